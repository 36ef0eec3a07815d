"""Batched passes over many adapters' work: `Trainer.run` takes the forward / forward_backward requests of several
adapters and runs them as one pass (engine of the Tinker API's training; serve/tinker.py schedules it).

A pass: every datum of every request is a row of a padded batch [B, L] (a request's datums side by side, so each
adapter's rows are one run); the decoder runs once; each datum's target log-probabilities come from the head a
datum at a time, under activation checkpointing (its logits [n, vocab] exist only inside, recomputed in backward);
each request's loss is the sum of its datums' (losses.py); one backward of the total of the requests that asked
for gradients. Gradients add up in each adapter's matrices until its optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from symbiosis.client.loss import LOGIT_TRANSFORMS
from symbiosis.errors import BadCall, UnsupportedAdapter
from symbiosis.train import losses
from symbiosis.train.lora import HostedLora
from symbiosis.train.model import build


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs, each [N] or [N, K]


@dataclass
class Work:
    """One forward (backward=False) or forward_backward request of one adapter."""
    lora: HostedLora
    datums: list[Datum]
    loss_fn: str
    config: dict = field(default_factory=dict)
    backward: bool = True

    @property
    def tokens(self) -> int:
        return sum(len(d.tokens) for d in self.datums)


@dataclass
class Result:
    """Per datum its target log-probabilities [N] (or [N, K]) and loss; the request's summed loss."""
    logprobs: list[torch.Tensor]
    losses: list[float]

    @property
    def loss(self) -> float:
        return sum(self.losses)


class Trainer:
    def __init__(self, model_path, executor):
        self.device, self.dtype = executor.device, executor.dtype
        self.fingerprint = executor.fingerprint
        self.model, self.state, self.targets = build(model_path, executor)
        self.config = self.model.config.get_text_config()
        model_type = getattr(self.model.config, "model_type", None)
        if model_type not in LOGIT_TRANSFORMS:
            raise UnsupportedAdapter(f"hosted training knows how {sorted(LOGIT_TRANSFORMS)} models make their logits, "
                                     f"not {model_type!r}")
        self.transform = LOGIT_TRANSFORMS[model_type](self.model.config)
        self.head = self.model.get_output_embeddings()
        self.vocab = self.head.base.spec.out_features
        self.context = getattr(self.config, "max_position_embeddings", None)

    def check(self, work: Work) -> None:
        """`BadCall` naming what is wrong with a request, before it joins a pass."""
        if not work.datums:
            raise BadCall("no datums")
        for i, datum in enumerate(work.datums):
            if not datum.tokens:
                raise BadCall(f"datum {i}: an empty model input")
            if self.context is not None and len(datum.tokens) > self.context:
                raise BadCall(f"datum {i}: {len(datum.tokens)} tokens exceed the model's context of {self.context}")
            if any(not 0 <= t < self.vocab for t in datum.tokens):
                raise BadCall(f"datum {i}: token ids outside the vocabulary (0..{self.vocab - 1})")
            try:
                work.config = losses.check(work.loss_fn, len(datum.tokens), datum.inputs, work.config)
            except BadCall as e:
                raise BadCall(f"datum {i}: {e}") from None
            targets = datum.inputs["target_tokens"]
            if targets.is_floating_point() or bool(((targets < 0) | (targets >= self.vocab)).any()):
                raise BadCall(f"datum {i}: target_tokens outside the vocabulary (0..{self.vocab - 1})")

    def run(self, works: list[Work]) -> list[Result]:
        """One pass over the works' datums; backward for those that ask. Returns each work's result."""
        datums = [d for work in works for d in work.datums]
        length = max(len(d.tokens) for d in datums)
        input_ids = torch.zeros(len(datums), length, dtype=torch.long)
        mask = torch.zeros(len(datums), length, dtype=torch.long)
        for row, datum in enumerate(datums):
            input_ids[row, :len(datum.tokens)] = torch.tensor(datum.tokens)
            mask[row, :len(datum.tokens)] = 1
        self.state.begin([work.lora for work in works for _ in work.datums])
        backward = any(work.backward for work in works)
        try:
            with torch.enable_grad() if backward else torch.no_grad():
                hidden = self.model.get_decoder()(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                                  use_cache=False)[0]  # [B, L, H]
                results, total, row = [], None, 0
                for work in works:
                    logprobs, values = [], []
                    for datum in work.datums:
                        n = len(datum.tokens)
                        lp = self._target_logprobs(hidden[row, :n], datum.inputs["target_tokens"], work.lora)
                        loss = losses.LOSSES[work.loss_fn](lp, {k: v.to(self.device) for k, v in datum.inputs.items()},
                                                          work.config)
                        if work.backward:
                            total = loss if total is None else total + loss
                        logprobs.append(lp.detach().cpu())
                        values.append(float(loss.detach()))
                        row += 1
                    results.append(Result(logprobs, values))
                if total is not None:
                    total.backward()
        finally:
            self.state.end()
        return results

    def _target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, lora: HostedLora) -> torch.Tensor:
        """log p(targets) [n] (or [n, K]) from hidden [n, H]: the head (with the adapter's LoRA on it, if any),
        the model's logit transform, log-softmax in at least float32; checkpointed when gradients flow."""
        targets = targets.to(self.device).long()

        def score(h):
            logits = self.head.project(h, [(0, h.shape[0], lora)])
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            if self.transform is not None:
                logits = self.transform(logits)[0]
            picked = logits.gather(1, targets if targets.dim() == 2 else targets[:, None])
            lp = picked - torch.logsumexp(logits, dim=-1, keepdim=True)
            return lp if targets.dim() == 2 else lp[:, 0]

        if torch.is_grad_enabled():
            return checkpoint(score, hidden, use_reentrant=False)
        return score(hidden)
