"""A frozen output head's loss gradient over a chunk of logits, in two passes over the logits' own memory.

For logits z [C, V] (rows: tokens; the head's output, half precision on a GPU), targets t [C, K] and per-target
weights c [C, K] (c = d loss / d log p(t), which needs the log-sum-exp first):

    lse[i]  = log sum_v exp(z[i, v])                                         # logsumexp_rows
    z[i, :] <- sum_k c[i, k] onehot(t[i, k]) - (sum_k c[i, k]) softmax(z[i])  # softmax_grad_ (in place)

which is d loss / d z, the input of the head's backward GEMM. Arithmetic in float32 at least (the log-softmax of
a half-precision head is always made in float32), rounded once to z's dtype on the store.

Why kernels: in torch the same takes a float32 copy of the logits and ~8 passes over it (the cast, the max, the
exponentials and sums of logsumexp, the subtraction, exp, the scaling, the cast back): ~60 bytes moved per logit,
~60 GB a pass of 32 tenants' 256 tokens through Llama-3's 128,256-word head. The kernels read the half-precision
logits twice and write them once (6 bytes per logit), and need no second [C, V] tensor.

CUDA tensors of float16/bfloat16/float32 run the Triton kernels; anything else (the CPU, float64, no Triton) runs
the torch reference below, which is the oracle of the kernels' tests and the path of the CPU's exactness tests.
"""

from __future__ import annotations

import torch

try:  # the kernels need Triton and a GPU; without them every call takes the reference path
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LSE_BLOCK = 4096  # columns a program reads at a time in the log-sum-exp's loop over a row
GRAD_BLOCK = 2048  # columns of one program of the gradient's grid


def logsumexp_rows(z: torch.Tensor) -> torch.Tensor:
    """log sum exp of each row of z [C, V]: [C], in z's dtype promoted to at least float32."""
    _check(z)
    if not _use_triton(z):
        return torch.logsumexp(z.to(_promoted(z)), dim=-1)
    lse = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    if z.shape[0]:
        _lse_kernel[(z.shape[0],)](z, lse, z.shape[1], z.stride(0), BLOCK=LSE_BLOCK, num_warps=8)
    return lse


def softmax_grad_(z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """z [C, V] <- sum_k weights[:, k] onehot(targets[:, k]) - weights.sum(1) softmax(z), in place; returns z.
    lse [C]: `logsumexp_rows(z)`; targets [C, K] int64 in 0..V-1; weights [C, K]."""
    _check(z)
    if targets.shape != weights.shape or targets.dim() != 2 or targets.shape[0] != z.shape[0] or \
            lse.shape != (z.shape[0],):
        raise ValueError(f"expected targets and weights [{z.shape[0]}, K] and lse [{z.shape[0]}], got "
                         f"{tuple(targets.shape)}, {tuple(weights.shape)} and {tuple(lse.shape)}")
    if not _use_triton(z):
        work = z.to(_promoted(z))  # (z itself when it is float32 or float64)
        weights = weights.to(work.dtype)
        work.sub_(lse.to(work.dtype)[:, None]).exp_().mul_(-weights.sum(1, keepdim=True))
        work.scatter_add_(1, targets, weights)
        return z if work is z else z.copy_(work)
    if z.numel():
        grid = (z.shape[0], triton.cdiv(z.shape[1], GRAD_BLOCK))
        _grad_kernel[grid](z, lse.to(torch.float32).contiguous(), targets.contiguous(),
                           weights.to(torch.float32).contiguous(), z.shape[1], z.stride(0), K=targets.shape[1],
                           BLOCK=GRAD_BLOCK, num_warps=4)
    return z


def _check(z: torch.Tensor) -> None:
    if z.dim() != 2 or (z.shape[0] and z.stride(1) != 1):
        raise ValueError(f"expected logits [C, V] with contiguous rows, got shape {tuple(z.shape)}, strides "
                         f"{z.stride()}")


def _promoted(z: torch.Tensor) -> torch.dtype:
    return torch.promote_types(z.dtype, torch.float32)


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and t.dtype in TRITON_DTYPES


if triton is not None:
    @triton.jit
    def _lse_kernel(z_ptr, lse_ptr, V, stride, BLOCK: tl.constexpr):
        # one program a row: a running max and sum of exp per lane (online softmax), folded at the end
        row = z_ptr + tl.program_id(0).to(tl.int64) * stride
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane with nothing yet: no inf - inf
            s = s * tl.exp(m - shift) + tl.exp(x - shift)
            m = m_new
        top = tl.max(m, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # a row of -inf: log(0) = -inf, as torch.logsumexp
        total = tl.sum(s * tl.exp(m - top), axis=0)
        tl.store(lse_ptr + tl.program_id(0), top + tl.log(total))

    @triton.jit
    def _grad_kernel(z_ptr, lse_ptr, targets_ptr, weights_ptr, V, stride, K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < V
        pointers = z_ptr + row.to(tl.int64) * stride + cols
        x = tl.load(pointers, mask=inside, other=0.0).to(tl.float32)
        grad = tl.zeros([BLOCK], tl.float32)
        total = 0.0
        for k in tl.static_range(K):
            target = tl.load(targets_ptr + row * K + k)
            weight = tl.load(weights_ptr + row * K + k)
            total += weight
            grad += tl.where(cols == target, weight, 0.0)
        grad = grad - total * tl.exp(x - tl.load(lse_ptr + row))
        tl.store(pointers, grad.to(z_ptr.dtype.element_ty), mask=inside)
