"""API keys: which tenant a bearer key belongs to.

The key file holds one `TENANT_NAME API_KEY` pair per line (blank lines and `#` comments allowed). A tenant may
have several keys; a key belongs to one tenant. The tenant named `admin` may read `/metrics` and every tenant's
usage. `reload()` (on SIGHUP) reads the file again and swaps the table at once: requests already running finish,
new ones with a removed key are refused; a file that does not parse leaves the old table in place.

Keys are never kept in clear: the table maps each key's SHA-256 to its tenant, and a presented key is compared
against every entry with `hmac.compare_digest`, so the time taken does not depend on how much of a key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
from pathlib import Path

TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as the executor's tenants (transport/auth.py)
MIN_KEY_LENGTH = 16
ADMIN = "admin"


class KeyFileError(ValueError):
    pass


def read_key_file(path: str | Path) -> list[tuple[str, bytes]]:
    """[(tenant, sha256 of key)], checked: names, key length, no key shared by two tenants."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"cannot read the API key file {path}: {e}") from None
    entries: dict[bytes, str] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileError(f"{path}, line {number}: expected `TENANT_NAME API_KEY`, got {len(parts)} fields")
        tenant, key = parts
        if not TENANT_NAME.fullmatch(tenant):
            raise KeyFileError(f"{path}, line {number}: tenant name {tenant[:80]!r} is not 1-64 of [A-Za-z0-9_-]")
        if len(key) < MIN_KEY_LENGTH:
            raise KeyFileError(f"{path}, line {number}: the key of tenant {tenant!r} is shorter than "
                               f"{MIN_KEY_LENGTH} characters")
        digest = hashlib.sha256(key.encode()).digest()
        if entries.get(digest, tenant) != tenant:
            raise KeyFileError(f"{path}, line {number}: this key already belongs to tenant {entries[digest]!r}")
        entries[digest] = tenant
    if not entries:
        raise KeyFileError(f"{path} holds no `TENANT_NAME API_KEY` line")
    return [(tenant, digest) for digest, tenant in entries.items()]


class ApiKeys:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._entries = read_key_file(self.path)
        self._lock = threading.Lock()

    @property
    def tenants(self) -> set[str]:
        return {tenant for tenant, _ in self._entries}

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant whose key this is, or None."""
        if not key:
            return None
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found = None
        for tenant, entry in self._entries:  # every entry compared: no early exit
            if hmac.compare_digest(digest, entry):
                found = tenant
        return found

    def reload(self) -> str:
        """Read the file again; returns a line for the log (the old table stays if the file does not parse)."""
        try:
            entries = read_key_file(self.path)
        except KeyFileError as e:
            return f"API keys not reloaded, the old ones stay: {e}"
        with self._lock:
            self._entries = entries
        return f"API keys reloaded from {self.path}: {len(entries)} keys of {len({t for t, _ in entries})} tenants"
