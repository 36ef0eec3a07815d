"""End to end: the hosted engine's tokens/s and decode-step latency with many adapters, beside its baselines.

    python benchmarks/engine.py --model llama-3-8b --batches 1,8,32,64

For each batch size B and adapter popularity (distinct: each request its own adapter; uniform: ~sqrt(B) adapters,
requests spread evenly; skewed: Zipf(1.5) over B adapters; identical: one adapter; none: the base model), B
requests run together to the end. Workload (ShareGPT-like, seeded): prompt lengths log-normal with median 160
tokens (sigma 0.8, clipped to 16..1024), `--new-tokens` generated each (eos ignored). Adapters: LoRA rank `--rank`
on q, k, v, o, gate, up, down, random values. Reported per run: generated tokens/s over the whole run, and the
median latency of the steps that were pure decodes. Each (batch, pattern) runs `--repeats` times and the last is
reported (the first records the CUDA graphs of its decode step shapes; `--eager`: none). A step is timed from its
launch to the next launch (the engine reads a step's tokens while the next one runs: steady steps take the device's
time); other_s: the prefill and mixed steps' time.

Baselines in the same process and run: (a) transformers + PEFT with the same adapters loaded and mixed in one
`generate(adapter_names=...)` batch (`--peft-batches`), (b) this engine with no adapter (pattern none),
(c) transformers' base model with a static KV cache and torch.compile, its decode step (`--compiled-batches`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import random
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from common import CONFIGS, checkpoint, device, dtype, emit, is_moe, sync
from symbiosis.engine import Engine, SamplingParams
from symbiosis.executor.executor import Executor

PROJECTIONS = {"self_attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a Llama-shaped decoder layer of `config`."""
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    kv = config.get("num_key_value_heads", heads) * head_dim
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_adapters(model: str, count: int, rank: int, root: Path, targets: tuple[str, ...] | None = None) -> list[Path]:
    """`count` random rank-`rank` LoRA adapters on every projection (or on `targets`), as PEFT writes them."""
    config = CONFIGS[model]
    shapes = projection_shapes(config)
    directories = []
    for i in range(count):
        directory = root / (f"{model}-r{rank}-{i}" if targets is None else f"{model}-r{rank}-{'-'.join(targets)}-{i}")
        directories.append(directory)
        if (directory / "adapter_model.safetensors").is_file():
            continue
        directory.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for block, names in PROJECTIONS.items():
                for name in names:
                    if targets is not None and name not in targets:
                        continue
                    fan_in, fan_out = shapes[name]
                    key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                    tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) / math.sqrt(fan_in)).bfloat16()
                    tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * 0.01).bfloat16()
        save_file(tensors, directory / "adapter_model.safetensors")
        (directory / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(targets) if targets else [n for names in PROJECTIONS.values() for n in names],
            "base_model_name_or_path": model}))
    return directories


def popularity(pattern: str, batch: int, rng: random.Random) -> list[int | None]:
    """Adapter index of each of `batch` requests."""
    if pattern == "none":
        return [None] * batch
    if pattern == "distinct":
        return list(range(batch))
    if pattern == "identical":
        return [0] * batch
    if pattern == "uniform":
        return [i % max(1, round(math.sqrt(batch))) for i in range(batch)]
    weights = [1 / (k + 1) ** 1.5 for k in range(batch)]  # skewed: Zipf 1.5
    return rng.choices(range(batch), weights, k=batch)


def prompt_lengths(batch: int, rng: random.Random) -> list[int]:
    return [min(1024, max(16, round(rng.lognormvariate(math.log(160), 0.8)))) for _ in range(batch)]


def run_engine(engine: Engine, adapters: list[Path], pattern: str, batch: int, new_tokens: int, vocab: int) -> dict:
    rng = random.Random(batch)
    lengths, owners = prompt_lengths(batch, rng), popularity(pattern, batch, rng)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    sync()
    start = time.perf_counter()
    handles = [engine.submit([rng.randrange(vocab) for _ in range(n)], params,
                             None if a is None else (f"adapter-{a}", adapters[a])) for n, a in zip(lengths, owners)]
    decode_times, other_times = [], []
    while engine.has_work():
        pure_decode = all(r.decoding for r in engine.scheduler.running) and not engine.scheduler.waiting \
            and len(engine.scheduler.running) == batch
        began = time.perf_counter()
        engine.step()  # launches a step and waits for the one before it: steady steps take the device's time
        (decode_times if pure_decode else other_times).append(time.perf_counter() - began)
    sync()
    wall = time.perf_counter() - start
    generated = sum(len(h.result().token_ids) for h in handles)
    return {"tokens_per_s": generated / wall, "decode_step_ms": 1e3 * statistics.median(decode_times or [0.0]),
            "decode_steps": len(decode_times), "other_steps": len(other_times), "other_s": sum(other_times),
            "adapters": len({a for a in owners if a is not None}), "prompt_tokens": sum(lengths)}


def run_peft(model_dir: Path, adapters: list[Path], batch: int, new_tokens: int, vocab: int) -> dict:
    """Baseline (a): transformers + PEFT, `batch` distinct adapters mixed in one generate() call."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda")
    model = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
    for i in range(1, batch):
        model.load_adapter(adapters[i], adapter_name=f"a{i}")
    rng = random.Random(batch)
    lengths = prompt_lengths(batch, rng)
    longest = max(lengths)
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for row, n in enumerate(lengths):  # left padding
        ids[row, longest - n:] = torch.tensor([rng.randrange(vocab) for _ in range(n)])
        mask[row, longest - n:] = 1
    kwargs = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), do_sample=False, pad_token_id=0,
                  adapter_names=[f"a{i}" for i in range(batch)], eos_token_id=None)
    model.generate(**kwargs, max_new_tokens=2)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    generated = (out.shape[1] - longest) * batch
    del model
    torch.cuda.empty_cache()
    return {"tokens_per_s": generated / wall, "adapters": batch}


def run_compiled(model_dir: Path, batch: int, steps: int = 64) -> dict:
    """Baseline (c): transformers' base model, static KV cache, torch.compile'd decode step (its best plain decode)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda")
    model.generation_config.cache_implementation = "static"  # generate() then compiles its decode step itself
    ids = torch.randint(0, 1000, (batch, 160), device="cuda")
    kwargs = dict(input_ids=ids, do_sample=False, pad_token_id=0, eos_token_id=None)
    for _ in range(2):  # compile and capture
        model.generate(**kwargs, max_new_tokens=steps, min_new_tokens=steps)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(**kwargs, max_new_tokens=steps, min_new_tokens=steps)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return {"decode_step_ms": 1e3 * wall / steps, "tokens_per_s": batch * steps / wall}


def profile_decode(engine: Engine, adapters: list[Path], path: Path, batch: int, prompt: int) -> None:
    """Where a step's time goes: `batch` requests of `prompt` tokens with distinct adapters; their prefill steps
    profiled (written to `path`.prefill), then 10 decode steps (sorted by GPU time, then by host time), then 10 more
    under cProfile (the host's Python)."""
    from torch.profiler import ProfilerActivity, profile

    def table(profiler):
        averages = profiler.key_averages()
        return (averages.table(sort_by="cuda_time_total", row_limit=30) + "\n"
                + averages.table(sort_by="cpu_time_total", row_limit=30) + "\n")

    for repeat in range(2):  # the first prefills record and compile their shapes
        handles = [engine.submit([i + 1 + repeat] * prompt, SamplingParams(max_tokens=40, ignore_eos=True),
                                 (f"adapter-{i}", adapters[i])) for i in range(batch)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            steps = 0
            while engine._incoming or engine.scheduler.waiting or \
                    not all(r.decoding for r in engine.scheduler.running):  # prefill
                engine.step()
                steps += 1
            sync()
        if repeat == 0:
            while engine.has_work():
                engine.step()
    Path(f"{path}.prefill").write_text(f"{steps} prefill steps, {batch} x {prompt} tokens\n" + table(profiler))
    for _ in range(3):  # a few decodes (graphs recorded)
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(10):
            engine.step()
        sync()
    averages = profiler.key_averages()
    host = cProfile.Profile()  # the host's Python, without the torch profiler's own overhead
    host.enable()
    for _ in range(10):
        engine.step()
    sync()
    host.disable()
    listing = io.StringIO()
    pstats.Stats(host, stream=listing).sort_stats("tottime").print_stats(30)
    path.write_text(averages.table(sort_by="cuda_time_total", row_limit=30) + "\n"
                    + averages.table(sort_by="cpu_time_total", row_limit=30) + "\n" + listing.getvalue())
    while engine.has_work():
        engine.step()
    for handle in handles:
        handle.result()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(CONFIGS))
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--patterns", default="none,distinct,uniform,skewed,identical")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--peft-batches", default="8", help="batch sizes of baseline (a); empty: skip")
    parser.add_argument("--compiled-batches", default="1,8", help="batch sizes of baseline (c); empty: skip")
    parser.add_argument("--adapters-dir", default="/tmp/symbiosis-bench-adapters")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each (batch, pattern); the last is reported")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block (page)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--layers", default="compiled",
                        help="decoder layers of graph-replayed decode steps: compiled, eager, or both (one engine "
                             "after the other, side by side in one run)")
    parser.add_argument("--profile", help="write a torch.profiler table of decode steps (distinct adapters) here")
    parser.add_argument("--profile-batch", default="8", help="batch sizes profiled (comma-separated)")
    parser.add_argument("--profile-prompt", type=int, default=100, help="prompt tokens of each profiled request")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    model_dir = checkpoint(args.model)
    vocab = CONFIGS[args.model]["vocab_size"]
    # a MoE model's experts are fused parameters, not projections an adapter of the engine targets
    adapters = write_adapters(args.model, max(batches), args.rank, Path(args.adapters_dir),
                              tuple(PROJECTIONS["self_attn"]) if is_moe(args.model) else None)
    common = dict(bench="engine", model=args.model, rank=args.rank, new_tokens=args.new_tokens, gpu=gpu)

    executor = Executor.from_pretrained(model_dir, device=device(), dtype=dtype())
    kv_tokens = max(batches) * (1024 + args.new_tokens)
    for layers in ("compiled", "eager") if args.layers == "both" else (args.layers,):
        engine = Engine(model_dir, executor, kv_blocks=kv_tokens // args.block_size + 1, block_size=args.block_size,
                        max_batch_tokens=2048,
                        max_running=max(batches), max_lora_rank=args.rank, adapter_slots=max(batches),
                        decode_graphs=not args.eager and torch.cuda.is_available() and not is_moe(args.model),
                        compile_layers=layers == "compiled")
        run_engine(engine, adapters, "distinct", min(8, max(batches)), 4, vocab)  # warm up (adapter copies, allocator)
        if args.profile:
            for profiled in [int(b) for b in args.profile_batch.split(",")]:
                profile_decode(engine, adapters, Path(f"{args.profile}.{layers}.b{profiled}"), profiled,
                               args.profile_prompt)
        for batch in batches:
            for pattern in args.patterns.split(","):
                for _ in range(args.repeats - 1):  # CUDA graphs of this run's step shapes are recorded here
                    run_engine(engine, adapters, pattern, batch, args.new_tokens, vocab)
                emit(**common, system="symbiosis", pattern=pattern, batch=batch, graphs=engine.graphs is not None,
                     layers=layers if engine.graphs is not None else "eager",
                     **run_engine(engine, adapters, pattern, batch, args.new_tokens, vocab))
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    del executor
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for batch in [int(b) for b in args.peft_batches.split(",") if b]:
        emit(**common, system="transformers+peft", pattern="distinct", batch=batch,
             **run_peft(model_dir, adapters, batch, args.new_tokens // 2, vocab))
    for batch in [int(b) for b in args.compiled_batches.split(",") if b]:
        emit(**common, system="transformers static+compile", pattern="none", batch=batch, **run_compiled(model_dir, batch))


if __name__ == "__main__":
    main()
