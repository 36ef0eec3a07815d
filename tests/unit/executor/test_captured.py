"""Blocks' calls replayed from CUDA graphs (executor/captured.py, `Executor(capture_blocks=True)`): the bookkeeping
on the CPU with a stand-in graph (captured the second time a call is seen, replayed after, least recently used out,
a failed capture eager for good, large calls never captured), the option's path through the executor, and on a GPU
the replays against the eager calls."""

from __future__ import annotations

import threading

import pytest
import torch

import symbiosis
from symbiosis.executor import captured


class _StandIn:
    """A graph that records its capture and replays by calling again (the bookkeeping, off the GPU)."""
    made: list = []
    released: list = []

    def __init__(self, call, x):
        _StandIn.made.append(x.shape)
        self.call = call

    def replay(self, x):
        return self.call(x) + 1000  # marked: a replay is told from an eager call

    def release(self):
        _StandIn.released.append(self)


@pytest.fixture
def stand_in(monkeypatch):
    _StandIn.made, _StandIn.released = [], []
    monkeypatch.setattr(captured, "_Graph", _StandIn)
    monkeypatch.setattr(captured, "_capturable", lambda x: True)
    return _StandIn


def test_off_the_gpu_calls_run_as_they_are():
    calls = captured.CapturedCalls()
    x = torch.randn(3, 4)
    for _ in range(3):
        torch.testing.assert_close(calls(("block", "forward"), lambda t: t * 2, x), x * 2)
    assert (calls.captures, calls.replays) == (0, 0)


def test_a_call_is_captured_the_second_time_it_is_seen_and_replayed_after(stand_in):
    calls = captured.CapturedCalls()
    x = torch.zeros(2, 3)
    results = [calls(("tail", "forward"), lambda t: t + 1, x)[0, 0].item() for _ in range(4)]
    assert results == [1, 1001, 1001, 1001]  # eager (seen), captured and replayed, replayed, replayed
    assert (calls.captures, calls.replays, stand_in.made) == (1, 3, [(2, 3)])
    # another op, another shape: graphs of their own
    calls(("tail", "backward"), lambda t: t, x)
    calls(("tail", "forward"), lambda t: t + 1, torch.zeros(5, 3))
    assert calls.captures == 1


def test_graphs_past_the_limit_go_least_recently_used_first(stand_in):
    calls = captured.CapturedCalls(max_graphs=2)
    shapes = [torch.zeros(rows, 2) for rows in (1, 2, 3)]
    for x in shapes:
        for _ in range(2):
            calls(("mlp", "forward"), lambda t: t, x)
    assert calls.captures == 3 and len(calls._graphs) == 2
    assert [key[2] for key in calls._graphs] == [(2, 2), (3, 2)]  # the first went, once its last replay was done
    assert len(stand_in.released) == 1 and stand_in.released[0] not in calls._graphs.values()


def test_an_evicted_shape_is_seen_again_before_it_is_captured_again(stand_in):
    calls = captured.CapturedCalls(max_graphs=1)
    replayed = [calls(("tail", "forward"), lambda t: t, torch.zeros(rows, 2))[0, 0].item() > 0
                for rows in (3, 3, 4, 4, 3, 4, 3, 4)]
    assert replayed == [False, True, False, True, False, True, True, False]
    assert calls.captures == 3 and len(calls._graphs) == 1 and len(stand_in.released) == 2


def test_a_failed_capture_leaves_the_call_eager_for_good(stand_in, monkeypatch):
    class Failing:
        def __init__(self, call, x):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(captured, "_Graph", Failing)
    calls = captured.CapturedCalls()
    x = torch.zeros(2, 2)
    assert [calls(("tail", "forward"), lambda t: t + 1, x)[0, 0].item() for _ in range(4)] == [1, 1, 1, 1]
    assert (calls.failures, calls.captures, calls.replays) == (1, 0, 0)


def test_calls_above_the_row_limit_are_never_captured(stand_in):
    calls = captured.CapturedCalls(max_rows=4)
    for _ in range(3):
        calls(("tail", "forward"), lambda t: t, torch.zeros(5, 2))
    assert calls.captures == 0 and not stand_in.made
    with pytest.raises(ValueError, match="must be positive"):
        captured.CapturedCalls(max_graphs=0)


def test_an_executor_that_captures_blocks_routes_their_calls_and_computes_the_same(checkpoints, stand_in):
    """Only block calls (the tail, the MLP) go through the captured path; a layer's call does not. The stand-in's
    replays are marked (+1000), so the routing shows; the eager first calls equal an executor without capture."""
    path, _ = checkpoints("llama")
    plain = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    capturing = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, capture_blocks=True)
    assert plain.captured is None and capturing.captured is not None
    sessions = [e.attach(e.fingerprint, "t") for e in (plain, capturing)]
    spec = plain.block_specs["model.layers.0"]
    x = torch.randn(3, spec.in_features, dtype=torch.float64)
    first = [s.forward("model.layers.0", x) for s in sessions]
    torch.testing.assert_close(first[1], first[0], rtol=0, atol=0)
    torch.testing.assert_close(sessions[1].forward("model.layers.0", x), first[0] + 1000)
    layer = "model.layers.0.self_attn.o_proj"
    y = torch.randn(3, plain.layer_specs[layer].in_features, dtype=torch.float64)
    for _ in range(2):
        torch.testing.assert_close(sessions[1].forward(layer, y), sessions[0].forward(layer, y), rtol=0, atol=0)
    assert capturing.captured.captures == 1
    for session, executor in zip(sessions, (plain, capturing)):
        session.close()
        executor.close()


@pytest.mark.gpu
def test_on_the_gpu_tails_and_mlps_replayed_from_graphs_equal_their_eager_calls(checkpoints):
    """float32 on the GPU: forward and backward of a decoder tail and of an MLP block, several inputs of one shape
    (replays with new contents), two shapes, and a replay from a second thread and stream, each against the
    block's eager call."""
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=torch.float32, capture_blocks=True)
    session = executor.attach(executor.fingerprint, "t")
    generator = torch.Generator(device="cuda").manual_seed(0)
    for block_id in ("model.layers.0", "model.layers.1.mlp"):
        block, spec = executor.weights.blocks[block_id], executor.block_specs[block_id]
        for rows in (7, 7, 7, 7, 16, 16, 16):
            x = torch.randn(rows, spec.in_features, device="cuda", generator=generator)
            g = torch.randn(rows, spec.out_features, device="cuda", generator=generator)
            torch.testing.assert_close(session.forward(block_id, x), block.forward(x), rtol=1e-5, atol=1e-5)
            both = torch.cat([x, g], dim=1)
            torch.testing.assert_close(session.backward(block_id, both), block.backward(both), rtol=1e-5, atol=1e-5)
    assert executor.captured.captures == 8 and executor.captured.replays >= 16 and executor.captured.failures == 0
    spec = executor.block_specs["model.layers.0"]
    x = torch.randn(7, spec.in_features, device="cuda", generator=generator)
    results = {}

    def other_stream():
        with torch.cuda.stream(torch.cuda.Stream()):
            results["other"] = session.forward("model.layers.0", x)
            torch.cuda.current_stream().synchronize()

    thread = threading.Thread(target=other_stream)
    thread.start()
    thread.join()
    torch.testing.assert_close(results["other"], executor.weights.blocks["model.layers.0"].forward(x),
                               rtol=1e-5, atol=1e-5)
    executor.captured = captured.CapturedCalls(max_graphs=1)  # every other call evicts the graph before it
    for rows in (3, 3, 4, 4, 3, 4, 3, 4):
        x = torch.randn(rows, spec.in_features, device="cuda", generator=generator)
        torch.testing.assert_close(session.forward("model.layers.0", x),
                                   executor.weights.blocks["model.layers.0"].forward(x), rtol=1e-5, atol=1e-5)
    # captured at the 2nd, 4th and 7th calls; an evicted shape is seen again before it is captured again
    assert executor.captured.captures == 3 and len(executor.captured._graphs) == 1
    session.close()
    executor.close()
