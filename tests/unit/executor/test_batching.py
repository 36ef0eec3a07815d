"""Per-layer batching: results per client do not depend on policy or on who else is attached; inference
overtakes training; waits shrink as work queues up."""

from __future__ import annotations

import threading

import pytest
import torch
from peft import get_peft_model

import symbiosis
from symbiosis.executor.batcher import Batcher
from symbiosis.executor.policy import ClientCounts, Lockstep, NoBatching, Opportunistic, QueuedCall, Queues
from symbiosis.executor.stats import ExecutorStats
from helpers import assert_close
from matrix import peft_config

# Tenants of different shapes and PEFT methods: (name, method, batch size, sequence length)
TENANTS = [("a", "lora", 1, 5), ("b", "ia3", 2, 9), ("c", "prompt", 4, 3), ("d", "lokr", 3, 7)]  # no dropout: threads share the global RNG


def _tenant_run(model, batch_size, length, seed, steps=2):
    """Two AdamW steps; returns (losses, final trainable tensors)."""
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        ids = torch.randint(2, 128, (batch_size, length), generator=g)
        torch.manual_seed(seed)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _build(path, executor, method, seed):
    torch.manual_seed(seed)
    return get_peft_model(symbiosis.from_pretrained(path, executor), peft_config(method, "llama"))


@pytest.mark.parametrize("policy", ["none", "lockstep", "opportunistic"])
def test_concurrent_clients_get_their_solo_results(policy, checkpoints):
    path, _ = checkpoints("llama")
    solo_executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, policy="none")
    solo = {name: _tenant_run(_build(path, solo_executor, method, i), bs, sl, i)
            for i, (name, method, bs, sl) in enumerate(TENANTS)}

    shared = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, policy=policy)
    models = {name: _build(path, shared, method, i) for i, (name, method, _, _) in enumerate(TENANTS)}
    if policy == "none":  # every call would run alone: each client runs its GEMMs itself, on its own thread
        layer = models[TENANTS[0][0]].base_model.model.model.layers[0].mlp.up_proj
        assert layer.session.direct(layer.layer_id, torch.zeros(1, 64, dtype=torch.float64)) is not None
    results, errors, start = {}, [], threading.Barrier(len(TENANTS))

    def run(i, name, bs, sl):
        try:
            start.wait()
            results[name] = _tenant_run(models[name], bs, sl, i)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, n, bs, sl)) for i, (n, _, bs, sl) in enumerate(TENANTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, (losses, params) in solo.items():
        for ours, theirs in zip(results[name][0], losses):
            assert_close(ours, theirs, f"{name} loss under {policy}")
        for key, value in params.items():
            assert_close(results[name][1][key], value, f"{name} {key} under {policy}")
    snapshot = shared.stats_snapshot()
    stats = snapshot["overall"]
    if policy == "none":
        assert stats["max_batch_calls"] == 1
    if policy == "lockstep":
        assert stats["max_batch_calls"] >= 2, stats  # concatenated calls of several clients into one GEMM
        assert 0 < snapshot["busy_s"]["batcher"] < snapshot["uptime_s"]  # those ran on the batcher's thread


def _queues(*calls: tuple[str, str, int, bool, float]) -> Queues:
    queues = Queues()
    for layer, client, tokens, inference, arrived in calls:
        queues.by_key.setdefault((layer, "forward"), []).append(QueuedCall(client, tokens, inference, arrived))
    return queues


def test_opportunistic_serves_inference_first_and_waits_less_as_work_grows():
    policy = Opportunistic(max_wait=0.010, target_tokens=1000)
    queues = _queues(("l0", "train", 400, False, 0.0), ("l5", "infer", 1, True, 0.001))
    decision = policy.decide(queues, 0.002, ClientCounts(attached=3, active=3))
    assert decision.key == ("l5", "forward") and decision.only_inference
    # Training alone, others still active: it waits, and the budget shrinks with the queued tokens.
    small = policy.decide(_queues(("l0", "a", 100, False, 0.0)), 0.0, ClientCounts(3, 3))
    large = policy.decide(_queues(("l0", "a", 800, False, 0.0)), 0.0, ClientCounts(3, 3))
    assert small.key is None and large.key is None and small.wait > large.wait > 0
    assert policy.decide(_queues(("l0", "a", 100, False, 0.0)), 0.0095, ClientCounts(3, 3)).key == ("l0", "forward")
    # Every active client is queued, or enough tokens: no wait.
    both = _queues(("l0", "a", 10, False, 0.0), ("l1", "b", 10, False, 0.0))
    assert policy.decide(both, 0.0, ClientCounts(attached=5, active=2)).key is not None
    assert policy.decide(_queues(("l0", "a", 1000, False, 0.0)), 0.0, ClientCounts(3, 3)).key == ("l0", "forward")


def test_opportunistic_stops_waiting_when_company_never_comes_and_probes_again():
    policy = Opportunistic(max_wait=0.010, target_tokens=1000, probe_every=4)
    counts = ClientCounts(attached=3, active=3)
    lone = _queues(("l0", "a", 100, False, 0.0))
    for _ in range(3):  # three waits in a row that end with the call still alone
        assert policy.decide(lone, 0.0, counts).key is None
        assert policy.decide(lone, 0.02, counts).key == ("l0", "forward")
    assert policy.company_rate < 0.5
    # Lone calls now run at once, but one in probe_every still waits.
    assert [policy.decide(lone, 0.0, counts).key is None for _ in range(4)] == [False, False, False, True]
    # That probe finds company: waiting pays again.
    met = _queues(("l0", "a", 100, False, 0.0), ("l0", "b", 100, False, 0.001))
    assert policy.decide(met, 0.02, counts).key == ("l0", "forward")
    assert policy.company_rate >= 0.5
    assert policy.decide(lone, 0.0, counts).key is None


def test_opportunistic_never_holds_a_pipelined_call_but_batches_what_is_queued_with_it():
    policy = Opportunistic(max_wait=0.010, target_tokens=1000)  # waiting pays (company_rate 1.0)
    counts = ClientCounts(attached=4, active=4)
    assert policy.decide(_queues(("l0", "a", 100, False, 0.0)), 0.0, counts).key is None  # a plain call waits
    queues = _queues(("l0", "a", 100, False, 0.0), ("l1", "b", 100, False, 0.001), ("l1", "c", 100, False, 0.002))
    queues.by_key[("l1", "forward")][0].may_wait = False  # b's is pipelined: its key runs now, c's call with it
    assert policy.decide(queues, 0.003, counts).key == ("l1", "forward")
    inference = _queues(("l1", "b", 100, False, 0.0), ("l2", "d", 1, True, 0.001))
    inference.by_key[("l1", "forward")][0].may_wait = False
    assert policy.decide(inference, 0.002, counts).key == ("l2", "forward")  # inference still goes first


def test_lockstep_waits_for_every_attached_client_then_gives_up():
    policy = Lockstep(max_wait=0.05)
    two = _queues(("l0", "a", 5, False, 0.0), ("l0", "b", 5, False, 0.0))
    assert policy.decide(two, 0.0, ClientCounts(attached=2, active=2)).key == ("l0", "forward")
    waiting = policy.decide(two, 0.01, ClientCounts(attached=3, active=2))
    assert waiting.key is None and waiting.wait == pytest.approx(0.04)
    assert policy.decide(two, 0.06, ClientCounts(attached=3, active=2)).key == ("l0", "forward")


def test_no_batching_runs_calls_alone_inference_first():
    queues = _queues(("l0", "a", 5, False, 0.0), ("l0", "b", 5, False, 0.1), ("l1", "c", 1, True, 0.2))
    assert NoBatching().decide(queues, 1.0, ClientCounts(3, 3)).key == ("l1", "forward")


def test_inference_calls_overtake_a_queued_training_burst():
    """A busy executor with training calls queued: an inference call that arrives later is served first."""
    order, first_running, release = [], threading.Event(), threading.Event()

    def layer(key, x):
        if not first_running.is_set():  # the first training call holds the batcher until the rest are queued
            first_running.set()
            release.wait(5)
        order.append(key[0])
        return x

    batcher = Batcher(layer, NoBatching(), lambda: 2, ExecutorStats(torch.device("cpu")))
    training = [batcher.submit("trainer", (f"train{i}", "forward"), torch.zeros(4, 2), False) for i in range(5)]
    assert first_running.wait(5)
    inference = batcher.submit("chat", ("infer", "forward"), torch.zeros(1, 2), True)
    release.set()
    inference.result(timeout=5)
    for f in training:
        f.result(timeout=5)
    batcher.close()
    assert order == ["train0", "infer", "train1", "train2", "train3", "train4"], order


def test_out_of_memory_fails_only_the_call_that_does_not_fit(checkpoints, tmp_path, monkeypatch):
    """A full device: the batch that runs out of memory is retried call by call, so only the call too
    large to fit fails, with an error that names it; the other client's call in that batch succeeds, and
    the executor keeps serving (in-process and over ipc://)."""
    from symbiosis.executor.store import BaseLayer
    from symbiosis.transport.server import ExecutorServer

    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, policy="lockstep")
    layer_id = "model.layers.0.mlp.up_proj"
    layer = executor.weights.layers[layer_id]
    real_forward = BaseLayer.forward

    def forward_with_a_small_device(self, x, with_bias=True):
        if x.shape[0] > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward(self, x, with_bias)

    monkeypatch.setattr(BaseLayer, "forward", forward_with_a_small_device)
    big_client, small_client = (executor.attach(executor.fingerprint, name) for name in ("big", "small"))
    big, small = torch.randn(90, 64, dtype=torch.float64), torch.randn(20, 64, dtype=torch.float64)
    # Lockstep batches the two calls (110 tokens: does not fit); alone, 90 and 20 would.
    futures = [executor.submit(big_client.client_id, "forward", layer_id, torch.cat([big, big])),
               executor.submit(small_client.client_id, "forward", layer_id, small)]
    with pytest.raises(symbiosis.ExecutorOutOfMemory, match=r"180 tokens of forward on 'model.layers.0.mlp.up_proj'"):
        futures[0].result(timeout=10)
    assert_close(futures[1].result(timeout=10), real_forward(layer, small), "the other client's call")
    assert_close(big_client.forward(layer_id, big), real_forward(layer, big), "a call that fits, afterwards")
    small_client.close()

    server = ExecutorServer(executor, f"ipc://{tmp_path}/oom.sock").start()
    try:
        remote = symbiosis.connect(server.url, timeout=10).attach(executor.fingerprint, "remote")
        big_client.close()  # lockstep would wait for it
        with pytest.raises(symbiosis.ExecutorOutOfMemory, match="send fewer tokens per call"):
            remote.forward(layer_id, torch.cat([big, big]))
        assert_close(remote.forward(layer_id, big), real_forward(layer, big), "remote call that fits")
        remote.close()
    finally:
        server.stop()
