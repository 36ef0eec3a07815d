"""Run a set of tenant processes together (start, wait for all to be ready, go, collect) with the GPU's
memory and utilisation sampled meanwhile, and (for symbiosis fleets) the executor's counters over the
working window. Used by the multi-tenant, policy, mixed-work and privacy benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common import ROOT, GpuSampler

HERE = Path(__file__).resolve().parent


@dataclass
class FleetGpu:
    used_gib: float  # GPU memory in use at peak by everything started, from before the tenants started
    busy_share: float  # mean GPU utilisation while the tenants worked, 0-1


def gpu_memory_mib() -> int:
    """Device memory in use now, all processes (0 without nvidia-smi)."""
    return GpuSampler.read()[0]


def run_fleet(tenants: list[dict], duration: float, on_go: Callable[[], None] | None = None,
              baseline_mib: int | None = None) -> tuple[list[dict], FleetGpu]:
    """tenants: keyword arguments of tenant.py per process (one process may hold several tenants: its results
    are all returned, in order); `on_go` is called as they start working.
    baseline_mib: device memory in use before the fleet's executor started (`gpu_memory_mib()`), so that
    the executor's memory counts as the fleet's; by default, what is in use when the tenants start."""
    go_file = Path(tempfile.mkdtemp()) / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]),
           # Tenants share the CPU with each other and the executor: OpenMP workers that spin while their
           # process waits (for an executor call, say) would take the cores the others need (README).
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    with GpuSampler(baseline_mib=baseline_mib) as memory:
        processes = []
        for spec in tenants:
            argv = [sys.executable, str(HERE / "tenant.py"), "--go-file", str(go_file), "--duration", str(duration)]
            for key, value in spec.items():
                if value is True:
                    argv.append(f"--{key.replace('_', '-')}")
                elif value not in (None, False):
                    argv += [f"--{key.replace('_', '-')}", str(value)]
            processes.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env))
        for p in processes:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a tenant exited before it was ready (code {p.wait()})")
        if on_go is not None:
            on_go()
        go_file.touch()
        went = time.time()
        results = []
        for p in processes:
            out = p.stdout.read().strip().splitlines()
            if p.wait() != 0 or not out:
                raise RuntimeError(f"a tenant failed (code {p.returncode})")
            result = json.loads(out[-1])  # one tenant's, or a list (one process of several tenants)
            results.extend(result if isinstance(result, list) else [result])
    return results, FleetGpu(memory.used_gib, memory.busy_share(went, went + duration))


class ExecutorWindow:
    """Where a symbiosis fleet's time went, from the executor's counters between `start` (pass it as
    run_fleet's on_go) and `shares` (call it when run_fleet returns): the share of the window each executor
    thread spent working (the I/O thread: doorbells, sockets, inline calls and answers; the batcher: batched
    GEMMs) and the compute time of the GEMMs (GPU time on a CUDA executor). The window ends when the tenants have exited, a little after their
    last iteration, so the shares are slight underestimates."""

    def __init__(self, url: str):
        self.url = url
        self._start: tuple[float, dict] | None = None

    def _stats(self) -> dict:
        import symbiosis

        return symbiosis.connect(self.url, timeout=30).stats()

    def start(self) -> None:
        self._start = (time.time(), self._stats())

    def shares(self) -> dict:
        started, before = self._start
        after, elapsed = self._stats(), time.time() - started
        busy = {role: after["busy_s"].get(role, 0.0) - before["busy_s"].get(role, 0.0)
                for role in ("io", "batcher")}
        calls = after["overall"]["calls"] - before["overall"]["calls"]
        batches = after["overall"]["batches"] - before["overall"]["batches"]
        return {"executor_io_busy": round(busy["io"] / elapsed, 3),
                "executor_batcher_busy": round(busy["batcher"] / elapsed, 3),
                "gemm_share": round((after["overall"]["compute_s"] - before["overall"]["compute_s"]) / elapsed, 3),
                "calls_per_s": round(calls / elapsed), "mean_calls_per_gemm": round(calls / max(1, batches), 3),
                "mean_queue_wait_ms": round(1e3 * (after["overall"]["queue_wait_s"] - before["overall"]["queue_wait_s"])
                                            / max(1, calls), 3)}
