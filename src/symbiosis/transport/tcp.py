"""The `tcp://` transport (another host): every layer call is a message, its tensor a zero-copy frame."""

from __future__ import annotations

import time

import torch

from symbiosis.transport import wire
from symbiosis.transport.remote import RemoteSession


class TcpSession(RemoteSession):
    grouped_experts = True
    whole_blocks = True

    def _call(self, op: str, layer_id: str, tensor: torch.Tensor, out_width: int, inference: bool,
              counts: list[int] | None = None) -> torch.Tensor:
        sent = tensor.detach().to(self.dtype)
        self.calls += 1
        header = {"op": op, "layer": layer_id, "inference": inference, "tensor": wire.describe(sent)}
        if counts is not None:  # a MoE projection's experts: `layer_id` names them, `counts` their rows
            header["counts"] = counts
        started = time.perf_counter()
        reply, frames = self._request(header, sent.cpu())
        self.waited_s += time.perf_counter() - started
        return wire.frame_tensor(frames[0], reply["tensor"]).to(tensor.device, tensor.dtype, copy=True)
