"""The adapter store alone (engine/adapters.py, no model): the host time of placing an adapter into a device slot,
at a real model's layer count and the tiny model's widths, so the copies cost little and the store's own work
shows, or (`--model`) at a real model's widths too. On the CPU the copies run at once; on a GPU they are queued on
the side stream and waited for between samples, untimed (as `hmi.py --phases placement` does with a whole engine).

    python benchmarks/placement_cpu.py --layers 16 --targets q_proj,v_proj
    python benchmarks/placement_cpu.py --layers 16 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --wave-bytes 1000
    python benchmarks/placement_cpu.py --model llama-3.2-1b --rank 64 --max-rank 64 --waves 1,3,6 \
        --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --profile placement.txt

`--wave-bytes` lowers engine.adapters.WAVE_BYTES so that an adapter this small goes in several waves, as a large one
does; `--waves` runs once for each cap on the waves (engine.adapters.PLACEMENT_WAVES). One JSON line each:
`placement_us` (median of `--samples` placements, each evicting another adapter). `--profile`: cProfile's table of
the last run's placements (by own time: which of the store's calls into torch cost the host what).
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from engine import PROJECTIONS, projection_shapes, write_adapters  # noqa: E402

from symbiosis.engine import adapters as adapter_store  # noqa: E402
from symbiosis.model.partition import BaseLayerSpec  # noqa: E402


def store_for(config: dict, device: torch.device, slots: int, max_rank: int = 16) -> adapter_store.AdapterStore:
    """The engine's store for a Llama-shaped model of `config`, q/k/v and gate/up fused as the engine fuses them."""
    shapes = projection_shapes(config)
    modules, groups = {}, []
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for block, names in PROJECTIONS.items():
            for name in names:
                layer_id = f"{prefix}.{block}.{name}"
                modules[layer_id] = BaseLayerSpec(layer_id, "linear", *shapes[name], layer_id + ".weight", None)
        groups += [tuple(f"{prefix}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")),
                   tuple(f"{prefix}.mlp.{n}" for n in ("gate_proj", "up_proj"))]
    return adapter_store.AdapterStore(modules, None, "placement-cpu", device, torch.bfloat16, max_rank=max_rank,
                                      slots=slots, groups=groups)


def placements(store, adapters: list, count: int, sync, profiler=None) -> list[float]:
    """`count` placements of `adapters` in turn (8 over 4 slots: each evicts another), their copies waited for
    untimed: each one's host time in microseconds, inside `profiler` where given."""
    times = []
    for i in range(count):
        if profiler is not None:
            profiler.enable()
        started = time.perf_counter()
        store.release(store.acquire(adapters[i % len(adapters)]))
        times.append((time.perf_counter() - started) * 1e6)
        if profiler is not None:
            profiler.disable()
        store.wait_all()
        sync()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a real model's widths and layers (common.CONFIGS), not the tiny model's")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-rank", type=int, default=16)
    parser.add_argument("--wave-bytes", type=int, default=adapter_store.WAVE_BYTES)
    parser.add_argument("--waves", default=str(adapter_store.PLACEMENT_WAVES), help="caps on a placement's waves")
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--profile", help="cProfile's table of the last run's placements, to this file")
    parser.add_argument("--workdir", default="/tmp/symbiosis-bench-placement")
    args = parser.parse_args()
    adapter_store.WAVE_BYTES = args.wave_bytes
    name = args.model or f"tiny-{args.layers}l"
    if args.model is None:
        common.CONFIGS[name] = dict(common.CONFIGS["tiny"], num_hidden_layers=args.layers)
    device = torch.device(common.device())
    directories = write_adapters(name, 8, args.rank, Path(args.workdir), tuple(args.targets.split(",")))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    caps = [int(cap) for cap in args.waves.split(",")]
    for run, cap in enumerate(caps):
        adapter_store.PLACEMENT_WAVES = cap
        store = store_for(common.CONFIGS[name], device, slots=4, max_rank=args.max_rank)
        adapters = [store.load(f"t{i}", d) for i, d in enumerate(directories)]
        times = placements(store, adapters, 50 + args.samples, sync)[50:]  # (the first 50 warm up)
        if args.profile and run == len(caps) - 1:  # a further pass, profiled (the timed one is not)
            profiler = cProfile.Profile()
            placements(store, adapters, args.samples, sync, profiler)
            Path(args.profile).write_text(f"{args.samples} placements, waves <= {cap}\n"
                                          + common.call_table(profiler, args.samples))
        waves = len(adapter_store.wave_bounds(len(adapters[0].layers), adapters[0].buffer.nbytes))
        common.emit(bench="placement_cpu", model=name, layers=common.CONFIGS[name]["num_hidden_layers"],
                    targets=args.targets, rank=args.rank, max_rank=args.max_rank, adapter_mb=adapters[0].nbytes / 1e6,
                    lora_layers=len(adapters[0].layers), waves=waves, samples=args.samples,
                    placement_us=round(float(np.median(times)), 1), device=str(device))
        del store, adapters


if __name__ == "__main__":
    main()
