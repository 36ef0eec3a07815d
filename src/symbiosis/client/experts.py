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

The executor takes each projection as ONE call: the rows grouped by expert and the rows per expert
(`Executor.submit_experts`; in process, or over tcp:// and nccl:// with the counts in the call's header), calls
of several clients batched per projection and regrouped by expert, one grouped GEMM (`store.ExpertGroup`; a
client alone in process runs it on its own thread, as a dense layer's `direct`, with the groups' offsets left on
the device: no host synchronization per layer). Over ipc:// (or through noise
masking) each chosen expert is a call of its own, under its layer id, which the executor batches per expert as
per dense layer. Backward sends the output gradient and gets grad_x = g W_e
per expert (nothing is saved on the executor). Experts no token chose cost nothing.
"""

from __future__ import annotations

import types

import torch
from peft.tuners.lora.layer import ParamWrapper
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


class SplitParamWrapper(ParamWrapper):
    """PEFT's LoRA on a fused experts parameter (`target_parameters`), on a split model. PEFT adds
    `scaling * lhs @ rhs` (per expert, the parameter's own layout) to the parameter while the experts run; here
    the executor keeps W and the experts' forward adds each expert's term to its rows instead:

        linear  W_e [out, in]:  y_e = x_e (W_e + s lhs_e rhs_e)^T = x_e W_e^T + s (x_e rhs_e^T) lhs_e^T
        conv1d  W_e [in, out]:  y_e = x_e (W_e + s lhs_e rhs_e)   = x_e W_e   + s (x_e lhs_e) rhs_e

    (the tenant's own two small GEMMs per expert, on the client; autograd trains the factors). Wrappers of both
    projections nest, each putting its factors where the experts' forward finds them for the call."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None:
            return super().forward(x, *args, **kwargs)
        experts = self.get_base_layer()
        active = [a for a in self.active_adapters if a in self.lora_A]
        pending = experts.__dict__.setdefault("symbiosis_lora", {})
        pending[self.parameter_name] = [self.get_delta_factors(a) for a in active]
        try:
            return self.base_layer(x, *args, **kwargs)
        finally:
            pending.pop(self.parameter_name, None)


def _add_lora(self, projection: str, y: torch.Tensor, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """y [rows grouped by expert, out] plus the LoRA of `projection` a SplitParamWrapper put here, if any."""
    factors = self.__dict__.get("symbiosis_lora", {}).get(projection)
    if not factors:
        return y
    linear = not self.is_transposed
    extra, start = [], 0
    for expert, rows in enumerate(counts):
        chunk = x[start:start + rows]
        start += rows
        term = chunk.new_zeros(rows, y.shape[1])
        for lhs, rhs, scaling in factors if rows else ():
            low = chunk @ (rhs[expert].t() if linear else lhs[expert])  # [rows, r]
            term = term + scaling * (low @ (lhs[expert].t() if linear else rhs[expert]))
        extra.append(term)
    return y + torch.cat(extra)


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
    rows = hidden_states[order // top_k]  # [S, H]
    hidden = hidden_states.shape[-1]

    def activation(h):
        return self._apply_gate(h) if self.has_gate else self.act_fn(h)

    def post(h):
        return self.post_expert_norm(h) if getattr(self, "has_post_expert_norm", False) else h

    on_device = _on_device_groups(self, session, groups, first, rows)
    if on_device is not None:  # this thread's own grouped GEMMs, the groups' offsets on the device: no host wait
        sorted_ids = expert_ids[order]
        # An id of num_experts (expert parallelism's sentinel in transformers) or above adds nothing, as there: such
        # pairs sort last, run with the last expert (so every row is written) and are zeroed.
        chosen = sorted_ids.clamp(max=self.num_experts - 1)
        per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=rows.device)
        ends = per_expert.scatter_add_(0, chosen, torch.ones_like(chosen)).cumsum(0).to(torch.int32)
        h = activation(on_device[0].forward_by_offsets(rows, ends, chosen))
        h = post(on_device[1].forward_by_offsets(h, ends, chosen))
        sorted_outputs = torch.where((sorted_ids < self.num_experts)[:, None], h, 0)
    else:
        counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()
        routed = sum(counts[:self.num_experts])
        if getattr(session, "expert_group", None) is not None and session.expert_group(groups[first]) is not None:
            kept, x = counts[:self.num_experts], rows[:routed]
            h = activation(_add_lora(self, first, _grouped(session, groups[first], x, kept), x, kept))
            h = post(_add_lora(self, "down_proj", _grouped(session, groups["down_proj"], h, kept), h, kept))
            outputs = [h, h.new_zeros(rows.shape[0] - routed, hidden)]
        else:
            outputs = []
            for expert, chunk in enumerate(rows.split(counts)):
                if expert >= self.num_experts or chunk.shape[0] == 0:
                    outputs.append(chunk.new_zeros(chunk.shape[0], hidden))
                    continue
                only = [0] * expert + [chunk.shape[0]]  # counts with this expert's rows alone
                h = activation(_add_lora(self, first, base_forward(calls[first][expert], chunk), chunk, only))
                outputs.append(post(_add_lora(self, "down_proj", base_forward(calls["down_proj"][expert], h), h,
                                              only)))
        sorted_outputs = torch.cat(outputs)
    weighted = sorted_outputs * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # [S, H]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return weighted[inverse].view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _on_device_groups(self, session, groups: dict, first: str, rows: torch.Tensor):
    """(first projection's, down projection's) `ExpertGroup` where this thread runs both on device offsets: an
    in-process executor that lets it run them itself, a grouped GEMM for these inputs, no LoRA of the tenant's on the
    experts (its terms are per expert, from host counts). Else None."""
    if self.__dict__.get("symbiosis_lora") or getattr(session, "expert_group", None) is None:
        return None
    pair = (session.expert_group(groups[first], rows), session.expert_group(groups["down_proj"], rows))
    if any(group is None or not group.runs_on_device_offsets(rows) for group in pair):
        return None
    return pair
