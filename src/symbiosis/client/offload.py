"""Long-context inference on heterogeneous devices: prefill with the client on the GPU, then move the KV
cache to host memory and decode with the client on the CPU. The GPU then holds only the executor's base
weights and transient activations; per decoded token only one token's activations cross PCIe (per base
layer), instead of the whole KV cache as with a GPU client and an offloaded cache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

DEFAULT_HEADROOM = 256  # tokens of spare cache capacity made when the cache moves


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values [B, H, T, D] are views of a larger buffer [B, H, capacity, D].

    `DynamicLayer` appends with `torch.cat`, copying the whole cache for every decoded token: on a GPU that is
    hidden by bandwidth, on a CPU at 64K tokens it is most of the step. Here a token is one slice copy; the
    buffer grows by half when full. Anything that replaces keys/values (crop, beam reordering) is picked up:
    the next update starts a new buffer from them.
    """

    _store: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        length, added = self.keys.shape[-2], key_states.shape[-2]
        if not self._aliases_store() or length + added > self._store[0].shape[-2]:
            self.reserve(max(added, length // 2, DEFAULT_HEADROOM))
        keys, values = self._store
        keys[..., length:length + added, :].copy_(key_states)
        values[..., length:length + added, :].copy_(value_states)
        self.keys, self.values = keys[..., :length + added, :], values[..., :length + added, :]
        return self.keys, self.values

    def reserve(self, headroom: int) -> None:
        """Copy the cache into a buffer with room for `headroom` more tokens."""
        length = self.keys.shape[-2]
        stores = []
        for tensor in (self.keys, self.values):
            store = tensor.new_empty(*tensor.shape[:-2], length + headroom, tensor.shape[-1])
            store[..., :length, :].copy_(tensor)
            stores.append(store)
        self._store = tuple(stores)
        self.keys, self.values = stores[0][..., :length, :], stores[1][..., :length, :]

    def _aliases_store(self) -> bool:
        return self._store is not None and self.keys.data_ptr() == self._store[0].data_ptr() \
            and self.values.data_ptr() == self._store[1].data_ptr()


def move_client(model: PreTrainedModel, cache: DynamicCache | None, device, dtype: torch.dtype | None = None,
                headroom: int = DEFAULT_HEADROOM):
    """Move a split model's own tensors (its virtual base layers follow as metadata) and its KV cache.

    Full-attention cache layers become `PreallocatedLayer`s with room for `headroom` more tokens, so decoding
    appends in place instead of copying the cache per token.
    """
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    if cache is not None:
        for layer in cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if tensor is not None:
                    setattr(layer, name, tensor.to(device=device, dtype=dtype or tensor.dtype))
            if hasattr(layer, "device"):
                layer.device = torch.device(device)
            if dtype is not None and hasattr(layer, "dtype"):
                layer.dtype = dtype
            if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
                layer.__class__ = PreallocatedLayer  # same state, in-place appends
                layer.reserve(headroom)
    return model


@torch.no_grad()
def prefill_then_decode(model: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int,
                        decode_device="cpu", decode_dtype: torch.dtype | None = None,
                        on_token=None) -> torch.Tensor:
    """Greedy generation: prefill where the model is now, decode on `decode_device` (tokens: [B, new])."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=input_ids.to(model.device), past_key_values=cache, use_cache=True).logits[:, -1]
    move_client(model, cache, decode_device, decode_dtype, headroom=max_new_tokens)
    token = logits.argmax(-1, keepdim=True).to(decode_device)
    generated = [token]
    for _ in range(max_new_tokens - 1):
        if on_token is not None:
            on_token(token)
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        generated.append(token)
    return torch.cat(generated, dim=1)
