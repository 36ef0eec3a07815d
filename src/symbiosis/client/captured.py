"""A fine-tuning step captured once as a CUDA graph and then replayed: no Python and no kernel launches
per step, so tenants on threads of one process no longer take turns on the interpreter.

    optimizer = torch.optim.AdamW(params, lr=torch.tensor(1e-4, device="cuda"), capturable=True)

    def train_step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    step = CapturedStep(train_step, example_ids, optimizer=optimizer)  # warms up, captures; model left as it was
    loss = step(ids)                   # what train_step(ids) computes, from one graph launch

Clients of an in-process executor on threads of their own share one interpreter, and eight compiled 1B
tenants took turns on it with the GPU 45% busy (docs/PERFORMANCE.md). A replay costs its thread a copy of
the batch into the captured input and one launch.

What CUDA graphs require of `fn`: fixed shapes (the example's), nothing that makes the CPU wait for the GPU
(`.item()`, data-dependent shapes), every tensor it reads already allocated (the executor's weights, the
client's own tensors; a transport's calls cannot be captured: this is for in-process clients), and an
optimizer built with `capturable=True`. Python numbers are captured as constants: an `lr` that a scheduler
changes must be a tensor. The outputs are tensors that each replay overwrites. The step holds `fn` (and
what it closes over: the model) and the optimizer, whose memory the graph reads and writes.

Capturing needs a few real runs of `fn` first (lazy state, library handles). They run on the example, and
then every trainable parameter and optimizer state tensor is put back as it was before them (state that
did not exist yet, zeros: how Adam-type optimizers start), so the first replay is the model's first step.
"""

from __future__ import annotations

from typing import Callable

import torch

from symbiosis.errors import BadCall, SymbiosisError

WARMUP_RUNS = 3


class CapturedStep:
    def __init__(self, fn: Callable[..., object], *example: torch.Tensor, optimizer: torch.optim.Optimizer,
                 warmup: int = WARMUP_RUNS):
        """`fn(*inputs)`: one step on tensors shaped like `example`; `optimizer`: the one `fn` steps."""
        if not optimizer.defaults.get("capturable"):
            raise SymbiosisError(f"{type(optimizer).__name__} must be built with capturable=True to be captured "
                                 "(its step count then lives on the GPU)")
        if not example or not all(t.is_cuda for t in example):
            raise SymbiosisError("CapturedStep captures CUDA work: give example inputs on a CUDA device")
        # The graph holds raw addresses of everything `fn` touches (parameters, buffers, optimizer state):
        # hold `fn` (and through it the model) and the optimizer for as long as the graph can replay.
        self.fn, self.optimizer = fn, optimizer
        self.inputs = [t.clone() for t in example]
        self.shapes = [list(t.shape) for t in example]
        restore = _snapshot(optimizer)
        # Warm-up and capture on a stream of this step's own: what libraries keep per stream (cuBLAS's
        # workspace) is then this graph's alone, and graphs of several steps may replay at once.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        restore()
        self.graph = torch.cuda.CUDAGraph()
        # cuBLAS keeps a workspace per stream, made on first use and freed whenever that cache is cleared
        # (torch.compile's own CUDA graphs clear it): made during the warm-up, it would lie outside this
        # graph's memory. Cleared here, the capture makes it in the graph's pool; cleared after, no other
        # work is handed that memory. (PyTorch's cudagraph trees do the same.)
        torch._C._cuda_clearCublasWorkspaces()
        try:
            with torch.cuda.graph(self.graph, stream=side):
                self.outputs = fn(*self.inputs)
        except RuntimeError as e:
            raise SymbiosisError(f"this step cannot be captured as a CUDA graph ({str(e).splitlines()[0]}); "
                                 "see CapturedStep's requirements") from e
        finally:
            torch._C._cuda_clearCublasWorkspaces()

    def __call__(self, *inputs: torch.Tensor):
        shapes = [list(t.shape) for t in inputs]
        if shapes != self.shapes:  # copy_ would broadcast a smaller batch silently
            raise BadCall(f"this step was captured for inputs of shapes {self.shapes}, got {shapes}; "
                          "capture another CapturedStep for another shape")
        for static, given in zip(self.inputs, inputs):
            static.copy_(given)
        self.graph.replay()
        return self.outputs


def _snapshot(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """What puts the optimizer's parameters and state back as they are now (state made later: zeros)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    values = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
             for p in params if p in optimizer.state}

    @torch.no_grad()
    def restore() -> None:
        for p, value in zip(params, values):
            p.copy_(value)
            p.grad = None  # the captured backward makes them anew, in the graph's memory
            before = state.get(id(p), {})
            for key, tensor in optimizer.state[p].items():
                if torch.is_tensor(tensor):
                    tensor.copy_(before[key]) if key in before else tensor.zero_()

    return restore
