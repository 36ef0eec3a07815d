"""The HTTP layer's own cost, alone: the service's real application (`symbiosis serve`'s, on the tiny model) with a
generator that costs nothing in place of the engine, a thread that hands every open request one token each
`--step-ms`, as the engine's decode steps do. `--streams` streaming completions at once, sent by client processes
(serve.py's); what the service's process then spends is the HTTP layer's. For each layout (`--http-processes`:
0, the app's own event loop; N, behind N front processes, symbiosis serve --http-processes N) it prints that
loop's CPU a token, the process's and each front's, and the tokens' latencies. On a CPU, without a GPU: the number
to drive down where the engine's thread and the HTTP layer share one interpreter (docs/PERFORMANCE.md section 9).

    python benchmarks/http_layer.py --streams 64 --tokens 128 --step-ms 15 --http-processes 0,1,2
"""

from __future__ import annotations

import argparse
import threading
import time

from common import BENCH_KEY, emit, http_layouts, process_cpu_s, tiny_service
from serve import run_http, serve_on_loopback, thread_cpu_s


class _Handle:
    def __init__(self, steps: "FreeSteps", events, max_tokens: int):
        self.steps, self.events, self.left = steps, events, max_tokens

    def cancel(self) -> None:
        with self.steps.lock:
            if self in self.steps.open:
                self.steps.open.remove(self)


class FreeSteps:
    """A generator (the engine's `submit`) whose steps cost nothing: every `step_s` each open request gets one
    token (its events put from this thread, as the engine's thread puts them), then `Finished` after its
    max_tokens."""

    def __init__(self, step_s: float):
        self.step_s, self.open, self.lock = step_s, [], threading.Lock()
        self.steps = 0
        threading.Thread(target=self._run, name="free-steps", daemon=True).start()

    def submit(self, prompt, params, adapter=None, events=None):
        handle = _Handle(self, events, params.max_tokens)
        with self.lock:
            self.open.append(handle)
        return handle

    def _run(self) -> None:
        from symbiosis.engine import Finished, Token

        while True:
            time.sleep(self.step_s)
            with self.lock:
                stepping = list(self.open)
            for handle in stepping:
                handle.left -= 1
                handle.events.put(Token(id=7, text=" x"))
                if handle.left == 0:
                    handle.cancel()
                    handle.events.put(Finished("length"))
            self.steps += bool(stepping)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64, help="streaming completions at once")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each")
    parser.add_argument("--step-ms", type=float, default=15.0, help="a step's time: every open stream gets a token")
    parser.add_argument("--http-processes", default="0,1,2")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="each layout's runs, alternated")
    args = parser.parse_args()

    service, key = tiny_service("http-layer-", 4 * args.streams), BENCH_KEY
    steps = FreeSteps(args.step_ms / 1e3)
    service.generator_for = lambda adapter: steps  # the HTTP layer's cost alone: no engine behind it
    server, url, _, loop_thread = serve_on_loopback(service, "bench", [])
    layouts, close_all = http_layouts(service, args.http_processes, server, url, loop_thread)
    names = [service.base_name]
    jobs = [{"prompt": [5, 6, 7], "max_tokens": args.tokens, "adapter": 0} for _ in range(args.streams)]
    times = [0.01 * i for i in range(args.streams)]  # all open within ~the first steps
    for warm_url, _, _ in layouts.values():
        run_http(warm_url, key, jobs[:8], times[:8], names, 1)
    for round_ in range(args.rounds):
        for count, (layout_url, thread, pids) in layouts.items():
            loop_cpu, process_cpu = thread_cpu_s(thread), time.process_time()
            fronts_cpu = [process_cpu_s(pid) for pid in pids]
            result = run_http(layout_url, key, jobs, times, names, args.client_processes)
            wall = result["generated"] / result["tokens_per_s"]
            emit(bench="http_layer", http_processes=count, round=round_, streams=args.streams, tokens=args.tokens,
                 step_ms=args.step_ms, **result,
                 loop_cpu_ms_per_token=1e3 * (thread_cpu_s(thread) - loop_cpu) / max(1, result["generated"]),
                 process_cpu_ms_per_token=1e3 * (time.process_time() - process_cpu) / max(1, result["generated"]),
                 front_cores=[round((process_cpu_s(pid) - before) / wall, 2) for pid, before in zip(pids, fronts_cpu)])
    close_all()


if __name__ == "__main__":
    main()
