"""Hosted fine-tuning (the Tinker API's training): N tenants each train their own LoRA (rank 16 on q/k/v/o) at
batch 1 x 256 tokens per step, forward_backward + optim_step in a loop, all batched by the service into one pass.

    python benchmarks/hosted_training.py --model llama-3.2-1b --tenants 8,16,32

Measured side by side in one run, on one GPU:
- symbiosis through its own Python API (train/: Trainer + TrainingQueue, each tenant a thread submitting its
  requests as the HTTP layer would) and, separately, through the official `tinker` SDK over HTTP (a loopback
  `symbiosis serve` in this process, each tenant a thread with its own ServiceClient);
- one compiled PEFT job at batch 1 x 256 (a tenant alone) and at batch N x 256 (every tenant's tokens in ONE job with
  ONE adapter: the ceiling of batching);
- a fleet of eager PEFT processes, one per tenant (`--fleet`, under MPS with `MPS=1 run_all.sh`), as many as fit.
Reported: aggregate tokens/s (trained tokens over the window), GPU memory, passes per second.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from common import (CONFIGS, checkpoint, device, dtype, emit, peak_gib, reset_peak, serve_through_fronts, sync,
                    task_cpu_s, with_tokenizer)

PARTS = dict(train_attn=True, train_mlp=False, train_unembed=False)


def _tokens(vocab: int, length: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, vocab, (length + 1,), generator=generator).tolist()


# a tenant's steps before the window opens: the trainer captures a shape of pass's CUDA graphs (train/graphs.py) once
# it has come 3 times in 16 passes, and the passes of the loops' first steps, which start at different times, are of
# several shapes (with 5 steps, one was still captured inside a 10 s window now and then: a stall that a
# long-running service pays once a shape; `graphs_in_window` says when it happened anyway)
WARM_UP_STEPS = 10


def drive(tenants: int, start_tenant, length: int, duration: float, on_start=lambda: None) -> tuple[int, float]:
    """Each tenant a thread: `start_tenant(index)` sets it up and returns (step, finish); after `WARM_UP_STEPS`
    warm-up steps each, every tenant steps until the window of `duration` seconds closes. Returns the tokens of the steps that
    finished inside the window and the seconds from its opening to the last of them (not to its close: the steps
    still running then, up to a round of every tenant's, would count as time without their tokens). A tenant that
    fails breaks the barrier, so nobody waits for it for ever."""
    trained = [0] * tenants
    stop_at = [None]
    last_done = [0.0] * tenants

    def open_window() -> None:  # run by the barrier once every tenant is there, before any is released
        on_start()
        stop_at[0] = time.perf_counter() + duration

    ready = threading.Barrier(tenants + 1, action=open_window)

    def tenant(index: int) -> None:
        try:
            step, finish = start_tenant(index)
            for _ in range(WARM_UP_STEPS):
                step()
            ready.wait()
            while time.perf_counter() < stop_at[0]:
                step()
                if (now := time.perf_counter()) < stop_at[0]:
                    trained[index] += length
                    last_done[index] = now
            finish()
        except BaseException:
            ready.abort()
            raise

    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(tenants)]
    for thread in threads:
        thread.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        for thread in threads:
            thread.join()
        raise RuntimeError("a tenant failed before the window opened (its traceback is above)") from None
    start = stop_at[0] - duration
    for thread in threads:
        thread.join()
    return sum(trained), max(last_done) - start if sum(trained) else duration


class Loop:
    """A tenant's training loop, as `--loop` says: `sequential` waits for each request before sending the next
    (forward_backward, then optim_step); `together` sends an iteration's forward_backward and optim_step, then waits
    for both (tinker-cookbook's loops); `ahead` sends the next iteration before waiting for the last one, so that its
    requests are queued while the last ones run. `iteration()` sends one iteration's requests and returns their
    waits (callables); `step()` is `drive`'s step: one iteration done a call (the first waits for its own)."""

    def __init__(self, kind: str, submit):
        self.kind, self.submit, self.pending, self.started = kind, submit, [], False

    def step(self) -> None:
        if self.kind == "sequential":
            for wait in self.submit(sequential=True):
                wait()
            return
        self.pending.append(self.submit(sequential=False))
        self._drain(keep=1 if self.kind == "ahead" and self.started else 0)
        self.started = True

    def finish(self) -> None:
        self._drain(keep=0)

    def _drain(self, keep: int) -> None:
        """Wait for the oldest iterations until `keep` are left in flight."""
        while len(self.pending) > keep:
            for wait in self.pending.pop(0):
                wait()


def _activities() -> list:
    return [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def _write_profile(profiler, path: str, title: str) -> None:
    """The operators by device time, the timeline, the operators by host time: each written as soon as it is made
    (the timeline and the host table take minutes for 2 GPUs; a run cut short keeps what came before)."""
    averages = profiler.key_averages()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    Path(path).write_text(f"{title}\n" + averages.table(sort_by=key, row_limit=60) + "\n")
    with open(path, "a") as out:
        out.write(_timeline(profiler.events()) + "\n")
        out.flush()
        out.write(averages.table(sort_by="cpu_time_total", row_limit=50))


def _timeline(events, bucket_us: float = 20_000) -> str:
    """Each GPU's busy time (the union of its kernels) and, every `bucket_us`, its busy percentage beside what the
    host was doing then (the trainer's ranges: F its decoder's forward, B its backward; - anything else, the head's
    forward among it): whether the host or the GPU bounds a pass."""
    kernels: dict[int, list[tuple[float, float]]] = {}
    ranges = []
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.end > event.time_range.start:
            kernels.setdefault(event.device_index, []).append((event.time_range.start, event.time_range.end))
        elif event.name.startswith("trainer."):
            ranges.append((event.time_range.start, event.time_range.end, event.name[8].upper()))
    if not kernels:
        return ""
    start = min(a for spans in kernels.values() for a, _ in spans)
    end = max(b for spans in kernels.values() for _, b in spans)
    buckets = int((end - start) // bucket_us) + 1
    lines = [f"window {(end - start) / 1e3:.1f} ms"]
    busy = {}
    for gpu, spans in sorted(kernels.items()):
        spans.sort()
        merged = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        busy[gpu] = [0.0] * buckets
        for a, b in merged:
            while a < b:
                index = int((a - start) // bucket_us)
                edge = min(b, start + (index + 1) * bucket_us)
                busy[gpu][index] += edge - a
                a = edge
        lines.append(f"GPU {gpu}: busy {sum(b - a for a, b in merged) / 1e3:.1f} ms")
    for index in range(buckets):
        at = start + (index + 0.5) * bucket_us
        host = "".join(sorted({tag for a, b, tag in ranges if a <= at < b})) or "-"
        lines.append(f"{index * bucket_us / 1e3:7.0f} ms  " + "  ".join(
            f"gpu{d} {100 * busy[d][index] / bucket_us:3.0f}%" for d in sorted(busy)) + f"  host {host}")
    return "\n".join(lines) + "\n"


def _trainer(model_dir: Path, devices: list[str] | None, micro_batch_tokens: int | None):
    """(executor, trainer) over this machine's GPU, or over `devices` (the base's layers spread: executor/peers.py)."""
    from symbiosis.executor.executor import Executor
    from symbiosis.executor.peers import on_devices
    from symbiosis.train import Trainer

    executor = on_devices(model_dir, devices, dtype=dtype()) if devices else \
        Executor.from_pretrained(model_dir, device=device(), dtype=dtype())
    trainer = Trainer(model_dir, executor)
    if micro_batch_tokens:
        trainer.micro_batch_tokens = micro_batch_tokens
    return executor, trainer


def _release_gpu() -> None:
    """What a finished run held on the GPU given back before the next run's peak is measured: the training model's
    modules and its pass state refer to each other (a cycle: only the collector frees them, and with them the
    trainer's CUDA graphs' memory pools, which counted in the next runs' peaks)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _graph_counts(trainer, at_start: dict | None = None) -> dict:
    """The decoder's CUDA graphs captured and replayed by `trainer` (train/graphs.py), where it has them; with
    `at_start` (this call's result when the window opened) also those inside the window: a capture there is a
    stall of a few passes that a long-running service pays once a shape."""
    graphs = getattr(trainer, "graphs", None)
    if graphs is None:
        return {}
    counts = {"graphs": {name: getattr(graphs, name, 0) for name in ("captures", "replays", "padded")}}
    if at_start:
        counts["graphs_in_window"] = {name: value - at_start["graphs"][name] for name, value in counts["graphs"].items()}
        counts["graph_shapes"] = sorted((rows, length) for rows, length, _ in graphs.graphs)  # (datums, tokens) held
    return counts


def _runner_share(queue, seconds_at_start: dict, wall: float) -> dict:
    """The share of a window of `wall` seconds each training runner (a TrainingQueue's, or each replica's, averaged)
    spent gathering its tenants' requests, stepping and passing, from `queue.seconds` at the window's start, and
    `idle`: the rest, waiting with nothing queued (a loop whose step was answered beside its pass is next awaited
    there, not in a gather)."""
    runners = len(queue.queues) if hasattr(queue, "queues") else 1
    shares = {what: (queue.seconds[what] - seconds_at_start[what]) / runners / wall for what in queue.seconds}
    shares["idle"] = max(0.0, 1 - sum(shares.values()))
    return {what: round(share, 3) for what, share in shares.items()}


def _peaks(devices: list[str] | None) -> dict:
    """Peak GPU memory: of this GPU, or of each of `devices`."""
    if not devices or not torch.cuda.is_available():
        return {"peak_gib": peak_gib()}
    return {"peak_gib_per_gpu": [torch.cuda.max_memory_allocated(d) / 2**30 for d in devices]}


def engine_api(model_dir: Path, tenants: int, rank: int, length: int, duration: float, vocab: int, batch: int = 1,
               devices: list[str] | None = None, max_pass_tokens: int | None = None,
               micro_batch_tokens: int | None = None, replicas: list[str] | None = None, loop: str = "together"
               ) -> dict:
    """Every tenant a thread submitting forward_backward (`batch` datums) and optim_step (`Loop`) to one
    TrainingQueue (or, with `replicas`, to a `Replicas` of a base copy on each of those GPUs, the tenants spread
    over them)."""
    from symbiosis.train import HostedLora, LoraSpec, Work
    from symbiosis.train.lora import AdamParams
    from symbiosis.train.replicas import Replicas
    from symbiosis.train.scheduler import Operation, TrainingQueue
    from symbiosis.train.trainer import Datum

    gpus = replicas or devices
    for d in gpus or [None]:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats(d)
    reset_peak()
    pass_tokens = max_pass_tokens or tenants * length * batch
    if replicas:
        executor = None
        queue = Replicas.on_devices(model_dir, replicas, dtype=dtype(), max_pass_tokens=pass_tokens).start()
        trainer = queue.trainers[0]
    else:
        executor, trainer = _trainer(model_dir, devices, micro_batch_tokens)
        queue = TrainingQueue(trainer, max_pass_tokens=pass_tokens).start()

    def start_tenant(index: int):
        generator = torch.Generator().manual_seed(index)
        key = f"tenant-{index}"
        home = queue.place(key) if replicas else trainer
        lora = HostedLora(LoraSpec(rank=rank, seed=index, **PARTS), home.targets, home.device, home.dtype)
        queue.open(key, 0)
        seq = 0

        def send(work=None, call=None, step=None, wait=False):
            nonlocal seq
            done = threading.Event()
            outcome = {}
            queue.submit(key, Operation(seq, lambda r: (outcome.update(r=r), done.set()),
                                        lambda e: (outcome.update(e=e), done.set()), work=work, call=call, step=step))
            seq += 1

            def waited():
                done.wait()
                if "e" in outcome:
                    raise outcome["e"]
            if wait:
                waited()
            return waited

        def iteration(sequential: bool) -> list:
            datums = []
            for _ in range(batch):
                tokens = _tokens(vocab, length, generator)
                datums.append(Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]),
                                                  "weights": torch.ones(length, dtype=torch.float64)}))
            return [send(work=Work(lora, datums, "cross_entropy"), wait=sequential),
                    send(call=lambda metrics: metrics, step=(lora, AdamParams(1e-4)), wait=sequential)]

        tenant_loop = Loop(loop, iteration)
        return tenant_loop.step, tenant_loop.finish

    at_start = []
    runners = [t for t in threading.enumerate() if t.name == "symbiosis-training"]
    runners_cpu = lambda: sum(task_cpu_s(t.native_id) for t in runners)  # noqa: E731
    trained, wall = drive(tenants, start_tenant, length * batch, duration,
                          on_start=lambda: at_start.append((queue.passes, dict(queue.seconds), runners_cpu(),
                                                            _graph_counts(trainer), queue.overlapped)))
    passes_run = queue.passes - at_start[0][0]
    result = {"tokens_per_s": trained / wall, "passes_per_s": passes_run / wall,
              "datums_per_pass": trained / length / max(1, passes_run), **_peaks(gpus),
              "overlapped_share": round((queue.overlapped - at_start[0][4]) / max(1, passes_run), 3),
              "runner_share": _runner_share(queue, at_start[0][1], wall), **_graph_counts(trainer, at_start[0][3]),
              # the trainer's CPU a tenant's iteration, as through_sdk prints it beside the HTTP server's
              "cpu_ms_per_iteration": {"training": round(1e3 * (runners_cpu() - at_start[0][2]) /
                                                         max(1, trained // (length * batch)), 3)}}
    if devices:
        result.update(devices=devices, micro_batch_tokens=trainer.micro_batch_tokens)
    if replicas:
        result.update(replicas=replicas)
    if gpus:
        result.update(batch=batch, max_pass_tokens=pass_tokens)
    queue.stop()
    del trainer, executor, queue
    _release_gpu()
    return result


def pass_anatomy(model_dir: Path, tenants: int, rank: int, length: int, vocab: int, repeats: int = 5,
                 profile: str | None = None, devices: list[str] | None = None, micro_batch_tokens: int | None = None
                 ) -> dict:
    """One pass of `tenants` datums (each its own adapter) and their optimizer steps, alone (no queue, no threads):
    wall milliseconds of the pass and of the steps (medians), and the pass's GPU milliseconds when the host has
    queued all of it in advance (behind a long GPU sleep, timed by events after the sleep): wall far above GPU
    means the host's launches bound the pass. `profile`: a torch.profiler table of the timed passes and steps
    (operators by GPU time, then by host time) written there."""
    from symbiosis.train import HostedLora, LoraSpec, Work
    from symbiosis.train.lora import AdamParams, step_together
    from symbiosis.train.trainer import Datum

    executor, trainer = _trainer(model_dir, devices, micro_batch_tokens)
    generator = torch.Generator().manual_seed(0)
    loras = [HostedLora(LoraSpec(rank=rank, seed=i, **PARTS), trainer.targets, trainer.device, trainer.dtype)
             for i in range(tenants)]

    def works():
        out = []
        for lora in loras:
            tokens = _tokens(vocab, length, generator)
            out.append(Work(lora, [Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]),
                                                       "weights": torch.ones(length, dtype=torch.float64)})],
                            "cross_entropy"))
        return out

    def median(values):
        return sorted(values)[len(values) // 2]

    passes, steps, gpu = [], [], []
    profiler = None
    for i in range(repeats + 1):
        if i == 1 and profile:
            profiler = torch.profiler.profile(activities=_activities())
            profiler.start()
        batch = works()
        sync()
        start = time.perf_counter()
        trainer.run(batch)
        passes.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        step_together([(lora, AdamParams(1e-4)) for lora in loras])
        sync()
        steps.append((time.perf_counter() - start) * 1e3)
        if torch.cuda.is_available():
            batch = works()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(2_000_000_000)  # ~1 s at H100 clocks: the host queues the whole pass behind it
            begin.record()
            trainer.run(batch)  # reads back at its end: returns after the GPU is done
            end.record()
            end.synchronize()
            gpu.append(begin.elapsed_time(end))
            for lora in loras:  # (the name in trees before the adapters' flat buffers too)
                lora.drop_gradients() if hasattr(lora, "drop_gradients") else lora.optimizer.zero_grad()
    if profiler is not None:
        profiler.stop()
        _write_profile(profiler, profile, f"{tenants} tenants, {repeats} passes and steps (and as many passes "
                                          "behind a GPU sleep)")
    result = {"pass_wall_ms": median(passes[1:]), "step_wall_ms": median(steps[1:])}
    if gpu:
        result["pass_gpu_ms"] = median(gpu[1:])
    if devices and torch.cuda.is_available():  # one more pass, each stage's work on each micro-batch timed
        clock = _StageClock(trainer)
        trainer.run(works())
        result["pipeline"] = clock.report()
        for lora in loras:
            lora.drop_gradients()
    del trainer, executor, loras
    _release_gpu()
    return result


class _StageClock:
    """When each GPU of a pass pipelined over several (Trainer over `--devices`) worked on which micro-batch: CUDA
    events at the start and end of each stage's (its GPU's run of decoder layers) forward of each micro-batch
    (module hooks) and backward (hooks on the gradients of the stage's output and input), read against events
    recorded on every GPU at once while all were idle. Far cheaper than a profiler's trace of two GPUs."""

    def __init__(self, trainer):
        layers = trainer.model.get_decoder().layers
        self.stages: list[list] = []  # [device, first layer, last layer]
        for index, layer in enumerate(layers):
            gpu = next(layer.parameters()).device
            if self.stages and self.stages[-1][0] == gpu:
                self.stages[-1][2] = index
            else:
                self.stages.append([gpu, index, index])
        self.marks: list[tuple] = []  # (stage, micro-batch, what, event)
        self.calls = [0] * len(self.stages)
        self.hooks = []
        for stage, (_, first, last) in enumerate(self.stages):
            self.hooks.append(layers[first].register_forward_pre_hook(
                functools.partial(self._began, stage), with_kwargs=True))
            self.hooks.append(layers[last].register_forward_hook(functools.partial(self._ended, stage)))
        sync()
        for gpu in {d for d, _, _ in self.stages}:
            torch.cuda.synchronize(gpu)
        self.reference = {}
        for gpu in {d for d, _, _ in self.stages}:  # every GPU idle: these run at (nearly) the same moment
            self.reference[gpu] = torch.cuda.Event(enable_timing=True)
            self.reference[gpu].record(torch.cuda.current_stream(gpu))

    def _mark(self, stage: int, batch: int, what: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.stages[stage][0]))
        self.marks.append((stage, batch, what, event))

    def _began(self, stage, module, args, kwargs):
        batch = self.calls[stage]
        self._mark(stage, batch, "forward from")
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.requires_grad:  # its gradient: this stage's backward is done
            x.register_hook(lambda grad: self._mark(stage, batch, "backward to"))

    def _ended(self, stage, module, args, output):
        batch = self.calls[stage]
        self.calls[stage] += 1
        self._mark(stage, batch, "forward to")
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:  # its gradient: this stage's backward begins
            out.register_hook(lambda grad: self._mark(stage, batch, "backward from"))

    def report(self) -> dict:
        """Per stage and micro-batch, forward and backward as [from, to] milliseconds since the pass began (a
        backward without its end: the first stage, whose input needs no gradient), each GPU's busy time in them,
        and the pass's span."""
        for hook in self.hooks:
            hook.remove()
        for gpu in self.reference:
            torch.cuda.synchronize(gpu)
        times: dict = {}
        for stage, batch, what, event in self.marks:
            phase, edge = what.split()
            ms = self.reference[self.stages[stage][0]].elapsed_time(event)
            times.setdefault((stage, batch, phase), {})[edge] = round(ms, 2)
        spans = [(stage, batch, phase, t.get("from"), t.get("to")) for (stage, batch, phase), t in sorted(times.items())]
        busy = [0.0] * len(self.stages)
        for stage, _, _, begin, end in spans:
            if begin is not None and end is not None:
                busy[stage] += end - begin
        ends = [t for span in spans for t in span[3:] if t is not None]
        return {"stages": [[str(d), first, last] for d, first, last in self.stages], "span_ms": max(ends) - min(ends),
                "busy_ms_per_stage": [round(b, 1) for b in busy], "spans": spans}


def through_sdk(model_dir: Path, tenants: int, rank: int, length: int, duration: float, vocab: int,
                processes: int = 1, replicas: list[str] | None = None,
                gather_fraction: float | None = None, loop: str = "together", http_processes: int = 0) -> dict:
    """A loopback `symbiosis serve` (in this process) and the tenants, each a thread driving the tinker SDK, in
    `processes` processes of their own. The processes' windows open together: each says `ready` when its tenants
    are warm, and all are told `go` at once. One process by default: on one machine, a process a tenant was slower
    (H100 host of 16 cores, 2026-11-27: 32 tenants 5,776 tokens/s against 14,358 in one process; 8 tenants 6,584
    against 8,848), likely because the clients' interpreters compete for the cores with the service's threads,
    which users' own machines would not (not profiled). `http_processes`: the service's HTTP behind that many
    front processes (`symbiosis serve --http-processes`); its "http" CPU is then the bridge's loop's."""
    import uvicorn

    from symbiosis.serve.app import create_app
    from symbiosis.serve.service import Service

    with_tokenizer(model_dir)
    state = Path(tempfile.mkdtemp())
    keys = state / "keys"
    keys.write_text("".join(f"tenant{i} {_sdk_key(i)}\n" for i in range(tenants)))
    reset_peak()
    service = Service(model_dir, state / "state", keys, device=device(), dtype=dtype(), served_name="base",
                      engine_options={"kv_blocks": 64}, training={"persist_every": 10**9,
                                                                  "max_pass_tokens": tenants * length,
                                                                  "devices": replicas,
                                                                  "gather_fraction": gather_fraction}).start()
    if http_processes:
        url, thread, _, stop_http = serve_through_fronts(service, http_processes)
    else:
        server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

        def stop_http() -> None:
            server.should_exit = True
            thread.join(30)
    processes = max(1, min(tenants, processes))
    groups = [list(range(tenants))[i::processes] for i in range(processes)]
    children = []
    for group in groups:
        spec = dict(url=url, indices=group, rank=rank, length=length, duration=duration, vocab=vocab, loop=loop)
        child = subprocess.Popen([sys.executable, __file__, "--sdk-client", json.dumps(spec)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "TINKER_TELEMETRY": "0"})
        children.append(child)
    outcomes = []
    try:
        for child in children:  # every process's tenants warm
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("an SDK client process failed before its window (its traceback is above)")
        passes, seconds = service.training_queue.passes, dict(service.training_queue.seconds)
        overlapped = service.training_queue.overlapped
        # the workers of `asyncio.to_thread` (the other routes' service calls): named by asyncio's loop or uvloop's
        watched = {"http": [thread], "http_workers": [t for t in threading.enumerate()
                                                      if t.name.startswith(("asyncio_", "uvloop_"))],
                   "training": [t for t in threading.enumerate() if t.name == "symbiosis-training"]}
        group_cpu = lambda: {name: sum(task_cpu_s(t.native_id) for t in group) for name, group in watched.items()}  # noqa: E731
        cpu, graphs_at_start = group_cpu(), _graph_counts(service.trainer)
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        outcomes = [json.loads(child.stdout.read().strip().splitlines()[-1]) for child in children]
        cpu = {name: seconds_ - cpu[name] for name, seconds_ in group_cpu().items()}
        passes = service.training_queue.passes - passes  # (a few after the window, as clients finish their step)
        overlapped = service.training_queue.overlapped - overlapped
    finally:
        for child in children:
            if len(outcomes) < len(children):  # failed: nobody waits for the others
                child.kill()
            child.wait()
    if any(child.returncode != 0 for child in children):
        raise RuntimeError(f"an SDK client process failed, exit status {[c.returncode for c in children]} (its "
                           "traceback, if any, is above)")
    trained, wall = sum(t for t, _, _ in outcomes), max(w for _, w, _ in outcomes)
    result = {"tokens_per_s": trained / wall, "datums_per_pass": trained / length / max(1, passes),
              "overlapped_share": round(overlapped / max(1, passes), 3),  # passes in flight beside the next's gather
              "peak_gib": peak_gib(), "client_processes": processes,
              # each client process's CPU seconds over its window: near 1, its interpreter is what bounds the run
              "client_cpu_share": [round(cpu / w, 2) for _, w, cpu in outcomes],
              "runner_share": _runner_share(service.training_queue, seconds, wall),
              # the service's threads' CPU a tenant's iteration (4 requests): the HTTP server's, its workers' (the
              # submissions' checks and writes) and the trainer's share one interpreter, so their sum bounds the
              # iterations a second
              "cpu_ms_per_iteration": {name: round(1e3 * seconds_ / max(1, trained // length), 3)
                                       for name, seconds_ in cpu.items()},
              **_graph_counts(service.trainer, graphs_at_start), "http_processes": http_processes}
    stop_http()
    service.close()
    del service
    _release_gpu()
    return result


def _sdk_key(index: int) -> str:
    return f"tml-tenant-{index:04d}-0123456789"


def sdk_tenants(url: str, indices: list[int], rank: int, length: int, duration: float, vocab: int,
                loop: str = "together") -> tuple[int, float, float]:
    """`through_sdk`'s client processes: tenants `indices`, each a thread with its own `tinker.ServiceClient`.
    Returns (tokens, seconds, this process's CPU seconds in them)."""
    import tinker
    from tinker import types

    def start_tenant(index: int):
        index = indices[index]
        generator = torch.Generator().manual_seed(index)
        client = tinker.ServiceClient(base_url=url, api_key=_sdk_key(index))
        training = client.create_lora_training_client(base_model="base", rank=rank, seed=index, **PARTS).result()

        def iteration(sequential: bool) -> list:
            tokens = _tokens(vocab, length, generator)
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length})
            backward = training.forward_backward([datum], "cross_entropy")
            if sequential:
                backward.result()
            update = training.optim_step(types.AdamParams(learning_rate=1e-4))
            return [backward.result, update.result]

        tenant_loop = Loop(loop, iteration)
        return tenant_loop.step, lambda: (tenant_loop.finish(), client.close("success"))

    cpu_at_go = []

    def wait_for_go() -> None:  # every tenant of this process warm: say so, and open the window when told
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            raise RuntimeError("no go")
        cpu_at_go.append(time.process_time())

    trained, wall = drive(len(indices), start_tenant, length, duration, on_start=wait_for_go)
    return trained, wall, time.process_time() - cpu_at_go[0]


def compiled_peft(model_dir: Path, batch: int, length: int, duration: float) -> dict:
    """One PEFT job, torch.compile'd, at batch x length tokens a step: tokens/s and peak memory."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from common import fit_step, lora, transformers_loss

    reset_peak()
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype(), device_map=device()),
                           lora("lora_r16_qkvo_a32"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loss_fn = transformers_loss(torch.compile(model))
    ids = lambda: torch.randint(3, model.config.vocab_size, (batch, length), device=device())  # noqa: E731
    for _ in range(3):
        fit_step(loss_fn, optimizer, ids())
    sync()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < duration:
        fit_step(loss_fn, optimizer, ids())
        steps += 1
    sync()
    result = {"tokens_per_s": steps * batch * length / (time.perf_counter() - start), "peak_gib": peak_gib()}
    del model, optimizer
    _release_gpu()
    return result


def peft_fleet(model_dir: Path, jobs: int, length: int, duration: float) -> dict | None:
    """`jobs` eager PEFT processes (benchmarks/tenant.py), one per tenant, batch 1 x length; None if they do not
    fit."""
    from fleet import run_fleet

    specs = [dict(model_dir=model_dir, lora="lora_r16_qkvo_a32", batch_size=1, seq_len=length, mode="plain",
                  name=f"peft{i}") for i in range(jobs)]
    try:
        results, gpu = run_fleet(specs, duration)
    except RuntimeError as e:
        print(f"{jobs} PEFT processes: {e}", flush=True)
        return None
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in results), "gpu_gib": gpu.used_gib}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS))
    parser.add_argument("--tenants", default="8,16,32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--paths", default="engine,sdk", help="engine (the Python API), sdk (tinker over HTTP)")
    parser.add_argument("--fleet", default="8,16", help="PEFT process fleets to run (empty: none)")
    parser.add_argument("--sdk-client", help=argparse.SUPPRESS)
    parser.add_argument("--sdk-processes", type=int, default=1, help="the SDK tenants' processes")
    parser.add_argument("--http-processes", default="0", help="the SDK runs' HTTP layouts, comma-separated: 0, in "
                        "the service's process; N, behind N front processes (symbiosis serve --http-processes)")
    parser.add_argument("--switch-interval", type=float, help="the service process's sys.setswitchinterval (the "
                                                                  "GIL's hand-over) for the SDK runs")
    parser.add_argument("--batch", type=int, default=1, help="datums of seq-len tokens a tenant's step (the "
                                                                 "Python API's runs)")
    parser.add_argument("--devices", help="the base's layers over these GPUs (cuda:0,cuda:1; the Python API's "
                                          "runs and --anatomy), a pass pipelined over them in micro-batches")
    parser.add_argument("--replicas", help="a copy of the base on each of these GPUs (cuda:0,cuda:1), the tenants "
                                           "spread over them (the Python API's and the SDK's runs: --train-devices)")
    parser.add_argument("--gather-fraction", type=float, help="the training queue's wait for the models it "
                                                                 "expects back, as a fraction of the last pass (the "
                                                                 "SDK's runs; default: the queue's)")
    parser.add_argument("--micro-batch-tokens", type=int,
                        help="tokens a micro-batch at least, over --devices (default: the trainer's)")
    parser.add_argument("--max-pass-tokens", type=int, help="the training queue's pass size (default: every "
                                                             "tenant's step)")
    parser.add_argument("--head-in-torch", action="store_true",
                        help="the frozen head's loss gradient by the torch reference, not the Triton kernels "
                             "(kernels/softmax_grad.py): the baseline of the kernels")
    parser.add_argument("--loop", default="together", choices=("sequential", "together", "ahead"),
                        help="each tenant's loop (both paths): wait for each request before the next; send an "
                             "iteration's forward_backward and optim_step, then wait for both (tinker-cookbook's); "
                             "send the next iteration before waiting for the last (Loop)")
    parser.add_argument("--no-peft", action="store_true", help="leave out the compiled PEFT jobs")
    parser.add_argument("--anatomy", action="store_true", help="also time one pass of 1 and of the most tenants "
                                                                    "alone (wall and GPU milliseconds)")
    parser.add_argument("--profile", help="write a torch.profiler table of passes and optimizer steps of the most "
                                          "tenants alone here (and run nothing else)")
    args = parser.parse_args()
    if args.sdk_client:  # through_sdk's tenants: a spec, then (tokens trained, seconds) on stdout
        print(json.dumps(sdk_tenants(**json.loads(args.sdk_client))), flush=True)
        # no interpreter teardown: with several SDK clients' background threads it aborted now and then (SIGABRT,
        # no message; 2 runs in 6 on this CPU), after the result was out
        os._exit(0)
    model_dir = checkpoint(args.model)
    vocab = CONFIGS[args.model]["vocab_size"]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    common = dict(bench="hosted_training", model=args.model, rank=args.rank, seq_len=args.seq_len, gpu=gpu,
                  loop=args.loop)
    counts = [int(n) for n in args.tenants.split(",")]
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
        common["switch_interval"] = args.switch_interval
    if args.head_in_torch:
        from symbiosis.kernels import softmax_grad

        softmax_grad._use_triton = lambda t: False
        common["head"] = "torch"
    devices = args.devices.split(",") if args.devices else None
    if args.profile:
        emit(**common, system="symbiosis pass alone, profiled", tenants=max(counts),
             **pass_anatomy(model_dir, max(counts), args.rank, args.seq_len, vocab, repeats=1, profile=args.profile,
                            devices=devices, micro_batch_tokens=args.micro_batch_tokens))
        return
    for n in sorted({1, max(counts)}) if args.anatomy else []:
        emit(**common, system="symbiosis pass alone", tenants=n,
             **pass_anatomy(model_dir, n, args.rank, args.seq_len, vocab, devices=devices,
                            micro_batch_tokens=args.micro_batch_tokens))
    for n in counts:
        if "engine" in args.paths:
            emit(**common, system="symbiosis engine API", tenants=n,
                 **engine_api(model_dir, n, args.rank, args.seq_len, args.duration, vocab, args.batch, devices,
                              args.max_pass_tokens, args.micro_batch_tokens,
                              args.replicas.split(",") if args.replicas else None, args.loop))
        for fronts in (map(int, args.http_processes.split(",")) if "sdk" in args.paths else ()):
            emit(**common, system="symbiosis tinker SDK over HTTP", tenants=n,
                 **through_sdk(model_dir, n, args.rank, args.seq_len, args.duration, vocab, args.sdk_processes,
                               args.replicas.split(",") if args.replicas else None, args.gather_fraction,
                               args.loop, fronts))
    if not args.no_peft:
        emit(**common, system="PEFT compiled, one job", batch=1,
             **compiled_peft(model_dir, 1, args.seq_len, args.duration))
        emit(**common, system="PEFT compiled, one job (batching ceiling)", batch=max(counts),
             **compiled_peft(model_dir, max(counts), args.seq_len, args.duration))
    for jobs in [int(n) for n in args.fleet.split(",") if n]:
        fleet = peft_fleet(model_dir, jobs, args.seq_len, args.duration)
        emit(**common, system="PEFT processes, eager", tenants=jobs, **(fleet or {"fits": False}))


if __name__ == "__main__":
    main()
