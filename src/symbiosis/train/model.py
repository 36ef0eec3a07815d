"""The training model: the base model over the executor's own weights (like the engine's), whose base layers add,
for the rows of each adapter's datums, that adapter's LoRA, with autograd reaching the adapters' matrices.

One pass runs every tenant's datums together (a padded batch [B, L], datums of one adapter in a row): the base GEMMs
once over all rows, each adapter's LoRA over its datums only. Each adapter's loss is a sum over its own datums and
its matrices meet no other adapter's rows, so the gradient of the total is, for each adapter, the gradient of
its own loss: exactly what training it alone computes.

The LoRA of a layer is two batched products over the datums, whatever the number of adapters:
    y[d] += (x[d] @ A[d]^T) @ (scale[d] * B[d])^T        x [B, L, in], A [B, R, in], B [B, out, R]
where A[d], B[d] are datum d's adapter's matrices (stacked once per layer and pass, ranks padded to the largest
with zeros; zero for an adapter that does not train the layer): a few launches per layer instead of a pair per
adapter. The products run in the activations' dtype (bfloat16 on a GPU: mixed precision, as PEFT under autocast;
the matrices, their gradients and AdamW's moments stay float32), the second one adding into the base's output
(baddbmm): in float32 the LoRA's casts, scaling and addition moved ~10x the bytes of the products themselves and
took a third of a pass's GPU time (H100, 32 tenants). A layer with a LoRA is one autograd node (`_LoraLinear`),
whose backward adds every datum's gradients into its adapter's flat gradient in one multi-tensor launch, or, where
the pass's adapters share one layout (their stacks views of one gathered buffer [B, F]), into the pass's gathered
gradient [B, F], added into each adapter's once the backward is done (`_scatter`). Nothing in that form of a pass
depends on which adapters it trains, so its decoder can be replayed as CUDA graphs (train/graphs.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from symbiosis.executor.store import BaseLayer
from symbiosis.train.lora import HostedLora, TargetLayer


@dataclass
class PassState:
    """What the decoder's layers share for a pass: `begin` gives every one its stacks (`TrainLinear.lora`)."""
    linears: list["TrainLinear"] = field(default_factory=list)  # the decoder's, not the head's
    anchors: dict = field(default_factory=dict)  # device -> a leaf that requires grad (_LoraLinear)
    fused_norms: int = 0  # the model's RMSNorms that run by torch's rms_norm (_fuse_norms)
    devices: list[torch.device] = field(default_factory=list)  # those the decoder's layers span (_place)
    moved: dict = field(default_factory=dict)  # (id, device) -> (tensor, its copy there), for a pass (hop)
    # a pass's gathered gradients [B, F] and the datums' adapters, which `finish` adds them into
    gradients: tuple[torch.Tensor, list[HostedLora]] | None = None

    def anchor(self, device: torch.device) -> torch.Tensor:
        if device not in self.anchors:
            self.anchors[device] = torch.zeros((), device=device, requires_grad=True)
        return self.anchors[device]

    def begin(self, datums: list[HostedLora | None], dtype: torch.dtype) -> None:
        """`datums[d]`: datum d's adapter (None: the base model alone); `dtype`: the activations' (the LoRA's
        products run in it)."""
        gathered = _gathered(datums, dtype)
        scales = _scales(datums, dtype)
        if gathered is not None:
            grads = torch.zeros(gathered.shape, dtype=datums[0].flat.dtype, device=gathered.device) \
                if torch.is_grad_enabled() else None
            self.begin_gathered(gathered, scales, grads, datums[0].spec.rank, datums[0]._slices)
            self.gradients = None if grads is None else (grads, datums)
            return
        self._set_stacks(scales, lambda linear, on_device: linear.stacks(datums, dtype, on_device))

    def begin_gathered(self, gathered: torch.Tensor, scales: torch.Tensor, grads: torch.Tensor | None, rank: int,
                       slices: dict[str, tuple[slice, slice]]) -> None:
        """Every layer's stacks as views of `gathered` [B, F] (the flat buffers of B datums' adapters of one layout,
        in the activations' dtype: `rank`, and `slices`, layer id -> its A's and B's elements) with `scales`
        [B, 1, 1] (each datum's LoRA scale), their gradients added into `grads` [B, F] (the adapters' dtype), if
        given. Nothing here depends on which adapters they are: a CUDA graph of the pass (train/graphs.py) replays
        it over other adapters of the layout."""
        self._set_stacks(scales, lambda linear, on_device: linear.gathered_stacks(gathered, on_device, grads, rank,
                                                                                  slices))

    def _set_stacks(self, scales: torch.Tensor, stacks_of) -> None:
        """Each layer's stacks for the pass: `stacks_of(linear, scales on its device)`, the scales [B, 1, 1] copied
        once a device."""
        on_device: dict[torch.device, torch.Tensor] = {}
        for linear in self.linears:
            device = linear.device
            if device not in on_device:
                on_device[device] = _on(scales, device)
            linear.whole = linear.lora = stacks_of(linear, on_device[device])

    def select(self, rows: slice) -> None:
        """Run the next forward over the pass's datums `rows` only (a micro-batch: `Trainer.run`)."""
        for linear in self.linears:
            linear.lora = None if linear.whole is None else linear.whole.of(rows)

    def finish(self) -> None:
        """After the pass's backward: the gradients held on other GPUs than the adapters' into their matrices, and
        the pass's gathered gradients into each adapter's (`gradients`)."""
        for linear in self.linears:
            if linear.whole is not None:
                linear.whole.flush()
        if self.gradients is not None:
            _scatter(*self.gradients)

    def end(self) -> None:
        for linear in self.linears:
            linear.whole = linear.lora = None
        self.moved.clear()
        self.gradients = None

    def hop(self, value, device: torch.device):
        """`value` (a tensor, or a tuple of them) on `device` by `hop`, each tensor once a pass (the rotary
        embeddings' (cos, sin), passed to every layer of a micro-batch, cross once, not once a layer)."""
        if isinstance(value, tuple):
            return tuple(self.hop(v, device) for v in value)
        if not isinstance(value, torch.Tensor) or value.device == device:
            return value
        key = (id(value), device)
        if key not in self.moved:  # (the source is kept with its copy: its id is not reused within the pass)
            self.moved[key] = (value, hop(value, device))
        return self.moved[key][1]


@dataclass
class _Stacks:
    """One layer's LoRA for a pass: A [B, R, in] and scale * B [B, out, R] of each datum's adapter, in the
    activations' dtype (ranks padded with zeros; zeros for a datum whose adapter does not train the layer);
    `rows[d]`: the index of datum d's adapter among `a_matrices` / `b_matrices` (its float32 leaves), or None.
    Gathered stacks (`PassState.begin_gathered`) have neither: their gradients go to `grads`, the pass's gathered
    gradient [B, F] and this layer's A's and B's elements of it."""
    a: torch.Tensor
    scaled_b: torch.Tensor
    scales: torch.Tensor
    anchor: torch.Tensor
    rows: list[int | None] | None = None
    a_matrices: list[torch.Tensor] = field(default_factory=list)
    b_matrices: list[torch.Tensor] = field(default_factory=list)
    grads: tuple[torch.Tensor, slice, slice] | None = None
    whole: "_Stacks | None" = None  # the pass's stacks whose rows first.. these are (of)
    first: int = 0
    held: list[torch.Tensor] | None = None  # the pass's gradients of A and B stacks, while on another GPU (flush)

    def of(self, rows: slice) -> "_Stacks | None":
        """These stacks for datums `rows` only (views), or None if none of them has an adapter here."""
        if self.rows is not None and all(row is None for row in self.rows[rows]):
            return None
        return _Stacks(self.a[rows], self.scaled_b[rows], self.scales[rows], self.anchor,
                       None if self.rows is None else self.rows[rows], self.a_matrices, self.b_matrices, self.grads,
                       whole=self, first=rows.start or 0)

    @property
    def home(self) -> torch.device:
        """Where the gradients go: the pass's gathered gradient's device, or the adapters' matrices'."""
        return self.grads[0].device if self.grads is not None else self.a_matrices[0].device

    def accumulate(self, grad_a: torch.Tensor, grad_b: torch.Tensor) -> None:
        """Every adapter's gradients (the sum of its rows') into its matrices' `.grad`s, views of its flat gradient:
        one multi-tensor launch for each of A and B. On another GPU than the matrices (a base over several: the
        adapters live on the first), they wait in the pass's stacks until it ends (`flush`): a copy to the
        adapters' GPU in the middle of the backward would tie the two GPUs' queues together. Gathered stacks add
        them into the pass's gathered gradient, a launch for each of A and B."""
        if grad_a.device != self.home:
            whole = self.whole or self
            if whole.held is None:
                whole.held = [torch.zeros_like(whole.a, dtype=grad_a.dtype),
                              torch.zeros_like(whole.scaled_b, dtype=grad_b.dtype)]
            rows = slice(self.first, self.first + grad_a.shape[0])
            whole.held[0][rows] += grad_a
            whole.held[1][rows] += grad_b
            return
        if self.grads is not None:
            buffer, a_elements, b_elements = self.grads
            rows = slice(self.first, self.first + grad_a.shape[0])
            buffer[rows, a_elements].view(grad_a.shape).add_(grad_a)
            buffer[rows, b_elements].view(grad_b.shape).add_(grad_b)
            return
        for grad, matrices in ((grad_a, self.a_matrices), (grad_b, self.b_matrices)):
            # contiguous: pieces whose strides differ from the gradients' they add into take foreach's per-tensor
            # path (a launch per matrix)
            grad = grad.to(matrices[0].dtype, memory_format=torch.contiguous_format)
            pieces: dict[int, torch.Tensor] = {}
            if None not in self.rows and len(set(self.rows)) == len(self.rows) and \
                    all(m.shape == grad.shape[1:] for m in matrices):
                pieces = dict(zip(self.rows, grad.unbind(0)))  # row d is matrix rows[d], whole
            else:
                for d, row in enumerate(self.rows):
                    if row is not None:  # a matrix in several rows (an adapter's datums): the sum of their gradients
                        piece = grad[(d, *_extent(matrices[row]))]
                        pieces[row] = piece if row not in pieces else pieces[row] + piece
            torch._foreach_add_([matrices[row].grad for row in pieces], list(pieces.values()))

    def flush(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            self.accumulate(*(hop(grad, self.home) for grad in held))


class TrainLinear(nn.Module):
    """y = x W^T + b with the executor's W (frozen: autograd computes only grad_x = g W), plus, for each datum's
    rows, its adapter's LoRA (the module's docstring)."""

    def __init__(self, base: BaseLayer, state: PassState, device: torch.device):
        super().__init__()
        self.base, self.state = base, state
        self.device = device  # where `base` takes its input and gives its output
        self.layer_id = base.spec.layer_id
        self.whole: _Stacks | None = None  # the pass's (PassState.begin)
        self.lora: _Stacks | None = None  # the forward's: the pass's, or a micro-batch's rows of it (select)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, L, in]: datum d's tokens in row d
        if self.lora is None:
            return self.base.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)  # [B, L, out]
        return _LoraLinear.apply(x, self.lora.anchor, self.base, self.lora)

    def stacks(self, datums: list[HostedLora | None], dtype: torch.dtype, scales: torch.Tensor) -> _Stacks | None:
        """This layer's LoRA for the datums' adapters, or None if no datum's adapter trains it."""
        adapters: dict[int, tuple[int, HostedLora]] = {}  # id -> (index among the layer's adapters, adapter)
        for lora in datums:
            if lora is not None and self.layer_id in lora.layers and id(lora) not in adapters:
                adapters[id(lora)] = (len(adapters), lora)
        if not adapters:
            return None
        rank = max(lora.spec.rank for _, lora in adapters.values())
        rows = [adapters[id(lora)][0] if id(lora) in adapters else None for lora in datums]
        spec = self.base.spec
        a_matrices = [lora.layers[self.layer_id][0] for _, lora in adapters.values()]
        b_matrices = [lora.layers[self.layer_id][1] for _, lora in adapters.values()]
        device = scales.device  # this layer's (the adapters' matrices may live on another GPU: `_place`)
        with torch.no_grad():  # their gradients come from _LoraLinear's backward
            a = _stack(rows, (rank, spec.in_features), dtype, a_matrices).to(device, non_blocking=True)
            scaled_b = _stack(rows, (spec.out_features, rank), dtype, b_matrices).to(device, non_blocking=True)
            scaled_b.mul_(scales)
        return _Stacks(a, scaled_b, scales, self.state.anchor(device), rows, a_matrices, b_matrices)

    def gathered_stacks(self, gathered: torch.Tensor, scales: torch.Tensor, grads: torch.Tensor | None, rank: int,
                        slices: dict[str, tuple[slice, slice]]) -> _Stacks | None:
        """This layer's LoRA as views of the pass's gathered buffer [B, F] (`PassState.begin_gathered`), or None
        if adapters of that layout do not train it."""
        if self.layer_id not in slices:
            return None
        a_elements, b_elements = slices[self.layer_id]
        spec, rows, device = self.base.spec, gathered.shape[0], scales.device
        with torch.no_grad():
            a = gathered[:, a_elements].view(rows, rank, spec.in_features).to(device, non_blocking=True)
            scaled_b = gathered[:, b_elements].view(rows, spec.out_features, rank).to(
                device, non_blocking=True) * scales
        return _Stacks(a, scaled_b, scales, self.state.anchor(device),
                       grads=None if grads is None else (grads, a_elements, b_elements))

    def project(self, tokens: torch.Tensor, rows) -> torch.Tensor:
        """tokens [T, in] -> [T, out], `rows` covering 0..T (or none: no adapter anywhere)."""
        y = self.base.forward(tokens)
        if not any(lora is not None and self.layer_id in lora.layers for _, _, lora in rows):
            return y
        pieces = []
        for first, end, lora in rows:
            piece = y[first:end]
            if lora is not None and self.layer_id in lora.layers:
                a, b = (m.to(tokens.device) for m in lora.layers[self.layer_id])
                delta = (tokens[first:end].to(a.dtype) @ a.T) @ b.T * lora.scale  # [rows, out]
                piece = piece + delta.to(y.dtype)
            pieces.append(piece)
        return torch.cat(pieces)


class _LoraLinear(torch.autograd.Function):
    """y = x W^T (+ bias) + (x A^T) (s B)^T over the pass's datums, x [B, L, in], as one autograd node: its backward
    gives grad_x = g W + (g (s B)) A and adds each adapter's gradients, (g (s B))^T x for A and s g^T (x A^T) for
    B, into its flat gradient (`_Stacks.accumulate`). Autograd's own graph of these products was ~8 nodes and
    ~15 operators a layer (products, transposes, the scaling, casts, an accumulation per matrix), the host's time
    that bounds a small pass. `anchor` (a leaf that requires grad) makes the backward run where x needs none (the
    first layer's input: the frozen embeddings')."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, base: BaseLayer, lora: _Stacks):
        y = base.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)  # [B, L, out]
        u = torch.bmm(x, lora.a.transpose(1, 2))  # [B, L, R]
        ctx.save_for_backward(x, u)
        ctx.base, ctx.lora = base, lora
        return torch.baddbmm(y, u, lora.scaled_b.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, u = ctx.saved_tensors
        base, lora = ctx.base, ctx.lora
        grad_scaled = torch.bmm(grad, lora.scaled_b)  # g (s B) [B, L, R]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = base.backward(grad.reshape(-1, grad.shape[-1])).view(x.shape)
            grad_x = torch.baddbmm(grad_x, grad_scaled, lora.a)
        lora.accumulate(torch.bmm(grad_scaled.transpose(1, 2), x),  # [B, R, in]
                        torch.bmm(grad.transpose(1, 2), u).mul_(lora.scales))  # [B, out, R]
        return grad_x, None, None, None


def one_layout(datums: list[HostedLora | None]) -> bool:
    """Whether every datum has an adapter and all share one layout (`HostedLora.layout`: rank, layers, dtype)."""
    return bool(datums) and all(lora is not None and lora.layout == datums[0].layout for lora in datums)


def _gathered(datums: list[HostedLora | None], dtype: torch.dtype) -> torch.Tensor | None:
    """Every datum's adapter's flat buffer, [B, F] in `dtype` (a copy: a snapshot of the weights for the pass),
    when every datum has an adapter and all share one layout (`HostedLora.layout`: rank, layers, dtype); else
    None. A layer's stacks are then views of it: one stack and cast a pass, where stacking each layer's matrices
    was two stacks of B matrices and two casts a layer (~8 ms of host time a pass of 32 tenants' q/k/v/o on 16
    layers, with the GPU idle, as a pass begins)."""
    if not one_layout(datums):
        return None
    unique = list({id(lora): lora for lora in datums}.values())
    with torch.no_grad():
        flats = torch.stack([lora.flat for lora in unique])  # [U, F]
        if len(unique) < len(datums):  # an adapter with several datums: its row for each
            index = {id(lora): i for i, lora in enumerate(unique)}
            rows = torch.tensor([index[id(lora)] for lora in datums])
            flats = flats[_pinned(rows, flats.device).to(flats.device, non_blocking=True)]
        return flats.to(dtype)


def _scales(datums: list[HostedLora | None], dtype: torch.dtype) -> torch.Tensor:
    """Each datum's LoRA scale (0 without one) [B, 1, 1], on the host."""
    return torch.tensor([0.0 if lora is None else lora.scale for lora in datums], dtype=dtype).view(-1, 1, 1)


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, once a pass and device (a layer's copy of it would be a wait for the GPU at every
    layer); through pinned memory, so the copy is queued without waiting for the GPU (from pageable memory it may
    drain it first)."""
    if tensor.device.type != "cpu":
        return tensor.to(device, non_blocking=True)
    return _pinned(tensor, device).to(device, non_blocking=True)


def _scatter(grads: torch.Tensor, datums: list[HostedLora]) -> None:
    """The pass's gathered gradients [B, F] (row d: datum d's adapter's) added into each adapter's flat gradient:
    one multi-tensor launch (an adapter with several datums: the sum of their rows)."""
    rows: dict[int, tuple[HostedLora, list[int]]] = {}  # id -> (adapter, its datums)
    for d, lora in enumerate(datums):
        rows.setdefault(id(lora), (lora, []))[1].append(d)
    pieces = []
    for _, indices in rows.values():
        if len(indices) == 1:
            pieces.append(grads[indices[0]])
        elif indices == list(range(indices[0], indices[-1] + 1)):
            pieces.append(grads[indices[0]:indices[-1] + 1].sum(0))
        else:
            pieces.append(grads[torch.tensor(indices, device=grads.device)].sum(0))
    torch._foreach_add_([lora.flat_grad for lora, _ in rows.values()], pieces)


def _stack(rows: list[int | None], shape: tuple[int, int], dtype: torch.dtype,
           matrices: list[torch.Tensor]) -> torch.Tensor:
    """[B, *shape] in `dtype`: row d is matrices[rows[d]] padded with zeros to `shape` (ranks differ), or zeros where
    rows[d] is None."""
    if None not in rows and all(m.shape == shape for m in matrices):
        return torch.stack([matrices[row] for row in rows]).to(dtype)
    out = matrices[0].new_zeros((len(rows), *shape), dtype=dtype)
    for d, row in enumerate(rows):
        if row is not None:
            out[(d, *_extent(matrices[row]))] = matrices[row]
    return out


def _extent(matrix: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in matrix.shape)


def _pinned(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if torch.device(device).type == "cpu" else tensor.pin_memory()


def build(model_path, executor):
    """(model, state, targets): the training model of `model_path` over `executor` (in-process), its pass state,
    and the base layers an adapter may train, each with its part (attn: the attention modules' layers; mlp: the
    other layers of the decoder; unembed: the output head)."""
    import symbiosis

    model = symbiosis.from_pretrained(model_path, executor, device=executor.device, name="trainer")
    state = PassState()
    head = model.get_output_embeddings()
    attention = [m for m in model.modules() if hasattr(m, "layer_idx")]
    in_attention = {id(inner) for m in attention for inner in m.modules()}
    targets = []
    for name, module in list(model.named_modules()):
        layer_id = getattr(module, "layer_id", None)
        if layer_id is None or not hasattr(module, "session"):
            continue
        base = executor.weights.layers[layer_id]
        if isinstance(getattr(base, "layer", None), BaseLayer):  # a peer's (executor/peers.py): run it there
            base = base.layer
        device = base.weight.device if isinstance(base, BaseLayer) else torch.device(executor.device)
        part = "unembed" if module is head else "attn" if id(module) in in_attention else "mlp"
        linear = TrainLinear(base, state, device)
        model.set_submodule(name, linear)
        if part != "unembed":  # the head runs by `project`, a datum's rows at a time
            state.linears.append(linear)
        targets.append(TargetLayer(name, layer_id, part, base.spec.in_features, base.spec.out_features))
    for name, module in model.named_modules():  # a MoE layer's experts: the MLP part, refused by HostedLora
        for projection, group_id in getattr(module, "symbiosis_expert_groups", {}).items():
            spec = executor.weights.layers[f"{group_id}.0"].spec
            targets.append(TargetLayer(f"{name}.{projection}", group_id, "mlp", spec.in_features, spec.out_features,
                                       experts=len(module.symbiosis_experts[projection])))
    model.requires_grad_(False)  # the client's own tensors (embeddings, norms) are the base's too: frozen
    state.devices = _place(model, torch.device(executor.device), state)
    state.fused_norms = _fuse_norms(model)
    return model.train(False), state, targets


def _place(model, front: torch.device, state: PassState) -> list[torch.device]:
    """Each decoder layer where its base layers are (a base over several GPUs, executor/peers.py: whole layers a
    GPU), and the final norm with the last: a layer's activations, norms and attention then stay on its GPU, and
    only the hidden states [B, L, H] cross between GPUs, once at each change of GPU each way. Returns the devices
    the decoder's layers span (Trainer.run pipelines micro-batches over several)."""
    decoder = model.get_decoder()
    devices = []
    for layer in decoder.layers:
        linears = [m for m in layer.modules() if isinstance(m, TrainLinear)]
        device = linears[0].device if linears and len({m.device for m in linears}) == 1 else front
        devices.append(device)
        if device != front:
            _move_to(layer, device, state)
    if devices and devices[-1] != front:
        _move_to(decoder.norm, devices[-1], state)
    return list(dict.fromkeys(devices))


def _move_to(module: nn.Module, device: torch.device, state: PassState) -> None:
    """`module` on `device`, its inputs (tensors, in tuples too: the rotary embeddings' (cos, sin)) moved there as it
    is called (`PassState.hop`)."""
    module.to(device)
    module.register_forward_pre_hook(
        lambda _, args, kwargs: (state.hop(args, device), {k: state.hop(v, device) for k, v in kwargs.items()}),
        with_kwargs=True)


def hop(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, differentiably, its copy between GPUs waiting for the work that made it and nothing
    else. (torch's own copy between GPUs, `.to`, makes each GPU's stream wait for all work queued so far on the
    other's, both ways: a pass pipelined over GPUs would run in lockstep, each GPU waiting for the other's last
    queued micro-batch at every crossing.)"""
    return _Hop.apply(tensor, torch.device(device))


class _Hop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, device: torch.device):
        ctx.source = tensor.device
        # where the gradient will be used: the stream the source's layers ran on, which autograd runs their backward
        # on too. (The backward of this node runs on a worker thread of the gradient's GPU, whose current stream
        # for the source's GPU is that GPU's default stream, not the pass's.)
        ctx.source_stream = torch.cuda.current_stream(tensor.device) if tensor.device.type == "cuda" else None
        return _copy(tensor, device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _copy(grad, ctx.source, ctx.source_stream), None


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy(tensor: torch.Tensor, device: torch.device, compute: torch.cuda.Stream | None = None) -> torch.Tensor:
    """`tensor` on `device`, ready for the work queued on `compute` (device's current stream by default) from now
    on, and kept from reuse by the allocator until that stream is past it."""
    if tensor.device == device or tensor.device.type != "cuda" or device.type != "cuda":
        return tensor.to(device)
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    copies, compute = _COPY_STREAMS[device], compute or torch.cuda.current_stream(device)
    with torch.cuda.stream(copies):  # the destination's side of the copy's two-way barrier: this stream's alone
        out = tensor.to(device, non_blocking=True)  # (runs on the source's current stream, after its producer)
    compute.wait_stream(copies)
    out.record_stream(compute)  # (allocated on `copies`, used on `compute`)
    return out


def _fuse_norms(model) -> int:
    """Every RMSNorm of `model` that is Llama's (weight * x / rms(x), normalised in float32: Llama's, Qwen's,
    Mistral's; found by comparing outputs on a random input, not by names, so Gemma's 1 + weight is left alone)
    runs by torch's rms_norm (`_rms_norm`). Returns how many."""
    generator = torch.Generator().manual_seed(0)
    fused = 0
    for module in model.modules():
        weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
        if list(module.children()) or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or \
                not isinstance(eps, float):
            continue
        probe = torch.randn(4, weight.shape[0], generator=generator).to(weight.device, weight.dtype)
        with torch.no_grad():  # (up to half precision's rounding)
            theirs, ours = module(probe).float(), _rms_norm(module, probe).float()
        if (theirs - ours).norm() <= 1e-2 * theirs.norm():
            module.forward = functools.partial(_rms_norm, module)
            fused += 1
    return fused


def _rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm through torch's rms_norm, its weight inside: on a GPU one kernel each way over the activations
    in their own dtype (statistics and products in float32, one rounding at the end), where the module's own code
    is ~6 forward and ~10 backward kernels over float32 copies of them, 33 norms a pass of Llama-3.2-1B. In half
    precision that rounds once where the module rounds twice (before and after the weight: at most an ulp of the
    output apart); where the activations are float32 or float64, the module's own order of operations, bit for
    bit on a CPU."""
    if x.dtype in (torch.float16, torch.bfloat16) and module.weight.dtype == x.dtype:
        return F.rms_norm(x, module.weight.shape, module.weight, module.variance_epsilon)
    return module.weight * F.rms_norm(x.float(), module.weight.shape, None, module.variance_epsilon).to(x.dtype)
