"""What one fine-tuning tenant holds for backward, by model shape: plain PEFT vs a symbiosis client, with and
without transformers' gradient checkpointing. Device-independent (it counts the bytes of the tensors autograd
saves during a training forward, each storage once, parameters left out), so it runs on a CPU in minutes
for shapes whose weights would not fit there: it builds the model with 1 and with 2 decoder layers, and
since every decoder layer saves the same, gives the full depth as (1-layer figure) + (layers - 1) x (the
difference). These are the activations alone; a process also holds its CUDA context, and a symbiosis
client its embedding and call buffer (docs/PERFORMANCE.md).

    python benchmarks/activation_memory.py --model llama-3.2-1b
    python benchmarks/activation_memory.py --model llama-2-13b
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import symbiosis
from symbiosis.client.virtual import VirtualWeight
from common import CONFIGS, emit, lora


def saved_bytes(model, ids: torch.Tensor) -> int:
    """Bytes autograd saves in one training forward (each storage once), leaving out the model's parameters
    (held anyway, not per step; a split model's base weights are in the executor, which saves nothing),
    plus the logits the caller gets back."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters() if not isinstance(p, VirtualWeight)}
    storages: dict[int, int] = {}

    def count(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        out = model(input_ids=ids, labels=ids)
    storages[out.logits.untyped_storage().data_ptr()] = out.logits.untyped_storage().nbytes()
    return sum(storages.values())


def measure(name: str, layers: int, lora_name: str, batch_size: int, seq_len: int) -> dict[str, int]:
    config = LlamaConfig(**{**CONFIGS[name], "num_hidden_layers": layers})
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        plain = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), lora(lora_name))
        executor = symbiosis.Executor.from_pretrained(path, device="cpu", dtype=torch.bfloat16)
        executor.attach(executor.fingerprint, "bystander")  # calls take the executor path, as from a client process
        split = get_peft_model(symbiosis.from_pretrained(path, executor), lora(lora_name))
        figures = {}
        for checkpointing in (False, True):
            for mode, model in (("plain", plain), ("symbiosis", split)):
                if checkpointing:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                figures[f"{mode}{'_checkpointing' if checkpointing else ''}"] = saved_bytes(model, ids)
        return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS))
    parser.add_argument("--lora", default="lora3_r8_qkvo")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    one, two = (measure(args.model, n, args.lora, args.batch_size, args.seq_len) for n in (1, 2))
    depth = CONFIGS[args.model]["num_hidden_layers"]
    gib = {setup: (one[setup] + (depth - 1) * (two[setup] - one[setup])) / 2**30 for setup in one}
    emit(bench="activation_memory", model=args.model, lora=args.lora, batch_size=args.batch_size,
         seq_len=args.seq_len, layers=depth, **{f"{setup}_gib": round(v, 3) for setup, v in gib.items()},
         **{f"{setup}_gib_per_layer": round((two[setup] - one[setup]) / 2**30, 4) for setup in one},
         checkpointing_keeps=round(gib["symbiosis_checkpointing"] / gib["plain"], 3))


if __name__ == "__main__":
    main()
