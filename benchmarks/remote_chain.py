"""The critical path of a remote call, alone: a chain of dependent steps (each step's input the last one's output,
as a model's layers are), in process and over `nccl://` (the client on another GPU), and the client's CPU time to
issue them. A fine-tuning step of Llama-3.2-1B makes ~130 calls; what one costs over the wire beyond the GEMM is
what a remote client's step pays ~130 times, wherever its CPU does not run far enough ahead to hide it.

    python benchmarks/remote_chain.py --model llama-3.2-1b --client-device cuda:1 --tokens 1024 --calls 256

A step (`--steps`): `layer`, one call of a square layer (`--layer`); `mlp_layers`, layer 0's MLP as a client whose
adapter touches it calls it (gate and up as one call, SiLU(gate) * up here, down); `mlp_block`, the same MLP as
one call (client/blocks.py: over nccl:// where the adapter leaves it frozen); `o_and_mlp`, o_proj then that MLP
block (two calls: a decoder layer's tail as the MLP blocks served it); `tail`, the decoder layer's tail as one call
([h | a] -> o(a) + mlp(norm(h + o(a)))). Each line: `per_step_us` (the
chain's wall time / steps), `issue_us` (the client's CPU time a step, before it waits), for `path` in_process (an
executor on this process's GPU 0, policy none: the calls run on the caller's thread) and nccl (a `symbiosis
executor` process on GPU 0, the client on --client-device).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import symbiosis
from symbiosis.model.checkpoint import Checkpoint
from common import checkpoint, dtype, emit, free_port, start_executor


def sync(on: torch.device) -> None:
    if on.type == "cuda":
        torch.cuda.synchronize(on)


def steps(layer_id: str) -> dict:
    """step name -> (calls it makes, what it does to y [T, hidden])."""
    mlp = "model.layers.0.mlp"

    def mlp_layers(session, y):
        gate, up = session.forward(f"{mlp}.gate_proj+{mlp}.up_proj", y).chunk(2, dim=1)
        return session.forward(f"{mlp}.down_proj", F.silu(gate) * up)

    def o_and_mlp(session, y):  # a decoder layer's tail as the MLP blocks call it: o_proj, then the MLP
        return session.forward(mlp, session.forward("model.layers.0.self_attn.o_proj", y) + y)

    return {"layer": (1, lambda session, y: session.forward(layer_id, y)), "mlp_layers": (2, mlp_layers),
            "mlp_block": (1, lambda session, y: session.forward(mlp, y)), "o_and_mlp": (2, o_and_mlp),
            "tail": (1, lambda session, y: session.forward("model.layers.0", torch.cat([y, y], dim=1)))}


def chain(session, step, x: torch.Tensor, count: int, client_device: torch.device) -> tuple[float, float]:
    """(wall seconds, issuing seconds) of `count` dependent steps, then their results on the client's GPU."""
    sync(client_device)
    started = time.perf_counter()
    y = x
    for _ in range(count):
        y = step(session, y) * 0.01  # a client op between steps, as a norm or a residual add is
    issued = time.perf_counter()
    session.synchronize(gpu=True)
    sync(client_device)
    return time.perf_counter() - started, issued - started


def measure(session, label: str, width: int, args, client_device: torch.device, **extra) -> None:
    x = torch.randn(args.tokens, width, device=client_device, dtype=dtype())
    for name in args.steps.split(","):
        calls, step = steps(args.layer)[name]
        chain(session, step, x, 16, client_device)  # warm-up: the communicator's buffers, the GEMMs' kernels
        walls, issues = [], []
        for _ in range(args.repeats):
            wall, issue = chain(session, step, x, args.calls, client_device)
            walls.append(wall)
            issues.append(issue)
        walls.sort()
        emit(bench="remote_chain", path=label, step=name, calls_per_step=calls, model=args.model,
             layer=args.layer if name == "layer" else "model.layers.0" if name == "tail" else "model.layers.0.mlp", tokens=args.tokens, steps=args.calls,
             client_device=str(client_device), per_step_us=round(walls[len(walls) // 2] / args.calls * 1e6, 1),
             best_per_step_us=round(walls[0] / args.calls * 1e6, 1),
             issue_us=round(sorted(issues)[len(issues) // 2] / args.calls * 1e6, 1), **extra)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--client-device", default="cuda:1")
    parser.add_argument("--layer", default="model.layers.0.self_attn.o_proj", help="a square base layer")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=256, help="steps in a chain")
    parser.add_argument("--steps", default="layer,mlp_layers,mlp_block,o_and_mlp,tail")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--paths", default="in_process,nccl")
    args = parser.parse_args()
    path = checkpoint(args.model)
    paths = args.paths.split(",")
    home = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if "in_process" in paths:
        executor = symbiosis.Executor.from_pretrained(path, device=home, dtype=dtype(), policy="none")
        session = executor.attach(executor.fingerprint)
        measure(session, "in_process", session.layer_specs[args.layer].in_features, args, home)
        session.close()
        executor.close()
        del executor, session
        torch.cuda.empty_cache()
    if "nccl" in paths:  # gloo:// where the client computes on the CPU (a smoke test)
        port = free_port()
        process = start_executor(path, f"tcp://127.0.0.1:{port}", where=["--device", str(home)])
        try:
            client_device = torch.device(args.client_device)
            scheme = "nccl" if client_device.type == "cuda" else "gloo"
            remote = symbiosis.connect(f"{scheme}://127.0.0.1:{port}", timeout=120)
            session = remote.attach(Checkpoint(path).fingerprint(), "chain", client_device)
            measure(session, scheme, session.layer_specs[args.layer].in_features, args, client_device,
                    pipelined=session.pipelined)
            session.close()
        finally:
            process.terminate()
            process.wait(60)


if __name__ == "__main__":
    main()
