"""HMI's lifecycle on the service (HMI §4-5): domains and tenant models over PLOT tables.

- a **domain** (version N of a tenant's name): further pre-training of the lower layers on the tenant's corpus
  (from version N-1's, or the base's), then its table of the top alpha% n-grams over the service's root table;
- a **model** (version N): a LoRA adapter on the upper layers, trained on the PLOT representations of a domain
  version (or of the root alone), from version N-1's adapter; it answers `generate` with lookups for the lower
  layers and the upper layers on the executor's weights (a split client: no copy of the base).

Long steps run one at a time on a worker thread, their stage and progress in the database; at start, whatever was
queued or running is queued again and resumes from its checkpoint (further pre-training and adapter training from
their last saved step, a table build from its last chunk). Deleting a domain stops its step; a model built on it
then answers with an error that says so. The admin's domains are everyone's to build on; the rest are their
tenant's alone.
"""

from __future__ import annotations

import itertools
import logging
import queue
import re
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from symbiosis.errors import SymbiosisError
from symbiosis.plot import Generation, LowerLayers, Plot, PlotTable, UpperModel, build_table, generate_many
from symbiosis.plot.build import Stopped
from symbiosis.plot.train import Schedule, further_pretrain, train_adapter
from symbiosis.serve.errors import ApiError
from symbiosis.serve.hmi.store import DOMAINS_TABLE, KEY, MODELS_TABLE, HmiStore
from symbiosis.worker import Worker

log = logging.getLogger("symbiosis.serve.hmi")
NAME = re.compile(r"(?=.*[A-Za-z0-9])[A-Za-z0-9._-]{1,64}")  # not dots alone: URLs fold "." and ".." away
ADMIN = "admin"
LIMITS = {"steps": (1, 100_000), "batch_size": (1, 256), "window": (8, 8192), "rank": (1, 256)}


MAX_BATCH = 32  # generations in one batch
SLICE_S = 30.0  # a long step's turn while another tenant's waits (pre-training, a table's build, training)
# what a tenant's domains may hold: their tables' bytes together (a table holds up to n(n+1)/2 vectors a corpus
# token: 25 kB of random words made 37 MB), and their versions (each keeps its lower layers' weights)
TABLE_BYTES_PER_TENANT = 8 << 30
DOMAIN_VERSIONS_PER_TENANT = 32
# a tenant's model versions (each keeps its adapter, rank at most 256 on the upper layers, and queues a training)
MODEL_VERSIONS_PER_TENANT = 64
MAX_WAITING_PER_TENANT = 256  # a tenant's generations waiting at once: past it a 429 (each holds its lookups)


@dataclass(eq=False)
class _Waiting:
    """A generation request waiting for the generator thread: its model version's row, what to generate, where the
    tokens go."""
    row: dict
    generation: Generation
    answer: Future


def _round_robin(waiting: list[_Waiting]) -> list[_Waiting]:
    """The waiting generations with their tenants taking turns (each tenant's in arrival order)."""
    by_tenant: dict[str, list[_Waiting]] = {}
    for item in waiting:
        by_tenant.setdefault(item.row["tenant"], []).append(item)
    turns = max((len(items) for items in by_tenant.values()), default=0)
    return [items[turn] for turn in range(turns) for items in by_tenant.values() if turn < len(items)]


def _number(body: dict, key: str, default, kind=int, low=None, high=None):
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"{key} must be a number", key)
    low, high = LIMITS.get(key, (low, high))
    if not low <= value <= high:
        raise ApiError(400, f"{key} must be in {low}..{high}", key)
    return kind(value)


class HmiService:
    def __init__(self, service, root: str | Path, min_corpus_tokens: int = 10_000, loaded_adapters: int = 64):
        self.service, self.store = service, HmiStore(service.state)
        self.root = PlotTable.open(root)
        self.lower_layers, self.min_corpus_tokens = self.root.lower_layers, min_corpus_tokens
        self.directory = service.state.directory / "hmi"
        self.loaded_adapters = loaded_adapters
        self.max_table_bytes, self.max_domain_versions = TABLE_BYTES_PER_TENANT, DOMAIN_VERSIONS_PER_TENANT
        self.max_model_versions = MODEL_VERSIONS_PER_TENANT
        self._tables: dict[str, PlotTable] = {}
        self._upper = self._new_upper(probe=True)  # checks the cut is exact for this model; the generator's alone
        if (self.root.kind, self.root.vocab, self.root.hidden) != (self._upper.kind, self._config.vocab_size,
                                                                    self._config.hidden_size):
            raise SymbiosisError(f"the PLOT root table {root} was built for another model")
        self._adapters: OrderedDict[str, None] = OrderedDict()  # model ids loaded in the shared upper model
        # generations wait here; the generator thread runs those waiting as one batch (each its tables and adapter)
        self._waiting: list[_Waiting] = []
        self._generator = Worker("symbiosis-hmi-generate", lambda: bool(self._waiting), self._generate_batch)
        self._tasks: queue.Queue = queue.Queue()
        self._stopping: set[str] = set()  # ids whose step should stop (deleted, or the service closing)
        self._backlog: list[tuple[str, str, str]] = []  # the worker's: (table, id, tenant) taken from _tasks, queued
        self._progressed = False  # the step running reported progress in its turn (`_stop`)
        self._slice_ends = float("inf")  # the worker's: when the step running yields to another tenant's waiting
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="symbiosis-hmi", daemon=True)
        for table in (DOMAINS_TABLE, MODELS_TABLE):
            for row in self.store.unfinished(table):  # under way when the service stopped: goes on
                self.store.update(table, self._id(table, row), status="queued")
                self._tasks.put((table, self._id(table, row), row["tenant"]))

    @property
    def _config(self):
        return self.service.engine.config

    @property
    def _context(self) -> int | None:
        """The model's context in tokens (None: it names none): bounds prompts and training lines alike."""
        return getattr(self._config, "max_position_embeddings", None)

    def _new_upper(self, probe: bool = False) -> UpperModel:
        """The upper layers as a split client of the service's executor (their weights are the executor's)."""
        import symbiosis

        executor = self.service.executor
        model = symbiosis.from_pretrained(self.service.model_path, executor, device=executor.device, name="hmi")
        return UpperModel(self.service.model_path, self.lower_layers, executor.device, executor.dtype, probe=probe,
                          model=model)

    @staticmethod
    def _id(table: str, row: dict) -> str:
        return row[KEY[table]]

    def start(self) -> None:
        self._thread.start()
        self._generator.start()

    def close(self) -> None:
        self._generator.stop()
        with self._generator.lock:
            waiting, self._waiting = self._waiting, []
        for generation in waiting:
            generation.answer.set_exception(ApiError(503, "the service is shutting down", None, "unavailable"))
        self._closing = True
        self._tasks.put(None)
        if self._thread.is_alive():
            self._thread.join(120)

    # -- requests (HTTP threads) --

    def _name(self, body: dict) -> str:
        name = body.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ApiError(400, "name must be 1-64 of [A-Za-z0-9._-], at least one a letter or digit", "name")
        return name

    def _texts(self, tenant: str, file_id, param: str) -> list[dict]:
        from symbiosis.train.data import check_lines, parse_text_line

        jobs = self.service.jobs
        row = jobs.file(tenant, str(file_id), "hmi", param)
        return check_lines((jobs.files_root / row["path"]).read_bytes(), parse_text_line)

    def _tokens(self, texts: list[str]) -> list[list[int]]:
        return self.service.tokenizer(texts)["input_ids"]

    def create_domain(self, tenant: str, body: dict, name: str | None = None) -> dict:
        """A new domain (`name` None) or a new version of the tenant's domain `name`, from an uploaded corpus."""
        if name is None:
            name = self._name(body)
            if self.store.versions(DOMAINS_TABLE, tenant, name):
                raise ApiError(400, f"you have a domain {name!r} already; add a version to it", "name")
        elif not (versions := self.store.versions(DOMAINS_TABLE, tenant, name)):
            raise ApiError(404, f"you have no domain {name[:80]!r}", "name", "domain_not_found")
        elif versions[0]["status"] in ("queued", "running"):  # a version starts from the one before, when ready
            raise ApiError(409, f"domain {name!r} version {versions[0]['version']} is {versions[0]['status']}")
        count, held = self.store.domain_usage(tenant)
        if count >= self.max_domain_versions or held >= self.max_table_bytes:
            raise ApiError(400, f"your domains hold {count} versions and {held} bytes of tables; at most "
                                f"{self.max_domain_versions} versions and {self.max_table_bytes} bytes may be kept: "
                                "delete some first", "name", "quota_exceeded")
        corpus = self._texts(tenant, body.get("corpus_file"), "corpus_file")
        tokens = sum(len(t) for t in self._tokens([line["text"] for line in corpus]))
        if tokens < self.min_corpus_tokens:
            raise ApiError(400, f"the corpus holds {tokens} tokens; a domain is built from at least "
                                f"{self.min_corpus_tokens}", "corpus_file", "corpus_too_small")
        options = {"alpha": _number(body, "alpha", 50.0, float, 0, 100),
                   "learning_rate": _number(body, "learning_rate", 1e-4, float, 1e-8, 1.0),
                   "steps": _number(body, "steps", 100), "batch_size": _number(body, "batch_size", 8),
                   "window": _number(body, "window", 128)}
        row = self.store.add(DOMAINS_TABLE, tenant, name, corpus_file=body["corpus_file"], options=options)
        self._tasks.put((DOMAINS_TABLE, row["domain_id"], tenant))
        return self.domain_object(row)

    def _domain_version(self, tenant: str, name: str, version=None) -> dict:
        """The newest ready version (or `version`) of the tenant's domain `name`, else of the admin's."""
        for owner in (tenant, ADMIN):
            rows = [r for r in self.store.versions(DOMAINS_TABLE, owner, name) if r["status"] == "ready"
                    and (version is None or r["version"] == version)]
            if rows:
                return rows[0]
        raise ApiError(404, f"no ready domain {str(name)[:80]!r}" + ("" if version is None else f" version {version}"),
                       "domain", "domain_not_found")

    def create_model(self, tenant: str, body: dict, name: str | None = None) -> dict:
        """A new model (`name` None: over `domain`, or the root when it is null) or a new version of the tenant's
        model `name` (over the same domain version, from the previous version's adapter)."""
        if name is None:
            name = self._name(body)
            if self.store.versions(MODELS_TABLE, tenant, name):
                raise ApiError(400, f"you have a model {name!r} already; add a version to it", "name")
            domain, version = body.get("domain"), body.get("domain_version")
            if version is not None and (type(version) is not int or version < 1):  # noqa: E721 -- (true == 1)
                raise ApiError(400, "domain_version must be a version number (1, 2, ...)", "domain_version")
            domain_id = None if domain is None else self._domain_version(tenant, str(domain), version)["domain_id"]
            options = {"learning_rate": _number(body, "learning_rate", 1e-3, float, 1e-8, 1.0),
                       "steps": _number(body, "steps", 100), "batch_size": _number(body, "batch_size", 8),
                       "rank": _number(body, "rank", 16)}
        else:
            versions = self.store.versions(MODELS_TABLE, tenant, name)
            if not versions:
                raise ApiError(404, f"you have no model {name[:80]!r}", "name", "model_not_found")
            if versions[0]["status"] != "ready":
                raise ApiError(409, f"model {name!r} version {versions[0]['version']} is {versions[0]['status']}")
            domain_id, options = versions[0]["domain_id"], dict(versions[0]["options"])
            options["steps"] = _number(body, "steps", options["steps"])
        if (count := self.store.count(MODELS_TABLE, tenant)) >= self.max_model_versions:
            raise ApiError(400, f"your models hold {count} versions; at most {self.max_model_versions} may be kept: "
                                "delete some first", "name", "quota_exceeded")
        lines = self._texts(tenant, body.get("training_file"), "training_file")
        limit = self._context
        longest = max((len(ids) for ids in self._tokens([line["text"] for line in lines])), default=0)
        if limit is not None and longest > limit:  # (a step's work and memory grow with its longest line)
            raise ApiError(400, f"a line of training_file holds {longest} tokens, past the model's context of {limit}",
                           "training_file")
        row = self.store.add(MODELS_TABLE, tenant, name, domain_id=domain_id, training_file=body["training_file"],
                             options=options)
        self._tasks.put((MODELS_TABLE, row["model_id"], tenant))
        return self.model_object(row)

    def listing(self, table: str, tenant: str) -> list[dict]:
        owners = (tenant,) if tenant == ADMIN or table == MODELS_TABLE else (tenant, ADMIN)
        describe = self.domain_object if table == DOMAINS_TABLE else self.model_object
        return [describe(row) for row in self.store.names(table, owners)]

    def versions(self, table: str, tenant: str, name: str) -> dict:
        rows = self.store.versions(table, tenant, name)
        if not rows and table == DOMAINS_TABLE:
            rows = self.store.versions(table, ADMIN, name)
        if not rows:
            raise ApiError(404, f"no {'domain' if table == DOMAINS_TABLE else 'model'} {name[:80]!r}", "name")
        describe = self.domain_object if table == DOMAINS_TABLE else self.model_object
        return {**describe(rows[0]), "versions": [describe(r) for r in rows]}

    def delete(self, table: str, tenant: str, name: str) -> dict:
        rows = self.store.delete(table, tenant, name)
        if not rows:
            raise ApiError(404, f"you have no {'domain' if table == DOMAINS_TABLE else 'model'} {name[:80]!r}", "name")
        for row in rows:
            row_id = self._id(table, row)
            self._stopping.add(row_id)
            self._tables.pop(row_id, None)
            if row["status"] != "running":  # a running step removes its own files when it stops
                shutil.rmtree(self._dir(table, row_id), ignore_errors=True)
        return {"name": name, "deleted": True, "versions": len(rows)}

    def generate(self, tenant: str, name: str, body: dict) -> tuple[Future, Callable[[list[int]], dict]]:
        """Greedy tokens after `prompt` from the newest ready version of the tenant's model `name`: (the tokens'
        future, what makes the answer of them). The caller waits for the future without holding a thread (a
        worker thread each waiting generation held was every sync route's pool)."""
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string", "prompt")
        max_tokens = _number(body, "max_tokens", 16, int, 1, 1024)
        ready = [r for r in self.store.versions(MODELS_TABLE, tenant, name) if r["status"] == "ready"]
        if not ready:
            raise ApiError(404, f"you have no ready model {name[:80]!r}", "model", "model_not_found")
        row = ready[0]
        plot = self._plot(row)
        ids = self._tokens([prompt])[0]
        limit = self._context
        if limit is not None and len(ids) + max_tokens > limit:
            raise ApiError(400, f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context "
                                f"of {limit}", "max_tokens")
        # the prompt's lookups here, on the request's thread: beside the batch the generator is running
        generation = Generation(plot, ids, max_tokens, row["model_id"], plot.represent([ids])[0])
        waiting = _Waiting(row, generation, Future())
        with self._generator.lock:
            if not self._generator.running:
                raise ApiError(503, "the service is shutting down", None, "unavailable")
            if sum(w.row["tenant"] == tenant for w in self._waiting) >= MAX_WAITING_PER_TENANT:
                raise ApiError(429, f"you have {MAX_WAITING_PER_TENANT} generations waiting, the limit; retry when "
                                    "some are answered", None, "rate_limit_exceeded")
            self._waiting.append(waiting)
            self._generator.lock.notify()
        return waiting.answer, lambda tokens: {"object": "hmi.generation", "model": name, "version": row["version"],
                                               "tokens": tokens, "text": self.service.tokenizer.decode(tokens)}

    def _generate_batch(self) -> None:
        """The generator thread: the generations waiting, as one batch (at most MAX_BATCH, and no more models than
        `loaded_adapters`), each row with its own tables and adapter; a failure fails that batch's requests."""
        with self._generator.lock:
            batch, models = [], set()
            for waiting in _round_robin(self._waiting):  # tenants in turn: a flood of one waits behind the others
                model = waiting.row["model_id"]
                if len(batch) < MAX_BATCH and (model in models or len(models) < self.loaded_adapters):
                    batch.append(waiting)
                    models.add(model)
            self._waiting = [w for w in self._waiting if w not in batch]
        loaded = []
        for waiting in batch:  # an adapter that cannot be loaded (its model deleted meanwhile) fails its own request
            try:
                self._load(waiting.row)
                loaded.append(waiting)
            except Exception as error:  # noqa: BLE001
                waiting.answer.set_exception(error)
        batch = loaded
        if not batch:
            return
        self.service.metrics.hmi_batch.observe(len(batch))
        try:  # each answered once its own tokens are done, not when the batch's longest is
            generate_many(self._upper, [waiting.generation for waiting in batch],
                          done=lambda row, tokens: batch[row].answer.set_result(list(tokens)))
        except Exception as error:  # noqa: BLE001 -- this batch's unanswered requests get the error; the thread goes on
            log.exception("an HMI generation batch of %d failed", len(batch))
            for waiting in batch:
                if not waiting.answer.done():
                    waiting.answer.set_exception(error)

    def _plot(self, row: dict) -> Plot:
        domain_id = row["domain_id"]
        if domain_id is None:
            return Plot(self.root)
        domain = self.store.get(DOMAINS_TABLE, domain_id)
        if domain is None:
            raise ApiError(400, f"model {row['name']!r} version {row['version']} was built on a domain version that "
                                "has been deleted; train a new model on another domain", "model", "domain_deleted")
        if domain_id not in self._tables:
            self._tables[domain_id] = PlotTable.open(self._dir(DOMAINS_TABLE, domain_id) / "table")
        return Plot(self.root, self._tables[domain_id])

    def _load(self, row: dict) -> None:
        """Load `row`'s adapter into the shared upper model under its model id, if it is not there, evicting the
        least recently used beyond `loaded_adapters` (never one of the batch at hand: it holds no more models)."""
        import peft

        adapter_id, directory = row["model_id"], self._dir(MODELS_TABLE, row["model_id"]) / "adapter"
        model = self._upper.model
        if adapter_id not in self._adapters:
            if isinstance(model, peft.PeftModel):
                model.load_adapter(directory, adapter_name=adapter_id)
            else:
                self._upper.model = model = peft.PeftModel.from_pretrained(model, directory, adapter_name=adapter_id)
            self._adapters[adapter_id] = None
            model.eval()  # PEFT's batches of several adapters are for inference
        self._adapters.move_to_end(adapter_id)
        while len(self._adapters) > self.loaded_adapters:
            model.delete_adapter(self._adapters.popitem(last=False)[0])

    # -- the worker thread --

    def _dir(self, table: str, row_id: str) -> Path:
        return self.directory / ("domains" if table == DOMAINS_TABLE else "models") / row_id

    def _take_tasks(self, block: bool) -> bool:
        """Move what was queued into the backlog (waiting for one if `block` and there is none); False once the
        service is closing."""
        while True:
            if self._closing:  # (its None may have been taken by a step's check: close() sets this first)
                return False
            try:
                task = self._tasks.get(block=block and not self._backlog)
            except queue.Empty:
                return True
            if task is None or self._closing:
                return False
            self._backlog.append(task)

    def _next_task(self, turns: dict[str, int]) -> tuple[str, str, str]:
        """The backlog's next step: of the tenant whose last turn is oldest (none yet: first), each tenant's in the
        order queued."""
        task = min(self._backlog, key=lambda t: turns.get(t[2], -1))
        self._backlog.remove(task)
        return task

    def _others_waiting(self, tenant: str) -> bool:
        self._take_tasks(block=False)
        return any(other != tenant for _, _, other in self._backlog)

    def _work(self) -> None:
        """The long steps, one at a time, tenants taking turns: a step that has run SLICE_S while another tenant's
        waits stops at its next checkpoint (it saves one there) and is queued again behind it, so one tenant's
        100,000-step model does not hold every other tenant's one-step model for half an hour."""
        turns: dict[str, int] = {}  # tenant -> the number of its last turn
        for turn in itertools.count():
            if not self._take_tasks(block=True):
                return
            table, row_id, tenant = task = self._next_task(turns)
            turns[tenant] = turn
            row = self.store.get(table, row_id)
            if row is None or row["status"] != "queued":
                continue
            self.store.update(table, row_id, status="running")
            self._slice_ends, self._progressed = time.monotonic() + SLICE_S, False
            try:
                (self._build_domain if table == DOMAINS_TABLE else self._train_model)(row)
            except Stopped:
                if not self._closing and row_id not in self._stopping and self.store.get(table, row_id) is not None:
                    self.store.update(table, row_id, status="queued")  # its turn is over: behind the others
                    self._backlog.append(task)
                continue  # deleted (cleaned up below), or closing: queued again at the next start
            except Exception as e:  # noqa: BLE001 -- this step fails alone; the others go on
                log.exception("HMI %s %s failed", table, row_id)
                if self.store.get(table, row_id) is not None:
                    self.store.update(table, row_id, status="failed", error=self.service.public(f"{type(e).__name__}: {e}"),
                                      finished_at=int(time.time()))
            finally:
                self._stopping.discard(row_id)
                if self.store.get(table, row_id) is None:  # deleted while it ran: nothing of it stays
                    shutil.rmtree(self._dir(table, row_id), ignore_errors=True)

    def _reporter(self, table: str, row_id: str, stage: str):
        self.store.update(table, row_id, stage=stage, done=0, total=0)

        def report(done: int, total: int, *_):
            self._progressed = True  # a turn ends only after some progress: setup alone may outlast SLICE_S
            self.store.update(table, row_id, done=done, total=total)
        return report

    def _stop(self, row_id: str, tenant: str):
        """Whether the step running should stop now: deleted, the service closing, or its turn over."""
        return lambda: self._closing or row_id in self._stopping or \
            (self._progressed and time.monotonic() > self._slice_ends and self._others_waiting(tenant))

    def _build_domain(self, row: dict) -> None:
        row_id, options = row["domain_id"], row["options"]
        directory = self._dir(DOMAINS_TABLE, row_id)
        corpus = self._tokens([line["text"] for line in self._texts(row["tenant"], row["corpus_file"], "corpus_file")])
        executor = self.service.executor
        lower_file = directory / "lower.safetensors"
        if not lower_file.is_file():
            previous = [r for r in self.store.versions(DOMAINS_TABLE, row["tenant"], row["name"])
                        if r["version"] < row["version"] and r["status"] == "ready"]
            start = load_file(self._dir(DOMAINS_TABLE, previous[0]["domain_id"]) / "lower.safetensors") \
                if previous else None
            schedule = Schedule(steps=options["steps"], learning_rate=options["learning_rate"],
                                batch_size=options["batch_size"], window=options["window"])
            lower = further_pretrain(self.service.model_path, self.lower_layers, corpus, directory, schedule,
                                     start=start, mask_token_id=self.service.tokenizer.mask_token_id,
                                     device=executor.device, dtype=executor.dtype,
                                     progress=self._reporter(DOMAINS_TABLE, row_id, "pretraining"),
                                     stop=self._stop(row_id, row["tenant"]))
            save_file(lower, directory / "lower.tmp")
            (directory / "lower.tmp").replace(lower_file)
        lower = LowerLayers(self.service.model_path, self.lower_layers, executor.device, executor.dtype,
                            state_dict=load_file(lower_file))
        table = build_table(lower, corpus, directory / "table", n=self.root.n, alpha=options["alpha"], root=self.root,
                            dtype=self.root.meta["dtype"], max_bytes=self.max_table_bytes -
                            self.store.domain_usage(row["tenant"])[1],
                            progress=self._reporter(DOMAINS_TABLE, row_id, "building"),
                            stop=self._stop(row_id, row["tenant"]))
        shutil.rmtree(directory / "state", ignore_errors=True)
        self.store.update(DOMAINS_TABLE, row_id, status="ready", stage=None, finished_at=int(time.time()),
                          entries={str(k): v for k, v in table.entries().items()}, table_bytes=table.nbytes)

    def _train_model(self, row: dict) -> None:
        import peft

        row_id, options = row["model_id"], row["options"]
        if row["domain_id"] is not None and self.store.get(DOMAINS_TABLE, row["domain_id"]) is None:
            raise SymbiosisError("its domain version was deleted before it could train")
        plot = self._plot(row)
        lines = self._texts(row["tenant"], row["training_file"], "training_file")
        examples = [(tokens, None) for tokens in self._tokens([line["text"] for line in lines])]
        previous = [r for r in self.store.versions(MODELS_TABLE, row["tenant"], row["name"])
                    if r["version"] < row["version"] and r["status"] == "ready"]
        start = self._dir(MODELS_TABLE, previous[0]["model_id"]) / "adapter" if previous else None
        config = peft.LoraConfig(r=options["rank"], lora_alpha=2 * options["rank"], target_modules="all-linear",
                                 task_type="CAUSAL_LM")
        schedule = Schedule(steps=options["steps"], learning_rate=options["learning_rate"],
                            batch_size=options["batch_size"])
        train_adapter(self._new_upper(), plot, examples, self._dir(MODELS_TABLE, row_id), schedule, config, start=start,
                      progress=self._reporter(MODELS_TABLE, row_id, "training"),
                      stop=self._stop(row_id, row["tenant"]))
        shutil.rmtree(self._dir(MODELS_TABLE, row_id) / "state", ignore_errors=True)
        self.store.update(MODELS_TABLE, row_id, status="ready", stage=None, finished_at=int(time.time()))

    # -- objects --

    def domain_object(self, row: dict) -> dict:
        return {"id": row["domain_id"], "object": "hmi.domain", "name": row["name"], "owner": row["tenant"],
                "version": row["version"], "status": row["status"], "error": row["error"],
                "progress": {"stage": row["stage"], "done": row["done"], "total": row["total"]},
                "alpha": row["options"]["alpha"], "entries": row["entries"], "table_bytes": row["table_bytes"],
                "created_at": row["created_at"], "finished_at": row["finished_at"]}

    def model_object(self, row: dict) -> dict:
        domain = None if row["domain_id"] is None else self.store.get(DOMAINS_TABLE, row["domain_id"])
        return {"id": row["model_id"], "object": "hmi.model", "name": row["name"], "version": row["version"],
                "status": row["status"], "error": row["error"],
                "progress": {"stage": row["stage"], "done": row["done"], "total": row["total"]},
                "domain": None if row["domain_id"] is None else
                ({"name": domain["name"], "version": domain["version"]} if domain else "deleted"),
                "created_at": row["created_at"], "finished_at": row["finished_at"]}
