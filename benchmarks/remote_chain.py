"""The critical path of a remote call, alone: a chain of dependent calls (each call's input the last one's output,
as a model's layers are), in process and over `nccl://` (the client on another GPU), and the client's CPU time to
issue them. A fine-tuning step of Llama-3.2-1B makes ~130 such calls; what one costs over the wire beyond the GEMM
is what a remote client's step pays ~130 times, wherever its CPU does not run far enough ahead to hide it.

    python benchmarks/remote_chain.py --model llama-3.2-1b --client-device cuda:1 --tokens 1024 --calls 256

Each line: `per_call_us` (the chain's wall time / calls), `issue_us` (the client's CPU time a call, before it
waits), for `path` in_process (an executor on this process's GPU 0, policy none: the call runs on the caller's
thread) and nccl (a `symbiosis executor` process on GPU 0, the client on --client-device).
"""

from __future__ import annotations

import argparse
import time

import torch

import symbiosis
from symbiosis.model.checkpoint import Checkpoint
from common import checkpoint, dtype, emit, free_port, start_executor


def sync(on: torch.device) -> None:
    if on.type == "cuda":
        torch.cuda.synchronize(on)


def chain(session, layer_id: str, x: torch.Tensor, calls: int, client_device: torch.device) -> tuple[float, float]:
    """(wall seconds, issuing seconds) of `calls` dependent forward calls of a square layer, then their results
    on the client's GPU."""
    sync(client_device)
    started = time.perf_counter()
    y = x
    for _ in range(calls):
        y = session.forward(layer_id, y) * 0.01  # a client op between calls, as a norm or a residual add is
    issued = time.perf_counter()
    session.synchronize(gpu=True)
    sync(client_device)
    return time.perf_counter() - started, issued - started


def measure(session, label: str, layer_id: str, args, client_device: torch.device, **extra) -> None:
    width = session.layer_specs[layer_id].in_features
    x = torch.randn(args.tokens, width, device=client_device, dtype=dtype())
    chain(session, layer_id, x, 16, client_device)  # warm-up: the communicator's buffers, the GEMM's kernels
    walls, issues = [], []
    for _ in range(args.repeats):
        wall, issue = chain(session, layer_id, x, args.calls, client_device)
        walls.append(wall)
        issues.append(issue)
    walls.sort()
    emit(bench="remote_chain", path=label, model=args.model, layer=layer_id, tokens=args.tokens, calls=args.calls,
         client_device=str(client_device), per_call_us=round(walls[len(walls) // 2] / args.calls * 1e6, 1),
         best_per_call_us=round(walls[0] / args.calls * 1e6, 1),
         issue_us=round(sorted(issues)[len(issues) // 2] / args.calls * 1e6, 1), **extra)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--client-device", default="cuda:1")
    parser.add_argument("--layer", default="model.layers.0.self_attn.o_proj", help="a square base layer")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--paths", default="in_process,nccl")
    args = parser.parse_args()
    path = checkpoint(args.model)
    paths = args.paths.split(",")
    home = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if "in_process" in paths:
        executor = symbiosis.Executor.from_pretrained(path, device=home, dtype=dtype(), policy="none")
        session = executor.attach(executor.fingerprint)
        measure(session, "in_process", args.layer, args, home)
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
            measure(session, scheme, args.layer, args, client_device, pipelined=session.pipelined)
            session.close()
        finally:
            process.terminate()
            process.wait(60)


if __name__ == "__main__":
    main()
