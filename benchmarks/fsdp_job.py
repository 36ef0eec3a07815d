"""One FSDP2 + PEFT fine-tuning job over the GPUs of this machine: the baseline of the sharded executor (paper
Fig. 15-16: one such job per adapter). Launched by torchrun, one process per GPU:

    torchrun --nproc-per-node 2 benchmarks/fsdp_job.py --model llama-2-13b --duration 20

Each rank builds the model on the meta device, wraps it with PEFT (LoRA r8 on q/k/v/o by default), shards every
decoder layer and then the whole model with FSDP2 (`fully_shard`), loads the random-weight checkpoint's tensors
into its shards, and trains at batch `--batch-size` x `--seq-len` per rank. Rank 0 prints one JSON line: tokens/s
of the job (all ranks), seconds per iteration, peak memory per GPU. Several jobs at once: several torchruns, each
with its own --master-port.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from peft import get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from common import CONFIGS, checkpoint, fit_step, lora, transformers_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-2-13b", choices=sorted(CONFIGS))
    parser.add_argument("--lora", default="lora3_r8_qkvo")
    parser.add_argument("--batch-size", type=int, default=2, help="per rank")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--duration", type=float, default=20.0)
    args = parser.parse_args()
    from torch.distributed.fsdp import fully_shard

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    path = checkpoint(args.model) if rank == 0 else None
    dist.barrier()  # rank 0 wrote the checkpoint (once per machine)
    path = path or checkpoint(args.model)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = get_peft_model(model, lora(args.lora))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=device)
    # the checkpoint's tensors into this rank's shards (LoRA: PEFT's init, seeded the same on every rank)
    from safetensors.torch import load_file

    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            full = state.get(key)
            if full is None:  # a LoRA matrix: PEFT's init (B = 0, A random), the same on every rank
                full = torch.zeros(parameter.shape) if "lora_B" in name else torch.randn(parameter.shape) * 0.01
            full = full.to(device, dtype)
            if hasattr(parameter, "device_mesh"):  # this rank's shard of it, as FSDP2 lays it out
                full = distribute_tensor(full, parameter.device_mesh, parameter.placements).to_local()
                parameter = parameter.to_local()
            parameter.copy_(full)
        rotary = getattr(model.base_model.model.model, "rotary_emb", None)
        if rotary is not None:  # its non-persistent buffers were made on the meta device
            with torch.device(device):
                fresh = type(rotary)(config=rotary.config)
            rotary.inv_freq, rotary.original_inv_freq = fresh.inv_freq, fresh.original_inv_freq
            rotary.attention_scaling = fresh.attention_scaling
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loss_fn = transformers_loss(model)
    ids = lambda: torch.randint(3, config.vocab_size, (args.batch_size, args.seq_len), device=device)  # noqa: E731
    model.train()
    with torch.no_grad():  # a sanity figure: a random model's loss is about ln(vocab)
        first_loss = float(loss_fn(input_ids=(first := ids()), labels=first))
    for _ in range(3):
        fit_step(loss_fn, optimizer, ids())
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, until = [], time.time() + args.duration
    while time.time() < until:
        started = time.perf_counter()
        fit_step(loss_fn, optimizer, ids())
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    dist.barrier()
    if rank == 0:
        iter_s = statistics.median(times)
        print(json.dumps({"bench": "fsdp_job", "model": args.model, "lora": args.lora, "ranks": world,
                          "batch_per_rank": args.batch_size, "seq_len": args.seq_len, "median_iter_s": iter_s,
                          "first_loss": first_loss,
                          "tokens_per_s": world * args.batch_size * args.seq_len / iter_s,
                          "peak_gib_per_gpu": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
