"""SwiGLU's product: the reference against float64 autograd and the formulas the kernels use (CPU), and the Triton
kernels against float64 (GPU, or the CPU under Triton's interpreter: `TRITON_INTERPRET=1` with Triton installed)."""

from __future__ import annotations

import os

import pytest
import torch

from symbiosis.kernels import silu_mul as module
from symbiosis.kernels.silu_mul import silu_mul

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and module.triton is not None


def _case(shape, dtype, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    gate, up, grad = ((torch.randn(shape, generator=generator, dtype=torch.float64) * 3).to(dtype).to(device)
                      for _ in range(3))
    return gate, up, grad


def _float64(gate, up, grad):
    """(y, d/d gate, d/d up) of sum(grad * silu(gate) * up), by autograd in float64 on the CPU."""
    gate, up = (t.detach().cpu().double().requires_grad_() for t in (gate, up))
    y = torch.nn.functional.silu(gate) * up
    y.backward(grad.cpu().double())
    return y.detach(), gate.grad, up.grad


def test_the_reference_is_the_product_and_its_gradients_the_kernels_formulas():
    gate, up, grad = _case((4, 33), torch.float64)
    y, grad_gate, grad_up = _float64(gate, up, grad)
    gate.requires_grad_(), up.requires_grad_()
    out = silu_mul(gate, up)
    out.backward(grad)
    torch.testing.assert_close(out, y, rtol=0, atol=0)
    torch.testing.assert_close(gate.grad, grad_gate, rtol=0, atol=0)
    sig = torch.sigmoid(gate.detach())  # the kernels' forms of the gradients (module docstring)
    torch.testing.assert_close(grad_up, grad * gate.detach() * sig, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(grad_gate, grad * up.detach() * sig * (1 + gate.detach() * (1 - sig)),
                               rtol=1e-13, atol=1e-13)


def test_mismatched_inputs_are_refused():
    gate, up, _ = _case((2, 8), torch.float32)
    with pytest.raises(ValueError, match="one shape and dtype"):
        silu_mul(gate, up[:, :4])
    with pytest.raises(ValueError, match="one shape and dtype"):
        silu_mul(gate, up.double())


@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]),
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter"))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 1500), (2, 2, 1024), (0, 7)])
def test_the_kernels_follow_float64(device, dtype, shape):
    """A size that is not a multiple of the block, one that is (2 blocks), and an empty one."""
    gate, up, grad = _case(shape, dtype, device)
    gate.requires_grad_(), up.requires_grad_()
    out = module._SiluMul.apply(gate, up)  # the kernels, whatever the device
    out.backward(grad)
    y, grad_gate, grad_up = _float64(gate, up, grad)
    assert out.dtype == dtype and gate.grad.dtype == dtype and up.grad.dtype == dtype
    # float32 arithmetic rounded once to `dtype`: within half an ulp of float64's (a GPU rounds to nearest; Triton
    # 3.6's interpreter truncates to bfloat16, a whole ulp), plus float32's own error
    half_ulp = 2 ** -8 if device == "cuda" else 2 ** -7
    tolerance = {torch.bfloat16: half_ulp, torch.float16: 2 ** -11, torch.float32: 1e-6}[dtype]
    for got, expected in ((out, y), (gate.grad, grad_gate), (up.grad, grad_up)):
        torch.testing.assert_close(got.cpu().double(), expected, rtol=tolerance, atol=1e-6)
