"""The two trainings of HMI's lifecycle (§5), each resumable from its last checkpoint:

- `further_pretrain`: a domain's knowledge goes into the lower layers. The whole model runs (MLM for encoders,
  causal LM for decoders) on the domain corpus, cut into windows of `window` tokens; only layers 0..k-1 train, the
  embeddings and the upper layers stay the root's. Result: those layers' weights (`lower.safetensors`, named as in
  the base model, what `LowerLayers(state_dict=...)` takes), from which the domain's table is built.
- `train_adapter`: a tenant's task goes into a PEFT adapter on the upper layers, trained on the PLOT
  representations of the domain version (exactly what inference will feed them). Decoders: causal LM on the
  tenant's texts; encoders: sequence classification on (text, label) pairs (the classifier head trains too, as
  `modules_to_save`). Result: an ordinary PEFT adapter directory of the upper model.

A checkpoint (`STATE/`: the trained tensors, AdamW's moments, state.json with the step and a digest of what decides
the training) is written every `checkpoint_every` steps; started again with the same data and settings, a training
goes on from its last checkpoint (with other ones, it starts over). Step t's batch and masks come
from a generator seeded with (seed, t), so a resumed run takes the same steps an uninterrupted one does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

from symbiosis.errors import SymbiosisError
from symbiosis.plot.build import Stopped
from symbiosis.plot.lookup import Plot
from symbiosis.plot.split import UpperModel, layer_list, check_cut, model_kind
from symbiosis.train.moments import load_moments, save_moments

MASK_FRACTION = 0.15  # BERT's: of the chosen tokens 80% become [MASK], 10% a random token, 10% stay


@dataclass(frozen=True)
class Schedule:
    steps: int = 100
    learning_rate: float = 1e-4
    batch_size: int = 8
    window: int = 128  # tokens per further pre-training example
    seed: int = 0
    checkpoint_every: int = 20

    def __post_init__(self):
        if min(self.steps, self.batch_size, self.window, self.checkpoint_every) < 1 or not self.learning_rate > 0:
            raise ValueError("steps, batch_size, window and checkpoint_every must be positive, learning_rate > 0")


def _plan(*parts) -> str:
    """A digest of what decides a training (its schedule, data, configuration): a checkpoint resumes only the
    training it was written by."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.numpy().tobytes() if isinstance(part, torch.Tensor) else
                      json.dumps(part, sort_keys=True, default=_plain).encode())
        digest.update(b"|")
    return digest.hexdigest()


def _plain(value):
    """JSON for what json does not take: sets sorted (their order changes from process to process), else str."""
    return sorted(value, key=str) if isinstance(value, (set, frozenset)) else str(value)


def _loop(step_fn, parameters: dict[str, torch.Tensor], schedule: Schedule, state_dir: Path, plan: str,
          progress: Callable[[int, int, float], None] | None, stop: Callable[[], bool] | None) -> None:
    """Run `step_fn(generator) -> loss` (with backward done) from the last checkpoint in `state_dir` to the end; a
    checkpoint of another `plan` (other data or settings) is set aside, not resumed."""
    optimizer = torch.optim.AdamW(list(parameters.values()), lr=schedule.learning_rate)
    first = 0
    state_file = state_dir / "state.json"
    if state_file.is_file() and json.loads(state_file.read_text()).get("plan") != plan:
        shutil.rmtree(state_dir)
    if state_file.is_file():
        tensors = load_file(state_dir / "trained.safetensors")
        with torch.no_grad():
            for name, parameter in parameters.items():
                parameter.copy_(tensors[name])
        load_moments(optimizer, parameters, state_dir)
        first = json.loads((state_dir / "state.json").read_text())["step"]
    for step in range(first, schedule.steps):
        if stop is not None and stop():
            if step > first:  # the steps since the last checkpoint are kept: a training stopped for another's
                _checkpoint(optimizer, parameters, state_dir, step, plan)  # turn goes on from here
            raise Stopped(f"stopped at step {step} of {schedule.steps}; it resumes from there")
        generator = torch.Generator().manual_seed(schedule.seed * 1_000_003 + step)
        loss = step_fn(generator)
        if not torch.isfinite(loss):
            raise SymbiosisError(f"the loss is {float(loss)} at step {step + 1}: training diverged (a lower "
                                 "learning rate?)")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % schedule.checkpoint_every == 0 or step + 1 == schedule.steps:
            _checkpoint(optimizer, parameters, state_dir, step + 1, plan)
            first = step + 1
        if progress is not None:
            progress(step + 1, schedule.steps, float(loss))


def _checkpoint(optimizer, parameters: dict[str, torch.Tensor], state_dir: Path, step: int, plan: str) -> None:
    staging = state_dir.with_name(state_dir.name + ".writing")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file({name: p.detach().contiguous().cpu() for name, p in parameters.items()}, staging / "trained.safetensors")
    save_moments(optimizer, parameters, staging)
    (staging / "state.json").write_text(json.dumps({"step": step, "plan": plan}))
    shutil.rmtree(state_dir, ignore_errors=True)
    os.replace(staging, state_dir)


def windows(sequences, window: int) -> torch.Tensor:
    """The corpus joined and cut into [N, window] (the last part dropped; a corpus shorter than one window is
    one shorter window)."""
    tokens = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences])
    if tokens.size < window:
        return torch.from_numpy(tokens)[None]
    usable = tokens.size // window * window
    return torch.from_numpy(tokens[:usable]).view(-1, window)


def _mask(ids: torch.Tensor, mask_token_id: int, vocab: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = torch.rand(ids.shape, generator=generator) < MASK_FRACTION
    chosen[..., 0] |= ~chosen.any(-1)  # at least one per row
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=generator)
    inputs = torch.where(chosen & (roll < 0.8), torch.full_like(ids, mask_token_id), ids)
    random_tokens = torch.randint(vocab, ids.shape, generator=generator)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_tokens, inputs)
    return inputs, labels


def further_pretrain(model_dir, lower_layers: int, corpus, directory, schedule: Schedule, *,
                     start: dict[str, torch.Tensor] | None = None, mask_token_id: int | None = None, device="cpu",
                     dtype=None, progress=None, stop=None) -> dict[str, torch.Tensor]:
    """Train layers 0..k-1 of `model_dir` (from `start`, a previous version's, else the checkpoint's) on `corpus`
    (lists of token ids). Checkpoints in `directory`/state; returns the lower layers' weights (base-model names)."""
    config = AutoConfig.from_pretrained(model_dir)
    check_cut(config, lower_layers)
    encoder = model_kind(config) == "encoder"
    if encoder and mask_token_id is None:
        raise ValueError("an encoder's further pre-training (MLM) needs the tokenizer's mask token id")
    model = (AutoModelForMaskedLM if encoder else AutoModelForCausalLM).from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).train()
    base = model.base_model
    if start is not None:
        _, unexpected = base.load_state_dict(start, strict=False)
        if unexpected:
            raise ValueError(f"the starting weights hold tensors this model lacks: {unexpected[:3]}")
    parent, attribute = layer_list(base, config.num_hidden_layers)
    lower_ids = {id(p) for layer in list(getattr(parent, attribute))[:lower_layers] for p in layer.parameters()}
    trained = {name: p for name, p in base.named_parameters() if id(p) in lower_ids}
    for parameter in model.parameters():
        parameter.requires_grad_(id(parameter) in lower_ids)
    examples = windows(corpus, schedule.window)

    def step(generator) -> torch.Tensor:
        rows = torch.randint(examples.shape[0], (min(schedule.batch_size, examples.shape[0]),), generator=generator)
        ids = examples[rows]
        inputs, labels = _mask(ids, mask_token_id, config.vocab_size, generator) if encoder else (ids, ids)
        loss = model(input_ids=inputs.to(device), labels=labels.to(device)).loss
        loss.backward()
        return loss.detach()

    plan = _plan("further_pretrain", str(model_dir), lower_layers, vars(schedule), mask_token_id, examples,
                 sorted((name, _plan(t)) for name, t in (start or {}).items()))
    _loop(step, trained, schedule, Path(directory) / "state", plan, progress, stop)
    return {name: p.detach().cpu().clone() for name, p in trained.items()}


def train_adapter(upper: UpperModel, plot: Plot, examples: list[tuple[list[int], int | None]], directory,
                  schedule: Schedule, peft_config, *, start=None, progress=None, stop=None) -> Path:
    """A PEFT adapter (`peft_config`; or the adapter in directory `start`, trained further) on `upper` (a fresh
    one: PEFT changes it), trained on `plot`'s representations of `examples` ((tokens, label) pairs; label None
    for a decoder's causal LM). Checkpoints in `directory`/state; the adapter is saved to `directory`/adapter,
    which is returned."""
    import peft

    if start is not None:
        model = peft.PeftModel.from_pretrained(upper.model, start, is_trainable=True)
    else:
        model = peft.get_peft_model(upper.model, peft_config)
    device = upper.device
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    encoder = plot.kind == "encoder"
    if encoder and any(label is None for _, label in examples):
        raise ValueError("an encoder's examples need labels")
    model.train()

    def step(generator) -> torch.Tensor:
        rows = torch.randint(len(examples), (min(schedule.batch_size, len(examples)),), generator=generator).tolist()
        # looked up a batch at a time: a whole training file's representations would hold its tokens x hidden
        batch = [torch.from_numpy(h) for h in plot.represent([examples[i][0] for i in rows])]
        longest = max(h.shape[0] for h in batch)
        inputs = torch.zeros(len(batch), longest, batch[0].shape[1], dtype=model.dtype)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, h in enumerate(batch):
            inputs[row, :h.shape[0]], mask[row, :h.shape[0]] = h, 1
        if encoder:
            labels = torch.tensor([examples[i][1] for i in rows])
        else:
            labels = torch.full((len(batch), longest), -100)
            for row, i in enumerate(rows):
                labels[row, :len(examples[i][0])] = torch.tensor(examples[i][0])
        loss = model(inputs_embeds=inputs.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        loss.backward()
        return loss.detach()

    plan = _plan("train_adapter", vars(schedule), peft_config.to_dict(), str(start), examples, plot.root.meta["id"],
                 None if plot.domain is None else plot.domain.meta["id"])
    _loop(step, trained, schedule, Path(directory) / "state", plan, progress, stop)
    model.save_pretrained(Path(directory) / "adapter")
    return Path(directory) / "adapter"
