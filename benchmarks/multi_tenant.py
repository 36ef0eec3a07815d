"""Multi-tenant scaling (paper Fig. 10-12) and capacity: N fine-tuning jobs as N plain PEFT processes vs N
symbiosis client processes on one executor process; aggregate tokens/s and GPU memory of everything, and
where a symbiosis fleet's time went (executor threads, GEMMs on the GPU, clients waiting on calls). Plain
fleets that cannot fit on the GPU (N footprints of the N=1 job) are not started; a symbiosis fleet of that
size is compared with the largest plain fleet that fitted.

    python benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 1,2,4,8
    python benchmarks/multi_tenant.py --model llama-2-13b --tenants 1,2,3   # plain fleets past the GPU memory are skipped
    python benchmarks/multi_tenant.py --model llama-2-13b --tenants 1,2,8,16 --checkpointing   # both fleets checkpoint
    python benchmarks/multi_tenant.py --tenants 8 --clients threads --compile symbiosis   # one process, N threads

`--clients threads` runs the symbiosis fleet as one process: an in-process executor (policy `none`) and N
clients on threads and CUDA streams of their own, each running its GEMMs itself. `--compile` and
`--capture` say which fleets go through `torch.compile` and replay each step as a CUDA graph
(`symbiosis`: the symbiosis clients, which must then be threads; `both`: the plain PEFT jobs too).
`--chunked-loss` says which fleets compute the loss with `symbiosis.causal_lm_loss` instead of
transformers' `model(...).loss` (it works on plain PEFT models too: `both` measures what it alone brings).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from common import checkpoint, emit, free_port, start_executor
from fleet import ExecutorWindow, FleetGpu, gpu_memory_mib, run_fleet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--tenants", default="1,2,4,8")
    parser.add_argument("--lora", default="lora3_r8_qkvo")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--policy", default="opportunistic")
    parser.add_argument("--checkpointing", action="store_true",
                        help="every tenant, plain or symbiosis, uses transformers' gradient checkpointing")
    parser.add_argument("--clients", choices=["processes", "threads"], default="processes",
                        help="symbiosis clients as processes on an executor process, or threads of one process")
    parser.add_argument("--compile", choices=["none", "symbiosis", "both"], default="none",
                        help="which fleets torch.compile their tenants' models")
    parser.add_argument("--capture", choices=["none", "symbiosis", "both"], default="none",
                        help="which fleets replay their tenants' steps as CUDA graphs (symbiosis.CapturedStep)")
    parser.add_argument("--compile-mode", help="torch.compile's mode, where --compile applies")
    parser.add_argument("--chunked-loss", choices=["none", "symbiosis", "both"], default="none",
                        help="which fleets compute the loss with symbiosis.causal_lm_loss (no whole logits)")
    parser.add_argument("--executor", action="append",
                        help="--clients threads: what they attach to: local (in-process, the default), "
                             "sharded:cuda:0,cuda:1[/columns] (executor/sharded.py: a process per device), "
                             "peers:cuda:0,cuda:1[/columns] (executor/peers.py: every GPU driven by this process), "
                             "nccl:cuda:0 with --client-device "
                             "cuda:1 (clients on another GPU). --clients processes: local (an executor process on "
                             "this benchmark's device), devices:cuda:0,cuda:1[/columns] (an executor process over "
                             "them, symbiosis executor --devices) or nccl:cuda:0 / gloo:cpu (an executor process "
                             "there, the client processes attached over that transport from --client-device). Given several times: each fleet in turn, each line with "
                             "its iteration time against the first's")
    parser.add_argument("--client-device", help="--executor nccl:... or --clients processes: where the clients "
                        "compute (comma-separated: round robin)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (batch 2)")
    parser.add_argument("--no-plain", action="store_true",
                        help="no plain PEFT fleets (their baseline is another benchmark's: fsdp_fleet.py)")
    args = parser.parse_args()
    args.executor = args.executor or ["local"]
    if args.clients == "processes" and any(e != "local" and not e.startswith(("devices:", "nccl:", "gloo:"))
                                           for e in args.executor):
        parser.error("client processes attach to an executor process: --executor local, devices:DEV,DEV[/columns], "
                     "nccl:DEV or gloo:DEV")
    if args.clients == "processes" and args.capture != "none":
        parser.error("--capture applies to symbiosis clients on threads (--clients threads)")
    path = checkpoint(args.model)
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0.0
    url = "ipc:///tmp/symbiosis-multi.sock"
    memory: dict[int, tuple[float | None, float]] = {}  # tenants -> (plain GiB or None: did not fit, symbiosis GiB)
    best_plain: tuple[int, float] | None = None  # (jobs, tokens/s) of the largest plain fleet that fitted
    usable_gib = 0.97 * total_gib
    for n in [int(x) for x in args.tenants.split(",")]:
        common = dict(model_dir=path, lora=args.lora, batch_size=2, seq_len=args.seq_len, checkpointing=args.checkpointing)

        def plain_fleet(jobs: int):
            try:
                specs = [dict(common, mode="plain", name=f"peft{i}", compile=args.compile == "both",
                              compile_mode=args.compile_mode, capture=args.capture == "both",
                              chunked_loss=args.chunked_loss == "both") for i in range(jobs)]
                return run_fleet(specs, args.duration)
            except RuntimeError as e:  # a job ran out of memory after all: this many do not fit
                print(f"{jobs} plain PEFT jobs: {e}", flush=True)
                return None, None

        # N plain jobs need N footprints: past the GPU's memory (known from N=1; none if one job failed) they
        # are not started.
        one_job = memory[1][0] if 1 in memory else None
        fits = not args.no_plain and (not total_gib or 1 not in memory or
                                      (one_job is not None and n * one_job <= usable_gib))
        plain, plain_gpu = plain_fleet(n) if fits else (None, None)
        # N jobs do not fit: the baseline is what the GPU can run of them, as many at once as fit (measured
        # here if no fleet that large has run yet).
        most = int(usable_gib // one_job) if one_job and total_gib else 0
        if not args.no_plain and plain is None and 1 < most < n and (best_plain is None or best_plain[0] < most):
            fleet, _ = plain_fleet(most)
            if fleet is not None:
                best_plain = (most, sum(r["tokens_per_s"] for r in fleet))
        first_iter_s, failed = None, False
        for executor in args.executor:
            try:
                ours, ours_gpu, profile = (symbiosis_threads if args.clients == "threads" else symbiosis_processes)(
                    args, common, n, path, url, executor)
            except RuntimeError as e:  # a client ran out of memory: this many do not fit, nor do more
                emit(bench="multi_tenant", model=args.model, tenants=n, executor=executor, symbiosis=f"failed: {e}")
                failed = True
                break
            iter_s = max(r["median_s"] for r in ours)
            first_iter_s = first_iter_s or iter_s
            if len(args.executor) > 1:
                profile = dict(profile, iter_s_vs_first_executor=round(iter_s / first_iter_s, 3))
            best_plain = report(args, n, executor, ours, ours_gpu, profile, plain, plain_gpu, best_plain)
        if failed:
            break
        memory[n] = (plain_gpu.used_gib if plain is not None else None, ours_gpu.used_gib)
    capacity(args, memory, total_gib)


def threads_policy(executor: str) -> str:
    """The batching policy of a threads fleet's executor (tenant.py's `threads_executor`)."""
    if executor == "local":
        return "none"
    return executor.partition("@")[2] or "opportunistic" if executor.startswith(("sharded:", "peers:")) \
        else "opportunistic"


def report(args, n, executor, ours, ours_gpu, profile, plain, plain_gpu, best_plain):
    """One fleet's line, against plain PEFT's fleet of n (or the largest that fitted); the new best plain fleet."""
    ours_tps = sum(r["tokens_per_s"] for r in ours)
    record = dict(bench="multi_tenant", model=args.model, tenants=n, clients=args.clients, executor=executor,
                  policy=threads_policy(executor) if args.clients == "threads" else args.policy, compile=args.compile,
                  compile_mode=args.compile_mode, capture=args.capture, chunked_loss=args.chunked_loss,
                  checkpointing=args.checkpointing,
                  symbiosis_tokens_per_s=round(ours_tps), symbiosis_gpu_gib=round(ours_gpu.used_gib, 1),
                  symbiosis_median_iter_s=round(max(r["median_s"] for r in ours), 4),
                  symbiosis_gpu_busy=round(ours_gpu.busy_share, 3), **profile)
    if plain is not None:
        plain_tps = sum(r["tokens_per_s"] for r in plain)
        best_plain = (n, plain_tps)
        record.update(plain_peft_tokens_per_s=round(plain_tps), throughput_ratio=round(ours_tps / plain_tps, 3),
                      plain_peft_gpu_gib=round(plain_gpu.used_gib, 1),
                      memory_ratio=round(ours_gpu.used_gib / plain_gpu.used_gib, 3) if plain_gpu.used_gib else None,
                      plain_median_iter_s=round(max(r["median_s"] for r in plain), 4),
                      plain_gpu_busy=round(plain_gpu.busy_share, 3))
    elif best_plain is not None:  # compare with what plain PEFT can do on this GPU: its largest fleet that fitted
        record.update(plain_peft="does not fit", plain_peft_jobs_that_fit=best_plain[0],
                      plain_peft_tokens_per_s=round(best_plain[1]),
                      throughput_vs_plain_that_fit=round(ours_tps / best_plain[1], 3))
    emit(**record)
    return best_plain


def capacity(args, memory: dict, total_gib: float) -> None:
    largest = max(memory, default=0)
    if total_gib and 1 in memory and memory[1][0] is not None and largest > 1:
        # Capacity from measured footprints: each PEFT job needs its whole footprint; each more symbiosis
        # client adds its own growth, on top of what the executor (and the first client) hold.
        plain_largest = max(n for n, (gib, _) in memory.items() if gib is not None)
        per_job = memory[plain_largest][0] / plain_largest
        per_client = (memory[largest][1] - memory[1][1]) / (largest - 1)
        shared = memory[1][1] - per_client
        peft_fit, ours_fit = int(total_gib // per_job), int((total_gib - shared) // per_client)
        emit(bench="capacity_estimate", model=args.model, checkpointing=args.checkpointing, gpu_gib=round(total_gib, 1),
             gib_per_peft_job=round(per_job, 2), gib_per_symbiosis_client=round(per_client, 2),
             gib_executor=round(shared, 2), peft_jobs_fit=peft_fit, symbiosis_clients_fit=ours_fit,
             ratio=round(ours_fit / max(1, peft_fit), 2))


def symbiosis_processes(args, common: dict, n: int, path, url: str, executor: str = "local"
                        ) -> tuple[list[dict], FleetGpu, dict]:
    """N client processes on an executor process; with where the fleet's time went. `nccl:DEVICE` / `gloo:DEVICE`:
    the executor process on DEVICE, each client process attached over that transport (a tenant's own process and
    interpreter, as a remote tenant has; --client-device: where they compute)."""
    before_executor = gpu_memory_mib()  # the executor's weights and context count as the fleet's memory
    scheme, _, where = executor.partition(":")
    if scheme in ("nccl", "gloo"):
        port = free_port()
        url, client_url = f"tcp://127.0.0.1:{port}", f"{scheme}://127.0.0.1:{port}"
        executor = start_executor(path, url, args.policy, where=["--device", where])
    else:
        devices, _, split = executor.removeprefix("devices:").partition("/")
        client_url = url
        executor = start_executor(path, url, args.policy, where=None if devices == "local" else
                                  ["--devices", devices, "--split", split or "layers"])
    try:
        window = ExecutorWindow(url)
        on = args.client_device.split(",") if args.client_device else [None]
        ours, ours_gpu = run_fleet([dict(common, mode="symbiosis", url=client_url, name=f"t{i}",
                                         client_device=on[i % len(on)],
                                     compile=args.compile != "none", compile_mode=args.compile_mode,
                                     chunked_loss=args.chunked_loss != "none") for i in range(n)],
                                   args.duration, on_go=window.start, baseline_mib=before_executor)
        profile = window.shares()  # where the time went: executor threads, GEMMs; and the clients' waits
    finally:
        executor.terminate()
        executor.wait()
    return ours, ours_gpu, {**profile, **_client_calls(ours)}


def symbiosis_threads(args, common: dict, n: int, path, url: str, executor: str = "local"
                      ) -> tuple[list[dict], FleetGpu, dict]:
    """One process: an executor (`executor`: tenant.threads_executor) and N client threads (its memory counts from
    before it starts)."""
    fleet = dict(common, mode="threads", tenants=n, name="t", executor=executor,
                 **({"client_device": args.client_device} if args.client_device else {}), compile=args.compile != "none",
                 compile_mode=args.compile_mode, capture=args.capture != "none",
                 chunked_loss=args.chunked_loss != "none")
    ours, ours_gpu = run_fleet([fleet], args.duration, baseline_mib=gpu_memory_mib())
    profile = {"build_s": round(ours[0]["build_s"], 1),  # the whole process's, on every line
               "process_peak_allocated_gib": round(ours[0]["peak_gib"], 2),
               "process_peak_reserved_gib": round(ours[0]["peak_reserved_gib"], 2),
               # where the tenants' threads went: their own CPU, and (remote sessions) time inside calls and waits
               "client_thread_cpu_share": round(statistics.mean(r["thread_cpu_share"] for r in ours), 3)}
    return ours, ours_gpu, {**profile, **_client_calls(ours)}


def _client_calls(ours: list[dict]) -> dict:
    """The clients' mean share of their time inside executor calls and their waits, and calls an iteration (tenant.py
    reports them for remote sessions only)."""
    if "wait_share" not in ours[0]:
        return {}
    return {"client_wait_share": round(statistics.mean(r["wait_share"] for r in ours), 3),
            "client_calls_per_iter": round(ours[0]["calls_per_iter"], 1)}


if __name__ == "__main__":
    main()
