"""A fine-tuning job: epochs over a dataset in batches, an optimizer step each, checkpoints, resumable.

The job's loop is the same for every PEFT method; what trains is a `Backend`:
- `HostedBackend`: a LoRA adapter (plain or rsLoRA) trained on the service's training queue, one pass with every
  other job's and every Tinker client's work (train/scheduler.py);
- `SplitBackend`: any PEFT method symbiosis runs exactly (client/peft_support.py) on a split client of the shared
  executor: PEFT's own model, the base layers' GEMMs in the executor.

A step: `batch_size` examples (the epoch's order is a permutation drawn from (seed, epoch): `data.epoch_order`),
the loss the mean over their trained tokens, one AdamW step at learning_rate_multiplier x the method's base rate.
A checkpoint (the adapter, the optimizer's state, the job's position in the data) is written every
`checkpoint_every` steps and at the end of every epoch; a job resumed from one goes on as it would have: the same
batches, the same steps, the same adapter at the end as a run never stopped.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from symbiosis.errors import BadCall
from symbiosis.train.data import Example, epoch_order
from symbiosis.train.lora import AdamParams, HostedLora, LoraSpec
from symbiosis.train.moments import load_moments, save_moments
from symbiosis.train.scheduler import Operation, TrainingQueue
from symbiosis.train.trainer import Datum, Trainer, Work

ADAMW = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
BASE_LEARNING_RATE = {"lora": 2e-4, "prompt": 3e-2}  # x learning_rate_multiplier (prompt: prefix / prompt tuning)
EVAL_EXAMPLES = 64  # validation loss over at most this many examples


class JobFailed(Exception):
    """The job cannot go on (a NaN loss, data found bad late, out of memory): `code` as OpenAI's errors say it."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Hyperparameters:
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float


@dataclass
class Position:
    """Where a job is: optimizer steps taken, the epoch, the examples of that epoch already trained on."""
    step: int = 0
    epoch: int = 0
    seen: int = 0


def _datums(examples: list[Example]) -> list[Datum]:
    """A batch as cross_entropy datums whose weights make the summed loss the mean over the trained tokens."""
    total = sum(sum(e.weights[1:]) for e in examples)
    if total == 0:
        raise JobFailed("invalid_training_file", "a batch has no token to train on")
    return [Datum(e.tokens[:-1], {"target_tokens": torch.tensor(e.tokens[1:]),
                                  "weights": torch.tensor(e.weights[1:], dtype=torch.float64) / total})
            for e in examples]


class HostedBackend:
    """A LoRA adapter trained on the training queue (`key`: its place there)."""

    def __init__(self, trainer: Trainer, queue: TrainingQueue, key: str, spec: LoraSpec):
        self.trainer, self.queue, self.key, self.spec = trainer, queue, key, spec
        self.lora = HostedLora(spec, trainer.targets, trainer.device, trainer.dtype)
        self._seq = 0
        queue.open(key, 0)

    def _run(self, work: Work | None = None, call=None, step=None):
        done, outcome = threading.Event(), {}
        self.queue.submit(self.key, Operation(self._seq, lambda r: (outcome.update(result=r), done.set()),
                                              lambda e: (outcome.update(error=e), done.set()), work=work, call=call,
                                              step=step))
        self._seq += 1
        done.wait()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def train_step(self, batch: list[Example], learning_rate: float) -> float:
        work = Work(self.lora, _datums(batch), "cross_entropy")
        self.trainer.check(work)
        loss = self._run(work=work).loss
        self._run(call=lambda metrics: metrics, step=(self.lora, AdamParams(learning_rate, **ADAMW)))
        return loss

    def eval_loss(self, examples: list[Example]) -> float:
        work = Work(self.lora, _datums(examples), "cross_entropy", backward=False)
        self.trainer.check(work)
        return self._run(work=work).loss

    def save(self, directory: Path, base_model: str, with_optimizer: bool = True) -> None:
        self._run(call=lambda: self.lora.save(directory, base_model, self.trainer.fingerprint, with_optimizer))

    def load(self, directory: Path) -> None:
        self.lora = HostedLora.load(directory, self.trainer.targets, self.trainer.device, self.trainer.dtype,
                                    self.trainer.fingerprint, with_optimizer=True)

    def close(self) -> None:
        self.queue.close(self.key)


_peft_init = threading.Lock()  # PEFT initialises from torch's global generator: one seeded init at a time


class SplitBackend:
    """Any PEFT method symbiosis runs exactly, on a split client of an in-process executor."""

    def __init__(self, model_path, executor, config, seed: int):
        import peft

        import symbiosis

        self.model_path, self.config = model_path, config
        model = symbiosis.from_pretrained(model_path, executor, device=executor.device, name="job")
        with _peft_init, torch.random.fork_rng(devices=[] if executor.device.type == "cpu" else [executor.device]):
            torch.manual_seed(seed)
            self.model = peft.get_peft_model(model, config)
        self.parameters = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(list(self.parameters.values()), lr=0.0, betas=(ADAMW["beta1"], ADAMW["beta2"]),
                                           eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
        self.device = executor.device

    def _loss(self, batch: list[Example]) -> torch.Tensor:
        length = max(len(e.tokens) for e in batch)
        ids = torch.zeros(len(batch), length, dtype=torch.long)
        mask = torch.zeros(len(batch), length, dtype=torch.long)
        labels = torch.full((len(batch), length), -100, dtype=torch.long)
        for row, example in enumerate(batch):
            n = len(example.tokens)
            ids[row, :n], mask[row, :n] = torch.tensor(example.tokens), 1
            labels[row, :n] = torch.tensor([t if w else -100 for t, w in zip(example.tokens, example.weights)])
        # transformers' loss: the mean over the tokens trained on (labels shifted by one inside)
        return self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                          labels=labels.to(self.device)).loss

    def train_step(self, batch: list[Example], learning_rate: float) -> float:
        self.model.train()
        loss = self._loss(batch)
        loss.backward()
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    @torch.no_grad()
    def eval_loss(self, examples: list[Example]) -> float:
        self.model.eval()
        return float(self._loss(examples))

    def save(self, directory: Path, base_model: str, with_optimizer: bool = True) -> None:
        from symbiosis.client.generate import save_adapter

        save_adapter(self.model, directory)
        if with_optimizer:
            save_moments(self.optimizer, self.parameters, directory)

    def load(self, directory: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file as read

        set_peft_model_state_dict(self.model, read(directory / "adapter_model.safetensors"))
        load_moments(self.optimizer, self.parameters, directory)

    def close(self) -> None:
        session = getattr(self.model.get_base_model(), "symbiosis_session", None)
        if session is not None:
            session.close()


class JobRunner:
    """The loop of one job over its backend. `report(kind, **fields)` receives "metrics" (step, train_loss,
    valid_loss) and "checkpoint" (step, directory, metrics); `stop()` says "pause" or "cancel" to end the loop at
    the next step (a pause writes a checkpoint first)."""

    def __init__(self, backend, train: list[Example], validation: list[Example] | None, hyper: Hyperparameters,
                 seed: int, base_learning_rate: float, checkpoint_every: int, directory: Path, base_model: str,
                 report: Callable[..., None], stop: Callable[[], str | None]):
        if hyper.batch_size < 1 or hyper.n_epochs < 1 or checkpoint_every < 1:
            raise BadCall("batch_size, n_epochs and checkpoint_every must be positive")
        self.backend, self.train, self.validation, self.hyper = backend, train, validation, hyper
        self.seed, self.learning_rate = seed, base_learning_rate * hyper.learning_rate_multiplier
        self.checkpoint_every, self.directory, self.base_model = checkpoint_every, directory, base_model
        self.report, self.stop = report, stop

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train) / self.hyper.batch_size)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.hyper.n_epochs

    def resume(self) -> Position:
        """The position of the newest checkpoint, its state loaded into the backend (a fresh start without one)."""
        latest = self.latest_checkpoint()
        if latest is None:
            return Position()
        self.backend.load(latest)
        return Position(**json.loads((latest / "job_position.json").read_text()))

    def latest_checkpoint(self) -> Path | None:
        found = [p for p in (self.directory / "checkpoints").glob("step-*") if (p / "job_position.json").is_file()]
        return max(found, key=lambda p: int(p.name.split("-")[1]), default=None)

    def run(self, position: Position) -> str:
        """Train from `position` on; returns "succeeded", "paused" or "cancelled" (JobFailed for a failure)."""
        train_loss = None
        while position.epoch < self.hyper.n_epochs:
            order = epoch_order(len(self.train), self.seed, position.epoch)
            while position.seen < len(order):
                asked = self.stop()
                if asked is not None:
                    if asked == "pause":
                        self._checkpoint(position, train_loss)
                    return "paused" if asked == "pause" else "cancelled"
                batch = [self.train[i] for i in order[position.seen:position.seen + self.hyper.batch_size]]
                train_loss = self.backend.train_step(batch, self.learning_rate)
                if not math.isfinite(train_loss):
                    raise JobFailed("training_diverged", f"the training loss became {train_loss} at step "
                                                         f"{position.step + 1}; lower learning_rate_multiplier")
                position.seen += len(batch)
                position.step += 1
                self.report("metrics", step=position.step, train_loss=train_loss, total_steps=self.total_steps,
                            epoch=position.epoch + 1)
                if position.seen < len(order) and position.step % self.checkpoint_every == 0:
                    self._checkpoint(position, train_loss)
            position.epoch += 1
            position.seen = 0
            self._checkpoint(position, train_loss)
        return "succeeded"

    def _checkpoint(self, position: Position, train_loss: float | None) -> None:
        directory = self.directory / "checkpoints" / f"step-{position.step}"
        if (directory / "job_position.json").is_file():
            return
        temporary = directory.with_name(f".{directory.name}.partial")
        shutil.rmtree(temporary, ignore_errors=True)  # a write the process did not finish
        self.backend.save(temporary, self.base_model)
        (temporary / "job_position.json").write_text(json.dumps(asdict(position)))
        temporary.rename(directory)
        metrics = {"step": position.step, "train_loss": train_loss}
        if self.validation:
            metrics["valid_loss"] = self.backend.eval_loss(self.validation[:EVAL_EXAMPLES])
        self.report("checkpoint", step=position.step, directory=directory, metrics=metrics)
