"""The causal-LM loss without whole logits: the output head and cross-entropy run a chunk of tokens at a time.

`model(input_ids, labels=ids).loss` makes the logits [tokens, vocab] whole: for Llama-3 at 1024 tokens that
is 0.25 GiB in bf16, 0.5 GiB more upcast to fp32, and log-softmax keeps 0.5 GiB more for backward, all held
at the step's peak. `causal_lm_loss` runs the decoder, then takes the tokens a chunk at a time. When the
head is frozen (a base layer, or a plain frozen `nn.Linear`), nothing but the hidden states needs the
logits' gradient, so each chunk computes its raw logits z = h W^T, its share of the loss, and at once the
gradient that reaches the hidden states, d loss / d h = (softmax(z) - onehot(target)) W / n, which is all
that is kept ([tokens, hidden]). The head's GEMMs are the ones backward would run anyway: nothing is
recomputed, and the logits never exist beyond one chunk. A head that trains (LoRA on `lm_head`,
`modules_to_save`) goes through activation checkpointing per chunk instead: its forward runs again in
backward.

It computes what transformers computes (`ForCausalLMLoss`: labels shifted by one, `ignore_index`, mean over
the counted tokens or sum / `num_items_in_batch`), with the softmax in at least float32 as transformers'
upcast does, for the architectures whose head it knows (`LOGIT_TRANSFORMS`); others are refused rather
than computed wrongly.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from symbiosis.client.virtual import VirtualLinear, base_call
from symbiosis.errors import BadCall, UnsupportedAdapter

# Raw logits z -> (logits, d logits / d z), both float [tokens, vocab].
Transform = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | float]]
# [chunk, hidden] -> (raw logits [chunk, vocab], grad_z [chunk, vocab] -> grad_h [chunk, hidden])
FrozenHead = Callable[[torch.Tensor], tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]


def _plain(config) -> None:
    return None  # the head's output is the logits


def _softcap(cap: float | None) -> Transform | None:
    if cap is None:
        return None

    def transform(z: torch.Tensor):  # Gemma-2: cap * tanh(z / cap)
        capped = torch.tanh(z / cap) * cap
        return capped, 1 - (capped / cap) ** 2

    return transform


def _scale(divisor: float) -> Transform | None:
    return None if divisor == 1 else (lambda z: (z / divisor, 1 / divisor))  # Granite: z / logits_scaling


# model_type -> config -> what the model's forward does to the head's output before the loss (None: nothing)
LOGIT_TRANSFORMS: dict[str, Callable[[object], Transform | None]] = {
    "llama": _plain,
    "mistral": _plain,
    "qwen2": _plain,
    "gpt2": _plain,
    "gpt_bigcode": _plain,
    "opt": _plain,
    "gemma2": lambda config: _softcap(config.final_logit_softcapping),
    "granite": lambda config: _scale(config.logits_scaling),
    # mixtures of experts: a plain head (their router's auxiliary loss is refused below where it joins the loss)
    "mixtral": _plain,
    "qwen3_moe": _plain,
    "olmoe": _plain,
}

CHUNK_ELEMENTS = 2**26  # default chunk: tokens x vocab logits of at most this many elements (256 MiB in fp32)


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                   chunk_tokens: int | None = None, ignore_index: int = -100,
                   num_items_in_batch: torch.Tensor | int | None = None, **inputs) -> torch.Tensor:
    """The loss `model(input_ids=..., labels=labels, ...).loss` would return, computed without whole logits.

    model: a causal LM, PEFT-wrapped or not, split (`symbiosis.from_pretrained`) or plain. labels: [batch,
    seq] token ids, `ignore_index` where a token does not count (shifted by one here, as transformers
    does). chunk_tokens: tokens per chunk (default: as many as keep a chunk's logits within
    CHUNK_ELEMENTS). Other keyword arguments (attention_mask, inputs_embeds, ...) go to the decoder."""
    if labels is None:
        raise TypeError("causal_lm_loss needs labels")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise BadCall(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in LOGIT_TRANSFORMS:
        raise UnsupportedAdapter(
            f"causal_lm_loss does not know how a {model_type!r} model turns its head's output into logits "
            f"(it knows {sorted(LOGIT_TRANSFORMS)}); use model(input_ids, labels=labels).loss")
    if getattr(config, "output_router_logits", False):
        raise UnsupportedAdapter(
            f"this {model_type} model's loss adds its router's auxiliary loss (output_router_logits), which "
            "causal_lm_loss does not compute; use model(input_ids, labels=labels).loss, or set "
            "model.config.output_router_logits = False for the cross-entropy alone")
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and peft_config.is_prompt_learning:
        raise UnsupportedAdapter(
            f"causal_lm_loss runs the decoder itself, and {peft_config.peft_type} adds its virtual tokens in "
            "PeftModel.forward; use model(input_ids, labels=labels).loss")
    inputs.setdefault("use_cache", False)  # a training pass: no KV cache to build
    hidden = model.get_decoder()(input_ids=input_ids, **inputs)[0]  # [batch, seq, hidden]
    if labels.shape != hidden.shape[:-1]:
        raise BadCall(f"labels of shape {list(labels.shape)} for inputs of {list(hidden.shape[:-1])} tokens")
    targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1).to(hidden.device)  # [tokens]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    head = model.get_output_embeddings()
    transform = LOGIT_TRANSFORMS[model_type](config)
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // head.out_features)
    loss_sum_dtype = torch.promote_types(hidden.dtype, torch.float32)
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum().to(loss_sum_dtype)
    else:
        denominator = torch.as_tensor(num_items_in_batch, dtype=loss_sum_dtype, device=hidden.device)
    frozen = _frozen_head(head)
    if frozen is not None:
        loss = _FrozenHeadLoss.apply(hidden, targets, denominator, frozen, transform, chunk, ignore_index)
    else:
        total = hidden.new_zeros((), dtype=loss_sum_dtype)
        for start in range(0, hidden.shape[0], chunk):
            piece = slice(start, start + chunk)
            total = total + checkpoint(_chunk_loss_sum, head, hidden[piece], targets[piece], transform,
                                       ignore_index, use_reentrant=False)
        loss = total / denominator
    session = getattr(model, "symbiosis_session", None)  # a split model's (a plain model has none)
    if session is not None:  # a pipelined client's calls answered (or raising), as the model's forward hook
        session.synchronize()
    return loss


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, transform: Transform | None,
                    ignore_index: int) -> torch.Tensor:
    """Sum of the cross-entropy of one chunk through any head (autograd does its backward)."""
    logits = head(hidden).to(torch.promote_types(hidden.dtype, torch.float32))
    if transform is not None:
        logits = transform(logits)[0]
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def _frozen_head(head: nn.Module) -> FrozenHead | None:
    """How to run `head` when its weights do not train: raw logits z = h W^T (+ b), and grad_h = grad_z W."""
    if isinstance(head, VirtualLinear):  # a base layer: the executor's GEMMs (on this thread where it can)
        return partial(base_call, head)
    trains = any(p.requires_grad for p in head.parameters())
    if type(head) is nn.Linear and not trains:
        return lambda h: (F.linear(h, head.weight, head.bias), lambda g: g @ head.weight)
    return None


class _FrozenHeadLoss(torch.autograd.Function):
    """loss = sum over chunks of cross-entropy(transform(h W^T), targets) / denominator; forward also computes
    d loss / d h chunk by chunk and keeps only that [tokens, hidden]; backward scales it."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, denominator: torch.Tensor, head: FrozenHead,
                transform: Transform | None, chunk: int, ignore_index: int) -> torch.Tensor:
        wants_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if wants_grad else None
        total = hidden.new_zeros((), dtype=denominator.dtype)
        vocabulary = None
        for start in range(0, hidden.shape[0], chunk):
            piece = slice(start, start + chunk)
            target = targets[piece]
            counted = target != ignore_index  # [C]
            index = torch.where(counted, target, 0).unsqueeze(1)  # [C, 1]
            raw, backward = head(hidden[piece])
            logits = raw.to(denominator.dtype)  # [C, vocab]
            if vocabulary is None:
                vocabulary = torch.arange(logits.shape[1], device=logits.device)  # [vocab]
            slope = 1.0
            if transform is not None:
                logits, slope = transform(logits)
            log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # [C, 1]
            picked = logits.gather(1, index)
            total = total + torch.where(counted.unsqueeze(1), log_norm - picked, 0).sum()
            if wants_grad:  # (softmax - onehot) / denominator on counted rows, through the transform, then W
                # Pointwise only (no scatter): torch.compile fuses it into one pass over the chunk's logits.
                grad = logits.sub_(log_norm).exp_().sub_((vocabulary == index).to(logits.dtype))
                grad.mul_(torch.where(counted, 1 / denominator, 0).unsqueeze(1))
                if transform is not None:
                    grad = grad * slope
                grad_hidden[piece] = backward(grad.to(hidden.dtype))
        ctx.save_for_backward(grad_hidden)
        return total / denominator

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None, None
