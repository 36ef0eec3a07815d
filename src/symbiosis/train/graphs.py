"""The decoder's part of a training pass as CUDA graphs: its forward and its backward each one replay, where eager
they are ~100 launches a decoder layer each way from Python (a pass of one tenant's 256 tokens on Llama-3.2-1B:
~65-70 ms of host time for ~15 ms of GPU work, so a small pass runs at the host's pace, and an eager pass's host
thread takes the interpreter from the HTTP server beside it).

A graph is made for a shape of pass: (datums B, rounded up to a `bucket`; tokens a datum L; the adapters' layout)
with every datum of one length (no padding mask) and every datum's adapter of one layout (`HostedLora.layout`),
which is when the pass's LoRA stacks are views of one gathered buffer [B, F] (train/model.py `PassState.begin_gathered`): nothing in the
captured work then depends on which adapters they are. Its static inputs are the token ids [B, L], the gathered
buffer, the datums' LoRA scales [B, 1, 1] and the gradient of the decoder's output [B, L, H]; its static outputs
the decoder's output and the gathered gradient [B, F], which the pass then adds into each adapter's
(`PassState.finish`). The head and the losses run eagerly as before (their shapes follow each request's).

Captured once a shape has come `CAPTURE_AFTER` times within the last `RECENT` passes: a shape seen now and then (a
round that a straggler missed) may not come back, and a capture costs a few passes' time, in which every tenant
waits, and keeps its pass's activations in a memory pool of its own. Until then a pass replays the smallest captured
graph of its length and layout with at most `PAD_AT_MOST` times its datums (the rows past its own compute for
nothing, as a bucket's do), and runs eagerly where there is none (an eager pass is host-bound and holds the
interpreter from the HTTP server beside it). At most `MAX_GRAPHS` at once, the least recently used given up first,
and none while less than `MIN_FREE` of the device's memory is free. A shape whose capture fails runs eagerly from
then on (logged once); a decoder that reads the device back mid-pass (a mixture of experts') is never captured
(`capturable`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

import torch

from symbiosis.train.lora import HostedLora
from symbiosis.train.model import PassState, _gathered, _on, _scales, one_layout

log = logging.getLogger(__name__)

CAPTURE_AFTER = 3
RECENT = 16
PAD_AT_MOST = 2
MAX_GRAPHS = 8
MIN_FREE = 0.25  # of the device's memory, free or cached by torch, to capture another graph
WARMUP = 1  # eager passes on a side stream before capture (its cuBLAS workspace, Triton's compiles)


class DecoderGraphs:
    """The decoder's graphs of one trainer (single GPU)."""

    def __init__(self, decoder, state: PassState, device: torch.device, dtype: torch.dtype):
        self.decoder, self.state, self.device, self.dtype = decoder, state, torch.device(device), dtype
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.recent: deque[tuple] = deque(maxlen=RECENT)  # the shapes of the last passes
        self.refused: set[tuple] = set()
        self.captures = self.replays = self.padded = 0  # `padded`: replays of a larger shape's graph

    def decode(self, input_ids: torch.Tensor, datums: list[HostedLora | None]) -> torch.Tensor | None:
        """The decoder's output [B, L, H] of `input_ids` (on the device, every datum L tokens) for a pass that
        trains (grad mode on), with the pass's gathered gradient left for `PassState.finish`; or None where this
        pass runs eagerly (`PassState.begin` and the decoder)."""
        if not one_layout(datums):
            return None
        rows, length = input_ids.shape
        key = (bucket(rows), length, datums[0].layout)
        self.recent.append(key)
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.refused and self.recent.count(key) >= CAPTURE_AFTER and self._room():
                graph = self._capture(key, input_ids, datums)
            if graph is None:  # a larger shape's graph, or eagerly
                key = self._larger(key, rows)
                if key is None:
                    return None
                graph = self.graphs[key]
                self.padded += 1
        self.graphs.move_to_end(key)
        with torch.no_grad():  # the first `rows` rows; the bucket's others get no LoRA (and no gradient: _Replay)
            graph.input_ids[:rows].copy_(input_ids, non_blocking=True)
            graph.gathered[:rows].copy_(_gathered(datums, self.dtype), non_blocking=True)
            graph.scales[:rows].copy_(_on(_scales(datums, self.dtype), self.device), non_blocking=True)
            graph.scales[rows:].zero_()  # (a pass of more rows may have left its datums' there)
        self.state.gradients = (graph.grads[:rows], datums)
        self.replays += 1
        return _Replay.apply(self.state.anchor(self.device), graph, rows)

    def _larger(self, key: tuple, rows: int) -> tuple | None:
        """The smallest captured shape of `key`'s length and layout that runs `rows` datums with at most
        `PAD_AT_MOST` times as many."""
        fits = [shape for shape in self.graphs if shape[1:] == key[1:] and rows <= shape[0] <= PAD_AT_MOST * rows]
        return min(fits, default=None)

    def _room(self) -> bool:
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return free + cached >= MIN_FREE * total

    def _capture(self, key: tuple, input_ids: torch.Tensor, datums: list[HostedLora]) -> "_Graph | None":
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        rows, length = key[0], key[1]
        try:
            graph = _Graph(self.decoder, self.state, input_ids.new_zeros(rows, length),
                           torch.zeros(rows, datums[0].flat.numel(), dtype=self.dtype, device=self.device),
                           torch.zeros(rows, 1, 1, dtype=self.dtype, device=self.device), datums[0].flat.dtype,
                           datums[0].spec.rank, dict(datums[0]._slices))
        except Exception as e:  # an operator that cannot be captured, or no memory: this shape runs eagerly
            self.state.end()
            self.refused.add(key)
            log.warning("training passes of %d datums of %d tokens run without a CUDA graph: %s", rows, length, e)
            return None
        self.graphs[key] = graph
        self.captures += 1
        return graph


def capturable(model) -> bool:
    """Whether `model`'s decoder can be captured: not where it reads the device back mid-pass (a mixture of
    experts' layers count each expert's rows on the host: client/experts.py), which a capture refuses."""
    return not any(getattr(module, "symbiosis_expert_groups", None) for module in model.modules())


def bucket(rows: int) -> int:
    """The datums a graph of a pass of `rows` datums runs: 1, 2, 4, 8, then multiples of 8 (the rows past `rows`
    compute for nothing; so few shapes recur, and each is captured once)."""
    return 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8


class _Graph:
    """One shape's captured forward and backward, with their static buffers."""

    def __init__(self, decoder, state: PassState, input_ids: torch.Tensor, gathered: torch.Tensor,
                 scales: torch.Tensor, grad_dtype: torch.dtype, rank: int, slices: dict[str, tuple[slice, slice]]):
        """Static buffers: `input_ids` [B, L], `gathered` [B, F] and `scales` [B, 1, 1] in; the gathered gradient
        [B, F] in `grad_dtype` (the adapters') out. `rank`, `slices`: the adapters' layout (no adapter is kept)."""
        self.decoder, self.state, self.rank, self.slices = decoder, state, rank, slices
        self.input_ids, self.gathered, self.scales = input_ids, gathered, scales
        self.grads = torch.zeros(gathered.shape, dtype=grad_dtype, device=gathered.device)
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side), torch.enable_grad():
            for _ in range(WARMUP):
                hidden = self._forward()
                hidden.backward(torch.zeros_like(hidden))
                state.end()
        current.wait_stream(side)
        del hidden
        # "thread_local": other threads' work on the GPU (the engine's decoding beside training) goes on during the
        # capture; only this thread's calls that cannot be captured are refused
        self.forward = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward, capture_error_mode="thread_local"), torch.enable_grad():
            self.hidden = self._forward()
        state.end()
        self.grad_hidden = torch.zeros_like(self.hidden)
        self.backward = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.backward, pool=self.forward.pool(), capture_error_mode="thread_local"):
            self.grads.zero_()
            # the autograd graph of the captured forward is kept (retain_graph): each replay of this graph runs
            # its kernels over the same saved activations, which the forward's replay has just rewritten
            self.hidden.backward(self.grad_hidden, retain_graph=True)

    def _forward(self) -> torch.Tensor:
        self.state.begin_gathered(self.gathered, self.scales, self.grads, self.rank, self.slices)
        return self.decoder(input_ids=self.input_ids, use_cache=False)[0]


class _Replay(torch.autograd.Function):
    """The decoder's output of a graph's replayed forward, whose backward replays its backward. `anchor`, a leaf that
    requires grad, makes autograd run it."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, graph: _Graph, rows: int) -> torch.Tensor:
        graph.forward.replay()
        ctx.graph, ctx.rows = graph, rows
        # (a view: the pass reads it before the next replay rewrites it, queued after on the same stream)
        return graph.hidden.detach()[:rows]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        graph = ctx.graph
        graph.grad_hidden[:ctx.rows].copy_(grad)
        graph.grad_hidden[ctx.rows:].zero_()  # (rows never mix: a padded row gets no gradient, not a larger pass's)
        graph.backward.replay()
        return None, None, None
