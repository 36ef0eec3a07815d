"""Building PLOT tables from a corpus (HMI §3.2.1, §5.1): count the corpus's n-grams, choose which to keep, run each
kept fragment alone through the lower layers, write the table.

- a root table keeps every fragment the corpus holds, and a uni-gram for every token of the vocabulary (so any
  sequence has a representation);
- a domain table keeps, at each length, the top `alpha`% most frequent of the domain corpus's distinct fragments
  (alpha 0: none, lookups go to the root; 100: all of them), computed with the domain's lower layers.

Building is resumable: the plan (the chosen keys) is written first, then the values in chunks into a mapped file, the
rows done recorded after each chunk; a build started again with the same corpus and settings goes on from there,
and the finished table appears whole (table.write_table).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from symbiosis.errors import SymbiosisError
from symbiosis.plot.split import LowerLayers
from symbiosis.plot.table import DTYPES, PlotTable, PlotTableError, check_packable, pack, unpack, write_table


class CorpusTooSmall(SymbiosisError):
    """A corpus below the minimum size a table is built from."""


class TableTooLarge(SymbiosisError):
    """A table whose planned size is past what the build may write (`max_bytes`)."""


class Stopped(SymbiosisError):
    """A build or a training asked to stop (deleted, or the service closing); started again, it resumes."""


def count_fragments(sequences: list[np.ndarray], length: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct `length`-grams of the corpus, packed (sorted), and how often each occurs."""
    packed = [pack(sliding_window_view(s, length), vocab) for s in sequences if s.size >= length]
    if not packed:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(packed), return_counts=True)


def top_fraction(keys: np.ndarray, counts: np.ndarray, alpha: float) -> np.ndarray:
    """The ceil(alpha% of them) most frequent keys (ties: the smaller key first), sorted."""
    keep = math.ceil(keys.size * alpha / 100)
    order = np.lexsort((keys, -counts))[:keep]
    return np.sort(keys[order])


def _corpus(sequences) -> list[np.ndarray]:
    arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
    return [a for a in arrays if a.size]


def build_table(lower: LowerLayers, sequences, directory: str | os.PathLike, *, n: int = 3, alpha: float = 100.0,
                root: PlotTable | None = None, dtype: str = "float16", min_tokens: int = 0, chunk: int = 4096,
                max_bytes: int | None = None, progress: Callable[[int, int], None] | None = None,
                stop: Callable[[], bool] | None = None) -> PlotTable:
    """Build the table of `lower` over `sequences` (lists of token ids) into `directory`: a root table, or with
    `root`, a domain table over it keeping the top `alpha`%. `max_bytes`: the most the table may take
    (`TableTooLarge` once its plan is past it, before anything is written: a table holds up to n(n+1)/2 vectors a
    corpus token). `progress(rows done, rows in all)` after each chunk; `stop()` true ends it (`Stopped`) between
    chunks."""
    directory = Path(directory)
    corpus = _corpus(sequences)
    tokens = sum(s.size for s in corpus)
    if tokens < max(min_tokens, 1):
        raise CorpusTooSmall(f"the corpus holds {tokens} tokens; a table is built from at least {max(min_tokens, 1)}")
    vocab = lower.vocab
    check_packable(n, vocab)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    if not 0 <= alpha <= 100:
        raise ValueError(f"alpha is a percentage (0..100), not {alpha}")
    if any(s.min() < 0 or s.max() >= vocab for s in corpus):
        raise ValueError(f"the corpus holds token ids outside the vocabulary (0..{vocab - 1})")
    if root is not None and (root.kind, root.vocab, root.hidden, root.lower_layers) != \
            (lower.kind, vocab, lower.hidden, lower.lower_layers):
        raise ValueError(f"the root table {root.directory} was built for another model or cut")
    digest = hashlib.sha256(json.dumps({"n": n, "alpha": alpha, "dtype": dtype, "vocab": vocab, "k": lower.lower_layers,
                                        "root": None if root is None else root.meta["id"]}).encode())
    for s in corpus:
        digest.update(s.tobytes())
        digest.update(b"|")
    plan_id = digest.hexdigest()

    work = directory.with_name(directory.name + ".work")
    finished = _finished(directory, plan_id)
    if finished is not None:  # stopped after the table was written, before its work files went
        shutil.rmtree(work, ignore_errors=True)
        return finished
    if not _resumable(work, plan_id, n):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        planned = {}
        for length in range(1, n + 1):
            if root is None and length == 1:
                planned[length] = np.arange(vocab, dtype=np.int64)
            else:
                keys, counts = count_fragments(corpus, length, vocab)
                planned[length] = keys if root is None else top_fraction(keys, counts, alpha)
        size = sum(keys.size * (8 + length * lower.hidden * np.dtype(DTYPES[dtype]).itemsize)
                   for length, keys in planned.items())
        if max_bytes is not None and size > max_bytes:
            shutil.rmtree(work, ignore_errors=True)
            raise TableTooLarge(f"the table would take {size} bytes ({sum(k.size for k in planned.values())} "
                                f"fragments of {lower.hidden} values), past the {max_bytes} bytes it may take")
        for length, keys in planned.items():
            np.save(work / f"keys-{length}.npy", keys, allow_pickle=False)
            np.lib.format.open_memmap(work / f"values-{length}.npy", mode="w+", dtype=DTYPES[dtype],
                                      shape=(keys.size, length, lower.hidden)).flush()
        _write_json(work / "progress.json", {str(length): 0 for length in range(1, n + 1)})
        _write_json(work / "plan.json", {"id": plan_id})
    done = json.loads((work / "progress.json").read_text())
    keys = {length: np.array(np.lib.format.open_memmap(work / f"keys-{length}.npy", mode="r"))
            for length in range(1, n + 1)}
    total = sum(k.size for k in keys.values())
    for length in range(1, n + 1):
        values = np.lib.format.open_memmap(work / f"values-{length}.npy", mode="r+")
        for first in range(done[str(length)], keys[length].size, chunk):
            if stop is not None and stop():
                raise Stopped(f"stopped with {sum(done.values())} of {total} rows built; it resumes from there")
            rows = slice(first, min(first + chunk, keys[length].size))
            values[rows] = lower.represent(unpack(keys[length][rows], length, vocab)).cpu().double().numpy()
            values.flush()
            done[str(length)] = rows.stop
            _write_json(work / "progress.json", done)
            if progress is not None:
                progress(sum(done.values()), total)
        del values
    meta = {"id": plan_id, "kind": lower.kind, "n": n, "lower_layers": lower.lower_layers, "hidden": lower.hidden,
            "vocab": vocab, "dtype": dtype, "alpha": alpha, "corpus_tokens": tokens,
            "root": None if root is None else root.meta["id"]}
    write_table(directory, meta, {length: (keys[length], work / f"values-{length}.npy") for length in keys})
    shutil.rmtree(work)
    return PlotTable.open(directory)


def _finished(directory: Path, plan_id: str) -> PlotTable | None:
    """The table in `directory` if it is whole and of this plan, else None (absent, damaged or another plan's).
    Its plan is read first: only a table of this plan is opened, which hashes every file of it."""
    try:
        meta = json.loads((directory / "plot.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(meta, dict) or meta.get("id") != plan_id:
        return None
    try:
        return PlotTable.open(directory)
    except PlotTableError:
        return None


def _resumable(work: Path, plan_id: str, n: int) -> bool:
    """Whether `work` holds this plan's files, all of them (a stop while the finished table was being written
    moves its values files away: that plan starts again)."""
    try:
        plan = json.loads((work / "plan.json").read_text())
        json.loads((work / "progress.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(plan, dict) and plan.get("id") == plan_id and all(
        (work / f"{part}-{length}.npy").is_file() for length in range(1, n + 1) for part in ("keys", "values"))


def _write_json(path: Path, value) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(value))
    os.replace(staging, path)
