"""Per-client shared buffers for same-host transports: activations are written once into memory both
processes map, and only a small header crosses the socket.

- CPU: a file in /dev/shm that both sides map (`torch.from_file(shared=True)`).
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
import os
import secrets
import tempfile
from pathlib import Path

import torch

from symbiosis.errors import BadCall

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
PREFIX = "symbiosis-"
MAX_CACHED_VIEWS = 256


class SharedBuffer:
    """A flat uint8 buffer shared by client and executor."""

    def __init__(self, tensor: torch.Tensor, description: dict, path: Path | None = None, owner: bool = False):
        self.tensor = tensor
        self.description = description
        self.path = path
        self.owner = owner
        self._views: dict[tuple, torch.Tensor] = {}  # (dtype, *shape) -> view
        self.pinned = False
        # The stream this process orders buffer work on, looked up once (current_stream() costs ~20 us a call).
        self.stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> "SharedBuffer":
        if device.type == "cuda":
            return cls._create_cuda(nbytes, device)
        path = SHM_DIR / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        with open(path, "wb") as f:
            f.truncate(nbytes)
        tensor = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        return cls(tensor, {"kind": "cpu", "path": str(path), "nbytes": nbytes}, path, owner=True)

    @classmethod
    def _create_cuda(cls, nbytes: int, device: torch.device) -> "SharedBuffer":
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
    def open(cls, description: dict) -> "SharedBuffer":
        """The executor's side: map a buffer a client described (validated: only our own shm files)."""
        try:
            kind, nbytes = description["kind"], int(description["nbytes"])
            if kind == "cpu":
                path = Path(description["path"])
                if path.parent != SHM_DIR or not path.name.startswith(PREFIX) or not path.is_file() \
                        or path.is_symlink() or path.stat().st_size != nbytes:
                    raise BadCall(f"shared buffer {path} is not a symbiosis buffer of {nbytes} bytes")
                tensor = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
                return cls(tensor, description, path)
            if kind == "cuda":
                return cls(_open_cuda(description), description)
        except (KeyError, TypeError, ValueError, OSError, RuntimeError) as e:
            raise BadCall(f"cannot map the client's shared buffer: {e}") from e
        raise BadCall(f"unknown shared buffer kind {kind!r}")

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

    def close(self, unlink: bool = False) -> None:
        """Drop the mapping; the owner (the client) also removes the file. The executor removes a dead
        client's file too (`unlink=True`), since that client cannot."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        self._views.clear()
        if self.owner or unlink:
            self.unlink()

    def unlink(self) -> None:
        if self.path is not None and self.path.name.startswith(PREFIX):
            self.path.unlink(missing_ok=True)


def _open_cuda(d: dict) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    b64 = lambda s: None if s is None else base64.b64decode(s)  # noqa: E731
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), int(d["offset"]),
                               torch.UntypedStorage, torch.uint8, int(d["device"]), b64(d["handle"]),
                               int(d["storage_bytes"]), int(d["storage_offset"]), False, b64(d["ref_handle"]),
                               int(d["ref_offset"]), b64(d["event_handle"]), bool(d["event_sync"]))
