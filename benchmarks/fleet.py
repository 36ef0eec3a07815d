"""Run a set of tenant processes together (start, wait for all to be ready, go, collect) with the GPU's
memory sampled meanwhile. Used by the multi-tenant, policy, mixed-work and privacy benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, GpuMemorySampler

HERE = Path(__file__).resolve().parent


def run_fleet(tenants: list[dict], duration: float) -> tuple[list[dict], float]:
    """tenants: keyword arguments of tenant.py per process. Returns (results, GiB of GPU memory in use at
    peak by everything started, measured from before the tenants started)."""
    go_file = Path(tempfile.mkdtemp()) / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])}
    with GpuMemorySampler() as memory:
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
        go_file.touch()
        results = []
        for p in processes:
            out = p.stdout.read().strip().splitlines()
            if p.wait() != 0 or not out:
                raise RuntimeError(f"a tenant failed (code {p.returncode})")
            results.append(json.loads(out[-1]))
    return results, memory.used_gib
