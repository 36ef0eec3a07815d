"""The training model: the base model over the executor's own weights (like the engine's), whose base layers add,
for the rows of each adapter's datums, that adapter's LoRA, with autograd reaching the adapters' matrices.

One pass runs every tenant's datums together (a padded batch, datums of one adapter in a row): the base GEMMs
once over all rows, each adapter's LoRA over its rows only. Each adapter's loss is a sum over its own datums and
its matrices meet no other adapter's rows, so the gradient of the total is, for each adapter, the gradient of
its own loss: exactly what training it alone computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from symbiosis.executor.store import BaseLayer
from symbiosis.train.lora import HostedLora, TargetLayer


@dataclass
class PassState:
    """Which rows of the pass's flattened tokens belong to which adapter: (first row, end row, adapter or None)."""
    rows: list[tuple[int, int, HostedLora | None]] = field(default_factory=list)


class TrainLinear(nn.Module):
    """y = x W^T + b with the executor's W (frozen: autograd computes only grad_x = g W), plus, for each adapter's
    rows, scale * (x A^T) B^T computed in the adapter's float32 (PEFT casts so too) and added in y's dtype."""

    def __init__(self, base: BaseLayer, state: PassState):
        super().__init__()
        self.base, self.state = base, state
        self.layer_id = base.spec.layer_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        y = self.project(tokens, self.state.rows)
        return y.view(*x.shape[:-1], y.shape[-1])

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
    model.requires_grad_(False)  # the client's own tensors (embeddings, norms) are the base's too: frozen
    return model.train(False), state, targets
