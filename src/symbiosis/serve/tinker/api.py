"""The Tinker API over HTTP (`/api/v1/...`), as the official `tinker` SDK speaks it (tested with 0.38.0).

Authentication: the SDK sends the key in `X-API-Key` (and insists that it starts with `tml-`); the same keys and
tenants as the OpenAI API. Work endpoints answer at once with a future (`request_id`), answered later through
`retrieve_future`, which holds each poll up to POLL_HOLD_S before saying `try_again` (the SDK polls again at once).
Results of forward/forward_backward and samples are protobuf (wire.py); the rest is JSON.

Errors: a synchronous request that cannot succeed gets 400 with a JSON body (the SDK raises BadRequestError and
does not retry); a future that fails answers `{"error", "category": "user"|"server"}` (RequestFailedError). Another
tenant's session, model, checkpoint or sampler is answered as one that does not exist.
"""

from __future__ import annotations

import asyncio
import json
import threading
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from symbiosis.errors import BadCall, SymbiosisError
from symbiosis.serve.errors import json_fields, json_object
from symbiosis.serve.tinker import wire
from symbiosis.serve.tinker.paths import TinkerPath, check_name
from symbiosis.serve.tinker.service import Busy, TinkerService, UserError

POLL_HOLD_S = 20.0  # under the SDK's 45 s read timeout of a poll
SDK_CONFIG = {  # client/config: no JWT exchange, uncompressed protobuf, the SDK's other defaults
    "pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": True,
    "sample_use_retrieve_futures": False, "custom_loss_server_side": False, "sample_join_sampling_session": False}


class Waiters:
    """Polls waiting for an answer, handed its fields (from any thread) once it is committed: no read of the
    database for them, and no task a poll (`asyncio.wait_for` made one, and an event, for each)."""

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[str, list[asyncio.Future]] = {}
        # answers not yet handed over, and whether the loop has been asked to: a round's 64 answers wake the loop
        # once, not 64 times (each a write to its wake-up pipe from the trainer's thread)
        self._answers: list[tuple[str, dict]] = []
        self._answers_lock = threading.Lock()

    def answered(self, request_id: str, outcome: dict) -> None:  # any thread
        if self.loop is None:
            return
        with self._answers_lock:
            self._answers.append((request_id, outcome))
            if len(self._answers) > 1:  # the loop has been asked already and has not taken them yet
                return
        try:
            self.loop.call_soon_threadsafe(self._hand)
        except RuntimeError:  # the loop has closed (the service stopping): no poll is left to hand them to
            with self._answers_lock:
                self._answers.clear()

    def _hand(self) -> None:
        with self._answers_lock:
            answers, self._answers = self._answers, []
        for request_id, outcome in answers:
            for future in self._waiting.pop(request_id, ()):
                _settle(future, outcome)

    async def wait(self, request_id: str, timeout: float) -> dict | None:
        """The answer's fields (as its row has them), or None if it did not come within `timeout` seconds."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        waiting = self._waiting.setdefault(request_id, [])
        waiting.append(future)
        timer = loop.call_later(timeout, _settle, future, None)
        try:
            return await future
        finally:
            timer.cancel()
            if future in waiting:  # timed out, or the poll's client went: not handed anything
                waiting.remove(future)
                if not waiting and self._waiting.get(request_id) is waiting:
                    del self._waiting[request_id]


def _settle(future: asyncio.Future, outcome: dict | None) -> None:
    if not future.done():
        future.set_result(outcome)


def _iso(seconds: float | None) -> str | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def routes(service, tinker: TinkerService) -> tuple[APIRouter, dict]:
    """The API's FastAPI routes, and its training loop's three requests as plain routes (app.PlainRoutes:
    `retrieve_future`, `forward_backward`, `optim_step`, ~4 requests an iteration of every tenant's loop)."""
    api = APIRouter(prefix="/api/v1")
    waiters = Waiters()
    tinker.answered = waiters.answered

    def tenant_with(key: str) -> str:
        found = service.keys.tenant_of(key.strip())
        if found is None:
            raise Refused(401, "invalid API key: send `X-API-Key: tml-...`, a key of this service's key file")
        return found

    def tenant_of(request: Request) -> str:
        return tenant_with(request.headers.get("x-api-key", ""))

    async def body(request: Request) -> tuple[str, dict]:
        tenant = tenant_of(request)
        parsed = await json_object(request, Refused)
        waiters.loop = asyncio.get_running_loop()
        return tenant, parsed

    def run(call):
        """Run a synchronous piece of the service: its user errors become 400, with the reason."""
        try:
            return call()
        except Busy as e:  # the tenant's pending requests at their bound: the SDK retries a 429 after a while
            raise Refused(429, str(e), retry_after_s=1) from None
        except (BadCall, ValueError, KeyError, TypeError) as e:
            raise Refused(400, str(e)) from None
        except SymbiosisError as e:
            raise Refused(400, str(e)) from None

    async def off_loop(call):
        return await asyncio.to_thread(run, call)

    async def on_loop_if_resident(model, call):
        """A submission on the loop if its model is in memory, else on a worker thread: reading a model back from
        disk (`--resident-models`) would stop every tenant's requests for its duration."""
        return run(call) if tinker.resident(model) else await off_loop(call)

    # -- the training loop's requests: plain routes, (headers, body, state) -> (status, media type, body). Their
    # submissions run on the event loop, not a worker thread: a thread's hand-off cost the interpreter ~0.3 ms an
    # iteration, and the loop's reads of the state wait on the same database lock anyway (WAL, no fsync a commit)

    def plain_tenant(headers: dict, state: dict) -> str:
        state["tenant"] = tenant = tenant_with(headers.get(b"x-api-key", b"").decode("latin-1"))
        waiters.loop = asyncio.get_running_loop()
        return tenant

    def answer(fields: dict) -> tuple[int, bytes, bytes]:
        return 200, b"application/json", json.dumps(fields).encode()

    async def retrieve_future(headers: dict, raw: bytes, state: dict):
        tenant = plain_tenant(headers, state)
        request_id = str(json_fields(raw, Refused).get("request_id"))
        waiting = tinker.pending.get(request_id) == tenant  # most polls come before their answer: no read for them
        row = None if waiting else tinker.store.request(tenant, request_id)
        if waiting or (row is not None and row["status"] == "pending"):
            row = await waiters.wait(request_id, POLL_HOLD_S) or tinker.store.request(tenant, request_id)
        if row is None:
            raise Refused(404, f"no request {request_id[:80]!r}")
        if row["status"] == "pending":
            return answer({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if row["status"] == "failed":
            return answer({"error": row["error"], "category": row["category"]})
        # the stored answer as it is: no parse and re-encode per answer, and a diverged model's NaN or infinite
        # metrics stay what Python's json (the SDK's parser) reads, where strict JSON would refuse them (a 500,
        # which the SDK retries for ever)
        media_type = b"application/x-protobuf" if row["content_type"] == "proto" else b"application/json"
        return 200, media_type, row["result"]

    async def forward_backward(headers: dict, raw: bytes, state: dict):
        tenant = plain_tenant(headers, state)
        if headers.get(b"content-encoding", b"identity") != b"identity":
            raise Refused(400, "send forward_backward uncompressed (client/config says proto_compress_fwdbwd false)")
        model, seq_id, loss_fn, config, forward_only, datums = run(lambda: wire.forward_backward_request(raw))
        request_id = await on_loop_if_resident(model, lambda: tinker.submit_pass(
            tenant, model, seq_id, datums, loss_fn, config, backward=not forward_only))
        return answer({"request_id": request_id, "model_id": model})

    async def optim_step(headers: dict, raw: bytes, state: dict):
        tenant = plain_tenant(headers, state)
        fields = json_fields(raw, Refused)
        model, adam = fields.get("model_id"), fields.get("adam_params")
        if not isinstance(adam, dict):
            raise Refused(400, "optim_step takes adam_params (this service's optimizer is AdamW)")
        request_id = await on_loop_if_resident(model, lambda: tinker.submit_optim_step(tenant, model,
                                                                                     _int(fields, "seq_id"), adam))
        return answer({"request_id": request_id, "model_id": model})

    plain = {"/api/v1/retrieve_future": retrieve_future, "/api/v1/forward_backward": forward_backward,
             "/api/v1/optim_step": optim_step}

    # -- handshake, sessions --

    @api.post("/client/config")
    async def client_config(request: Request):
        tenant_of(request)
        return SDK_CONFIG

    @api.post("/client/dynamic_config")
    async def dynamic_config(request: Request):
        tenant_of(request)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}

    @api.post("/telemetry")
    async def telemetry(request: Request):
        tenant_of(request)
        return {"status": "accepted"}  # not kept

    @api.post("/create_session")
    async def create_session(request: Request):
        tenant, _ = await body(request)
        return {"type": "create_session", "session_id": tinker.store.create_session(tenant)}

    @api.post("/session_heartbeat")
    async def heartbeat(request: Request):
        tenant, fields = await body(request)
        session = tinker.store.session(tenant, str(fields.get("session_id")))
        if session is None:
            raise Refused(404, "no such session")
        if session["finished"] is not None:
            raise Refused(410, "the session has finished")
        return {"type": "session_heartbeat"}

    @api.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        tenant, _ = await body(request)
        if not tinker.store.finish_session(tenant, session_id):
            raise Refused(404, "no such session")
        return {}

    @api.get("/get_server_capabilities")
    async def capabilities(request: Request):
        tenant_of(request)
        return {"supported_models": [{"model_name": service.base_name, "max_context_length": service.context_limit,
                                      "trainable": True, "sampleable": True}]}

    # -- training --

    @api.post("/create_model")
    async def create_model(request: Request):
        tenant, fields = await body(request)
        request_id = await off_loop(lambda: tinker.create_model(
            tenant, fields.get("session_id"), _int(fields, "model_seq_id"), fields.get("base_model"),
            _object(fields, "lora_config"), _object(fields, "optimizer_config").get("type")))
        return {"request_id": request_id}

    @api.post("/get_info")
    async def get_info(request: Request):
        tenant, fields = await body(request)
        return run(lambda: tinker.info(tenant, fields.get("model_id")))

    @api.post("/save_weights")
    async def save_weights(request: Request):
        tenant, fields = await body(request)
        model, name = fields.get("model_id"), run(lambda: check_name(fields.get("path"), "path"))

        def save():
            return {"path": str(tinker.save(tenant, model, name, sampler=False)), "type": "save_weights"}
        request_id = await off_loop(lambda: tinker.submit(tenant, model, _int(fields, "seq_id"), "save_weights", call=save))
        return {"request_id": request_id, "model_id": model}

    @api.post("/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        tenant, fields = await body(request)
        model, seq_id = fields.get("model_id"), _int(fields, "seq_id")
        name = fields.get("path")
        if name is not None:
            run(lambda: check_name(name, "path"))
        else:  # checked now: the checkpoint is written before the sampler is made of it
            _int(fields, "sampling_session_seq_id")

        def save():
            if name is not None:
                return {"path": str(tinker.save(tenant, model, name, sampler=True)), "type": "save_weights_for_sampler"}
            path = tinker.save(tenant, model, f"sampler-{seq_id}", sampler=True)
            session_id = tinker.model(tenant, model)["session_id"]
            sampler = tinker.create_sampler(tenant, session_id, _int(fields, "sampling_session_seq_id"), None, str(path))
            return {"sampling_session_id": sampler, "type": "save_weights_for_sampler"}
        request_id = await off_loop(lambda: tinker.submit(tenant, model, seq_id, "save_weights_for_sampler", call=save))
        return {"request_id": request_id, "model_id": model}

    @api.post("/load_weights")
    async def load_weights(request: Request):
        tenant, fields = await body(request)
        path, optimizer = fields.get("path"), bool(fields.get("optimizer", False))
        if "model_id" in fields:
            model = fields["model_id"]
            request_id = await off_loop(lambda: tinker.submit(
                tenant, model, _int(fields, "seq_id"), "load_weights",
                call=lambda: tinker.load_into(tenant, model, path, optimizer)))
            return {"request_id": request_id, "model_id": model}
        request_id = await off_loop(lambda: tinker.create_from_state(
            tenant, fields.get("session_id"), _int(fields, "model_seq_id"), path, optimizer, fields.get("base_model")))
        return {"request_id": request_id}

    # -- sampling --

    @api.post("/create_sampling_session")
    async def create_sampling_session(request: Request):
        tenant, fields = await body(request)
        sampler = await off_loop(lambda: tinker.create_sampler(
            tenant, fields.get("session_id"), _int(fields, "sampling_session_seq_id"), fields.get("base_model"),
            fields.get("model_path")))
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    @api.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        tenant = tenant_of(request)
        row = run(lambda: tinker.sampler(tenant, sampler_id))
        return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": row["model_path"]}

    @api.post("/asample")
    async def asample(request: Request):
        tenant, fields = await body(request)
        prompt = fields.get("prompt")
        chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
        if not isinstance(chunks, list) or any(not isinstance(c, dict) or c.get("type") != "encoded_text" or
                                               not isinstance(c.get("tokens", []), list) for c in chunks):
            raise Refused(400, "the prompt must be {\"chunks\": [encoded_text chunks with a list of tokens]} (no "
                               "images)")
        prompt = [t for c in chunks for t in c.get("tokens", [])]
        if any(type(t) is not int for t in prompt):  # noqa: E721 -- not bools
            raise Refused(400, "prompt tokens must be integers")
        params = fields.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise Refused(400, "sampling_params must be an object")
        request_id, sequence_ids = await off_loop(lambda: tinker.sample(
            tenant, fields.get("sampling_session_id"), _int(fields, "seq_id"), prompt, _int(fields, "num_samples"),
            params, bool(fields.get("prompt_logprobs", False))))
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    @api.post("/cancel_future")
    async def cancel_future(request: Request):
        tenant_of(request)
        return {}

    # -- training runs and checkpoints --

    def training_run(tenant: str, model: dict) -> dict:
        spec = json.loads(model["spec"])
        checkpoints, _ = tinker.store.checkpoints(tenant, model["model_id"])
        latest = {kind: next((c for c in reversed(checkpoints) if c["kind"] == kind), None)
                  for kind in ("weights", "sampler_weights")}
        return {"training_run_id": model["model_id"], "base_model": model["base_model"], "model_owner": tenant,
                "is_lora": True, "corrupted": False, "lora_rank": spec["rank"],
                "last_request_time": _iso(model["last_request"]),
                "last_checkpoint": checkpoint(latest["weights"]), "last_sampler_checkpoint": checkpoint(
                    latest["sampler_weights"]), "user_metadata": None}

    def checkpoint(row: dict | None) -> dict | None:
        if row is None:
            return None
        path = TinkerPath(row["model_id"], row["kind"], row["name"])
        return {"checkpoint_id": path.checkpoint_id, "checkpoint_type": "sampler" if row["kind"] == "sampler_weights"
                else "training", "time": _iso(row["created"]), "tinker_path": str(path), "size_bytes": row["size_bytes"],
                "public": False, "user_metadata": None, "expires_at": None}

    @api.get("/training_runs")
    async def list_runs(request: Request, limit: int = 20, offset: int = 0):
        tenant = tenant_of(request)
        rows, total = tinker.store.models(tenant, _page(offset), min(max(1, limit), 1000))
        return {"training_runs": [training_run(tenant, row) for row in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    @api.get("/training_runs/{run_id}")
    async def get_run(run_id: str, request: Request):
        tenant = tenant_of(request)
        row = tinker.store.model(tenant, run_id)
        if row is None:
            raise Refused(404, "no such training run")
        return training_run(tenant, row)

    @api.get("/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: str, request: Request):
        tenant = tenant_of(request)
        if tinker.store.model(tenant, run_id) is None:
            raise Refused(404, "no such training run")
        rows, total = tinker.store.checkpoints(tenant, run_id)
        return {"checkpoints": [checkpoint(row) for row in rows],
                "cursor": {"offset": 0, "limit": len(rows), "total_count": total}}

    @api.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
        tenant = tenant_of(request)
        path = run(lambda: TinkerPath.parse(f"tinker://{run_id}/{checkpoint_id}"))
        if not tinker.store.delete_checkpoint(tenant, path.model_id, path.kind, path.name):
            raise Refused(404, "no such checkpoint")
        await off_loop(lambda: tinker.remove_checkpoint_files(path))
        return Response(status_code=204)

    @api.get("/checkpoints")
    async def user_checkpoints(request: Request, limit: int = 100, offset: int = 0):
        tenant = tenant_of(request)
        rows, total = tinker.store.checkpoints(tenant, None, _page(offset), min(max(1, limit), 1000))
        return {"checkpoints": [checkpoint(row) for row in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    @api.post("/weights_info")
    async def weights_info(request: Request):
        tenant, fields = await body(request)
        path, _ = run(lambda: tinker.resolve(tenant, fields.get("tinker_path")))
        spec = json.loads(tinker.store.model(tenant, path.model_id)["spec"])
        return {"base_model": tinker.base_name, "is_lora": True, "lora_rank": spec["rank"],
                "train_mlp": spec["train_mlp"], "train_attn": spec["train_attn"], "train_unembed": spec["train_unembed"]}

    return api, plain


def _int(fields: dict, name: str) -> int:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:  # (what SQLite holds)
        raise Refused(400, f"{name} must be an integer in [0, 2^63)")
    return value


def _object(fields: dict, name: str) -> dict:
    value = fields.get(name) or {}
    if not isinstance(value, dict):
        raise Refused(400, f"{name} must be a JSON object")
    return value


def _page(offset: int) -> int:
    return min(max(0, offset), 2**62)  # (a larger one overflowed SQLite's integers: a server error)


class Refused(Exception):
    """An HTTP error answer of the Tinker API: `{"error", "detail"}` with its status (app.py answers it)."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.message, "detail": self.message}, status_code=self.status,
                            headers=None if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)})


__all__ = ["SDK_CONFIG", "Refused", "UserError", "routes"]
