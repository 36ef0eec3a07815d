"""Faults with real processes on loopback: a client killed mid-pass, a frozen client, an executor killed
and restarted. The executor and the surviving clients must carry on, with exact results."""

from __future__ import annotations

import glob
import signal
import time

import pytest
import torch

import symbiosis
from helpers import TOKEN, assert_close, start_executor, start_tenant
from tenant_process import build, train

pytestmark = pytest.mark.slow


def reference(model_dir, method, seed) -> dict[str, torch.Tensor]:
    executor = symbiosis.Executor.from_pretrained(model_dir, dtype=torch.float64, policy="none")
    return train(build(model_dir, executor, method, seed), seed)


@pytest.mark.parametrize("die_in", ["forward", "backward"])
def test_client_killed_mid_pass(die_in, checkpoints, tmp_path):
    model_dir, _ = checkpoints("llama")
    url = f"ipc://{tmp_path}/executor.sock"
    executor = start_executor(model_dir, url, tmp_path, policy="lockstep")
    try:
        victim = start_tenant(model_dir, url, "lora", 0, tmp_path / "victim.pt", "--die-in", die_in)
        survivors = {seed: start_tenant(model_dir, url, method, seed, tmp_path / f"{seed}.pt")
                     for seed, method in ((1, "lora"), (2, "ia3"))}
        assert victim.wait(timeout=120) == -signal.SIGKILL
        for seed, process in survivors.items():
            assert process.wait(timeout=180) == 0, f"survivor {seed} failed"
        # The dead client is detached; shared memory is anonymous (memfd), so nothing is left in any directory.
        executor.log.wait_for(r"detached tenant0-")
        assert not glob.glob("/dev/shm/symbiosis-*")
        assert executor.poll() is None
    finally:
        executor.terminate()
        assert executor.wait(timeout=30) == 0  # SIGTERM: clean shutdown
    for seed, method in ((1, "lora"), (2, "ia3")):
        ours, expected = torch.load(tmp_path / f"{seed}.pt"), reference(model_dir, method, seed)
        for name, value in expected.items():
            assert_close(ours[name], value, f"survivor {seed}: {name}")


def test_a_client_process_that_dies_is_detached_at_once_not_after_its_timeout(checkpoints, tmp_path):
    """An ipc:// client holds its handoff connection while its process lives: the executor detaches a killed
    client within a second or so, not after its heartbeat timeout (60 s here), which matters most when
    other tenants' calls wait behind the dead one's (lockstep batching here; a pipelined client's calls on
    the executor's GPU stream)."""
    model_dir, _ = checkpoints("llama")
    url = f"ipc://{tmp_path}/executor.sock"
    executor = start_executor(model_dir, url, tmp_path, policy="lockstep", client_timeout=60)
    try:
        victim = start_tenant(model_dir, url, "lora", 0, tmp_path / "victim.pt", "--die-in", "backward")
        assert victim.wait(timeout=120) == -signal.SIGKILL
        died = time.time()
        executor.log.wait_for(r"detached tenant0-", timeout=10)
        assert time.time() - died < 10
        assert not glob.glob("/dev/shm/symbiosis-*")
        worker = start_tenant(model_dir, url, "lora", 1, tmp_path / "1.pt")
        assert worker.wait(timeout=120) == 0
        # The worker exited without closing its session: detached as soon as the reaper looks, too.
        executor.log.wait_for(r"detached tenant1-", timeout=10)
    finally:
        executor.terminate()
        executor.wait(timeout=30)


def test_frozen_client_holds_no_one_up(checkpoints, tmp_path):
    model_dir, _ = checkpoints("llama")
    url = "tcp://127.0.0.1:46731"
    executor = start_executor(model_dir, url, tmp_path, policy="lockstep")
    frozen = start_tenant(model_dir, url, "lora", 0, tmp_path / "frozen.pt")
    try:
        executor.log.wait_for(r"attached tenant0-", timeout=60)
        frozen.send_signal(signal.SIGSTOP)  # attached, silent: no calls, no heartbeats
        started = time.time()
        worker = start_tenant(model_dir, url, "lora", 1, tmp_path / "1.pt")
        assert worker.wait(timeout=120) == 0
        assert time.time() - started < 90
        executor.log.wait_for(r"tenant0-\S+ silent for .*detaching it")
    finally:
        frozen.kill()
        executor.terminate()
        executor.wait(timeout=30)
    for name, value in reference(model_dir, "lora", 1).items():
        assert_close(torch.load(tmp_path / "1.pt")[name], value, name)


def test_executor_killed_and_restarted(checkpoints, tmp_path):
    model_dir, _ = checkpoints("llama")
    url = f"ipc://{tmp_path}/executor.sock"
    executor = start_executor(model_dir, url, tmp_path)
    with pytest.raises(symbiosis.Unauthorized):
        symbiosis.from_pretrained(model_dir, symbiosis.connect(url, token="wrong", timeout=5))
    model = build(model_dir, symbiosis.connect(url, token=TOKEN, timeout=3), "lora", 4)
    session = model.base_model.model.symbiosis_session
    g = torch.Generator().manual_seed(4)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    batches = [torch.randint(2, 128, (2, 10), generator=g) for _ in range(3)]

    def step(ids):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    try:
        step(batches[0])
        executor.kill()
        executor.wait()
        started = time.time()
        # ipc://: the handoff connection and the doorbell's pipes end with the executor's process, so the client
        # knows at once, not after its timeout (3 s here, 60 by default)
        with pytest.raises(symbiosis.ExecutorUnavailable, match="closed this client's connection|process is gone"):
            step(batches[1])
        assert time.time() - started < 2.5
        executor = start_executor(model_dir, url, tmp_path)
        with pytest.raises(symbiosis.ExecutorUnavailable, match="reconnect"):
            step(batches[1])
        session.reconnect()
        step(batches[1])
        step(batches[2])
    finally:
        executor.terminate()
        executor.wait(timeout=30)
    # Reference: the same three batches without interruption.
    reference_model = build(model_dir, symbiosis.Executor.from_pretrained(model_dir, dtype=torch.float64), "lora", 4)
    ref_opt = torch.optim.AdamW([p for p in reference_model.parameters() if p.requires_grad], lr=1e-2)
    reference_model.train()
    for ids in batches:
        ref_opt.zero_grad()
        reference_model(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
    reference_params = dict(reference_model.named_parameters())
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert_close(param.detach(), reference_params[name].detach(), name)
