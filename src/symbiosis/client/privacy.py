"""Noise masking: the executor sees x + n instead of x, and the client removes the noise's effect exactly.

Base layers are linear, so with a noise matrix n (one row per token) chosen by the client:

    executor returns  (x + n) W^T + b  =  x W^T + b  +  n W^T
    client subtracts  n W^T, computed in advance through the executor's bias-free path  ->  x W^T + b

and for gradients (masked the same way, with noise m):

    executor returns  (g + m) W  =  g W + m W;   client subtracts  m W  (computed in advance)

Per layer and direction the client keeps a pool of `pool` noise values, each `rows` x width, whose effects
were computed when the model was built (and again every `refresh_every` calls of that layer; a group of
layers sharing an input, see client/grouping.py, gets its own pool before its first call). Each call
draws one value and a random order of its rows, so two tokens of one call never share a noise row. What
this does and does not hide is written down in docs/PRIVACY.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from symbiosis.model.partition import BaseLayerSpec, group_spec
from symbiosis.transport.base import Session


@dataclass(frozen=True)
class NoiseMasking:
    pool: int = 2
    """Noise values per layer and direction."""
    rows: int = 1024
    """Rows (tokens) per noise value: a call of up to `rows` tokens uses each row at most once."""
    scale: float = 1.0
    """Standard deviation of the noise (compare with your activations' magnitude: larger hides more, and
    costs precision in low-precision dtypes)."""
    refresh_every: int = 0
    """Replace a layer's pool after this many calls to it (0: never)."""
    mask_backward: bool = True
    """Mask gradient calls too."""
    seed: int | None = None
    """Fix the noise (tests); by default it comes from the OS's entropy."""


class _Pool:
    """Noise values [pool, rows, width] and their effects [pool, rows, out_width] for one layer direction."""

    def __init__(self, noise: torch.Tensor, effect: torch.Tensor):
        self.noise, self.effect, self.calls = noise, effect, 0


class MaskedSession(Session):
    """Wraps any session (in-process or remote) with noise masking; a group ("q+k+v") gets its own pool,
    made when the group is first used."""

    def __init__(self, inner, masking: NoiseMasking, layer_ids: list[str], device: torch.device,
                 dtype: torch.dtype):
        self.inner, self.masking, self.device, self.dtype = inner, masking, device, dtype
        self.layer_specs: dict[str, BaseLayerSpec] = inner.layer_specs
        seed = masking.seed if masking.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.generator = torch.Generator(device=device)  # noise values and row orders, made where they are used
        self.generator.manual_seed(seed)
        self.host_generator = torch.Generator()  # which pool value a call uses: read on the CPU, so no GPU sync
        self.host_generator.manual_seed(seed + 1)
        directions = ("forward", "backward") if masking.mask_backward else ("forward",)
        self.pools = {(layer_id, d): self._make_pool(layer_id, d) for layer_id in layer_ids for d in directions}

    # What masking does not change is the wrapped session's.
    client_id = property(lambda self: self.inner.client_id)

    def fetch(self, layer_id: str):
        return self.inner.fetch(layer_id)

    def weight_norms(self, layer_id: str) -> torch.Tensor:
        return self.inner.weight_norms(layer_id)

    def synchronize(self, gpu: bool = False) -> None:
        self.inner.synchronize(gpu)

    def reconnect(self) -> None:
        self.inner.reconnect()

    def close(self) -> None:
        self.inner.close()

    def _make_pool(self, layer_id: str, direction: str) -> _Pool:
        spec = group_spec(self.layer_specs, layer_id)
        width = spec.in_features if direction == "forward" else spec.out_features
        m = self.masking
        noise = torch.randn(m.pool * m.rows, width, generator=self.generator, device=self.device, dtype=self.dtype)
        noise *= m.scale
        # The executor computes the effects, bias-free: n W^T (forward) or m W (backward).
        effect = self.inner.forward_nobias(layer_id, noise) if direction == "forward" else \
            self.inner.backward(layer_id, noise)
        return _Pool(noise.view(m.pool, m.rows, width), effect.view(m.pool, m.rows, -1))

    def _draw(self, layer_id: str, direction: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer_id, direction)
        pool = self.pools.get(key)
        refresh = self.masking.refresh_every
        # None: a call group learned after attach gets its pool before its first call.
        if pool is None or (refresh and pool.calls >= refresh):
            pool = self.pools[key] = self._make_pool(layer_id, direction)
        pool.calls += 1
        value = int(torch.randint(self.masking.pool, (1,), generator=self.host_generator))  # on the CPU: no sync
        rows = self.masking.rows
        # The rows, in a random order, drawn on the device. (Drawing them on the CPU and copying them over,
        # pinned, measured slower for fine-tuning in run 12: docs/PERFORMANCE.md section 5.)
        if tokens == 1:  # decoding: one row, without a permutation (on a GPU, a sort of `rows` keys)
            order = torch.randint(rows, (1,), generator=self.generator, device=self.device)
        elif tokens <= rows:
            order = torch.randperm(rows, generator=self.generator, device=self.device)[:tokens]
        else:  # more tokens than rows: rows must repeat (documented: repeats leak differences)
            order = torch.randint(rows, (tokens,), generator=self.generator, device=self.device)
        return pool.noise[value].index_select(0, order), pool.effect[value].index_select(0, order)

    def _masked_forward(self, call, layer_id: str, x: torch.Tensor, inference: bool) -> torch.Tensor:
        noise, effect = self._draw(layer_id, "forward", x.shape[0])
        return call(layer_id, x + noise.to(x.dtype), inference) - effect.to(x.dtype)

    def forward(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        # x: [T, in];  returns (x + n) W^T + b - n W^T
        return self._masked_forward(self.inner.forward, layer_id, x, inference)

    def forward_nobias(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        # x: [T, in];  returns (x + n) W^T - n W^T  (the pools' effects are bias-free)
        return self._masked_forward(self.inner.forward_nobias, layer_id, x, inference)

    def backward(self, layer_id: str, grad_out: torch.Tensor) -> torch.Tensor:
        # grad_out: [T, out];  returns (g + m) W - m W
        if not self.masking.mask_backward:
            return self.inner.backward(layer_id, grad_out)
        noise, effect = self._draw(layer_id, "backward", grad_out.shape[0])
        return self.inner.backward(layer_id, grad_out + noise.to(grad_out.dtype)) - effect.to(grad_out.dtype)
