"""Which tensors of a checkpoint are base (served by the executor) and which belong to a client.

A *base layer* is every `nn.Linear` and transformers `Conv1D` of the model whose weight the checkpoint
holds, lm_head included. Its weight (and bias) live only in the executor. Everything else (embeddings,
norms, rotary buffers, heads the checkpoint lacks) belongs to the client.

Layer ids are the module names written the way the checkpoint names tensors
(`model.layers.3.self_attn.q_proj`), so a client built with another head class (say
`AutoModelForSequenceClassification` on a causal-LM checkpoint, whose modules are prefixed differently)
and the executor still agree on every id.

Tied weights: when `lm_head.weight` is tied to the input embedding (`tie_word_embeddings`), the checkpoint
stores the matrix once, under the embedding's name. The executor reads it as lm_head's weight, the client
reads it as its embedding table: the one tensor is read by both sides, and held once on each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import transformers
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D

from symbiosis.errors import CheckpointError
from symbiosis.model.checkpoint import Checkpoint

LayerKind = Literal["linear", "conv1d"]
GROUP_SEPARATOR = "+"  # "a+b+c": layers a, b, c that take one input, run as one GEMM


@dataclass(frozen=True)
class BaseLayerSpec:
    """One base layer as both sides see it.

    linear: y = x W^T + b, W: [out, in];  conv1d: y = x W + b, W: [in, out].
    """

    layer_id: str
    kind: LayerKind
    in_features: int
    out_features: int
    weight_key: str
    bias_key: str | None


def group_spec(specs: dict[str, BaseLayerSpec], layer_id: str) -> BaseLayerSpec | None:
    """The spec of a layer, or of a group of layers sharing an input (outputs side by side)."""
    if GROUP_SEPARATOR not in layer_id:
        return specs.get(layer_id)
    members = [specs.get(i) for i in layer_id.split(GROUP_SEPARATOR)]
    if any(m is None for m in members):
        return None
    return BaseLayerSpec(layer_id, members[0].kind, members[0].in_features, sum(m.out_features for m in members),
                         "", None)


def is_base_module(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))


def load_config(checkpoint: Checkpoint) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(checkpoint.path)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{checkpoint.path}/config.json: transformers cannot build a config from it ({e})") from e


def build_skeleton(config: PretrainedConfig, auto_class, dtype: torch.dtype) -> PreTrainedModel:
    """The model's module tree on the meta device: no memory, no init cost."""
    with torch.device("meta"):
        try:
            if hasattr(auto_class, "from_config"):
                return auto_class.from_config(config, dtype=dtype)
            return auto_class._from_config(config, dtype=dtype)
        except ValueError as e:
            raise CheckpointError(f"{auto_class.__name__} cannot build a model from this config: {e}") from e


def architecture_class(config: PretrainedConfig):
    """The class the checkpoint was saved from (config.architectures[0]); it names every tensor in the file."""
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def checkpoint_name(model: PreTrainedModel, param_name: str, checkpoint: Checkpoint) -> str | None:
    """The checkpoint key holding `param_name` of `model`, allowing for the base-model prefix
    (a `LlamaModel` checkpoint read into `LlamaForCausalLM`, or the reverse)."""
    prefix = model.base_model_prefix + "."
    candidates = [param_name]
    if param_name.startswith(prefix):
        candidates.append(param_name[len(prefix):])
    else:
        candidates.append(prefix + param_name)
    return next((c for c in candidates if c in checkpoint), None)


def _base_layer_spec(model, module_name: str, module: nn.Module, checkpoint: Checkpoint) -> BaseLayerSpec | None:
    weight_param = f"{module_name}.weight"
    weight_key = checkpoint_name(model, weight_param, checkpoint)
    if weight_key is None:
        source = (getattr(model, "all_tied_weights_keys", None) or {}).get(weight_param)
        weight_key = checkpoint_name(model, source, checkpoint) if source else None
        if weight_key is None:
            return None  # not in the checkpoint: a new head, the client owns and initializes it
        layer_id = module_name
    else:
        layer_id = weight_key.removesuffix(".weight")
    bias_key = checkpoint_name(model, f"{module_name}.bias", checkpoint) if module.bias is not None else None
    if module.bias is not None and bias_key is None:
        raise CheckpointError(f"{checkpoint.path}: layer {layer_id!r} has a bias but the checkpoint holds none")
    if isinstance(module, Conv1D):
        kind, in_features, out_features = "conv1d", module.nx, module.nf
        expected = (in_features, out_features)
    else:
        kind, in_features, out_features = "linear", module.in_features, module.out_features
        expected = (out_features, in_features)
    found = checkpoint.entries[weight_key].shape
    if found != expected:
        raise CheckpointError(f"{checkpoint.path}: tensor {weight_key!r} has shape {list(found)}, "
                              f"the config implies {list(expected)}")
    return BaseLayerSpec(layer_id, kind, in_features, out_features, weight_key, bias_key)


def plan_base_layers(model: PreTrainedModel, checkpoint: Checkpoint) -> dict[str, BaseLayerSpec]:
    """Module name in `model` -> spec of the base layer that replaces it."""
    plan = {}
    for module_name, module in model.named_modules():
        if is_base_module(module):
            spec = _base_layer_spec(model, module_name, module, checkpoint)
            if spec is not None:
                plan[module_name] = spec
    return plan
