"""Per-client shared buffers for same-host transports: activations are written once into memory both
processes map, and only a small header crosses the socket.

- Host memory: the executor makes it, as an anonymous memory file (`memfd`) sealed against shrinking and
  growing, and hands the client a descriptor of it (`handoff.py`). The executor never opens a path a client
  names, the memory is in no directory another user could read, and nothing a client does to its file can
  take pages from under the executor's mapping (a shrunk file would kill the executor with SIGBUS).
- CUDA (client and executor on the same GPU): a device buffer the client allocates with the driver (`DeviceMemory`)
  and the executor maps through its CUDA IPC handle. The executor takes no more than that handle from the client's
  description: the mapped allocation's own size and device, asked of the driver, bound what it will touch
  (`_open_cuda`).

A buffer is allocated once at attach (capacity: tokens x widest layer x element size) and replaced by a
larger one only when a call does not fit. Every call uses it from offset 0: the client writes its input,
the executor reads it, computes, and writes the output back in its place.

CUDA buffers are ordered on the GPU, without either CPU waiting, by flags in a second, tiny shared CUDA
buffer that each side's stream writes and the other's waits on (`streamops.py`, `client.py`).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import fcntl
import functools
import os
import secrets

import torch

from symbiosis.errors import BadCall

MAX_CACHED_VIEWS = 256
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
IPC_HANDLE_BYTES = 64  # CUipcMemHandle
# torch's mapping of a CUDA IPC handle decrements, when dropped, an int64 in a shared-memory file the sender names, at
# an offset the sender names: a client naming another's counter file, or an offset past its end, would have the
# executor write there. The executor names a file nobody has (a name made here, unguessable): the decrement finds
# nothing and does nothing. (The clients' buffers are the driver's, `DeviceMemory`, which keep no such counter.)
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
        memory = DeviceMemory(nbytes, device)
        description = {"kind": "cuda", "nbytes": nbytes, "handle": base64.b64encode(memory.handle).decode()}
        return cls(torch.as_tensor(memory, device=memory.device), description)

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
    """Map a client's CUDA buffer: the first `nbytes` of the allocation its IPC `handle` names, once the driver has
    said how large that allocation is and on which device it lives (a size past it would have the executor read
    and write beyond the client's memory: a fault that ends every tenant's calls). The handle is a driver
    allocation's (64 bytes); torch's other kind, an expandable segment's, names a process and descriptor numbers
    to take, which could be the executor's own: refused. No event to wait for: a new buffer has no write pending
    that the executor could overtake, and calls are ordered by the flags (`streamops.py`)."""
    nbytes = d["nbytes"]
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive number of bytes, not {str(nbytes)[:40]!r}")
    handle = base64.b64decode(d["handle"], validate=True)
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle of a driver allocation is {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
    torch.cuda.init()
    index = _index(device)
    storage = torch.UntypedStorage._new_shared_cuda(index, handle, nbytes, 0, NO_REF_COUNTER, 0, b"", False)
    pointer = storage.data_ptr()
    base, size, ordinal = _allocation(pointer)
    if ordinal != index:
        raise ValueError(f"the buffer is on cuda:{ordinal} (as this process numbers devices), not on the "
                         f"executor's {device}; use a host buffer")
    if pointer + nbytes > base + size:
        raise ValueError(f"the description claims {nbytes} bytes of an allocation of {base + size - pointer}")
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage, 0, (nbytes,), (1,))


class DeviceMemory:
    """`nbytes` of device memory from the driver (`cuMemAlloc`), lent to torch through `__cuda_array_interface__`
    (torch holds this object while a tensor views it) and freed when collected. Not the caching allocator's: under
    expandable segments it shares memory by process id and descriptor numbers, which the executor refuses."""

    def __init__(self, nbytes: int, device: torch.device):
        self.pointer, self._device = None, None
        torch.cuda.init()
        self.device = torch.device("cuda", _index(device))
        driver, ordinal = _driver(), ctypes.c_int()
        self._context, pointer, handle = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.create_string_buffer(64)
        _check(driver.cuDeviceGet(ctypes.byref(ordinal), self.device.index), "cuDeviceGet")
        _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), ordinal), "cuDevicePrimaryCtxRetain")
        self._device = ordinal
        with self._current():
            _check(driver.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(nbytes)), "cuMemAlloc")
            self.pointer = pointer.value
            _check(driver.cuIpcGetMemHandle(handle, pointer), "cuIpcGetMemHandle")
        self.handle = handle.raw
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.pointer, False),
                                         "version": 3, "strides": None}

    @contextlib.contextmanager
    def _current(self):
        """The device's primary context current on this thread (a collector's thread may have none)."""
        _check(_driver().cuCtxPushCurrent_v2(self._context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            _driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def __del__(self):
        # (at the interpreter's exit the driver may be gone already: then there is nothing left to free)
        with contextlib.suppress(Exception):
            if self.pointer is not None:
                with self._current():
                    _driver().cuMemFree_v2(ctypes.c_uint64(self.pointer))  # (waits for work on it to end)
            if self._device is not None:
                _driver().cuDevicePrimaryCtxRelease_v2(self._device)
        self.pointer = self._device = None


def _index(device: torch.device) -> int:
    """`device`'s index, the current device's for a bare "cuda"."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed (CUresult {status})")


def _allocation(pointer: int) -> tuple[int, int, int]:
    """(base, size, device ordinal) of the device allocation holding `pointer`, as the driver knows it."""
    driver, base, size, ordinal = _driver(), ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_int()
    try:
        _check(driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer)),
               "cuMemGetAddressRange")
        _check(driver.cuPointerGetAttribute(ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                            ctypes.c_uint64(pointer)), "cuPointerGetAttribute")
    except RuntimeError as e:
        raise ValueError(f"the CUDA driver cannot describe the mapped buffer: {e}") from e
    return base.value, size.value, ordinal.value
