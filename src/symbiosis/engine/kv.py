"""The paged KV cache: one pool of fixed-size blocks shared by every request, on the engine's device.

A request owns a list of block ids (its block table); token position p of the request lives in block
`table[p // block_size]`, row `p % block_size`, i.e. flat slot `table[p // block_size] * block_size + p % block_size`.
Every attention layer has its own key and value tensors of shape [kv_heads, slots, head_dim], heads first as
flex_attention reads them, made as the engine's model is built (their head counts and sizes are whatever the
architecture's attention gives: engine/attention.py's probe). One more block than the pool's, the trash page,
takes what padding rows write.
"""

from __future__ import annotations

import torch


class BlockPool:
    """Which of `num_blocks` blocks are free. Allocation is all or nothing."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV pool needs at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first

    @property
    def free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()


class PagedKV:
    """The key/value tensors of every attention layer, indexed by flat slot."""

    def __init__(self, pool: BlockPool, device: torch.device, dtype: torch.dtype):
        self.pool, self.device, self.dtype = pool, device, dtype
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (keys, values) of each attention layer

    @property
    def trash(self) -> int:
        """The first slot past the pool's (of the trash page): what padding rows of a replayed decode step write."""
        return self.pool.num_blocks * self.pool.block_size

    def add_layer(self, kv_heads: int, head_dim: int, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A new attention layer's (keys, values): [kv_heads, (num_blocks + 1 (trash)) * block_size, head_dim]."""
        slots = self.trash + self.pool.block_size
        layer = (torch.zeros(kv_heads, slots, head_dim, device=self.device, dtype=self.dtype),
                 torch.zeros(kv_heads, slots, value_dim, device=self.device, dtype=self.dtype))
        self.layers.append(layer)
        return layer

    @torch.inference_mode()  # the layers' tensors were made in it
    def scrub(self, blocks: list[int]) -> None:
        """Zero these blocks in every layer. For the blocks of a request that failed or was cancelled: they may
        hold NaN or Inf, and attention multiplies the values of masked keys (positions its next owner has not
        written yet) by zero, which would make NaN of them."""
        if not blocks or not self.layers:
            return
        slots = (torch.tensor(blocks, device=self.device)[:, None] * self.pool.block_size +
                 torch.arange(self.pool.block_size, device=self.device)).flatten()
        for layer in self.layers:
            for tensor in layer:
                tensor.index_fill_(1, slots, 0)
