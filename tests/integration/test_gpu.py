"""CUDA placements (run on the device machine; skipped on CPU): executor on the GPU with the client in-process,
in another process on the same GPU (CUDA IPC buffer), and on the CPU (shared host buffer, and tcp frames)."""

from __future__ import annotations

import os

import pytest
import torch
from peft import get_peft_model

import symbiosis
from helpers import TOKEN, batch, start_executor
from matrix import peft_config

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _train_step(path, executor, device, dtype=None, privacy=None):
    torch.manual_seed(0)
    model = get_peft_model(symbiosis.from_pretrained(path, executor, device=device, dtype=dtype, privacy=privacy),
                           peft_config("lora", "llama"))
    inputs = {k: v.to(device) for k, v in batch("llama").items()}
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
    model.base_model.model.symbiosis_session.close()  # a pipelined one leaves the device to the next test's
    return out.logits.detach().float().cpu(), grads


@pytest.fixture(scope="module")
def reference(checkpoints):
    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=torch.float32)
    return _train_step(path, executor, "cuda")


@pytest.mark.parametrize("client_device,scheme", [("cuda", "ipc"), ("cpu", "ipc"), ("cpu", "tcp")])
def test_placements_match_in_process(client_device, scheme, checkpoints, tmp_path, reference):
    path, _ = checkpoints("llama")
    url = f"ipc://{tmp_path}/x.sock" if scheme == "ipc" else "tcp://127.0.0.1:46999"
    process = start_executor(path, url, tmp_path, device="cuda:0", dtype="float32")
    try:
        logits, grads = _train_step(path, symbiosis.connect(url, token=TOKEN, timeout=60), client_device)
    finally:
        process.terminate()
        process.wait()
    ref_logits, ref_grads = reference
    assert _rel(logits, ref_logits) < 1e-5
    for name, grad in ref_grads.items():
        assert _rel(grads[name], grad) < 1e-4, name


def test_bf16_masking_stays_within_rounding(checkpoints):
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
    clear, _ = _train_step(path, executor, "cuda")
    masked, _ = _train_step(path, executor, "cuda", privacy=symbiosis.NoiseMasking(scale=0.5))
    assert _rel(masked, clear) < 3e-2


def test_cpu_client_buffer_is_pinned_by_a_cuda_executor(checkpoints, tmp_path):
    """A CPU client's shared host buffer is page-locked in the executor's process (DMA both ways); results
    still equal the executor's own layer."""
    from symbiosis.transport.server import ExecutorServer

    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=torch.float32)
    server = ExecutorServer(executor, f"ipc://{tmp_path}/pin.sock").start()
    try:
        session = symbiosis.connect(f"ipc://{tmp_path}/pin.sock").attach(executor.fingerprint, "cpu-client", "cpu")
        (client,) = server.clients.values()
        assert client.buffer.pinned
        layer = "model.layers.0.mlp.down_proj"
        x = torch.randn(7, executor.layer_specs[layer].in_features)
        expected = executor.weights.layers[layer].forward(x.cuda(), True).cpu()
        assert _rel(session.forward(layer, x), expected) < 1e-6
        session.close()
    finally:
        server.stop()


@pytest.mark.skipif("expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower(),
                    reason="expandable segments keep freed pages reserved in a segment that later allocations share: "
                           "the weights have no allocations of their own to hand back")
def test_fusing_a_group_hands_back_the_members_old_memory(tmp_path):
    """q/k/v fused into one weight: the members become views of it, and the memory of their old tensors goes
    back to the device instead of staying reserved by this process. Weights of 16 MiB each, so that each has
    a device allocation of its own (smaller ones share the allocator's segments, which then stay)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    executor = symbiosis.Executor.from_pretrained(tmp_path, device="cuda", dtype=torch.float32)
    group = "+".join(f"model.layers.0.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    fused = executor.weights.get(group)
    torch.cuda.synchronize()
    assert fused is not None and fused.weight.nbytes == 3 * 2048 * 2048 * 4
    assert torch.cuda.memory_reserved() - before < fused.weight.nbytes // 2  # not a second copy


def _lora_model(path, executor, seed: int = 0, name: str = "client"):
    torch.manual_seed(seed)
    return get_peft_model(symbiosis.from_pretrained(path, executor, device="cuda", name=name),
                          peft_config("lora", "llama"))


def _adamw_steps(model, device, steps=3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(2, 128, (2, 9), generator=generator).to(device)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return {n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}


def test_pipelined_calls_train_exactly_and_a_dead_executor_releases_the_stream(checkpoints, tmp_path):
    """A client on the executor's GPU makes its calls pipelined (its CPU waits for no call): three AdamW
    steps equal the in-process ones. Then the executor is killed: the next forward raises
    ExecutorUnavailable, and the client's stream, which was left waiting for flags the executor would never
    write, is released (a device-wide synchronize returns)."""
    import threading

    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = checkpoints("llama")
    expected = _adamw_steps(_lora_model(path, symbiosis.Executor.from_pretrained(path, device="cuda",
                                                                                 dtype=torch.float32)), "cuda")
    url = f"ipc://{tmp_path}/pipelined.sock"
    process = start_executor(path, url, tmp_path, device="cuda:0", dtype="float32", client_timeout=30)
    try:
        model = _lora_model(path, symbiosis.connect(url, token=TOKEN, timeout=5))
        session = model.base_model.model.symbiosis_session
        assert session.pipelined
        for name, value in _adamw_steps(model, "cuda").items():
            assert _rel(value, expected[name]) < 1e-5, name
        process.kill()
        process.wait()
        ids = torch.randint(2, 128, (2, 9), device="cuda")
        with pytest.raises(symbiosis.ExecutorUnavailable):
            model(input_ids=ids, labels=ids).loss.backward()
        synchronized = threading.Thread(target=torch.cuda.synchronize, daemon=True)
        synchronized.start()
        synchronized.join(timeout=20)
        assert not synchronized.is_alive(), "the client's stream still waits for the dead executor"
        with pytest.raises(symbiosis.ExecutorUnavailable, match="reconnect"):
            model(input_ids=ids)
    finally:
        process.kill()
        process.wait()


def test_pipelined_calls_to_an_executor_over_two_gpus_train_exactly(checkpoints, tmp_path):
    """The base over both GPUs of the executor's process (executor/peers.py): a pipelined client's calls for the
    second GPU's layers run on a stream of their own, which waits for each call's input flag itself; three AdamW
    steps equal the in-process ones."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = checkpoints("llama")
    expected = _adamw_steps(_lora_model(path, symbiosis.Executor.from_pretrained(path, device="cuda",
                                                                                 dtype=torch.float32)), "cuda")
    url = f"ipc://{tmp_path}/two-gpus.sock"
    process = start_executor(path, url, tmp_path, "opportunistic", 30, "cuda:0", "float32", None,
                             "--devices", "cuda:0,cuda:1")
    try:
        model = _lora_model(path, symbiosis.connect(url, token=TOKEN, timeout=30))
        assert model.base_model.model.symbiosis_session.pipelined
        for name, value in _adamw_steps(model, "cuda").items():
            assert _rel(value, expected[name]) < 1e-5, name
        model.base_model.model.symbiosis_session.close()
    finally:
        process.kill()
        process.wait()


def test_one_pipelined_client_per_process_and_device(checkpoints, tmp_path):
    """Sessions of one process share its CUDA stream, and the executor may take their calls in another order
    than that stream queued them: so only the first is pipelined, the second waits for its answers (through
    a host buffer). Trained in two threads at once, each equals its in-process twin."""
    import gc
    from concurrent.futures import ThreadPoolExecutor

    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = checkpoints("llama")

    def build(executor, seed):
        return _lora_model(path, executor, seed, name=f"t{seed}")

    local = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=torch.float32)
    expected = [_adamw_steps(build(local, seed), "cuda", steps=2) for seed in (0, 1)]
    url = f"ipc://{tmp_path}/two.sock"
    process = start_executor(path, url, tmp_path, device="cuda:0", dtype="float32", client_timeout=30)
    try:
        executor = symbiosis.connect(url, token=TOKEN, timeout=20)
        models = [build(executor, seed) for seed in (0, 1)]
        sessions = [m.base_model.model.symbiosis_session for m in models]
        assert [s.pipelined for s in sessions] == [True, False]
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda m: _adamw_steps(m, "cuda", steps=2), models))
        for got, want in zip(results, expected):
            for name, value in want.items():
                assert _rel(got[name], value) < 1e-5, name
        sessions[0].close()
        third = build(executor, 2)
        assert third.base_model.model.symbiosis_session.pipelined  # the device is free again
        del third  # dropped without close(): collecting the session gives the device up too
        gc.collect()
        fourth = build(executor, 3).base_model.model.symbiosis_session
        assert fourth.pipelined
        for session in (sessions[1], fourth):
            session.close()
    finally:
        process.kill()
        process.wait()


def test_pipelined_calls_with_activation_checkpointing_train_exactly(checkpoints, tmp_path):
    """Checkpointing puts a pipelined client's recomputed forward calls inside backward, between its
    backward calls: two AdamW steps still equal in-process ones without checkpointing."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = checkpoints("llama")
    expected = _adamw_steps(_lora_model(path, symbiosis.Executor.from_pretrained(path, device="cuda",
                                                                                 dtype=torch.float32)), "cuda", 2)
    url = f"ipc://{tmp_path}/checkpointed.sock"
    process = start_executor(path, url, tmp_path, device="cuda:0", dtype="float32", client_timeout=30)
    try:
        model = _lora_model(path, symbiosis.connect(url, token=TOKEN, timeout=5))
        model.gradient_checkpointing_enable()
        assert model.base_model.model.symbiosis_session.pipelined
        for name, value in _adamw_steps(model, "cuda", 2).items():
            assert _rel(value, expected[name]) < 1e-5, name
    finally:
        process.kill()
        process.wait()


def test_pipelined_client_processes_share_the_stream_and_a_dying_one_holds_no_one_up(checkpoints, tmp_path):
    """Three client processes on the executor's GPU make pipelined calls at once, so their calls share the
    executor's stream (interleaved, a bounded number each). One is killed in the middle of its backward pass,
    possibly with calls queued on that stream behind inputs it will never write: once it is reaped, the
    executor lets the stream run past them, and the other two finish with exactly the in-process results."""
    import signal

    from tenant_process import build, train
    from helpers import start_tenant

    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = checkpoints("llama")
    url = f"ipc://{tmp_path}/fleet.sock"
    process = start_executor(path, url, tmp_path, device="cuda:0", dtype="float32", client_timeout=2)
    survivors = {1: "lora", 2: "ia3"}
    try:
        on_gpu = ("--device", "cuda", "--dtype", "float32")
        victim = start_tenant(path, url, "lora", 0, tmp_path / "victim.pt", "--die-in", "backward", *on_gpu)
        workers = {seed: start_tenant(path, url, method, seed, tmp_path / f"{seed}.pt", *on_gpu)
                   for seed, method in survivors.items()}
        assert victim.wait(timeout=120) == -signal.SIGKILL
        for seed, worker in workers.items():
            assert worker.wait(timeout=180) == 0, f"survivor {seed} failed"
        process.log.wait_for(r"detached tenant0-")
        assert process.poll() is None
    finally:
        process.kill()
        process.wait()
    local = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=torch.float32)
    for seed, method in survivors.items():
        expected = train(build(path, local, method, seed, "cuda", torch.float32), seed)
        ours = torch.load(tmp_path / f"{seed}.pt")
        for name, value in expected.items():
            assert _rel(ours[name], value.cpu()) < 1e-5, f"survivor {seed}: {name}"
