"""What the files and fine-tuning jobs API keeps in the service's SQLite database (serve/state.py), beside the files
under STATE_DIR/files/ and STATE_DIR/jobs/.

    files(file_id, tenant, filename, purpose, bytes, created_at, path)
    jobs(job_id, tenant, model, training_file, validation_file, suffix, seed, method, peft, hyperparameters,
         status, error, fine_tuned_model, created_at, started_at, finished_at, trained_tokens, total_steps,
         last_step)
    job_events(event_id, job_id, created_at, level, message, type, data)
    job_checkpoints(checkpoint_id, job_id, created_at, step, metrics, model_name, path)

Every read asks for the caller's tenant: another tenant's file or job is not found.
"""

from __future__ import annotations

import json
import time
import uuid

from symbiosis.serve.state import Tables

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    file_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, path TEXT NOT NULL, examples INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, model TEXT NOT NULL, training_file TEXT NOT NULL,
    validation_file TEXT, suffix TEXT, seed INTEGER NOT NULL, method TEXT NOT NULL, peft TEXT NOT NULL,
    hyperparameters TEXT NOT NULL, status TEXT NOT NULL, error TEXT, fine_tuned_model TEXT,
    created_at INTEGER NOT NULL, started_at INTEGER, finished_at INTEGER, trained_tokens INTEGER,
    total_steps INTEGER, last_step INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS job_events (
    event_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, job_id TEXT NOT NULL, created_at INTEGER NOT NULL,
    level TEXT NOT NULL, message TEXT NOT NULL, type TEXT NOT NULL, data TEXT);
CREATE INDEX IF NOT EXISTS job_events_by_job ON job_events (job_id, seq);
CREATE TABLE IF NOT EXISTS job_checkpoints (
    checkpoint_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, created_at INTEGER NOT NULL, step INTEGER NOT NULL,
    metrics TEXT NOT NULL, model_name TEXT NOT NULL, path TEXT NOT NULL);
"""
class JobStore(Tables):
    SCHEMA = SCHEMA
    JSON_COLUMNS = ("method", "peft", "hyperparameters", "error", "data", "metrics")

    # -- files --

    def add_file(self, tenant: str, filename: str, purpose: str, size: int, path: str, examples: int) -> dict:
        file_id = "file-" + uuid.uuid4().hex[:24]
        self._change("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                     (file_id, tenant, filename, purpose, size, int(time.time()), path, examples))
        return self.file(tenant, file_id)

    def file(self, tenant: str, file_id: str) -> dict | None:
        return self._one("SELECT * FROM files WHERE tenant = ? AND file_id = ?", (tenant, file_id))

    def files(self, tenant: str, purpose: str | None = None) -> list[dict]:
        if purpose is None:
            return self._query("SELECT * FROM files WHERE tenant = ? ORDER BY created_at DESC, file_id", (tenant,))
        return self._query("SELECT * FROM files WHERE tenant = ? AND purpose = ? ORDER BY created_at DESC, file_id",
                           (tenant, purpose))

    def file_usage(self, tenant: str) -> tuple[int, int]:
        """(files, bytes) the tenant holds."""
        row = self._one("SELECT COUNT(*) AS count, COALESCE(SUM(bytes), 0) AS bytes FROM files WHERE tenant = ?",
                        (tenant,))
        return row["count"], row["bytes"]

    def delete_file(self, tenant: str, file_id: str) -> bool:
        return self._change("DELETE FROM files WHERE tenant = ? AND file_id = ?", (tenant, file_id)) > 0

    # -- jobs --

    def add_job(self, tenant: str, **fields) -> dict:
        job_id = "ftjob-" + uuid.uuid4().hex[:24]
        fields = {**fields, "job_id": job_id, "tenant": tenant, "status": "validating_files",
                  "created_at": int(time.time())}
        fields = self._encoded(fields)
        names = ", ".join(fields)
        self._change(f"INSERT INTO jobs ({names}) VALUES ({', '.join('?' * len(fields))})", tuple(fields.values()))
        return self.job(tenant, job_id)

    def job(self, tenant: str | None, job_id: str) -> dict | None:
        if tenant is None:
            return self._one("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
        return self._one("SELECT * FROM jobs WHERE tenant = ? AND job_id = ?", (tenant, job_id))

    def jobs(self, tenant: str, after: str | None, limit: int) -> list[dict]:
        """The tenant's jobs, newest first, after the job `after` (OpenAI's cursor)."""
        rows = self._query("SELECT * FROM jobs WHERE tenant = ? ORDER BY created_at DESC, job_id DESC", (tenant,))
        return self._page(rows, "job_id", after, limit)

    def jobs_in(self, *statuses: str) -> list[dict]:
        marks = ", ".join("?" * len(statuses))
        return self._query(f"SELECT * FROM jobs WHERE status IN ({marks}) ORDER BY created_at, job_id", statuses)

    def update_job(self, job_id: str, **fields) -> None:
        self._update("jobs", "job_id", job_id, fields)

    # -- events and checkpoints --

    def add_event(self, job_id: str, message: str, level: str = "info", kind: str = "message",
                  data: dict | None = None) -> None:
        with self.state.transaction() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM job_events WHERE job_id = ?", (job_id,)).fetchone()[0]
            db.execute("INSERT INTO job_events VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       ("ftevent-" + uuid.uuid4().hex[:24], seq, job_id, int(time.time()), level, message, kind,
                        None if data is None else json.dumps(data)))

    def events(self, job_id: str, after: str | None, limit: int) -> list[dict]:
        """Newest first (OpenAI's order), after the event `after`."""
        rows = self._query("SELECT * FROM job_events WHERE job_id = ? ORDER BY seq DESC", (job_id,))
        return self._page(rows, "event_id", after, limit)

    def add_checkpoint(self, job_id: str, step: int, metrics: dict, model_name: str, path: str) -> None:
        self._change("INSERT INTO job_checkpoints VALUES (?, ?, ?, ?, ?, ?, ?)",
                     ("ftckpt-" + uuid.uuid4().hex[:24], job_id, int(time.time()), step, json.dumps(metrics),
                      model_name, path))

    def checkpoints(self, job_id: str) -> list[dict]:
        return self._query("SELECT * FROM job_checkpoints WHERE job_id = ? ORDER BY step DESC", (job_id,))

    def checkpoint_named(self, tenant: str, model_name: str) -> dict | None:
        return self._one("SELECT c.* FROM job_checkpoints c JOIN jobs j ON c.job_id = j.job_id "
                         "WHERE j.tenant = ? AND c.model_name = ?", (tenant, model_name))
