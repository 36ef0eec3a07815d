"""Long-context inference on heterogeneous devices: prefill with the client on the GPU, then move the KV
cache to host memory and decode with the client on the CPU. The GPU then holds only the executor's base
weights and transient activations; per decoded token only one token's activations cross PCIe (per base
layer), instead of the whole KV cache as with a GPU client and an offloaded cache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


def move_client(model: PreTrainedModel, cache: DynamicCache | None, device, dtype: torch.dtype | None = None):
    """Move a split model's own tensors (its virtual base layers follow as metadata) and its KV cache."""
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
    return model


@torch.no_grad()
def prefill_then_decode(model: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int,
                        decode_device="cpu", decode_dtype: torch.dtype | None = None,
                        on_token=None) -> torch.Tensor:
    """Greedy generation: prefill where the model is now, decode on `decode_device` (tokens: [B, new])."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=input_ids.to(model.device), past_key_values=cache, use_cache=True).logits[:, -1]
    move_client(model, cache, decode_device, decode_dtype)
    token = logits.argmax(-1, keepdim=True).to(decode_device)
    generated = [token]
    for _ in range(max_new_tokens - 1):
        if on_token is not None:
            on_token(token)
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        generated.append(token)
    return torch.cat(generated, dim=1)
