"""Files and fine-tuning jobs (OpenAI's API) on the service's hosted training.

A job: its files are checked (validating_files), tokenized, its hyperparameters resolved (queued); it runs when a
place is free (at most `max_running_jobs`, and `max_running_jobs_per_tenant` of one tenant), on a thread of its own
whose LoRA steps join the shared training queue's passes (every tenant's jobs and Tinker clients together) or, for
other PEFT methods, as a split client of the shared executor (train/job.py). Its events and checkpoints go to the
store as they come; the checkpoints (and the final adapter) are served by the engine at once as
`ft:BASE:SUFFIX:JOB_ID[:ckpt-step-N]`.

Durable: a job's state is its newest checkpoint; when the service stops (or is killed) every job that was
validating, queued or running is queued again at the next start and resumes from there, ending with the adapter
an uninterrupted run would have. A job that cannot go on (bad data found late, a NaN loss, out of memory) ends
`failed` with the reason; the others go on.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
import threading
import time
import uuid
from pathlib import Path

import torch

from symbiosis.client.adapter_files import PATTERN_KEY, check_pattern_keys
from symbiosis.serve.errors import ApiError, not_found
from symbiosis.serve.jobs.store import JobStore
from symbiosis.train.data import DataError, check_lines, parse_line, parse_text_line, tokenize
from symbiosis.train.job import BASE_LEARNING_RATE, HostedBackend, Hyperparameters, JobFailed, JobRunner, SplitBackend
from symbiosis.train.lora import MAX_RANK, LoraSpec

log = logging.getLogger("symbiosis.serve.jobs")
SUFFIX = re.compile(r"[A-Za-z0-9._-]{1,40}")
ACTIVE = ("validating_files", "queued", "running")
# what a file of each purpose holds: fine-tuning examples (chat or prompt/completion); texts (and labels) for HMI's
# domain corpora and tasks (serve/hmi/)
PURPOSES = {"fine-tune": parse_line, "hmi": parse_text_line}
# the keys a LoRA config may hold for the batched trainer; any other (dropout, DoRA, biases, ...) runs on a split client
HOSTED_LORA_KEYS = {"r", "lora_alpha", "target_modules", "use_rslora", "lora_dropout", "task_type"}
# A tenant's PEFT config is hostile input: PEFT reads some fields as files or hub repositories to load (a tokenizer,
# a pickled state dict, other adapters), some as sizes of what it allocates. A config must be plain JSON of bounded
# size; the fields that load anything are refused, and those that size the trained tensors are bounded.
LOADING_FIELDS = re.compile(r"path|tokenizer|^adapters$|_config$")  # files, hub repos, nested configs (LoftQ, EVA, ...)
REGEX_FIELDS = {"layers_pattern", "exclude_modules"}  # strings PEFT runs as regular expressions
SAFE_INITS = {"prompt_tuning_init": {"RANDOM", "SAMPLE_VOCAB"}, "init_lora_weights": {True, False, "gaussian"}}
MODEL_SIZES = {"token_dim", "num_transformer_submodules", "num_attention_heads", "num_layers"}  # PEFT's, from the model
SIZE_BOUNDS = {"num_virtual_tokens": 1024, "encoder_hidden_size": 8192, "encoder_num_layers": 8, "num_tasks": 256,
               "num_ranks": 64, "num_vectors": 4096, "shadow_hidden_size": 8192, "shadow_intermediate_size": 32768,
               "shadow_num_attention_heads": 64, "shadow_num_hidden_layers": 8, "update_hidden_size": 8192,
               "xlora_size": 8192, "hidden_size": 8192, "adapter_len": 1024, "adapter_layers": 256}
MAX_FILE_CHECKS = 2
MAX_FILES_PER_TENANT = 1000  # what one tenant may keep uploaded (files and bytes): the service's disk is shared
MAX_FILE_BYTES_PER_TENANT = 16 << 30


def _peft_config(method: str, options: dict):
    """A PEFT config for `method` (a PEFT type's name, or rslora / dora) and its options; ApiError(400) naming
    what is wrong."""
    import peft

    from symbiosis.client.peft_support import EXACT, REFUSED

    name = method.lower()
    extra = {"rslora": {"use_rslora": True}, "dora": {"use_dora": True}}.get(name, {})
    kind = "LORA" if extra else name.upper()
    if kind in REFUSED or kind not in EXACT:
        raise ApiError(400, f"PEFT method {method!r} is not one this service trains (it trains "
                            f"{', '.join(sorted(m.lower() for m in EXACT))}, rslora and dora)", "peft.method")
    _check_peft_options(options)
    config_class = peft.PEFT_TYPE_TO_CONFIG_MAPPING[kind]
    defaults = {"LORA": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}}.get(kind, {})
    try:
        config = config_class(**{**defaults, **options, **extra, "task_type": "CAUSAL_LM"})
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"peft.config for {method}: {e}", "peft.config") from None
    # a rank's memory is the service's: bounded whichever path trains it (VeRA's r is its shared projections',
    # usually 256-1024; OFT's r 0 means "by block size")
    most = 4 * MAX_RANK if kind in ("VERA", "PVERA") else MAX_RANK
    ranks = [(field, getattr(config, field, None)) for field in ("r", "init_r", "target_r")]
    ranks += [(f"rank_pattern.{key}", rank) for key, rank in (getattr(config, "rank_pattern", None) or {}).items()]
    for field, rank in ranks:
        if rank is not None and (type(rank) is not int or not 0 <= rank <= most):  # noqa: E721 -- not bools
            raise ApiError(400, f"peft.config.{field} must be an integer in 0..{most}", f"peft.config.{field}")
    return config


def _check_peft_options(options: dict) -> None:
    """ApiError(400) for a PEFT config field that is not plain bounded JSON, loads anything, or sizes a tensor past
    its bound (LOADING_FIELDS, SAFE_INITS, MODEL_SIZES, SIZE_BOUNDS)."""
    def plain(value, depth: int = 0) -> bool:
        if value is None or isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value)):
            return True
        if isinstance(value, str):
            return len(value) <= 1024
        if isinstance(value, list):
            return depth < 2 and len(value) <= 4096 and all(plain(v, depth + 1) for v in value)
        if isinstance(value, dict):  # rank_pattern and the like: module name -> a number
            return depth == 0 and len(value) <= 4096 and all(isinstance(k, str) and len(k) <= 1024 and plain(v, 2)
                                                             for k, v in value.items())  # (at 2: no list, no dict)
        return False

    for field, value in options.items():
        where = f"peft.config.{str(field)[:80]}"
        if not plain(value):
            raise ApiError(400, f"{where}: a config holds numbers (finite), booleans, strings of at most 1024 "
                                "characters and short lists of them", where)
        if LOADING_FIELDS.search(field):
            raise ApiError(400, f"{where}: a field that loads files, repositories or further configs is not taken "
                                "(the service gives PEFT the base model itself)", where)
        if field in SAFE_INITS and (not isinstance(value, (str, bool)) or value not in SAFE_INITS[field]):
            raise ApiError(400, f"{where} must be one of {sorted(map(str, SAFE_INITS[field]))}", where)
        if isinstance(value, dict):  # rank_pattern, alpha_pattern: PEFT matches their keys as regular expressions
            try:
                check_pattern_keys(value, where)
            except ValueError as e:
                raise ApiError(400, str(e), where) from None
        if field in REGEX_FIELDS and any(isinstance(v, str) and not PATTERN_KEY.fullmatch(v)
                                         for v in (value if isinstance(value, list) else [value])):
            raise ApiError(400, f"{where}: module names only (1-256 of [A-Za-z0-9_.-]; PEFT would run it as a "
                                "regular expression)", where)
        if field == "target_modules" and isinstance(value, str) and value != "all-linear":
            raise ApiError(400, f"{where}: a list of module names, or 'all-linear' (a regular expression is not "
                                "taken: the service's LoRA trainer and PEFT would read it differently)", where)
        if field in MODEL_SIZES:
            raise ApiError(400, f"{where} is the base model's, set by the service", where)
        if field in SIZE_BOUNDS and (type(value) is not int or not 0 <= value <= SIZE_BOUNDS[field]):  # noqa: E721
            raise ApiError(400, f"{where} must be an integer in 0..{SIZE_BOUNDS[field]}", where)


def _hosted_spec(config, seed: int) -> LoraSpec | None:
    """The batched trainer's LoraSpec for a plain LoRA config (no dropout, no DoRA, nothing else), else None."""
    from peft import LoraConfig, PeftType

    if not isinstance(config, LoraConfig) or config.peft_type != PeftType.LORA:
        return None
    given = {k for k, v in config.to_dict().items() if v != getattr(LoraConfig(), k, v)}
    if config.lora_dropout or config.use_dora or given - HOSTED_LORA_KEYS - {"peft_type"}:
        return None
    modules = config.target_modules
    modules = (modules,) if isinstance(modules, str) else tuple(sorted(modules))
    return LoraSpec(rank=config.r, seed=seed, alpha=float(config.lora_alpha), rslora=bool(config.use_rslora),
                    modules=modules)


class JobService:
    def __init__(self, service, max_running_jobs: int = 8, max_running_jobs_per_tenant: int = 2,
                 checkpoint_every: int = 50):
        self.service, self.store = service, JobStore(service.state)
        self.files_root = service.state.directory / "files"
        self.jobs_root = service.state.directory / "jobs"
        self.max_running, self.max_per_tenant = max_running_jobs, max_running_jobs_per_tenant
        self.checkpoint_every = checkpoint_every
        self.max_files, self.max_file_bytes = MAX_FILES_PER_TENANT, MAX_FILE_BYTES_PER_TENANT
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._asked: dict[str, str] = {}  # job id -> "pause" / "cancel" / "shutdown"
        # jobs whose files are checked and tokenized at once (CPU work beside the engine's thread: however many
        # jobs tenants create, the engine gives up no more than this many threads' share of the interpreter)
        self._checking = threading.BoundedSemaphore(MAX_FILE_CHECKS)
        self._closing = False
        for job in self.store.jobs_in(*ACTIVE):  # what was under way when the service stopped goes on
            self.store.update_job(job["job_id"], status="validating_files")
            self.store.add_event(job["job_id"], "The service restarted: the job goes on from its last checkpoint")

    def start(self) -> None:
        for job in self.store.jobs_in("validating_files"):
            self._validate_later(job)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            for job_id in self._threads:
                self._asked[job_id] = "shutdown"
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(120)

    # -- files --

    def upload(self, tenant: str, filename: str, purpose: str, data: bytes) -> dict:
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose {purpose!r} is not supported ({', '.join(PURPOSES)})", "purpose")
        if not filename or len(filename) > 255 or "/" in filename or "\\" in filename or "\x00" in filename:
            raise ApiError(400, "a file name of 1-255 characters, without slashes", "file")
        if not filename.endswith(".jsonl"):
            raise ApiError(400, "a training file is a .jsonl file (one JSON example per line)", "file")
        count, held = self.store.file_usage(tenant)
        if count >= self.max_files or held + len(data) > self.max_file_bytes:
            raise ApiError(400, f"you hold {count} files of {held} bytes; at most {self.max_files} files and "
                                f"{self.max_file_bytes} bytes may be kept: delete some first", "file",
                           "quota_exceeded")
        try:
            examples = check_lines(data, PURPOSES[purpose])
        except DataError as e:
            raise ApiError(400, f"{filename}: {e}", "file", "invalid_file") from None
        relative = f"{uuid.uuid4().hex}.jsonl"
        self.files_root.mkdir(parents=True, exist_ok=True)
        (self.files_root / relative).write_bytes(data)
        return self.file_object(self.store.add_file(tenant, filename, purpose, len(data), relative, len(examples)))

    @staticmethod
    def file_object(row: dict) -> dict:
        return {"id": row["file_id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
                "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
                "status_details": None}

    def file(self, tenant: str, file_id: str, purpose: str | None = None, param: str = "file_id") -> dict:
        """The tenant's file (404 if it has none of that id); 400 unless it was uploaded for `purpose`."""
        row = self.store.file(tenant, file_id)
        if row is None:
            raise ApiError(404, f"No such File object: {file_id[:80]}", param, "file_not_found")
        if purpose is not None and row["purpose"] != purpose:
            raise ApiError(400, f"file {file_id} was uploaded for {row['purpose']!r}, not {purpose!r}", param)
        return row

    def file_content(self, tenant: str, file_id: str) -> bytes:
        return (self.files_root / self.file(tenant, file_id)["path"]).read_bytes()

    def delete_file(self, tenant: str, file_id: str) -> None:
        row = self.file(tenant, file_id)
        self.store.delete_file(tenant, file_id)
        (self.files_root / row["path"]).unlink(missing_ok=True)

    # -- jobs --

    def create(self, tenant: str, body: dict) -> dict:
        base = self.service.base_name
        if body.get("model") != base:
            raise ApiError(400, f"this service fine-tunes {base!r}, not {str(body.get('model'))[:80]!r}", "model")
        training = self.file(tenant, str(body.get("training_file")), "fine-tune", "training_file")
        validation = body.get("validation_file")
        if validation is not None:
            self.file(tenant, str(validation), "fine-tune", "validation_file")
        suffix = body.get("suffix")
        if suffix is not None and not SUFFIX.fullmatch(str(suffix)):
            raise ApiError(400, "suffix must be 1-40 of [A-Za-z0-9._-]", "suffix")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31):
            raise ApiError(400, "seed must be an integer in [0, 2^31)", "seed")
        seed = secrets.randbelow(2**31) if seed is None else seed
        method = body.get("method") or {"type": "supervised", "supervised": {
            "hyperparameters": body.get("hyperparameters") or {}}}
        if not isinstance(method, dict) or method.get("type") != "supervised":
            raise ApiError(400, "method.type: this service runs supervised fine-tuning only", "method")
        supervised = method.get("supervised") or {}
        requested = (supervised.get("hyperparameters") if isinstance(supervised, dict) else None) or {}
        if not isinstance(supervised, dict) or not isinstance(requested, dict):
            raise ApiError(400, "method.supervised and its hyperparameters must be JSON objects", "hyperparameters")
        for name, check in (("n_epochs", lambda v: isinstance(v, int) and 1 <= v <= 50),
                            ("batch_size", lambda v: isinstance(v, int) and 1 <= v <= 256),
                            ("learning_rate_multiplier", lambda v: isinstance(v, (int, float)) and 0 < v <= 100)):
            value = requested.get(name, "auto")
            if value != "auto" and (isinstance(value, bool) or not check(value)):
                raise ApiError(400, f"method.supervised.hyperparameters.{name} must be 'auto' or in range",
                               f"hyperparameters.{name}")
        peft_request = body.get("peft") or {"method": "lora", "config": {}}
        if not isinstance(peft_request, dict) or not isinstance(peft_request.get("config", {}), dict):
            raise ApiError(400, 'peft must be {"method": NAME, "config": {...}}', "peft")
        config = _peft_config(str(peft_request.get("method", "lora")), peft_request.get("config", {}))  # checked now
        try:  # what the job's thread will make of it, so that it fails here and not there
            _hosted_spec(config, seed)
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"peft.config: {e}", "peft.config") from None
        job = self.store.add_job(tenant, model=base, training_file=training["file_id"], validation_file=validation,
                                 suffix=suffix, seed=seed, method={"type": "supervised"},
                                 peft={"method": str(peft_request.get("method", "lora")),
                                       "config": peft_request.get("config", {})},
                                 hyperparameters=requested)
        self.store.add_event(job["job_id"], f"Validating training file: {training['file_id']}")
        self._validate_later(job)
        return self.job(tenant, job["job_id"])

    def _validate_later(self, job: dict) -> None:
        threading.Thread(target=self._validate, args=(job["job_id"],), name="symbiosis-job-check", daemon=True).start()

    def _examples(self, job: dict):
        """(training, validation) examples of a job; DataError says which file and line."""
        tokenizer, context = self.service.tokenizer, self.service.engine.context_limit
        vocab = self.service.trainer.vocab
        loaded = []
        for kind in ("training", "validation"):
            file_id = job[f"{kind}_file"]
            if file_id is None:
                loaded.append(None)
                continue
            row = self.store.file(job["tenant"], file_id)
            if row is None:
                raise DataError(None, f"the {kind} file {file_id} was deleted")
            try:
                records = check_lines((self.files_root / row["path"]).read_bytes())
                loaded.append(tokenize(records, tokenizer, context, vocab))
            except DataError as e:
                raise DataError(e.line, f"{kind} file {file_id}: {e}") from None
        return loaded

    def _validate(self, job_id: str) -> None:
        job = self.store.job(None, job_id)
        try:
            with self._checking:
                training, _ = self._examples(job)
        except DataError as e:
            training, bad = None, e
        with self._lock:  # as `control`'s: a cancel that came while the files were checked stands
            if self.store.job(None, job_id)["status"] != "validating_files":
                return
            if training is None:
                param = "validation_file" if "validation file" in str(bad) else "training_file"
                return self._fail(job, f"invalid_{param}", str(bad), param)
            hyper = self.hyperparameters(job, len(training))
            total = math.ceil(len(training) / hyper.batch_size) * hyper.n_epochs
            self.store.update_job(job_id, status="queued", total_steps=total, hyperparameters={
                "n_epochs": hyper.n_epochs, "batch_size": hyper.batch_size,
                "learning_rate_multiplier": hyper.learning_rate_multiplier})
            self.store.add_event(job_id, f"Files validated; the job is queued ({len(training)} examples, {total} "
                                         "steps)")
        self._dispatch()

    @staticmethod
    def hyperparameters(job: dict, examples: int) -> Hyperparameters:
        """"auto": 3 epochs; a batch of about 0.2% of the examples (1 to 32); learning rate multiplier 1."""
        asked = job["hyperparameters"]
        value = lambda name, auto: auto if asked.get(name, "auto") == "auto" else asked[name]  # noqa: E731
        return Hyperparameters(value("n_epochs", 3), value("batch_size", max(1, min(32, round(0.002 * examples)))),
                               float(value("learning_rate_multiplier", 1.0)))

    def _fail(self, job: dict, code: str, message: str, param: str | None = None) -> None:
        self.store.update_job(job["job_id"], status="failed", finished_at=int(time.time()),
                              error={"code": code, "message": message, "param": param})
        self.store.add_event(job["job_id"], f"The job failed: {message}", level="error")

    def _dispatch(self) -> None:
        """Start queued jobs, oldest first, where there is room."""
        with self._lock:
            if self._closing:
                return
            running = [self.store.job(None, job_id)["tenant"] for job_id in self._threads]
            for job in self.store.jobs_in("queued"):
                if len(running) >= self.max_running:
                    break
                if running.count(job["tenant"]) >= self.max_per_tenant or job["job_id"] in self._threads:
                    continue
                running.append(job["tenant"])
                self.store.update_job(job["job_id"], status="running", started_at=job["started_at"] or int(time.time()))
                thread = threading.Thread(target=self._run, args=(job["job_id"],), name=f"symbiosis-{job['job_id']}",
                                          daemon=True)
                self._threads[job["job_id"]] = thread
                thread.start()

    def _run(self, job_id: str) -> None:
        job = self.store.job(None, job_id)
        backend = None
        try:
            training, validation = self._examples(job)
            hyper = self.hyperparameters(job, len(training))
            config = _peft_config(job["peft"]["method"], job["peft"]["config"])
            spec = _hosted_spec(config, job["seed"])
            if spec is not None:
                key = f"job:{job_id}"
                replicas = self.service.training_queue
                backend = HostedBackend(replicas.place(key), replicas, key, spec)
            else:
                backend = SplitBackend(self.service.model_path, self.service.executor, config, job["seed"])
            kind = config.peft_type.value if hasattr(config.peft_type, "value") else str(config.peft_type)
            rate = BASE_LEARNING_RATE["prompt" if getattr(config, "is_prompt_learning", False) else "lora"]
            if kind == "IA3":
                rate = 3e-3
            runner = JobRunner(backend, training, validation, hyper, job["seed"], rate, self.checkpoint_every,
                               self.jobs_root / job_id, job["model"], lambda kind_, **f: self._report(job, kind_, f),
                               lambda: self._asked.get(job_id))
            position = runner.resume()
            if position.step:
                self.store.add_event(job_id, f"Resumed from the checkpoint at step {position.step}")
            else:
                self.store.add_event(job_id, f"Fine-tuning job started ({spec and 'LoRA on the batched trainer' or kind + ' on a split client'})")
            outcome = runner.run(position)
        except JobFailed as e:
            self._fail(job, e.code, str(e))
        except DataError as e:
            self._fail(job, "invalid_training_file", str(e), "training_file")
        except torch.OutOfMemoryError as e:
            self._fail(job, "out_of_memory", f"the job ran out of GPU memory ({e}); try a smaller batch_size")
        except Exception as e:  # whatever it is, the job ends failed: a thread that died left it "running" for ever
            log.exception("job %s failed", job_id)
            self._fail(job, "training_failed", f"{type(e).__name__}: {e}")
        else:
            self._finished(job, outcome, len(training) and sum(len(e.tokens) for e in training) * hyper.n_epochs)
        finally:
            if backend is not None:
                backend.close()
            with self._lock:
                self._threads.pop(job_id, None)
                self._asked.pop(job_id, None)
            self._dispatch()

    def _finished(self, job: dict, outcome: str, trained_tokens: int) -> None:
        job_id, now = job["job_id"], int(time.time())
        if outcome == "succeeded":
            name = self.model_name(job)
            self.store.update_job(job_id, status="succeeded", finished_at=now, fine_tuned_model=name,
                                  trained_tokens=trained_tokens)
            self.store.add_event(job_id, f"New fine-tuned model created: {name}")
            self.store.add_event(job_id, "The job has successfully completed")
        elif outcome == "cancelled":
            self.store.update_job(job_id, status="cancelled", finished_at=now)
            self.store.add_event(job_id, "The job was cancelled")
        elif self._asked.get(job_id) == "shutdown":
            self.store.update_job(job_id, status="queued")  # goes on at the next start
        else:
            self.store.update_job(job_id, status="paused")
            self.store.add_event(job_id, "The job was paused")

    def _report(self, job: dict, kind: str, fields: dict) -> None:
        job_id = job["job_id"]
        if kind == "metrics":
            self.store.update_job(job_id, last_step=fields["step"])
            self.store.add_event(job_id, f"Step {fields['step']}/{fields['total_steps']}: training loss="
                                         f"{fields['train_loss']:.4f}", kind="metrics",
                                 data={"step": fields["step"], "train_loss": fields["train_loss"],
                                       "total_steps": fields["total_steps"], "epoch": fields["epoch"]})
        else:
            directory = fields["directory"]
            name = f"{self.model_name(job)}:ckpt-step-{fields['step']}"
            metrics = {k: v for k, v in fields["metrics"].items() if v is not None}
            self.store.add_checkpoint(job_id, fields["step"], metrics, name,
                                      str(directory.relative_to(self.jobs_root)))
            if "valid_loss" in metrics:
                self.store.add_event(job_id, f"Step {fields['step']}: validation loss={metrics['valid_loss']:.4f}",
                                     kind="metrics", data=metrics)
            self.store.add_event(job_id, f"Checkpoint created at step {fields['step']}: {name}")

    def model_name(self, job: dict) -> str:
        return f"ft:{job['model']}:{job['suffix'] or job['tenant']}:{job['job_id']}"

    def job(self, tenant: str, job_id: str) -> dict:
        row = self.store.job(tenant, job_id)
        if row is None:
            raise ApiError(404, f"No such fine-tuning job: {job_id}", "fine_tuning_job_id", "job_not_found")
        return self.job_object(row)

    def job_object(self, row: dict) -> dict:
        hyper = row["hyperparameters"]
        return {
            "id": row["job_id"], "object": "fine_tuning.job", "created_at": row["created_at"], "error": row["error"],
            "fine_tuned_model": row["fine_tuned_model"], "finished_at": row["finished_at"],
            "hyperparameters": {k: hyper.get(k, "auto") for k in ("n_epochs", "batch_size", "learning_rate_multiplier")},
            "model": row["model"], "organization_id": row["tenant"], "result_files": [], "seed": row["seed"],
            "status": row["status"], "trained_tokens": row["trained_tokens"], "training_file": row["training_file"],
            "validation_file": row["validation_file"], "estimated_finish": None, "integrations": [],
            "metadata": None, "suffix": row["suffix"],
            "method": {"type": "supervised", "supervised": {"hyperparameters": {
                k: hyper.get(k, "auto") for k in ("n_epochs", "batch_size", "learning_rate_multiplier")}}},
            "peft": row["peft"], "total_steps": row["total_steps"], "last_step": row["last_step"]}

    def jobs(self, tenant: str, after: str | None, limit: int) -> dict:
        rows = self.store.jobs(tenant, after, limit)
        return {"object": "list", "data": [self.job_object(r) for r in rows[:limit]], "has_more": len(rows) > limit}

    def control(self, tenant: str, job_id: str, action: str) -> dict:
        """cancel, pause or resume a job, as its status allows (400 otherwise)."""
        with self._lock:  # the status read and changed under the lock `_validate` and `_dispatch` change it under
            row = self.store.job(tenant, job_id)
            if row is None:
                raise ApiError(404, f"No such fine-tuning job: {job_id}", "fine_tuning_job_id", "job_not_found")
            status = row["status"]
            running = job_id in self._threads
            if action == "cancel" and status in ("validating_files", "queued", "paused", "running"):
                if running:
                    self._asked[job_id] = "cancel"
                else:
                    self.store.update_job(job_id, status="cancelled", finished_at=int(time.time()))
                    self.store.add_event(job_id, "The job was cancelled")
            elif action == "pause" and status in ("queued", "running"):
                if running:
                    self._asked[job_id] = "pause"
                else:
                    self.store.update_job(job_id, status="paused")
                    self.store.add_event(job_id, "The job was paused")
            elif action == "resume" and status == "paused" and not running:
                self.store.update_job(job_id, status="queued")
                self.store.add_event(job_id, "The job was resumed")
            else:
                raise ApiError(400, f"a {status} job cannot be {action}ed" if action != "pause" else
                               f"a {status} job cannot be paused", code="invalid_job_state")
        self._dispatch()
        return self.job(tenant, job_id)

    def events(self, tenant: str, job_id: str, after: str | None, limit: int) -> dict:
        self.job(tenant, job_id)
        rows = self.store.events(job_id, after, limit)
        return {"object": "list", "has_more": len(rows) > limit, "data": [
            {"id": r["event_id"], "object": "fine_tuning.job.event", "created_at": r["created_at"], "level": r["level"],
             "message": r["message"], "type": r["type"], "data": r["data"] or {}} for r in rows[:limit]]}

    def checkpoints(self, tenant: str, job_id: str, after: str | None, limit: int) -> dict:
        self.job(tenant, job_id)
        rows = self.store.checkpoints(job_id)
        if after is not None:
            ids = [r["checkpoint_id"] for r in rows]
            rows = rows[ids.index(after) + 1:] if after in ids else []
        return {"object": "list", "has_more": len(rows) > limit, "first_id": rows[0]["checkpoint_id"] if rows else None,
                "last_id": rows[min(limit, len(rows)) - 1]["checkpoint_id"] if rows else None, "data": [
                    {"id": r["checkpoint_id"], "object": "fine_tuning.job.checkpoint", "created_at": r["created_at"],
                     "fine_tuned_model_checkpoint": r["model_name"], "fine_tuning_job_id": job_id,
                     "metrics": r["metrics"], "step_number": r["step"]} for r in rows[:limit]]}

    def resolve(self, tenant: str, model: str) -> tuple[str, Path]:
        """(engine name, directory) of the tenant's fine-tuned model or checkpoint `model` (404 otherwise)."""
        checkpoint = self.store.checkpoint_named(tenant, model)
        if checkpoint is None:
            finished = [j for j in self.store.jobs_in("succeeded") if j["tenant"] == tenant
                        and j["fine_tuned_model"] == model]
            if not finished:
                raise not_found(model)
            checkpoints = self.store.checkpoints(finished[0]["job_id"])
            checkpoint = checkpoints[0] if checkpoints else None
            if checkpoint is None:
                raise not_found(model)
        directory = self.jobs_root / checkpoint["path"]
        if not directory.is_dir():
            raise not_found(model)
        return f"{tenant}/{model}", directory
