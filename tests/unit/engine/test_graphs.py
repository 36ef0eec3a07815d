"""The recorded decode graphs: one per step shape, replayed with each step's own indices, at most MAX_GRAPHS kept.
(Their exactness is tested end to end in test_engine.py: padded decode steps on the CPU, graphs on the GPU.)"""

from __future__ import annotations

import torch

from symbiosis.engine import graphs


def test_step_shapes_are_bucketed():
    assert [graphs.bucket(rows) for rows in (1, 2, 3, 5, 8, 33)] == [1, 2, 4, 8, 8, 64]


def test_the_least_recently_replayed_graph_is_dropped_beyond_the_bound(monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    ran = []
    recorder = graphs.DecodeGraphs(lambda batch: ran.append(batch) or torch.zeros(1), torch.device("cpu"))
    batches = {key: object() for key in "abc"}
    for key in "aba":
        recorder.run(key, batches[key])
    recorder.run("c", batches["c"])  # "b" was replayed least recently
    assert list(recorder.recorded) == ["a", "c"]
    assert ran == [batches[k] for k in "abac"]
