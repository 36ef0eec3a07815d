"""A client's request/reply channel to an executor: one ZeroMQ DEALER socket, a timeout on every request,
the tenant's token in the handshake (`auth.py`)."""

from __future__ import annotations

import itertools
import secrets
import threading
import time

import torch
import zmq

from symbiosis.errors import ExecutorUnavailable, Unauthorized
from symbiosis.transport import auth, wire

HANDSHAKE_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | \
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class Channel:
    """One DEALER socket with request/reply matching by id and a timeout on every request. It presents the
    client's token in ZeroMQ's handshake (`auth.py`); a handshake the executor refuses raises `Unauthorized`."""

    def __init__(self, url: str, timeout: float, token: str | None):
        self.url = url
        self.timeout = timeout
        self.token = token
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # a DEALER with no peer (not connected yet, or its handshake refused) blocks a send: for `timeout` at most
        self.socket.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout * 1000)))
        self.socket.setsockopt(zmq.IDENTITY, secrets.token_bytes(12))
        auth.secure_client(self.socket, self.token)
        self._monitor = self.socket.get_monitor_socket(HANDSHAKE_REFUSED)
        self._poller = zmq.Poller()
        self._poller.register(self.socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.socket.connect(self.url)

    def close(self) -> None:
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=0)

    def send(self, header: dict, *tensors: torch.Tensor) -> None:
        with self._lock:
            self._send(wire.encode(header, *tensors), header)

    def post(self, header: dict) -> int:
        """Send a request whose reply `take_replies` collects later; its id."""
        with self._lock:
            header = {**header, "id": next(self._ids)}
            self._send(wire.encode(header), header)
            return header["id"]

    def _next_reply(self, timeout_ms: int) -> tuple[dict, list] | None:
        """The next reply within `timeout_ms` (its header, its tensor frames), or None; a refused handshake raises."""
        events = dict(self._poller.poll(timeout_ms))
        if self._monitor in events:
            self._refused()
        if self.socket not in events:
            return None
        frames = self.socket.recv_multipart(copy=False)
        return (wire.decode_header(frames[0]) if frames else {}), frames[1:]

    def take_replies(self, pending: set[int], block: bool) -> dict | None:
        """Collect replies to posted requests (their ids in `pending`, removed as they come): those already here,
        or with `block` every one (the timeout at most between two). The first error reply among them, or None."""
        error = None
        with self._lock:
            deadline = time.monotonic() + self.timeout
            while pending:
                left = deadline - time.monotonic()
                got = self._next_reply(int(left * 1000) + 1 if block and left > 0 else 0)
                if got is None:
                    if not block:
                        return error
                    if left <= 0:
                        raise ExecutorUnavailable(f"executor at {self.url} did not answer {len(pending)} calls "
                                                  f"within {self.timeout:g}s (stopped, restarted or overloaded)")
                    continue
                reply = got[0]
                if reply.get("id") in pending:
                    pending.discard(reply["id"])
                    deadline = time.monotonic() + self.timeout
                    if not reply.get("ok") and error is None:
                        error = reply
        return error

    def _send(self, frames: list, header: dict) -> None:
        """Queue the frames; a socket that could not take them within the timeout has no executor to talk to."""
        try:
            wire.send(self.socket, frames)
        except zmq.Again:
            if self._monitor.poll(0):
                self._refused()
            self.close()  # nothing half-sent stays queued for a later executor
            self._open()
            raise ExecutorUnavailable(f"executor at {self.url} took no {header.get('op')!r} within {self.timeout:g}s "
                                      "(not reachable, stopped or overloaded)") from None

    def _refused(self):
        self._monitor.recv_multipart()
        raise Unauthorized("executor refused the client: missing or wrong token (ZeroMQ's handshake "
                           "failed: an executor with tokens needs one, one without takes none)")

    def request(self, header: dict, *tensors: torch.Tensor) -> tuple[dict, list]:
        with self._lock:
            header = {**header, "id": next(self._ids)}
            self._send(wire.encode(header, *tensors), header)
            deadline = time.monotonic() + self.timeout
            while (left := deadline - time.monotonic()) > 0:
                got = self._next_reply(int(left * 1000) + 1)
                if got is None:
                    continue
                reply, frames = got
                if reply.get("id") == header["id"]:
                    if not reply.get("ok"):
                        wire.raise_error(reply)
                    return reply, frames
                # a stale reply to an earlier, timed-out request: skip it
            # Nothing in time: drop the socket so queued requests are not replayed to a restarted executor.
            self.close()
            self._open()
        raise ExecutorUnavailable(f"executor at {self.url} did not answer {header['op']!r} within {self.timeout:g}s "
                                  "(stopped, restarted or overloaded)")
