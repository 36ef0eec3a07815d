"""Attention over the paged KV cache, plugged into transformers' attention interface.

The engine's model is an ordinary transformers model whose attention implementation is "symbiosis_paged":
the model's own attention module computes q, k, v (projections, q/k norms, rotary embedding with each token's own
position) and hands them here, where the step's new keys and values are written into the pool at their slots and
each chunk's queries attend over its request's whole context, gathered from the pool through its block table.
Masks come from the step (`StepBatch.mask`), not from transformers (none is made for an unknown implementation).

    for each chunk r, query q (position p_q), context position l <= p_q (and l > p_q - window):
        s = scaling * <Q[r, q], K[slot(r, l)]>          (s = softcap * tanh(s / softcap) where the model caps)
        out[r, q] = sum_l softmax_l(s) V[slot(r, l)]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "symbiosis_paged"


def paged_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, sliding_window=None,
                    softcap=None, **kwargs):
    # query [1, H, T, D]; key, value [1, Hkv, T, D] -> ([1, T, H, Dv], None)
    step = module.symbiosis_step.batch
    kv = module.symbiosis_step.kv
    heads, kv_heads, head_dim, value_dim = query.shape[1], key.shape[1], query.shape[-1], value.shape[-1]
    keys, values = kv.layer(module.layer_idx, kv_heads, head_dim, value_dim)
    keys.index_copy_(0, step.slots, key[0].transpose(0, 1).to(keys.dtype))
    values.index_copy_(0, step.slots, value[0].transpose(0, 1).to(values.dtype))

    group = heads // kv_heads  # grouped-query attention: query heads kv*group .. kv*group+group-1 read kv head kv
    q = query[0].transpose(0, 1)[step.query_index]  # [R, Q, H, D]
    chunks, longest = q.shape[0], q.shape[1]
    q = q.view(chunks, longest, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(chunks, kv_heads, group * longest, head_dim)
    k = keys[step.context_slots].transpose(1, 2)  # [R, Hkv, L, D]
    v = values[step.context_slots].transpose(1, 2)
    scale = head_dim ** -0.5 if scaling is None else scaling
    mask = step.mask(sliding_window, group)  # [R, 1, G*Q, L]
    if softcap is None:  # one fused kernel (on a GPU: memory-efficient attention, which takes the mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [R, Hkv, G*Q, Dv]
    else:  # soft-capped scores (Gemma2): no fused kernel takes them
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap  # [R, Hkv, G*Q, L]
        probabilities = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1,
                                      dtype=torch.promote_types(scores.dtype, torch.float32))
        out = torch.matmul(probabilities.to(v.dtype), v)  # [R, Hkv, G*Q, Dv]
    out = out.reshape(chunks, heads, longest, value_dim)  # [R, H, Q, Dv] (a fused kernel may lay it out transposed)
    out = out.transpose(1, 2).reshape(chunks * longest, heads, value_dim)[step.query_rows]  # [T, H, Dv], flat order
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, paged_attention)
