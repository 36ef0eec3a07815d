"""The service's durable state: one SQLite database (`STATE_DIR/symbiosis.db`, WAL journal) and the files it
refers to. Every write is one transaction; readers never see half of one. Tables:

    adapters(tenant, name, path, loaded_at)          an adapter a tenant loaded: its directory under the
                                                     adapter root (relative), served until unloaded
    usage(tenant, model, requests, prompt_tokens,    counters per tenant and model (the base or an adapter),
          completion_tokens, errors)                 kept across restarts
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    tenant TEXT NOT NULL, name TEXT NOT NULL, path TEXT NOT NULL, loaded_at REAL NOT NULL,
    PRIMARY KEY (tenant, name));
CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL, model TEXT NOT NULL, requests INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
    errors INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (tenant, model));
"""


class StateStore:
    def __init__(self, state_dir: str | Path):
        self.directory = Path(state_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "symbiosis.db"
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        # one connection, used by the HTTP workers and the engine's and the trainer's callbacks; reentrant: a batch's
        # thread runs transactions (and reads) inside it
        self._lock = threading.RLock()
        self._batch = threading.local()  # .after: the open batch's calls for after its commit (this thread's)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)

    def _open_batch(self) -> list | None:
        """This thread's open batch's calls for after its commit, or None outside a batch."""
        return getattr(self._batch, "after", None)

    @contextmanager
    def transaction(self):
        """The connection, inside one transaction (committed at the end, rolled back on an error); inside this
        thread's open `batch`, part of the batch's."""
        with self._lock:
            if self._open_batch() is not None:
                yield self._db
                return
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def batch(self):
        """This thread's transactions in one until the end of the block (the training queue's answers of a round:
        32 tenants' answers were ~130 transactions, each statement handing the interpreter to the HTTP threads and
        waiting to get it back, which made a pass of the SDK's tenants twice as long as the engine's). Calls given
        to `after_commit` meanwhile run once it is committed. Other threads wait for the database meanwhile."""
        if self._open_batch() is not None:  # nested: the outer one commits
            yield
            return
        with self.transaction():
            self._batch.after = []
            try:
                yield
            finally:
                after, self._batch.after = self._batch.after, None
        for call in after:
            call()

    def after_commit(self, call) -> None:
        """`call()` once what this thread wrote is committed: now, or at the end of its open batch (an answer's
        waiters are told once it can be read)."""
        after = self._open_batch()
        if after is None:
            call()
        else:
            after.append(call)

    @contextmanager
    def reading(self):
        """The connection, for one statement that only reads (SQLite makes it a snapshot of its own): no write
        transaction around it (BEGIN IMMEDIATE and COMMIT were two more statements and the database's write lock
        for every read, each statement handing the interpreter to the other threads and back)."""
        with self._lock:
            yield self._db

    def change(self, sql: str, parameters: tuple = ()) -> int:
        """One statement that writes: its own transaction (SQLite commits a statement outside BEGIN by itself), or
        part of this thread's open batch; the rows it changed. (In `transaction()` it was three statements, BEGIN
        IMMEDIATE and COMMIT around it, on the event loop for every request a training loop submits.)"""
        with self._lock:
            return self._db.execute(sql, parameters).rowcount

    def _read(self, sql: str, parameters: tuple = ()) -> list[tuple]:
        with self.reading() as db:
            return db.execute(sql, parameters).fetchall()

    def create(self, schema: str) -> None:
        """More tables (a part of the service keeps its own: serve/tinker/store.py)."""
        with self._lock:
            self._db.executescript(schema)

    # -- adapters --

    def add_adapter(self, tenant: str, name: str, path: str) -> bool:
        """False if the tenant has an adapter of that name already."""
        try:
            self.change("INSERT INTO adapters (tenant, name, path, loaded_at) VALUES (?, ?, ?, ?)",
                        (tenant, name, path, time.time()))
        except sqlite3.IntegrityError:
            return False
        return True

    def remove_adapter(self, tenant: str, name: str) -> bool:
        return self.change("DELETE FROM adapters WHERE tenant = ? AND name = ?", (tenant, name)) > 0

    def adapter(self, tenant: str, name: str) -> tuple[str, float] | None:
        """(path relative to the adapter root, loaded_at) of the tenant's adapter, or None."""
        rows = self._read("SELECT path, loaded_at FROM adapters WHERE tenant = ? AND name = ?", (tenant, name))
        return rows[0] if rows else None

    def adapters(self, tenant: str) -> list[tuple[str, str, float]]:
        """[(name, path, loaded_at)] of the tenant's adapters, by name."""
        return self._read("SELECT name, path, loaded_at FROM adapters WHERE tenant = ? ORDER BY name", (tenant,))

    # -- usage --

    def count(self, tenant: str, model: str, prompt_tokens: int, completion_tokens: int, error: bool) -> None:
        self.change("INSERT INTO usage (tenant, model, requests, prompt_tokens, completion_tokens, errors) "
                    "VALUES (?, ?, 1, ?, ?, ?) ON CONFLICT (tenant, model) DO UPDATE SET "
                    "requests = requests + 1, prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                    "completion_tokens = completion_tokens + excluded.completion_tokens, "
                    "errors = errors + excluded.errors",
                    (tenant, model, prompt_tokens, completion_tokens, int(error)))

    def usage(self, tenant: str | None = None) -> list[dict]:
        """Counters per (tenant, model): one tenant's, or everyone's (None)."""
        sql = "SELECT tenant, model, requests, prompt_tokens, completion_tokens, errors FROM usage"
        rows = self._read(sql + (" WHERE tenant = ?" if tenant else "") + " ORDER BY tenant, model",
                          (tenant,) if tenant else ())
        keys = ("tenant", "model", "requests", "prompt_tokens", "completion_tokens", "errors")
        return [dict(zip(keys, row)) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class Tables:
    """A part of the service with tables of its own in the state's database (serve/tinker/store.py,
    serve/jobs/store.py): `SCHEMA` made at start, rows read as dicts, `JSON_COLUMNS` held as JSON text."""

    SCHEMA = ""
    JSON_COLUMNS: tuple[str, ...] = ()

    def __init__(self, state: StateStore):
        self.state = state
        state.create(self.SCHEMA)

    def _rows(self, cursor) -> list[dict]:
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, row)) for row in cursor.fetchall()]
        for row in rows:
            for column in self.JSON_COLUMNS:
                if row.get(column) is not None:
                    row[column] = json.loads(row[column])
        return rows

    def _encoded(self, fields: dict) -> dict:
        return {name: json.dumps(value) if name in self.JSON_COLUMNS and value is not None else value
                for name, value in fields.items()}

    def _query(self, sql: str, parameters: tuple = ()) -> list[dict]:
        """The rows of one SELECT."""
        with self.state.reading() as db:
            return self._rows(db.execute(sql, parameters))

    def _one(self, sql: str, parameters: tuple) -> dict | None:
        rows = self._query(sql, parameters)
        return rows[0] if rows else None

    def _change(self, sql: str, parameters: tuple) -> int:
        return self.state.change(sql, parameters)

    def _update(self, table: str, key_column: str, key: str, fields: dict) -> None:
        """Set `fields` (column -> value, JSON columns encoded) of the row whose `key_column` is `key`; the table
        and column names are the code's, never a caller's."""
        fields = self._encoded(fields)
        self._change(f"UPDATE {table} SET {', '.join(f'{name} = ?' for name in fields)} WHERE {key_column} = ?",
                     (*fields.values(), key))

    @staticmethod
    def _page(rows: list[dict], id_column: str, after: str | None, limit: int) -> list[dict]:
        """OpenAI's cursor: the rows after the one whose `id_column` is `after` (none if it is not there), up to
        limit + 1 of them (the caller's has_more)."""
        if after is not None:
            ids = [row[id_column] for row in rows]
            rows = rows[ids.index(after) + 1:] if after in ids else []
        return rows[:limit + 1]
