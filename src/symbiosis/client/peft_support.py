"""PEFT on a split model: which methods run exactly, which are refused (and why), and the hooks that make
PEFT's own entry points hold to it.

PEFT wraps a split model's virtual layers as it wraps any `nn.Linear`. A tuner whose layers only call their
base layer (`base_layer(x)`) and add terms of their own runs unchanged: the base calls go to the executor.
A tuner that computes with the base weight's values is either rewritten so that it needs only executor
calls (DoRA: `client/dora.py`; the methods that multiply W by a tenant matrix from one side:
`client/rewrites.py`), or refused when `get_peft_model` (or `PeftModel.from_pretrained`, `add_adapter`,
`load_adapter`, `inject_adapter_in_model`) runs, naming the method and why, before any compute.

The tables below are keyed by PEFT's own registry of tuner types (`peft.utils.peft_types.PeftType`): a type
that a later PEFT release adds, and that is in neither table, is *untested*: allowed, with a warning (a base
weight read still raises `VirtualWeightAccess` rather than compute with garbage). Every type in `EXACT` has
a float64 test against plain PEFT (tests/matrix.py), and the README's table is generated from both.

The hooks (`install`, run once on import of `symbiosis.client.build`) change nothing for plain models: each
first asks whether the model it is given is a split one.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from peft import PeftModel
from peft.mixed_model import PeftMixedModel
from peft.tuners.adaption_prompt.model import AdaptionPromptModel
from peft.tuners.lora import layer as lora_layer
from peft.tuners.lora.layer import ParamWrapper
from peft.tuners.lora.variants import DoraLinearVariant
from peft.tuners.tuners_utils import BaseTuner

from symbiosis.client.adapter_files import check_adapter_directory
from symbiosis.client.dora import SplitDoraLinearVariant
from symbiosis.client.experts import SplitParamWrapper
from symbiosis.client.rewrites import REWRITES
from symbiosis.client.virtual import VirtualConv1D, VirtualLinear, VirtualWeight
from symbiosis.errors import UnsupportedAdapter

# Tuner types that run exactly on a split model: their layers call the base layer and add terms of their own,
# or are rewritten here. Each is tested in float64 against plain PEFT (tests/matrix.py says on which models).
EXACT = frozenset({
    "LORA", "ADALORA", "IA3", "LOHA", "LOKR", "OFT", "BOFT", "HRA", "VERA", "PVERA", "FOURIERFT", "VBLORA",
    "UNILORA", "RANDLORA", "ROAD", "C3A", "WAVEFT", "GRALORA", "MISS", "POLY", "LN_TUNING", "BEFT", "LILY",
    "SHADOW", "XLORA", "TRAINABLE_TOKENS", "SHIRA", "PEANUT", "DEFT", "PROMPT_TUNING", "MULTITASK_PROMPT_TUNING",
    "P_TUNING", "PREFIX_TUNING", "ADAPTION_PROMPT", "CPT", "CARTRIDGE",
})


def _needs_w(what: str) -> str:
    return f"it {what}; a split model holds no base weight values (the executor does)"


def _per_rank_calls(what: str) -> str:
    return (f"its update is {what}: exact with executor calls only at one extra full-size call of the layer per "
            "rank every forward, several times the base layer's cost; refused rather than run that slowly")


# Tuner types refused on a split model, and why.
REFUSED = {
    "ADAMSS": _needs_w("initialises its subspaces from an SVD of the base weight"),
    "OSF": _needs_w("splits the base weight by an SVD and trains its singular vectors in place of it"),
    "PSOFT": _needs_w("builds its subspace from an SVD of the base weight"),
    "TINYLORA": _needs_w("builds its projections from an SVD of the base weight"),
    "FROD": _needs_w("initialises from a joint decomposition of the base weights"),
    "DELORA": _needs_w("scales its update by the base weight's norms over the input dimension"),
    "SUPERTUNING": _needs_w("chooses the entries it trains by the magnitude of the base weight's entries"),
    "HIRA": _per_rank_calls("the entrywise product W ⊙ (B A)"),
    "GLORA": _per_rank_calls("W ⊙ A + B with a low-rank A") + " (PEFT also takes only base layers of type exactly "
                                                               "torch.nn.Linear)",
}


@dataclass(frozen=True)
class RefusedOption:
    """A setting of a tuner that is otherwise exact, refused on a split model."""

    setting: str  # how errors and the README name it
    applies: Callable[[Any, Any], Any]  # (config, the split model or None) -> whether it has this setting (truthy;
    #                                     a list names where)
    why: str


def _init(config, field: str = "init_lora_weights") -> str:
    value = getattr(config, field, None)
    return value if isinstance(value, str) else ""


REFUSED_OPTIONS = [
    RefusedOption("LoRA init_lora_weights='pissa' / 'pissa_niter_k'", lambda c, m: _init(c).startswith("pissa"),
                  _needs_w("initialises from an SVD of the base weight, and subtracts its principal part from it")),
    RefusedOption("LoRA init_lora_weights='olora'", lambda c, m: _init(c) == "olora",
                  _needs_w("initialises from a QR decomposition of the base weight, and subtracts it")),
    RefusedOption("LoRA init_lora_weights='corda'", lambda c, m: _init(c) == "corda",
                  _needs_w("initialises from an SVD of the base weight times its inputs' covariance")),
    RefusedOption("LoRA init_lora_weights='loftq'", lambda c, m: _init(c) == "loftq",
                  _needs_w("quantises the base weight and initialises from the residual")),
    RefusedOption("LoRA init_lora_weights='lora_ga'", lambda c, m: _init(c) == "lora_ga",
                  _needs_w("initialises from the base weight's gradient, which the executor never computes")),
    RefusedOption("LoRA init_lora_weights='mica'", lambda c, m: _init(c) == "mica",
                  _needs_w("sets B to singular vectors of the base weight")),
    RefusedOption("LoRA kasa_config (KaSA)", lambda c, m: getattr(c, "kasa_config", None) is not None,
                  _needs_w("truncates the base weight's SVD and trains its singular values")),
    RefusedOption("LoRA target_parameters on a linear layer's base weight",
                  lambda c, m: m is not None and _base_weights_targeted(c, m),
                  _needs_w("adds its update to that weight tensor itself") + "; target_modules does the same "
                  "exactly, and target_parameters on a MoE layer's fused experts or the client's own weights (a "
                  "router's) runs exactly"),
    RefusedOption("MiSS init_weights='bat'", lambda c, m: _kind(c) == "MISS" and getattr(c, "init_weights", None) == "bat",
                  "its update multiplies blocks of the base weight: exact with executor calls only at one extra "
                  "full-size call per output block every forward"),
    RefusedOption("DEFT init_weights=True without para (its default)",
                  lambda c, m: _kind(c) == "DEFT" and c.init_weights is True and not c.para,
                  _needs_w("initialises its update from the base weight projected on its subspace") +
                  "; init_weights=False or para=True run exactly"),
]


def _base_weights_targeted(config, model) -> list[str]:
    """The executor-held parameters a LoRA config's `target_parameters` names (PEFT matches them by name suffix),
    after PEFT's own rewriting of MoE targets for transformers 5 (which turns "all-linear" on a MoE model into
    LoRA on its fused experts too), run here on a copy before PEFT runs it."""
    if getattr(config, "target_parameters", None) is None and not hasattr(config, "target_modules"):
        return []
    config = copy.deepcopy(config)
    try:
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers,
            get_model_conversion_mapping,
        )
        convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
    except (ImportError, AttributeError, TypeError, ValueError):
        pass  # another PEFT or model: the targets as given
    targets = getattr(config, "target_parameters", None) or []
    experts = {name for name, module in model.named_modules() if hasattr(module, "symbiosis_experts")}
    return [name for name, parameter in model.named_parameters(remove_duplicate=False)
            if isinstance(parameter, VirtualWeight) and any(name == t or name.endswith("." + t) for t in targets)
            and name.rpartition(".")[0] not in experts]  # LoRA on the fused experts runs (client/experts.py)


def _kind(config) -> str:
    return getattr(config.peft_type, "value", config.peft_type)


def check_config(config, model=None) -> None:
    """Refuse a PEFT config that cannot run exactly on a split model (`UnsupportedAdapter`, before anything is
    built); warn about a tuner type no test covers. `model`: the split model it is for, where known."""
    kind = _kind(config)
    if kind in REFUSED:
        raise UnsupportedAdapter(f"PEFT method {kind} cannot run on a split model: {REFUSED[kind]}. Use it on a "
                                 "plain model (transformers + PEFT), or another method (README: PEFT methods)")
    for option in REFUSED_OPTIONS:
        found = option.applies(config, model)
        if found:
            where = f" ({', '.join(map(repr, found[:4]))}{', ...' if len(found) > 4 else ''})" if isinstance(found, list) else ""
            raise UnsupportedAdapter(f"{option.setting}{where} cannot run on a split model: {option.why}. Use it on a plain "
                                     "model (transformers + PEFT), or another setting (README: PEFT methods)")
    if kind not in EXACT:
        warnings.warn(f"PEFT method {kind} is not tested on split models by this symbiosis release; a read of a base "
                      "weight still raises VirtualWeightAccess, but check its results against a plain model",
                      stacklevel=3)


def is_split(model) -> bool:
    get_base = getattr(model, "get_base_model", None)
    return getattr(get_base() if get_base else model, "symbiosis_session", None) is not None


def _is_virtual(module) -> bool:
    return isinstance(module, (VirtualLinear, VirtualConv1D))


def _checked_inject(inject):
    """Check the config first; then give the layers PEFT built over virtual base layers their rewrites."""
    @functools.wraps(inject)
    def wrapper(self, model, adapter_name, *args, **kwargs):
        if not is_split(model):
            return inject(self, model, adapter_name, *args, **kwargs)
        check_config(self.peft_config[adapter_name], model)
        result = inject(self, model, adapter_name, *args, **kwargs)
        for module in model.modules():
            rewrite = REWRITES.get(type(module))
            if rewrite is not None and _is_virtual(module.get_base_layer()):
                module.__class__ = rewrite
            elif type(module) is ParamWrapper and hasattr(module.get_base_layer(), "symbiosis_experts"):
                module.__class__ = SplitParamWrapper  # LoRA on a split model's fused experts
        return result
    return wrapper


def _checked_tuner(init):
    """Check the config before the tuner does anything (some read the base weights in a pre-injection hook)."""
    @functools.wraps(init)
    def wrapper(self, model, peft_config, adapter_name, *args, **kwargs):
        if is_split(model):
            check_config(peft_config[adapter_name] if isinstance(peft_config, dict) else peft_config, model)
        return init(self, model, peft_config, adapter_name, *args, **kwargs)
    return wrapper


def _checked_prompt(setup):
    @functools.wraps(setup)
    def wrapper(self, adapter_name, *args, **kwargs):
        if is_split(self):
            check_config(self.peft_config[adapter_name])
        return setup(self, adapter_name, *args, **kwargs)
    return wrapper


def _checked_adaption_prompt(add_adapter):
    @functools.wraps(add_adapter)
    def wrapper(self, adapter_name, config, *args, **kwargs):
        if is_split(self.model):
            check_config(config)
        return add_adapter(self, adapter_name, config, *args, **kwargs)
    return wrapper


def adapter_directory(model_id, kwargs) -> str:
    subfolder = kwargs.get("subfolder")
    return os.path.join(model_id, subfolder) if subfolder else model_id


def _checked_load(load_adapter):
    """A split model's adapter directory is checked (safetensors only, no pickle) before PEFT reads it."""
    @functools.wraps(load_adapter)
    def wrapper(self, model_id, *args, **kwargs):
        if is_split(self):
            check_adapter_directory(adapter_directory(model_id, kwargs))
        return load_adapter(self, model_id, *args, **kwargs)
    return wrapper


def _split_lora_variants(variants_property):
    """LoRA's variant table, with PEFT's DoRA swapped for the split one where the base layer is virtual."""
    @functools.wraps(variants_property.fget)
    def lora_variants(self):
        variants = variants_property.fget(self)
        if _is_virtual(self.get_base_layer()):
            variants = {k: SplitDoraLinearVariant if v is DoraLinearVariant else v for k, v in variants.items()}
        return variants
    return property(lora_variants)


def install() -> None:
    """Put the checks and rewrites into PEFT's entry points (once)."""
    if getattr(BaseTuner.inject_adapter, "_symbiosis", False):
        return
    patches = [
        (BaseTuner, "__init__", _checked_tuner),
        (BaseTuner, "inject_adapter", _checked_inject),
        (PeftModel, "_setup_prompt_encoder", _checked_prompt),
        (AdaptionPromptModel, "add_adapter", _checked_adaption_prompt),
        (PeftModel, "load_adapter", _checked_load),
        (PeftMixedModel, "load_adapter", _checked_load),
    ]
    for owner, name, wrap in patches:
        wrapped = wrap(getattr(owner, name))
        wrapped._symbiosis = True
        setattr(owner, name, wrapped)
    lora_layer.Linear.lora_variants = _split_lora_variants(lora_layer.Linear.lora_variants)
