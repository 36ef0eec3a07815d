"""A frozen head's loss gradient: the torch reference against autograd of the log-softmax (float64, CPU), and the
Triton kernels against the reference (GPU)."""

from __future__ import annotations

import pytest
import torch

from symbiosis.kernels.softmax_grad import logsumexp_rows, softmax_grad_


def _case(rows: int, vocab: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 4).to(dtype).to(device)
    targets = torch.randint(0, vocab, (rows, k), generator=generator)
    if k > 1:
        targets[:, 1] = targets[:, 0]  # a target twice in a row: both weights land on it
    weights = torch.randn(rows, k, generator=generator, dtype=torch.float64)
    return z, targets.to(device), weights.to(device)


def _autograd(z: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """d/dz of sum_i,k weights[i, k] log_softmax(z[i])[targets[i, k]], in float64."""
    z = z.detach().to(torch.float64).requires_grad_()
    (torch.log_softmax(z, dim=-1).gather(1, targets) * weights.to(torch.float64)).sum().backward()
    return z.grad


@pytest.mark.parametrize("k", [1, 3])
def test_the_reference_is_the_gradient_of_the_weighted_log_softmax(k):
    z, targets, weights = _case(5, 37, k, torch.float64)
    expected = _autograd(z, targets, weights)
    lse = logsumexp_rows(z)
    torch.testing.assert_close(lse, torch.logsumexp(z, dim=-1), rtol=0, atol=0)
    grad = softmax_grad_(z, lse, targets, weights)
    assert grad is z  # in the logits' own memory
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_half_precision_logits_are_computed_in_float32_and_rounded_once():
    z, targets, weights = _case(4, 50, 1, torch.bfloat16)
    lse = logsumexp_rows(z)
    assert lse.dtype == torch.float32
    wide = z.float()
    expected = wide.sub(lse[:, None]).exp().mul(-weights.float().sum(1, keepdim=True))
    expected = expected.scatter_add(1, targets, weights.float()).to(torch.bfloat16)
    assert torch.equal(softmax_grad_(z, lse, targets, weights), expected)


def test_shapes_that_do_not_match_are_refused():
    z, targets, weights = _case(3, 10, 2, torch.float32)
    with pytest.raises(ValueError, match="targets and weights"):
        softmax_grad_(z, logsumexp_rows(z), targets[:, :1], weights)
    with pytest.raises(ValueError, match="contiguous rows"):
        logsumexp_rows(z.t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab, k", [(128_256, 1), (1_000, 3), (4_096, 1)])
def test_the_kernels_follow_the_reference(dtype, vocab, k):
    """Llama-3's vocabulary (not a multiple of the blocks), a small one with repeated targets, one exactly a block;
    a row of masked (-inf) entries beside finite ones."""
    z, targets, weights = _case(67, vocab, k, dtype, "cuda")
    z[3, : vocab // 2] = float("-inf")
    original = z.cpu()
    reference_z = original.clone()  # (softmax_grad_ writes the gradient over its logits)
    lse = logsumexp_rows(z)
    expected_lse = logsumexp_rows(reference_z)
    torch.testing.assert_close(lse.cpu(), expected_lse, rtol=1e-6, atol=1e-6)
    grad = softmax_grad_(z, lse, targets, weights)
    expected = softmax_grad_(reference_z, expected_lse, targets.cpu(), weights.cpu())
    assert grad.dtype == dtype and grad.data_ptr() == z.data_ptr()
    # the two differ only where float32's rounding of exp(z - lse) crosses a rounding boundary of `dtype`
    tolerance = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(grad.cpu().double(), expected.double(), rtol=tolerance, atol=1e-7)
    # and both are the gradient, up to that rounding
    exact = _autograd(original.double(), targets.cpu(), weights.cpu())
    torch.testing.assert_close(grad.cpu().double(), exact, rtol=tolerance, atol=1e-3 if dtype != torch.float32 else 1e-6)
