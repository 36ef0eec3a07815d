"""The losses of Tinker's `forward_backward`, over one datum's target log-probabilities.

Every input lines up with the model input: position i's logits score target_tokens[i] (Tinker's convention;
the datum is already shifted by one). With lp = log p_theta(target_tokens) [N] (or [N, K] for K targets a
position, cross_entropy only):

    cross_entropy        loss = -sum(weights * lp)
    importance_sampling  loss = -sum(exp(lp - logprobs) * advantages)           logprobs: the sampler's
    ppo                  loss = -sum(min(r * A, clip(r, low, high) * A)),  r = exp(lp - logprobs), A = advantages
                         low, high: loss_fn_config's clip_low_threshold / clip_high_threshold (0.8, 1.2)

Each returns the loss (a sum: Tinker's reduction) and the datum's outputs: `logprobs`, lp itself.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from symbiosis.errors import BadCall

# name -> the loss_fn_inputs it reads (besides target_tokens)
INPUTS = {"cross_entropy": ("weights",), "importance_sampling": ("logprobs", "advantages"),
          "ppo": ("logprobs", "advantages")}
CONFIG = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}}


def _cross_entropy(lp, inputs, config):
    return -(inputs["weights"].to(lp.dtype) * lp).sum()


def _importance_sampling(lp, inputs, config):
    ratio = torch.exp(lp - inputs["logprobs"].to(lp.dtype))
    return -(ratio * inputs["advantages"].to(lp.dtype)).sum()


def _ppo(lp, inputs, config):
    ratio = torch.exp(lp - inputs["logprobs"].to(lp.dtype))
    advantages = inputs["advantages"].to(lp.dtype)
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


LOSSES: dict[str, Callable] = {"cross_entropy": _cross_entropy, "importance_sampling": _importance_sampling,
                               "ppo": _ppo}


def check(loss_fn: str, tokens: int, inputs: dict[str, torch.Tensor], config: dict | None) -> dict:
    """The loss's config (defaults filled in); `BadCall` naming what is missing, extra or misshapen."""
    if loss_fn not in LOSSES:
        raise BadCall(f"loss_fn {loss_fn!r} is not supported (supported: {', '.join(sorted(LOSSES))})")
    targets = inputs.get("target_tokens")
    if targets is None:
        raise BadCall("loss_fn_inputs lack target_tokens")
    if targets.shape[:1] != (tokens,) or targets.dim() > (2 if loss_fn == "cross_entropy" else 1):
        raise BadCall(f"target_tokens of shape {list(targets.shape)} for {tokens} input tokens")
    for name in INPUTS[loss_fn]:
        if name not in inputs:
            raise BadCall(f"loss_fn {loss_fn!r} needs loss_fn_inputs[{name!r}]")
        if inputs[name].shape != targets.shape:
            raise BadCall(f"loss_fn_inputs[{name!r}] has shape {list(inputs[name].shape)}, target_tokens "
                          f"{list(targets.shape)}")
        if not torch.isfinite(inputs[name].double()).all():
            raise BadCall(f"loss_fn_inputs[{name!r}] holds NaN or Inf")
    extra = set(inputs) - {"target_tokens", *INPUTS[loss_fn]}
    if extra:
        raise BadCall(f"loss_fn {loss_fn!r} takes no loss_fn_inputs {sorted(extra)}")
    merged = dict(CONFIG.get(loss_fn, {}))
    for key, value in (config or {}).items():
        if key not in merged:
            raise BadCall(f"loss_fn {loss_fn!r} has no config {key!r}")
        try:
            merged[key] = float(value)
        except (TypeError, ValueError):
            raise BadCall(f"loss_fn_config[{key!r}] must be a number") from None
        if not math.isfinite(merged[key]):
            raise BadCall(f"loss_fn_config[{key!r}] must be finite, not {value}")
    if "clip_low_threshold" in merged and merged["clip_low_threshold"] > merged.get("clip_high_threshold", math.inf):
        raise BadCall(f"loss_fn_config: clip_low_threshold {merged['clip_low_threshold']} is above "
                      f"clip_high_threshold {merged['clip_high_threshold']}")
    return merged
