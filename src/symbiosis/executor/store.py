"""The base weights: every base layer's W (+ b), loaded once, read-only, on the executor's device.

Math per layer (T tokens):
    linear:  forward y = x W^T + b   backward grad_x = g W      (W: [out, in])
    conv1d:  forward y = x W + b     backward grad_x = g W^T    (W: [in, out])
No gradient is computed for W or b: base layers are frozen.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from symbiosis.errors import CheckpointError
from symbiosis.model.layout import Layout
from symbiosis.model.partition import GROUP_SEPARATOR, BaseLayerSpec


@dataclass
class BaseLayer:
    spec: BaseLayerSpec
    weight: torch.Tensor
    bias: torch.Tensor | None

    @functools.cached_property
    def squared_norms(self) -> torch.Tensor:
        """||W_o||^2 per output feature o [out], summed in at least float32."""
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        return self.weight.to(dtype).square().sum(dim=1 if self.spec.kind == "linear" else 0)

    @property
    def expected_shape(self) -> tuple[int, int]:
        spec = self.spec
        return (spec.out_features, spec.in_features) if spec.kind == "linear" else (spec.in_features, spec.out_features)

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        bias = self.bias if with_bias else None
        if self.spec.kind == "linear":
            return F.linear(x, self.weight, bias)
        return x @ self.weight if bias is None else torch.addmm(bias, x, self.weight)

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        # grad_out: [T, out] -> grad_in: [T, in]
        return grad_out @ self.weight if self.spec.kind == "linear" else grad_out @ self.weight.t()


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's grouped GEMM (one kernel for every expert): CUDA, Hopper or newer, bf16, widths of 16s (x's width
    is one of the weight's)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and weight.shape[1] % 16 == 0 and weight.shape[2] % 16 == 0)


@dataclass
class ExpertGroup:
    """Every expert of one fused MoE projection, run as one call: tokens grouped by expert, `counts[e]` rows each.

    linear:  weight [E, out, in],  y[rows of e] = x[rows of e] W_e^T + b_e    backward: g W_e
    conv1d:  weight [E, in, out],  y[rows of e] = x[rows of e] W_e + b_e      backward: g W_e^T
    One grouped GEMM (`torch._grouped_mm`) where it runs, else one GEMM per expert with rows."""

    spec: BaseLayerSpec  # expert 0's (every expert's shapes)
    weight: torch.Tensor
    bias: torch.Tensor | None

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def runs_on_device_offsets(self, x: torch.Tensor) -> bool:
        """Whether `forward_by_offsets` runs for inputs like `x` (one grouped GEMM, no host synchronization)."""
        return _grouped_mm_fits(x, self.weight)

    def forward_by_offsets(self, x: torch.Tensor, ends: torch.Tensor, experts: torch.Tensor | None,
                           with_bias: bool = True) -> torch.Tensor:
        """As `forward`, the groups given on the device: `ends` int32 [E] (expert e's rows end at ends[e]; the last
        is x's row count) and `experts` [T] each row's expert (for the bias). Nothing is read back to the host, so
        the caller's thread does not wait for the GPU and a CUDA graph can record it. x [T, in] -> [T, out]; its
        gradient by autograd (the weights need none)."""
        linear = self.spec.kind == "linear"
        y = torch._grouped_mm(x, self.weight.transpose(1, 2) if linear else self.weight, offs=ends)
        return y if self.bias is None or not with_bias else y + self.bias[experts]

    def _per_expert(self, x: torch.Tensor, counts: list[int], width: int, gemm) -> torch.Tensor:
        out = x.new_empty(x.shape[0], width)
        start = 0
        for expert, rows in enumerate(counts):
            if rows:
                out[start:start + rows] = gemm(x[start:start + rows], expert)
            start += rows
        return out

    def forward(self, x: torch.Tensor, counts: list[int], with_bias: bool = True) -> torch.Tensor:
        # x [T, in] -> [T, out]
        linear = self.spec.kind == "linear"
        bias = self.bias if with_bias else None
        if _grouped_mm_fits(x, self.weight):
            rows = torch.tensor(counts, device=x.device)
            experts = None if bias is None else torch.arange(len(counts), device=x.device).repeat_interleave(rows)
            return self.forward_by_offsets(x, rows.cumsum(0).to(torch.int32), experts, with_bias)
        b = (lambda e: None) if bias is None else (lambda e: bias[e])  # noqa: E731
        gemm = (lambda rows, e: F.linear(rows, self.weight[e], b(e))) if linear else \
            (lambda rows, e: rows @ self.weight[e] if bias is None else torch.addmm(bias[e], rows, self.weight[e]))
        return self._per_expert(x, counts, self.spec.out_features, gemm)

    def backward(self, grad_out: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # grad_out [T, out] -> [T, in]
        linear = self.spec.kind == "linear"
        if _grouped_mm_fits(grad_out, self.weight):
            ends = torch.tensor(counts, device=grad_out.device).cumsum(0).to(torch.int32)
            return torch._grouped_mm(grad_out, self.weight if linear else self.weight.transpose(1, 2), offs=ends)
        gemm = (lambda g, e: g @ self.weight[e]) if linear else (lambda g, e: g @ self.weight[e].t())
        return self._per_expert(grad_out, counts, self.spec.in_features, gemm)


def check_finite(layout: Layout, name: str, tensor: torch.Tensor) -> None:
    """A base tensor is served to every tenant: a NaN or Inf in it would spoil all their results."""
    if not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{layout.checkpoint.listing}: base tensor {name!r} holds NaN or Inf values "
                              f"({layout.keys(name)}); refusing to serve it")


class BaseWeights:
    """layer id -> BaseLayer, read from the checkpoint (base tensors only) onto `device` in `dtype`.

    A tensor shared by several layers (tied weights) is read and held once. A *group* id, layer ids joined
    by "+" ("...q_proj+...k_proj+...v_proj"), names sibling layers that take one input, run as one GEMM:
    y = x [W_q; W_k; W_v]^T. Its fused weight is made on first use, and the members' weights become views
    of it, so memory stays as it was (`_group` says how later groups of the same layers are served).
    """

    def __init__(self, layout: Layout, specs: list[BaseLayerSpec], device: torch.device, dtype: torch.dtype,
                 columns: dict[str, tuple[int, int]] | None = None):
        names = {s.weight_name for s in specs} | {s.bias_name for s in specs if s.bias_name}
        loaded = layout.read(dict.fromkeys(sorted(names), dtype), device)  # a tied tensor once
        expert = lambda tensor, spec: tensor if spec.expert is None else tensor[spec.expert]  # noqa: E731 -- a view
        self.layers = {s.layer_id: BaseLayer(s, expert(loaded[s.weight_name], s),
                                             expert(loaded[s.bias_name], s) if s.bias_name else None)
                       for s in specs}
        for name, tensor in loaded.items():
            check_finite(layout, name, tensor)
        for layer in self.layers.values():  # a converter's output is known only now; a bias is not checked before
            for name, tensor, expected in ((layer.spec.weight_name, layer.weight, layer.expected_shape),
                                           (layer.spec.bias_name, layer.bias, (layer.spec.out_features,))):
                if tensor is not None and tensor.shape != expected:
                    raise CheckpointError(f"{layout.checkpoint.listing}: {layout.keys(name)} make {name!r} of shape "
                                          f"{list(tensor.shape)}, the config implies {list(expected)}")
        for layer_id, (first, width) in (columns or {}).items():  # a sharded executor's slices: only they are kept
            layer = self.layers[layer_id]
            out_dim = 0 if layer.spec.kind == "linear" else 1
            layer.weight = layer.weight.narrow(out_dim, first, width).clone()
            layer.bias = None if layer.bias is None else layer.bias.narrow(0, first, width).clone()
            layer.spec = dataclasses.replace(layer.spec, out_features=width)
        sliced = [self.layers[i] for i in columns or ()]  # their whole tensors are dropped, their slices held
        dropped = {name for layer in sliced for name in (layer.spec.weight_name, layer.spec.bias_name)}
        held = [t for name, t in loaded.items() if name not in dropped] + \
            [t for layer in sliced for t in (layer.weight, layer.bias) if t is not None]
        self.nbytes = sum(t.numel() * t.element_size() for t in held)
        # fused MoE projection (its tensor's name) -> all its experts, for grouped calls
        self.experts: dict[str, ExpertGroup] = {
            s.weight_name: ExpertGroup(s, loaded[s.weight_name], loaded[s.bias_name] if s.bias_name else None)
            for s in specs if s.expert == 0}
        self.groups: dict[str, BaseLayer | MemberLayers] = {}
        self._fused_in: dict[str, BaseLayer] = {}  # layer id -> the fused group whose weight its weight views
        self._lock = threading.Lock()
        self.blocks: dict[str, GatedMlp | DecoderTail] = {}  # block id -> the block (`serve_blocks`)

    def serve_blocks(self, blocks: dict[str, BaseLayerSpec], modules: dict[str, torch.nn.Module]) -> None:
        """Serve these blocks whole: gated MLPs (`partition.plan_gated_mlps`; `modules`: each one's activation module),
        then decoder tails (`plan_decoder_tails`; `modules`: each one's post-attention norm, its weight loaded) of the
        MLPs served."""
        for block_id, spec in blocks.items():
            if spec.kind != "gated_mlp":
                continue
            gate, up, down = spec.weight_name.split(GROUP_SEPARATOR)
            gate_up = self.get(GROUP_SEPARATOR.join((gate, up)))
            if gate_up is not None:  # (None: not one group, say one of them has a bias: its layers are called)
                self.blocks[block_id] = GatedMlp(spec, gate_up, self.layers[down], modules[block_id])
        for block_id, spec in blocks.items():
            if spec.kind == "decoder_tail":
                o_proj, mlp, _ = spec.weight_name.split(GROUP_SEPARATOR)
                if mlp in self.blocks:
                    norm = modules[block_id]
                    self.blocks[block_id] = DecoderTail(spec, self.layers[o_proj], norm, self.blocks[mlp])
                    self.nbytes += sum(p.numel() * p.element_size() for p in norm.parameters())  # it holds them

    def tensor(self, name: str) -> torch.Tensor | None:
        """The weight read as tensor `name`, if a layer holds one (a tied lm_head: the embedding)."""
        return next((layer.weight for layer in self.layers.values()
                     if layer.spec.weight_name == name and layer.spec.expert is None), None)

    def get(self, layer_id: str) -> "BaseLayer | MemberLayers | GatedMlp | None":
        """A layer, group or block by id; None if there is no such layer, group or block."""
        layer = self.layers.get(layer_id) or self.blocks.get(layer_id)
        if layer is not None or GROUP_SEPARATOR not in layer_id:
            return layer
        with self._lock:
            group = self.groups.get(layer_id)
            if group is None:
                group = self._group(layer_id.split(GROUP_SEPARATOR))
                if group is not None:  # only real groups are kept: a bounded number (siblings of one module)
                    self.groups[layer_id] = group
            return group

    def _group(self, ids: list[str]) -> BaseLayer | MemberLayers | None:
        """Layers that take one input: sibling modules (q, k, v of one attention block), of one kind and input
        width. The first group a layer joins is fused (its weight becomes a view of the group's: no memory
        grows); a later group of members of one fused group, in its order, is a view of that group's weight;
        any other is served member by member. So a client can grow no weight on the executor."""
        members = [self.layers.get(i) for i in ids]
        if len(set(ids)) < 2 or len(set(ids)) != len(ids) or any(m is None or m.spec.expert is not None for m in members):
            return None  # experts take different inputs; and fusing them would copy a view of the fused tensor
        first = members[0].spec
        if any(i.rpartition(".")[0] != ids[0].rpartition(".")[0] or m.spec.kind != first.kind
               or m.spec.in_features != first.in_features or (m.bias is None) != (members[0].bias is None)
               for i, m in zip(ids, members)):
            return None
        spec = BaseLayerSpec(GROUP_SEPARATOR.join(ids), first.kind, first.in_features,
                             sum(m.spec.out_features for m in members), "", None if members[0].bias is None else "")
        owners = [self._fused_in.get(i) for i in ids]
        if all(owner is None for owner in owners):
            return self._fuse(ids, members, spec)
        owner = owners[0]
        if all(other is owner for other in owners):
            order = owner.spec.layer_id.split(GROUP_SEPARATOR)
            start = order.index(ids[0])
            if order[start:start + len(ids)] == ids:  # a run of the fused group: a view of its weight
                offset = sum(self.layers[i].spec.out_features for i in order[:start])
                out_dim = 0 if spec.kind == "linear" else 1
                return BaseLayer(spec, owner.weight.narrow(out_dim, offset, spec.out_features),
                                 None if owner.bias is None else owner.bias.narrow(0, offset, spec.out_features))
        return MemberLayers(spec, members)

    def _fuse(self, ids: list[str], members: list[BaseLayer], spec: BaseLayerSpec) -> BaseLayer:
        out_dim = 0 if spec.kind == "linear" else 1  # linear W: [out, in]; conv1d W: [in, out]
        weight = torch.cat([m.weight for m in members], dim=out_dim)
        bias = None if members[0].bias is None else torch.cat([m.bias for m in members])
        offset = 0
        for m in members:  # members now view the fused tensors
            width = m.spec.out_features
            m.weight = weight.narrow(out_dim, offset, width)
            m.bias = None if bias is None else bias.narrow(0, offset, width)
            offset += width
        group = BaseLayer(spec, weight, bias)
        self._fused_in.update(dict.fromkeys(ids, group))
        if weight.is_cuda:
            # The members' old tensors are free now, but PyTorch's allocator would keep their memory reserved
            # for this process: a copy of every fused weight (16 GiB for Llama-2-13B's q/k/v and gate/up),
            # lost to other processes. Hand it back (once per group; cudaFree waits for the device).
            torch.cuda.empty_cache()
        return group


@dataclass
class MemberLayers:
    """A group served member by member (its members are fused in another group already): the same math as a
    fused group, a GEMM per member, outputs side by side."""

    spec: BaseLayerSpec
    members: list[BaseLayer]

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        # x: [T, in] -> [T, sum of outs]
        return torch.cat([m.forward(x, with_bias) for m in self.members], dim=1)

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        # grad_out: [T, sum of outs] -> [T, in], the members' gradients summed
        pieces = grad_out.split([m.spec.out_features for m in self.members], dim=1)
        grad_in = self.members[0].backward(pieces[0])
        for member, piece in zip(self.members[1:], pieces[1:]):
            grad_in += member.backward(piece)
        return grad_in


@dataclass
class GatedMlp:
    """A gated MLP run whole (`partition.plan_gated_mlps`): y = down(act(gate(x)) * up(x)), x [T, hidden] -> y [T,
    hidden]. Gate and up run as their fused group (one GEMM). Stateless as every call: backward takes x beside the
    output's gradient, [T, 2 * hidden] = [x | g] -> grad_x [T, hidden], and recomputes gate and up (one GEMM more than
    the layers' backward calls, for one call instead of two and a fifth of their bytes)."""

    spec: BaseLayerSpec
    gate_up: BaseLayer | MemberLayers
    down: BaseLayer
    act: torch.nn.Module  # the model's own activation module (stateless)

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x): down's input [T, intermediate]."""
        gate, up = self.gate_up.forward(x).chunk(2, dim=1)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return self.down.forward(self.gated(x))

    def backward(self, x_and_grad: torch.Tensor) -> torch.Tensor:
        """[x | g] -> g_x: gate and up recomputed under autograd (the weights need none, so only what leads to x is
        kept), down's input's gradient g W_down taken straight (its forward is not run again)."""
        x, grad_out = x_and_grad.split([self.spec.in_features, self.spec.out_features], dim=1)
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (grad_x,) = torch.autograd.grad(self.gated(x), x, self.down.backward(grad_out))
        return grad_x


@dataclass
class DecoderTail:
    """What a decoder layer adds to the residual stream after its attention, run whole (`partition.
    plan_decoder_tails`): [h | a] [T, hidden + attention] -> d = o(a) + mlp(norm(h + o(a))) [T, hidden], where h is the
    residual stream plus the tenant's own o_proj delta and a is o_proj's input. The client adds h + d, as its decoder
    layer does. One call each way instead of two (o_proj, then the MLP); backward recomputes o, the norm, gate and up."""

    spec: BaseLayerSpec
    o_proj: BaseLayer
    norm: torch.nn.Module  # the model's own post-attention norm module, holding the base's weight
    mlp: GatedMlp

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        h, a = x.split([self.o_proj.spec.out_features, self.o_proj.spec.in_features], dim=1)
        o = self.o_proj.forward(a)
        return o + self.mlp.forward(self.norm(h + o))

    def backward(self, x_and_grad: torch.Tensor) -> torch.Tensor:
        """[h | a | g] -> [g_h | g_a]: with s = h + o(a), g_s comes from the norm and the MLP (recomputed under autograd,
        the only part that is not linear), g_h = g_s and g_a = (g + g_s) W_o, as autograd would sum them."""
        hidden, attention = self.o_proj.spec.out_features, self.o_proj.spec.in_features
        h, a, g = x_and_grad.split([hidden, attention, hidden], dim=1)
        with torch.enable_grad():
            s = (h + self.o_proj.forward(a)).requires_grad_()
            (grad_s,) = torch.autograd.grad(self.mlp.gated(self.norm(s)), s, self.mlp.down.backward(g))
        return torch.cat([grad_s, self.o_proj.backward(g + grad_s)], dim=1)
