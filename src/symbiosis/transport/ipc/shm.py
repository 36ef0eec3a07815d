"""Per-client shared buffers for same-host transports: activations are written once into memory both
processes map, and only a small header crosses the socket.

- Host memory: the executor makes it, as an anonymous memory file (`memfd`) sealed against shrinking and
  growing, and hands the client a descriptor of it (`handoff.py`). The executor never opens a path a client
  names, the memory is in no directory another user could read, and nothing a client does to its file can
  take pages from under the executor's mapping (a shrunk file would kill the executor with SIGBUS).
- CUDA (client and executor on the same GPU): a device buffer the client allocates and the executor maps
  through a CUDA IPC handle.

A buffer is allocated once at attach (capacity: tokens x widest layer x element size) and replaced by a
larger one only when a call does not fit. Every call uses it from offset 0: the client writes its input,
the executor reads it, computes, and writes the output back in its place.

CUDA buffers are ordered on the GPU, without either CPU waiting, by flags in a second, tiny shared CUDA
buffer that each side's stream writes and the other's waits on (`streamops.py`, `client.py`).
"""

from __future__ import annotations

import base64
import fcntl
import os

import torch

from symbiosis.errors import BadCall

MAX_CACHED_VIEWS = 256
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memory(nbytes: int, name: str) -> int:
    """A descriptor of `nbytes` of anonymous shared memory that nobody can shrink or grow any more."""
    fd = os.memfd_create(f"symbiosis-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedBuffer:
    """A flat uint8 buffer shared by client and executor."""

    def __init__(self, tensor: torch.Tensor, description: dict):
        self.tensor = tensor
        self.description = description
        self._views: dict[tuple, torch.Tensor] = {}  # (dtype, *shape) -> view
        self.pinned = False
        # The stream this process orders buffer work on, looked up once (current_stream() costs ~20 us a call).
        self.stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @classmethod
    def sealed(cls, nbytes: int) -> tuple["SharedBuffer", int]:
        """The executor's side: a new host buffer, and the descriptor to hand its client (then close)."""
        fd = sealed_memory(nbytes, "buffer")
        try:
            return cls.from_fd(fd, nbytes), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def from_fd(cls, fd: int, nbytes: int) -> "SharedBuffer":
        """Map a host buffer from its descriptor (which may be closed afterwards). torch maps it and keeps the
        mapping for as long as any tensor views it (a call in flight may outlive the buffer's replacement)."""
        return cls(torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8),
                   {"kind": "cpu", "nbytes": nbytes})

    @classmethod
    def create_cuda(cls, nbytes: int, device: torch.device) -> "SharedBuffer":
        """A client's CUDA buffer on the executor's GPU, described by its IPC handle."""
        from torch.multiprocessing.reductions import reduce_tensor

        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _, args = reduce_tensor(tensor)
        (_, size, stride, offset, _, _, dev, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset,
         event_handle, event_sync) = args
        b64 = lambda b: None if b is None else base64.b64encode(b).decode()  # noqa: E731
        description = {"kind": "cuda", "nbytes": nbytes, "size": list(size), "stride": list(stride),
                       "offset": offset, "device": dev, "handle": b64(handle), "storage_bytes": storage_bytes,
                       "storage_offset": storage_offset, "ref_handle": b64(ref_handle), "ref_offset": ref_offset,
                       "event_handle": b64(event_handle), "event_sync": event_sync}
        return cls(tensor, description)

    @classmethod
    def open_cuda(cls, description: dict) -> "SharedBuffer":
        """The executor's side of a client's CUDA buffer."""
        try:
            if description.get("kind") != "cuda":
                raise BadCall("a client describes only CUDA buffers; the executor makes host buffers itself")
            return cls(_open_cuda(description), description)
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise BadCall(f"cannot map the client's CUDA buffer: {e}") from e

    def pin(self) -> None:
        """Page-lock a host buffer in this process (the executor's, when it computes on a GPU): copies between
        it and the GPU then run as DMA instead of through a staging copy. Left pageable if the driver refuses."""
        if self.tensor.is_cuda or self.pinned:
            return
        self.pinned = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)) == 0

    def view(self, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """[T, d] of `dtype` at offset 0. Views are kept by (dtype, shape): a call's input and output shapes
        recur every step, and making a view costs two tensor ops (~7 us a call on the executor's thread)."""
        key = (dtype, *shape)
        view = self._views.get(key)
        if view is not None:
            return view
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        if nbytes > self.nbytes:
            raise BadCall(f"a {list(shape)} {dtype} tensor ({nbytes} bytes) does not fit the shared buffer "
                          f"({self.nbytes} bytes)")
        if len(self._views) >= MAX_CACHED_VIEWS:  # many shapes (decoding with growing batches): start over
            self._views.clear()
        view = self._views[key] = self.tensor[:nbytes].view(dtype).view(shape)
        return view

    def close(self) -> None:
        """Drop this process's mapping (a host buffer's memory is freed when both processes have)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        self._views.clear()


def _open_cuda(d: dict) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    b64 = lambda s: None if s is None else base64.b64decode(s)  # noqa: E731
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), int(d["offset"]),
                               torch.UntypedStorage, torch.uint8, int(d["device"]), b64(d["handle"]),
                               int(d["storage_bytes"]), int(d["storage_offset"]), False, b64(d["ref_handle"]),
                               int(d["ref_offset"]), b64(d["event_handle"]), bool(d["event_sync"]))
