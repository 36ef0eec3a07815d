"""The adapter store alone (engine/adapters.py, no model): the host time of placing an adapter into a device slot,
at a real model's layer count and the tiny model's widths, so the copies cost little and the store's own work
shows. On the CPU the copies run at once; on a GPU they are queued on the side stream and waited for between
samples, untimed (as `hmi.py --phases placement` does with a whole engine).

    python benchmarks/placement_cpu.py --layers 16 --targets q_proj,v_proj
    python benchmarks/placement_cpu.py --layers 16 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --wave-bytes 1000

`--wave-bytes` lowers engine.adapters.WAVE_BYTES so that an adapter this small goes in several waves, as a large one
does. One JSON line: `placement_us` (median of `--samples` placements, each evicting another adapter).
"""

from __future__ import annotations

import argparse
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


def store_for(config: dict, device: torch.device, slots: int) -> adapter_store.AdapterStore:
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
    return adapter_store.AdapterStore(modules, None, "placement-cpu", device, torch.bfloat16, max_rank=16,
                                      slots=slots, groups=groups)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--wave-bytes", type=int, default=adapter_store.WAVE_BYTES)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--workdir", default="/tmp/symbiosis-bench-placement")
    args = parser.parse_args()
    adapter_store.WAVE_BYTES = args.wave_bytes
    name = f"tiny-{args.layers}l"
    common.CONFIGS[name] = dict(common.CONFIGS["tiny"], num_hidden_layers=args.layers)
    device = torch.device(common.device())
    store = store_for(common.CONFIGS[name], device, slots=4)
    adapters = [store.load(f"t{i}", d) for i, d in enumerate(
        write_adapters(name, 8, args.rank, Path(args.workdir), tuple(args.targets.split(","))))]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(50 + args.samples):  # 8 adapters over 4 slots: every placement evicts one
        started = time.perf_counter()
        store.release(store.acquire(adapters[i % len(adapters)]))
        if i >= 50:
            times.append((time.perf_counter() - started) * 1e6)
        store.wait_all()
        sync()
    waves = len(adapter_store.wave_bounds(len(adapters[0].layers), adapters[0].buffer.nbytes))
    common.emit(bench="placement_cpu", layers=args.layers, targets=args.targets, rank=args.rank,
                lora_layers=len(adapters[0].layers), waves=waves, samples=args.samples,
                placement_us=round(float(np.median(times)), 1), device=str(device))


if __name__ == "__main__":
    main()
