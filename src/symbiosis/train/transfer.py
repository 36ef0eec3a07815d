"""Tensors between the host and a GPU in as few copies as there are dtypes, none waited for: a training pass's inputs
in (trainer.py), its results and the optimizer steps' gradient norms out (trainer.py, lora.py). A blocking copy,
or one from pageable memory, would drain the GPU first and hold the host and the GPU in lockstep."""

from __future__ import annotations

import torch


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Each tensor on `device`, as it is, in one copy per dtype from pinned memory (queued, not waited for)."""
    if torch.device(device).type == "cpu":
        return list(tensors)
    return _moved(tensors, lambda flat: flat.pin_memory().to(device, non_blocking=True))


def to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
    """Each tensor on the host, as it is (shape, dtype), in one copy per dtype; from a GPU, into pinned memory,
    queued behind the work that makes them, and the event to wait for before reading them (the work queued after
    the copies is not waited for)."""
    if not tensors or not tensors[0].is_cuda:
        return _moved(tensors, lambda flat: flat.cpu()), None

    def copy(flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True).copy_(flat, non_blocking=True)

    copied, event = _moved(tensors, copy), torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))
    return copied, event


def _moved(tensors: list[torch.Tensor], move) -> list[torch.Tensor]:
    """`tensors` concatenated per dtype, each concatenation through `move`, and cut back into their shapes."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = move(torch.cat([tensors[i].reshape(-1) for i in indices]))
        for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices])):
            out[i] = piece.view(tensors[i].shape)
    return out
