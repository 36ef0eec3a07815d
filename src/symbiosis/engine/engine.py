"""The hosted inference engine: many requests, each with its own adapter or none, decoded together.

    engine = Engine.from_pretrained("path/to/model", device="cuda", dtype=torch.bfloat16, tokenizer=tokenizer)
    engine.start()                                       # a thread that steps while there is work
    handle = engine.submit(prompt_ids, SamplingParams(max_tokens=64), adapter=("alice/support", "/adapters/a"))
    for token in handle: ...                             # tokens as they are made
    completion = handle.result()

One step: the scheduler picks chunks (decodes and prefill pieces, under the token budget), `StepBatch` lays them out
(grouped by adapter) and builds the indices every layer reads, the model runs once over all of them (base layers
on the executor's weights + SGMV LoRA; paged attention), the sampled rows' logits choose one token per finished
chunk. A request that fails (NaN logits, a cancelled stream) ends alone; the others go on.

Steps overlap: the host schedules, lays out and launches step t+1 while the device still runs step t, and only then
waits for step t's tokens (`_InFlight`). A decode of t+1 reads its input token, sampled by t, from the device
(`last_tokens`); a request that step t ends (a stop token) has run one row of t+1 for nothing, which is dropped.
So the host's own time per step (laying out the batch, launching a graph, reading tokens, streaming text) is spent
beside the device's, not after it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from symbiosis.engine import graphs, layers, sampling, stops
from symbiosis.engine.adapters import AdapterStore
from symbiosis.engine.batch import Staging, StepBatch
from symbiosis.engine.kv import BlockPool, PagedKV
from symbiosis.engine.params import SamplingParams
from symbiosis.engine.scheduler import Request, Scheduler
from symbiosis.errors import BadCall, SymbiosisError
from symbiosis.worker import Worker


log = logging.getLogger(__name__)


class GenerationError(SymbiosisError):
    """One request could not go on: its logits were NaN or Inf (`retryable` False: the same request would fail
    again), or the step running it failed or the engine closed (`retryable` True)."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


@dataclass
class Token:
    """One generated token, as streamed: its id, the text it adds (with a tokenizer), its log-probabilities."""
    id: int
    text: str = ""
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Completion:
    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (a stop token or string) or "length" (max_tokens)
    logprobs: list[Token] = field(default_factory=list)
    preemptions: int = 0


class Finished:
    """The last event of a request: why it ended ("stop", "length", "cancelled"), or the error that ended it."""

    def __init__(self, reason: str | None, error: Exception | None = None):
        self.reason, self.error = reason, error


class RequestHandle:
    """A submitted request: iterate for its tokens as they come, or wait for `result()`."""

    def __init__(self, request: Request, engine: "Engine"):
        self.request, self._engine = request, engine
        self._tokens: list[Token] = []
        self._finished: Finished | None = None

    @property
    def id(self) -> str:
        return self.request.id

    def __iter__(self):
        return self._tokens_until(None)

    def _tokens_until(self, deadline: float | None):
        while self._finished is None:
            try:
                event = self.request.events.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"request {self.id} did not finish in time") from None
            if isinstance(event, Finished):
                self._finished = event
            else:
                self._tokens.append(event)
                yield event
        if self._finished.error is not None:
            raise self._finished.error

    def result(self, timeout: float | None = None) -> Completion:
        """The whole completion; `TimeoutError` if it has not finished within `timeout` seconds."""
        for _ in self._tokens_until(None if timeout is None else time.monotonic() + timeout):
            pass
        request = self.request
        return Completion(request.id, len(request.prompt), list(request.output), request.text,
                          self._finished.reason, list(self._tokens) if request.params.logprobs is not None else [],
                          request.preemptions)

    def cancel(self) -> None:
        self.request.cancelled = True
        self._engine._wake()


def _experts_on_device(executor) -> bool:
    """Whether every MoE projection of `executor` runs as one grouped GEMM with its offsets on the device (and every
    expert is in such a group)."""
    groups = executor.weights.experts.values()
    grouped = sum(group.num_experts for group in groups)
    experts = sum(layer.spec.expert is not None for layer in executor.weights.layers.values())
    return grouped == experts and all(
        group.runs_on_device_offsets(torch.empty(0, group.spec.in_features, device=executor.device,
                                                 dtype=executor.dtype)) for group in groups)


@dataclass
class _InFlight:
    """A launched step whose tokens the host has not read."""
    number: int
    requests: list[Request]  # of its sampled chunks, in row order
    choices: sampling.Launched


class Engine:
    def __init__(self, model_path, executor, tokenizer=None, *, kv_blocks: int = 512, block_size: int = 64,
                 max_batch_tokens: int = 512, max_running: int = 64, max_lora_rank: int = 64, adapter_slots: int = 8,
                 adapter_host_bytes: int = 4 << 30, adapter_device_bytes: int | None = None, decode_graphs: bool | None = None, compile_layers: bool | None = None,
                 admit_batch: int | None = None):
        """An engine over `executor` (an in-process `symbiosis.Executor` of `model_path`): its model shares
        the executor's base weights. KV pool: `kv_blocks` blocks of `block_size` tokens. Adapters: `adapter_slots` on the device (or as many as
        `adapter_device_bytes` holds), up to `adapter_host_bytes` of them in host memory (engine/adapters.py). `decode_graphs`
        (default: on a GPU) replays decode steps from CUDA graphs; on the CPU it runs them padded, eagerly.
        `compile_layers` (default: with decode graphs on a GPU) runs those steps' decoder layers compiled
        (engine/compiled.py). `admit_batch`: while requests run, waiting ones join that many at a time
        (engine/scheduler.py; default an eighth of `max_running`)."""
        self.device, self.dtype, self.tokenizer = executor.device, executor.dtype, tokenizer
        if self.device.type == "cuda" and (block_size < 16 or block_size & (block_size - 1)):
            raise ValueError(f"on a GPU the KV block size must be a power of two of at least 16 (flex_attention's "
                             f"key tiles divide it), not {block_size}")
        self.pool = BlockPool(kv_blocks, block_size)
        self.kv = PagedKV(self.pool, self.device, self.dtype)
        # A MoE model's experts (client/experts.py) run as grouped GEMMs on the engine's thread. Where the groups'
        # offsets stay on the device (torch's grouped GEMM: Hopper, bf16) no step reads the routing back to the host
        # and a decode step can be recorded as a graph; elsewhere each step's rows per expert are host numbers
        # that a recorded graph cannot replay. Graphs of MoE steps are asked for, not the default: not yet run on a
        # GPU.
        experts = any(layer.spec.expert is not None for layer in executor.weights.layers.values())
        if decode_graphs and experts and not _experts_on_device(executor):
            raise ValueError("decode graphs cannot replay this mixture-of-experts model's routing (its tokens per "
                             "expert are read back to the host each step: no grouped GEMM for its experts on this "
                             "device and dtype); use decode_graphs=False")
        if decode_graphs is None:
            decode_graphs = self.device.type == "cuda" and not experts
        if compile_layers is None:
            compile_layers = self.device.type == "cuda" and not experts
        self.compile_layers = decode_graphs and compile_layers
        self.state = layers.StepState()
        self.model, modules, groups, embedding, vocabulary = layers.build(model_path, executor, self.state, self.kv,
                                                                          self.compile_layers)
        self.config = self.model.config.get_text_config()
        self.adapters = AdapterStore(modules, embedding, executor.fingerprint, self.device, self.dtype, max_lora_rank,
                                     adapter_slots, adapter_host_bytes, vocabulary_weights=vocabulary, groups=groups,
                                     device_bytes=adapter_device_bytes)
        layers.attach_pools(self.model, self.adapters)
        admit_batch = max(1, max_running // 8) if admit_batch is None else admit_batch
        if max_batch_tokens < 1 or max_running < 1 or not 1 <= admit_batch <= max_running:
            raise ValueError("max_batch_tokens and max_running must be positive, admit_batch in 1..max_running")
        self.scheduler = Scheduler(self.pool, self.adapters, max_batch_tokens, max_running, admit_batch)
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        self.context_limit = getattr(self.config, "max_position_embeddings", None)
        # pages one request may hold: the width of each step's block tables (fixed, so graphs keep their shapes)
        self.max_pages = min(kv_blocks, self.pool.blocks_for(self.context_limit or kv_blocks * block_size))
        self._incoming: list[Request] = []
        self._worker = Worker("symbiosis-engine", self.has_work, self._work)
        self._lock = self._worker.lock
        # Held by whoever steps, all through a step but its wait for the device (`_await`): the placer thread, which
        # places the adapters of requests that arrive during that wait (`_place_arrivals`), takes it to touch what a
        # step touches. Order: `_stepping` before `_lock`, never the other way.
        self._stepping = threading.Lock()
        self._arrivals = threading.Event()  # set by `submit` for a request whose adapter is not on the device
        self._placer: threading.Thread | None = None
        self._placer_stopping = False
        # set while the engine's thread, its wait over, waits for `_stepping`: the placer stops between placements
        # then, so that the next launch waits for one placement at most (the rest go after it, in `_prefetch`)
        self._wants_stepping = False
        self._awaiting = False  # set while the engine's thread waits for the device with `_stepping` let go
        self.steps = 0
        # Whether a reader's `events` with `put_quietly` and `flush` (the service's, serve/generation.py) is woken
        # only as the engine's thread is about to wait for the device, once for a step's events, not at the first
        # of them: a reader on another thread of this process then takes the GIL while the device runs, not in the
        # middle of the next step's launch; its tokens come one launch later, or before the launch if that is an
        # eager step's (a prefill's: ~10x a replayed decode's host time). H100, Llama-3-8B, 64 adapters at
        # saturation: inter-token p50 0.3-0.4 ms lower through HTTP in each of 6 pairs of runs, tokens/s +4-8%
        # (docs/PERFORMANCE.md section 9)
        self.defer_wakeups = True
        self._quiet: dict[int, object] = {}  # id -> events put to quietly since their last flush
        self.graphs = graphs.DecodeGraphs(self._decode_logits, self.device) if decode_graphs else None
        # the sampled tokens of the latest step, where the next step's decodes read their input
        self.last_tokens = torch.zeros(max_running, dtype=torch.long, device=self.device)
        self._in_flight: _InFlight | None = None
        # Steps go to the GPU on a stream of their own, of the highest priority. Beside a training pass (the
        # service's jobs, hosted training: ~1 s of kernels launched at once on their thread's stream) a step's
        # kernels are then scheduled as the GPU frees room, instead of queueing behind every kernel the pass
        # launched before them (H100: inter-token p99 1.26 s beside 8 jobs on one stream, PERFORMANCE section 11).
        self.stream = torch.cuda.Stream(self.device, priority=-100) if self.device.type == "cuda" else None
        self.staging = Staging() if self.device.type == "cuda" else None  # the steps' index arrays' pinned memory
        if self.stream is not None:  # what was made above, on the current stream, before the first step reads it
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    @classmethod
    def from_pretrained(cls, model_path, device="cpu", dtype=None, tokenizer=None, **options) -> "Engine":
        from symbiosis.executor.executor import Executor

        return cls(model_path, Executor.from_pretrained(model_path, device=device, dtype=dtype), tokenizer, **options)

    # -- submitting (any thread) --

    def submit(self, prompt: list[int], params: SamplingParams | None = None, adapter: tuple[str, str] | None = None,
               request_id: str | None = None, events=None, owner: str | None = None) -> RequestHandle:
        """Queue one request. `adapter`: (name, PEFT directory), read and checked now (an error here is this
        request's alone); None: the base model. `events`: where the engine's thread puts the request's `Token`s
        and then one `Finished` (any object with `put`; default a queue.Queue that the handle reads). `owner`:
        whose it is (the service's tenant): waiting requests of several owners are admitted in turns."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        vocab = self.model.get_input_embeddings().weight.shape[0]
        if not prompt:
            raise BadCall("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise BadCall(f"the prompt holds token ids outside the vocabulary (0..{vocab - 1})")
        total = len(prompt) + params.max_tokens
        if self.context_limit is not None and total > self.context_limit:
            raise BadCall(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the model's "
                          f"context of {self.context_limit} tokens")
        capacity = self.pool.num_blocks * self.pool.block_size
        if total > capacity:
            raise BadCall(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the engine's whole "
                          f"KV cache of {capacity} tokens")
        if params.stop and self.tokenizer is None:
            raise BadCall("stop strings need an engine with a tokenizer")
        host_adapter = None if adapter is None else self.adapters.load(*adapter)
        generator = None
        if params.temperature > 0 and params.seed is not None:  # (without a seed: the device's default generator)
            generator = torch.Generator(self.device)
            generator.manual_seed(params.seed)
        request = Request(request_id or uuid.uuid4().hex, prompt, params, host_adapter, generator, owner=owner)
        if events is not None:
            request.events = events
        with self._lock:
            self._incoming.append(request)
            self._lock.notify()
        if host_adapter is not None and self._placer is not None and not self.adapters.placed(host_adapter):
            self._arrivals.set()
        return RequestHandle(request, self)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 adapters: list | None = None) -> list[Completion]:
        """Run these requests together to the end (stepping here if no engine thread runs)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        handles = [self.submit(p, q, a) for p, q, a in zip(prompts, params_list, adapters or [None] * len(prompts))]
        if not self._worker.running:
            while self.has_work():
                self.step()
        return [h.result() for h in handles]

    # -- stepping (the engine's thread) --

    def has_work(self) -> bool:
        return bool(self._incoming or self.scheduler.waiting or self.scheduler.running or self._in_flight)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def step(self) -> int:
        """Launch one step, then read the tokens of the step launched before it; returns how many tokens the new
        step runs."""
        with self._stepping, self._on_stream():
            return self._step()

    def _step(self) -> int:
        with self._lock:
            incoming, self._incoming = self._incoming, []
        for request in incoming:
            self.scheduler.add(request)
        for request in [r for r in self.scheduler.running + self.scheduler.waiting if r.cancelled]:
            self._end(request, Finished("cancelled"))
        chunks = self.scheduler.schedule()
        if self._quiet and chunks and not self._replays(chunks):
            self._wake_readers()  # not after an eager launch (see defer_wakeups)
        previous, self._in_flight = self._in_flight, None
        ran = self._launch(chunks) if chunks else 0
        self._prefetch()
        self._wake_readers()  # (the last step's events) while this thread waits for the device in `_read`
        if previous is not None:
            self._await(previous)
            self._read(previous)
        if self._in_flight is None:  # nothing to wait for: at once
            self._wake_readers()
        return ran

    def _put(self, request: Request, event) -> None:
        events = request.events
        quietly = getattr(events, "put_quietly", None) if self.defer_wakeups else None
        if quietly is None:
            events.put(event)
            return
        quietly(event)
        self._quiet[id(events)] = events

    def _wake_readers(self) -> None:
        quiet, self._quiet = self._quiet, {}
        for events in quiet.values():
            events.flush()

    def _await(self, step: _InFlight) -> None:
        """Wait for `step`'s tokens with `_stepping` let go: the placer may place arrivals' adapters meanwhile."""
        if self._placer is None:
            return
        self._awaiting = True
        self._stepping.release()
        try:
            step.choices.wait()
        finally:
            self._wants_stepping = True
            self._stepping.acquire()
            self._wants_stepping = self._awaiting = False

    def _place_arrivals(self) -> None:
        """The placer thread. A request that arrives while the engine's thread waits for the device (most of a
        replayed decode step) came after that step's `_prefetch`: its adapter would be placed by the next step's
        admission, on that launch's path (~1 ms of host time for a 91 MB adapter on an H200, the whole of what a new
        adapter added to its first step: docs/PERFORMANCE.md section 12). Here it is placed during the wait; the placer
        stops between placements once the wait is over (`_wants_stepping`), leaving the rest to the engine's thread.
        It places nothing while the engine's thread is not waiting for the device (idle, say): admission does it
        then, on that thread, no later, and faster (H200, a 91 MB adapter: ~0.08 ms on a running thread, ~0.43 ms on
        one just woken, as this one is: docs/PERFORMANCE.md section 12)."""
        while True:
            self._arrivals.wait()
            if self._placer_stopping:
                return
            self._arrivals.clear()
            with self._stepping, self._on_stream():  # (a pool made by a placement: on the steps' stream, as theirs)
                if self._placer_stopping:
                    return
                if not self._awaiting:
                    continue
                try:
                    self._prefetch(until=lambda: self._wants_stepping)
                except Exception:  # noqa: BLE001 -- its placement is left to admission, which fails that request
                    log.exception("placing an arriving request's adapter failed; admission will place it")

    def _prefetch(self, until=None) -> None:
        """While the step just launched runs: place the adapters of the requests that may join the next one (those
        waiting, then those arrived since this step took them in, as many as may be admitted), so that their
        placement is not on the next launch's path (docs/PERFORMANCE.md section 12); stopping between placements
        once `until()` says so."""
        room = self.scheduler.max_running - len(self.scheduler.running)
        if room <= 0:
            return
        with self._lock:
            arrived = list(self._incoming)
        adapters = [r.adapter for r in itertools.chain(self.scheduler.waiting, arrived)
                    if r.adapter is not None and not r.cancelled]
        if adapters:
            self.adapters.prefetch(adapters[:room], until)

    def _launch(self, chunks: list) -> int:
        """Queue the step on the device (its sampled tokens become `_in_flight`); returns its token count, 0 if it
        failed (its requests fail with it)."""
        try:
            with torch.inference_mode():
                batch, logits = self._forward(chunks)
                requests = [c.request for c in batch.sampled_chunks]
                choices = sampling.launch(logits, requests) if requests else None
                if choices is not None:
                    self.last_tokens[:len(requests)].copy_(choices.tokens)
        except Exception as e:  # noqa: BLE001 -- the step's requests fail with it; the engine goes on
            for chunk in chunks:
                self._end(chunk.request, Finished(None, GenerationError(f"the step running request "
                                                                          f"{chunk.request.id} failed: {e}")))
            return 0
        finally:  # a placement into these slots waits for what was queued (a failed step's kernels too)
            self.adapters.read_by({c.slot for c in chunks if c.slot is not None})
        self.steps += 1
        for chunk in chunks:
            chunk.request.computed = chunk.start + len(chunk.tokens)
        for row, request in enumerate(requests):
            request.in_flight_row, request.in_flight_step = row, self.steps
        if requests:
            self._in_flight = _InFlight(self.steps, requests, choices)
        return batch.num_tokens

    def _forward(self, chunks: list) -> tuple[StepBatch, torch.Tensor]:
        """The step's batch and the logits of its sampled rows. A step of one-token decodes only is replayed from
        a recorded graph (engine/graphs.py) unless an adapter has embedding LoRA (read with host indices)."""
        layout = (self.pool.block_size, self.pool.num_blocks, self.max_pages, self.device)
        if self._replays(chunks):
            self.adapters.wait_all()  # a graph cannot wait layer by layer (adapters.py)
            rows = graphs.bucket(len(chunks))
            batch = StepBatch(chunks, *layout, padded_rows=rows, staging=self.staging)
            key = (rows, batch.token_segments is not None, self.adapters.pools_version)
            return batch, self.graphs.run(key, batch)[:len(chunks)]
        if not self.adapters.layerwise:
            self.adapters.wait_all()
        batch = StepBatch(chunks, *layout, staging=self.staging)
        return batch, self._logits(batch)

    def _replays(self, chunks: list) -> bool:
        """Whether the step of `chunks` is replayed from a graph (one-token decodes alone), not run eagerly."""
        return self.graphs is not None and self.adapters.embedding_pool is None and \
            all(len(c.tokens) == 1 and c.sample for c in chunks)

    def _decode_logits(self, batch: StepBatch) -> torch.Tensor:
        return self._logits(batch, compiled=self.compile_layers)

    def _logits(self, batch: StepBatch, compiled: bool = False) -> torch.Tensor:
        # decodes whose input token the step before sampled read it where that step left it, on the device
        input_ids = torch.where(batch.previous_rows >= 0, self.last_tokens[batch.previous_rows.clamp(min=0)],
                                batch.input_ids)
        with self.state.running(batch, compiled):
            return self.model(input_ids=input_ids[None], position_ids=batch.positions[None],
                              logits_to_keep=batch.sample_rows, use_cache=False).logits[0]

    def _read(self, step: _InFlight) -> None:
        """Take in the tokens `step` sampled (waiting for them); rows of requests that ended since are dropped."""
        try:
            choices = step.choices.read(step.requests)
        except Exception as e:  # noqa: BLE001 -- as a failed launch: its requests fail, the engine goes on
            choices = [e] * len(step.requests)
        for request, choice in zip(step.requests, choices):
            if request.in_flight_step == step.number:
                request.in_flight_row = request.in_flight_step = None
            if request.finished:
                continue
            if isinstance(choice, Exception):
                self._end(request, Finished(None, GenerationError(f"the step running request {request.id} "
                                                                  f"failed: {choice}")))
                continue
            if choice is None:
                self._end(request, Finished(None, GenerationError(
                    f"request {request.id}: the model's logits are NaN or Inf at output token "
                    f"{len(request.output)}; the request is stopped", retryable=False)))
                continue
            request.output.append(choice.token)
            reason = stops.stop_reason(request, choice.token, self.tokenizer, self.eos_ids)
            text = stops.new_text(request, final=reason is not None)
            self._put(request, Token(choice.token, text, choice.logprob, choice.top_logprobs))
            if reason is not None:
                self._end(request, Finished(reason))

    def _end(self, request: Request, finished: Finished) -> None:
        """The request leaves: its blocks and adapter slot go back now, though the step in flight may still run a
        row of it (it writes and reads only the request's own blocks, before any later step on the device reuses
        them; adapter copies wait for the steps before them: AdapterStore._place)."""
        if finished.reason not in ("stop", "length"):  # failed or cancelled: its KV may not be finite
            self.kv.scrub(request.blocks)
        self.scheduler.finish(request)
        request.finished = True
        self._put(request, finished)

    def warm_up(self) -> float:
        """Before the engine's thread starts: run, for every row bucket up to `max_running`'s, a prefill step and a
        decode step of that many base-model requests (two-token prompts, two tokens out), so that the compiled
        attention of both layouts, the compiled decoder layers and the decode graphs of those shapes are made now
        and not on the first requests that meet them (H100, Llama-3.2-1B, the service's first 96 requests at 8/s:
        TTFT p50 17.7 s without, ~25 compilations of 2-3 s each; the third pass of the same requests 0.45 s).
        Adapters' steps still compile their own decoder-layer code at first use. Returns the seconds it took."""
        if self._worker.running:
            raise RuntimeError("warm the engine up before its thread starts")
        started, rows = time.perf_counter(), 1
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        while rows < 2 * self.scheduler.max_running:
            self.generate([[0, 0]] * min(rows, self.scheduler.max_running), params)
            rows *= 2
        return time.perf_counter() - started

    # -- the engine's thread --

    def start(self) -> "Engine":
        if self._placer is None:
            self._placer_stopping = False
            self._placer = threading.Thread(target=self._place_arrivals, name="symbiosis-engine-placer", daemon=True)
            self._placer.start()
        self._worker.start()
        return self

    def _wake(self) -> None:
        self._worker.wake()

    def _work(self) -> None:
        if self.step() == 0 and not self._incoming:
            time.sleep(0.001)  # work that cannot run yet (blocks or adapter slots in use): let others finish

    def close(self) -> None:
        if self._placer is not None:
            self._placer_stopping = True
            self._arrivals.set()
            self._placer.join()
            self._placer = None
        self._worker.stop()
        self._in_flight = None
        with self._on_stream():  # after the steps still on it (a failed request's KV is scrubbed)
            for request in self.scheduler.running + self.scheduler.waiting + self._incoming:
                self._end(request, Finished(None, GenerationError("the engine was closed")))
        self._wake_readers()
