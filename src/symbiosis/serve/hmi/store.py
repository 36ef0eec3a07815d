"""What HMI's lifecycle keeps in the service's SQLite database (serve/state.py), beside its files under
STATE_DIR/hmi/{domains,models}/ID/.

    hmi_domains(domain_id, tenant, name, version, status, stage, done, total, error, corpus_file, options,
                created_at, finished_at, entries, table_bytes)
        one row per version of a tenant's domain; version N+1 starts from version N's lower layers
    hmi_models(model_id, tenant, name, version, domain_id, status, stage, done, total, error, training_file,
               options, created_at, finished_at)
        one row per version of a tenant's model (an adapter on the upper layers over a domain version, or over
        the root when domain_id is NULL); version N+1 trains version N's adapter further

status: queued -> running -> ready | failed; `stage` names the step running (pretraining, building, training) and
`done`/`total` its progress. Every read names the caller's tenant; the admin's domains are everyone's to build on.
"""

from __future__ import annotations

import time
import uuid

from symbiosis.serve.state import Tables

SCHEMA = """
CREATE TABLE IF NOT EXISTS hmi_domains (
    domain_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL, version INTEGER NOT NULL,
    status TEXT NOT NULL, stage TEXT, done INTEGER NOT NULL DEFAULT 0, total INTEGER NOT NULL DEFAULT 0, error TEXT,
    corpus_file TEXT NOT NULL, options TEXT NOT NULL, created_at INTEGER NOT NULL, finished_at INTEGER,
    entries TEXT, table_bytes INTEGER, UNIQUE (tenant, name, version));
CREATE TABLE IF NOT EXISTS hmi_models (
    model_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL, version INTEGER NOT NULL,
    domain_id TEXT, status TEXT NOT NULL, stage TEXT, done INTEGER NOT NULL DEFAULT 0,
    total INTEGER NOT NULL DEFAULT 0, error TEXT, training_file TEXT NOT NULL, options TEXT NOT NULL,
    created_at INTEGER NOT NULL, finished_at INTEGER, UNIQUE (tenant, name, version));
"""
UNFINISHED = ("queued", "running")
DOMAINS_TABLE, MODELS_TABLE = "hmi_domains", "hmi_models"
KEY = {DOMAINS_TABLE: "domain_id", MODELS_TABLE: "model_id"}  # each table's id column


class HmiStore(Tables):
    SCHEMA = SCHEMA
    JSON_COLUMNS = ("options", "entries")

    def add(self, table: str, tenant: str, name: str, **fields) -> dict:
        """A new version (1 + the latest) of the tenant's domain or model `name`, queued."""
        key = KEY[table]
        row_id = ("dom-" if table == DOMAINS_TABLE else "hmi-") + uuid.uuid4().hex[:20]
        fields = self._encoded(fields)
        with self.state.transaction() as db:
            latest = db.execute(f"SELECT MAX(version) FROM {table} WHERE tenant = ? AND name = ?",
                                (tenant, name)).fetchone()[0]
            columns = {key: row_id, "tenant": tenant, "name": name, "version": (latest or 0) + 1, "status": "queued",
                       "created_at": int(time.time()), **fields}
            db.execute(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                       tuple(columns.values()))
        return self.get(table, row_id)

    def get(self, table: str, row_id: str) -> dict | None:
        return self._one(f"SELECT * FROM {table} WHERE {KEY[table]} = ?", (row_id,))

    def versions(self, table: str, tenant: str, name: str) -> list[dict]:
        """Every version of the tenant's `name`, newest first."""
        return self._query(f"SELECT * FROM {table} WHERE tenant = ? AND name = ? ORDER BY version DESC", (tenant, name))

    def names(self, table: str, tenants: tuple[str, ...]) -> list[dict]:
        """The newest version of each name these tenants have, by tenant and name."""
        marks = ", ".join("?" * len(tenants))
        return self._query(f"SELECT * FROM {table} t WHERE tenant IN ({marks}) AND version = (SELECT MAX(version) "
                           f"FROM {table} WHERE tenant = t.tenant AND name = t.name) ORDER BY tenant, name", tenants)

    def update(self, table: str, row_id: str, **fields) -> None:
        self._update(table, KEY[table], row_id, fields)

    def delete(self, table: str, tenant: str, name: str) -> list[dict]:
        """Remove every version of the tenant's `name`; returns the rows removed."""
        rows = self.versions(table, tenant, name)
        self._change(f"DELETE FROM {table} WHERE tenant = ? AND name = ?", (tenant, name))
        return rows

    def count(self, table: str, tenant: str) -> int:
        """How many versions of domains or models the tenant keeps."""
        return self._one(f"SELECT COUNT(*) AS n FROM {table} WHERE tenant = ?", (tenant,))["n"]

    def domain_usage(self, tenant: str) -> tuple[int, int]:
        """(versions, bytes of their finished tables) of the tenant's domains."""
        row = self._one("SELECT COUNT(*) AS versions, COALESCE(SUM(table_bytes), 0) AS held FROM hmi_domains "
                        "WHERE tenant = ?", (tenant,))
        return row["versions"], row["held"]

    def unfinished(self, table: str) -> list[dict]:
        return self._query(f"SELECT * FROM {table} WHERE status IN {UNFINISHED} ORDER BY created_at")
