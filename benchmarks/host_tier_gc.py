"""What the host tier's adapters cost Python's cyclic collector: the objects it tracks per adapter, and the time of a
full collection with `--adapters` of them in host memory (engine/adapters.py's store alone, no model). A full
collection holds the GIL throughout, so the engine's thread stops for it; `symbiosis serve` freezes its heap after
warm-up, but adapters read after that (tenants loading theirs, the host tier refilling from disk) are walked by
every full collection.

    python benchmarks/host_tier_gc.py --adapters 2000 --layers 16 --targets q_proj,v_proj

Each adapter is a directory of its own (hard links to `--distinct` written ones), read and checked as a tenant's
is. One JSON line: `tracked_per_adapter` (the collector's tracked objects, after a full collection, per adapter
held) and `full_collection_ms` (median of 5, with the adapters held) beside `empty_collection_ms` (the same
process before they were read): the difference is theirs. Run it on the tree before a change as well
(`PYTHONPATH=<that tree>/src`) for the side-by-side figure.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from engine import write_adapters  # noqa: E402
from hmi import tenant_directories  # noqa: E402
from placement_cpu import store_for  # noqa: E402


def full_collection_ms(repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapters", type=int, default=2000)
    parser.add_argument("--distinct", type=int, default=8)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--workdir", default="/tmp/symbiosis-bench-host-gc")
    args = parser.parse_args()
    name = f"tiny-{args.layers}l"
    common.CONFIGS[name] = dict(common.CONFIGS["tiny"], num_hidden_layers=args.layers)
    workdir = Path(args.workdir)
    distinct = write_adapters(name, args.distinct, args.rank, workdir / "distinct", tuple(args.targets.split(",")))
    directories = tenant_directories(distinct, args.adapters, workdir / "tenants")
    store = store_for(common.CONFIGS[name], torch.device("cpu"), slots=4, max_rank=args.rank)
    store.host_budget = 1 << 40
    empty = full_collection_ms()
    tracked_before = len(gc.get_objects())
    started = time.perf_counter()
    held = [store.load(f"t{i}", directory) for i, directory in enumerate(directories)]
    read_s = time.perf_counter() - started
    gc.collect()  # (what the collector untracks, it does in a full collection)
    tracked = len(gc.get_objects()) - tracked_before
    common.emit(bench="host_tier_gc", adapters=len(held), lora_layers=len(held[0].layers), targets=args.targets,
                tracked_per_adapter=round(tracked / len(held), 2), empty_collection_ms=round(empty, 2),
                full_collection_ms=round(full_collection_ms(), 2), read_s=round(read_s, 1),
                python=sys.version.split()[0])


if __name__ == "__main__":
    main()
