"""The engine's model: the tenant-side transformers model of the base, whose base layers compute with the
executor's own weights (no copy) and add each segment's LoRA, and whose attention reads the paged KV cache.

Built like a split client (`symbiosis.from_pretrained` on an in-process executor: the skeleton on the meta
device, only the client tensors read, a tied embedding shared), then each virtual base layer is swapped for an
`EngineLinear` holding the executor's `BaseLayer`, and the attention implementation is set to the paged one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from symbiosis.engine import attention
from symbiosis.engine.adapters import AdapterStore
from symbiosis.engine.batch import StepBatch
from symbiosis.engine.kv import PagedKV
from symbiosis.executor.store import BaseLayer
from symbiosis.kernels.sgmv import lora_apply
from symbiosis.model.partition import BaseLayerSpec


@dataclass
class StepState:
    """What every engine layer reads during a step: the batch and the cache (set by the engine before each step)."""
    batch: StepBatch | None = None
    kv: PagedKV | None = None
    adapters: AdapterStore | None = None


class EngineLinear(nn.Module):
    """y = x W^T + b with the executor's W and b, plus, for the tokens of each adapter's segment,
    scale_i * (x A_i^T) B_i^T. The output head sees only the sampled rows (`row_segments`)."""

    def __init__(self, base: BaseLayer, state: StepState, is_head: bool):
        super().__init__()
        self.base, self.state, self.is_head = base, state, is_head
        self.layer_id = base.spec.layer_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, in]
        y = self.base.forward(tokens)  # [T, out]
        batch, pools = self.state.batch, self.state.adapters.pools.get(self.layer_id)
        segments = None if batch is None else batch.row_segments if self.is_head else batch.token_segments
        if segments is not None and pools is not None:
            lora_apply(y, tokens, pools[0], pools[1], pools[2], segments)
        return y.view(*x.shape[:-1], y.shape[-1])


class EngineEmbedding(nn.Module):
    """The model's input embedding, plus each adapter's embedding LoRA for its tokens:
    out[t] += scale_i * A_i[token_t] @ B_i (times the embedding's own scale, where it has one, as PEFT does)."""

    def __init__(self, embedding: nn.Module, state: StepState):
        super().__init__()
        self.embedding, self.state = embedding, state

    @property
    def weight(self):
        return self.embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.embedding(input_ids)
        pools, batch = self.state.adapters.embedding_pool, self.state.batch
        if pools is None or batch is None or batch.token_segments is None:
            return out
        a_pool, b_pool, scales = pools
        flat, ids = out.view(-1, out.shape[-1]), input_ids.reshape(-1)
        scale = getattr(self.embedding, "embed_scale", None)
        for first, end, slot in batch.token_runs:  # the segments' bounds as host values: no device read
            delta = (a_pool[slot][ids[first:end]] @ b_pool[slot]) * scales[slot].to(flat.dtype)
            flat[first:end] += delta if scale is None else delta * scale.to(delta.dtype)
        return out


def build(model_path, executor, state: StepState):
    """The engine's model of `model_path` over `executor` (in-process, same checkpoint). Returns
    (model, modules: module name -> base layer spec, embedding: (module name, vocab, dim),
    vocabulary weights: module name -> weight, of the input embedding and the output head)."""
    import symbiosis

    model = symbiosis.from_pretrained(model_path, executor, device=executor.device, name="engine")
    head = model.get_output_embeddings()
    modules: dict[str, BaseLayerSpec] = {}
    vocabulary = {}
    for name, module in list(model.named_modules()):
        layer_id = getattr(module, "layer_id", None)
        if layer_id is None or not hasattr(module, "session"):
            continue
        base = executor.weights.layers[layer_id]
        model.set_submodule(name, EngineLinear(base, state, is_head=module is head))
        modules[name] = base.spec
        if module is head:
            vocabulary[name] = base.weight
    embedding = model.get_input_embeddings()
    embedding_name = next(name for name, module in model.named_modules() if module is embedding)
    model.set_submodule(embedding_name, EngineEmbedding(embedding, state))
    for module in model.modules():
        if hasattr(module, "layer_idx") and any(isinstance(m, EngineLinear) for m in module.children()):
            module.symbiosis_step = state  # attention modules: paged_attention reads the step from here
    model.set_attn_implementation(attention.NAME)
    vocab, dim = embedding.weight.shape
    vocabulary[embedding_name] = embedding.weight
    return model.eval(), modules, (embedding_name, vocab, dim), vocabulary
