"""CUDA stream memory operations: a stream waits until a 32-bit word in device memory reaches a value, or
writes one, without either CPU waiting (the driver's `cuStreamWaitValue32` / `cuStreamWriteValue32`).

This is what lets a client on the executor's GPU run ahead of its calls (`transport/client.py`): the
client's stream writes its call's sequence number after its input, the executor's stream waits for it
before reading; the executor's stream writes the sequence number after the output, the client's waits for
it before reading. Unlike interprocess events, a wait may be queued before the write it waits for is.

Sequence numbers are compared cyclically ((int32)(*word - value) >= 0), so they may wrap around.
PyTorch does not expose these calls; they are bound here from libcuda with ctypes.
"""

from __future__ import annotations

import ctypes
import threading

import torch

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: cyclic >=
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: earlier writes of the stream are visible first
RELEASE_AHEAD = 1 << 20  # a released flag is set this far past the last call: no wait queued on it can hold
_driver: ctypes.CDLL | None = None
_functions: dict[str, ctypes._CFuncPtr] = {}
_thread = threading.local()  # devices whose primary context this thread has made current


def _bind() -> dict[str, ctypes._CFuncPtr]:
    global _driver
    if _functions:
        return _functions
    _driver = ctypes.CDLL("libcuda.so.1")
    for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
        # The _v2 entry points need no opt-in (CUDA >= 11.7); the plain names are the older, opt-in ones.
        function = getattr(_driver, f"{name}_v2", None) or getattr(_driver, name)
        function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        function.restype = ctypes.c_int
        _functions[name] = function
    for name, args in (("cuCtxGetCurrent", [ctypes.POINTER(ctypes.c_void_p)]),
                       ("cuStreamCreate", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
                       ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]),
                       ("cuCtxSetCurrent", [ctypes.c_void_p])):
        function = getattr(_driver, name)
        function.argtypes, function.restype = args, ctypes.c_int
        _functions[name] = function
    return _functions


def available(device: torch.device) -> bool:
    """Whether this process can queue stream memory operations on `device` (a CUDA device)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        _bind()
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        stream = torch.cuda.current_stream(device)
        write(stream.cuda_stream, flag.data_ptr(), 7, device.index)
        wait_geq(stream.cuda_stream, flag.data_ptr(), 7, device.index)
        return int(flag.item()) == 7
    except (OSError, AttributeError, RuntimeError):
        return False


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"CUDA driver call {what} failed with CUresult {result}")


def _use_context(device_index: int) -> None:
    """Driver calls need a current context; a thread that has made no CUDA runtime call yet has none."""
    bound = getattr(_thread, "devices", None)
    if bound is None:
        bound = _thread.devices = set()
    if device_index in bound:
        return
    functions = _bind()
    context = ctypes.c_void_p()
    _check(functions["cuCtxGetCurrent"](ctypes.byref(context)), "cuCtxGetCurrent")
    if not context.value:
        _check(functions["cuDevicePrimaryCtxRetain"](ctypes.byref(context), device_index), "cuDevicePrimaryCtxRetain")
        _check(functions["cuCtxSetCurrent"](context), "cuCtxSetCurrent")
    bound.add(device_index)


def side_stream(device_index: int) -> int:
    """A new stream that does not synchronise with the default stream (CU_STREAM_NON_BLOCKING), made with
    the driver: it can write a flag while the default stream is stuck waiting for one."""
    _use_context(device_index)
    stream = ctypes.c_void_p()
    _check(_functions["cuStreamCreate"](ctypes.byref(stream), 0x1), "cuStreamCreate")
    return stream.value


def wait_geq(stream: int, address: int, value: int, device_index: int) -> None:
    """Work queued on `stream` after this waits until the int32 at `address` is >= value (cyclically)."""
    _use_context(device_index)
    _check(_functions["cuStreamWaitValue32"](stream, address, value & 0xFFFFFFFF, WAIT_GEQ), "cuStreamWaitValue32")


def write(stream: int, address: int, value: int, device_index: int) -> None:
    """Once the work queued on `stream` before this is done, the int32 at `address` becomes value."""
    _use_context(device_index)
    _check(_functions["cuStreamWriteValue32"](stream, address, value & 0xFFFFFFFF, WRITE_DEFAULT),
           "cuStreamWriteValue32")


def release(stream: int, address: int, last_seq: int, device_index: int) -> None:
    """Let every wait on the flag at `address` for a call up to `last_seq` end: the other side will never
    write it (it died, or stopped answering). `stream` must be one that is not itself stuck on such a wait."""
    write(stream, address, last_seq + RELEASE_AHEAD, device_index)
