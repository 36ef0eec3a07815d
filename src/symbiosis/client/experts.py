"""The experts of a mixture-of-experts layer on a split model: routing here, expert GEMMs in the executor.

transformers 5 holds a MoE layer's experts in one module (`use_experts_implementation`): fused 3-D parameters
`gate_up_proj` (or `up_proj`) and `down_proj`, called with the router's choice per token. On a split model those
parameters are virtual (shape, dtype, device; no values) and each expert's projection is a base layer of the
executor (`model/partition.py`). The client keeps what is the tenant's: the router (its own module, LoRA-able),
the top-k indices and weights it computes, the activation between the projections, the routing weights and the
sum over the k experts of each token. Per token t and its k chosen experts e with weights w:

    rows of expert e   = the (t, k) pairs routed to e, in token order          (one sort of the S = T*k pairs)
    h                  = executor(e.gate_up_proj, rows)                        [n_e, 2I]  (or up_proj: [n_e, I])
    h                  = act(gate) * up            (the module's own `_apply_gate`; act(h) without a gate)
    y                  = executor(e.down_proj, h)                              [n_e, H]
    out[t]             = sum over k of w[t, k] * y[(t, k)]

An in-process executor takes each projection as ONE call: the rows grouped by expert and the rows per expert
(`Executor.submit_experts`), calls of several clients batched per projection and regrouped by expert, one
grouped GEMM (`store.ExpertGroup`; alone, the client runs it on its own thread, as a dense layer's `direct`).
Over a transport (or through noise masking), each chosen expert is a call of its own, under its layer id, which
the executor batches per expert as per dense layer. Backward sends the output gradient and gets grad_x = g W_e
per expert (nothing is saved on the executor). Experts no token chose cost nothing.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from symbiosis.client.virtual import VirtualWeight, base_forward, make_virtual
from symbiosis.model.partition import BaseLayerSpec


def make_virtual_experts(module: nn.Module, projections: dict[str, list[BaseLayerSpec]], session, device,
                         dtype) -> None:
    """Turn transformers' experts `module` into a split one, in place: its fused parameters become virtual, and
    its forward calls the executor per expert."""
    calls = {}
    for projection, specs in projections.items():
        fused = getattr(module, projection)
        parameter = nn.Parameter(VirtualWeight(fused.shape, dtype, device, specs[0].weight_name), requires_grad=False)
        parameter._is_hf_initialized = True
        setattr(module, projection, parameter)
        if specs[0].bias_name:  # the executor adds each expert's bias in its call
            bias = getattr(module, f"{projection}_bias")
            parameter = nn.Parameter(VirtualWeight(bias.shape, dtype, device, specs[0].bias_name), requires_grad=False)
            parameter._is_hf_initialized = True
            setattr(module, f"{projection}_bias", parameter)
        # grouper=None: no two experts take one input. Not submodules: PEFT's "all-linear" must not find them
        # (a plain model has no such nn.Linear), nor must state_dict.
        calls[projection] = [make_virtual(spec, session, None, device, dtype) for spec in specs]
    module.__dict__["symbiosis_experts"] = calls
    module.__dict__["symbiosis_expert_groups"] = {projection: specs[0].weight_name for projection, specs in projections.items()}
    module.__dict__["symbiosis_session"] = session
    module.forward = types.MethodType(split_experts_forward, module)


class _ExpertsCall(torch.autograd.Function):
    """y = every expert's GEMM of one fused projection, one executor call (x grouped by expert, counts rows each);
    backward: grad_x, one call. Nothing saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, session, group_id: str, counts: list[int], inference: bool) -> torch.Tensor:
        ctx.session, ctx.group_id, ctx.counts = session, group_id, counts
        return session.experts_forward(group_id, x, counts, inference=inference)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return ctx.session.experts_backward(ctx.group_id, grad_out.contiguous(), ctx.counts), None, None, None, None


def _grouped(session, group_id: str, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """One fused projection's experts on x [rows grouped by expert, in] -> [rows, out]."""
    group = session.expert_group(group_id, x)
    if group is not None:  # alone on an in-process executor: its GEMMs here, native autograd (W needs no grad)
        return group.forward(x, counts)
    return _ExpertsCall.apply(x, session, group_id, counts, not torch.is_grad_enabled())


def split_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states [T, H], top_k_index [T, k] (int), top_k_weights [T, k] -> [T, H]; as transformers' experts
    compute it, with each expert's projections in the executor."""
    calls, groups, session = self.symbiosis_experts, self.symbiosis_expert_groups, self.symbiosis_session
    first = "gate_up_proj" if self.has_gate else "up_proj"
    num_tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)  # [S]: the (token, k) pairs, token-major
    order = torch.argsort(expert_ids, stable=True)  # pairs grouped by expert, each group in token order
    # An id of num_experts (expert parallelism's sentinel in transformers) or above adds nothing, as there.
    counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()
    rows = hidden_states[order // top_k]  # [S, H]
    routed = sum(counts[:self.num_experts])
    hidden = hidden_states.shape[-1]

    def activation(h):
        return self._apply_gate(h) if self.has_gate else self.act_fn(h)

    if getattr(session, "expert_group", None) is not None and session.expert_group(groups[first]) is not None:
        kept = counts[:self.num_experts]
        h = activation(_grouped(session, groups[first], rows[:routed], kept))
        h = _grouped(session, groups["down_proj"], h, kept)
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        outputs = [h, h.new_zeros(rows.shape[0] - routed, hidden)]
    else:
        outputs = []
        for expert, chunk in enumerate(rows.split(counts)):
            if expert >= self.num_experts or chunk.shape[0] == 0:
                outputs.append(chunk.new_zeros(chunk.shape[0], hidden))
                continue
            h = base_forward(calls["down_proj"][expert], activation(base_forward(calls[first][expert], chunk)))
            if getattr(self, "has_post_expert_norm", False):
                h = self.post_expert_norm(h)
            outputs.append(h)
    weighted = torch.cat(outputs) * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # [S, H]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return weighted[inverse].view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)
