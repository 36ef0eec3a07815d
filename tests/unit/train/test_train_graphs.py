"""The decoder's CUDA graphs (train/graphs.py): a replayed pass computes what the eager pass computes, for whichever
adapters of the captured layout it runs; shapes that do not recur, or whose datums differ in length, run eagerly."""

from __future__ import annotations

import pytest
import torch

import symbiosis
from symbiosis.train import HostedLora, LoraSpec, Trainer, Work, graphs
from symbiosis.train.trainer import Datum
from matrix import make_checkpoint



def test_a_mixture_of_experts_decoder_is_not_captured(tmp_path):
    """Its layers read each expert's row counts back mid-pass (client/experts.py): a capture would fail there."""
    for architecture, expected in (("llama", True), ("qwen3_moe", False)):
        path = tmp_path / architecture
        make_checkpoint(architecture, path)
        trainer = Trainer(path, symbiosis.Executor.from_pretrained(path, dtype=torch.float32))
        assert graphs.capturable(trainer.model) is expected


def test_passes_round_up_to_few_shapes():
    assert [graphs.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 24, 32, 32, 40]


def _works(loras, generator, length):
    works = []
    for lora in loras:
        tokens = torch.randint(0, 128, (length,), generator=generator).tolist()
        targets = torch.randint(0, 128, (length,), generator=generator)
        works.append(Work(lora, [Datum(tokens, {"target_tokens": targets,
                                                "weights": torch.rand(length, generator=generator)})],
                          "cross_entropy"))
    return works


@pytest.fixture
def trainers(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    make_checkpoint("llama", tmp_path)
    executor = symbiosis.Executor.from_pretrained(tmp_path, device="cuda", dtype=torch.float32)
    graphed, eager = Trainer(tmp_path, executor), Trainer(tmp_path, executor)
    eager.graphs = None
    return graphed, eager


def _adapters(trainer, seeds):
    return [HostedLora(LoraSpec(rank=4, seed=seed), trainer.targets, trainer.device, trainer.dtype) for seed in seeds]


@pytest.mark.gpu
def test_replayed_passes_train_as_eager_passes_over_any_adapters_of_the_layout(trainers):
    """Three datums (a graph of four rows: the fourth computes for nothing); float32, where the two differ only by
    the GEMMs' rounding (cuBLAS may pick other kernels under capture)."""
    graphed, eager = trainers
    assert graphed.graphs is not None
    ours, theirs = _adapters(graphed, range(3)), _adapters(eager, range(3))
    others, others_eager = _adapters(graphed, (7, 8, 9)), _adapters(eager, (7, 8, 9))
    # eager passes, the capture's, two replays; then others than the adapters it was captured with; then four datums
    # (the bucket's every row) and three again (the fourth row's datum, adapter and gradient of the pass before left)
    passes = [(ours, theirs)] * graphs.CAPTURE_AFTER + [(ours, theirs)] * 2 + [(others, others_eager)] + \
        [(ours + others[:1], theirs + others_eager[:1]), (ours, theirs)]
    _train_both(graphed, eager, passes, torch.Generator().manual_seed(0))
    assert graphed.graphs.captures == 1
    assert graphed.graphs.replays == len(passes) - graphs.CAPTURE_AFTER + 1  # the capture's pass and those after


@pytest.mark.gpu
def test_a_shape_that_has_not_recurred_replays_a_graph_up_to_twice_its_size(trainers):
    """Two datums replay the graph of four (captured from three) until their own shape has recurred; one datum
    (a quarter of that graph) runs eagerly; all of them train as eager passes do."""
    graphed, eager = trainers
    three, three_eager = _adapters(graphed, range(3)), _adapters(eager, range(3))
    generator = torch.Generator().manual_seed(2)
    _train_both(graphed, eager, [(three, three_eager)] * graphs.CAPTURE_AFTER, generator)
    assert (graphed.graphs.captures, graphed.graphs.padded) == (1, 0)
    replays = graphed.graphs.replays
    _train_both(graphed, eager, [(three[:2], three_eager[:2]), (three[:1], three_eager[:1])], generator)
    assert (graphed.graphs.captures, graphed.graphs.padded, graphed.graphs.replays) == (1, 1, replays + 1)
    _train_both(graphed, eager, [(three[1:], three_eager[1:])] * (graphs.CAPTURE_AFTER - 1), generator)
    assert (graphed.graphs.captures, graphed.graphs.padded) == (2, 2)  # the third pass of two captured theirs


def _train_both(graphed, eager, passes, generator):
    """Each pass of (adapters, their eager twins) trained on both trainers: equal losses, gradients, steps."""
    for pair in passes:
        works = _works(pair[0], generator, 16)
        twins = [Work(lora, work.datums, work.loss_fn) for lora, work in zip(pair[1], works)]
        for trainer, batch in ((graphed, works), (eager, twins)):
            for work in batch:
                trainer.check(work)
        results, expected = graphed.run(works), eager.run(twins)
        for result, reference in zip(results, expected):
            assert result.losses == pytest.approx(reference.losses, rel=1e-5)
            for lp, lp_reference in zip(result.logprobs, reference.logprobs):
                torch.testing.assert_close(lp, lp_reference, rtol=1e-5, atol=1e-5)
        for lora, twin in zip(*pair):
            scale = float(twin.flat_grad.abs().max())
            assert scale > 0
            torch.testing.assert_close(lora.flat_grad, twin.flat_grad, rtol=1e-3, atol=1e-4 * scale)
            for adapter in (lora, twin):
                adapter.step(learning_rate=0.01)
        for lora, twin in zip(*pair):
            torch.testing.assert_close(lora.flat, twin.flat, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_shapes_that_do_not_recur_or_differ_in_length_run_eagerly(trainers):
    graphed, _ = trainers
    loras = _adapters(graphed, range(2))
    generator = torch.Generator().manual_seed(1)
    for step in range(graphs.CAPTURE_AFTER + 1):
        works = _works(loras, generator, 8 + step)  # a new length each pass
        ragged = _works(loras, generator, 12)
        ragged[0].datums[0] = Datum(ragged[0].datums[0].tokens[:6],
                                    {k: v[:6] for k, v in ragged[0].datums[0].inputs.items()})
        for batch in (works, ragged):
            for work in batch:
                graphed.check(work)
            graphed.run(batch)
    assert graphed.graphs.captures == graphed.graphs.replays == 0
