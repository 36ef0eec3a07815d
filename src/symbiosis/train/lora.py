"""One hosted LoRA adapter in training: its matrices, its AdamW state, and their files.

Parametrised by default as Tinker's published recipe ("LoRA Without Regret"): alpha fixed at 32, so each layer adds
    y += (32 / r) * (x A^T) B^T        A [r, in] (Kaiming-uniform, as PEFT), B [out, r] (zeros, as PEFT)
and the best learning rate hardly moves with the rank. A fine-tuning job may ask for PEFT's own: another alpha,
rsLoRA's alpha / sqrt(r), target modules by name. Matrices and AdamW moments are float32 at least, whatever the
base's dtype (PEFT keeps adapters in float32 too; a float64 base trains float64 ones); the LoRA runs in their
dtype and its output is added in the activations'.

Files: a checkpoint is an ordinary PEFT adapter directory (adapter_config.json, adapter_model.safetensors,
symbiosis.json with the base's fingerprint), servable by the engine and loadable by plain PEFT, plus
optimizer.safetensors (AdamW's exp_avg / exp_avg_sq per tensor) and trainer_state.json (steps taken, the spec).
No pickle is written or read.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.optim.adamw import adamw
from safetensors.torch import load_file, save_file

from symbiosis.client.adapter_files import check_adapter_directory
from symbiosis.client.generate import FINGERPRINT_FILE, check_base_fingerprint
from symbiosis.errors import AdapterError
from symbiosis.train.transfer import to_host

ALPHA = 32.0
PREFIX = "base_model.model."
MAX_RANK = 256


@dataclass(frozen=True)
class LoraSpec:
    """What a training client asks for (Tinker's LoraConfig): the rank, which parts of the model train, the seed
    of the initial A matrices; or, for a fine-tuning job, PEFT's `alpha`, `rslora` and `modules` (target module
    names as PEFT matches them: a module whose name is one of them or ends with `.` + one of them; `all-linear`:
    every base layer but the output head), which take the place of the parts."""
    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    alpha: float = ALPHA
    rslora: bool = False
    modules: tuple[str, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank must be an integer in 1..{MAX_RANK}, got {self.rank!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("at least one of train_attn, train_mlp, train_unembed must be true")
        if not 0 < float(self.alpha) <= 1e6:
            raise ValueError(f"alpha must be positive, got {self.alpha!r}")
        if self.modules is not None:
            object.__setattr__(self, "modules", tuple(str(m) for m in self.modules))
            if not self.modules or any(not m for m in self.modules):
                raise ValueError("target modules must be non-empty names")

    def trains(self, target: "TargetLayer") -> bool:
        if self.modules is None:
            return {"attn": self.train_attn, "mlp": self.train_mlp, "unembed": self.train_unembed}[target.part]
        if "all-linear" in self.modules and target.part != "unembed":
            return True
        return any(target.module == m or target.module.endswith("." + m) for m in self.modules)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class TargetLayer:
    """A base layer an adapter may train: its module name (PEFT's key), its executor id, its part, its shape."""
    module: str
    layer_id: str
    part: str  # "attn", "mlp" or "unembed"
    in_features: int
    out_features: int
    experts: int = 0  # a MoE layer's fused experts (one projection of each): LoRA on them is not hosted yet


class HostedLora:
    """`layers`: layer id -> (A, B), float32 leaf tensors that train. Every matrix is a view of one flat buffer
    (`flat`), its gradient a view of another (`flat_grad`: autograd adds into it in place), and AdamW's moments are
    flat too: an optimizer step is a few launches over one tensor an adapter, not a few per matrix (4,096 matrices
    at 32 tenants of q/k/v/o on 16 layers). `pending`: gradients were gathered since the last step."""

    def __init__(self, spec: LoraSpec, targets: list[TargetLayer], device: torch.device,
                 dtype: torch.dtype = torch.float32, tensors: dict[str, torch.Tensor] | None = None):
        """Fresh matrices (seeded by `spec.seed`) for the targets of the parts `spec` trains, or `tensors`
        (PEFT's names) read from a checkpoint; in `dtype` promoted to at least float32."""
        self.spec = spec
        dtype = torch.promote_types(dtype, torch.float32)
        self.targets = [t for t in targets if spec.trains(t)]
        if not self.targets:
            raise ValueError("this base model has no layer of the parts or modules asked to train")
        experts = next((t for t in self.targets if t.experts), None)
        if experts is not None:
            raise ValueError(f"{experts.module}: this base model's MLP is a mixture of {experts.experts} experts, "
                             "whose LoRA hosted training does not run yet; train the attention (train_mlp=False, "
                             "or target modules of the attention)")
        self.scale = spec.scale
        shapes = [((spec.rank, t.in_features), (t.out_features, spec.rank)) for t in self.targets]
        size = sum(math.prod(shape) for pair in shapes for shape in pair)
        self.flat = torch.empty(size, dtype=dtype, device=device)
        self.flat_grad = torch.zeros_like(self.flat)
        self.exp_avg: torch.Tensor | None = None  # AdamW's moments, flat, made at the first step (as torch makes them)
        self.exp_avg_sq: torch.Tensor | None = None
        self.pending = False
        generator = torch.Generator().manual_seed(spec.seed if spec.seed is not None else 0)
        self.layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._slices: dict[str, tuple[slice, slice]] = {}  # layer id -> (A's, B's) elements of the flat buffers
        offset = 0
        with torch.no_grad():
            for target, (a_shape, b_shape) in zip(self.targets, shapes):
                if tensors is None:
                    a = torch.empty(a_shape, dtype=dtype)
                    # PEFT's (and nn.Linear's) init of A: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
                    bound = 1 / math.sqrt(target.in_features)
                    a.uniform_(-bound, bound, generator=generator)
                    b = torch.zeros(b_shape, dtype=dtype)
                else:
                    a, b = (tensors[f"{PREFIX}{target.module}.lora_{name}.weight"] for name in "AB")
                    for name, saved, shape in (("A", a, a_shape), ("B", b, b_shape)):
                        if tuple(saved.shape) != shape:
                            raise ValueError(f"{target.module}.lora_{name} has shape {list(saved.shape)}, not "
                                             f"{list(shape)}")
                pair, where = [], []
                for value in (a, b):
                    elements = slice(offset, offset + value.numel())
                    offset = elements.stop
                    view = self.flat[elements].view(value.shape)
                    view.copy_(value)
                    view.requires_grad_()
                    view.grad = self.flat_grad[elements].view(value.shape)
                    pair.append(view)
                    where.append(elements)
                self.layers[target.layer_id] = (pair[0], pair[1])
                self._slices[target.layer_id] = (where[0], where[1])
        # adapters of one layout have every matrix at the same place of their flat buffers (train/model.py gathers
        # a pass's adapters' buffers at once, each layer's stacks then views of them)
        self.layout = (spec.rank, tuple(self._slices), self.flat.shape, self.flat.dtype, self.flat.device)
        self.steps = 0

    def take_state(self, other: "HostedLora") -> None:
        """Become `other` (read from a checkpoint) in place: its matrices, AdamW moments (none if it has none),
        steps, spec and scale; gradients dropped. Work queued for this object before (which holds it) then trains
        the new state. ValueError where `other`'s layout (rank, layers, dtype, device) is not this one's."""
        if other.layout != self.layout:
            raise ValueError(f"the checkpoint's LoRA (rank {other.spec.rank}, {len(other.targets)} layers) is not "
                             f"this model's (rank {self.spec.rank}, {len(self.targets)} layers)")
        with torch.no_grad():
            self.flat.copy_(other.flat)
            if other.exp_avg is None:
                self.exp_avg = self.exp_avg_sq = None
            else:
                exp_avg, exp_avg_sq = self.moments()
                exp_avg.copy_(other.exp_avg)
                exp_avg_sq.copy_(other.exp_avg_sq)
        self.spec, self.scale, self.steps = other.spec, other.scale, other.steps
        self.drop_gradients()

    def drop_gradients(self) -> None:
        """Forget the gradients gathered since the last step (a failed pass must not leave half of one)."""
        self.flat_grad.zero_()
        self.pending = False

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.exp_avg is None:
            self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
        return self.exp_avg, self.exp_avg_sq

    def _named_slices(self) -> dict[str, slice]:
        """PEFT's names for the matrices' elements of the flat buffers."""
        return self._by_name(self._slices)

    def parameters(self) -> list[torch.Tensor]:
        return [p for pair in self.layers.values() for p in pair]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """PEFT's names for the matrices."""
        return self._by_name(self.layers)

    def _by_name(self, pairs: dict) -> dict:
        """layer id -> (A's, B's) as PEFT's names -> each."""
        names = {}
        for target in self.targets:
            a, b = pairs[target.layer_id]
            names[f"{PREFIX}{target.module}.lora_A.weight"] = a
            names[f"{PREFIX}{target.module}.lora_B.weight"] = b
        return names

    def spec_json(self) -> dict:
        spec = asdict(self.spec)
        spec["modules"] = None if self.spec.modules is None else list(self.spec.modules)
        return spec

    def has_gradients(self) -> bool:
        return self.pending

    def step(self, learning_rate: float, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-12,
             weight_decay: float = 0.0, grad_clip_norm: float = 0.0) -> dict[str, float]:
        """One AdamW step on the gradients gathered since the last one (clipped to `grad_clip_norm` in total L2
        norm when it is positive), then the gradients are cleared. Returns metrics."""
        return step_together([(self, AdamParams(learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm))])[0]

    # -- files --

    def save(self, directory: Path, base_model: str, fingerprint: str, with_optimizer: bool = True) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file({name: t.detach().contiguous().cpu() for name, t in self.named_tensors().items()},
                  directory / "adapter_model.safetensors")
        modules = sorted(t.module for t in self.targets)  # full names: GPT-2's c_proj is in attention and MLP
        (directory / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.spec.rank, "lora_alpha": self.spec.alpha,
            "lora_dropout": 0.0, "bias": "none", "use_rslora": self.spec.rslora, "target_modules": modules,
            "base_model_name_or_path": base_model}, indent=1))
        (directory / FINGERPRINT_FILE).write_text(json.dumps({"base_fingerprint": fingerprint}))
        (directory / "trainer_state.json").write_text(json.dumps({"steps": self.steps, "spec": self.spec_json()}))
        if with_optimizer:
            moments = {}
            if self.exp_avg is not None:
                shapes = {name: t.shape for name, t in self.named_tensors().items()}
                for name, elements in self._named_slices().items():
                    for moment, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                        moments[f"{name}.{moment}"] = flat[elements].view(shapes[name]).contiguous().cpu()
            save_file(moments, directory / "optimizer.safetensors")

    @classmethod
    def load(cls, directory: Path, targets: list[TargetLayer], device: torch.device, dtype: torch.dtype,
             fingerprint: str, with_optimizer: bool) -> "HostedLora":
        """A training adapter from a directory `save` wrote (`AdapterError` naming what is wrong otherwise)."""
        directory, state = saved_state(directory, fingerprint, with_optimizer)
        try:
            spec = LoraSpec(**state["spec"])
            tensors = load_file(directory / "adapter_model.safetensors")
            lora = cls(spec, targets, device, dtype, tensors)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise AdapterError(f"{directory.name}: not a training checkpoint of this service ({e})") from e
        for name, tensor in lora.named_tensors().items():
            saved = tensors[name]
            if saved.shape != tensor.shape or not torch.isfinite(saved).all():
                raise AdapterError(f"{directory.name}: {name} has shape {list(saved.shape)} or values that do not fit")
        lora.steps = int(state.get("steps", 0))
        if with_optimizer:
            moments = load_file(directory / "optimizer.safetensors")
            if moments:  # saved after at least one step: every matrix's two moments
                exp_avg, exp_avg_sq = lora.moments()
                slices = lora._named_slices()
                for name, parameter in lora.named_tensors().items():
                    elements = slices[name]
                    for moment, flat in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                        saved = moments.get(f"{name}.{moment}")
                        if saved is None or saved.shape != parameter.shape or not torch.isfinite(saved).all():
                            raise AdapterError(f"{directory.name}: the optimizer state of {name} is missing or does "
                                               "not fit")
                        flat[elements] = saved.reshape(-1).to(device, parameter.dtype)
        return lora


def saved_state(directory: Path, fingerprint: str, with_optimizer: bool) -> tuple[Path, dict]:
    """A training checkpoint's directory, checked (its files, this base's fingerprint, its optimizer state where
    asked for), and its trainer_state.json: `AdapterError` naming what is wrong otherwise."""
    directory = check_adapter_directory(directory)
    check_base_fingerprint(directory, fingerprint)
    if with_optimizer and not (directory / "optimizer.safetensors").is_file():
        raise AdapterError(f"{directory.name}: saved without optimizer state")
    try:
        state = json.loads((directory / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{directory.name}: not a training checkpoint of this service ({e})") from e
    if not isinstance(state, dict):
        raise AdapterError(f"{directory.name}: not a training checkpoint of this service (its trainer_state.json "
                           "is not an object)")
    return directory, state


@dataclass(frozen=True)
class AdamParams:
    """One AdamW step's hyperparameters (the Tinker API's names and defaults)."""
    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self):
        # torch.optim checks these when an optimizer is made, not when a step changes them: a beta of 1 or more, or
        # a NaN, would leave the adapter's weights silently NaN or diverging
        for name, value in asdict(self).items():
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("beta1", "beta2"):
            if getattr(self, name) >= 1:
                raise ValueError(f"{name} must be below 1, got {getattr(self, name)!r}")

    @classmethod
    def from_fields(cls, fields: dict) -> "AdamParams":
        """From a request's `adam_params` (ValueError or TypeError naming a bad field)."""
        return cls(*(float(fields.get(name, default)) for name, default in (
            ("learning_rate", 1e-4), ("beta1", 0.9), ("beta2", 0.95), ("eps", 1e-12), ("weight_decay", 0.0),
            ("grad_clip_norm", 0.0))))


def step_together(steps: list[tuple[HostedLora, AdamParams]]) -> list[dict[str, float]]:
    """One AdamW step of each adapter (each at most once), as its own `torch.optim.AdamW` after `clip_grad_norm_`
    takes it, in a few multi-tensor launches for all of them: every adapter's gradient norm in one call (over its
    flat gradient: the same norm as clip_grad_norm_'s norm of the matrices' norms, up to rounding), the moments and
    weights of all adapters with equal hyperparameters in one AdamW call over their flat buffers. The training queue
    runs every tenant's step of a round here. An adapter with no gradients since its last step does not move (as
    torch skips parameters without gradients). Returns each adapter's metrics."""
    return launch_steps(steps)()


def launch_steps(steps: list[tuple[HostedLora, AdamParams]]) -> Callable[[], list[dict[str, float]]]:
    """`step_together`'s steps queued on the device, not waited for: the adapters' states are the stepped ones for
    whatever is queued after; the returned call reads the metrics (gradient norms), waiting for the steps alone (their
    norms are copied to the host as soon as they are made, so work queued after the steps is not waited for)."""
    moving = [(lora, adam) for lora, adam in steps if lora.pending]
    norms = torch._foreach_norm([lora.flat_grad for lora, _ in moving]) if moving else []
    groups: dict[tuple, tuple[list, list, list, list, list]] = {}
    with torch.no_grad():
        for (lora, adam), norm in zip(moving, norms):
            if adam.grad_clip_norm > 0:  # as clip_grad_norm_
                lora.flat_grad.mul_(torch.clamp(adam.grad_clip_norm / (norm + 1e-6), max=1.0))
            group = groups.setdefault((adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay),
                                      ([], [], [], [], []))
            count = torch.tensor(float(lora.steps), dtype=_scalar_dtype())  # as torch.optim keeps it; adamw adds 1
            for into, value in zip(group, (lora.flat, lora.flat_grad, *lora.moments(), count)):
                into.append(value)
        for (lr, beta1, beta2, eps, weight_decay), (params, grads, exp_avgs, exp_avg_sqs, counts) in groups.items():
            adamw(params, grads, exp_avgs, exp_avg_sqs, [], counts, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                  weight_decay=weight_decay, eps=eps, maximize=False)
        if moving:
            torch._foreach_zero_([lora.flat_grad for lora, _ in moving])
    for lora, _ in moving:
        lora.pending = False
        lora.steps += 1
    # the norms into pinned memory behind them, an event after: a read that waits for them alone
    (copied,), event = to_host([torch.stack(norms)]) if moving else ((None,), None)

    def metrics() -> list[dict[str, float]]:
        if event is not None:
            event.synchronize()
        read = dict(zip((id(lora) for lora, _ in moving), copied.tolist() if moving else []))
        return [{"grad_norm:mean": read.get(id(lora), 0.0), "learning_rate:mean": adam.learning_rate}
                for lora, adam in steps]

    return metrics


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim keeps a step count in (off its fused path)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
