"""Selective reading of a Hugging Face model directory's safetensors files.

The safetensors layout is tiny: an 8-byte little-endian header length N, N bytes of JSON mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header), then the raw data. We parse headers ourselves so that (a) a reader touches exactly the bytes of
the tensors it asks for, and counts them (the executor reads only base tensors, a client only its own),
and (b) a truncated or corrupt file is reported with the file and tensor that are wrong, before any
weight is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from symbiosis.errors import CheckpointError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
FINGERPRINT_SAMPLE_BYTES = 64  # per probe; three probes (start, middle, end) per tensor


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: absolute byte range [start, end) in `file`."""

    name: str
    file: Path
    dtype: torch.dtype
    dtype_code: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _parse_header(file: Path) -> dict[str, TensorEntry]:
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file}: not a safetensors file (only {len(prefix)} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{file}: corrupt safetensors header (declared length {header_len}, file size {size})")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            dtype = SAFETENSORS_DTYPES[code]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt header entry for tensor {name!r}: {info!r}") from e
        numel = 1
        for dim in shape:
            numel *= dim
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise CheckpointError(f"{file}: tensor {name!r} has {end - begin} bytes for shape {list(shape)} {code}")
        if data_start + end > size:
            raise CheckpointError(
                f"{file}: truncated: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes"
            )
        entries[name] = TensorEntry(name, file, dtype, code, shape, data_start + begin, data_start + end)
    return entries


def _safetensors_files(path: Path) -> tuple[Path, list[Path]]:
    """(the file that lists the tensors: model.safetensors or its index, the safetensors files)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map.values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e})") from e
        for name in names:  # a shard is a file of this directory: nothing the index names elsewhere is opened
            if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts \
                    or "\0" in name:
                raise CheckpointError(f"{index}: shard name {str(name)[:200]!r} is not a file name inside {path}")
        files = sorted(path / name for name in names)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard(s) named in model.safetensors.index.json are missing: {missing}")
        return index, files
    single = path / "model.safetensors"
    if single.is_file():
        return single, [single]
    if any(path.glob("*.bin")):
        raise CheckpointError(f"{path}: only PyTorch .bin weights found; symbiosis reads safetensors only "
                              "(convert with `model.save_pretrained(dir, safe_serialization=True)`)")
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


class Checkpoint:
    """The config and safetensors tensors of one model directory; tensor data is read on demand.

    `bytes_read` counts every data byte this reader has read (tensors and fingerprint probes), so tests
    can prove that each side reads only what it owns.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{self.path}: not a Hugging Face model directory (no config.json)")
        try:
            self.config_dict: dict = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config_file}: not valid JSON ({e})") from e
        self.entries: dict[str, TensorEntry] = {}
        self.listing, files = _safetensors_files(self.path)  # errors name it
        for file in files:
            self.entries.update(_parse_header(file))
        self.bytes_read = 0
        self._lock = threading.Lock()

    def _pread(self, entry: TensorEntry, offset: int, length: int, into: memoryview) -> None:
        with open(entry.file, "rb") as f:
            f.seek(offset)
            got = f.readinto(into)
        if got != length:
            raise CheckpointError(f"{entry.file}: truncated while reading tensor {entry.name!r}")
        with self._lock:
            self.bytes_read += length

    def read(self, name: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """Read one tensor (only its bytes), cast to `dtype` if given, on `device`."""
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        raw = torch.empty(entry.nbytes, dtype=torch.uint8)
        if entry.nbytes:
            self._pread(entry, entry.start, entry.nbytes, memoryview(raw.numpy()))
        tensor = raw.view(entry.dtype).reshape(entry.shape)
        return tensor.to(device=device, dtype=dtype or entry.dtype)

    def content_probe(self, name: str) -> bytes:
        """Three short slices (start, middle, end) of a tensor's bytes: enough to tell two checkpoints of the
        same architecture apart (a fine-tune changes essentially every byte) for ~192 bytes per tensor."""
        entry = self.entries[name]
        n = min(FINGERPRINT_SAMPLE_BYTES, entry.nbytes)
        probes = bytearray()
        for offset in sorted({entry.start, entry.start + (entry.nbytes - n) // 2, entry.end - n}):
            chunk = bytearray(n)
            if n:
                self._pread(entry, offset, n, memoryview(chunk))
            probes += chunk
        return bytes(probes)

    def fingerprint(self) -> str:
        """sha256 over the config (minus bookkeeping keys) and, per tensor, name, dtype, shape and content probes.

        Client and executor compute it independently from their own copy of the directory; they work
        together only if the values agree.
        """
        digest = hashlib.sha256()
        config = {k: v for k, v in self.config_dict.items() if k not in ("transformers_version", "_name_or_path")}
        digest.update(json.dumps(config, sort_keys=True).encode())
        for name in sorted(self.entries):
            entry = self.entries[name]
            digest.update(f"{name}|{entry.dtype_code}|{list(entry.shape)}|".encode())
            digest.update(self.content_probe(name))
        return digest.hexdigest()
