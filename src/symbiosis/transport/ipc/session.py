"""A client of an executor on the same host (`ipc://`) whose calls wait for their answers (a client on the
CPU, on another GPU, or a second session of a process on the executor's GPU).

Its shared memory is the executor's making, handed over at attach (`handoff.py`): a host buffer the tensors
are written into and read back from, and a doorbell (`doorbell.py`) that carries each call's op, layer and
shape. No socket is on the call path.
"""

from __future__ import annotations

import os
import time

import torch

from symbiosis.transport.ipc import handoff
from symbiosis.transport.ipc.doorbell import Doorbell
from symbiosis.transport.ipc.shm import SharedBuffer
from symbiosis.transport.remote import INITIAL_BUFFER_BYTES, RemoteSession


class IpcSession(RemoteSession):
    buffer: SharedBuffer | None = None
    doorbell: Doorbell | None = None

    def _shared(self, buffer_bytes: int) -> dict | None:
        return {"nbytes": max(buffer_bytes, INITIAL_BUFFER_BYTES)}

    def _take_shared(self, reply: dict) -> None:
        self.link, fds = handoff.claim(reply["handoff"], bytes.fromhex(reply["ticket"]), 4, self.executor.timeout)
        self.doorbell = Doorbell(*fds[:3])
        self.buffer = SharedBuffer.from_fd(fds[3], int(reply["buffer_bytes"]))
        os.close(fds[3])

    def _transport(self) -> list:
        return [thing for thing in (self.buffer, self.doorbell, self.link) if thing is not None]

    def _buffer_bytes(self) -> int:
        return self.buffer.nbytes if self.buffer is not None else 0

    def _reset_transport(self) -> None:
        self.buffer = self.doorbell = self.link = None

    def _grow(self, wanted: int, at_least: int) -> SharedBuffer:
        """A larger buffer: the executor makes it and hands it over before it replies."""
        reply, _ = self._request({"op": "buffer", "nbytes": wanted, "at_least": at_least})
        (fd,) = handoff.receive(self.link, 1)
        try:
            return SharedBuffer.from_fd(fd, int(reply["nbytes"]))
        finally:
            os.close(fd)

    def _ensure_capacity(self, nbytes: int) -> None:
        if nbytes <= self.buffer.nbytes:
            return
        old = self.buffer
        self._wait_answers()
        if old.stream is not None:
            old.stream.synchronize()  # nothing may still use the old one
        self.buffer = self._grow(max(nbytes, old.nbytes * 3 // 2), nbytes)
        old.close()

    def _wait_answers(self) -> None:
        """Until every call made is answered; a failure is reported as an earlier call's."""
        self.doorbell.wait_answered(self.doorbell.seq, self.executor.timeout, self._still_attached)
        self.doorbell.raise_error()

    def _call(self, op: str, layer_id: str, tensor: torch.Tensor, out_width: int, inference: bool) -> torch.Tensor:
        sent = tensor.detach().to(self.dtype)
        self.calls += 1
        self._check_open()
        rows, cols = sent.shape  # [T, d_in]: _spec has checked it
        with self._call_lock:
            self._ensure_capacity(rows * max(cols, out_width) * self.dtype.itemsize)
            self.buffer.view(self.dtype, [rows, cols]).copy_(sent)
            started = time.perf_counter()
            seq = self.doorbell.submit(op, layer_id, inference, self.dtype, (rows, cols), self.executor.timeout,
                                       self._still_attached)
            self.doorbell.wait(seq, self.executor.timeout, self._still_attached)
            self.waited_s += time.perf_counter() - started
            # One copy out of the buffer (the next call reuses it), cast on the way if need be.
            return self.buffer.view(self.dtype, [rows, out_width]).to(tensor.device, tensor.dtype, copy=True)
