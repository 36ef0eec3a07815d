"""The CUDA driver calls symbiosis makes itself, through ctypes (`libcuda.so.1`, loaded on first use).

Two uses:
- the shared-buffer checks of `transport/ipc/shm.py` (allocations, IPC handles, address ranges), which torch does not
  expose;
- `Issuer`, the adapter store's way of queueing a placement's work on its copy stream: host-to-device copies, graph
  launches and events. A placement issues a few dozen of them on the engine's thread, in the path of the step that
  needs the adapter (a 1,024-token prefill of Llama-3.2-1B is host-bound). Through torch each costs the host
  10-30 us of dispatch; a driver call costs it ~1-2 us, and ctypes lets go of the GIL while the driver works.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

CU_EVENT_DISABLE_TIMING = 0x2
CUDA_ERROR_NOT_READY = 600


@functools.cache
def driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    # argument types declared once: calls then take Python ints as they are (no ctypes object made per call)
    u64, size, handle = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
    for name, args in (("cuMemcpyHtoDAsync_v2", (u64, u64, size, handle)), ("cuGraphLaunch", (handle, handle)),
                       ("cuEventRecord", (handle, handle)), ("cuStreamWaitEvent", (handle, handle, ctypes.c_uint)),
                       ("cuEventQuery", (handle,)), ("cuEventDestroy_v2", (handle,))):
        function = getattr(lib, name)
        function.argtypes, function.restype = args, ctypes.c_int
    return lib


def check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed (CUresult {status})")


class PrimaryContext:
    """A device's primary context (torch's), retained while this object lives: driver calls need a current context,
    and a thread that has made no CUDA runtime call (a collector's, say) has none."""

    def __init__(self, index: int):
        self.handle = self._device = None
        device, handle = ctypes.c_int(), ctypes.c_void_p()
        check(driver().cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
        check(driver().cuDevicePrimaryCtxRetain(ctypes.byref(handle), device), "cuDevicePrimaryCtxRetain")
        self.handle, self._device = handle.value, device

    @contextlib.contextmanager
    def current(self):
        """The context current on this thread meanwhile (pushed only where another, or none, is)."""
        now = ctypes.c_void_p()
        check(driver().cuCtxGetCurrent(ctypes.byref(now)), "cuCtxGetCurrent")
        if now.value == self.handle:
            yield
            return
        check(driver().cuCtxPushCurrent_v2(ctypes.c_void_p(self.handle)), "cuCtxPushCurrent")
        try:
            yield
        finally:
            driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def __del__(self):
        if self._device is not None:
            with contextlib.suppress(Exception):  # (at the interpreter's exit the driver may be gone)
                driver().cuDevicePrimaryCtxRelease_v2(self._device)
            self._device = None


class Event:
    """A driver event without timing, recorded on a stream and waited on by others (`torch.cuda.Event`'s part the
    adapter store needs, at a fraction of its host cost). Destroyed when collected."""
    __slots__ = ("handle",)

    def __init__(self):
        self.handle = None
        handle = ctypes.c_void_p()
        check(driver().cuEventCreate(ctypes.byref(handle), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self.handle = handle.value

    def record(self, stream: int) -> None:
        """After the work queued so far on `stream` (a raw CUstream, `torch.cuda.Stream.cuda_stream`)."""
        check(driver().cuEventRecord(self.handle, stream), "cuEventRecord")

    def wait(self, stream: int) -> None:
        """`stream`'s later work waits for the work before this event's latest record."""
        check(driver().cuStreamWaitEvent(stream, self.handle, 0), "cuStreamWaitEvent")

    def done(self) -> bool:
        status = driver().cuEventQuery(self.handle)
        if status not in (0, CUDA_ERROR_NOT_READY):
            check(status, "cuEventQuery")
        return status == 0

    def __del__(self):
        if self.handle is not None:
            try:
                driver().cuEventDestroy_v2(self.handle)
            except Exception:  # noqa: BLE001 -- at the interpreter's exit the driver may be gone: nothing to free
                pass


def copy_to_device(target: int, source: int, nbytes: int, stream: int) -> None:
    """`nbytes` from host address `source` to device address `target`, queued on `stream`. The source must stay
    untouched until the copy ran (from pinned memory the call returns at once; torch's pinned-memory cache knows
    nothing of it: the caller keeps the source alive)."""
    check(driver().cuMemcpyHtoDAsync_v2(target, source, nbytes, stream), "cuMemcpyHtoDAsync")


def launch_graph(graph_exec: int, stream: int) -> None:
    """An instantiated CUDA graph (`torch.cuda.CUDAGraph.raw_cuda_graph_exec()`) queued on `stream`."""
    check(driver().cuGraphLaunch(graph_exec, stream), "cuGraphLaunch")
