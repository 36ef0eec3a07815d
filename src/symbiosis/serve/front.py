"""An HTTP front process of `symbiosis serve --http-processes N` (the service's side and the wire: bridge.py).

Each front runs uvicorn on the service's listening socket (inherited: the kernel hands each connection to one
front), reads a request's body (bounded), forwards it to the service over ZeroMQ, and writes the response's
messages as they come back: the per-connection work of HTTP (parsing, each streamed chunk's write) runs on the
front's own interpreter, not beside the engine's thread. The service answers everything (keys, limits, errors):
a front holds no state but its requests in flight. The service stops its fronts when it stops (SIGTERM: uvicorn's
graceful shutdown); a service that dies otherwise takes them with it (Linux: the parent's death kills them).

    python -m symbiosis.serve.front --fd FD --service ipc://PATH --max-body-bytes N --parent PID
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import itertools
import json
import os
import signal
import socket
import subprocess
import sys

import zmq
import zmq.asyncio

from symbiosis.serve.bridge import decode_headers, encode_headers
from symbiosis.serve.errors import ApiError


class Front:
    """The front's ASGI application (`url`: the service's bridge)."""

    def __init__(self, url: str, max_body_bytes: int):
        self.url, self.max_body_bytes = url, max_body_bytes
        self.ids = itertools.count()
        self.pending: dict[int, asyncio.Queue] = {}
        self.formats: dict[int, list[bytes]] = {}  # request -> its token chunks' (prefix, middle, suffix)
        self.socket = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":  # (no websockets here)
            return
        body = await self._body(receive)
        if body is None:  # over the limit, or the client went while sending it
            error = ApiError(413, f"the request body is over {self.max_body_bytes} bytes")
            return await error.response()(scope, receive, send)
        request_id, replies = next(self.ids), asyncio.Queue()
        self.pending[request_id] = replies
        header = {"id": request_id, "method": scope["method"], "path": scope["path"],
                  "query": scope.get("query_string", b"").decode("latin-1"), "headers": encode_headers(scope["headers"])}
        watcher = asyncio.ensure_future(self._watch(receive, request_id))
        finished = False
        try:
            await self.socket.send_multipart([b"request", json.dumps(header).encode(), body])
            while not finished:
                message = await replies.get()
                if message is None:  # the client went
                    return
                finished = message["type"] == "http.response.body" and not message["more_body"]
                await send(message)
        finally:
            watcher.cancel()
            del self.pending[request_id]
            self.formats.pop(request_id, None)
            if not finished:  # the client went, or the front stops: the service cancels what it runs for it
                await self.socket.send_multipart([b"gone", json.dumps({"id": request_id}).encode()])

    async def _body(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _watch(self, receive, request_id: int) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if (replies := self.pending.get(request_id)) is not None:
            replies.put_nowait(None)

    async def _dispatch(self) -> None:
        """The service's bunches, each message to its request's queue (a request's body messages of one bunch as
        one: one write of a decode step's tokens)."""
        while True:
            frames = await self.socket.recv_multipart()
            bunch: dict[int, list[dict]] = {}
            for request_id, message in self._messages(json.loads(frames[1]), frames[2]):
                messages = bunch.setdefault(request_id, [])
                last = messages[-1] if messages else None
                if last is not None and message["type"] == last["type"] == "http.response.body" and last["more_body"]:
                    last["body"] += message["body"]
                    last["more_body"] = message["more_body"]
                else:
                    messages.append(message)
            for request_id, messages in bunch.items():
                if (replies := self.pending.get(request_id)) is not None:
                    for message in messages:
                        replies.put_nowait(message)

    def _messages(self, items: list, bodies: bytes):
        """(request id, ASGI message) for each of a bunch's items (the wire: bridge.py)."""
        offset = 0
        for kind, request_id, *rest in items:
            if kind == "s":
                yield request_id, {"type": "http.response.start", "status": rest[0], "headers": decode_headers(rest[1])}
            elif kind == "b":
                yield request_id, {"type": "http.response.body", "body": bodies[offset:offset + rest[1]],
                                   "more_body": rest[0]}
                offset += rest[1]
            elif kind == "f" and request_id in self.pending:
                self.formats[request_id] = [part.encode() for part in rest]
            elif kind == "t" and (form := self.formats.get(request_id)) is not None:
                body = b"%s%d%s%s%s" % (form[0], rest[0], form[1], json.dumps(rest[1]).encode(), form[2])
                yield request_id, {"type": "http.response.body", "body": body, "more_body": True}

    async def _lifespan(self, receive, send) -> None:
        dispatching = None
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
                self.socket.setsockopt(zmq.LINGER, 0)
                self.socket.setsockopt(zmq.SNDHWM, 0)
                self.socket.setsockopt(zmq.RCVHWM, 0)
                self.socket.connect(self.url)
                dispatching = asyncio.ensure_future(self._dispatch())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if dispatching is not None:
                    dispatching.cancel()
                self.socket.close(0)
                await send({"type": "lifespan.shutdown.complete"})
                return


def start_fronts(listener: socket.socket, service_url: str, count: int, max_body_bytes: int) -> list[subprocess.Popen]:
    """`count` front processes accepting on `listener` (inherited) and forwarding to the bridge at `service_url`."""
    return [subprocess.Popen([sys.executable, "-m", "symbiosis.serve.front", "--fd", str(listener.fileno()),
                              "--service", service_url, "--max-body-bytes", str(max_body_bytes),
                              "--parent", str(os.getpid())],
                             pass_fds=[listener.fileno()]) for _ in range(count)]


def stop_fronts(fronts: list[subprocess.Popen], timeout: float = 10.0) -> None:
    for front in fronts:
        front.terminate()
    for front in fronts:
        try:
            front.wait(timeout)
        except subprocess.TimeoutExpired:
            front.kill()


def _end_with_parent(parent: int) -> None:
    """Kill this process when its parent (the service, pid `parent`) dies without stopping it (Linux's
    PR_SET_PDEATHSIG). SIGKILL, not SIGTERM: the requests in flight cannot be answered by a dead service anyway, and
    the end then does not hang on uvicorn's graceful shutdown.

    The kernel only signals a death that comes after the request: a service killed while this front was still
    importing (seconds on a loaded machine) has already left it to init, so the parent is checked once more after
    asking, and a front that finds itself orphaned ends at once (a front once outlived its SIGKILLed service so)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the service terminates its fronts when it stops
        pass
    if os.getppid() != parent:
        raise SystemExit(f"symbiosis.serve.front: the service (pid {parent}) ended before this front started")


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="symbiosis.serve.front", description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="the service's listening socket, inherited")
    parser.add_argument("--service", required=True, help="the service's bridge (ipc://...)")
    parser.add_argument("--max-body-bytes", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True, help="the service's pid: this front ends with it")
    args = parser.parse_args(argv)
    _end_with_parent(args.parent)
    listener = socket.socket(fileno=args.fd)  # (its family and type read from the socket itself)
    config = uvicorn.Config(Front(args.service, args.max_body_bytes), log_level="warning", access_log=False,
                            lifespan="on")
    uvicorn.Server(config).run(sockets=[listener])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
