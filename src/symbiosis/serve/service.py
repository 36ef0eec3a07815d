"""The service: one executor (the base weights, once; split tenants may attach at `executor_listen`), the hosted
engine on it, the tenants' keys, the durable state and the adapters, as the HTTP layer uses them."""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

from symbiosis.serve.adapters import AdapterRegistry
from symbiosis.serve.dashboard import RecentRequests
from symbiosis.serve.errors import not_found
from symbiosis.serve.generation import Admission
from symbiosis.serve.keys import ApiKeys
from symbiosis.serve.metrics import Metrics
from symbiosis.serve.state import StateStore
from symbiosis.serve.templates import TemplateRenderer

log = logging.getLogger("symbiosis.serve")


class Service:
    def __init__(self, model: str | Path, state_dir: str | Path, api_keys: str | Path, *, adapter_root=None,
                 device: str = "cpu", dtype=None, executor_listen: str | None = None, served_name: str | None = None,
                 max_requests: int = 256, max_requests_per_tenant: int = 64, max_chat_tokens: int = 4096,
                 engine_options: dict | None = None, training: dict | None = None, hmi: dict | None = None):
        """`training`: hosted training's options (max_pass_tokens: tokens of one batched pass; devices: a trainer
        on each (train/replicas.py); gather_fraction: the training queue's wait for models it expects back, as a
        fraction of the last pass; the Tinker API's persist_every, keep_answers_s, resident_models, its per-tenant
        bounds and tokenizer_id; the fine-tuning jobs' max_running_jobs, max_running_jobs_per_tenant,
        checkpoint_every), or
        None for no hosted training (neither the Tinker API nor fine-tuning jobs). `hmi`: HMI's domains and models
        (serve/hmi/: root, the PLOT root table's directory; min_corpus_tokens), which need hosted training's files."""
        from transformers import AutoTokenizer

        from symbiosis.engine import Engine
        from symbiosis.executor.executor import Executor

        self.keys = ApiKeys(api_keys)
        self.state = StateStore(state_dir)
        self.model_path = Path(model)
        self.base_name = served_name or self.model_path.resolve().name
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)  # a local directory; no remote code
        self.executor = Executor.from_pretrained(self.model_path, device=device, dtype=dtype)
        self.server = None
        if executor_listen:
            from symbiosis.transport.auth import Tenants
            from symbiosis.transport.server import ExecutorServer

            # split tenants attach with the same keys they use over HTTP (one key per tenant, then)
            self.server = ExecutorServer(self.executor, executor_listen, Tenants.read(api_keys))
        self.engine = Engine(self.model_path, self.executor, self.tokenizer, **(engine_options or {}))
        self.context_limit = self.engine.context_limit or (self.engine.pool.num_blocks * self.engine.pool.block_size)
        self.max_chat_tokens = max_chat_tokens
        self.fingerprint = "fp_" + self.executor.fingerprint[:12]
        self.created = int(time.time())
        self.adapters = AdapterRegistry(adapter_root, self.state, self.engine, self.base_name)
        self.templates = TemplateRenderer(self.model_path)  # tenants' chat templates, in worker processes
        self.admission = Admission(max_requests, max_requests_per_tenant)
        self.metrics = Metrics(self.engine, self.executor)
        self.recent = RecentRequests()
        self.tinker = self.jobs = self.training_queue = self.split_generator = None
        if training is not None:
            from symbiosis.serve.jobs.service import JobService
            from symbiosis.serve.tinker.service import TinkerService
            from symbiosis.train.replicas import Replicas

            training = dict(training)
            # a trainer a device: the service's executor on its own, a copy of the base on each other one (each
            # training model lives on one: train/replicas.py)
            self.training_queue = Replicas.on_devices(
                self.model_path, training.pop("devices", None) or [self.executor.device], dtype, self.executor,
                max_pass_tokens=training.pop("max_pass_tokens", 16384),
                gather_fraction=training.pop("gather_fraction", None), answering=self.state.batch)
            # the trainer of calls that belong to no model (prompt log-probabilities)
            self.trainer = self.training_queue.trainers[0]
            tinker = {key: training.pop(key) for key in ("persist_every", "tokenizer_id", "keep_answers_s",
                                                         "resident_models", "max_models_per_tenant",
                                                         "max_checkpoint_bytes_per_tenant") if key in training}
            self.tinker = TinkerService(self, **tinker)
            self.jobs = JobService(self, **training)
        self.hmi = None
        if hmi is not None:
            if self.jobs is None:
                raise ValueError("HMI's domains and models need hosted training (its files API)")
            from symbiosis.serve.hmi.service import HmiService

            self.hmi = HmiService(self, **hmi)

    def start(self) -> "Service":
        if self.engine.device.type == "cuda":  # compile and record every step shape now, not on the first requests
            self.engine.warm_up()
        # Everything made so far (the model's modules, torch's and transformers' objects, compiled code: ~400k
        # objects on the tiny model) lives as long as the service: out of the cyclic collector's sight, or each full
        # collection walks it all, holding the GIL the engine's thread needs: 170-240 ms a time on the CPU
        # (docs/PERFORMANCE.md section 9), as vLLM's engine does after its start-up too.
        gc.collect()
        gc.freeze()
        self.engine.start()
        if self.training_queue is not None:
            self.training_queue.start()
            self.jobs.start()
        if self.hmi is not None:
            self.hmi.start()
        if self.server is not None:
            self.server.start()
        return self

    def close(self) -> None:
        if self.hmi is not None:
            self.hmi.close()
        if self.training_queue is not None:
            self.jobs.close()
            self.training_queue.stop()
            if self.tinker is not None:
                self.tinker.close()
        self.templates.close()
        self.engine.close()
        if self.server is not None:
            self.server.stop()
        self.executor.close()
        self.state.close()
        gc.unfreeze()  # what start froze may be garbage now (a process that starts services one after another)

    def model_card(self, name: str, created: float | None) -> dict:
        base = name == self.base_name
        return {"id": name, "object": "model", "created": self.created if base else int(created),
                "owned_by": "symbiosis", "root": name, "parent": None if base else self.base_name}

    def resolve(self, tenant: str, model: str) -> tuple[str, Path] | None:
        """The adapter (engine name, directory) a request's `model` names, None for the base (404 otherwise): one
        the tenant loaded, or one of its Tinker checkpoints (`tinker://...`)."""
        if model == self.base_name:
            return None
        if self.tinker is not None and model.startswith("tinker://"):
            from symbiosis.errors import BadCall

            try:
                _, directory = self.tinker.resolve(tenant, model)
            except BadCall:
                raise not_found(model) from None
            return self.tinker.engine_name(tenant, model), directory
        if self.jobs is not None and model.startswith("ft:"):
            return self.jobs.resolve(tenant, model)
        return self.adapters.lookup(tenant, model)

    def public(self, message: str) -> str:
        """An error's `message` as a tenant may see it: without where the adapter root and the state dir lie."""
        message = self.adapters.public(message)
        for directory in {str(self.state.directory.resolve()), str(self.state.directory)}:
            message = message.replace(directory, "<state dir>")
        return message

    def generator_for(self, adapter: tuple[str, str] | None):
        """What generates with `adapter`: the hosted engine (the base, LoRA adapters), or, for an adapter of another
        PEFT method (a fine-tuning job's IA3, LoHa, ...), a split client of the executor (split_generation.py)."""
        if adapter is None:
            return self.engine
        from symbiosis.errors import UnsupportedAdapter

        try:
            self.engine.adapters.load(*adapter)  # read and checked once, then cached
            return self.engine
        except UnsupportedAdapter:
            if self.split_generator is None:
                from symbiosis.serve.split_generation import SplitGenerator

                self.split_generator = SplitGenerator(self)
            return self.split_generator

    def finished(self, tenant: str, model: str, generation, distinct_prompts: int, error: bool) -> None:
        prompt_tokens = generation.prompt_tokens(distinct_prompts)
        self.state.count(tenant, model, prompt_tokens, generation.completion_tokens, error)
        self.metrics.finished(tenant, model, generation, prompt_tokens)
        self.recent.add(tenant, generation)

    def reload_keys(self) -> None:
        """SIGHUP: the API keys again, and the executor's tenants (for split tenants attaching from now on)."""
        log.info(self.keys.reload())
        if self.server is not None:
            from symbiosis.transport.auth import Tenants

            try:
                self.server.use_tenants(Tenants.read(self.keys.path))
            except (OSError, ValueError) as e:
                log.info("the executor keeps its tenants: %s", e)
