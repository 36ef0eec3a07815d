"""Call grouping: base layers that take the same input (q/k/v, gate/up) run as one executor call.

Fewer round trips (a Llama decoder layer makes 4 calls per pass instead of 7) and one larger GEMM. The
grouper learns groups by watching: layers called one after another with the very same input tensor (the
same object, unmodified) form a group. Once a group is known, the first member's call asks the executor
for the whole group ("q+k+v"), returns its own columns and keeps the others' for the members' calls that
follow. Backward needs nothing special: the members' outputs are slices of one autograd output, so
autograd sums their gradients into one, and one backward call returns grad_x = [g_q g_k g_v] W_qkv.

A member called with another input than its group's (the model took another path) gets its own call,
and that group is forgotten.
"""

from __future__ import annotations

import torch

from symbiosis.model.partition import GROUP_SEPARATOR


class CallGrouper:
    def __init__(self, session, call):
        self.session = session
        self.call_layer = call  # (tokens [T, in], layer or group id, inference) -> [T, out]
        self.groups: dict[str, tuple[str, ...]] = {}  # first member -> members, in call order
        self.grouped: set[str] = set()  # every member of a known group
        self.waiting: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}  # member -> (input, version, output)
        self._run: list[str] = []  # layers called in a row with _run_input
        self._run_input: tuple[torch.Tensor, int] | None = None  # held, so its memory cannot be reused meanwhile

    @torch.compiler.disable  # a compiled client's calls go out anyway (a graph break); tracing this bookkeeping
    # would guard on its state and recompile at every layer, and tensor identity is what it goes by
    def call(self, layer_id: str, x: torch.Tensor, tokens: torch.Tensor, inference: bool) -> torch.Tensor:
        """x: the module's input (identity is what matters); tokens: x as [T, in]. Returns [T, out]."""
        self._learn(layer_id, x)
        waiting = self.waiting.pop(layer_id, None)
        if waiting is not None:
            if waiting[0] is x and waiting[1] == x._version:
                return waiting[2]
            self._forget(layer_id)
        members = self.groups.get(layer_id)
        if members is None:
            return self.call_layer(tokens, layer_id, inference)
        fused = self.call_layer(tokens, GROUP_SEPARATOR.join(members), inference)  # [T, sum of outs]
        own, start = None, 0
        for member in members:
            width = self.session.layer_specs[member].out_features
            piece = fused[:, start:start + width].contiguous()
            start += width
            if member == layer_id:
                own = piece
            else:
                self.waiting[member] = (x, x._version, piece)
        return own

    def _learn(self, layer_id: str, x: torch.Tensor) -> None:
        same_input = self._run_input is not None and self._run_input[0] is x and self._run_input[1] == x._version
        if same_input and layer_id not in self._run:
            self._run.append(layer_id)
            return
        run = self._run
        if len(run) > 1 and not self.grouped.intersection(run):
            self.groups[run[0]] = tuple(run)
            self.grouped.update(run)
        self._run, self._run_input = [layer_id], (x, x._version)

    def _forget(self, layer_id: str) -> None:
        for first, members in list(self.groups.items()):
            if layer_id in members:
                del self.groups[first]
                self.grouped.difference_update(members)
                for member in members:
                    self.waiting.pop(member, None)
