"""A fine-tuning tenant run as its own process by the fault tests (not a test module).

    python tenant_process.py MODEL URL TOKEN METHOD SEED OUT [--die-in forward|backward] [--device cuda --dtype float32]

Runs `STEPS` AdamW steps of a split model against the executor at URL and saves its trainable tensors to
OUT. With --die-in it SIGKILLs itself in the middle of its first forward or backward pass.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
from peft import get_peft_model

sys.path.insert(0, os.path.dirname(__file__))
import symbiosis  # noqa: E402
from matrix import peft_config  # noqa: E402

STEPS = 3


def train(model, seed: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The same deterministic training as the in-process reference of the tests."""
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    device = next(p.device for p in model.parameters() if p.requires_grad)
    for _ in range(steps):
        ids = torch.randint(2, 128, (2, 6 + seed), generator=g).to(device)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def build(model_dir, executor, method: str, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float64):
    torch.manual_seed(seed)
    model = symbiosis.from_pretrained(model_dir, executor, device=device, dtype=dtype, name=f"tenant{seed}")
    return get_peft_model(model, peft_config(method, "llama"))


def _die(*_):
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("model", "url", "token", "method"):
        parser.add_argument(name)
    parser.add_argument("seed", type=int)
    parser.add_argument("out")
    parser.add_argument("--die-in", choices=["forward", "backward"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float64")
    args = parser.parse_args()
    model = build(args.model, symbiosis.connect(args.url, token=args.token, timeout=30), args.method, args.seed,
                  args.device, getattr(torch, args.dtype))
    layer = model.base_model.model.model.layers[1].mlp  # after several base calls of this pass
    if args.die_in == "forward":
        layer.register_forward_pre_hook(_die)
    elif args.die_in == "backward":
        layer.register_full_backward_pre_hook(_die)
    print("ready", flush=True)
    torch.save({n: t.cpu() for n, t in train(model, args.seed).items()}, args.out)
    print("done", flush=True)


if __name__ == "__main__":
    main()
