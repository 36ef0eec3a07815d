"""Ten thousand tenants on one GPU (HMI §6, §7.8): the engine's tiered adapters under a burst of concurrent clients,
against one hot tenant, against loading adapters on demand (no host tier, no layer-wise prefetch), and against one
model copy per tenant; and how much of an adapter's copy time layer-wise prefetch hides.

    python benchmarks/hmi.py --model llama-3.2-1b --tenants 10000 --clients 250 --requests 12500

Tenants: `--distinct` random LoRA adapters (rank `--rank` on `--targets`, q and v by default, as PEFT writes them) and
`--tenants` adapter directories hard-linked to them in turn, so every tenant is a directory the engine reads,
checks and caches on its own (the disk holds `--distinct` adapters' bytes, the page cache serves the reads).
Each client sends its requests one after another (a `--prompt`-token prompt, `--output` greedy tokens) for a
random tenant; lines report throughput, p50/p99 latency (submit to last token), GPU memory and the host tier.

Phases: `hot` (every request for one tenant), `tiered` (random tenants, every adapter in the host tier first,
layer-wise prefetch), `on_demand` (random tenants, host tier off: each placement reads the disk, and each step
waits for all of its copies before it starts), `copies` (how many whole model copies the GPU holds: computed
from the free memory and the model's bytes, not run), `placement` (the CPU time of issuing one adapter's
placement: what the step that needs it pays on the engine's thread), `prefetch` (copy time of one adapter alone, against the
latency a new adapter adds to a prefill step with and without layer-wise waits, on an idle engine and, `loaded_*`, for
a request that joins 16 decoding requests; each new adapter paired with a resident one, the pair's order alternating),
`contention` (a resident adapter's steps alone and beside a large copy to the device that no step reads: what the
copy alone costs them, with no placement's host work).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import random
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CONFIGS, GcPauses, call_table, checkpoint, device, dtype, emit  # noqa: E402
from engine import write_adapters  # noqa: E402

from symbiosis.engine import Engine, SamplingParams  # noqa: E402
from symbiosis.engine import adapters as adapter_store  # noqa: E402


def tenant_directories(distinct: list[Path], tenants: int, root: Path) -> list[Path]:
    directories = []
    for i in range(tenants):
        directory = root / f"tenant-{i}"
        directories.append(directory)
        if (directory / "adapter_model.safetensors").exists():
            continue
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            os.link(distinct[i % len(distinct)] / name, directory / name)
    return directories


def host_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def burst(engine: Engine, directories: list[Path], clients: int, requests: int, prompt: int, output: int,
          vocab: int, pick, seed: int) -> dict:
    """`clients` threads, each sending its share of `requests` one after another; latencies in ms."""
    latencies, lock = [], threading.Lock()
    params = SamplingParams(max_tokens=output, ignore_eos=True)

    def client(index: int, count: int):
        rng = random.Random(seed * 100_003 + index)
        for _ in range(count):
            tenant = pick(rng)
            ids = [rng.randrange(vocab) for _ in range(prompt)]
            started = time.perf_counter()
            engine.submit(ids, params, (f"t{tenant}", directories[tenant])).result()
            with lock:
                latencies.append((time.perf_counter() - started) * 1000)

    shares = [requests // clients + (i < requests % clients) for i in range(clients)]
    threads = [threading.Thread(target=client, args=(i, n)) for i, n in enumerate(shares)]
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    return {"requests": requests, "seconds": elapsed, "requests_per_s": requests / elapsed,
            "tokens_per_s": requests * output / elapsed, "p50_ms": float(np.percentile(latencies, 50)),
            "p99_ms": float(np.percentile(latencies, 99)),
            "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "host_rss_gib": host_rss_gib(), "tiers": engine.adapters.tiers()}


def prefill_ms(engine: Engine, directory: Path, name: str, prompt: list[int], before=None) -> float:
    """One prompt's prefill on an idle engine, the device synchronized around it; `before()` issued just before the
    clock starts."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    if before is not None:
        before()
    started = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1), [(name, directory)])
    sync()
    return (time.perf_counter() - started) * 1000


def first_token_ms(engine: Engine, directory: Path, name: str, prompt: list[int]) -> float:
    """Submit to first token of one request, whatever else the running engine is doing."""
    started = time.perf_counter()
    next(iter(engine.submit(prompt, SamplingParams(max_tokens=1), (name, directory))))
    return (time.perf_counter() - started) * 1000


def prefetch(engine: Engine, directories: list[Path], vocab: int, prompt_len: int, samples: int,
             background: int = 16, profile: str | None = None, calls: str | None = None,
             loads: tuple = ("idle_", "loaded_")) -> dict:
    """Copy time alone (host tier -> a slot, synchronized) against what a new adapter adds to a prefill: alone on
    an idle engine (prefill_ms), and as the first token of a request that joins `background` decoding requests
    (`loaded_*`: the engine's thread then builds and launches each step while the one before runs on the GPU, where a
    placement's host work and its copies have the running step beside them). `calls`: a file for cProfile's tables
    of the placing calls in the timed new steps (by own time, idle and loaded): which of the store's calls into torch
    cost the host what, where it counts. `loads`: which of the two to measure ("idle_", "loaded_")."""
    store, rng = engine.adapters, random.Random(7)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    # tenants the bursts are least likely to have left resident (5 a sample: its copy, and a new one in each of
    # the four ways of measuring; t0 and t1 stay resident)
    fresh = iter(range(len(directories) - 1, 1, -1))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    copies, device_copies = [], []
    for _ in range(samples):
        i = next(fresh)
        adapter = store.load(f"t{i}", directories[i])  # into the host tier first: copies alone are timed
        sync()
        side = store._copy_stream
        if side is not None:  # the copies' own time on the GPU, apart from the host's issuing them
            marks = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            marks[0].record(side)
        started = time.perf_counter()
        slot = store.acquire(adapter)
        if side is not None:
            marks[1].record(side)
        store.wait_all()
        sync()
        copies.append((time.perf_counter() - started) * 1000)
        if side is not None:
            device_copies.append(marks[0].elapsed_time(marks[1]))
        store.release(slot)
    result = {"copy_ms": float(np.median(copies))}
    if device_copies:  # what layer-wise waits can hide at best: the host's issuing is on the step's path
        result["copy_device_ms"] = float(np.median(device_copies))
    # The two ways of waiting, interleaved sample by sample: a drift of the GPU's clocks or of the engine's state
    # then lands on both (run on the H100 one after the other, their resident prefills differed by 10 ms).
    for load, measure in [m for m in (("", prefill_ms), ("loaded_", first_token_ms)) if (m[0] or "idle_") in loads]:
        running = start_decoding(engine, directories[0], prompt, background if load else 0)
        for _ in range(2):  # warm: the step's shapes compiled (and, loaded, captured) before anything is timed
            measure(engine, directories[1], "t1", prompt)
        # what lives on (the model, compiled code, the tiers' adapters) out of the collector's sight, as `symbiosis
        # serve` freezes its heap after warm-up: a full collection of it stops every thread for up to hundreds of ms
        gc.collect()
        gc.freeze()
        times = {(layerwise, kind): [] for layerwise in (True, False) for kind in ("resident", "new")}
        # the placement's host time in each new step: in `acquire` (on the step's path), in `prefetch` (beside the
        # step before it, loaded only)
        placing = {(layerwise, way): [] for layerwise in (True, False) for way in ("acquire", "prefetch")}
        placing_cpu = {key: [] for key in placing}  # the placing thread's CPU time in them
        # the collections that remain, during the timed samples
        profiler = cProfile.Profile() if calls else None
        with GcPauses() as pauses, PlacementClock(store, profiler) as clock:
            for sample in range(samples):
                if sample % 10 == 0:  # progress, for a run cut short by its time limit
                    print(f"prefetch {load or 'idle'}: sample {sample} of {samples}", file=sys.stderr, flush=True)
                for layerwise in (True, False):
                    store.layerwise = layerwise
                    i = next(fresh)
                    store.load(f"t{i}", directories[i])
                    # t1 stays put; not t0, the background's: a new adapter's step holds two adapters' segments, and so
                    # must the resident one's (with t0 the loaded figures measured a second adapter's SGMV work too)
                    pair = [("resident", directories[1], "t1"), ("new", directories[i], f"t{i}")]
                    # A step right after the host's reading of the new adapter (tens of ms for a large one: the GPU
                    # idle, the host's caches swept by the copy into its buffer) ran 1.3-2.4 ms slower on the H100,
                    # whichever adapter it had: that step is not timed. (With the first of each pair paying it, and
                    # the order alternating to even it out, the differences split in two clusters about 2 x that
                    # apart, which is what the medians' intervals measured.) Which goes first still alternates.
                    measure(engine, directories[1], "t1", prompt)
                    for kind, directory, name in pair if sample % 2 == 0 else pair[::-1]:
                        before, cpu_before = dict(clock.seconds), dict(clock.cpu_seconds)
                        times[layerwise, kind].append(measure(engine, directory, name, prompt))
                        if kind == "new":
                            for way in before:
                                placing[layerwise, way].append((clock.seconds[way] - before[way]) * 1000)
                                placing_cpu[layerwise, way].append((clock.cpu_seconds[way] - cpu_before[way]) * 1000)
        result[f"{load}gc_pauses"] = pauses.by_generation  # generation -> [collections, ms], every thread's
        if profiler is not None:
            with open(calls, "a") as file:
                file.write(f"# {load or 'idle '}placements of the timed new steps ({2 * samples}, both ways of "
                           "waiting): the calls on the placing threads\n" + call_table(profiler, 2 * samples))
        stop_decoding(running)
        for layerwise in (True, False):
            resident, new = times[layerwise, "resident"], times[layerwise, "new"]
            differences = np.array(new) - np.array(resident)  # paired: each new one with its neighbour
            added = float(np.median(differences))
            low, high = _median_interval(differences)
            key = load + ("layerwise" if layerwise else "whole_step")
            result.update({f"{key}_resident_ms": float(np.median(resident)), f"{key}_new_ms": float(np.median(new)),
                           f"{key}_added_ms": added, f"{key}_added_ci95_ms": [low, high],
                           # the pairs' spread: how far one step's jitter reaches against what an adapter adds
                           f"{key}_added_quartiles_ms": np.percentile(differences, [25, 75]).tolist(),
                           f"{key}_resident_quartiles_ms": np.percentile(resident, [25, 75]).tolist(),
                           # resident first, new first: equal unless the pair's order still matters
                           f"{key}_added_by_order_ms": [float(np.median(differences[0::2])),
                                                        float(np.median(differences[1::2]))],
                           # the host's issuing of the new adapter's copies on the engine's thread: what a
                           # host-bound step adds however well its copies are hidden
                           **{f"{key}_{way}_host_ms": float(np.median(placing[layerwise, way]))
                              for way in ("acquire", "prefetch")},
                           **{f"{key}_{way}_host_cpu_ms": float(np.median(placing_cpu[layerwise, way]))
                              for way in ("acquire", "prefetch")},
                           f"{key}_hidden": 1 - added / result["copy_ms"],
                           f"{key}_hidden_ci95": [1 - high / result["copy_ms"], 1 - low / result["copy_ms"]]})
    store.layerwise = True
    if profile:
        profile_pairs(engine, directories, fresh, prompt, profile)
    return result


def start_decoding(engine: Engine, directory: Path, prompt: list[int], count: int) -> list:
    """`count` requests of the resident adapter t0 decoding until `stop_decoding` (a row is left for a timed one)."""
    params = SamplingParams(max_tokens=min(4096, (engine.context_limit or 8192) - 64), ignore_eos=True)
    count = min(count, engine.scheduler.max_running - 1)
    running = [engine.submit(prompt[:64], params, ("t0", directory)) for _ in range(count)]
    for handle in running:
        next(iter(handle))
    return running


def stop_decoding(running: list) -> None:
    for handle in running:
        handle.cancel()
    for handle in running:
        for _ in handle:  # to its end: the engine is idle again
            pass


def contention(engine: Engine, directories: list[Path], vocab: int, prompt_len: int, samples: int,
               background: int = 16, piece_bytes: int = 4 << 20) -> dict:
    """What an adapter's copy costs a step with no placement at all: a resident adapter's prefill (idle) and first
    token (beside `background` decoding requests), alone and with a large adapter's bytes copied from pinned host
    memory to the device on a side stream, issued just before the request: `whole` (one copy) or in `pieces` of
    `piece_bytes`. A new adapter brings host work (its placement, clocked by `prefetch`) and such a copy. If the copy
    alone adds time to a step whose GPU work it does not touch, something of the step's waits behind it (its own
    small host-to-device uploads, on the same copy engine, say); if pieces add less, the wait is one copy long.
    (On the CPU the copies run at once, before the clock: a smoke run of the code, no measurement.)"""
    store, rng = engine.adapters, random.Random(11)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    source = store.load("t2", directories[2]).buffer  # (pinned on a GPU engine)
    target = torch.empty_like(source, device=store.device)
    side = torch.cuda.Stream(store.device) if store.device.type == "cuda" else None
    piece = max(1, piece_bytes // source.element_size())

    def copy(way: str) -> None:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if way == "whole":
                target.copy_(source, non_blocking=True)
            elif way == "pieces":
                for lo in range(0, source.numel(), piece):
                    target[lo:lo + piece].copy_(source[lo:lo + piece], non_blocking=True)

    def idle(way: str) -> float:  # (the copy issued before the clock starts: only what it does to the step is timed)
        return prefill_ms(engine, directories[1], "t1", prompt, before=lambda: copy(way))

    def loaded(way: str) -> float:
        copy(way)
        elapsed = first_token_ms(engine, directories[1], "t1", prompt)
        if side is not None:
            side.synchronize()
        return elapsed

    result = {"copy_bytes": source.numel() * source.element_size(), "piece_bytes": piece_bytes}
    ways = ("alone", "whole", "pieces")
    for load, measure in (("", idle), ("loaded_", loaded)):
        running = start_decoding(engine, directories[0], prompt, background if load else 0)
        for way in ways * 2:  # warm
            measure(way)
        times = {way: [] for way in ways}
        for sample in range(samples):
            for way in (ways if sample % 2 == 0 else ways[::-1]):  # the order alternating, as in `prefetch`
                times[way].append(measure(way))
        stop_decoding(running)
        result[f"{load}alone_ms"] = float(np.median(times["alone"]))
        for way in ("whole", "pieces"):
            differences = np.array(times[way]) - np.array(times["alone"])
            result[f"{load}{way}_added_ms"] = float(np.median(differences))
            result[f"{load}{way}_added_ci95_ms"] = list(_median_interval(differences))
    return result


class PlacementClock:
    """The host time the store's placing calls take while open, summed per call: `seconds` {"acquire": s,
    "prefetch": s} of wall time, `cpu_seconds` of the calling thread's CPU time (less than the wall time by what the
    call waited: for the GIL, say, while another thread held it); `profiler` (a cProfile.Profile) is enabled inside
    them (on the engine's thread, or the placer's)."""

    def __init__(self, store, profiler=None):
        self.store, self.profiler = store, profiler
        self.seconds, self.cpu_seconds = {"acquire": 0.0, "prefetch": 0.0}, {"acquire": 0.0, "prefetch": 0.0}

    def _timed(self, name: str):
        method = getattr(self.store, name)

        def call(*args):
            if self.profiler is not None:
                self.profiler.enable()
            started, cpu_started = time.perf_counter(), time.thread_time()
            try:
                return method(*args)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.cpu_seconds[name] += time.thread_time() - cpu_started
                if self.profiler is not None:
                    self.profiler.disable()
        return call

    def __enter__(self) -> "PlacementClock":
        for name in self.seconds:
            setattr(self.store, name, self._timed(name))
        return self

    def __exit__(self, *exc) -> None:
        for name in self.seconds:
            delattr(self.store, name)  # the class's methods again


def profile_pairs(engine: Engine, directories: list[Path], fresh, prompt: list[int], path: str, pairs: int = 4) -> None:
    """torch.profiler over `pairs` idle layer-wise prefills with a resident adapter and as many with a new one:
    where the time a new adapter adds goes, operator by operator (CPU and device totals of the new prefills minus
    the resident ones', per prefill), and one chrome trace of each kind (`path`.resident.json, .new.json)."""
    store, totals = engine.adapters, {}
    store.layerwise = True
    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # every thread (the engine's, where the step runs), with Python frames: a placement is mostly Python
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    for kind in ("resident", "new", "resident", "new"):  # twice each: the second of a kind is the one traced
        ops: dict[str, list[float]] = {}
        with torch.profiler.profile(activities=activities, with_stack=True, experimental_config=config) as profiler:
            walls = []
            for _ in range(pairs):
                if kind == "new":
                    i = next(fresh)
                    store.load(f"t{i}", directories[i])
                    walls.append(prefill_ms(engine, directories[i], f"t{i}", prompt))
                else:
                    walls.append(prefill_ms(engine, directories[1], "t1", prompt))
        for event in profiler.key_averages():
            key = re.sub(r" at 0x[0-9a-f]+", "", event.key)  # a bound method's object differs between runs
            counts = ops.setdefault(key, [0.0, 0.0, 0.0])
            for index, value in enumerate((event.count, event.self_cpu_time_total, event.self_device_time_total)):
                counts[index] += value / pairs / (1 if index == 0 else 1000)
        totals[kind] = (ops, float(np.median(walls)))
        profiler.export_chrome_trace(f"{path}.{kind}.json")
    (resident, resident_ms), (new, new_ms) = totals["resident"], totals["new"]
    rows = []
    for key in set(resident) | set(new):
        a, b = resident.get(key, [0, 0, 0]), new.get(key, [0, 0, 0])
        rows.append((b[1] - a[1], b[2] - a[2], b[0] - a[0], a[1], b[1], key))
    rows.sort(key=lambda row: -abs(row[0]) - abs(row[1]))
    lines = [f"prefill wall, median of {pairs}: resident {resident_ms:.2f} ms, new {new_ms:.2f} ms",
             "per prefill: self CPU ms new-resident | self device ms new-resident | calls new-resident | "
             "CPU resident | CPU new | operator"]
    lines += [f"{d_cpu:+8.3f} {d_dev:+8.3f} {d_calls:+8.1f} {cpu_a:8.3f} {cpu_b:8.3f}  {key}"
              for d_cpu, d_dev, d_calls, cpu_a, cpu_b, key in rows[:60]]
    Path(path).write_text("\n".join(lines) + "\n")


def _median_interval(values: np.ndarray, resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of `values`: whether a difference of a fraction of a millisecond
    between steps of ~40 ms is there at all."""
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(values, size=(resamples, len(values)), replace=True), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def placement_cpu(engine: Engine, directories: list[Path], samples: int = 200, profile: str | None = None) -> dict:
    """Median wall time of `acquire` placing an adapter already in the host tier (the copies issued on the side
    stream, not waited for): the CPU time of a placement, which the step that needs it pays. `profile`: a file for
    torch.profiler's table of where a further `samples` placements spent their CPU time (operator by operator)."""
    store, times = engine.adapters, []
    adapters = [store.load(f"t{i}", directories[i]) for i in range(min(len(directories), 2 * store.num_slots))]

    def place_adapter(adapter) -> None:
        store.release(store.acquire(adapter))

    def place(i: int) -> None:
        place_adapter(adapters[i % len(adapters)])

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def settle() -> None:
        # the copies done before the next placement: else hundreds queued fill the stream's queue, and the host's
        # issuing waits for the copies (at 335 MB an adapter it measured their time, 6.6 ms, not the host's)
        store.wait_all()
        sync()

    def timed(placing, *args) -> float:
        """Milliseconds of `placing(*args)`, its copies then done, untimed."""
        started = time.perf_counter()
        placing(*args)
        elapsed = (time.perf_counter() - started) * 1000
        settle()
        return elapsed

    times = [timed(place, i) for i in range(samples)]
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            for i in range(samples):
                place(i)
                settle()
        Path(profile).write_text(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    # The same placements on a host as the prefetch phase's timed steps find it, where they cost ~4x this: after
    # 128 MB of host memory was written (what reading a large adapter does to the caches), and of an adapter read
    # from disk just before (its host buffer new to the copies: the pinned memory allocator's, the driver's)
    sweep, swept, fresh = torch.empty(128 << 20, dtype=torch.uint8), [], []
    for i in range(samples // 4):
        sweep.fill_(i)
        swept.append(timed(place, i))
    first = len(adapters)
    for i in range(first, min(len(directories) // 2, first + samples // 4)):  # (prefetch takes the last ones)
        adapter = store.load(f"t{i}", directories[i])
        sync()
        fresh.append(timed(place_adapter, adapter))
    # ... and by a thread woken for it after a pause, as the engine's placer is (its core maybe idle, its caches cold)
    woken, wake, done = [], threading.Event(), threading.Event()

    def placer() -> None:
        for i in range(samples // 4):
            wake.wait()
            wake.clear()
            started = time.perf_counter()
            place(i)
            woken.append((time.perf_counter() - started) * 1000)
            done.set()
    thread = threading.Thread(target=placer)
    thread.start()
    for _ in range(samples // 4):
        time.sleep(0.03)  # (a prefill's time)
        wake.set()
        done.wait()
        done.clear()
        settle()
    thread.join()
    return {"placement_cpu_ms": float(np.median(times)), "samples": samples,
            "placement_cpu_swept_ms": float(np.median(swept)), "placement_cpu_fresh_ms": float(np.median(fresh)),
            "placement_cpu_woken_ms": float(np.median(woken))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS))
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--distinct", type=int, default=100)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q_proj,v_proj", help="the projections each adapter has LoRA on")
    parser.add_argument("--clients", type=int, default=250)
    parser.add_argument("--requests", type=int, default=12_500)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=16)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--phases", default="hot,tiered,on_demand,copies,placement,prefetch")
    parser.add_argument("--workdir", default="/tmp/symbiosis-bench-hmi")
    parser.add_argument("--samples", type=int, default=150, help="`prefetch`: pairs a mode (5 new adapters each)")
    parser.add_argument("--prefetch-prompt", type=int, default=1024,
                        help="`prefetch`: the timed prefill's tokens (longer: more layers' work to hide a copy behind)")
    parser.add_argument("--placement-profile", help="`placement` also writes torch.profiler's table to this file")
    parser.add_argument("--placement-calls", help="`prefetch` also writes cProfile's tables of the timed steps' "
                        "placing calls to this file")
    parser.add_argument("--prefetch-loads", default="idle,loaded",
                        help="`prefetch`: on an idle engine, beside decoding requests, or both (a shorter run)")
    parser.add_argument("--prefetch-profile", help="`prefetch` also profiles idle layer-wise prefills, resident "
                        "against new, into this file (and chrome traces beside it)")
    parser.add_argument("--host-gib", type=float, default=256,
                        help="the host tier's budget (large adapters: `prefetch` loads 5 new ones a sample)")
    parser.add_argument("--wave-bytes", type=int, default=adapter_store.WAVE_BYTES,
                        help="engine.adapters.WAVE_BYTES: the least of an adapter a wave takes (a 91 MB adapter goes in "
                        "one wave at 100000000, in five at the default); each wave costs the placing thread ~25 us")
    parser.add_argument("--switch-interval", type=float,
                        help="sys.setswitchinterval for the run (`symbiosis serve` sets 5e-4; Python's default is 5e-3)")
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    adapter_store.WAVE_BYTES = args.wave_bytes

    workdir = Path(args.workdir)
    model_dir = checkpoint(args.model)
    distinct = write_adapters(args.model, args.distinct, args.rank, workdir / "distinct", tuple(args.targets.split(",")))
    directories = tenant_directories(distinct, args.tenants, workdir / "tenants")
    vocab = CONFIGS[args.model]["vocab_size"]
    engine = Engine.from_pretrained(model_dir, device=device(), dtype=dtype(), kv_blocks=args.clients * 2 + 64,
                                    block_size=64, max_running=args.clients, max_lora_rank=args.rank,
                                    adapter_slots=args.slots, max_batch_tokens=max(4096, args.prefetch_prompt + 64),
                                    adapter_host_bytes=int(args.host_gib * 2**30))
    engine.start()
    common = dict(bench="hmi", model=args.model, tenants=args.tenants, distinct=args.distinct, rank=args.rank,
                  targets=args.targets, switch_interval=sys.getswitchinterval(), wave_bytes=args.wave_bytes,
                  clients=args.clients, prompt=args.prompt, output=args.output, slots=args.slots,
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    phases = args.phases.split(",")
    run = dict(clients=args.clients, prompt=args.prompt, output=args.output, vocab=vocab)
    try:
        # warm: every batch shape the bursts reach compiled and captured, the first slots filled (a shape first met
        # inside a timed burst costs seconds of compilation, which would land in that burst's p99)
        # (only for the phases that burst: prefetch warms its own shapes, and on an 8B model this warm-up alone
        # outlasted a 250-s call)
        if {"hot", "tiered", "on_demand"} & set(phases):
            burst(engine, directories, **run, requests=min(2 * args.clients, args.requests),
                  pick=lambda rng: rng.randrange(args.slots), seed=99)
        if "hot" in phases:
            emit(**common, phase="hot", **burst(engine, directories, **run, requests=args.requests,
                                                 pick=lambda rng: 0, seed=1))
        if "tiered" in phases:
            started = time.perf_counter()
            for i, directory in enumerate(directories):  # registration: every tenant's adapter read and checked
                engine.adapters.load(f"t{i}", directory)
            registered = time.perf_counter() - started
            emit(**common, phase="tiered", register_s=registered,
                 **burst(engine, directories, **run, requests=args.requests,
                         pick=lambda rng: rng.randrange(args.tenants), seed=2))
        if "on_demand" in phases:
            engine.adapters.host_budget, engine.adapters.layerwise = 0, False
            emit(**common, phase="on_demand", **burst(engine, directories, **run, requests=args.requests,
                                                       pick=lambda rng: rng.randrange(args.tenants), seed=2))
            engine.adapters.host_budget, engine.adapters.layerwise = int(args.host_gib * 2**30), True
        if "copies" in phases and torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            model_bytes = sum(layer.base.weight.numel() * layer.base.weight.element_size()
                              for layer in engine.model.modules() if hasattr(layer, "base")) + \
                sum(p.numel() * p.element_size() for p in engine.model.parameters())
            emit(**common, phase="copies", model_gib=model_bytes / 2**30, gpu_total_gib=total / 2**30,
                 copies_that_fit=int(total * 0.95 // model_bytes), computed=True)
        if "placement" in phases:  # the CPU time a placement takes on the engine's thread (issuing, not copying)
            emit(**common, phase="placement", **placement_cpu(engine, directories, profile=args.placement_profile))
        if "contention" in phases:
            emit(**common, phase="contention", prompt_tokens=args.prefetch_prompt,
                 **contention(engine, directories, vocab, args.prefetch_prompt, args.samples))
        if "prefetch" in phases:
            samples = min(args.samples, (args.tenants - 10) // 5)  # 5 fresh tenants a sample, 8 for the profile
            emit(**common, phase="prefetch", prompt_tokens=args.prefetch_prompt,
                 **prefetch(engine, directories, vocab, args.prefetch_prompt, samples, profile=args.prefetch_profile,
                           calls=args.placement_calls,
                           loads=tuple(f"{load}_" for load in args.prefetch_loads.split(","))))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
