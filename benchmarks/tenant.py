"""One benchmark tenant process (launched by multi_tenant.py and friends; not run by hand).

Builds its model (plain PEFT, or a symbiosis client of the executor at --url), warms up, prints
{"ready": true}, waits for --go-file, then works for --duration seconds and prints one JSON result:
fine-tuning (--work train) or greedy decoding one token at a time (--work decode).

`--mode threads --tenants N` instead holds an executor itself and N symbiosis clients of it, each
fine-tuning on a thread and CUDA stream of its own, and prints a JSON list of N results. `--compile` runs
each tenant's model through `torch.compile`, `--capture` replays each tenant's step as one CUDA graph
(`symbiosis.CapturedStep`), `--chunked-loss` computes the loss with `symbiosis.causal_lm_loss` (no whole
logits) instead of transformers' `model(...).loss`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

import symbiosis
from common import device, dtype, fit_step, lora, peak_gib, sync, sync_stream, transformers_loss


def build(args, executor=None, name: str | None = None, on=None):
    """A PeftModel: plain, a client of the executor at --url, or (threads) of `executor`, computing `on` (default:
    the benchmark's device)."""
    if args.mode == "plain":
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype(), device_map=device())
    else:
        privacy = symbiosis.NoiseMasking(pool=args.privacy_pool, rows=1024, refresh_every=args.privacy_refresh_every) \
            if args.privacy_pool else None
        executor = executor or symbiosis.connect(args.url, timeout=300)
        model = symbiosis.from_pretrained(args.model_dir, executor, device=on or device(), name=name or args.name,
                                          privacy=privacy, dtype=dtype())
    model = get_peft_model(model, lora(args.lora))
    if args.checkpointing:  # backward recomputes each decoder layer's forward (on a split model: its calls too)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def make_step(model, args):
    """step(ids) -> loss: one fine-tuning step (AdamW), with symbiosis.causal_lm_loss (--chunked-loss) or
    transformers' loss, through torch.compile (--compile) and captured as a CUDA graph (--capture) as asked."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, capturable=args.capture)
    maybe_compile = partial(torch.compile, mode=args.compile_mode) if args.compile else (lambda f: f)
    if args.chunked_loss:
        loss_fn = maybe_compile(partial(symbiosis.causal_lm_loss, model))
    else:
        loss_fn = transformers_loss(maybe_compile(model))
    step = partial(fit_step, loss_fn, optimizer)
    if args.capture:
        example = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len), device=model.device)
        step = symbiosis.CapturedStep(step, example, optimizer=optimizer)
    return step


def train_loop(model, args, until: float | None, max_iters: int | None = None, step=None) -> list[float]:
    """Seconds per fine-tuning iteration of `step` (make_step's). Waits for this thread's CUDA stream only,
    so that tenants on other threads keep computing meanwhile."""
    step = make_step(model, args) if step is None else step
    model.train()
    times = []
    while (until is None or time.time() < until) and (max_iters is None or len(times) < max_iters):
        start = time.perf_counter()
        step(torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len), device=model.device))
        sync_stream()
        times.append(time.perf_counter() - start)
        if args.pace_ms:
            time.sleep(args.pace_ms / 1e3)
    return times


@torch.no_grad()
def decode_loop(model, args, until: float | None, max_iters: int | None = None) -> list[float]:
    """Per-token latency of greedy decoding with a KV cache, restarting from a fresh prompt every 64 tokens."""
    model.eval()
    times = []
    while (until is None or time.time() < until) and (max_iters is None or len(times) < max_iters):
        ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len), device=model.device)
        out = model(input_ids=ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(64):
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - start)
            if until is not None and time.time() >= until:
                break
    return times


def _sharded(args, where: str, launch):
    """`DEV,DEV[,...][/columns][@POLICY]`: an executor over several devices (`launch`: sharded.launch_sharded, a
    process per device after the first, this one the front; or peers.on_devices, every GPU driven by this
    process); its batching policy `opportunistic` unless named (a layer on another device costs a transfer a call,
    which N clients' calls batched pay once; `none`: the front's own layers run on the clients' threads, each call
    alone)."""
    where, _, policy = where.partition("@")
    devices, _, split = where.partition("/")
    return launch(args.model_dir, devices.split(","), dtype(), split=split or "layers", policy=policy or "opportunistic")


def threads_executor(args):
    """(what the threads' clients attach to, the devices they compute on (round robin), what to close): --executor
    `local` (in-process, policy none: each client runs its GEMMs itself), `sharded:DEV,DEV[,...][/columns][@POLICY]`
    (executor/sharded.py, this process rank 0, calls batched unless @none), `peers:...` (the same, every GPU driven
    by this process: executor/peers.py), or `nccl:WHAT` / `gloo:WHAT` (WHAT: a device, or
    `sharded:...`):
    a `symbiosis executor` process serving WHAT, the clients, on --client-device's devices, attached to it over
    that transport (`nccl-layers:` / `gloo-layers:`: the same with every frozen MLP called as its layers, not
    whole; `nccl-mlps:` / `gloo-mlps:`: MLPs whole but no decoder tails: client/blocks.py's savings measured side by
    side). (An executor process of its own, as the paper's remote clients have: with the executor's
    NCCL ranks in this process too, the first call hung on two H100s, 2026-11-26.)"""
    kind, _, where = args.executor.partition(":")
    if kind == "local":
        executor = symbiosis.Executor.from_pretrained(args.model_dir, device=device(), dtype=dtype(), policy="none")
        return executor, [device()], [executor.close]
    if kind in ("sharded", "peers"):
        from symbiosis.executor.peers import on_devices
        from symbiosis.executor.sharded import launch_sharded

        executor = _sharded(args, where, launch_sharded if kind == "sharded" else on_devices)
        return executor, [executor.device], [executor.close]
    kind, _, calls = kind.partition("-")  # nccl-layers: no block; nccl-mlps: MLP blocks, no decoder tails
    if kind in ("nccl", "gloo") and calls in ("", "layers", "mlps"):
        from common import free_port, start_executor

        if where.startswith("sharded:"):  # its calls from the clients batched (the executor's default policy)
            devices, _, split = where.removeprefix("sharded:").partition("/")
            placement = ["--devices", devices, "--split", split or "layers"]
        else:
            placement = ["--device", where]
        port = free_port()
        process = start_executor(Path(args.model_dir), f"tcp://127.0.0.1:{port}", where=placement)
        remote = symbiosis.connect(f"{kind}://127.0.0.1:{port}", timeout=300)
        if calls:  # sessions that call fewer blocks
            attach = remote.attach

            def attach_fewer(*args, **kwargs):
                session = attach(*args, **kwargs)
                session.block_specs = {block: spec for block, spec in session.block_specs.items()
                                       if calls == "mlps" and spec.kind == "gated_mlp"}
                return session
            remote.attach = attach_fewer

        def stop() -> None:
            process.terminate()
            process.wait(60)
        return remote, (args.client_device or device()).split(","), [stop]
    raise SystemExit(f"--executor {args.executor!r}: local, sharded:DEVICES[/columns], peers:DEVICES[/columns], "
                     "nccl:WHAT or gloo:WHAT")


def run_threads(args) -> None:
    """--tenants symbiosis clients of one executor (`threads_executor`), each fine-tuning on a thread and CUDA
    stream of its own, at once; prints one result per tenant, as a JSON list."""
    started = time.perf_counter()
    executor, client_devices, closing = threads_executor(args)
    tenants = []
    for i in range(args.tenants):  # built, compiled, captured and warmed up one at a time
        on = torch.device(client_devices[i % len(client_devices)])
        model = build(args, executor, name=f"{args.name}{i}", on=on)
        stream = torch.cuda.Stream(on) if on.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            model.train()
            step = make_step(model, args)
            train_loop(model, args, until=None, max_iters=3, step=step)
        tenants.append((model, step, stream))
        print(f"tenant {i} built and warmed up at {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    if torch.cuda.is_available():  # captured steps run in their graphs' memory: the warm-ups' cache is idle
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - started
    print(json.dumps({"ready": True}), flush=True)
    _wait_for(args.go_file)
    until = time.time() + args.duration
    times: list[list[float]] = [[] for _ in tenants]
    figures: list[dict] = [{} for _ in tenants]

    def work(i: int) -> None:
        model, step, stream = tenants[i]
        session = model.get_base_model().symbiosis_session
        cpu, calls, waited = time.thread_time(), getattr(session, "calls", 0), getattr(session, "waited_s", 0.0)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            times[i] = train_loop(model, args, until=until, step=step)
        # where the tenant's thread went: its CPU, and (remote sessions) its time inside calls and their waits
        figures[i] = {"thread_cpu_share": (time.thread_time() - cpu) / (sum(times[i]) or 1.0),
                      **_call_figures(session, calls, waited, times[i])}

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(tenants))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps([dict(_result(args, f"{args.name}{i}", t), build_s=build_s, executor=args.executor, **figures[i])
                      for i, t in enumerate(times)]), flush=True)
    for model, _, _ in tenants:  # sessions first (a nccl:// one ends its process group), then the executor
        model.get_base_model().symbiosis_session.close()
    for close in closing:
        close()


def _wait_for(go_file: str) -> None:
    while not os.path.exists(go_file):
        time.sleep(0.01)


def _result(args, name: str, times: list[float]) -> dict:
    tokens = args.batch_size * (args.seq_len if args.work == "train" else 1)
    reserved = torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0
    return {"name": name, "iters": len(times), "median_s": statistics.median(times) if times else 0.0,
            "tokens_per_s": tokens * len(times) / sum(times) if times else 0.0,
            "wall_tokens_per_s": tokens * len(times) / args.duration, "peak_gib": peak_gib(),
            "peak_reserved_gib": reserved}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["plain", "symbiosis", "threads"], required=True)
    parser.add_argument("--work", choices=["train", "decode"], default="train")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--url")
    parser.add_argument("--name", default="tenant")
    parser.add_argument("--tenants", type=int, default=1, help="--mode threads: how many clients")
    parser.add_argument("--executor", default="local", help="--mode threads: what the clients attach to "
                        "(local, sharded:DEVICES[/columns], peers:DEVICES[/columns], nccl:DEVICE, gloo:DEVICE)")
    parser.add_argument("--client-device", help="where the client computes (--mode threads over nccl/gloo: the "
                        "clients, round robin over a comma-separated list)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each tenant's model")
    parser.add_argument("--compile-mode", help="torch.compile's mode (default: its default)")
    parser.add_argument("--capture", action="store_true", help="each tenant's step as a CUDA graph (CapturedStep)")
    parser.add_argument("--chunked-loss", action="store_true", help="symbiosis.causal_lm_loss, not model(...).loss")
    parser.add_argument("--lora", default="lora3_r8_qkvo")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--pace-ms", type=float, default=0.0, help="client-side pause between iterations")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--go-file", required=True)
    parser.add_argument("--privacy-pool", type=int, default=0, help="NoiseMasking pool size (0: no masking)")
    parser.add_argument("--privacy-refresh-every", type=int, default=0)
    parser.add_argument("--checkpointing", action="store_true", help="transformers' gradient checkpointing")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(hash(args.name) % 1000)
    if args.mode == "threads":
        return run_threads(args)
    if args.client_device and torch.cuda.is_available():  # this process's GPU ("cuda" means it from here on)
        torch.cuda.set_device(args.client_device)
    started = time.perf_counter()
    model = build(args)
    build_s = time.perf_counter() - started  # attach, load, and (masked) computing the noise pools
    if args.work == "train":
        model.train()
        loop = partial(train_loop, step=make_step(model, args))
    else:
        loop = decode_loop
    loop(model, args, until=None, max_iters=3)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    _wait_for(args.go_file)
    session = getattr(model.get_base_model(), "symbiosis_session", None)
    calls, waited = getattr(session, "calls", 0), getattr(session, "waited_s", 0.0)
    times = loop(model, args, until=time.time() + args.duration)
    print(json.dumps(dict(_result(args, args.name, times), build_s=build_s,
                          **_call_figures(session, calls, waited, times))), flush=True)


def _call_figures(session, calls: int, waited: float, times: list[float]) -> dict:
    """A remote session's executor calls an iteration, and the share of the working time it spent inside them and
    their waits, since it had made `calls` and waited `waited` seconds; nothing for a session that counts neither."""
    if not hasattr(session, "waited_s"):
        return {}
    return {"calls_per_iter": (session.calls - calls) / max(1, len(times)),
            "wait_share": (session.waited_s - waited) / sum(times) if times else 0.0}


if __name__ == "__main__":
    main()
