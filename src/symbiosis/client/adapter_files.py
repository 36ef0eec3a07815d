"""Adapter directories: safetensors only, nothing that is unpickled.

PEFT falls back to `adapter_model.bin` (a `torch.save` pickle) when a directory has no
`adapter_model.safetensors`, and transformers' adapter loading does the same. Unpickling runs code chosen by
whoever wrote the file, so a split model refuses any directory that holds a pickle, wherever it is in the
directory, before PEFT or transformers look at it (`client/peft_support.py` installs the check on every
adapter-loading entry point of a split model). The error says how to convert the file where it is trusted.
"""

from __future__ import annotations

import os
from pathlib import Path

from symbiosis.errors import AdapterError

# torch.save / pickle files by name; others by content (below)
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz"}
# Files that are not sniffed: their own formats cannot start like a pickle by design, or their parsers never
# unpickle (a safetensors header length may begin with the bytes a pickle begins with).
NOT_SNIFFED = {".safetensors", ".json", ".md", ".txt"}
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format: a zip holding a pickle


def _pickled(path: Path) -> bool:
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return True
    if path.suffix.lower() in NOT_SNIFFED:
        return False
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(ZIP_MAGIC) or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def check_adapter_directory(directory: str | os.PathLike) -> Path:
    """`directory`, if it is a PEFT adapter directory holding safetensors weights and no pickle; else
    `AdapterError` naming the file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AdapterError(f"{directory}: not a local adapter directory. A split model loads adapters from a local "
                           "directory only (check it before loading: `huggingface_hub.snapshot_download(repo, "
                           "allow_patterns=['*.json', '*.safetensors'])` fetches one without pickles)")
    for root, _, files in os.walk(directory):  # symlinked directories are not followed
        for name in sorted(files):
            path = Path(root) / name
            if path.is_file() and _pickled(path):
                raise AdapterError(
                    f"{path}: a pickle (torch.save or pickle format). symbiosis loads adapters from safetensors "
                    "only and never unpickles a file. Where you trust it, convert it with plain PEFT "
                    "(`PeftModel.from_pretrained(model, dir).save_pretrained(new_dir)` writes "
                    "adapter_model.safetensors), then remove the pickle from the directory")
    if not (directory / "adapter_config.json").is_file():
        raise AdapterError(f"{directory}: not a PEFT adapter directory (no adapter_config.json)")
    if not (directory / "adapter_model.safetensors").is_file():
        raise AdapterError(f"{directory}: no adapter_model.safetensors")
    return directory
