"""SwiGLU's product silu(gate) * up (Llama's, Qwen's, Mistral's MLP), forward and backward in one Triton kernel each.

Not used by the hosted training pass: on an H100 it is 1.4x torch's five kernels alone ([8,192, 8,192] bfloat16
forward and backward, 0.64 against 0.90 ms), but the 32-tenant pass it was wired into measured 113.8-117.3 ms of GPU
time against 111.1-111.2 without it, side by side (benchmarks/results/h100-2026-11-27j/silu_ab_*.log), which is not
explained yet; at 256 rows it is slower (0.38 against 0.25 ms: launch-bound).

In torch the forward is two kernels (silu, then the product: the silu's output written and read back) and the
backward three (two products and silu's backward), five passes over tensors of [tokens, intermediate] (Llama-3.2-1B:
8,192 x 8,192 a 32-tenant pass, 134 MB each in bfloat16) and five launches a layer. Here the forward reads gate
and up and writes the product; the backward reads the gradient, gate and up and writes both gradients, keeping
nothing but gate and up for it. Arithmetic in float32, rounded once on the store (torch rounds silu's output
before the product).

CUDA tensors of float16/bfloat16/float32 run the kernels; anything else (the CPU, float64, no Triton) runs
`F.silu(gate) * up`, which is the oracle of the kernels' tests and the path of the CPU's exactness tests.

    y = silu(g) u = g sigmoid(g) u
    dy/du = silu(g)
    dy/dg = u sigmoid(g) (1 + g (1 - sigmoid(g)))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # the kernels need Triton and a GPU (or Triton's interpreter); without them the torch ops run
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 2048  # elements a program


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, differentiable in both; gate and up of one shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"expected gate and up of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} and "
                         f"{tuple(up.shape)} {up.dtype}")
    if not _use_triton(gate):
        return F.silu(gate) * up
    return _SiluMul.apply(gate, up)


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and t.dtype in TRITON_DTYPES


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        if out.numel():
            _forward[(triton.cdiv(out.numel(), BLOCK),)](gate, up, out, out.numel(), BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        if grad.numel():
            _backward[(triton.cdiv(grad.numel(), BLOCK),)](grad, gate, up, grad_gate, grad_up, grad.numel(),
                                                             BLOCK=BLOCK, num_warps=4)
        return grad_gate, grad_up


if triton is not None:
    @triton.jit
    def _forward(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        g = tl.load(gate_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _backward(grad_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        dy = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        tl.store(grad_up_ptr + offsets, (dy * g * sig).to(grad_up_ptr.dtype.element_ty), mask=inside)
        grad_g = dy * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(grad_gate_ptr + offsets, grad_g.to(grad_gate_ptr.dtype.element_ty), mask=inside)
