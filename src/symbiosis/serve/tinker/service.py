"""The Tinker API's work: training models (hosted LoRA adapters) trained by one queue of batched passes
(train/scheduler.py), their checkpoints, sampling sessions on the hosted engine, and answers kept durable.

Every request that names a model is accepted once per (model_id, seq_id) (a resubmission gets the same request)
and answered through the store, so an answer outlives the process. Training work runs in each model's seq order.

Durability: a model's live state (matrices, AdamW moments, steps) is written under STATE_DIR/tinker/models/ when it
is made and at every `persist_every`-th optimizer step (1: every step, before the step is answered; the write is
atomic: a new directory renamed over the old). After a restart every model comes back from it; a request accepted
and not answered before the stop fails with a server error saying so (it never runs twice, and never silently
vanishes); and a model whose last answered steps or gathered gradients were not on disk has its next request fail
with a server error naming what was lost, once, then goes on from the state on disk.

Residency: at most `resident_models` models' states (matrices, AdamW moments, gradients: on the trainer's device)
stay in memory when idle, the least recently used of the others dropped and read back from their live copy at their
next request (a start reads no model's matrices, only each live copy's step count). A model stays in memory while
a request of it holds it, running or next in its queue (its `Work` and optimizer step bind the HostedLora object
then; one waiting for an earlier seq_id binds it when the training queue comes to it, `Operation.bind`). One whose
state is newer than its live copy (persist_every > 1) is written before it is dropped, and its gradients gathered
and not yet stepped beside it (`gradients.safetensors`, read back and deleted with the model).
So a tenant's many models cost disk, not memory.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import sqlite3
import threading
import time
import uuid
from collections import Counter, OrderedDict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from symbiosis.engine import Finished, SamplingParams
from symbiosis.errors import AdapterError, BadCall, SymbiosisError
from symbiosis.serve.tinker import wire
from symbiosis.serve.tinker.paths import TinkerPath, check_name, model_directory_name, model_id as make_model_id
from symbiosis.serve.tinker.store import KEEP_ANSWERS_S, TinkerStore
from symbiosis.train import HostedLora, LoraSpec, Work
from symbiosis.train.lora import AdamParams, saved_state
from symbiosis.train.scheduler import Operation
from symbiosis.train.trainer import Datum

log = logging.getLogger("symbiosis.serve.tinker")
RESTARTED = ("the service restarted before this request was answered; it did not run and will not: "
             "submit it again")
MAX_SAMPLES = 64
# a tenant's requests accepted and not yet answered (a training loop has a few; the SDK's chunks of one big batch a
# few dozen): past it a new one is refused with 429 (the SDK waits and retries), so that no tenant can pile up
# queued work (each request up to the body limit) in the service's memory, nor requests whose seq never comes
MAX_PENDING_PER_TENANT = 128
PRUNE_EVERY_S = 600  # how often answered requests older than keep_answers_s are deleted
MAX_SAMPLE_TOKENS = 4096
RESIDENT_MODELS = 64  # training models kept in memory when idle (the others read back from disk when used)
# what one tenant may keep on the service's disk, which every tenant shares: training models (never deleted: each a
# live copy of its matrices and AdamW moments) and checkpoints' bytes (deleted through the RestClient)
MAX_MODELS_PER_TENANT = 1000
MAX_CHECKPOINT_BYTES_PER_TENANT = 64 << 30


class UserError(BadCall):
    """A request that cannot succeed as sent (category `user`)."""


class ServerError(SymbiosisError):
    """A request the service could not answer (category `server`)."""


class Busy(SymbiosisError):
    """A request refused for now (HTTP 429: the tenant has MAX_PENDING_PER_TENANT requests pending)."""


def category(error: Exception) -> str:
    return "user" if isinstance(error, (BadCall, AdapterError, ValueError, KeyError)) else "server"


class TinkerService:
    def __init__(self, service, persist_every: int = 1, tokenizer_id: str | None = None,
                 keep_answers_s: float = KEEP_ANSWERS_S, resident_models: int = RESIDENT_MODELS,
                 max_models_per_tenant: int = MAX_MODELS_PER_TENANT,
                 max_checkpoint_bytes_per_tenant: int = MAX_CHECKPOINT_BYTES_PER_TENANT):
        """On the service's trainer and training queue (shared with fine-tuning jobs). `keep_answers_s`: how long an
        answered request is kept (polled late, resubmitted); pruned at start and every `PRUNE_EVERY_S` after.
        `resident_models`: how many training models' states stay in memory when idle (module docstring).
        `max_models_per_tenant`, `max_checkpoint_bytes_per_tenant`: what one tenant may keep on disk."""
        if persist_every < 1:
            raise ValueError("persist_every must be at least 1")
        if not keep_answers_s > 0:
            raise ValueError("keep_answers_s must be positive")
        if resident_models < 1:
            raise ValueError("resident_models must be at least 1")
        if max_models_per_tenant < 1:
            raise ValueError("max_models_per_tenant must be at least 1")
        if max_checkpoint_bytes_per_tenant < 0:
            raise ValueError("max_checkpoint_bytes_per_tenant must be at least 0")
        self.service, self.persist_every, self.keep_answers_s = service, persist_every, keep_answers_s
        self.resident_models = int(resident_models)
        self.max_models_per_tenant = int(max_models_per_tenant)
        self.max_checkpoint_bytes_per_tenant = int(max_checkpoint_bytes_per_tenant)
        # tenant -> held from a quota's check to the write it allows (creates run on worker threads, saves on each
        # trainer's): one tenant's concurrent requests cannot all pass the bound on the same count
        self._quota_locks: dict[str, threading.Lock] = {}
        self._pruned_at = time.monotonic()
        self._pruning = threading.Lock()  # held while a pruning thread runs
        self.store = TinkerStore(service.state)
        self.root = service.state.directory / "tinker"
        self.base_name = service.base_name
        self.tokenizer_id = tokenizer_id or str(service.model_path.resolve())
        self.trainer, self.queue = service.trainer, service.training_queue
        # the models in memory, least recently used first, and the steps of each one's live copy; the models being
        # read from or written to their live copy (a request for one waits for the event); how many requests of
        # each model are queued or running (each binds its HostedLora). All under `_resident`, which no file's read
        # or write holds.
        self.loras: OrderedDict[str, HostedLora] = OrderedDict()
        self._written: dict[str, int] = {}
        self._moving: dict[str, threading.Event] = {}
        self._held: Counter[str] = Counter()
        self._resident = threading.Lock()
        # model id -> its tenant (models are never deleted; one whose live copy cannot be read is dropped): no read a
        # submission
        self.owners: dict[str, str] = {}
        self.pending: dict[str, str] = {}  # request id -> tenant, from its acceptance until its answer is committed
        self._pending_of: Counter[str] = Counter()  # tenant -> its requests in `pending`
        self._pending_lock = threading.Lock()
        self.lost: dict[str, str] = {}  # model id -> what a restart lost, said once at its next request
        self._sample_counter = threading.Lock()
        # set by the HTTP layer: hands a committed answer's fields to the polls waiting for it
        self.answered = lambda request_id, outcome: None
        self._recover()
        # evictions (each may write a model's state) on a thread of their own: `_release` runs inside the training
        # queue's answer transaction, and on the event loop
        self._eviction = threading.Condition()
        self._eviction_wanted = self._evicting = self._closing = False
        self._evictor = threading.Thread(target=self._evict_when_wanted, name="symbiosis-tinker-evict", daemon=True)
        self._evictor.start()

    # -- start and stop --

    def _recover(self) -> None:
        self.store.fail_unanswered(RESTARTED)
        self.store.prune(self.keep_answers_s)
        for row in self.store.all_models():
            model = row["model_id"]
            try:  # its matrices are read at its first request (`_hold`)
                steps = self._live_steps(model)
            except (OSError, SymbiosisError, ValueError, KeyError, TypeError, AttributeError) as e:
                log.error("training model %s could not be restored: %s", model, e)
                continue
            self.owners[model] = row["tenant"]
            self._gradients(model).unlink(missing_ok=True)  # (the row's pending_grads says they are lost)
            lost = []
            if row["completed_steps"] > steps:
                lost.append(f"optimizer steps {steps + 1}..{row['completed_steps']} (the model is back at step "
                            f"{steps}, its last one written to disk)")
            if row["pending_grads"]:
                lost.append(f"the gradients of {row['pending_grads']} forward_backward request(s) since its last step")
            if lost:
                self.lost[model] = "the service restarted and this model lost " + " and ".join(lost)
                self.store.update_model(model, completed_steps=steps, pending_grads=0)
            self.queue.open(model, (self.store.last_seq(model) or 0) + 1)

    def _live_steps(self, model: str) -> int:
        """The optimizer steps of `model`'s live copy, once the copy is checked as a load checks it but for its
        matrices (read at its first request). Places the model on its trainer, as a load does."""
        _, state = saved_state(self._live(model), self.queue.place(model).fingerprint, with_optimizer=True)
        return int(state.get("steps", 0))

    # -- files --

    def _model_directory(self, model: str) -> Path:
        return self.root / "models" / model_directory_name(model)

    def _gradients(self, model: str) -> Path:
        """Where a model out of memory keeps the gradients gathered since its last step (until it is read back)."""
        return self._model_directory(model) / "gradients.safetensors"

    def _live(self, model: str) -> Path:
        return self._model_directory(model) / "live"

    def checkpoint_directory(self, path: TinkerPath) -> Path:
        return self._model_directory(path.model_id) / path.kind / path.name

    def _write(self, lora: HostedLora, directory: Path, with_optimizer: bool) -> int:
        """Save atomically (a new directory renamed over the old one); returns the bytes written."""
        temporary = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:8]}")
        lora.save(temporary, self.base_name, self.trainer.fingerprint, with_optimizer)
        size = sum(f.stat().st_size for f in temporary.iterdir())
        old = directory.with_name(f".{directory.name}.old")
        if directory.exists():
            directory.rename(old)
        temporary.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
        return size

    # -- the models in memory --

    def _hold(self, tenant: str, model: str) -> HostedLora:
        """The caller's `model`'s state, read from its live copy if it is not in memory, marked most recently used
        and held in memory until `_release` (once for each `_hold`). A model whose live copy cannot be read is
        logged and dropped, and answered as no training model from then on (as a start does)."""
        while True:
            self._check_owner(tenant, model)
            with self._resident:
                lora = self.loras.get(model)
                if lora is not None:
                    self.loras.move_to_end(model)
                    self._held[model] += 1
                    return lora
                moving = self._moving.get(model)
                if moving is None:  # ours to read
                    moving = self._moving[model] = threading.Event()
                    break
            moving.wait()  # read or written by another thread: then look again
        try:
            lora = self._load(model, self._live(model), with_optimizer=True)
        except (OSError, SymbiosisError, SafetensorError, ValueError, KeyError, TypeError) as e:  # (a damaged copy)
            log.error("training model %s could not be restored: %s", model, e)
            self.owners.pop(model, None)
            raise UserError(f"no training model {model[:80]!r}") from None
        else:
            self._restore_gradients(model, lora)
            self._install(model, lora, hold=True)
        finally:
            self._moved(model, moving)
        self._want_eviction()
        return lora

    def _restore_gradients(self, model: str, lora: HostedLora) -> None:
        """The gradients `model` left memory with, back into `lora` (the file then deleted). Unreadable, they are
        lost, and the model's next request fails saying so (as after a restart)."""
        path = self._gradients(model)
        if not path.exists():
            return
        try:
            saved = load_file(path)["flat_grad"]
            if saved.shape != lora.flat_grad.shape or saved.dtype != lora.flat_grad.dtype:
                raise ValueError(f"{list(saved.shape)} {saved.dtype}, not {list(lora.flat_grad.shape)} "
                                 f"{lora.flat_grad.dtype}")
            lora.flat_grad.copy_(saved)
            lora.pending = True
        except (OSError, SafetensorError, KeyError, ValueError) as e:
            log.error("training model %s: its gradients could not be read back: %s", model, e)
            self.lost[model] = f"this model lost the gradients gathered since its last step (unreadable: {e})"
            self.store.update_model(model, pending_grads=0)
        finally:
            path.unlink(missing_ok=True)

    def _write_gradients(self, model: str, lora: HostedLora) -> None:
        path = self._gradients(model)
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        save_file({"flat_grad": lora.flat_grad.detach().cpu()}, temporary)
        os.replace(temporary, path)

    def resident(self, model) -> bool:
        """Whether `model` is in memory now (a hint from any thread: it may leave or come next)."""
        return isinstance(model, str) and model in self.loras

    def _release(self, model: str) -> None:
        """A request that held `model` is over (answered, failed, or never queued); models over the budget go."""
        with self._resident:
            self._held[model] -= 1
            if not self._held[model]:
                del self._held[model]
        self._want_eviction()

    def _resident_lora(self, model: str) -> HostedLora:
        """The state of a model that a request holds (`_hold`: it is in memory)."""
        with self._resident:
            return self.loras[model]

    def _install(self, model: str, lora: HostedLora, hold: bool = False) -> None:
        """`lora`, the state of `model`'s live copy, as the model's state in memory (most recently used); `hold`:
        held for the caller as `_hold` holds (in the same lock, so that no eviction comes in between)."""
        with self._resident:
            self.loras[model], self._written[model] = lora, lora.steps
            self.loras.move_to_end(model)
            if hold:
                self._held[model] += 1

    def _moved(self, model: str, moving: threading.Event) -> None:
        """`model`'s read or write is over: the requests waiting for it look again."""
        with self._resident:
            del self._moving[model]
        moving.set()

    def _want_eviction(self) -> None:
        with self._eviction:
            self._eviction_wanted = True
            self._eviction.notify_all()

    def _evict_when_wanted(self) -> None:
        while True:
            with self._eviction:
                self._eviction.wait_for(lambda: self._eviction_wanted or self._closing)
                if self._closing:
                    return
                self._eviction_wanted, self._evicting = False, True
            try:
                self._evict()
            except Exception:  # noqa: BLE001 -- the models stay in memory; the next release tries again
                log.exception("evicting training models failed")
            finally:
                with self._eviction:
                    self._evicting = False
                    self._eviction.notify_all()

    def settle(self, timeout: float = 30) -> bool:
        """Wait until no eviction is wanted or running (tests, benchmarks); whether it came within `timeout`."""
        with self._eviction:
            return self._eviction.wait_for(lambda: not self._eviction_wanted and not self._evicting, timeout)

    def close(self) -> None:
        """End the eviction thread (the one running finishes first)."""
        with self._eviction:
            self._closing = True
            self._eviction.notify_all()
        self._evictor.join()

    def _evict(self) -> None:
        """Drop the least recently used idle models (no request holds them) until at most `resident_models` are in
        memory, each written to its live copy first where its state is newer, and its gradients not yet stepped
        beside it.

        Where every model in memory is busy the set stays over the budget: `_hold` reads the model asked for
        anyway, rather than fail a request for memory. Each busy model is held by a request running or next in its
        queue, and every `_release` asks for an eviction again, so the set comes back to the budget as they are
        answered.

        Models with requests queued go last: such a request binds its model when the queue comes to it (a loop's
        optimizer step sent behind its forward_backward, say), and a model evicted in between would be read back
        then, on the training thread, holding up that round."""
        if len(self.loras) <= self.resident_models:  # (every answer asks: most find nothing to do, and read no queue)
            return
        waiting = self.queue.waiting()  # (a hint: read before our lock, which the queue's callbacks take)
        while True:
            with self._resident:
                if len(self.loras) <= self.resident_models:
                    return
                idle = [m for m in self.loras if not self._held[m]]  # least recently used first
                model = next((m for m in idle if m not in waiting), idle[0] if idle else None)
                if model is None:
                    return
                lora, written = self.loras.pop(model), self._written.pop(model)
                if lora.steps == written and not lora.pending:  # its live copy is this state
                    continue
                moving = self._moving[model] = threading.Event()  # a request for it waits for the write
            try:
                if lora.steps != written:
                    self._write(lora, self._live(model), with_optimizer=True)
                    written = lora.steps
                if lora.pending:
                    self._write_gradients(model, lora)
            except Exception:  # noqa: BLE001 -- it stays in memory (its last steps are not on disk), tried again later
                log.exception("training model %s could not be written to disk; it stays in memory", model)
                with self._resident:
                    self.loras[model], self._written[model] = lora, written
                return
            finally:
                self._moved(model, moving)

    # -- requests --

    def _accept(self, tenant: str, owner: str, seq_id: int, kind: str) -> tuple[str, bool]:
        # the bound read without the lock (submissions at once may pass it by a few), and the acceptance's write
        # made holding no lock of ours (an answer's `_settled` may come while the database's lock is held)
        if not 0 <= seq_id < 1 << 63:  # (the protobuf routes' seq_ids are up to 2^64 - 1; SQLite's integers less)
            raise UserError(f"seq_id {seq_id} is not in 0..2^63-1")
        if self._pending_of[tenant] >= MAX_PENDING_PER_TENANT:
            raise Busy(f"you have {MAX_PENDING_PER_TENANT} requests pending, the limit; retry when some are answered")
        request_id, new = self.store.accept(tenant, owner, seq_id, kind)
        if new:
            with self._pending_lock:
                self.pending[request_id] = tenant
                self._pending_of[tenant] += 1
        self._prune_now_and_then()
        return request_id, new

    def _prune_now_and_then(self) -> None:
        """Every PRUNE_EVERY_S (or a fraction of keep_answers_s), the old answers deleted on a thread of their own."""
        now = time.monotonic()
        if now - self._pruned_at < min(PRUNE_EVERY_S, self.keep_answers_s / 4) or \
                not self._pruning.acquire(blocking=False):
            return
        self._pruned_at = now

        def prune():
            try:
                deleted = self.store.prune(self.keep_answers_s)
                if deleted:
                    log.info("pruned %d answered requests older than %g s", deleted, self.keep_answers_s)
            except sqlite3.Error as e:
                log.error("could not prune old answered requests: %s", e)
            finally:
                self._pruning.release()

        threading.Thread(target=prune, name="symbiosis-tinker-prune", daemon=True).start()

    def _answer(self, request_id: str, content_type: str, body: bytes) -> None:
        self.store.answer(request_id, content_type, body)
        outcome = {"status": "done", "content_type": content_type, "result": body}
        self.store.state.after_commit(lambda: self._settled(request_id, outcome))

    def _fail(self, request_id: str, error: Exception) -> None:
        message, kind = str(error), category(error)
        self.store.fail(request_id, message, kind)
        outcome = {"status": "failed", "error": message, "category": kind}
        self.store.state.after_commit(lambda: self._settled(request_id, outcome))

    def _settled(self, request_id: str, outcome: dict) -> None:
        """Its answer is committed: no longer pending, then handed to its polls (in that order: a poll that found it
        pending waits to be handed it, one that did not reads it from the database). `outcome`: the answer's
        fields as its row has them (status, and content_type and result, or error and category)."""
        with self._pending_lock:
            tenant = self.pending.pop(request_id, None)
            if tenant is not None:
                self._pending_of[tenant] -= 1
                if not self._pending_of[tenant]:
                    del self._pending_of[tenant]
        self.answered(request_id, outcome)

    def _json(self, request_id: str, value: dict) -> None:
        self._answer(request_id, "json", json.dumps(_named_non_finite(value), allow_nan=False).encode())

    def model(self, tenant: str, model: str) -> dict:
        self._check_owner(tenant, model)
        return self.store.model(tenant, model)

    def _check_owner(self, tenant: str, model: str) -> None:
        if not isinstance(model, str) or self.owners.get(model) != tenant:
            raise UserError(f"no training model {str(model)[:80]!r}")

    def _check_base(self, base_model: str | None) -> None:
        if base_model not in (None, self.base_name):
            raise UserError(f"this service trains {self.base_name!r} only, not {str(base_model)[:120]!r}")

    def _check_session(self, tenant: str, session_id: str) -> None:
        session = self.store.session(tenant, session_id) if isinstance(session_id, str) else None
        if session is None:
            raise UserError(f"no session {str(session_id)[:80]!r}")

    def create_model(self, tenant: str, session_id: str, model_seq_id: int, base_model: str, lora_config: dict,
                     optimizer: str | None = None) -> str:
        # JSON as it is: a rank of 2.9 was taken as 2, "false" as true
        rank, seed = lora_config.get("rank", 32), lora_config.get("seed")
        flags = {name: lora_config.get(name, True) for name in ("train_attn", "train_mlp", "train_unembed")}
        if type(rank) is not int or (seed is not None and type(seed) is not int) or \
                not all(isinstance(flag, bool) for flag in flags.values()):  # noqa: E721 -- ints, not bools
            raise UserError("lora_config: rank and seed are integers, train_attn / train_mlp / train_unembed booleans")
        self._check_session(tenant, session_id)
        self._check_base(base_model)
        if optimizer not in (None, "adamw"):
            raise UserError(f"this service trains with AdamW, not {str(optimizer)[:40]!r}")
        try:
            spec = LoraSpec(rank=rank, seed=secrets.randbits(62) if seed is None else seed,  # None: a random seed
                            **flags)
        except (TypeError, ValueError) as e:
            raise UserError(f"lora_config: {e}") from None
        model = make_model_id(session_id, int(model_seq_id))
        request_id, new = self._accept(tenant, model, 0, "create_model")
        if new:
            try:
                home = self.queue.place(model)
                lora = HostedLora(spec, home.targets, home.device, home.dtype)
                self._start_model(tenant, session_id, model, lora)
            except Exception as e:  # noqa: BLE001 -- answered as this request's failure
                self._fail(request_id, e)
            else:
                self._json(request_id, {"model_id": model, "type": "create_model"})
        return request_id

    def _load(self, model: str, directory: Path, with_optimizer: bool) -> HostedLora:
        """A training model's state from `directory`, on the device of the trainer it lives on."""
        home = self.queue.place(model)
        return HostedLora.load(directory, home.targets, home.device, home.dtype, home.fingerprint,
                               with_optimizer=with_optimizer)

    def _quota(self, tenant: str) -> threading.Lock:
        return self._quota_locks.setdefault(tenant, threading.Lock())

    def _start_model(self, tenant: str, session_id: str, model: str, lora: HostedLora) -> None:
        with self._quota(tenant):
            # before anything is written: a create replayed after its answer was pruned must not reset the live copy
            if self.store.model_exists(model):
                raise UserError(f"model {model} exists already")
            held = self.store.models(tenant, 0, 0)[1]
            if held >= self.max_models_per_tenant:
                raise UserError(f"quota exceeded: you have {held} training models, the most one tenant may have on "
                                "this service")
            self._write(lora, self._live(model), with_optimizer=True)
            if not self.store.add_model(model, tenant, session_id, lora.spec_json(), self.base_name, lora.steps):
                raise UserError(f"model {model} exists already")
        self._install(model, lora)
        self.queue.open(model, 1)
        self.owners[model] = tenant
        self._want_eviction()

    def info(self, tenant: str, model: str) -> dict:
        row = self.model(tenant, model)
        spec = json.loads(row["spec"])
        return {"type": "get_info", "model_id": model, "is_lora": True, "lora_rank": spec["rank"],
                "model_name": self.base_name,
                "model_data": {"arch": self.trainer.model.config.model_type, "model_name": self.base_name,
                               "tokenizer_id": self.tokenizer_id}}

    def submit(self, tenant: str, model: str, seq_id: int, kind: str, work: Work | None = None, call=None,
               adam: dict | None = None) -> str:
        """Accept a training request of `model` (once per seq_id) and queue it; returns its request id. `adam`: an
        optimizer step's `adam_params` (its result is then `call(metrics)`); `work`: a pass, its `lora` set here.
        The model is held in memory (`_hold`) until the request is answered, from here if the request is the
        model's next (read back here, off the training thread), else from when the queue comes to it
        (`Operation.bind`): a request waiting for an earlier seq_id holds nothing."""
        self._check_owner(tenant, model)
        expected = self.queue.next_seq(model)
        lora = self._hold(tenant, model) if expected is None or int(seq_id) <= expected else None
        queued = False
        try:
            request_id, queued = self._enqueue(lora, tenant, model, seq_id, kind, work, call, adam)
        finally:
            if not queued and lora is not None:
                self._release(model)
        return request_id

    def _enqueue(self, lora: HostedLora | None, tenant: str, model: str, seq_id: int, kind: str, work: Work | None,
                 call, adam: dict | None) -> tuple[str, bool]:
        """`submit`'s request id, and whether the request was queued (its answer then releases the model, if it
        was held: `lora` None, it is held when the queue binds it)."""
        request_id, new = self._accept(tenant, model, int(seq_id), kind)
        if not new:
            return request_id, False
        expected = self.queue.next_seq(model)
        if expected is not None and int(seq_id) < expected:  # it would wait in the queue for ever
            self._fail(request_id, UserError(
                f"seq_id {seq_id} of model {model} comes before the model's next request ({expected}): a request of "
                f"that number was answered more than {self.keep_answers_s:g} s ago and its answer is no longer kept, "
                "or it was never sent"))
            return request_id, False
        # (only the request the queue waits for takes it: a later one's skip would leave the queue waiting for ever)
        lost = self.lost.pop(model, None) if expected is None or int(seq_id) == expected else None
        if lost is not None:
            self._fail(request_id, ServerError(lost + "; it goes on from there with your next request"))
            self.queue.skip(model, int(seq_id))
            return request_id, False
        if work is not None:
            work.lora = lora
            try:
                self.trainer.check(work)
            except BadCall as e:
                self._fail(request_id, UserError(str(e)))
                self.queue.skip(model, int(seq_id))
                return request_id, False
        step = None
        if adam is not None:
            try:
                step = (lora, AdamParams.from_fields(adam))
            except (TypeError, ValueError) as e:
                self._fail(request_id, UserError(f"adam_params: {e}"))
                self.queue.skip(model, int(seq_id))
                return request_id, False
        held = [lora is not None]  # whether the model is held for this request (released at its answer, once)

        def release():
            if held[0]:
                held[0] = False
                self._release(model)

        def bind(operation: Operation) -> None:
            bound = self._hold(tenant, model)
            held[0] = True
            if operation.work is not None:
                operation.work.lora = bound
            if operation.step is not None:
                operation.step = (bound, operation.step[1])

        def done(result):
            try:
                if work is None:
                    self._json(request_id, result)
                    return
                if work.backward:
                    self.store.count_gradients(model)
                self._answer(request_id, "proto", wire.forward_backward_output(result.logprobs, result.loss))
            finally:
                release()

        def fail(error):
            try:
                self._fail(request_id, error)
            finally:
                release()

        self.queue.submit(model, Operation(int(seq_id), done, fail, work, call, step,
                                           bind=None if lora is not None else bind))
        return request_id, True

    def submit_optim_step(self, tenant: str, model: str, seq_id: int, adam: dict) -> str:
        """An optimizer step of `model`, taken with every other model's of its round (TrainingQueue)."""
        return self.submit(tenant, model, seq_id, "optim_step", call=lambda metrics: self.stepped(model, metrics),
                           adam=adam)

    def submit_pass(self, tenant: str, model: str, seq_id: int, datums: list, loss_fn: str, config: dict,
                    backward: bool) -> str:
        """A forward (backward False) or forward_backward request of `model`."""
        work = Work(None, datums, loss_fn, config, backward)  # (its lora the model's, once `submit` holds it)
        return self.submit(tenant, model, seq_id, "forward_backward" if backward else "forward", work=work)

    def remove_checkpoint_files(self, path: TinkerPath) -> None:
        shutil.rmtree(self.checkpoint_directory(path), ignore_errors=True)

    # the calls below run on the training queue's thread, in the model's order

    def stepped(self, model: str, metrics: dict) -> dict:
        """After `model`'s optimizer step: its state written every `persist_every` steps (else when it leaves
        memory: `_evict`), its row updated."""
        lora = self._resident_lora(model)
        if lora.steps % self.persist_every == 0:
            self._write(lora, self._live(model), with_optimizer=True)
            with self._resident:
                self._written[model] = lora.steps
        self.store.update_model(model, completed_steps=lora.steps, pending_grads=0)
        return {"metrics": metrics}

    def save(self, tenant: str, model: str, name: str, sampler: bool) -> TinkerPath:
        path = TinkerPath(model, "sampler_weights" if sampler else "weights", check_name(name, "path"))
        with self._quota(tenant):
            held = self.store.checkpoint_bytes(tenant)
            if held >= self.max_checkpoint_bytes_per_tenant:
                raise UserError(f"quota exceeded: your checkpoints hold {held} bytes, at most "
                                f"{self.max_checkpoint_bytes_per_tenant} may be kept: delete some first")
            size = self._write(self._resident_lora(model), self.checkpoint_directory(path), with_optimizer=not sampler)
            self.store.add_checkpoint(tenant, model, path.kind, path.name, size)
        return path

    def resolve(self, tenant: str, path: str) -> tuple[TinkerPath, Path]:
        """A tinker:// path of one of the caller's checkpoints, and its directory (UserError otherwise)."""
        parsed = TinkerPath.parse(path)
        if self.store.checkpoint(tenant, parsed.model_id, parsed.kind, parsed.name) is None:
            raise UserError(f"no checkpoint {path[:160]!r}")
        return parsed, self.checkpoint_directory(parsed)

    def load_into(self, tenant: str, model: str, path: str, optimizer: bool) -> dict:
        _, directory = self.resolve(tenant, path)
        # into the model's object in place: requests queued behind this one hold it (their `Work`, their step)
        lora = self._resident_lora(model)  # (this request holds the model: it is in memory)
        try:
            lora.take_state(self._load(model, directory, with_optimizer=optimizer))
        except ValueError as e:
            raise UserError(f"{e}: load it into a model of its own (create_training_client_from_state)") from None
        self._write(lora, self._live(model), with_optimizer=True)
        self._install(model, lora)
        self.store.update_model(model, completed_steps=lora.steps, persisted_steps=lora.steps, pending_grads=0,
                                spec=json.dumps(lora.spec_json()))
        return {"path": path, "model_id": model, "type": "load_weights"}

    def create_from_state(self, tenant: str, session_id: str, model_seq_id: int, path: str, optimizer: bool,
                          base_model: str | None) -> str:
        self._check_session(tenant, session_id)
        self._check_base(base_model)
        model = make_model_id(session_id, int(model_seq_id))
        request_id, new = self._accept(tenant, model, 0, "load_weights")
        if new:
            try:
                _, directory = self.resolve(tenant, path)
                lora = self._load(model, directory, with_optimizer=optimizer)
                self._start_model(tenant, session_id, model, lora)
            except Exception as e:  # noqa: BLE001
                self._fail(request_id, e)
            else:
                self._json(request_id, {"path": path, "model_id": model, "type": "load_weights"})
        return request_id

    # -- sampling --

    def create_sampler(self, tenant: str, session_id: str, seq: int, base_model: str | None,
                       model_path: str | None) -> str:
        self._check_session(tenant, session_id)
        if model_path is None:
            self._check_base(base_model)
            if base_model is None:
                raise UserError("give base_model or model_path")
        else:
            _, directory = self.resolve(tenant, model_path)
            self.service.engine.adapters.load(self.engine_name(tenant, model_path), directory)  # checked now
        sampler = f"{session_id}:sample:{int(seq)}"
        self.store.add_sampler(sampler, tenant, session_id, self.base_name, model_path)
        return sampler

    @staticmethod
    def engine_name(tenant: str, model_path: str) -> str:
        return f"{tenant}/{model_path}"

    def sampler(self, tenant: str, sampler: str) -> dict:
        row = self.store.sampler(tenant, sampler) if isinstance(sampler, str) else None
        if row is None:
            raise UserError(f"no sampling session {str(sampler)[:80]!r}")
        return row

    def sample(self, tenant: str, sampler: str, seq_id: int, prompt: list[int], samples: int, params: dict,
               prompt_logprobs: bool) -> tuple[str, list[str]]:
        """Accept a sample request (once per (sampler, seq_id)) and start it on the engine; returns (request id,
        sample sequence ids)."""
        row = self.sampler(tenant, sampler)
        if not 1 <= samples <= MAX_SAMPLES:
            raise UserError(f"num_samples must be 1..{MAX_SAMPLES}, got {samples}")
        request_id, new = self._accept(tenant, sampler, int(seq_id), "sample")
        if new:
            try:
                self._start_sample(request_id, tenant, row, prompt, samples, params, prompt_logprobs)
            except Exception as e:  # noqa: BLE001 -- this request's failure
                self._fail(request_id, UserError(str(e)) if isinstance(e, BadCall) else e)
        return request_id, [f"{request_id}:{i}" for i in range(samples)]

    def _start_sample(self, request_id, tenant, row, prompt, samples, params, want_prompt_logprobs) -> None:
        if not prompt:
            raise UserError("the prompt is empty")
        adapter = None
        if row["model_path"] is not None:
            _, directory = self.resolve(tenant, row["model_path"])
            adapter = (self.engine_name(tenant, row["model_path"]), directory)
        gather = _Samples(samples + want_prompt_logprobs, lambda result: self._answer(request_id, "proto", result),
                          lambda error: self._fail(request_id, error))
        sampling = [self._sampling_params(params, prompt, i) for i in range(samples)]
        if want_prompt_logprobs:
            self._prompt_logprobs(prompt, adapter, gather)
        for i, sampling_params in enumerate(sampling):
            self.service.engine.submit(prompt, sampling_params, adapter, events=gather.sink(i))


    def _sampling_params(self, params: dict, prompt: list[int], index: int) -> SamplingParams:
        """Tinker's sampling_params as the engine's (sample `index` seeded seed + index); stop: strings, token
        ids, None (the model's end of sequence) or [] (nothing, not even that)."""
        stop = params.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        room = max(1, (self.service.context_limit or MAX_SAMPLE_TOKENS) - len(prompt))
        max_tokens, seed = params.get("max_tokens"), params.get("seed")
        try:
            return SamplingParams(
                max_tokens=min(room, MAX_SAMPLE_TOKENS) if max_tokens is None else int(max_tokens),
                temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
                top_k=max(0, int(params.get("top_k", -1))), seed=None if seed is None else int(seed) + index,
                stop=tuple(s for s in stop or () if isinstance(s, str)),
                stop_token_ids=tuple(s for s in stop or () if isinstance(s, int)),
                ignore_eos=stop == [], logprobs=0)
        except (TypeError, ValueError) as e:
            raise UserError(f"sampling_params: {e}") from None

    def _prompt_logprobs(self, prompt: list[int], adapter, gather: "_Samples") -> None:
        """log p(prompt[i] | prompt[:i]) for i >= 1 (NaN at 0): one forward pass of the trainer's model (with the
        sampler's adapter, read from its directory), queued on the training queue; handed to `gather`."""
        nan = float("nan")
        if len(prompt) < 2:
            gather.prompt_logprobs([nan] * len(prompt))
            return
        lora = None
        if adapter is not None:
            lora = HostedLora.load(adapter[1], self.trainer.targets, self.trainer.device, self.trainer.dtype,
                                   self.trainer.fingerprint, with_optimizer=False)
        datum = Datum(prompt[:-1], {"target_tokens": torch.tensor(prompt[1:]),
                                    "weights": torch.zeros(len(prompt) - 1, dtype=torch.float64)})
        work = Work(lora, [datum], "cross_entropy", backward=False)
        self.trainer.check(work)
        self.queue.submit_call(lambda: [nan] + self.trainer.run([work])[0].logprobs[0].tolist(),
                               gather.prompt_logprobs, gather.failed)


class _Samples:
    """The parts of one sample request, as they finish on the engine's thread (and the training queue's, for
    prompt log-probabilities): when the last is in, the SampleResponse is answered (or the first error)."""

    def __init__(self, parts: int, answer, fail):
        self.answer, self.fail = answer, fail
        self.sequences: dict[int, tuple[list[int], list[float], str]] = {}
        self.prompt: list[float] | None = None
        self._tokens: dict[int, tuple[list[int], list[float]]] = {}
        self._left, self._error = parts, None
        self._lock = threading.Lock()

    def sink(self, index: int):
        gather = self

        class Sink:
            def put(self, event):
                gather._event(index, event)
        return Sink()

    def _event(self, index: int, event) -> None:
        if isinstance(event, Finished):
            tokens, logprobs = self._tokens.pop(index, ([], []))
            if event.error is not None:
                self.failed(event.error)
            else:
                self.sequences[index] = (tokens, logprobs, event.reason)
                self._part_done()
            return
        tokens, logprobs = self._tokens.setdefault(index, ([], []))
        tokens.append(event.id)
        logprobs.append(event.logprob)

    def prompt_logprobs(self, values: list[float]) -> None:
        self.prompt = values
        self._part_done()

    def failed(self, error: Exception) -> None:
        with self._lock:
            first, self._error = self._error is None, self._error or error
            self._left -= 1
        if first:
            self.fail(UserError(str(error)) if isinstance(error, BadCall) else error)

    def _part_done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0 and self._error is None
        if last:
            self.answer(wire.sample_response([self.sequences[i] for i in sorted(self.sequences)], self.prompt))


def _named_non_finite(value):
    """`value` with every NaN or infinite float as the string "NaN", "Infinity" or "-Infinity": strict JSON (the
    SDK parses answers with orjson, which refuses those numbers), which the SDK's pydantic models read back as the
    float (a diverged model's gradient norm is NaN: it gets its NaN, not a server error that it retries for ever)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _named_non_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_named_non_finite(v) for v in value]
    return value
