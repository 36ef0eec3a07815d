"""The call protocol both sides of the boundary share: what a layer call is, and what makes one invalid.

An executor serves three ops on a base layer or a group of them (ids joined by "+": sibling layers that
take one input, outputs side by side):

    forward:        x [T, in]  -> x W^T + b   [T, out]
    forward_nobias: x [T, in]  -> x W^T       [T, out]
    backward:       g [T, out] -> g W         [T, in]   (no gradient for W or b is formed)

and two on a block (`partition.BLOCK_KINDS`), stateless as the rest:

    forward:        x [T, in]             -> the block's output            [T, out]
    backward:       [x | g] [T, in + out] -> the input's gradient          [T, in]

A `gated_mlp` block is down(act(gate(x)) * up(x)) (`partition.plan_gated_mlps`); a `decoder_tail` takes [h | a]
(the residual stream, o_proj's input) and gives o(a) + mlp(norm(h + o(a))) (`partition.plan_decoder_tails`).

`check_call` is what the executor checks before a call is queued, and what a remote session checks before
it sends one (so a pipelined call's error shows at the call). Tenant processes import this module, never
the executor's.
"""

from __future__ import annotations

import torch

from symbiosis.errors import BadCall, UnknownLayer
from symbiosis.model.partition import BLOCK_KINDS, BaseLayerSpec

OPS = ("forward", "forward_nobias", "backward")  # an op travels as its index on the ipc:// doorbell
CALL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # likewise a call's dtype
DEFAULT_MAX_CALL_TOKENS = 1 << 20
CHECK_EVERY = 1.0  # seconds a client waits on a reply between asking whether the executor still knows it


def check_call(layer_id: str, spec: BaseLayerSpec | None, op: str, tensor: torch.Tensor, max_call_tokens: int) -> None:
    """Raise what is wrong with a call of `op` on the layer `spec` describes (None: not served), but dtype."""
    if op not in OPS:
        raise BadCall(f"unknown op {op!r}; expected one of {OPS}")
    if spec is None:
        raise UnknownLayer(f"this executor serves no base layer {layer_id[:300]!r}")
    if spec.kind in BLOCK_KINDS and op == "forward_nobias":
        raise BadCall(f"block {layer_id[:300]!r} runs forward and backward only")
    width = spec.out_features if op == "backward" else spec.in_features
    if spec.kind in BLOCK_KINDS and op == "backward":  # its input beside the output's gradient
        width = spec.in_features + spec.out_features
    if tensor.dim() != 2 or tensor.shape[1] != width:
        raise BadCall(f"{op} call to layer {layer_id[:300]!r} expects [tokens, {width}], got {list(tensor.shape)}")
    if tensor.shape[0] > max_call_tokens:
        raise BadCall(f"{op} call to layer {layer_id[:300]!r} has {tensor.shape[0]} tokens, "
                      f"more than this executor's limit of {max_call_tokens}")


def result_width(spec: BaseLayerSpec, op: str) -> int:
    """The width of `op`'s result on the layer `spec` describes."""
    return spec.in_features if op == "backward" else spec.out_features


def check_counts(group_id: str, op: str, counts, experts: int, rows: int) -> None:
    """Raise what is wrong with the rows per expert of a MoE projection's call (`Executor.submit_experts`)."""
    if (not isinstance(counts, list) or len(counts) != experts
            or any(not isinstance(c, int) or c < 0 for c in counts) or sum(counts) != rows):
        raise BadCall(f"{op} call to experts {group_id[:300]!r}: counts must be {experts} non-negative integers "
                      f"adding up to the call's {rows} rows")
