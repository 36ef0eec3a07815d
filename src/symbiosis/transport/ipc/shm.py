"""Per-client shared buffers for same-host transports: activations are written once into memory both
processes map, and only a small header crosses the socket.

- Host memory: the executor makes it, as an anonymous memory file (`memfd`) sealed against shrinking and
  growing, and hands the client a descriptor of it (`handoff.py`). The executor never opens a path a client
  names, the memory is in no directory another user could read, and nothing a client does to its file can
  take pages from under the executor's mapping (a shrunk file would kill the executor with SIGBUS).
- CUDA (client and executor on the same GPU): a device buffer the client allocates and the executor maps
  through a CUDA IPC handle. The executor trusts nothing else the client's description says: the mapped
  allocation's own size and device, asked of the driver, bound what the executor will touch (`_open_cuda`).

A buffer is allocated once at attach (capacity: tokens x widest layer x element size) and replaced by a
larger one only when a call does not fit. Every call uses it from offset 0: the client writes its input,
the executor reads it, computes, and writes the output back in its place.

CUDA buffers are ordered on the GPU, without either CPU waiting, by flags in a second, tiny shared CUDA
buffer that each side's stream writes and the other's waits on (`streamops.py`, `client.py`).
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import functools
import os
import secrets

import torch

from symbiosis.errors import BadCall

MAX_CACHED_VIEWS = 256
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t
# torch's receiving side decrements, when it drops a mapping, an int64 in a shared-memory file that the sender names
# at an offset the sender names (the sender frees the block at zero). A client naming another's counter file, or an
# offset past its end, would have the executor write there. The executor names instead a file nobody has (a name
# made here, unguessable): torch's decrement then finds nothing and does nothing. The cost is the client's: a buffer
# it replaced stays allocated until it exits (torch's "limbo"), which its growth bounds.
NO_REF_COUNTER = f"/symbiosis-no-counter-{secrets.token_hex(16)}".encode()
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


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
    def open_cuda(cls, description: dict, device: torch.device) -> "SharedBuffer":
        """The executor's side of a client's CUDA buffer, which must be on `device`."""
        try:
            if not isinstance(description, dict) or description.get("kind") != "cuda":
                raise BadCall("a client describes only CUDA buffers; the executor makes host buffers itself")
            return cls(_open_cuda(description, device), description)
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


def _open_cuda(d: dict, device: torch.device) -> torch.Tensor:
    """Map a client's CUDA buffer: `nbytes` at `storage_offset` of the allocation its IPC `handle` names. Of the
    description only the handle, the offset and the sizes are used, and the sizes only once the driver has said
    how large the mapped allocation is and on which device it lives (a size past it would have the executor read
    and write beyond the client's memory: a fault that ends every tenant's calls). No ref counter of the client's
    (NO_REF_COUNTER) and no event: a new buffer has no write pending that the executor could overtake (torch.empty
    launches nothing), and calls are ordered by the flags (`streamops.py`)."""
    nbytes, storage_bytes, storage_offset = (_count(d, key) for key in ("nbytes", "storage_bytes", "storage_offset"))
    handle = base64.b64decode(d["handle"], validate=True)
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
    if not 0 < nbytes <= storage_bytes:
        raise ValueError(f"a buffer of {nbytes} bytes in a storage of {storage_bytes}")
    torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(index, handle, storage_bytes, storage_offset,
                                                    NO_REF_COUNTER, 0, b"", False)
    pointer = storage.data_ptr()
    base, size, ordinal = _allocation(pointer)
    if ordinal != index:
        raise ValueError(f"the buffer is on cuda:{ordinal} (as this process numbers devices), not on the "
                         f"executor's {device}; use a host buffer")
    if pointer + storage_bytes > base + size:
        raise ValueError(f"the description claims {storage_bytes} bytes at offset {pointer - base} of an "
                         f"allocation of {size} bytes")
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage, 0, (nbytes,), (1,))


def _count(d: dict, key: str) -> int:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a number of bytes, not {str(value)[:40]!r}")
    return value


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _allocation(pointer: int) -> tuple[int, int, int]:
    """(base, size, device ordinal) of the device allocation holding `pointer`, as the driver knows it."""
    driver, base, size, ordinal = _driver(), ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_int()
    status = driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer))
    if status == 0:
        status = driver.cuPointerGetAttribute(ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                              ctypes.c_uint64(pointer))
    if status != 0:
        raise ValueError(f"the CUDA driver cannot describe the mapped buffer (CUresult {status})")
    return base.value, size.value, ordinal.value
