"""The service's side of its HTTP front processes (`symbiosis serve --http-processes N`; the fronts: front.py).

In one process, the HTTP layer's Python (parsing, each streamed token's write to its socket) takes turns with the
engine's thread on one GIL, and every decode step waits for it (docs/PERFORMANCE.md section 9). With fronts, HTTP
lives in processes of their own; this process runs the same ASGI application, unchanged, on requests the fronts
forward over one ZeroMQ socket, and sends the responses' messages back in bunches: everything that one turn of
the event loop produced for a front (at saturation, a decode step's chunks of every stream) goes as ONE message.

The wire (ZeroMQ multipart; JSON and raw bytes, nothing unpickled):
- front -> service: [b"request", JSON {id, method, path, query, headers: [[name, value]...]}, body] (the body
  whole: the front reads it, bounded); [b"gone", JSON {id}] (the HTTP client went: the app's `receive()` then
  says `http.disconnect`, which cancels a generation as a direct client's disconnect does).
- service -> front: [b"bunch", JSON [item, ...], bodies], the items in order:
  - ["s", id, status, headers]: a response's start;
  - ["b", id, more, length]: one of its body messages (`more`: whether more follow; its `length` bytes the next
    ones of `bodies`, every body message's bytes joined in order: one frame, not one a message, which cost the
    service a third of its loop's time at 65 streams);
  - ["f", id, prefix, middle, suffix]: the format of the response's token chunks, then ["t", id, index, text]: a
    chunk of the body, prefix + index + middle + text as a JSON string + suffix, which the front writes: a
    streamed completion's tokens, relayed as they come (`symbiosis.chunks` in the app's scope: `_Exchange`), and
    their JSON chunks built in the front, not here beside the engine's thread.
  A front joins the body messages of one request that come in one bunch into one write.
Names and values of headers travel as latin-1 strings (HTTP's own charset for them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import defaultdict
from collections.abc import Callable

import zmq
import zmq.asyncio

from symbiosis.serve.errors import ApiError

log = logging.getLogger("symbiosis.serve")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The bridge's loop: uvloop's where it is installed (as uvicorn's `loop="auto"` takes it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def encode_headers(headers) -> list[list[str]]:
    return [[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers]


def decode_headers(headers) -> list[tuple[bytes, bytes]]:
    if not isinstance(headers, list) or not all(isinstance(h, list) and len(h) == 2 and all(isinstance(p, str)
                                                                                          for p in h) for h in headers):
        raise ValueError("headers must be [name, value] string pairs")
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]


class _Exchange:
    """One forwarded request: the app's `receive` and `send` for it, and (as `symbiosis.chunks` in the scope's
    extensions) what relays a stream's token chunks to the front: `chunk_format`, `chunk`, `body`."""

    def __init__(self, host: "AsgiHost", front: bytes, request_id: int, body: bytes):
        self.host, self.front, self.id, self.request_body = host, front, request_id, body
        self.gone = asyncio.Event()
        self.started = self.finished = False

    async def receive(self) -> dict:
        if self.request_body is not None:
            body, self.request_body = self.request_body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.finished or self.gone.is_set():
            return
        if message["type"] == "http.response.start":
            self.started = True
            self.host.post(self.front, ["s", self.id, int(message["status"]),
                                        encode_headers(message.get("headers", ()))])
        elif message["type"] == "http.response.body":
            self._post_body(bytes(message.get("body", b"")), bool(message.get("more_body", False)))

    def _post_body(self, data: bytes, more: bool) -> None:
        self.finished = not more
        self.host.post(self.front, ["b", self.id, more, len(data)], data)

    def chunk_format(self, prefix: str, middle: str, suffix: str) -> None:
        """How the front writes this response's `chunk`s (after its start, before its first chunk)."""
        self.host.post(self.front, ["f", self.id, prefix, middle, suffix])

    def chunk(self, index: int, text: str) -> None:
        """A chunk of the body, as `chunk_format` says, from an index and a text."""
        if not (self.finished or self.gone.is_set()):
            self.host.post(self.front, ["t", self.id, index, text])

    def body(self, data: bytes) -> None:
        """A part of the body (more follows), in order with the chunks (`send`'s, from a plain function)."""
        if not (self.finished or self.gone.is_set()):
            self._post_body(data, more=True)

    def end(self) -> None:
        """After the app returned: a response it left unfinished is finished (a 500 if it never started)."""
        if self.gone.is_set() or self.finished:
            return
        if not self.started:
            body = json.dumps(ApiError(500, "the server failed to answer this request; it was logged").body()).encode()
            self.host.post(self.front, ["s", self.id, 500, [["content-type", "application/json"]]])
            self._post_body(body, more=False)
        else:
            self._post_body(b"", more=False)


class AsgiHost:
    """Runs `app` on the requests that front processes send to `url` (a ROUTER socket bound here), on the running
    event loop: `await host.serve(stop)` until `stop` is set."""

    def __init__(self, app, url: str):
        self.app, self.url = app, url
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # a front's bunches are never dropped (each stream's tokens are bounded)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.bind(url)
        self._exchanges: dict[tuple[bytes, int], _Exchange] = {}
        self._outbox: dict[bytes, list] = defaultdict(list)  # front -> [(item, body or None)] until the next flush
        self._flush_scheduled = False

    def post(self, front: bytes, item: list, body: bytes | None = None) -> None:
        """Queue a response message for `front`; every message queued in this turn of the loop leaves as one."""
        self._outbox[front].append((item, body))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, defaultdict(list)
        for front, items in outbox.items():
            frames = [front, b"bunch", json.dumps([item for item, _ in items], separators=(",", ":")).encode(),
                      b"".join(body for _, body in items if body is not None)]
            try:
                self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # the front is gone (its process ended): its requests are abandoned
                log.warning("a front's responses could not be sent (%s); its requests are dropped", e)

    async def serve(self, stop: asyncio.Event) -> None:
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                receiving = asyncio.ensure_future(self.socket.recv_multipart())
                done, _ = await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if receiving not in done:
                    receiving.cancel()
                    break
                self._take(receiving.result())
        finally:
            stopping.cancel()
            for exchange in self._exchanges.values():
                exchange.gone.set()
            self.socket.close(0)
            self.context.term()

    def serve_in_thread(self) -> tuple[threading.Thread, Callable[[], None]]:
        """`serve` on an event loop of its own, on a thread of its own (the service's loop where something else has
        this process's main thread: tests, benchmarks): (that thread, what stops it)."""
        loop, stop = new_event_loop(), asyncio.Event()
        thread = threading.Thread(target=loop.run_until_complete, args=(self.serve(stop),), name="bridge",
                                  daemon=True)
        thread.start()

        def stopping() -> None:
            loop.call_soon_threadsafe(stop.set)
            thread.join(30)
        return thread, stopping

    def _take(self, frames: list[bytes]) -> None:
        try:
            front, kind, header = frames[0], frames[1], json.loads(frames[2])
            key = (front, int(header["id"]))
            if kind == b"gone":
                if (exchange := self._exchanges.get(key)) is not None:
                    exchange.gone.set()
                return
            if kind != b"request" or len(frames) != 4 or key in self._exchanges:
                raise ValueError(f"unexpected message {kind!r}")
            scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                     "method": str(header["method"]), "scheme": "http", "path": str(header["path"]),
                     "raw_path": str(header["path"]).encode("latin-1"), "root_path": "",
                     "query_string": str(header.get("query", "")).encode("latin-1"),
                     "headers": decode_headers(header["headers"]), "client": None, "server": None, "state": {}}
            exchange = _Exchange(self, front, key[1], frames[3])
            scope["extensions"] = {"symbiosis.chunks": exchange}
        except (ValueError, KeyError, TypeError, IndexError, UnicodeError) as e:  # fronts are ours: a bug, logged
            log.error("a front sent a malformed message: %s", e)
            return
        self._exchanges[key] = exchange
        asyncio.get_running_loop().create_task(self._run(key, exchange, scope))

    async def _run(self, key, exchange: _Exchange, scope: dict) -> None:
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception:  # noqa: BLE001 -- the app answers its errors itself; whatever escapes is logged
            log.exception("unexpected error on %s", scope["path"])
        finally:
            exchange.end()
            del self._exchanges[key]
