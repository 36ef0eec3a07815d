"""Decode steps replayed from CUDA graphs: one kernel-launch sequence per step shape, recorded once.

An eager decode step of an 8B model launches ~2,300 kernels from Python, so the GPU waits on the host
(docs/PERFORMANCE.md section 8). A step whose chunks are all one-token decodes is instead laid out padded
(`StepBatch(..., padded_rows=rows)`, rows = the running requests rounded up to a power of two; block tables are
always `max_pages` wide), so its every shape depends on (rows, whether any request has an adapter) alone.
The first step of a shape runs the model once eagerly (Triton and flex_attention compile, caches are made) and
records it; every later step of that shape copies its indices into the recorded batch's tensors and replays. Graphs
share one memory pool (safe: one replays at a time, and each step reads its logits before the next replay); at
most MAX_GRAPHS are kept. A graph records the adapter pools that exist when it is made, so the key also holds
`AdapterStore.pools_version`.

Without CUDA the same padded batches run eagerly (the CPU tests check that padding changes no token).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from symbiosis.engine.batch import StepBatch, bucket  # noqa: F401 -- bucket: the row buckets of decode steps

MAX_GRAPHS = 64  # recorded graphs kept (least recently replayed dropped): each adapter-pool layout makes new ones


class DecodeGraphs:
    def __init__(self, forward: Callable[[StepBatch], torch.Tensor], device: torch.device):
        """`forward(batch) -> logits [rows, vocab]`: the model over one batch."""
        self.forward, self.capture = forward, device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.recorded: OrderedDict[tuple, tuple[StepBatch, torch.cuda.CUDAGraph | None, torch.Tensor | None]] = OrderedDict()
        self.steps = 0  # steps run through here (replayed; on the CPU, run padded): the rest of the engine's ran eagerly

    def run(self, key: tuple, batch: StepBatch) -> torch.Tensor:
        """Logits of `batch` (padded rows included), from the graph recorded for `key`."""
        if key not in self.recorded:
            self.recorded[key] = self._record(batch)
            while len(self.recorded) > MAX_GRAPHS:
                self.recorded.popitem(last=False)
        self.recorded.move_to_end(key)
        self.steps += 1
        static, graph, logits = self.recorded[key]
        if static is not batch:
            static.copy_from(batch)
        if graph is None:
            return self.forward(static)
        graph.replay()
        return logits

    def _record(self, batch: StepBatch):
        if not self.capture:
            return batch, None, None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, lazily made tensors are made, outside the capture
            self.forward(batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (the service's training queue) go on launching their own work
        # while this thread records; only this thread's calls are checked for what a capture forbids
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self.forward(batch)
        return batch, graph, logits
