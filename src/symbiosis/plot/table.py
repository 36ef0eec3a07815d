"""PLOT tables on disk (HMI §3.2.1): n-grams of token ids -> their representations after the model's lower layers.

A table is a directory:

    plot.json        {"format": "symbiosis-plot/1", "id": the build's digest, "kind": "decoder" | "encoder",
                      "n": 3, "lower_layers": k, "hidden": d, "vocab": V, "dtype": "float16", "alpha": 100,
                      "root": a domain table's root's id (null for a root), "corpus_tokens": ...,
                      "levels": {"3": {"entries": N3, "sha256": {"keys", "values"}}, "2": ..., "1": ...}}
    keys-G.npy       int64 [N_G], strictly increasing: each G-gram packed as sum(token_j * V**(G-1-j))
    values-G.npy     [N_G, G, d]: the lower layers' output at each of the fragment's G positions, the fragment run
                     alone (positions 0..G-1)

for each level G = n, n-1, .., 1 (tri-, bi-, uni-grams by default). Both files are plain .npy, memory-mapped with
numpy's open_memmap, which refuses an array of Python objects (nothing is ever unpickled): a table larger than host
memory is paged in as lookups touch it. Opening checks everything a lookup relies on: the JSON, the arrays' dtypes
and shapes against it, each file's SHA-256 (so a truncated or altered file is found at open, not as a wrong answer
later), and the keys' order and range. A damaged table raises `PlotTableError` naming the file and the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from symbiosis.errors import SymbiosisError

FORMAT = "symbiosis-plot/1"
DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64}
KINDS = ("decoder", "encoder")
MAX_N = 8


class PlotTableError(SymbiosisError):
    """A PLOT table that cannot be used: missing or damaged files, or one made for another model."""


@dataclass
class Level:
    """The fragments of one length: keys int64 [N] (sorted), values [N, length, hidden] (memory-mapped)."""
    keys: np.ndarray
    values: np.ndarray


def pack(fragments: np.ndarray, vocab: int) -> np.ndarray:
    """fragments int64 [N, G] -> int64 [N]: each row as one number in base `vocab` (first token most significant)."""
    keys = np.zeros(fragments.shape[0], dtype=np.int64)
    for column in range(fragments.shape[1]):
        keys = keys * vocab + fragments[:, column]
    return keys


def unpack(keys: np.ndarray, length: int, vocab: int) -> np.ndarray:
    """The inverse of `pack`: int64 [N] -> [N, length]."""
    fragments = np.empty((keys.shape[0], length), dtype=np.int64)
    rest = keys.copy()
    for column in reversed(range(length)):
        fragments[:, column] = rest % vocab
        rest //= vocab
    return fragments


def check_packable(n: int, vocab: int) -> None:
    if not 1 <= n <= MAX_N:
        raise PlotTableError(f"n-grams of length {n}: the length must be in 1..{MAX_N}")
    if vocab < 2 or vocab ** n >= 2 ** 63:
        raise PlotTableError(f"{n}-grams of a {vocab}-token vocabulary do not fit a 64-bit key; use a shorter n")


class PlotTable:
    """One table, opened read-only and checked. `find` and `rows` are what lookups use."""

    def __init__(self, directory: Path, meta: dict, levels: dict[int, Level]):
        self.directory, self.meta, self.levels = directory, meta, levels
        self.n, self.vocab, self.hidden = meta["n"], meta["vocab"], meta["hidden"]
        self.kind, self.lower_layers = meta["kind"], meta["lower_layers"]

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "PlotTable":
        directory = Path(directory)
        meta = _read_meta(directory)
        levels = {}
        for length in range(1, meta["n"] + 1):
            entry = meta["levels"][str(length)]
            keys = _load(directory / f"keys-{length}.npy", np.int64, (entry["entries"],), entry["sha256"]["keys"])
            values = _load(directory / f"values-{length}.npy", DTYPES[meta["dtype"]],
                           (entry["entries"], length, meta["hidden"]), entry["sha256"]["values"])
            if keys.size and (np.any(np.diff(keys) <= 0) or keys[0] < 0 or keys[-1] >= meta["vocab"] ** length):
                raise PlotTableError(f"{directory / f'keys-{length}.npy'}: keys are not strictly increasing "
                                     f"{length}-grams of a {meta['vocab']}-token vocabulary")
            levels[length] = Level(keys, values)
        return cls(directory, meta, levels)

    def find(self, fragments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """fragments int64 [M, G] -> (row of each in level G, int64 [M]; found, bool [M])."""
        level = self.levels[fragments.shape[1]]
        if fragments.shape[0] == 0 or level.keys.size == 0:
            return np.zeros(fragments.shape[0], dtype=np.int64), np.zeros(fragments.shape[0], dtype=bool)
        keys = pack(fragments, self.vocab)
        rows = np.searchsorted(level.keys, keys).clip(max=level.keys.size - 1)
        return rows, level.keys[rows] == keys

    def rows(self, length: int, rows: np.ndarray) -> np.ndarray:
        """[M, length, hidden] of level `length`, in the table's dtype (read from the mapped file)."""
        return np.asarray(self.levels[length].values[rows])

    @property
    def nbytes(self) -> int:
        return sum(level.keys.nbytes + level.values.nbytes for level in self.levels.values())

    def entries(self) -> dict[int, int]:
        return {length: int(level.keys.size) for length, level in self.levels.items()}


def write_table(directory: str | os.PathLike, meta: dict, levels: dict[int, tuple[np.ndarray, os.PathLike]]) -> Path:
    """Write a table whose level G holds sorted `keys` and the values already in the .npy file at the given path
    (moved in); the directory appears whole or not at all (written beside it, then renamed)."""
    directory = Path(directory)
    staging = directory.with_name(directory.name + ".writing")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    meta = {**meta, "format": FORMAT, "levels": {}}
    for length, (keys, values_file) in sorted(levels.items()):
        np.save(staging / f"keys-{length}.npy", keys.astype(np.int64), allow_pickle=False)
        os.replace(values_file, staging / f"values-{length}.npy")
        meta["levels"][str(length)] = {"entries": int(keys.size), "sha256": {
            "keys": _sha256(staging / f"keys-{length}.npy"), "values": _sha256(staging / f"values-{length}.npy")}}
    (staging / "plot.json").write_text(json.dumps(meta, indent=1))
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(staging, directory)
    return directory


def _read_meta(directory: Path) -> dict:
    path = directory / "plot.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlotTableError(f"{directory}: not a PLOT table (no plot.json)") from None
    except (OSError, ValueError, RecursionError) as e:
        raise PlotTableError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PlotTableError(f"{path}: not a {FORMAT} table")
    try:
        # JSON integers, not floats, strings or booleans: these reach the keys' packing and the arrays' shapes
        for key in ("n", "vocab", "hidden", "lower_layers"):
            if type(meta[key]) is not int:  # noqa: E721
                raise ValueError(f"{key} is not an integer")
        n, vocab, hidden, lower = (meta[key] for key in ("n", "vocab", "hidden", "lower_layers"))
        if meta["kind"] not in KINDS or meta["dtype"] not in DTYPES or hidden < 1 or lower < 1:
            raise ValueError("kind, dtype, hidden or lower_layers")
        check_packable(n, vocab)
        for length in range(1, n + 1):
            entry = meta["levels"][str(length)]
            if type(entry["entries"]) is not int or entry["entries"] < 0 or \
                    not all(isinstance(entry["sha256"][f], str) for f in ("keys", "values")):  # noqa: E721
                raise ValueError(f"level {length}")
    except (KeyError, TypeError, ValueError, PlotTableError) as e:
        raise PlotTableError(f"{path}: a field is missing or out of range ({e})") from None
    return meta


def _load(path: Path, dtype, shape: tuple, sha256: str) -> np.ndarray:
    try:
        array = np.lib.format.open_memmap(path, mode="r")  # reads no object arrays: nothing is ever unpickled
    except FileNotFoundError:
        raise PlotTableError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise PlotTableError(f"{path}: not a readable .npy array ({e})") from None
    if array.dtype != dtype or array.shape != shape:
        raise PlotTableError(f"{path}: holds {array.dtype} {list(array.shape)}, plot.json says {np.dtype(dtype)} "
                             f"{list(shape)}")
    if _sha256(path) != sha256:
        raise PlotTableError(f"{path}: its SHA-256 is not the one plot.json records (the file was damaged or "
                             "changed)")
    return array


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
