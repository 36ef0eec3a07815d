"""Building PLOT tables from a corpus (HMI §3.2.1, §5.1): count the corpus's n-grams, choose which to keep, give
each kept fragment its representations after the lower layers, write the table.

A fragment's value (`values`):
- "context" (the default): the mean of the lower layers' output at the fragment's positions over its occurrences in
  the corpus, each sequence run whole (in windows of CONTEXT_WINDOW tokens); a fragment the corpus does not hold (a
  root's uni-gram of a token it lacks) is run alone. The lookups then stand for what the lower layers give those
  tokens in the text such fragments come from, and a fragment found stands in for its context's share: on the
  held-out fortunes task (docs/PERFORMANCE.md section 12) an adapter trained over PLOT reached 79.5% against 70.9%
  with fragments run alone, the whole model 80.6%. It computes less too: one forward a corpus token, not one a
  fragment position.
- "alone": each fragment run alone (positions 0..G-1), as HMI defines the table: a sequence that is itself a
  fragment of the table then gets exactly the lower layers' output.

- a root table keeps every fragment the corpus holds, and a uni-gram for every token of the vocabulary (so any
  sequence has a representation);
- a domain table keeps, at each length, the top `alpha`% most frequent of the domain corpus's distinct fragments
  (alpha 0: none, lookups go to the root; 100: all of them), computed with the domain's lower layers.

Building is resumable: the plan (the chosen keys) is written first, then the values run alone in chunks into a mapped
file, the rows done recorded after each chunk; a build started again with the same corpus and settings goes on from
there. The context pass sums into mapped files and records the windows summed after each batch: stopped between
batches it goes on from there, killed while adding one it starts again. The finished table appears whole
(table.write_table).
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
import torch
from numpy.lib.stride_tricks import sliding_window_view

from symbiosis.errors import SymbiosisError
from symbiosis.plot.split import LowerLayers
from symbiosis.plot.table import DTYPES, PlotTable, PlotTableError, check_packable, pack, unpack, write_table


VALUES = ("context", "alone")
CONTEXT_WINDOW = 512  # tokens of a corpus sequence run whole at once in the context pass (a longer one in windows)
CONTEXT_BATCH = 64  # windows a forward in the context pass


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
                root: PlotTable | None = None, dtype: str = "float16", values: str = "context", min_tokens: int = 0,
                chunk: int = 4096, max_bytes: int | None = None, progress: Callable[[int, int], None] | None = None,
                stop: Callable[[], bool] | None = None) -> PlotTable:
    """Build the table of `lower` over `sequences` (lists of token ids) into `directory`: a root table, or with
    `root`, a domain table over it keeping the top `alpha`%; each fragment's value as `values` says (the module).
    `max_bytes`: the most the table may take (`TableTooLarge` once its plan is past it, before anything is written:
    a table holds up to n(n+1)/2 vectors a corpus token; the context pass's sums take as much again, in float32,
    while it runs). `progress(units done, units in all)` after each chunk (a unit: a fragment run alone, or a window
    of the context pass); `stop()` true ends it (`Stopped`) between chunks."""
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
    if values not in VALUES:
        raise ValueError(f"values must be one of {VALUES}, not {values!r}")
    if any(s.min() < 0 or s.max() >= vocab for s in corpus):
        raise ValueError(f"the corpus holds token ids outside the vocabulary (0..{vocab - 1})")
    if root is not None and (root.kind, root.vocab, root.hidden, root.lower_layers) != \
            (lower.kind, vocab, lower.hidden, lower.lower_layers):
        raise ValueError(f"the root table {root.directory} was built for another model or cut")
    digest = hashlib.sha256(json.dumps({"n": n, "alpha": alpha, "dtype": dtype, "vocab": vocab, "k": lower.lower_layers,
                                        "root": None if root is None else root.meta["id"], "values": values}).encode())
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
        planned, alone = {}, {}
        for length in range(1, n + 1):
            if root is None and length == 1:
                planned[length] = np.arange(vocab, dtype=np.int64)  # (a row per token id)
                # in context only a token the corpus lacks, which has no occurrence to average, runs alone
                unseen = np.setdiff1d(planned[length], np.concatenate(corpus))
            else:
                keys, counts = count_fragments(corpus, length, vocab)
                planned[length] = keys if root is None else top_fraction(keys, counts, alpha)
                unseen = np.zeros(0, dtype=np.int64)  # every fragment kept is the corpus's own
            alone[length] = np.arange(planned[length].size) if values == "alone" else unseen
        size = sum(keys.size * (8 + length * lower.hidden * np.dtype(DTYPES[dtype]).itemsize)
                   for length, keys in planned.items())
        if max_bytes is not None and size > max_bytes:
            shutil.rmtree(work, ignore_errors=True)
            raise TableTooLarge(f"the table would take {size} bytes ({sum(k.size for k in planned.values())} "
                                f"fragments of {lower.hidden} values), past the {max_bytes} bytes it may take")
        for length, keys in planned.items():
            np.save(work / f"keys-{length}.npy", keys, allow_pickle=False)
            np.save(work / f"alone-{length}.npy", alone[length], allow_pickle=False)
            np.lib.format.open_memmap(work / f"values-{length}.npy", mode="w+", dtype=DTYPES[dtype],
                                      shape=(keys.size, length, lower.hidden)).flush()
        _write_json(work / "progress.json", {**{str(length): 0 for length in range(1, n + 1)},
                                             "context": values == "alone"})
        _write_json(work / "plan.json", {"id": plan_id})
    done = json.loads((work / "progress.json").read_text())
    keys = {length: np.array(np.lib.format.open_memmap(work / f"keys-{length}.npy", mode="r"))
            for length in range(1, n + 1)}
    alone = {length: np.array(np.lib.format.open_memmap(work / f"alone-{length}.npy", mode="r"))
             for length in range(1, n + 1)}
    windows = [] if done["context"] else _windows(corpus, min(CONTEXT_WINDOW, lower.max_positions or CONTEXT_WINDOW))
    total = sum(rows.size for rows in alone.values()) + len(windows)
    ran = sum(done[str(length)] for length in range(1, n + 1))
    for length in range(1, n + 1):
        table = np.lib.format.open_memmap(work / f"values-{length}.npy", mode="r+")
        for first in range(done[str(length)], alone[length].size, chunk):
            if stop is not None and stop():
                raise Stopped(f"stopped with {ran} of {total} parts built; it resumes from there")
            rows = alone[length][first:first + chunk]
            table[rows] = lower.represent(unpack(keys[length][rows], length, vocab)).cpu().double().numpy()
            table.flush()
            done[str(length)] = first + rows.size
            ran += rows.size
            _write_json(work / "progress.json", done)
            if progress is not None:
                progress(ran, total)
        del table
    if not done["context"]:
        _context_pass(lower, windows, keys, work, done, torch.float64 if dtype == "float64" else torch.float32,
                      lambda windows_done: progress(ran + windows_done, total) if progress is not None else None,
                      lambda: stop is not None and stop())
        done["context"] = True
        _write_json(work / "progress.json", done)
    meta = {"id": plan_id, "kind": lower.kind, "n": n, "lower_layers": lower.lower_layers, "hidden": lower.hidden,
            "vocab": vocab, "dtype": dtype, "alpha": alpha, "corpus_tokens": tokens, "values": values,
            "root": None if root is None else root.meta["id"]}
    write_table(directory, meta, {length: (keys[length], work / f"values-{length}.npy") for length in keys})
    shutil.rmtree(work)
    return PlotTable.open(directory)


def _windows(corpus: list[np.ndarray], size: int) -> list[np.ndarray]:
    """The corpus in windows of at most `size` tokens, shortest first (batches of like lengths pad little)."""
    windows = [s[i:i + size] for s in corpus for i in range(0, s.size, size)]
    return sorted(windows, key=len)


def _context_pass(lower: LowerLayers, windows: list[np.ndarray], keys: dict[int, np.ndarray], work: Path,
                  done: dict, dtype: torch.dtype, progress: Callable[[int], None], stop: Callable[[], bool]) -> None:
    """The mean in-context representation of every planned fragment the windows hold, into its values (mapped
    files in `work`); sums (in `dtype`) and counts in mapped files of their own. `done` (progress.json's) gains
    `windows` (those summed) and `adding` (a batch being summed), which make it resumable: a pass stopped between
    batches (`stop`, as the service's time slices do) goes on from there; one killed while adding a batch starts
    again (its sums may hold part of it)."""
    resume = not done.get("adding", True) and all((work / f"{part}-{length}.npy").is_file()
                                                  for length in keys for part in ("sums", "counts"))
    sums, counts = {}, {}
    for length, planned in keys.items():
        sums[length] = np.lib.format.open_memmap(work / f"sums-{length}.npy", mode="r+" if resume else "w+",
                                                 dtype=torch.empty(0, dtype=dtype).numpy().dtype,
                                                 shape=(planned.size, length, lower.hidden))
        counts[length] = np.lib.format.open_memmap(work / f"counts-{length}.npy", mode="r+" if resume else "w+",
                                                   dtype=np.int64, shape=(planned.size,))
    if not resume:
        done.update(windows=0, adding=False)
        _write_json(work / "progress.json", done)
    vocab = lower.vocab
    for first in range(done["windows"], len(windows), CONTEXT_BATCH):
        if stop():
            raise Stopped(f"stopped in the context pass ({first} of {len(windows)} windows); it resumes from there")
        batch = windows[first:first + CONTEXT_BATCH]
        _write_json(work / "progress.json", {**done, "adding": True})
        outputs = [reps.to("cpu", dtype) for reps in lower.in_context(batch)]
        for length, planned in keys.items():  # the batch's fragments of each length at once
            fitting = [i for i, tokens in enumerate(batch) if tokens.size >= length]
            if not fitting or planned.size == 0:
                continue
            packed = np.concatenate([pack(sliding_window_view(batch[i], length), vocab) for i in fitting])
            rows = np.searchsorted(planned, packed).clip(max=planned.size - 1)
            found = np.flatnonzero(planned[rows] == packed)  # (a domain table keeps the top alpha% only)
            if found.size:
                positions = torch.cat([outputs[i].unfold(0, length, 1).permute(0, 2, 1) for i in fitting])  # [F, G, d]
                index = torch.from_numpy(rows[found])
                torch.from_numpy(sums[length]).index_add_(0, index, positions[torch.from_numpy(found)])
                torch.from_numpy(counts[length]).index_add_(0, index, torch.ones(index.numel(), dtype=torch.int64))
        for length in keys:
            sums[length].flush()
            counts[length].flush()
        done.update(windows=first + len(batch), adding=False)
        _write_json(work / "progress.json", done)
        progress(first + len(batch))
    for length, planned in keys.items():
        table = np.lib.format.open_memmap(work / f"values-{length}.npy", mode="r+")
        for first in range(0, planned.size, 4096):
            part = slice(first, min(first + 4096, planned.size))
            seen = np.flatnonzero(counts[length][part]) + first
            if seen.size:
                table[seen] = sums[length][seen] / counts[length][seen][:, None, None]
        table.flush()
        del table
    del sums, counts
    for length in keys:
        (work / f"sums-{length}.npy").unlink()
        (work / f"counts-{length}.npy").unlink()


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
        (work / f"{part}-{length}.npy").is_file() for length in range(1, n + 1) for part in ("keys", "alone", "values"))


def _write_json(path: Path, value) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(value))
    os.replace(staging, path)
