"""Build a tenant's model: the full transformers model, with every base layer virtual.

    model = symbiosis.from_pretrained(path, executor, auto_class=AutoModelForCausalLM, dtype=torch.float64)

The model is built on the meta device (no memory), base layers are swapped for virtual ones, and only
then is real storage made for what is left: the client's own tensors, read from the checkpoint (and only
those) where transformers would read them (`model.layout`), plus what transformers makes itself (rotary
tables, a new head of another class than the checkpoint's), initialised the way transformers does. Any
other tensor the checkpoint lacks is a `CheckpointError` before anything runs. The result is an ordinary `PreTrainedModel`: PEFT, `Trainer`
and `generate()` use it unchanged.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from symbiosis.client import peft_support
from symbiosis.client.blocks import serve_tail, serve_whole
from symbiosis.client.adapter_files import check_adapter_directory
from symbiosis.client.experts import make_virtual_experts
from symbiosis.client.privacy import MaskedSession, NoiseMasking
from symbiosis.client.grouping import CallGrouper
from symbiosis.client.virtual import call_executor, make_virtual
from symbiosis.errors import CheckpointError, VirtualWeightAccess
from symbiosis.model.checkpoint import Checkpoint
from symbiosis.model.layout import Layout
from symbiosis.model.partition import (build_skeleton, check_complete, load_config, plan_base_layers, plan_expert_layers,
                                       plan_decoder_tails, plan_gated_mlps)
from symbiosis.torch_dtypes import resolve_dtype

peft_support.install()  # PEFT's entry points check split models' configs and adapter files


def _load_client_tensors(model: PreTrainedModel, layout: Layout, device: torch.device, session) -> None:
    """Fill every non-virtual parameter and persistent buffer that the checkpoint provides; flag it initialised.
    A tensor an in-process executor holds too (a tied embedding) is taken from it, frozen, not copied."""
    persistent = set(model.state_dict(keep_vars=True).keys())
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent)
    wanted = {}
    for key, tensor in named.items():
        name = layout.names.get(key)
        if getattr(tensor, "_is_hf_initialized", False) or name is None:
            continue  # virtual; or tied to a tensor loaded here, or a new head (check_complete said which)
        shared = session.base_tensor(name, tensor) if isinstance(tensor, nn.Parameter) else None
        if shared is not None:
            _share(model, key, name, shared)
        else:
            wanted[key] = name
    values = layout.read({name: named[key].dtype for key, name in wanted.items()}, device)
    for key, name in wanted.items():
        tensor, value = named[key], values[name]
        if value.shape != tensor.shape:
            raise CheckpointError(f"{layout.checkpoint.listing}: {layout.keys(name)} make {name!r} of shape "
                                  f"{list(value.shape)}, the model expects {list(tensor.shape)} for {key!r}")
        with torch.no_grad():
            tensor.copy_(value)
        tensor._is_hf_initialized = True


def _share(model: PreTrainedModel, parameter_name: str, name: str, base: torch.Tensor) -> None:
    """Make parameter `parameter_name` the executor's tensor `name` itself, frozen. Every in-process client of
    the executor then holds it once between them (a 1B Llama's tied embedding is 0.5 GiB a client). Training it in place
    would change the base for everyone: a gradient reaching it raises instead. PEFT's `modules_to_save`
    trains a copy, as always."""

    def refuse(grad):
        raise VirtualWeightAccess(
            f"{parameter_name} is the executor's tensor {name!r} (a tied weight), shared by every in-process client, so it "
            "cannot be trained in place. Give this client its own copy first: `module.weight = "
            "torch.nn.Parameter(module.weight.detach().clone())`, or train it through PEFT (modules_to_save).")

    module_name, _, attribute = parameter_name.rpartition(".")
    parameter = nn.Parameter(base, requires_grad=True)
    parameter.register_hook(refuse)  # stays with the tensor when it is unfrozen later
    parameter.requires_grad_(False)
    parameter._is_hf_initialized = True
    setattr(model.get_submodule(module_name), attribute, parameter)


def _checked_load_adapter(load_adapter):
    """transformers' own adapter loading (`model.load_adapter(dir)`), with the adapter directory checked first:
    safetensors only, no pickle (PEFT's entry points are checked by `peft_support`)."""
    @functools.wraps(load_adapter)
    def checked(peft_model_id=None, *args, **kwargs):
        if peft_model_id is not None:
            check_adapter_directory(peft_support.adapter_directory(peft_model_id, kwargs))
        return load_adapter(peft_model_id, *args, **kwargs)
    return checked


def _refuse_full_save(*args, **kwargs):
    raise VirtualWeightAccess(
        "this split model holds no base weights (the executor does), so it cannot be saved as a full checkpoint; "
        "save the adapter with PeftModel.save_pretrained, or copy the original model directory"
    )


def from_pretrained(path: str | os.PathLike, executor, auto_class=AutoModelForCausalLM, *,
                    dtype: torch.dtype | str | None = None, torch_dtype=None, device: str | torch.device = "cpu",
                    name: str = "client", privacy: NoiseMasking | None = None) -> PreTrainedModel:
    """A transformers model of `path` whose base layers run in `executor`; it holds only the client's tensors.

    `executor`: an in-process `Executor`, or `symbiosis.connect(url)` for one in another process or host.
    `dtype` defaults to the executor's dtype (`torch_dtype` is its deprecated alias); a different dtype is
    cast at the executor boundary. `device` is where the client's own tensors and compute live.
    `privacy=NoiseMasking(...)` masks every activation (and gradient) that leaves the client with noise
    whose effect is removed exactly (docs/PRIVACY.md).
    """
    checkpoint = Checkpoint(path)
    config = load_config(checkpoint)
    device = torch.device(device)
    fingerprint = checkpoint.fingerprint()
    session = executor.attach(fingerprint, name, device)
    dtype = resolve_dtype(dtype, torch_dtype, config) if (dtype or torch_dtype) else session.dtype
    model = build_skeleton(config, auto_class, dtype)
    layout = Layout(model, checkpoint)
    check_complete(model, layout)
    plan = plan_base_layers(model, layout)
    experts = plan_expert_layers(model, layout)
    expert_specs = [s for projections in experts.values() for specs in projections.values() for s in specs]
    for spec in list(plan.values()) + expert_specs:
        served = session.layer_specs.get(spec.layer_id)
        if served != spec:
            raise CheckpointError(f"the executor does not serve base layer {spec.layer_id!r} as this model needs it "
                                  f"(executor: {served}, client: {spec})")
    if privacy is not None:
        session = MaskedSession(session, privacy, sorted({s.layer_id for s in list(plan.values()) + expert_specs}), device, dtype)
    grouper = CallGrouper(session, functools.partial(call_executor, session))
    for module_name, spec in plan.items():
        virtual = make_virtual(spec, session, grouper, device, dtype)
        virtual._is_hf_initialized = True
        virtual.weight._is_hf_initialized = True  # its bias is loaded with the client's tensors
        model.set_submodule(module_name, virtual)
    for module_name, projections in experts.items():
        make_virtual_experts(model.get_submodule(module_name), projections, session, device, dtype)
    mlps = plan_gated_mlps(model, plan)
    for module_name, spec in mlps.items():  # the MLPs the executor also runs whole
        if session.block_specs.get(module_name) == spec:
            serve_whole(model.get_submodule(module_name), module_name, session)
    tails = {name: spec for name, spec in plan_decoder_tails(model, plan, mlps).items()
             if session.block_specs.get(name) == spec}  # served once the norms hold their weights

    model.to_empty(device=device)
    _load_client_tensors(model, layout, device, session)
    model.initialize_weights()
    model.tie_weights()
    for module_name in tails:  # (their norms' weights as loaded: a later write declines the tail)
        serve_tail(model.get_submodule(module_name), module_name, session)
    if (checkpoint.path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(checkpoint.path)
    model.save_pretrained = _refuse_full_save
    model.load_adapter = _checked_load_adapter(model.load_adapter)
    # A pipelined client's calls are answered (or raise) before its output is used (a no-op elsewhere).
    model.register_forward_hook(lambda *_: session.synchronize())
    model.symbiosis_session = session
    model.symbiosis_fingerprint = fingerprint
    model.symbiosis_checkpoint = checkpoint  # its bytes_read shows what this client read
    return model.eval()
