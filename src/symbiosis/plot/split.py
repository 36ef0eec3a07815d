"""A model cut at layer k (HMI §3.3): the lower part (embeddings + layers 0..k-1), which PLOT tables replace, and the
upper part (layers k..L-1 + the head), which takes the lower part's output as its input.

    lower = LowerLayers(model_dir, k)          # builds tables: fragments [N, G] -> representations [N, G, d]
    upper = UpperModel(model_dir, k)           # logits from hidden states [B, T, d]; PEFT wraps `upper.model`

`UpperModel` is the Hugging Face model itself with its first k layers removed (layer indices renumbered, so its KV
cache and masks are those of an (L-k)-layer model) and whatever the model adds to its input embedding besides the
embedding (GPT-2's learned positions; BERT's positions, token types and LayerNorm) bypassed: the lower layers'
output already holds it. That the cut is exact is checked when the upper model is made: on a short probe,
upper(lower(x)) must give the whole model's logits, or the architecture is refused (`UnsupportedModel`).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.utils import logging as transformers_logging

from symbiosis.errors import SymbiosisError

# encoders whose embeddings module takes (input_ids, token_type_ids, position_ids, inputs_embeds) and whose
# layers are `encoder.layer`
ENCODERS = ("bert", "roberta", "xlm-roberta", "electra", "camembert")


class UnsupportedModel(SymbiosisError):
    """An architecture whose lower layers cannot be cut off exactly."""


def model_kind(config) -> str:
    return "encoder" if config.model_type in ENCODERS else "decoder"


def _cut_config(config, layers: slice):
    """A copy of `config` for the layers in `layers` (num_hidden_layers, and layer_types where it has them)."""
    config = copy.deepcopy(config)
    kept = range(config.num_hidden_layers)[layers]
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in kept]
    config.num_hidden_layers = len(kept)
    return config


def layer_list(model: nn.Module, count: int) -> tuple[nn.Module, str]:
    """(parent, attribute) of the model's stack of `count` transformer layers."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and name.rsplit(".", 1)[-1] in ("layers", "h", "layer"):
            parent_name, _, attribute = name.rpartition(".")
            return model.get_submodule(parent_name), attribute
    raise UnsupportedModel(f"{type(model).__name__}: no stack of {count} transformer layers found")


def check_cut(config, lower_layers: int) -> None:
    total = config.num_hidden_layers
    if not 1 <= lower_layers < total:
        raise UnsupportedModel(f"the lower part must be 1..{total - 1} of the model's {total} layers, not "
                               f"{lower_layers}")


class LowerLayers:
    """The embeddings and the first `lower_layers` layers; `represent` runs fragments alone through them."""

    def __init__(self, model_dir, lower_layers: int, device="cpu", dtype=None, state_dict: dict | None = None):
        """`state_dict`: weights to use instead of the checkpoint's (a domain's further pre-trained lower layers)."""
        config = AutoConfig.from_pretrained(model_dir)
        check_cut(config, lower_layers)
        self.kind, self.lower_layers, self.vocab = model_kind(config), lower_layers, config.vocab_size
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # the upper layers' weights go unread on purpose: no report
        try:
            self.model = AutoModel.from_pretrained(model_dir, config=_cut_config(config, slice(0, lower_layers)),
                                                   dtype=dtype).to(device).eval()
        finally:
            transformers_logging.set_verbosity(verbosity)
        if state_dict is not None:
            self.model.load_state_dict(state_dict, strict=False)
        parent, attribute = layer_list(self.model, lower_layers)
        self._output = None
        getattr(parent, attribute)[-1].register_forward_hook(self._keep)
        self.hidden = config.hidden_size
        self.device = torch.device(device)
        # the longest sequence the model places (learned positions end there): `in_context` runs no longer ones
        self.max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

    def _keep(self, _module, _args, output):
        self._output = output[0] if isinstance(output, tuple) else output

    @torch.no_grad()
    def represent(self, fragments: np.ndarray, batch: int = 1024) -> torch.Tensor:
        """fragments int64 [N, G] -> [N, G, hidden]: layer k's output at each position, each fragment run alone
        (positions 0..G-1)."""
        outputs = []
        for first in range(0, fragments.shape[0], batch):
            ids = torch.as_tensor(fragments[first:first + batch], device=self.device)
            self.model(input_ids=ids, attention_mask=torch.ones_like(ids))
            outputs.append(self._output.detach())
        if not outputs:
            return torch.zeros(0, fragments.shape[1], self.hidden)
        return torch.cat(outputs)

    @torch.no_grad()
    def in_context(self, sequences: list[np.ndarray]) -> list[torch.Tensor]:
        """Each sequence (int64 [T], T >= 1) run whole through the lower layers -> [T, hidden] each: layer k's output
        at each position with the sequence's own context (right-padded batches, masked)."""
        longest = max(s.size for s in sequences)
        ids = torch.zeros(len(sequences), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(sequences):
            ids[row, :tokens.size], mask[row, :tokens.size] = torch.from_numpy(tokens), 1
        self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        return [self._output[row, :tokens.size].detach() for row, tokens in enumerate(sequences)]


class _PassThroughEmbeddings(nn.Module):
    """Stands in for a BERT-style embeddings module: the input is already the lower layers' output."""

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, **_):
        return inputs_embeds


class _NoPositions(nn.Module):
    """Stands in for GPT-2's learned positions: the lower layers' output already holds them."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, position_ids):
        return torch.zeros(*position_ids.shape, self.width, device=position_ids.device)


class UpperModel:
    """Layers k..L-1 and the head of `model_dir`: decoders as their causal LM, encoders as their sequence
    classifier. `model` is the Hugging Face module (PEFT adapters wrap it)."""

    def __init__(self, model_dir, lower_layers: int, device="cpu", dtype=None, probe: bool = True, model=None):
        """`model`: the whole model of `model_dir`, already built (a split client on the executor's weights, so
        that no copy of the base is made), else it is loaded."""
        config = AutoConfig.from_pretrained(model_dir)
        check_cut(config, lower_layers)
        self.kind, self.lower_layers = model_kind(config), lower_layers
        if model is None:
            auto = AutoModelForCausalLM if self.kind == "decoder" else AutoModelForSequenceClassification
            model = auto.from_pretrained(model_dir, dtype=dtype).to(device)
        model.eval()
        probe_ids = torch.tensor([[1, 2, 3][:min(3, config.vocab_size)]], device=device)
        expected = model(input_ids=probe_ids).logits if probe else None
        parent, attribute = layer_list(model, config.num_hidden_layers)
        setattr(parent, attribute, nn.ModuleList(list(getattr(parent, attribute))[lower_layers:]))
        cut = _cut_config(model.config, slice(lower_layers, None))  # with the attention implementation set
        whole = model.config
        for module in model.modules():
            if getattr(module, "config", None) is whole:  # masks and caches are made from it: (L-k) layers
                module.config = cut
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx -= lower_layers
        base = model.base_model
        if self.kind == "encoder":
            base.embeddings = _PassThroughEmbeddings()
        elif isinstance(getattr(base, "wpe", None), nn.Embedding):
            base.wpe = _NoPositions(base.wpe.embedding_dim)
        self.model, self.device = model, torch.device(device)
        if probe:
            lower = LowerLayers(model_dir, lower_layers, device, model.dtype)
            hidden = lower.represent(probe_ids.cpu().numpy())
            got = self.logits(hidden)
            if got.shape != expected.shape or not torch.allclose(got.float(), expected.float(), rtol=1e-3, atol=1e-3):
                raise UnsupportedModel(f"{type(model).__name__}: its upper layers on its lower layers' output do not "
                                       "give the whole model's logits (it adds to its input something this cut does "
                                       "not know)")

    def logits(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """hidden [B, T, d] (layer k's output) -> the model's logits ([B, T, vocab], or [B, labels] for a
        classifier)."""
        hidden = hidden.to(self.device, self.model.dtype)
        return self.model(inputs_embeds=hidden, attention_mask=attention_mask, **kwargs).logits
