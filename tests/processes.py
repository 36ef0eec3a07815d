"""Executor and tenant processes for the tests that need real ones (faults, isolation)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import symbiosis

HERE = Path(__file__).parent
TOKEN = "fault-test-token"


def start_executor(model_dir, url, tmp_path, policy="opportunistic", client_timeout=2.0, device="cpu",
                   dtype="float64", tenants: dict[str, str] | None = None, *extra: str) -> subprocess.Popen:
    """An executor process; `tenants` (name -> token) beside the admin, whose token is TOKEN."""
    token_file = tmp_path / "tenants"
    token_file.write_text("".join(f"{name} {token}\n" for name, token in {"admin": TOKEN, **(tenants or {})}.items()))
    process = subprocess.Popen([sys.executable, "-m", "symbiosis.cli", "executor", "--model", str(model_dir),
                                "--listen", url, "--device", device, "--dtype", dtype, "--policy", policy,
                                "--max-wait-ms", "50", "--client-timeout", str(client_timeout),
                                "--token-file", str(token_file), *extra])
    deadline = time.time() + 90
    while time.time() < deadline:
        assert process.poll() is None, "executor exited during start-up"
        try:
            symbiosis.connect(url, token=TOKEN, timeout=0.5).stats()
            return process
        except symbiosis.ExecutorUnavailable:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("executor did not come up")


def start_tenant(model_dir, url, method, seed, out, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "tenant_process.py"), str(model_dir), url, TOKEN, method,
                             str(seed), str(out), *extra], env={**os.environ, "OMP_NUM_THREADS": "1"})


def attached(url) -> list[str]:
    return symbiosis.connect(url, token=TOKEN, timeout=5).stats()["attached_clients"]


def wait_until(condition, timeout=20.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


