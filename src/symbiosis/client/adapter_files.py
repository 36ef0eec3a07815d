"""Adapter directories: safetensors only, nothing that is unpickled.

PEFT falls back to `adapter_model.bin` (a `torch.save` pickle) when a directory has no
`adapter_model.safetensors`, and transformers' adapter loading does the same. Unpickling runs code chosen by
whoever wrote the file, so a split model refuses any directory that holds a pickle, wherever it is in the
directory, before PEFT or transformers look at it (`client/peft_support.py` installs the check on every
adapter-loading entry point of a split model). The error says how to convert the file where it is trusted.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from symbiosis.errors import AdapterError

# torch.save / pickle files by name; others by content (below)
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz"}
# Files that are not sniffed: their own formats cannot start like a pickle by design, or their parsers never
# unpickle (a safetensors header length may begin with the bytes a pickle begins with).
NOT_SNIFFED = {".safetensors", ".json", ".md", ".txt"}
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format: a zip holding a pickle
MAX_WALKED = 4096  # entries of an adapter directory looked at for pickles: an adapter has a handful
MAX_JSON_BYTES = 4 << 20  # an adapter's JSON files (configs, records): a config of 1,024 pattern keys is ~100 kB
# A PEFT pattern key (`alpha_pattern`, `rank_pattern`): a module's name or a dotted suffix of it. PEFT reads a key as
# a regular expression (`re.match(rf"(.*\.)?({key})$", module)`, holding the GIL: a key like `(.|.)*Z` took minutes);
# of these characters alone a key is one without quantifiers or groups (a `.` matching any one character), matched
# here (`pattern_value`) as PEFT would, in linear time
PATTERN_KEY = re.compile(r"[A-Za-z0-9_.\-]{1,256}")
MAX_PATTERN_KEYS = 1024


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
    walked = 0
    for root, directories, files in os.walk(directory):  # symlinked directories are not followed
        walked += len(directories) + len(files)
        if walked > MAX_WALKED:
            raise AdapterError(f"{directory}: more than {MAX_WALKED} files and directories; an adapter directory "
                               "holds its config and weights (and a few more files)")
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


def read_json(path: Path, what: str, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value in the file `path`, or `AdapterError` naming the problem: a file over `max_bytes` (checked
    before it is read), not UTF-8 JSON, or nested too deep for the parser. `what`: what the file should be."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise AdapterError(f"{path}: cannot be read ({e.strerror})") from None
    if len(data) > max_bytes:
        raise AdapterError(f"{path}: over {max_bytes} bytes, too large for {what}")
    try:
        return json.loads(data)
    except RecursionError:
        raise AdapterError(f"{path}: not {what} (JSON nested too deep)") from None
    except ValueError as e:
        raise AdapterError(f"{path}: not {what} ({e})") from None


def check_pattern_keys(patterns: dict, field: str) -> None:
    """ValueError unless `patterns` (a PEFT `alpha_pattern` / `rank_pattern`) has at most MAX_PATTERN_KEYS keys,
    each a module name or dotted suffix (PATTERN_KEY): regular expressions beyond that are refused."""
    if len(patterns) > MAX_PATTERN_KEYS:
        raise ValueError(f"{field} has more than {MAX_PATTERN_KEYS} keys")
    for key in patterns:
        if not isinstance(key, str) or not PATTERN_KEY.fullmatch(key):
            raise ValueError(f"{field} key {str(key)[:60]!r} is not a module name (1-256 of [A-Za-z0-9_.-]; "
                             "regular expressions are not taken)")


def pattern_value(patterns: dict, module: str, default):
    """PEFT's `patterns.get(get_pattern_key(patterns, module), default)` for keys that passed
    `check_pattern_keys`: the first key (in order) that matches `module`'s whole name or a part after a `.`, a
    key's `.` matching any character."""
    for key, value in patterns.items():
        n = len(key)
        if n > len(module) or (n < len(module) and module[-n - 1] != "."):
            continue
        tail = module[-n:]
        if tail == key or all(k == "." or k == c for k, c in zip(key, tail)):
            return value
    return default
