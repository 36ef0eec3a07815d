"""What the Tinker API keeps in the service's SQLite database (serve/state.py), beside the files of its models.

    tinker_sessions(session_id, tenant, created, finished)
    tinker_models(model_id, tenant, session_id, spec, base_model, created, last_request, completed_steps,
                  persisted_steps, pending_grads)      a training model; its live state is files (service.py),
                                                      written at every `persist_every`-th optimizer step
    tinker_requests(request_id, tenant, owner, seq_id, kind, status, content_type, result, error, category,
                    created, finished)                  every accepted request and its answer, unique per
                                                      (owner, seq_id): a resubmission gets the first one's
    tinker_checkpoints(tenant, model_id, kind, name, created, size_bytes)
    tinker_samplers(sampling_session_id, tenant, session_id, base_model, model_path, created)

Every row carries its tenant, and every read asks for the caller's: another tenant's object is not found.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
import uuid

from symbiosis.serve.state import Tables

SCHEMA = """
CREATE TABLE IF NOT EXISTS tinker_sessions (
    session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created REAL NOT NULL, finished REAL);
CREATE TABLE IF NOT EXISTS tinker_models (
    model_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT NOT NULL, spec TEXT NOT NULL,
    base_model TEXT NOT NULL, created REAL NOT NULL, last_request REAL NOT NULL,
    completed_steps INTEGER NOT NULL DEFAULT 0, persisted_steps INTEGER NOT NULL DEFAULT 0,
    pending_grads INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS tinker_requests (
    request_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, owner TEXT NOT NULL, seq_id INTEGER NOT NULL,
    kind TEXT NOT NULL, status TEXT NOT NULL, content_type TEXT, result BLOB, error TEXT, category TEXT,
    created REAL NOT NULL, finished REAL, UNIQUE (owner, seq_id));
CREATE INDEX IF NOT EXISTS tinker_requests_finished ON tinker_requests (finished);
CREATE TABLE IF NOT EXISTS tinker_checkpoints (
    tenant TEXT NOT NULL, model_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, created REAL NOT NULL,
    size_bytes INTEGER NOT NULL, PRIMARY KEY (model_id, kind, name));
CREATE TABLE IF NOT EXISTS tinker_samplers (
    sampling_session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT NOT NULL, base_model TEXT NOT NULL,
    model_path TEXT, created REAL NOT NULL);
"""
# Answered requests are kept this long (a client may poll late, or resubmit after a restart), then pruned. An
# hour, not a day: at 32 tenants' full speed (~500 requests a second, a forward_backward's answer a few kB: its
# per-token log-probabilities) a day of answers is ~100 GB of database.
KEEP_ANSWERS_S = 3600
PRUNE_BATCH = 2000  # rows deleted a statement: the database's lock is held a batch at a time


class TinkerStore(Tables):
    SCHEMA = SCHEMA

    def __init__(self, state):
        super().__init__(state)
        # request ids: 64 random bits a start, then a count (a uuid4 a request read the OS's random source: ~30 us of
        # the event loop a submission on this project's CI machine); unique across restarts, a tenant's own anyway
        self._id_prefix, self._id_numbers = secrets.token_hex(8), itertools.count()

    # -- sessions --

    def create_session(self, tenant: str) -> str:
        session_id = uuid.uuid4().hex[:20]
        self._change("INSERT INTO tinker_sessions VALUES (?, ?, ?, NULL)", (session_id, tenant, time.time()))
        return session_id

    def session(self, tenant: str, session_id: str) -> dict | None:
        return self._one("SELECT * FROM tinker_sessions WHERE tenant = ? AND session_id = ?", (tenant, session_id))

    def finish_session(self, tenant: str, session_id: str) -> bool:
        return self._change("UPDATE tinker_sessions SET finished = COALESCE(finished, ?) WHERE tenant = ? AND "
                            "session_id = ?", (time.time(), tenant, session_id)) > 0

    # -- models --

    def add_model(self, model_id: str, tenant: str, session_id: str, spec: dict, base_model: str,
                  steps: int = 0) -> bool:
        """False if the model exists already."""
        now = time.time()
        with self.state.transaction() as db:
            if db.execute("SELECT 1 FROM tinker_models WHERE model_id = ?", (model_id,)).fetchone():
                return False
            db.execute("INSERT INTO tinker_models (model_id, tenant, session_id, spec, base_model, created, "
                       "last_request, completed_steps, persisted_steps) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (model_id, tenant, session_id, json.dumps(spec), base_model, now, now, steps, steps))
        return True

    def model_exists(self, model_id: str) -> bool:
        return self._one("SELECT 1 FROM tinker_models WHERE model_id = ?", (model_id,)) is not None

    def model(self, tenant: str, model_id: str) -> dict | None:
        return self._one("SELECT * FROM tinker_models WHERE tenant = ? AND model_id = ?", (tenant, model_id))

    def all_models(self) -> list[dict]:
        return self._query("SELECT * FROM tinker_models")

    def models(self, tenant: str, offset: int, limit: int) -> tuple[list[dict], int]:
        rows = self._query("SELECT * FROM tinker_models WHERE tenant = ? ORDER BY created DESC LIMIT ? OFFSET ?",
                           (tenant, limit, offset))
        total = self._query("SELECT COUNT(*) AS n FROM tinker_models WHERE tenant = ?", (tenant,))[0]["n"]
        return rows, total

    def update_model(self, model_id: str, **values) -> None:
        assignments = ", ".join(f"{name} = ?" for name in values)
        self._change(f"UPDATE tinker_models SET {assignments}, last_request = ? WHERE model_id = ?",
                     (*values.values(), time.time(), model_id))

    def count_gradients(self, model_id: str) -> None:
        """One more forward_backward's gradients gathered since the model's last step."""
        self._change("UPDATE tinker_models SET pending_grads = pending_grads + 1, last_request = ? WHERE model_id = ?",
                     (time.time(), model_id))

    # -- requests --

    def accept(self, tenant: str, owner: str, seq_id: int, kind: str) -> tuple[str, bool]:
        """(request_id, new): the request of (owner, seq_id), made now unless it was accepted before (one statement
        for a new one, the usual case; a resubmission reads the first one's id). An owner is one tenant's model:
        another tenant's (owner, seq_id) is not found here, it is refused before."""
        request_id = f"{self._id_prefix}{next(self._id_numbers):x}"
        if self._change("INSERT INTO tinker_requests (request_id, tenant, owner, seq_id, kind, status, created) "
                        "VALUES (?, ?, ?, ?, ?, 'pending', ?) ON CONFLICT (owner, seq_id) DO NOTHING",
                        (request_id, tenant, owner, seq_id, kind, time.time())):
            return request_id, True
        found = self._one("SELECT request_id, kind FROM tinker_requests WHERE tenant = ? AND owner = ? AND seq_id = ?",
                          (tenant, owner, seq_id))
        if found is None:
            raise LookupError(f"request {seq_id} of {owner!r} belongs to another tenant")
        if found["kind"] != kind:  # a resubmission is the same request; another one would get this one's answer
            raise ValueError(f"seq_id {seq_id} of {owner} was a {found['kind']} request; this {kind} request needs "
                             "a seq_id of its own")
        return found["request_id"], False

    def answer(self, request_id: str, content_type: str, result: bytes) -> None:
        self._change("UPDATE tinker_requests SET status = 'done', content_type = ?, result = ?, finished = ? "
                     "WHERE request_id = ?", (content_type, result, time.time(), request_id))

    def fail(self, request_id: str, error: str, category: str) -> None:
        self._change("UPDATE tinker_requests SET status = 'failed', error = ?, category = ?, finished = ? "
                     "WHERE request_id = ?", (error, category, time.time(), request_id))

    def request(self, tenant: str, request_id: str) -> dict | None:
        return self._one("SELECT * FROM tinker_requests WHERE tenant = ? AND request_id = ?", (tenant, request_id))

    def fail_unanswered(self, error: str) -> list[dict]:
        """At start: every request accepted and not answered before the service stopped fails with `error`."""
        with self.state.transaction() as db:
            pending = self._rows(db.execute("SELECT request_id, owner, seq_id, kind FROM tinker_requests "
                                       "WHERE status = 'pending'"))
            db.execute("UPDATE tinker_requests SET status = 'failed', error = ?, category = 'server', finished = ? "
                       "WHERE status = 'pending'", (error, time.time()))
        return pending

    def prune(self, keep_s: float) -> int:
        """Delete the answered requests finished more than `keep_s` ago, but each model's newest one (its seq_id is
        where the model's queue goes on after a restart); returns how many."""
        cutoff, deleted = time.time() - keep_s, 0
        while True:
            count = self._change(
                "DELETE FROM tinker_requests WHERE rowid IN (SELECT rowid FROM tinker_requests AS old "
                "WHERE old.status != 'pending' AND old.finished < ? AND old.seq_id < "
                "(SELECT MAX(seq_id) FROM tinker_requests WHERE owner = old.owner) LIMIT ?)", (cutoff, PRUNE_BATCH))
            deleted += count
            if count < PRUNE_BATCH:
                return deleted

    def last_seq(self, owner: str) -> int | None:
        row = self._one("SELECT MAX(seq_id) AS seq FROM tinker_requests WHERE owner = ?", (owner,))
        return None if row is None else row["seq"]

    # -- checkpoints --

    def add_checkpoint(self, tenant: str, model_id: str, kind: str, name: str, size: int) -> None:
        self._change("INSERT OR REPLACE INTO tinker_checkpoints VALUES (?, ?, ?, ?, ?, ?)",
                     (tenant, model_id, kind, name, time.time(), size))

    def checkpoint_bytes(self, tenant: str) -> int:
        return self._one("SELECT COALESCE(SUM(size_bytes), 0) AS n FROM tinker_checkpoints WHERE tenant = ?",
                         (tenant,))["n"]

    def checkpoint(self, tenant: str, model_id: str, kind: str, name: str) -> dict | None:
        return self._one("SELECT * FROM tinker_checkpoints WHERE tenant = ? AND model_id = ? AND kind = ? AND name = ?",
                         (tenant, model_id, kind, name))

    def checkpoints(self, tenant: str, model_id: str | None = None, offset: int = 0,
                    limit: int = 1000) -> tuple[list[dict], int]:
        where, parameters = "tenant = ?", (tenant,)
        if model_id is not None:
            where, parameters = where + " AND model_id = ?", parameters + (model_id,)
        rows = self._query(f"SELECT * FROM tinker_checkpoints WHERE {where} ORDER BY created LIMIT ? OFFSET ?",
                           parameters + (limit, offset))
        total = self._query(f"SELECT COUNT(*) AS n FROM tinker_checkpoints WHERE {where}", parameters)[0]["n"]
        return rows, total

    def delete_checkpoint(self, tenant: str, model_id: str, kind: str, name: str) -> bool:
        return self._change("DELETE FROM tinker_checkpoints WHERE tenant = ? AND model_id = ? AND kind = ? AND name = ?",
                            (tenant, model_id, kind, name)) > 0

    # -- sampling sessions --

    def add_sampler(self, sampler_id: str, tenant: str, session_id: str, base_model: str,
                    model_path: str | None) -> None:
        self._change("INSERT OR REPLACE INTO tinker_samplers VALUES (?, ?, ?, ?, ?, ?)",
                     (sampler_id, tenant, session_id, base_model, model_path, time.time()))

    def sampler(self, tenant: str, sampler_id: str) -> dict | None:
        return self._one("SELECT * FROM tinker_samplers WHERE tenant = ? AND sampling_session_id = ?",
                         (tenant, sampler_id))
