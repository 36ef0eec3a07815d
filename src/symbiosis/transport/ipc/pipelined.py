"""A client process on the executor's GPU: pipelined calls.

A call queues, on the client's CUDA stream, the copy of its input into the shared buffer, a write of the
call's number into an input flag, a wait until the executor's stream has written that number into an output
flag, and the copy of the output; then it rings the executor and returns without waiting for anything
(`streamops.py`; the executor's side: `streams.py`). The client's CPU runs ahead like a plain model's, and
the round trip leaves its critical path. The buffer and flags are the client's own CUDA memory, which the
executor maps by IPC handle; the doorbell is handed over as for any `ipc://` client.

The executor's answers are collected where a result could be used: at the end of the model's forward and of
each backward pass (`synchronize`, called by the client: `client/build.py`, `client/virtual.py`), which
raise the first error among them. If the executor stops answering, the session lets its stream run past
every wait (what it computes from there on is garbage, and the next call or `synchronize` raises).

Only one session per process and device pipelines: sessions of one process share its CUDA stream, and the
executor's single stream may take their calls in another order than that stream queued them, so each could
end up waiting for the other's (`claim`). Later sessions wait for their answers (`session.IpcSession`).
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager

import torch

from symbiosis.errors import ExecutorUnavailable, SymbiosisError
from symbiosis.transport.ipc import handoff, streamops
from symbiosis.transport.ipc.doorbell import Doorbell
from symbiosis.transport.ipc.provision import FLAG_BYTES
from symbiosis.transport.ipc.session import IpcSession
from symbiosis.transport.ipc.shm import SharedBuffer
from symbiosis.transport.remote import INITIAL_BUFFER_BYTES, gpu_reached

_PIPELINED_DEVICES: set[int] = set()  # devices on which a session of this process pipelines
_PIPELINED_LOCK = threading.Lock()


def claim(device: torch.device) -> bool:
    """Take `device` for one pipelined session of this process (False if one has it)."""
    with _PIPELINED_LOCK:
        if device.index in _PIPELINED_DEVICES:
            return False
        _PIPELINED_DEVICES.add(device.index)
        return True


def give_back(index: int) -> None:
    with _PIPELINED_LOCK:
        _PIPELINED_DEVICES.discard(index)


class PipelinedSession(IpcSession):
    """Made by `RemoteExecutor.attach` once `claim(device)` succeeded."""

    pipelined = True

    def __init__(self, executor, fingerprint: str, name: str, device: torch.device):
        self.flags: SharedBuffer | None = None
        self._retired_flags: list[SharedBuffer] = []  # released flags a stream may still wait on: kept alive
        # Made before any stream could be stuck: making one then can hang.
        self._release_stream = streamops.side_stream(device.index)
        # The device is this session's until it is released, closed or collected.
        self._claim = weakref.finalize(self, give_back, device.index)
        super().__init__(executor, fingerprint, name, device)

    def _shared(self, buffer_bytes: int) -> dict | None:
        self.buffer = SharedBuffer.create_cuda(max(buffer_bytes, INITIAL_BUFFER_BYTES), self.device)
        self.flags = SharedBuffer.create_cuda(FLAG_BYTES, self.device)
        self.flags.tensor.zero_()
        self.flags.stream.synchronize()  # zeros before the executor's first wait reads them
        return {"cuda": self.buffer.description, "flags": self.flags.description}

    def _take_shared(self, reply: dict) -> None:
        self.link, fds = handoff.claim(reply["handoff"], bytes.fromhex(reply["ticket"]), 3, self.executor.timeout)
        self.doorbell = Doorbell(*fds)

    def _reset_transport(self) -> None:
        super()._reset_transport()
        self.flags = None

    def reconnect(self) -> None:
        self._release("reconnecting")  # the old executor will never answer what it still owed
        if not self._claim.alive and not claim(self.device):
            raise ExecutorUnavailable("another session of this process now pipelines on this device; make a new "
                                      "session instead of reconnecting this one")
        if not self._claim.alive:
            self._claim = weakref.finalize(self, give_back, self.device.index)
        super().reconnect()

    def _grow(self, wanted: int, at_least: int) -> SharedBuffer:
        """Our own CUDA memory, described to the executor."""
        new = SharedBuffer.create_cuda(wanted, self.device)
        try:
            self._request({"op": "buffer", "buffer": new.description})
        except BaseException:
            new.close()  # the executor still uses the old one
            raise
        return new

    def _lost(self, why: str) -> None:
        self._release(why)

    def _release(self, why: str) -> None:
        """Mark the session broken, and let the client's stream run past every wait on the executor's flag."""
        if self._broken is not None:
            return
        self._broken = why
        flags = self.flags
        # On a stream of its own: the client's stream may be stuck waiting.
        streamops.release(self._release_stream, flags.tensor.data_ptr() + 4, self.doorbell.seq,
                          flags.tensor.device.index)
        self._retired_flags.append(flags)
        self._claim()  # another session may pipeline on this device now; reconnect() claims again

    @contextmanager
    def _releasing(self):
        """An executor that stops answering would leave the stream waiting for flags that never come: release
        it before the error goes up."""
        try:
            yield
        except ExecutorUnavailable as e:
            self._release(str(e))
            raise

    def synchronize(self, gpu: bool = False) -> None:
        """Wait until the executor has answered every call made so far, raising the first error among them.
        With `gpu`, also until the client's GPU has run them: an executor that died meanwhile then raises
        `ExecutorUnavailable` here instead of hanging."""
        with self._call_lock, self._releasing():
            self._check_open()
            self._wait_answers()
            if not gpu:
                return
            done = torch.cuda.Event()
            done.record(self.buffer.stream)
            if not gpu_reached(done, self.executor.timeout):
                self._release(f"the executor's results did not reach the GPU within {self.executor.timeout:g}s")
            self._check_open()  # the heartbeat may have released the stream meanwhile: the results are lost

    def _call(self, op: str, layer_id: str, tensor: torch.Tensor, out_width: int, inference: bool) -> torch.Tensor:
        sent = tensor.detach().to(self.dtype)
        self.calls += 1
        self._check_open()
        rows, cols = sent.shape  # [T, d_in]: _spec has checked it
        with self._call_lock, self._releasing():
            self._ensure_capacity(rows * max(cols, out_width) * self.dtype.itemsize)
            self.buffer.view(self.dtype, [rows, cols]).copy_(sent)
            started = time.perf_counter()
            stream, flags, device = self.buffer.stream.cuda_stream, self.flags.tensor.data_ptr(), self.device.index
            streamops.write(stream, flags, self.doorbell.seq + 1, device)  # the input is in the buffer
            seq = self.doorbell.submit(op, layer_id, inference, self.dtype, (rows, cols), self.executor.timeout,
                                       self._still_attached)
            streamops.wait_geq(stream, flags + 4, seq, device)  # the output is in the buffer
            self.waited_s += time.perf_counter() - started
            # One copy out of the buffer (the next call reuses it), queued behind the wait.
            return self.buffer.view(self.dtype, [rows, out_width]).to(tensor.device, tensor.dtype, copy=True)

    def _before_detach(self) -> None:
        if self._broken is None:
            try:
                self.synchronize(gpu=True)  # the executor must not write into a freed buffer
            except SymbiosisError:
                pass  # an earlier call's error, or an executor gone: closing regardless

    def close(self) -> None:
        super().close()
        self._claim()

    # (The flags are not among what `_transport` closes: a released stream may still wait on them; they are
    # kept until the session is collected.)
