"""The training model: the base model over the executor's own weights (like the engine's), whose base layers add,
for the rows of each adapter's datums, that adapter's LoRA, with autograd reaching the adapters' matrices.

One pass runs every tenant's datums together (a padded batch [B, L], datums of one adapter in a row): the base GEMMs
once over all rows, each adapter's LoRA over its datums only. Each adapter's loss is a sum over its own datums and
its matrices meet no other adapter's rows, so the gradient of the total is, for each adapter, the gradient of
its own loss: exactly what training it alone computes.

The LoRA of a layer is two batched products over the datums, whatever the number of adapters:
    delta[d] = scale[d] * (x[d] @ A[d]^T) @ B[d]^T        x [B, L, in], A [B, R, in], B [B, out, R]
where A[d], B[d] are datum d's adapter's matrices (stacked once per layer and pass, ranks padded to the largest
with zeros; zero for an adapter that does not train the layer): a few launches per layer instead of a pair per
adapter, and autograd carries each datum's gradients back to its adapter's matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from symbiosis.executor.store import BaseLayer
from symbiosis.train.lora import HostedLora, TargetLayer


@dataclass
class PassState:
    """The pass's adapters: `datums[d]` is datum d's (None: the base model alone); `stacks` caches, per layer, the
    stacked matrices of the datums (TrainLinear); `scales` [B, 1, 1] is each datum's LoRA scale (0 without one),
    made once a pass: a layer's copy of it to the device would be a wait for the GPU at every layer."""
    datums: list[HostedLora | None] = field(default_factory=list)
    stacks: dict = field(default_factory=dict)
    scales: torch.Tensor | None = None

    def begin(self, datums: list[HostedLora | None]) -> None:
        self.datums, self.stacks, self.scales = datums, {}, None
        first = next((lora for lora in datums if lora is not None and lora.layers), None)
        if first is not None:
            like = next(iter(first.layers.values()))[0]
            # from pageable memory without waiting: the copy is staged before `to` returns, the GPU not drained
            self.scales = torch.tensor([0.0 if lora is None else lora.scale for lora in datums], dtype=like.dtype
                                       ).view(-1, 1, 1).to(like.device, non_blocking=True)

    def end(self) -> None:
        self.datums, self.stacks, self.scales = [], {}, None


class TrainLinear(nn.Module):
    """y = x W^T + b with the executor's W (frozen: autograd computes only grad_x = g W), plus, for each adapter's
    rows, scale * (x A^T) B^T computed in the adapter's float32 (PEFT casts so too) and added in y's dtype."""

    def __init__(self, base: BaseLayer, state: PassState):
        super().__init__()
        self.base, self.state = base, state
        self.layer_id = base.spec.layer_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, L, in]: datum d's tokens in row d
        y = self.base.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)  # [B, L, out]
        stack = self._stack()
        if stack is None:
            return y
        a, b, scale = stack
        delta = torch.bmm(torch.bmm(x.to(a.dtype), a.transpose(1, 2)), b.transpose(1, 2)) * scale  # [B, L, out]
        return y + delta.to(y.dtype)

    def _stack(self):
        """(A [B, R, in], B [B, out, R], scale [B, 1, 1]) of the pass's datums for this layer, or None if no datum's
        adapter trains it."""
        if self.layer_id in self.state.stacks:
            return self.state.stacks[self.layer_id]
        loras = self.state.datums
        adapters = {id(lora): lora for lora in loras if lora is not None and self.layer_id in lora.layers}
        stack = None
        if adapters:
            rank = max(lora.spec.rank for lora in adapters.values())
            first = next(iter(adapters.values())).layers[self.layer_id][0]
            spec = self.base.spec
            zero_a = first.new_zeros(rank, spec.in_features)
            zero_b = first.new_zeros(spec.out_features, rank)
            pairs = {key: _padded(*lora.layers[self.layer_id], rank) for key, lora in adapters.items()}
            a = torch.stack([pairs[id(lora)][0] if id(lora) in pairs else zero_a for lora in loras])
            b = torch.stack([pairs[id(lora)][1] if id(lora) in pairs else zero_b for lora in loras])
            # a datum whose adapter does not train this layer has zero matrices here: its scale does not matter
            stack = (a, b, self.state.scales)
        self.state.stacks[self.layer_id] = stack
        return stack

    def project(self, tokens: torch.Tensor, rows) -> torch.Tensor:
        """tokens [T, in] -> [T, out], `rows` covering 0..T (or none: no adapter anywhere)."""
        y = self.base.forward(tokens)
        if not any(lora is not None and self.layer_id in lora.layers for _, _, lora in rows):
            return y
        pieces = []
        for first, end, lora in rows:
            piece = y[first:end]
            if lora is not None and self.layer_id in lora.layers:
                a, b = lora.layers[self.layer_id]
                delta = (tokens[first:end].to(a.dtype) @ a.T) @ b.T * lora.scale  # [rows, out]
                piece = piece + delta.to(y.dtype)
            pieces.append(piece)
        return torch.cat(pieces)


def _padded(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, in], B [out, r] padded with zeros to `rank` (no copy when r is the rank)."""
    missing = rank - a.shape[0]
    return (a, b) if missing == 0 else (F.pad(a, (0, 0, 0, missing)), F.pad(b, (0, missing)))


def build(model_path, executor):
    """(model, state, targets): the training model of `model_path` over `executor` (in-process), its pass state,
    and the base layers an adapter may train, each with its part (attn: the attention modules' layers; mlp: the
    other layers of the decoder; unembed: the output head)."""
    import symbiosis

    model = symbiosis.from_pretrained(model_path, executor, device=executor.device, name="trainer")
    state = PassState()
    head = model.get_output_embeddings()
    attention = [m for m in model.modules() if hasattr(m, "layer_idx")]
    in_attention = {id(inner) for m in attention for inner in m.modules()}
    targets = []
    for name, module in list(model.named_modules()):
        layer_id = getattr(module, "layer_id", None)
        if layer_id is None or not hasattr(module, "session"):
            continue
        base = executor.weights.layers[layer_id]
        part = "unembed" if module is head else "attn" if id(module) in in_attention else "mlp"
        model.set_submodule(name, TrainLinear(base, state))
        targets.append(TargetLayer(name, layer_id, part, base.spec.in_features, base.spec.out_features))
    for name, module in model.named_modules():  # a MoE layer's experts: the MLP part, refused by HostedLora
        for projection, group_id in getattr(module, "symbiosis_expert_groups", {}).items():
            spec = executor.weights.layers[f"{group_id}.0"].spec
            targets.append(TargetLayer(f"{name}.{projection}", group_id, "mlp", spec.in_features, spec.out_features,
                                       experts=len(module.symbiosis_experts[projection])))
    model.requires_grad_(False)  # the client's own tensors (embeddings, norms) are the base's too: frozen
    return model.train(False), state, targets
