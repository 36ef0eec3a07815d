"""Fine-tuning jobs beside inference (issue: fine-tuning jobs): what 8 jobs of 8 tenants train per second on the
shared base, and what inference requests (streamed through the HTTP API by a client in another process, Poisson
arrivals over LoRA adapters) see while they train, against the same requests on the same warm service with no job.

    PYTHONPATH=src python benchmarks/fine_tuning_jobs.py --model llama-3.2-1b --jobs 8 --rate 8 --requests 128

Four results, one service, one run:
  inference_alone        the requests with no job running (TTFT, ITL p50/p99, tokens/s)
  inference_with_jobs    the same requests while the jobs train (and the ratios to the line above)
  jobs_with_inference    the jobs' trained tokens/s over that window
  jobs_alone             the jobs' trained tokens/s over an equal window with no request
Jobs: LoRA r16 on every projection (the service's default method), `--batch-size` examples of about
`--example-tokens` tokens a step (trained tokens: steps x batch x the examples' mean length, which varies by a token
or two), created with the service's own JobService calls (the HTTP layer is measured by the
requests). Trained tokens count every token of an example (the prompt's too), as OpenAI's `trained_tokens` does.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from common import CONFIGS, checkpoint, device, dtype, emit, with_tokenizer
from engine import write_adapters
from serve import arrivals, run_http, serve_on_loopback, workload

WORDS = "the cat sees a dog in garden .".split()


def training_file(tokenizer, examples: int, tokens: int, seed: int) -> tuple[bytes, float]:
    """JSONL of prompt/completion examples of about `tokens` tokens: (the file, their mean length as the jobs
    tokenize them)."""
    from symbiosis.train.data import check_lines, tokenize

    rng = random.Random(seed)
    lines = []
    for _ in range(examples):
        words = [rng.choice(WORDS) for _ in range(tokens)]
        lines.append(json.dumps({"prompt": " ".join(words[:tokens // 4]),
                                 "completion": " " + " ".join(words[tokens // 4:])}))
    data = "\n".join(lines).encode()
    lengths = [len(example.tokens) for example in tokenize(check_lines(data), tokenizer, None)]
    return data, sum(lengths) / len(lengths)


def steps(service, jobs: list[tuple[str, str]]) -> int:
    """The steps the jobs have trained, together (each job's newest metrics event)."""
    total = 0
    for tenant, job_id in jobs:
        for event in service.jobs.store.events(job_id, None, 100):
            if event["type"] == "metrics" and "step" in (event["data"] or {}):
                total += event["data"]["step"]
                break
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS))
    parser.add_argument("--jobs", type=int, default=8, help="jobs, each of its own tenant")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--example-tokens", type=int, default=256)
    parser.add_argument("--max-pass-tokens", type=int, default=16384)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--adapters", type=int, default=16, help="LoRA adapters the requests spread over")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--workdir", default="/tmp/symbiosis-bench-jobs")
    parser.add_argument("--warmups", type=int, default=1, help="untimed passes of the requests before the timed ones")
    args = parser.parse_args()

    from symbiosis.serve.service import Service

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = with_tokenizer(checkpoint(args.model))
    adapter_root = workdir / "adapters"
    directories = write_adapters(args.model, args.adapters, 16, adapter_root)
    tenants = ["infer"] + [f"job{i}" for i in range(args.jobs)]
    keys = {tenant: f"key-{tenant}-0123456789abcdef" for tenant in tenants}
    (workdir / "keys").write_text("".join(f"{t} {k}\n" for t, k in keys.items()))
    started = time.perf_counter()
    service = Service(model_dir, workdir / f"state-{time.time_ns()}", workdir / "keys", adapter_root=adapter_root,
                      device=device(), dtype=dtype(), served_name=args.model, max_requests=4096,
                      max_requests_per_tenant=4096,
                      engine_options={"kv_blocks": 96 * 1300 // 64, "block_size": 64, "max_running": 96,
                                      "max_lora_rank": 16, "adapter_slots": args.adapters, "max_batch_tokens": 2048},
                      training={"max_pass_tokens": args.max_pass_tokens, "checkpoint_every": args.checkpoint_every,
                                "max_running_jobs": args.jobs, "max_running_jobs_per_tenant": 1}).start()
    start_s = time.perf_counter() - started  # with the engine's warm-up (every step shape compiled, on a GPU)
    server, url, names, _ = serve_on_loopback(service, "infer", directories)

    vocab = CONFIGS[args.model]["vocab_size"]
    common = dict(bench="fine_tuning_jobs", model=args.model, jobs=args.jobs, batch_size=args.batch_size,
                  example_tokens=args.example_tokens, rate=args.rate,
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    requests, times = workload(args.requests, args.adapters, vocab), arrivals(args.requests, args.rate)
    # Warm-up: the timed requests once, untimed. Every prefill shape they reach is compiled here; a first-met shape
    # costs seconds of compilation, which a shorter warm-up left to the first timed run (H100, 2026-11-26: TTFT p50
    # 3.2 s alone against 0.9 s with the jobs, measured second).
    emit(**common, path="service_start", seconds=start_s)
    for warmup in range(args.warmups):  # reported, so that a warm-up still paying for something shows
        emit(**common, path="inference_warmup", warmup=warmup, **run_http(url, keys["infer"], requests, times, names))
    alone = run_http(url, keys["infer"], requests, times, names)
    emit(**common, path="inference_alone", **alone)

    jobs = []
    for i, tenant in enumerate(tenants[1:]):
        data, length = training_file(service.tokenizer, 256, args.example_tokens, seed=i)
        file_id = service.jobs.upload(tenant, "train.jsonl", "fine-tune", data)["id"]
        job = service.jobs.create(tenant, {"model": args.model, "training_file": file_id, "seed": i, "method": {
            "type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 50, "batch_size": args.batch_size}}},
            "peft": {"method": "lora", "config": {"r": 16, "lora_alpha": 32}}})
        jobs.append((tenant, job["id"]))
    tokens_per_step = args.batch_size * length
    deadline = time.monotonic() + 600
    while not all(service.jobs.job(t, j)["status"] == "running" for t, j in jobs) or steps(service, jobs) < 2 * len(jobs):
        if any(service.jobs.job(t, j)["status"] == "failed" for t, j in jobs):
            raise SystemExit(f"a job failed: {[service.jobs.job(t, j)['error'] for t, j in jobs]}")
        if time.monotonic() > deadline:
            raise SystemExit("the jobs did not start training within 600 s")
        time.sleep(0.5)

    start, before = time.perf_counter(), steps(service, jobs)
    shared = run_http(url, keys["infer"], requests, times, names)
    window, trained = time.perf_counter() - start, steps(service, jobs) - before
    emit(**common, path="inference_with_jobs", **shared,
         ttft_p50_ratio=shared["ttft_p50_ms"] / alone["ttft_p50_ms"],
         ttft_p99_ratio=shared["ttft_p99_ms"] / alone["ttft_p99_ms"],
         itl_p50_ratio=shared["itl_p50_ms"] / alone["itl_p50_ms"],
         itl_p99_ratio=shared["itl_p99_ms"] / alone["itl_p99_ms"],
         throughput_ratio=shared["tokens_per_s"] / alone["tokens_per_s"])
    with_inference = trained * tokens_per_step / window
    emit(**common, path="jobs_with_inference", window_s=window, steps=trained, trained_tokens_per_s=with_inference)
    start, before = time.perf_counter(), steps(service, jobs)
    time.sleep(window)
    window, trained = time.perf_counter() - start, steps(service, jobs) - before
    emit(**common, path="jobs_alone", window_s=window, steps=trained, trained_tokens_per_s=trained * tokens_per_step / window,
         with_inference_ratio=with_inference / (trained * tokens_per_step / window))
    for tenant, job_id in jobs:
        service.jobs.control(tenant, job_id, "cancel")
    server.should_exit = True
    service.close()


if __name__ == "__main__":
    main()
