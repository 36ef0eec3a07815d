"""What the executor makes for an `ipc://` client: its shared memory, at attach and when its buffer grows.

A client asks for a host buffer of some size (the executor makes it, sealed, `shm.py`, and it is handed over
with the doorbell's descriptors, `handoff.py`), or, on the executor's GPU, describes its own CUDA buffer and
flags by IPC handle. Sizes are checked before anything is made: no buffer is larger than the largest call
this executor accepts needs.
"""

from __future__ import annotations

import os

import torch

from symbiosis.errors import BadCall
from symbiosis.transport.ipc import handoff
from symbiosis.transport.ipc.doorbell import Doorbell
from symbiosis.transport.ipc.shm import SharedBuffer

FLAG_BYTES = 8  # int32 [input seq (the client writes), output seq (the executor writes)]


class Provisioner:
    def __init__(self, device: torch.device, max_buffer_bytes: int, pipelines: bool):
        self.device = device
        self.max_buffer_bytes = max_buffer_bytes
        self.pipelines = pipelines  # the executor's stream can queue stream memory operations

    def buffer_bytes(self, nbytes, at_least=None) -> int:
        """A host buffer's size, checked before anything is made: at most what the largest call needs."""
        at_least = at_least if at_least is not None else nbytes
        if type(nbytes) is not int or type(at_least) is not int:  # noqa: E721 -- JSON integers: not bools, floats
            raise BadCall(f"shared buffer size must be a number of bytes, not {str(nbytes)[:40]!r} / "
                          f"{str(at_least)[:40]!r}")
        if at_least > self.max_buffer_bytes or at_least < 0:
            raise BadCall(f"a shared buffer of {at_least} bytes is more than this executor's largest call needs "
                          f"({self.max_buffer_bytes} bytes); send fewer tokens per call")
        return max(4096, at_least, min(nbytes, self.max_buffer_bytes))

    def host_buffer(self, nbytes: int) -> tuple[SharedBuffer, int]:
        """A sealed host buffer, and the descriptor to hand over (then close)."""
        buffer, fd = SharedBuffer.sealed(nbytes)
        if self.device.type == "cuda":
            buffer.pin()  # a host buffer of a CPU client: DMA to and from the GPU
        return buffer, fd

    def cuda_buffer(self, description: dict) -> SharedBuffer:
        if not self.pipelines:
            raise BadCall("this executor cannot queue CUDA stream memory operations: attach with a host buffer")
        if self.device.type != "cuda":
            raise BadCall(f"this executor computes on {self.device}: attach with a host buffer")
        return SharedBuffer.open_cuda(description, self.device)

    def attach(self, shared) -> tuple[SharedBuffer, Doorbell, SharedBuffer | None, list[int]]:
        """A client's shared memory: (buffer, doorbell, flags or None, descriptors to hand it); nothing is left
        open if anything is refused."""
        if not isinstance(shared, dict):
            raise BadCall("malformed attach: 'shared' must be an object")
        made, fds = [], []
        try:
            flags = None
            if "cuda" in shared:
                buffer = self.cuda_buffer(shared["cuda"])
                made.append(buffer)
                flags = self.cuda_buffer(shared.get("flags") or {})
                made.append(flags)
                if flags.nbytes < FLAG_BYTES:
                    raise BadCall(f"pipelined calls need CUDA flags of {FLAG_BYTES} bytes")
            else:
                buffer, fd = self.host_buffer(self.buffer_bytes(shared.get("nbytes"), at_least=0))
                made.append(buffer)
                fds.append(fd)
            doorbell, doorbell_fds = Doorbell.pair()
            made.append(doorbell)
            return buffer, doorbell, flags, doorbell_fds + fds
        except BaseException:
            for thing in made:
                thing.close()
            for fd in fds:
                os.close(fd)
            raise

    def grow(self, client, header: dict) -> int:
        """A larger buffer for a client (its record: `buffer`, `flags`, `link`): a pipelined client's own CUDA
        memory, mapped here; else host memory made here and handed over before the reply. Returns its size."""
        if client.buffer is None or client.link is None:
            raise BadCall("this client has no shared buffer (attached without one, or not handed over yet)")
        if client.flags is not None:
            new = self.cuda_buffer(header.get("buffer") or {})
        else:
            new, fd = self.host_buffer(self.buffer_bytes(header.get("nbytes"), header.get("at_least")))
            try:
                handoff.send(client.link, [fd])
            except BaseException:
                new.close()
                raise
            finally:
                os.close(fd)
        client.buffer.close()
        client.buffer = new
        return new.nbytes
