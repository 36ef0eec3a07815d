"""The engine's model: the tenant-side transformers model of the base, whose base layers compute with the
executor's own weights (no copy) and add each segment's LoRA, and whose attention reads the paged KV cache.

Built like a split client (`symbiosis.from_pretrained` on an in-process executor: the skeleton on the meta
device, only the client tensors read, a tied embedding shared), then each virtual base layer is swapped for an
`EngineLinear` holding the executor's `BaseLayer`, and the attention implementation is set to the paged one.

Sibling layers that take one input (q/k/v, gate/up: found by watching one forward pass, as split clients'
call grouping does) become a `FusedGroup`: one GEMM on the executor's fused weight and one SGMV call per group
instead of one each per layer.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from symbiosis.engine import attention
from symbiosis.engine.adapters import AdapterStore, BottleneckPools, Pools
from symbiosis.engine.batch import StepBatch
from symbiosis.engine.compiled import compile_decoder_layers
from symbiosis.engine.kv import PagedKV
from symbiosis.executor.store import BaseLayer
from symbiosis.kernels.bottleneck import bottleneck_apply
from symbiosis.kernels.sgmv import MAX_SLICES, linear_and_lora_delta_op, linear_with_lora, lora_apply
from symbiosis.model.partition import GROUP_SEPARATOR, BaseLayerSpec


@dataclass
class StepState:
    """What every engine layer reads during a step: its batch, and whether its decoder layers run compiled
    (engine/compiled.py), both set by `running`."""
    batch: StepBatch | None = None
    compiled: bool = False

    @contextmanager
    def running(self, batch: StepBatch, compiled: bool = False):
        self.batch, self.compiled = batch, compiled
        try:
            with attention.stepping(batch):
                yield
        finally:
            self.batch, self.compiled = None, False


def _project(base: BaseLayer, pools: Pools, tokens: torch.Tensor, state: StepState, is_head: bool,
             widths: tuple[int, ...]) -> torch.Tensor:
    """tokens [T, in] -> [T, out]: x W^T + b, plus each segment's LoRA from `pools` (a layer's, or a group's whose
    members' outputs are `widths` side by side). Nothing here names a layer (torch.compile: one code for all)."""
    batch = state.batch
    segments = None if batch is None else batch.row_segments if is_head else batch.token_segments
    if segments is None or pools.a is None:
        return base.forward(tokens)
    if pools.ready is not None and not torch.compiler.is_compiling():  # this layer's adapter copy, not the others'
        pools.wait(tokens.device)
    args = (tokens, base.weight, base.bias, base.spec.kind == "conv1d", pools.a, pools.b, pools.scales,
            segments.starts, segments.slots, segments.max_len, list(widths))
    if torch.compiler.is_compiling():  # the add left to the compiler: it lands in the kernel that reads the sum
        y, delta = linear_and_lora_delta_op(*args)
        return y + delta
    return linear_with_lora(*args)


class EngineLinear(nn.Module):
    """y = x W^T + b with the executor's W and b, plus, for the tokens of each adapter's segment,
    scale_i * (x A_i^T) B_i^T, or its bottleneck of y (kernels/bottleneck.py). The output head sees only the
    sampled rows (`row_segments`). A member of a `FusedGroup` leaves its call to the group."""

    def __init__(self, base: BaseLayer, state: StepState, is_head: bool):
        super().__init__()
        self.base, self.state, self.is_head = base, state, is_head
        self.layer_id = base.spec.layer_id
        self.pools = Pools()  # AdapterStore's, once there is one (attach_pools)
        self.bottleneck = BottleneckPools()
        self.group: FusedGroup | None = None
        self.member = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            return self.group.member_output(self.member, x)
        tokens = x.reshape(-1, x.shape[-1])  # [T, in]
        y = _project(self.base, self.pools, tokens, self.state, self.is_head, (self.base.spec.out_features,))
        pools, batch = self.bottleneck, self.state.batch
        if pools.down is not None and batch is not None:
            segments = batch.row_segments if self.is_head else batch.token_segments
            if segments is not None:
                if pools.ready is not None and not torch.compiler.is_compiling():
                    pools.wait(tokens.device)
                bottleneck_apply(y, pools.down, pools.down_bias, pools.up, pools.up_bias, pools.scales, pools.acts,
                                 segments)
        return y.view(*x.shape[:-1], y.shape[-1])


class FusedGroup:
    """Sibling layers that take one input. The first member's call runs the whole group: one GEMM on the
    executor's fused weight (the members' weights are views of it) and one SGMV call over the group's pools
    (`AdapterStore`: the members side by side); it keeps the other members' columns for their calls, which
    follow with the very same input. A member called with another input (a path the model did not take when
    the group was found) computes alone, from its own columns of the pools."""

    def __init__(self, base: BaseLayer, members: list[EngineLinear], state: StepState):
        self.base, self.members, self.state = base, members, state
        self.layer_id = base.spec.layer_id
        self.widths = tuple(m.base.spec.out_features for m in members)
        self.pools = Pools()
        self._pending: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None  # (input, members' outputs)
        for index, member in enumerate(members):
            member.group, member.member = self, index

    def member_output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        if member == 0:
            tokens = x.reshape(-1, x.shape[-1])
            outputs = _project(self.base, self.pools, tokens, self.state, False, self.widths).split(self.widths, 1)
            self._pending = (x, outputs)
        elif self._pending is not None and self._pending[0] is x:
            outputs = self._pending[1]
        else:
            outputs = {member: self._alone(member, x.reshape(-1, x.shape[-1]))}
        if member == len(self.members) - 1:
            self._pending = None  # the input is not held beyond the group's calls
        y = outputs[member]
        return y.view(*x.shape[:-1], y.shape[-1])

    def _alone(self, member: int, tokens: torch.Tensor) -> torch.Tensor:
        layer = self.members[member].base
        y = layer.forward(tokens)
        batch, pools = self.state.batch, self.pools
        if batch is not None and batch.token_segments is not None and pools.a is not None:
            pools.wait(tokens.device)
            rank, first = pools.b.shape[2], sum(self.widths[:member])
            lora_apply(y, tokens, pools.a[:, member * rank:(member + 1) * rank], pools.b[:, first:first + y.shape[1]],
                       pools.scales[:, member:member + 1], batch.token_segments, slices=(y.shape[1],))
        return y


class EngineEmbedding(nn.Module):
    """The model's input embedding, plus each adapter's embedding LoRA for its tokens:
    out[t] += scale_i * A_i[token_t] @ B_i (times the embedding's own scale, where it has one, as PEFT does)."""

    def __init__(self, embedding: nn.Module, state: StepState):
        super().__init__()
        self.embedding, self.state = embedding, state
        self.adapters: AdapterStore | None = None  # attach_pools

    @property
    def weight(self):
        return self.embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.embedding(input_ids)
        batch = self.state.batch
        pools = None if batch is None or batch.token_segments is None else self.adapters.embedding_pool
        if pools is None:
            return out
        self.adapters.wait_embedding()
        a_pool, b_pool, scales = pools
        flat, ids = out.view(-1, out.shape[-1]), input_ids.reshape(-1)
        scale = getattr(self.embedding, "embed_scale", None)
        for first, end, slot in batch.token_runs:  # the segments' bounds as host values: no device read
            delta = (a_pool[slot][ids[first:end]] @ b_pool[slot]) * scales[slot].to(flat.dtype)
            flat[first:end] += delta if scale is None else delta * scale.to(delta.dtype)
        return out


def build(model_path, executor, state: StepState, kv: PagedKV, compile_layers: bool = False):
    """The engine's model of `model_path` over `executor` (in-process, same checkpoint), each attention layer's
    pool made in `kv`, its decoder layers also compiled with `compile_layers`. Returns (model, modules: module name
    -> base layer spec, groups: the layer ids of each fused group, embedding: (module name, vocab, dim), vocabulary
    weights: module name -> weight, of the input embedding and the head)."""
    import symbiosis

    model = symbiosis.from_pretrained(model_path, executor, device=executor.device, name="engine")
    model.symbiosis_session.own_gemms = True  # a MoE model's experts: on the engine's thread, as its other layers
    head = model.get_output_embeddings()
    modules: dict[str, BaseLayerSpec] = {}
    linears: dict[str, EngineLinear] = {}
    vocabulary = {}
    for name, module in list(model.named_modules()):
        layer_id = getattr(module, "layer_id", None)
        if layer_id is None or not hasattr(module, "session"):
            continue
        base = executor.weights.layers[layer_id]
        linears[name] = EngineLinear(base, state, is_head=module is head)
        model.set_submodule(name, linears[name])
        modules[name] = base.spec
        if module is head:
            vocabulary[name] = base.weight
    embedding = model.get_input_embeddings()
    embedding_name = next(name for name, module in model.named_modules() if module is embedding)
    model.set_submodule(embedding_name, EngineEmbedding(embedding, state))
    attention_modules = [module for module in model.modules() if hasattr(module, "layer_idx") and
                         any(isinstance(m, EngineLinear) for m in module.children())]
    for module in attention_modules:
        module.symbiosis_make_kv = kv.add_layer
    groups = []
    for names in _probe(model, linears):
        members = [linears[name] for name in names]
        fused = executor.weights.get(GROUP_SEPARATOR.join(m.layer_id for m in members))
        if isinstance(fused, BaseLayer) and len(members) <= MAX_SLICES:  # else: already fused otherwise; alone
            groups.append(tuple(m.layer_id for m in FusedGroup(fused, members, state).members))
    if not attention_modules or any(not hasattr(module, "symbiosis_kv") for module in attention_modules):
        raise NotImplementedError(f"{type(model).__name__}: the engine needs every attention layer to go through "
                                  "transformers' attention interface")
    model.set_attn_implementation(attention.NAME)
    if compile_layers:
        compile_decoder_layers(model, attention_modules, state)
    vocab, dim = embedding.weight.shape
    vocabulary[embedding_name] = embedding.weight
    return model.eval(), modules, groups, (embedding_name, vocab, dim), vocabulary


def _probe(model, linears: dict[str, EngineLinear]) -> list[list[str]]:
    """One forward pass of one token (no adapters; `attention.probe_attention` makes each layer's pool). Returns
    the module names of the runs of base layers (the head aside) called one after another with the very same input
    tensor."""
    calls: list[tuple[str, torch.Tensor]] = []
    hooks = [module.register_forward_pre_hook(lambda _, args, name=name: calls.append((name, args[0])))
             for name, module in linears.items() if not module.is_head]
    model.set_attn_implementation(attention.PROBE)
    try:
        with torch.inference_mode():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    runs: list[tuple[list[str], torch.Tensor]] = []
    for name, x in calls:
        if runs and runs[-1][1] is x:
            runs[-1][0].append(name)
        else:
            runs.append(([name], x))
    return [names for names, _ in runs if len(names) > 1]


def attach_pools(model, store: AdapterStore) -> None:
    """Point every base layer (every fused group) and the input embedding of the engine's model at their pools in
    `store`."""
    for module in model.modules():
        if isinstance(module, EngineLinear):
            owner = module if module.group is None else module.group
            owner.pools = store.pools[owner.layer_id]
            module.bottleneck = store.bottleneck_pools.get(module.layer_id, module.bottleneck)
        elif isinstance(module, EngineEmbedding):
            module.adapters = store
