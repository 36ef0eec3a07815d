"""Attention over the paged KV cache, plugged into transformers' attention interface.

The engine's model is an ordinary transformers model whose attention implementation is "symbiosis_paged":
the model's own attention module computes q, k, v (projections, q/k norms, rotary embedding with each token's own
position) and hands them here, where the step's new keys and values are written into the pool at their slots and
each chunk's queries attend over its request's context where it lies in the pool: torch's flex_attention with the
step's block masks (`AttentionLayout.block_mask`: per row the pages of its chunk's block table, per key its
position in its request), one call per layout of the step (its decodes, its prefill chunks: engine/batch.py). On
a GPU flex_attention is compiled and reads the pool in place (its decoding kernel splits each request's pages over
the SMs); on the CPU, where it runs unfused and evaluates every key it is given, each row's context is gathered
first.
Masks come from the step, not from transformers (none is made for an unknown implementation).

The work is one custom operator, `symbiosis::paged_attention` (opaque to torch.compile, which compiles the decoder
layers around it: engine/compiled.py), given q, k, v and the layer's pool tensors (which it writes); it reads the
step's batch from the engine that runs it (`stepping`, per thread).

    for each chunk r, query q (position p_q), context position l <= p_q (and l > p_q - window):
        s = scaling * <Q[r, q], K[slot(r, l)]>          (s = softcap * tanh(s / softcap) where the model caps)
        out[r, q] = sum_l softmax_l(s) V[slot(r, l)]
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch
from torch.nn.attention.flex_attention import flex_attention
from transformers import AttentionInterface

NAME = "symbiosis_paged"
PROBE = "symbiosis_probe"  # one token, as the model is built (probe_attention)
PREFILL_BLOCK_M = 64  # query rows per prefill kernel tile (divides the block mask's QUERY_BLOCK of 128)
RECOMPILE_LIMIT = 128  # one compiled kernel per (rows bucket, window, dtype) for decodes and for prefill rows
#                       (StepBatch lays both out in powers of two of rows)


def _decode_kernel(options: dict):
    def decode(q, k, v, block_mask, score_mod, scale):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True,
                              kernel_options=options)
    return decode


def _prefill_kernel(options: dict):  # its own code object: its own compile cache
    def prefill(q, k, v, block_mask, score_mod, scale):
        # Queries tiled by PREFILL_BLOCK_M: with torch's H100 default of 128 rows, rows of 64 or fewer queries found
        # no kernel configuration (torch 2.11, bf16, head_dim 64 and 128)
        tiles = {**options, "BLOCK_M": min(PREFILL_BLOCK_M, q.shape[-2])}
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True,
                              kernel_options=tiles)
    return prefill


def _unfused(q, k, v, visible, score_mod, scale):
    """flex_attention's arithmetic, unfused, in plain torch: q [R, H, Q, D], k and v [R or 1, Hkv, L, D], `visible`
    [R, 1, Q, L] -> [R, H, Q, Dv]; a query that sees no key gets zeros, as from flex_attention. (flex_attention
    itself, called outside torch.compile, compiles a wrapper of its own at every call, which torch 2.13 keeps
    registered for good, torch._dynamo.eval_frame.cached_backends: a leak of ~1 KB a layer a step, without end, on
    the CPU.)"""
    heads = q.shape[1]
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # [R, H, Q, L]
    if score_mod is not None:  # elementwise over the scores, with their indices broadcast as flex_attention's
        index = [torch.arange(n, device=q.device).view([-1 if i == d else 1 for i in range(4)])
                 for d, n in enumerate(scores.shape)]
        scores = score_mod(scores, *index)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    # a query that sees no key (its row all -inf: NaN) gets zeros; a NaN of the numbers themselves stays one
    weights = torch.where(visible.any(-1, keepdim=True), weights, 0.0)
    return weights @ v


def reads_in_place(query: torch.Tensor) -> bool:
    """Whether attention reads the pool in place (a GPU) or gathered contexts (the CPU: unfused, flex_attention
    would evaluate every key of the pool). The tests run the in-place path on the CPU too."""
    return query.is_cuda


_compiled: dict[tuple, object] = {}


def _kernel(one_query: bool, block_size: int):
    """Compiled flex_attention, static in its shapes: one-token queries (the decoding kernel) and prefill rows of
    QUERY_BLOCK queries, in the row buckets StepBatch lays them out in (powers of two). With a symbolic query length
    (torch.compile's automatic dynamic shapes) flex_attention found no kernel configuration (H100, torch 2.11: every
    prefill step after the second shape failed). The kernels tile keys by BLOCK_N, which must divide the page
    (block) size; it is a constant of the compiled function."""
    key = (one_query, block_size)
    if key not in _compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        options = {"BLOCK_N": min(block_size, 64)}
        attend = _decode_kernel(options) if one_query else _prefill_kernel(options)
        _compiled[key] = torch.compile(attend, dynamic=False, fullgraph=True)
    return _compiled[key]


@functools.cache  # one function a cap: a new one at every call would be a new guard for the compiled kernels
def _softcapped(softcap: float):
    def score_mod(score, b, h, q, k):
        return torch.tanh(score / softcap) * softcap
    return score_mod


_running = threading.local()


@contextmanager
def stepping(batch):
    """The step whose batch the paged attention of this thread's model calls reads."""
    _running.batch = batch
    try:
        yield
    finally:
        _running.batch = None


def paged_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, sliding_window=None,
                    softcap=None, **kwargs):
    # query [1, H, T, D]; key, value [1, Hkv, T, D] -> ([1, T, H, Dv], None)
    keys, values = module.symbiosis_kv  # [Hkv, S, D], [Hkv, S, Dv]: the layer's pool (engine/kv.py)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.ops.symbiosis.paged_attention(query, key, value, keys, values, scale, sliding_window or 0,
                                              softcap or 0.0)
    return out, None


@torch.library.custom_op("symbiosis::paged_attention", mutates_args=("keys", "values"))
def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            scale: float, sliding_window: int, softcap: float) -> torch.Tensor:
    """Writes the step's keys and values into the pool at their slots; returns [1, T, H, Dv] (sliding_window,
    softcap: 0 for none)."""
    step = _running.batch
    keys.index_copy_(1, step.slots, key[0].to(keys.dtype))
    values.index_copy_(1, step.slots, value[0].to(values.dtype))
    score_mod = None if not softcap else _softcapped(softcap)
    outputs = [(layout, _attend_layout(layout, query, keys, values, scale, sliding_window or None, score_mod))
               for layout in step.layouts]
    if len(outputs) == 1 and outputs[0][0].whole:  # [T, H, Dv] in flat order already
        return outputs[0][1].unsqueeze(0)
    out = query.new_empty(query.shape[2], query.shape[1], value.shape[-1])  # [T, H, Dv]
    for layout, part in outputs:
        out.index_copy_(0, layout.tokens, part)
    return out.unsqueeze(0)


def _attend_layout(layout, query, keys, values, scale, sliding_window, score_mod) -> torch.Tensor:
    """[n, H, Dv]: the attention of the layout's tokens (`layout.tokens`, in that order)."""
    heads, value_dim = query.shape[1], values.shape[-1]
    if layout.one_token_rows:  # row r is token r: no gather either way
        q = query[0].transpose(0, 1).unsqueeze(2)  # [R, H, 1, D]
    else:
        q = query[0][:, layout.query_index].transpose(0, 1)  # [R, H, Q, D]
    # One memory layout whatever made q (a graph step's compiled layers, an eager step's gather): the compiled
    # kernels guard on strides, and decodes in mixed steps compiled again every row bucket the graphs had (H100)
    q = q.contiguous()
    rows, queries = q.shape[0], q.shape[2]
    if reads_in_place(q) and q.is_cuda:  # the kernels read each row's pages of the pool
        out = _kernel(queries == 1, layout.block_size)(q, keys[None], values[None], layout.block_mask(sliding_window),
                                                       score_mod, scale)
    elif reads_in_place(q):  # (the tests' in-place path on the CPU)
        out = _unfused(q, keys[None], values[None], layout.pool_visible(sliding_window), score_mod, scale)
    else:  # unfused flex_attention evaluates every key it is given: each row's own context, gathered
        context, visible = layout.gathered(sliding_window)  # [R, L], [R, 1, Q, L]: made once a step
        out = _unfused(q, keys[:, context].transpose(0, 1), values[:, context].transpose(0, 1), visible,
                       score_mod, scale)
    out = out.transpose(1, 2).reshape(rows * queries, heads, value_dim)  # [R * Q, H, Dv]
    return out if layout.one_token_rows else out[layout.query_rows]


@_attend.register_fake
def _(query, key, value, keys, values, scale, sliding_window, softcap):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])


def probe_attention(module, query, key, value, attention_mask=None, **kwargs):
    """Attention over a one-token sequence, whatever the model's scores (softmax over one key is 1): each query
    head's output is its key/value head's value. It makes the layer's pool (`module.symbiosis_make_kv`) from the
    head counts and sizes the architecture gives, as the engine's model is built."""
    # query [1, H, 1, D]; key, value [1, Hkv, 1, D] -> ([1, 1, H, Dv], None)
    module.symbiosis_kv = module.symbiosis_make_kv(key.shape[1], query.shape[-1], value.shape[-1])
    out = value.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    return out.transpose(1, 2), None


AttentionInterface.register(NAME, paged_attention)
AttentionInterface.register(PROBE, probe_attention)
