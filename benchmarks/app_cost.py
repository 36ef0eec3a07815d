"""The service's application alone, per request and per token, with no network and no engine: the real app
(`symbiosis serve`'s, on the tiny model) called as ASGI on one event loop, for streamed completions of a
`--prompt-tokens` token-id prompt, answered by a generator that puts its tokens at once. Relayed: as behind a front
process (the stream's tokens handed to the front as (choice, text)); in process: each token's SSE chunk made here.
It prints the process's CPU a request at 1 token and at `--tokens`, and what a token adds: the Python that the
HTTP layer puts beside the engine's thread in its process (docs/PERFORMANCE.md section 9).

    python benchmarks/app_cost.py --tokens 64 --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from common import BENCH_KEY, emit, tiny_service


class _AtOnce:
    """A generator whose requests get their `tokens` tokens, then their end, as they are submitted."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def submit(self, prompt, params, adapter=None, events=None):
        from symbiosis.engine import Finished, Token

        for _ in range(self.tokens):
            events.put(Token(id=7, text=" x"))
        events.put(Finished("length"))
        return self

    def cancel(self) -> None:
        pass


class _Front:
    """What the bridge gives the app as `symbiosis.chunks` (serve/bridge.py), counting what it is given."""

    def __init__(self):
        self.parts = 0

    def chunk_format(self, prefix: str, middle: str, suffix: str) -> None:
        pass

    def chunk(self, index: int, text: str) -> None:
        self.parts += 1

    def body(self, data: bytes) -> None:
        self.parts += 1


async def _request(app, body: bytes, relayed: bool) -> None:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"authorization", f"Bearer {BENCH_KEY}".encode()), (b"content-type", b"application/json")],
             "client": None, "server": None, "state": {}, "extensions": {"symbiosis.chunks": _Front()} if relayed else {}}
    answered, body_sent = asyncio.Event(), []

    async def receive():
        if not body_sent:
            body_sent.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        pass
    await app(scope, receive, send)
    answered.set()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64, help="tokens a request, beside 1")
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--requests", type=int, default=500, help="timed requests a configuration")
    args = parser.parse_args()

    from symbiosis.serve.app import create_app

    service = tiny_service("app-cost-", 4096)
    app = create_app(service)
    body = json.dumps({"model": service.base_name, "prompt": list(range(5, 5 + args.prompt_tokens)),
                       "max_tokens": max(args.tokens, 1), "stream": True}).encode()

    async def cpu_a_request(tokens: int, relayed: bool) -> float:
        service.generator_for = lambda adapter: _AtOnce(tokens)
        for _ in range(50):  # warm
            await _request(app, body, relayed)
        began = time.process_time()
        for _ in range(args.requests):
            await _request(app, body, relayed)
        return 1e3 * (time.process_time() - began) / args.requests

    for relayed in (False, True):
        one, many = (asyncio.run(cpu_a_request(tokens, relayed)) for tokens in (1, args.tokens))
        emit(bench="app_cost", relayed=relayed, prompt_tokens=args.prompt_tokens, tokens=args.tokens,
             requests=args.requests, cpu_ms_a_request_1_token=one, cpu_ms_a_request=many,
             cpu_ms_a_token=(many - one) / max(1, args.tokens - 1))
    service.close()


if __name__ == "__main__":
    main()
