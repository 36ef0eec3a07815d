"""The HTTP layer's cost (issue: `symbiosis serve`): requests with Poisson arrivals at rising rates, prompts and
outputs of a ShareGPT-like length distribution, spread over many adapters, sent (a) through the HTTP API
(/v1/completions, streaming, by clients in other processes over loopback, `--client-processes`) and (b) to the engine directly
(`Engine.submit` in the service's own process, by one thread at the arrival times, each token's time taken on the
engine's thread: nothing of the benchmark's competes with the engine for the GIL), the same requests on the same warm
service in the same run.
Reports throughput (generated tokens / wall time), time to first token and inter-token latency p50/p99.

    PYTHONPATH=src python benchmarks/serve.py --model llama-3-8b --adapters 64 --rates 4,16,64 --requests 128

Prompts: log-normal tokens, median 160 (sigma 0.8, 16..1024); outputs: log-normal, median 64 (sigma 0.6,
8..256), eos ignored by neither path (random weights rarely emit it). Adapters: uniform over `--adapters`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from common import (CONFIGS, GcPauses, checkpoint, device, dtype, emit, http_layouts, process_cpu_s, task_cpu_s,
                    with_tokenizer)
from engine import write_adapters


def workload(count: int, adapters: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        prompt = min(1024, max(16, round(rng.lognormvariate(math.log(160), 0.8))))
        output = min(256, max(8, round(rng.lognormvariate(math.log(64), 0.6))))
        jobs.append({"prompt": [rng.randrange(3, vocab) for _ in range(prompt)], "max_tokens": output,
                     "adapter": rng.randrange(adapters)})
    return jobs


def arrivals(count: int, rate: float, seed: int = 1) -> list[float]:
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def pct(values: list[float], q: float) -> float | None:
    """The `q` quantile of sorted `values` (None if there are none)."""
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def summary(records: list[dict], wall: float) -> dict:
    """records: {"arrival", "tokens": [times]} per request (times from the run's start)."""
    ttft = sorted(r["tokens"][0] - r["arrival"] for r in records if r["tokens"])
    gaps = sorted(b - a for r in records for a, b in zip(r["tokens"], r["tokens"][1:]))
    generated = sum(len(r["tokens"]) for r in records)
    return {"tokens_per_s": generated / wall, "generated": generated, "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
            "ttft_p99_ms": 1e3 * pct(ttft, 0.99), "itl_p50_ms": 1e3 * pct(gaps, 0.5),
            "itl_p99_ms": 1e3 * pct(gaps, 0.99), "requests": len(records)}


class _Recorder:
    """A request's events, put by the engine's thread: each token's time (from the run's `start`) appended where it
    comes, with no thread of the benchmark's to wake (the engine's own cost, nothing added); `finished` is set once
    every request of the run has ended."""

    def __init__(self, record: dict, start: float, ended: list, finished: threading.Event, total: int):
        self.record, self.start, self.ended, self.finished, self.total = record, start, ended, finished, total

    def put(self, event) -> None:
        from symbiosis.engine import Finished

        if not isinstance(event, Finished):
            self.record["tokens"].append(time.perf_counter() - self.start)
            return
        if event.error is not None:
            self.record["error"] = str(event.error)
        self.ended.append(1)
        if len(self.ended) == self.total:
            self.finished.set()


def run_direct(service, jobs: list[dict], times: list[float], names: list[str], started=None) -> dict:
    """The same requests submitted to the engine in the service's process by one thread, each at its arrival time,
    their tokens' times taken by the engine's thread itself (`_Recorder`). `started()`, if given, is called as the
    run's clock starts."""
    from symbiosis.engine import SamplingParams

    records = [{"arrival": t, "tokens": []} for t in times]
    ended, finished = [], threading.Event()
    if started is not None:
        started()
    start = time.perf_counter()
    for i in sorted(range(len(jobs)), key=lambda i: times[i]):
        job = jobs[i]
        time.sleep(max(0.0, start + times[i] - time.perf_counter()))
        adapter = service.adapters.lookup("bench", names[job["adapter"]])
        service.engine.submit(job["prompt"], SamplingParams(max_tokens=job["max_tokens"]), (adapter[0], str(adapter[1])),
                              events=_Recorder(records[i], start, ended, finished, len(jobs)))
    finished.wait()
    failed = [r["error"] for r in records if "error" in r]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed on the engine, the first: {failed[0]}")
    return summary(records, time.perf_counter() - start)


async def _http_client(url: str, key: str, jobs: list[dict], times: list[float], names: list[str]) -> dict:
    """Says "ready" on stdout once its imports are done, reads the run's wall-clock start from stdin, then streams
    `jobs` (each at its arrival time after that start); returns their records (times from that start), this
    process's end and its CPU seconds."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    records = [{"arrival": t, "tokens": []} for t in times]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        print("ready", flush=True)
        start_at = float(sys.stdin.readline())
        start = time.perf_counter() + (start_at - time.time())
        cpu_at_start = time.process_time()  # (its imports took seconds of CPU: not the run's)

        async def one(i):
            job = jobs[i]
            await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
            body = {"model": names[job["adapter"]], "prompt": job["prompt"], "max_tokens": job["max_tokens"],
                    "temperature": 0, "stream": True}
            records[i]["sent"] = time.perf_counter() - start
            async with client.stream("POST", "/v1/completions", json=body) as response:
                records[i]["headers"] = time.perf_counter() - start  # the server answers once it has submitted it
                response.raise_for_status()
                async for line in response.aiter_lines():
                    # a token's chunk; the last chunk (finish_reason, empty text) is no token
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"] is None:
                        records[i]["tokens"].append(time.perf_counter() - start)
        await asyncio.gather(*(one(i) for i in range(len(jobs))))
        return {"records": records, "end": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_at_start}


def run_http(url: str, key: str, jobs: list[dict], times: list[float], names: list[str], processes: int = 1,
             started=None) -> dict:
    """From `processes` client processes (request i in process i % processes), so that no client's Python bounds
    what is measured, nor competes with the server's for one GIL; their CPU share says whether one came close.
    `started()`, if given, is called as the run's clock starts (once every process is ready)."""
    clients, folder = [], tempfile.TemporaryDirectory()
    for p in range(processes):  # (its jobs in a file: a pipe would hold each process's start up until it reads them)
        mine = list(range(p, len(jobs), processes))
        spec = Path(folder.name) / f"client{p}.json"
        spec.write_text(json.dumps({"url": url, "key": key, "jobs": [jobs[i] for i in mine],
                                    "times": [times[i] for i in mine], "names": names}))
        clients.append(subprocess.Popen([sys.executable, __file__, "--client", str(spec)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True))
    for child in clients:  # every process started (its imports take seconds on a busy machine): then the clock starts
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"an HTTP client process failed to start (exit {child.wait()})")
    if started is not None:
        started()
    start_at = time.time() + 0.1
    for child in clients:
        child.stdin.write(f"{start_at}\n")
        child.stdin.close()
    outcomes = []
    for child in clients:
        out = child.stdout.read()
        if child.wait() != 0:
            raise RuntimeError(f"an HTTP client process failed (exit {child.returncode})")
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    folder.cleanup()
    wall = max(o["end"] for o in outcomes)
    records = [r for o in outcomes for r in o["records"]]
    result = summary(records, wall)
    # where a request's first token waited: in its client (sent late), in the HTTP layer up to its submission
    # (the response's headers), in the engine (the rest of its TTFT)
    late, submitted = sorted(r["sent"] - r["arrival"] for r in records), sorted(r["headers"] - r["sent"] for r in records)
    result.update(sent_late_p50_ms=1e3 * pct(late, 0.5), sent_late_p99_ms=1e3 * pct(late, 0.99),
                  submitted_p50_ms=1e3 * pct(submitted, 0.5), submitted_p99_ms=1e3 * pct(submitted, 0.99))
    result.update(client_processes=processes, client_cpu_share=[round(o["cpu_s"] / wall, 2) for o in outcomes])
    return result


def serve_on_loopback(service, tenant: str, directories: list[Path]):
    """`tenant`'s adapters a0, a1, ... loaded from `directories` (under the service's adapter root), and the
    service's HTTP app answering on a free loopback port from a thread: (uvicorn server, url, adapter names, that
    thread)."""
    import uvicorn

    from symbiosis.serve.app import create_app

    names = [f"a{i}" for i in range(len(directories))]
    for name, directory in zip(names, directories):
        if service.state.adapter(tenant, name) is None:
            service.adapters.load(tenant, name, directory.name)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}", names, thread


def threads_cpu_s() -> dict[int, tuple[str, float]]:
    """Each live thread of this process (Linux's /proc: every thread, also those Python did not start): its OS id ->
    (its Python name without digits, or for threads Python did not start (torch's and OpenMP's pools, the CUDA
    driver's, a tokenizer's) "native:" and the name the OS has for them; its CPU seconds so far)."""
    python_names = {t.native_id: re.sub(r"[\d_ ()-]+$", "", t.name.split(" (")[0]) or "?" for t in threading.enumerate()}
    threads = {}
    for task in Path("/proc/self/task").iterdir():
        seconds = task_cpu_s(int(task.name))
        if not math.isnan(seconds):  # (NaN: the thread ended meanwhile)
            threads[int(task.name)] = (python_names.get(int(task.name)) or "native:" + _os_name(task), seconds)
    return threads


def _os_name(task: Path) -> str:
    try:
        return re.sub(r"[\d_ -]+$", "", (task / "comm").read_text().strip()) or "?"
    except OSError:
        return "?"


def cpu_by_name(before: dict, seen: dict) -> dict[str, float]:
    """CPU seconds each thread name used between `before` and `seen` (threads_cpu_s's, `seen` with the last figures
    of threads that ended meanwhile)."""
    used: dict[str, float] = {}
    for tid, (name, seconds) in seen.items():
        used[name] = used.get(name, 0.0) + seconds - before.get(tid, (name, 0.0))[1]
    return used


def busiest_threads(used: dict[str, float], wall: float, top: int = 6) -> dict[str, float]:
    """The thread names of `used` (cpu_by_name's) that used the most CPU, as cores busy over `wall` seconds."""
    return {name: round(seconds / wall, 2) for name, seconds in sorted(used.items(), key=lambda kv: -kv[1])[:top]}


class QueueSampler:
    """Where the requests were, every 10 ms of a run: admitted by the HTTP layer (`admitted`), handed to the engine
    and not yet scheduled (`engine_waiting`: its inbox and its scheduler's queue), running in its batch
    (`engine_running`); their means say whether the engine's batch was kept full, and if not, where requests waited."""

    def __init__(self, service, interval: float = 0.01):
        self.service, self.interval = service, interval
        self.samples: list[tuple[int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="queue-sampler", daemon=True)
        self.started()

    def started(self) -> None:
        """From now on (the run's clock starts: not the HTTP clients' start-up): the process's CPU, and every thread's
        as last seen (every 0.5 s and at the end: a thread that ends in the run still counts)."""
        self.cpu, self.began = time.process_time(), time.perf_counter()
        self.threads_before = self.threads_seen = threads_cpu_s()

    def _sample(self) -> None:
        engine, admission = self.service.engine, self.service.admission
        while not self._stop.wait(self.interval):
            self.samples.append((sum(admission.running.values()), len(engine._incoming) + len(engine.scheduler.waiting),
                                 len(engine.scheduler.running)))
            if len(self.samples) % round(0.5 / self.interval) == 0:
                self.threads_seen = {**self.threads_seen, **threads_cpu_s()}

    def __enter__(self) -> "QueueSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.threads_seen = {**self.threads_seen, **threads_cpu_s()}

    def means(self) -> dict:
        """The three means, and the samples of every 2nd second (admitted, engine_waiting, engine_running), over
        the samples with a request somewhere."""
        busy = [s for s in self.samples if any(s)]  # (not the seconds before the first request: clients starting)
        count, every = max(1, len(busy)), round(2.0 / self.interval)
        return {**{name: round(sum(s[i] for s in busy) / count, 1)
                   for i, name in enumerate(("admitted_mean", "engine_waiting_mean", "engine_running_mean"))},
                "queues_every_2s": busy[::every]}


def engine_switches() -> tuple[int, int]:
    """The engine thread's context switches so far, (voluntary, involuntary) (Linux; (0, 0) elsewhere). The
    involuntary ones are the OS scheduler taking its core for another thread or process. The voluntary ones are
    its own waits, the GIL's among them."""
    thread = next((t for t in threading.enumerate() if t.name == "symbiosis-engine"), None)
    try:
        fields = dict(line.split(":\t") for line in Path(f"/proc/self/task/{thread.native_id}/status").read_text()
                      .splitlines() if line.endswith(tuple("0123456789")) and ":\t" in line)
        return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])
    except (AttributeError, OSError, KeyError, ValueError):
        return 0, 0


def measured(service, run) -> dict:
    """`run(started)`'s summary (it calls `started()` as its clock starts), with what the service's process spent
    on it: its CPU time (every thread: the engine's, the event loop's) per generated token, where what the HTTP layer
    adds is Python that competes with the engine's thread for the GIL; which threads used it, in cores; and the
    requests whose adapter was read from disk again (evicted from the host tier: each costs its reading)."""
    engine = service.engine
    graph_steps = lambda: getattr(engine.graphs, "steps", 0) if engine.graphs is not None else 0  # noqa: E731
    reads, steps, graphed = engine.adapters.stats.disk_reads, engine.steps, graph_steps()
    switches = []
    # each run from an emptied heap (the last run's garbage collected now, not in this run), and the live objects it
    # starts with: a count that grows run after run is something kept for good (docs/PERFORMANCE.md section 8)
    gc.collect()
    live_objects = len(gc.get_objects())
    with QueueSampler(service) as queues, GcPauses() as gc_pauses:
        result = run(lambda: (queues.started(), switches.append(engine_switches())))
    switches.append(engine_switches())
    result["gc_pauses"] = gc_pauses.by_generation  # generation -> [collections, ms] (every thread's)
    result["live_objects_before"] = live_objects  # (the collector's; gc.freeze's are not counted)
    result.update(queues.means())
    # the engine's steps, and how many of them were decode-only steps replayed from CUDA graphs (the others, with a
    # prefill chunk, ran eagerly: their host time is the engine thread's CPU a step)
    result.update(engine_steps=engine.steps - steps, graph_steps=graph_steps() - graphed)
    result["server_cpu_ms_per_token"] = 1e3 * (time.process_time() - queues.cpu) / max(1, result["generated"])
    used = cpu_by_name(queues.threads_before, queues.threads_seen)
    result["server_threads_cores"] = busiest_threads(used, time.perf_counter() - queues.began)
    result["adapter_disk_reads"] = engine.adapters.stats.disk_reads - reads
    result["engine_thread_ms_per_step"] = 1e3 * used.get("symbiosis-engine", 0.0) / max(1, result["engine_steps"])
    # whether other threads and processes took the engine thread's core (involuntary), or it waited (voluntary)
    result["engine_switches_per_step"] = [round((after - before) / max(1, result["engine_steps"]), 1)
                                          for before, after in zip(switches[0], switches[-1])]
    return result


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds `thread` has used (Linux: its own CPU clock)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--client", help=argparse.SUPPRESS)  # (an HTTP client process: its jobs' file)
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(CONFIGS))
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rates", default="4,16,64", help="requests per second (Poisson)")
    parser.add_argument("--admit-batch", help="the engine's admit_batch values to run every rate with "
                        "(engine/scheduler.py; default: the engine's own, an eighth of its 96 running)")
    parser.add_argument("--switch-interval", help="the interpreter's GIL switch intervals (seconds, comma-separated) to "
                        "run every rate with (default: the interpreter's, 5 ms; 0.5 ms sped the engine's direct path "
                        "and not HTTP's, docs/PERFORMANCE.md section 9)")
    parser.add_argument("--http-processes", help="HTTP layouts to run every rate with, comma-separated: 0, the "
                        "app's event loop in the service's process; N, behind N front processes (symbiosis serve "
                        "--http-processes N)")
    parser.add_argument("--defer-wakeups", default="1", help="comma-separated 0/1: run each HTTP layout with the "
                        "engine's defer_wakeups off and on (the loop woken once a step, as the engine is about to wait "
                        "for the device; on by default)")
    parser.add_argument("--requests", type=int, default=128, help="requests per rate and path")
    parser.add_argument("--repeat", type=int, default=1, help="run every round this many times, alternated (the "
                        "engine, then each HTTP layout, again): one run a layout moved by 0.2x between calls")
    parser.add_argument("--client-processes", type=int, default=8, help="the HTTP clients' processes")
    parser.add_argument("--workdir", default="/tmp/symbiosis-bench-serve")
    args = parser.parse_args()
    if args.client:
        spec = json.loads(Path(args.client).read_text())
        print(json.dumps(asyncio.run(_http_client(spec["url"], spec["key"], spec["jobs"], spec["times"],
                                                  spec["names"]))))
        return

    from symbiosis.serve.service import Service

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = checkpoint(args.model)
    with_tokenizer(model_dir)
    adapter_root = workdir / "adapters"
    directories = write_adapters(args.model, args.adapters, args.rank, adapter_root)
    key = "bench-key-0123456789abcdef"
    (workdir / "keys").write_text(f"bench {key}\n")
    kv_tokens = 96 * 1300
    # every adapter fits the host tier: 64 of Llama-3-8B's (rank 16, every projection, 84 MB each: 5.4 GB) overflow
    # its default 4 GiB, and a request of an evicted one reads its file again, on both paths (`adapter_disk_reads`
    # counts them): this benchmark measures the HTTP layer; docs/PERFORMANCE.md section 12 measures the tiers
    host_bytes = max(4 << 30, 2 * sum((d / "adapter_model.safetensors").stat().st_size for d in directories))
    service = Service(model_dir, workdir / "state", workdir / "keys", adapter_root=adapter_root, device=device(),
                      dtype=dtype(), max_requests=4096, max_requests_per_tenant=4096,
                      engine_options={"kv_blocks": kv_tokens // 64, "block_size": 64, "max_running": 96,
                                      "max_lora_rank": args.rank, "adapter_slots": args.adapters,
                                      "max_batch_tokens": 2048, "adapter_host_bytes": host_bytes}).start()
    server, url, names, loop_thread = serve_on_loopback(service, "bench", directories)
    # each HTTP layout: the app's event loop in this process (0), or behind N front processes (its loop the bridge's)
    layouts, close_all = http_layouts(service, (args.http_processes or "0"), server, url, loop_thread)
    vocab = CONFIGS[args.model]["vocab_size"]
    common = dict(bench="serve", model=args.model, adapters=args.adapters, rank=args.rank,
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    warm = workload(128, args.adapters, vocab, seed=99)  # graphs, compiled kernels, adapter copies
    run_direct(service, warm, arrivals(len(warm), 64.0), names)
    for layout_url, _, _ in layouts.values():
        run_http(layout_url, key, warm, arrivals(len(warm), 64.0), names, args.client_processes)
    admit_batches = args.admit_batch.split(",") if args.admit_batch else [service.engine.scheduler.admit_batch]
    switch_intervals = args.switch_interval.split(",") if args.switch_interval else [sys.getswitchinterval()]
    rounds = [(float(rate), int(together), float(switch)) for together in admit_batches
              for switch in switch_intervals for rate in args.rates.split(",")] * args.repeat
    per_repeat = len(rounds) // args.repeat
    defer_default = service.engine.defer_wakeups
    for index, (rate, together, switch) in enumerate(rounds):
        # the engine's admission (engine/scheduler.py: admit_batch), set between rounds: both paths of a round share it
        service.engine.scheduler.admit_batch = together
        sys.setswitchinterval(switch)
        common.update(admit_batch=together, switch_interval_s=switch, repeat=index // per_repeat)
        jobs, times = workload(args.requests, args.adapters, vocab), arrivals(args.requests, rate)
        print(f"== engine, {rate} requests/s", file=sys.stderr, flush=True)  # (a profiler may wait for a phase)
        direct = measured(service, lambda started: run_direct(service, jobs, times, names, started))
        emit(**common, rate=rate, path="engine", **direct)
        for (count, (layout_url, layout_thread, front_pids)), defer in itertools.product(
                layouts.items(), [bool(int(d)) for d in args.defer_wakeups.split(",")]):
            print(f"== http ({count} front processes, wake-ups deferred: {defer}), {rate} requests/s",
                  file=sys.stderr, flush=True)
            service.engine.defer_wakeups = defer
            loop_cpu, fronts_cpu = thread_cpu_s(layout_thread), [process_cpu_s(pid) for pid in front_pids]
            http = measured(service, lambda started: run_http(layout_url, key, jobs, times, names,
                                                              args.client_processes, started))
            if front_pids:  # each front's CPU in cores over the run (warm-up and start-up excluded)
                wall = http["generated"] / http["tokens_per_s"]
                http["front_cores"] = [round((process_cpu_s(pid) - before) / wall, 2)
                                       for pid, before in zip(front_pids, fronts_cpu)]
            # the app's event loop alone (its own, or the bridge's): the HTTP layer's Python per token in this
            # process (requests, SSE chunks, and the writes to sockets or to the fronts)
            http["loop_cpu_ms_per_token"] = 1e3 * (thread_cpu_s(layout_thread) - loop_cpu) / max(1, http["generated"])
            service.engine.defer_wakeups = defer_default
            emit(**common, rate=rate, path="http", http_processes=count, defer_wakeups=defer, **http,
                 throughput_ratio=http["tokens_per_s"] / direct["tokens_per_s"],
                 ttft_p50_ratio=http["ttft_p50_ms"] / direct["ttft_p50_ms"],
                 itl_p50_ratio=http["itl_p50_ms"] / direct["itl_p50_ms"],
                 http_cpu_ms_per_token=http["server_cpu_ms_per_token"] - direct["server_cpu_ms_per_token"])
    close_all()


if __name__ == "__main__":
    main()
