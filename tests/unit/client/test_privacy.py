"""Noise masking: exact results, adapters never leave the client, no clear activation reaches the executor."""

from __future__ import annotations

import threading

import pytest
import torch
from peft import get_peft_model

import symbiosis
from symbiosis import NoiseMasking
from symbiosis.transport.server import ExecutorServer
from helpers import assert_close, batch
from matrix import peft_config

MASK = NoiseMasking(pool=2, rows=64, scale=1.0, seed=0)


def _model(path, executor, arch, method, auto_class, privacy=None):
    torch.manual_seed(7)
    model = symbiosis.from_pretrained(path, executor, auto_class=auto_class, privacy=privacy)
    return get_peft_model(model, peft_config(method, arch))


def _step(model, arch, seed=0):
    model.train()
    torch.manual_seed(seed)
    out = model(**batch(arch, seed=seed))
    out.loss.backward()
    return out


@pytest.mark.parametrize("arch,method,checkpointing", [
    ("llama", "lora", False), ("llama", "ia3", False), ("llama", "prefix", False), ("gpt2", "lora", False),
    ("bert", "lora", False), ("llama", "dora_rslora_dropout_bias", False), ("gpt2", "dora", False),
    ("llama", "lora", True),  # backward's recomputed forward calls draw fresh noise
])
def test_masked_equals_unmasked(arch, method, checkpointing, checkpoints):
    """A masked client computes what a clear one does; with activation checkpointing too, where it recomputes
    its layers in backward and the clear one keeps every activation."""
    path, auto_class = checkpoints(arch)
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    clear = _model(path, executor, arch, method, auto_class)
    masked = _model(path, executor, arch, method, auto_class, privacy=MASK)
    if checkpointing:
        masked.gradient_checkpointing_enable()
    _step(masked, arch), _step(clear, arch)  # the first pass learns call groups; the second uses them
    for model in (masked, clear):
        model.zero_grad()
    ours, theirs = _step(masked, arch), _step(clear, arch)
    assert_close(ours.logits, theirs.logits, "logits")
    assert_close(ours.loss, theirs.loss, "loss")
    reference = dict(clear.named_parameters())
    for name, param in masked.named_parameters():
        if param.requires_grad:
            assert_close(param.grad, reference[name].grad, f"grad of {name}")


def test_masked_decoding_equals_unmasked(checkpoints):
    """Decoding with a KV cache makes one-token calls, which draw their noise row without a permutation:
    the logits of every step still equal the unmasked model's."""
    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    clear = _model(path, executor, "llama", "lora", auto_class).eval()
    masked = _model(path, executor, "llama", "lora", auto_class, privacy=MASK).eval()
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        outs = [model(input_ids=ids, use_cache=True) for model in (masked, clear)]
        for step in range(4):
            assert_close(outs[0].logits, outs[1].logits, f"logits at step {step}")
            token = outs[1].logits[:, -1:].argmax(-1)
            outs = [model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
                    for model, out in zip((masked, clear), outs)]


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_masking_over_transports(scheme, checkpoints, tmp_path):
    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    server = ExecutorServer(executor, f"ipc://{tmp_path}/x.sock" if scheme == "ipc" else "tcp://127.0.0.1:*").start()
    try:
        remote = _model(path, symbiosis.connect(server.url, timeout=10), "llama", "lora", auto_class, privacy=MASK)
        clear = _model(path, executor, "llama", "lora", auto_class)
        assert_close(_step(remote, "llama").logits, _step(clear, "llama").logits, "logits")
    finally:
        server.stop()


def _record(executor, making_pool: list | None = None) -> list[tuple[str, str, torch.Tensor]]:
    """Every tensor the executor receives: (op, layer, tensor); calls made while `making_pool` is non-empty
    (noise-effect computations) are recorded with op "pool"."""
    received = []
    submit = executor.submit

    def recording_submit(client_id, op, layer_id, tensor, inference=False, inline=False):
        received.append(("pool" if making_pool else op, layer_id, tensor.detach().clone()))
        return submit(client_id, op, layer_id, tensor, inference, inline)

    executor.submit = recording_submit
    return received


def _rows_shared(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6) -> bool:
    """Does any row of a equal (within tol) any row of b?"""
    return a.shape[-1] == b.shape[-1] and bool((torch.cdist(a.reshape(-1, a.shape[-1]),
                                                            b.reshape(-1, b.shape[-1])) < tol).any())


@pytest.mark.parametrize("method", ["lora", "dora"])  # DoRA sends A through the layer: masked, like activations
def test_executor_sees_no_adapter_and_no_clear_activation(method, checkpoints):
    path, auto_class = checkpoints("llama")
    masked_executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    clear_executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    clear_executor.attach(clear_executor.fingerprint, "bystander")  # no direct path: every call is recorded
    making_pool = []
    received, clear_calls = _record(masked_executor, making_pool), _record(clear_executor)
    masked = _model(path, masked_executor, "llama", method, auto_class, privacy=NoiseMasking(pool=2, rows=64))
    # made while building it: every pool at attach, and DoRA's initial norms (A masked like an activation)
    received[:] = [("pool", layer, tensor) for _, layer, tensor in received]
    session = masked.get_base_model().symbiosis_session
    make_pool = session._make_pool

    def tracked_make_pool(*args):  # noise effects: the executor sees every pool value, by design
        making_pool.append(True)
        try:
            return make_pool(*args)
        finally:
            making_pool.pop()

    session._make_pool = tracked_make_pool
    clear = _model(path, clear_executor, "llama", method, auto_class)
    del clear_calls[:]  # made while building it (DoRA's initial norms), as the masked model's are set aside above
    adapter_snapshots = []
    for model in (masked, clear):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for step in range(3):
            _step(model, "llama", seed=step)
            optimizer.step()
            optimizer.zero_grad()
            if model is masked:
                adapter_snapshots += [p.detach().clone() for p in model.parameters() if p.requires_grad]
    specs = masked_executor.layer_specs

    def per_layer(calls) -> dict[tuple[str, str], list[torch.Tensor]]:
        """Calls split back per layer: grouped calls ("q+k+v") share their input, and their gradients are
        the members' side by side."""
        split = {}
        for op, layer_id, tensor in calls:
            members = layer_id.split("+")
            pieces = [tensor] * len(members)
            if op == "backward" and len(members) > 1:
                pieces = torch.split(tensor, [specs[m].out_features for m in members], dim=1)
            for member, piece in zip(members, pieces):
                split.setdefault((op, member), []).append(piece)
        return split

    seen_per_layer = per_layer([c for c in received if c[0] != "pool"])
    clear = per_layer(clear_calls)
    assert {k: len(v) for k, v in seen_per_layer.items()} == {k: len(v) for k, v in clear.items()}  # same calls
    for op, layer, tensor in received:
        for adapter in adapter_snapshots:
            assert not _rows_shared(tensor, adapter) and not _rows_shared(tensor, adapter.t()), \
                f"an adapter tensor reached the executor in a {op} call to {layer}"
    for (op, layer), seen_tensors in seen_per_layer.items():
        for seen in seen_tensors:
            for plain in clear[(op, layer)]:
                assert not _rows_shared(seen, plain), f"a clear activation reached the executor ({op} {layer})"


def test_pool_refresh_recomputes_effects(checkpoints):
    from symbiosis.client.privacy import MaskedSession

    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    received = _record(executor)
    layer = "model.layers.0.mlp.up_proj"
    masking = NoiseMasking(pool=2, rows=32, refresh_every=2, mask_backward=False, seed=1)
    session = MaskedSession(executor.attach(executor.fingerprint), masking, [layer], torch.device("cpu"),
                            torch.float64)
    assert [op for op, _, _ in received] == ["forward_nobias"]  # the pool's effects, computed at attach
    x = torch.randn(5, 64, dtype=torch.float64)
    expected = x @ executor.weights.layers[layer].weight.T
    for _ in range(5):
        assert_close(session.forward(layer, x), expected, "masked forward")
    # 5 calls with a refresh every 2: new pools before the 3rd and the 5th call.
    assert [op for op, _, _ in received].count("forward_nobias") == 3
    # And through a whole model, across refreshes and call groups, results stay exact.
    model = _model(path, executor, "llama", "lora", auto_class, privacy=NoiseMasking(pool=2, rows=32,
                                                                                     refresh_every=2, seed=1))
    clear = _model(path, symbiosis.Executor.from_pretrained(path, dtype=torch.float64), "llama", "lora", auto_class)
    for step in range(4):
        assert_close(_step(model, "llama", step).logits, _step(clear, "llama", step).logits, f"logits {step}")


def test_masked_calls_batch_with_other_clients(checkpoints):
    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, policy="lockstep")
    models = [_model(path, executor, "llama", "lora", auto_class, privacy=MASK if i else None) for i in range(2)]
    reference = _step(_model(path, symbiosis.Executor.from_pretrained(path, dtype=torch.float64), "llama", "lora",
                             auto_class), "llama")
    outputs = [None, None]

    def run(i):
        outputs[i] = models[i](**batch("llama")).logits

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out in outputs:
        assert_close(out, reference.logits, "logits")
    assert executor.stats_snapshot()["overall"]["max_batch_calls"] >= 2
