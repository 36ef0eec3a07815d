"""The command line: the demo end to end (short), and `symbiosis executor --stats`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import symbiosis
from symbiosis.cli import main
from symbiosis.transport.server import ExecutorServer


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run([sys.executable, "-m", "symbiosis.cli", "demo", "--workdir", str(tmp_path), "--steps", "3"],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for tenant in ("poet", "counter"):
        assert f"[{tenant:6s}] step   3/3" in out and (tmp_path / "adapters" / tenant / "adapter_model.safetensors").is_file()
    assert out.count("[writer] ") == 6 and "tenants ended cleanly" in out


def test_stats_command(checkpoints, tmp_path, capsys):
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path)
    server = ExecutorServer(executor, "tcp://127.0.0.1:*", "s").start()
    (tmp_path / "token").write_text("s\n")
    try:
        model = symbiosis.from_pretrained(path, symbiosis.connect(server.url, token="s"), name="probe")
        started = time.perf_counter()
        model(torch.randint(0, 128, (1, 4)))
        wall = time.perf_counter() - started
        session = model.symbiosis_session  # what the executor cost this client: calls and time waiting on them
        assert session.calls > 0 and 0 < session.waited_s < wall
        capsys.readouterr()
        assert main(["executor", "--stats", server.url, "--token-file", str(tmp_path / "token")]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert any(c.startswith("probe") for c in stats["attached_clients"])
        # one forward call per base layer, but an MLP's three are one call (a block, over tcp://: client/blocks.py;
        # not the decoder layer's tail: this model's norms are trainable, and gradients are on)
        mlps = [spec for spec in executor.block_specs.values() if spec.kind == "gated_mlp"]
        assert stats["overall"]["calls"] == len(executor.layer_specs) - 2 * len(mlps)
        assert stats["per_layer"]["lm_head:forward"]["tokens"] == 4
        assert 0 < stats["busy_s"]["io"] < stats["uptime_s"]  # the I/O thread answered every call itself (inline)
    finally:
        server.stop()


def test_executor_command_names_a_bad_model_directory(tmp_path):
    with pytest.raises(SystemExit, match=f"symbiosis executor: {tmp_path}/missing: not a directory"):
        main(["executor", "--model", str(tmp_path / "missing"), "--listen", f"ipc://{tmp_path}/x.sock",
              "--device", "cpu"])
