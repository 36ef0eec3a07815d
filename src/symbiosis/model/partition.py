"""Which tensors of a checkpoint are base (served by the executor) and which belong to a client.

A *base layer* is every `nn.Linear` and transformers `Conv1D` of the model whose weight the checkpoint
holds, lm_head included. Its weight (and bias) live only in the executor. Everything else (embeddings,
norms, rotary buffers, a new head of another class than the checkpoint's) belongs to the client. Where
each tensor lies in the checkpoint is transformers' business (`layout.Layout`): keys it renames or
converts on load are renamed and converted here too.

Layer ids are the module names written the way the checkpoint names tensors after transformers' renaming
(`model.layers.3.self_attn.q_proj`; GPT-NeoX's `embed_out` is `lm_head`), so a client built with another
head class (say `AutoModelForSequenceClassification` on a causal-LM checkpoint, whose modules are prefixed
differently) and the executor still agree on every id.

Experts of a mixture-of-experts model (transformers 5: one module per layer holding fused 3-D parameters,
`gate_up_proj` [experts, 2 x intermediate, hidden] or `up_proj`, and `down_proj`; transposed in gpt-oss) are
base layers too: each expert's projection is one base layer, `<tensor name>.<expert>`, whose weight is a view of
the fused tensor (`BaseLayerSpec.expert`), so the executor holds every expert once and a client none. The router
(not an `nn.Linear` in transformers 5) stays the client's, as do the routing and the activation between the
projections (client/experts.py).

Tied weights: when `lm_head.weight` is tied to the input embedding (`tie_word_embeddings`), the checkpoint
stores the matrix once, under the embedding's name. The executor reads it as lm_head's weight, the client
reads it as its embedding table: the one tensor is read by both sides, and held once on each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
import transformers
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D

from symbiosis.errors import CheckpointError
from symbiosis.model.checkpoint import Checkpoint
from symbiosis.model.layout import Layout

log = logging.getLogger("symbiosis")

# gated_mlp: a block of three layers (plan_gated_mlps); decoder_tail: o_proj, a residual, a norm and a gated_mlp
# (plan_decoder_tails)
LayerKind = Literal["linear", "conv1d", "gated_mlp", "decoder_tail"]
BLOCK_KINDS = ("gated_mlp", "decoder_tail")  # their backward takes [x | g] (protocol.py)
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
    weight_name: str  # the tensors' names in the checkpoint (layout.Layout): what the executor reads
    bias_name: str | None
    expert: int | None = None  # an expert's projection: its index in the fused [experts, ...] tensors named above


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


def _base_layer_spec(model, module_name: str, module: nn.Module, layout: Layout) -> BaseLayerSpec | None:
    weight_param = f"{module_name}.weight"
    weight_name = layout.names.get(weight_param)
    if weight_name is None:
        source = (getattr(model, "all_tied_weights_keys", None) or {}).get(weight_param)
        weight_name = layout.names.get(source) if source else None
        if weight_name is None:
            return None  # not in the checkpoint: a new head (the client's), or missing (check_complete says)
        layer_id = module_name
    else:
        layer_id = weight_name.removesuffix(".weight")
    bias_name = layout.names.get(f"{module_name}.bias") if module.bias is not None else None
    if module.bias is not None and bias_name is None:
        raise CheckpointError(f"{layout.checkpoint.listing}: layer {layer_id!r} has a bias but the checkpoint holds none")
    if isinstance(module, Conv1D):
        kind, in_features, out_features = "conv1d", module.nx, module.nf
        expected = (in_features, out_features)
    else:
        kind, in_features, out_features = "linear", module.in_features, module.out_features
        expected = (out_features, in_features)
    found = layout.shape(weight_name)
    if found is not None and found != expected:
        raise CheckpointError(f"{layout.checkpoint.listing}: tensor {layout.keys(weight_name)[0]!r} has shape "
                              f"{list(found)}, the config implies {list(expected)}")
    return BaseLayerSpec(layer_id, kind, in_features, out_features, weight_name, bias_name)


def plan_base_layers(model: PreTrainedModel, layout: Layout) -> dict[str, BaseLayerSpec]:
    """Module name in `model` -> spec of the base layer that replaces it."""
    plan = {}
    for module_name, module in model.named_modules():
        if is_base_module(module):
            spec = _base_layer_spec(model, module_name, module, layout)
            if spec is not None:
                plan[module_name] = spec
    return plan


# transformers' MLP classes whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)), read in their source
# (transformers 5); a class whose forward changed would be computed wrong whole: the exactness tests run them
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP",
                        "GraniteMLP", "Olmo2MLP"})


def plan_gated_mlps(model: PreTrainedModel, plan: dict[str, BaseLayerSpec]) -> dict[str, BaseLayerSpec]:
    """Module name -> spec of each gated MLP whose three projections are planned base layers (linear, no expert):
    a block the executor may run whole. Its spec: x [T, hidden] -> [T, hidden], kind `gated_mlp`, the layer ids
    of gate, up and down in `weight_name` (joined by the group separator). Both sides compute it from the model."""
    blocks = {}
    for module_name, module in model.named_modules():
        if type(module).__name__ not in GATED_MLPS:
            continue
        parts = [plan.get(f"{module_name}.{name}") for name in ("gate_proj", "up_proj", "down_proj")]
        if any(p is None or p.kind != "linear" or p.expert is not None for p in parts):
            continue
        gate, up, down = parts
        if gate.in_features != up.in_features or gate.out_features != up.out_features or \
                down.in_features != gate.out_features or down.out_features != gate.in_features:
            continue
        blocks[module_name] = BaseLayerSpec(module_name, "gated_mlp", gate.in_features, down.out_features,
                                            GROUP_SEPARATOR.join(p.layer_id for p in parts), None)
    return blocks


# transformers' decoder layers whose forward is h = x + self_attn(input_layernorm(x)) (o_proj its last step), then
# h + mlp(post_attention_layernorm(h)), read in their source (transformers 5): nothing between the attention's
# o_proj and the residual, nor after the MLP. Gemma's and Olmo2's add norms there, Granite scales the residuals.
DECODER_TAILS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})


def plan_decoder_tails(model: PreTrainedModel, plan: dict[str, BaseLayerSpec],
                       mlps: dict[str, BaseLayerSpec]) -> dict[str, BaseLayerSpec]:
    """Decoder layer name -> spec of its tail, a block the executor may run whole: the update a layer makes to the
    residual stream after its attention, d = o(a) + mlp(norm(h + o(a))), of h (the residual plus whatever the
    tenant's adapter adds to o_proj's output) and a (o_proj's input). Its spec: [h | a] [T, hidden + attention] ->
    d [T, hidden], kind `decoder_tail`, and in `weight_name` the ids of o_proj, of the MLP's block (`mlps`) and the
    post-attention norm's module (its weight is the base's). Both sides compute it from the model."""
    tails = {}
    for module_name, module in model.named_modules():
        if type(module).__name__ not in DECODER_TAILS or not isinstance(getattr(module, "post_attention_layernorm",
                                                                                 None), nn.Module):
            continue
        o_proj, mlp = plan.get(f"{module_name}.self_attn.o_proj"), mlps.get(f"{module_name}.mlp")
        if o_proj is None or o_proj.kind != "linear" or o_proj.expert is not None or mlp is None or \
                o_proj.out_features != mlp.in_features:
            continue
        parts = (o_proj.layer_id, mlp.layer_id, f"{module_name}.post_attention_layernorm")
        tails[module_name] = BaseLayerSpec(module_name, "decoder_tail", o_proj.out_features + o_proj.in_features,
                                           o_proj.out_features, GROUP_SEPARATOR.join(parts), None)
    return tails


EXPERT_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")  # transformers 5's fused expert parameters


def is_experts_module(module: nn.Module) -> bool:
    """transformers 5's experts of a MoE layer (made by `use_experts_implementation`): fused 3-D parameters."""
    down = getattr(module, "down_proj", None)
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and isinstance(down, nn.Parameter) \
        and down.dim() == 3


def _expert_specs(module_name: str, module: nn.Module, projection: str, layout: Layout) -> list[BaseLayerSpec]:
    weight = getattr(module, projection)
    weight_name = layout.names.get(f"{module_name}.{projection}")
    if weight_name is None:
        return []  # missing (check_complete says)
    bias_name = layout.names.get(f"{module_name}.{projection}_bias") if getattr(module, "has_bias", False) else None
    if getattr(module, "has_bias", False) and bias_name is None:
        raise CheckpointError(f"{layout.checkpoint.listing}: experts {module_name!r} have a {projection} bias but the "
                              "checkpoint holds none")
    experts, rows, cols = weight.shape
    found = layout.shape(weight_name)
    if found is not None and tuple(found) != (experts, rows, cols):
        raise CheckpointError(f"{layout.checkpoint.listing}: tensor {layout.keys(weight_name)[0]!r} has shape "
                              f"{list(found)}, the config implies {[experts, rows, cols]}")
    # per expert: [out, in] (a linear's W) or, transposed (gpt-oss), [in, out] (a Conv1D's W)
    kind, (in_features, out_features) = ("conv1d", (rows, cols)) if module.is_transposed else ("linear", (cols, rows))
    return [BaseLayerSpec(f"{weight_name}.{e}", kind, in_features, out_features, weight_name, bias_name, e)
            for e in range(experts)]


def plan_expert_layers(model: PreTrainedModel, layout: Layout) -> dict[str, dict[str, list[BaseLayerSpec]]]:
    """Experts module name in `model` -> its fused projection's parameter name -> one spec per expert."""
    plan = {}
    for module_name, module in model.named_modules():
        if is_experts_module(module):
            projections = {p: _expert_specs(module_name, module, p, layout) for p in EXPERT_PROJECTIONS
                           if isinstance(getattr(module, p, None), nn.Parameter)}
            if all(projections.values()):
                plan[module_name] = projections
    return plan


def all_base_layers(model: PreTrainedModel, layout: Layout) -> list[BaseLayerSpec]:
    """Every base layer of `model`: its linear layers, and each expert's projections."""
    experts = [s for projections in plan_expert_layers(model, layout).values() for specs in projections.values()
               for s in specs]
    return list(plan_base_layers(model, layout).values()) + experts


def _in_base_model(model: PreTrainedModel, key: str) -> bool:
    return model.base_model is model or key.startswith(model.base_model_prefix + ".")


def check_complete(model: PreTrainedModel, layout: Layout) -> list[str]:
    """Refuse, before anything is computed, a checkpoint that lacks a tensor `model` needs (where transformers
    would fill it with random values and only log it). Returns the tensors of a *new head*, which are
    initialised as transformers does: the task head of a class other than the checkpoint's own (a `LlamaModel`
    checkpoint under `AutoModelForCausalLM`, a causal LM under `AutoModelForSequenceClassification`)."""
    missing = layout.missing(model)
    own_class = type(model).__name__ in (model.config.architectures or [])
    new_head = [key for key in missing if not own_class and not _in_base_model(model, key)]
    lacking = [key for key in missing if key not in new_head]
    if lacking:
        shown = ", ".join(repr(k) for k in lacking[:8]) + (f" and {len(lacking) - 8} more" if len(lacking) > 8 else "")
        raise CheckpointError(
            f"{layout.checkpoint.listing}: no tensor for {shown}, which {type(model).__name__} needs (after "
            "transformers' own key renaming and conversion); transformers would initialise them with random "
            "values, symbiosis refuses to. Is the checkpoint complete, and was it saved for this model type?")
    if new_head:
        log.warning("%s: %s is not in the checkpoint (saved as %s): a new head, initialised as transformers does; "
                    "train it before use", layout.checkpoint.path, ", ".join(new_head), model.config.architectures)
    return new_head
