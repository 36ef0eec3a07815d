"""The sharded executor on the CPU (gloo, float64): 2 and 4 processes give exactly the single executor's numbers,
for every layer's calls and for a split model's training step, in process and over tcp://; a shard killed mid-way
fails its layers' calls clearly (no hang) while the rest keep serving; close() stops every shard."""

from __future__ import annotations

import signal
import time

import pytest
import torch

import symbiosis
from helpers import assert_close, assert_same_step_on, batch
from matrix import make_checkpoint
from symbiosis.errors import ExecutorUnavailable
from symbiosis.executor.peers import on_devices
from symbiosis.executor.sharded import launch_sharded, place


def test_placement_keeps_decoder_layers_whole_and_balances_bytes(checkpoints):
    path, _ = checkpoints("llama")
    single = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    specs = [layer.spec for layer in single.weights.layers.values()]
    placement = place(specs, 2)
    for spec in specs:  # every layer of one decoder block on one rank; the head on rank 0
        block = spec.layer_id.split(".layers.")[1].split(".")[0] if ".layers." in spec.layer_id else None
        siblings = {placement[s.layer_id] for s in specs if block is not None and f".layers.{block}." in s.layer_id}
        assert block is None and placement[spec.layer_id] == 0 or len(siblings) == 1
    assert {placement[s.layer_id] for s in specs if ".layers.0." in s.layer_id} == {0}
    assert {placement[s.layer_id] for s in specs if ".layers.1." in s.layer_id} == {1}
    single.close()


@pytest.mark.parametrize("world, split", [(2, "layers"), (4, "layers"), (2, "columns"), (3, "columns")])
def test_sharded_equals_single_executor(world, split, checkpoints, tmp_path):
    """Whole layers per rank: the very same GEMMs, to the bit. Columns split over the ranks: each output column
    from a GEMM of a slice, and grad_x summed over the ranks: float64 rounding apart."""
    path, auto_class = checkpoints("llama")
    if world == 4:  # a decoder layer per rank
        auto_class = make_checkpoint("llama", tmp_path, num_hidden_layers=4)
        path = tmp_path
    single = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    sharded = launch_sharded(path, ["cpu"] * world, dtype=torch.float64, split=split)
    rtol = 0.0 if split == "layers" else 1e-12
    same = (lambda a, b: torch.equal(a, b)) if rtol == 0 else (lambda a, b: assert_close(a, b, "call", rtol) or True)
    try:
        # layer id -> its rank, or -1: split over every rank (Llama has no MoE experts, which stay whole)
        assert set(sharded.placement.values()) == (set(range(world)) if split == "layers" else {-1})
        assert sharded.layer_specs == single.layer_specs
        ours, theirs = sharded.attach(sharded.fingerprint, "a"), single.attach(single.fingerprint, "a")
        torch.manual_seed(0)
        for layer_id, spec in single.layer_specs.items():  # every layer's calls, wherever it lives
            x, g = torch.randn(5, spec.in_features, dtype=torch.float64), torch.randn(5, spec.out_features,
                                                                                     dtype=torch.float64)
            assert same(ours.forward(layer_id, x), theirs.forward(layer_id, x))
            assert same(ours.forward_nobias(layer_id, x), theirs.forward_nobias(layer_id, x))
            assert same(ours.backward(layer_id, g), theirs.backward(layer_id, g))
            assert torch.equal(ours.fetch(layer_id)[0], theirs.fetch(layer_id)[0])
            assert same(ours.weight_norms(layer_id), theirs.weight_norms(layer_id))
        # a split model's training step (its q/k/v and gate/up calls grouped)
        assert_same_step_on(path, auto_class, [single, sharded], "rslora_all_linear", rtol=rtol)
        if split == "columns":  # each rank holds its slice of every layer, no more
            assert sharded.weights.nbytes < single.weights.nbytes / world * 1.2
    finally:
        sharded.close()
        single.close()
    assert all(p.returncode == 0 for p in sharded.shards), "every shard stopped cleanly"


def test_clients_over_tcp_attach_to_a_sharded_executor(checkpoints):
    from symbiosis.transport.server import ExecutorServer

    path, auto_class = checkpoints("llama")
    single = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    sharded = launch_sharded(path, ["cpu", "cpu"], dtype=torch.float64)
    server = ExecutorServer(sharded, "tcp://127.0.0.1:0").start()
    try:
        remote = symbiosis.connect(server.url, timeout=30)
        split = symbiosis.from_pretrained(path, remote, auto_class=auto_class, dtype=torch.float64)
        plain = symbiosis.from_pretrained(path, single, auto_class=auto_class, dtype=torch.float64)
        inputs = {k: v for k, v in batch("llama").items() if k != "labels"}
        with torch.no_grad():
            assert_close(split(**inputs).logits, plain(**inputs).logits, "logits over tcp", rtol=0)
        split.symbiosis_session.close()
    finally:
        server.stop()
        sharded.close()
        single.close()


def test_a_killed_shard_fails_its_layers_clearly_and_the_rest_keep_serving(checkpoints):
    path, _ = checkpoints("llama")
    sharded = launch_sharded(path, ["cpu", "cpu"], dtype=torch.float64, timeout_s=20)
    try:
        session = sharded.attach(sharded.fingerprint, "a")
        on_shard = next(i for i, rank in sharded.placement.items() if rank == 1)
        at_front = next(i for i, rank in sharded.placement.items() if rank == 0)
        spec, front_spec = sharded.layer_specs[on_shard], sharded.layer_specs[at_front]
        session.forward(on_shard, torch.ones(2, spec.in_features, dtype=torch.float64))
        sharded.shards[0].send_signal(signal.SIGKILL)
        sharded.shards[0].wait(10)
        started = time.monotonic()
        with pytest.raises(ExecutorUnavailable, match="shard rank 1 .* is gone"):
            session.forward(on_shard, torch.ones(2, spec.in_features, dtype=torch.float64))
        with pytest.raises(ExecutorUnavailable, match="shard rank 1"):  # and at once from then on
            session.backward(on_shard, torch.ones(2, spec.out_features, dtype=torch.float64))
        assert time.monotonic() - started < 15, "no hang"
        out = session.forward(at_front, torch.ones(2, front_spec.in_features, dtype=torch.float64))
        assert out.shape == (2, front_spec.out_features)
    finally:
        sharded.close()


def _same_logits_as_single(path, auto_class, url: str, single) -> None:
    """A client attached at `url` (token TOKEN) computes the logits a client of `single` does, to the bit."""
    from helpers import TOKEN

    split = symbiosis.from_pretrained(path, symbiosis.connect(url, token=TOKEN, timeout=30), auto_class=auto_class,
                                      dtype=torch.float64)
    plain = symbiosis.from_pretrained(path, single, auto_class=auto_class, dtype=torch.float64)
    inputs = {k: v for k, v in batch("llama").items() if k != "labels"}
    with torch.no_grad():
        assert torch.equal(split(**inputs).logits, plain(**inputs).logits)
    split.symbiosis_session.close()


def test_the_executor_command_shards_over_devices_and_serves_ipc_clients(checkpoints, tmp_path):
    """`symbiosis executor --devices cpu,cpu` launches its shard itself; a client over ipc:// gets the single
    executor's logits; SIGTERM stops the front and its shard."""
    from helpers import start_executor

    path, auto_class = checkpoints("llama")
    url = f"ipc://{tmp_path}/sharded.sock"
    process = start_executor(path, url, tmp_path, "opportunistic", 2.0, "cpu", "float64", None, "--devices", "cpu,cpu")
    single = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    try:
        assert process.log.wait_for(r"sharded over cpu,cpu")
        _same_logits_as_single(path, auto_class, url, single)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        single.close()
    assert process.log.wait_for(r"^\[executor\] stopped")


@pytest.mark.gpu
def test_a_gpu_rank_and_a_cpu_rank_equal_the_single_gpu_executor(checkpoints):
    """One GPU: the front's layers on it, the other shard's on the CPU (gloo carries CPU tensors between them)."""
    path, _ = checkpoints("llama")
    single = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=torch.float64)
    sharded = launch_sharded(path, ["cuda:0", "cpu"], dtype=torch.float64)
    try:
        ours, theirs = sharded.attach(sharded.fingerprint, "a"), single.attach(single.fingerprint, "a")
        torch.manual_seed(0)
        for layer_id, spec in single.layer_specs.items():
            x = torch.randn(3, spec.in_features, dtype=torch.float64, device="cuda")
            assert_close(ours.forward(layer_id, x), theirs.forward(layer_id, x), layer_id, rtol=1e-12)
            g = torch.randn(3, spec.out_features, dtype=torch.float64, device="cuda")
            assert_close(ours.backward(layer_id, g), theirs.backward(layer_id, g), layer_id, rtol=1e-12)
    finally:
        sharded.close()
        single.close()


def test_under_torchrun_each_rank_takes_its_device_and_rank_0_serves(checkpoints, tmp_path):
    """`torchrun --nproc-per-node 2 -m symbiosis.cli executor --devices cpu,cpu ...`: the launcher the field uses;
    a client over ipc:// gets the single executor's logits."""
    import socket
    import subprocess
    import sys

    from helpers import TOKEN, ExecutorLog

    path, auto_class = checkpoints("llama")
    token_file = tmp_path / "tenants"
    token_file.write_text(f"admin {TOKEN}\n")
    url = f"ipc://{tmp_path}/torchrun.sock"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "symbiosis.cli",
                                "executor", "--model", str(path), "--listen", url, "--devices", "cpu,cpu", "--dtype",
                                "float64", "--token-file", str(token_file)], stderr=subprocess.PIPE, text=True)
    process.log = ExecutorLog.reading(process.stderr)
    single = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    try:
        process.log.wait_for(r"^\[executor\] serving .*sharded over cpu,cpu", timeout=120)
        _same_logits_as_single(path, auto_class, url, single)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        single.close()
    assert process.log.wait_for(r"^\[executor\] stopped")


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["layers", "columns"])
@pytest.mark.parametrize("launch", [launch_sharded, on_devices], ids=["processes", "one_process"])
def test_on_two_gpus_the_sharded_executor_equals_one_gpu(split, launch, checkpoints):
    """Two GPUs (NCCL between processes, or both driven by one), bf16: every layer's calls within bf16 rounding
    of the single-GPU executor's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path, _ = checkpoints("llama")
    single = symbiosis.Executor.from_pretrained(path, device="cuda:0", dtype=torch.bfloat16)
    sharded = launch(path, ["cuda:0", "cuda:1"], dtype=torch.bfloat16, split=split)
    try:
        ours, theirs = sharded.attach(sharded.fingerprint, "a"), single.attach(single.fingerprint, "a")
        torch.manual_seed(0)
        for layer_id, spec in single.layer_specs.items():
            x = torch.randn(4, spec.in_features, dtype=torch.bfloat16, device="cuda:0")
            g = torch.randn(4, spec.out_features, dtype=torch.bfloat16, device="cuda:0")
            assert_close(ours.forward(layer_id, x).float(), theirs.forward(layer_id, x).float(), layer_id, rtol=2e-2)
            assert_close(ours.backward(layer_id, g).float(), theirs.backward(layer_id, g).float(), layer_id,
                         rtol=2e-2)
    finally:
        sharded.close()
        single.close()
