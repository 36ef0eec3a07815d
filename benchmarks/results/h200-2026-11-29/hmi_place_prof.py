"""cProfile of the engine's placements (hmi.py's `placement` phase), beside its own timing."""
import cProfile
import os
import sys
import time

sys.path.insert(0, "benchmarks")
import common  # noqa: E402
import hmi  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

original = hmi.placement_cpu


def profiled(engine, directories, samples=200, profile=None):
    out = original(engine, directories, samples)
    store = engine.adapters
    adapters = [store.load(f"t{i}", directories[i]) for i in range(min(len(directories), 2 * store.num_slots))]
    for label in ("a", "b"):
        prof, times, cpu = cProfile.Profile(), [], []
        for i in range(samples):
            t0, c0 = time.perf_counter(), time.thread_time()
            if label == "b":
                prof.enable()
            slot = store.acquire(adapters[i % len(adapters)])
            store.release(slot)
            if label == "b":
                prof.disable()
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            store.wait_all()
            torch.cuda.synchronize()
        print(label, "wall us", np.median(times) * 1e6, "cpu us", np.median(cpu) * 1e6, flush=True)
    with open(os.path.join(os.environ["OUT"], "hmi_place_calls.txt"), "w") as f:
        f.write(common.call_table(prof, samples, rows=45))
    return out


hmi.placement_cpu = profiled
hmi.main()
