"""Tenants' adapters: loaded by name from directories under the adapter root, each the tenant's own.

`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` (vLLM's shape): `lora_path` is a path relative to
`--adapter-root`. Refused: absolute paths, `..`, anything (a symlink included) that resolves outside the root,
names outside `[A-Za-z0-9._-]{1,64}`, directories without `adapter_config.json` and `adapter_model.safetensors`
(no pickle is ever read: the engine reads safetensors only). Nothing is fetched from a URL or a hub. The adapter is
read and checked against the base by the engine when loaded, so a bad one is refused at once, with the reason.

An adapter is its tenant's: in the engine its name is `TENANT/NAME`, and another tenant asking for NAME gets the
same 404 as for a name that exists nowhere.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from symbiosis.errors import SymbiosisError
from symbiosis.serve.errors import ApiError, not_found
from symbiosis.serve.state import StateStore

ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")
# every file of an adapter directory that the server reads: the engine's, the base fingerprint's, the chat template's
ADAPTER_FILES = REQUIRED_FILES + ("symbiosis.json", "chat_template.jinja", "tokenizer_config.json")


class AdapterRegistry:
    def __init__(self, root: str | Path | None, state: StateStore, engine, base_name: str):
        self.root = None if root is None else Path(root).resolve()
        self.state, self.engine, self.base_name = state, engine, base_name

    def resolve(self, lora_path: str) -> Path:
        """The directory `lora_path` names under the root, or ApiError(400) saying why not."""
        if self.root is None:
            raise ApiError(400, "this server loads no adapters (it was started without --adapter-root)", "lora_path")
        if not lora_path or "\x00" in lora_path or "\\" in lora_path:
            raise ApiError(400, "lora_path must be a non-empty relative path with / separators", "lora_path")
        relative = PurePosixPath(lora_path)
        if relative.is_absolute() or ".." in relative.parts or lora_path.startswith("~"):
            raise ApiError(400, "lora_path must be relative to the adapter root, without `..`", "lora_path")
        return self._confined(lora_path)

    def _confined(self, lora_path: str) -> Path:
        """The adapter directory at `lora_path` under the root, resolved now, with every file that is read from it
        (ADAPTER_FILES) a plain file inside the root (a symlink may lead within the root, not out of it); else
        ApiError(400). Checked at load and again on every use: a directory or file swapped for a symlink since is
        refused then. (A swap between this check and the read is not caught: the root is the operator's, not a
        place tenants write to.)"""
        try:
            directory = (self.root / lora_path).resolve(strict=True)
        except (OSError, RuntimeError):
            raise ApiError(400, f"no adapter directory `{lora_path}` under the adapter root", "lora_path") from None
        if directory != self.root and self.root not in directory.parents:
            raise ApiError(400, f"`{lora_path}` leads outside the adapter root", "lora_path")
        if not directory.is_dir():
            raise ApiError(400, f"`{lora_path}` is not a directory", "lora_path")
        for name in ADAPTER_FILES:
            file = directory / name
            if not os.path.lexists(file):
                if name in REQUIRED_FILES:
                    raise ApiError(400, f"`{lora_path}` has no {name} (a PEFT adapter saved with safetensors)",
                                   "lora_path")
                continue
            target = file.resolve()
            if self.root not in target.parents or not target.is_file():
                raise ApiError(400, f"`{lora_path}`: {name} is not a file inside the adapter root", "lora_path")
        return directory

    def load(self, tenant: str, name: str, lora_path: str) -> None:
        if not ADAPTER_NAME.fullmatch(name) or name == self.base_name:
            raise ApiError(400, "lora_name must be 1-64 of [A-Za-z0-9._-] and not the base model's name", "lora_name")
        directory = self.resolve(lora_path)
        if self.state.adapter(tenant, name) is not None:
            raise ApiError(400, f"you have an adapter named `{name}` already; unload it first", "lora_name",
                           "adapter_exists")
        try:
            self.engine.adapters.load(self.engine_name(tenant, name), directory)  # read and checked now
        except SymbiosisError as e:  # the reason, without where the root lies on the server's disk
            raise ApiError(400, self.public(str(e)), "lora_path", "invalid_adapter") from None
        if not self.state.add_adapter(tenant, name, os.fspath(directory.relative_to(self.root))):
            raise ApiError(400, f"you have an adapter named `{name}` already; unload it first", "lora_name",
                           "adapter_exists")

    def unload(self, tenant: str, name: str) -> None:
        if not ADAPTER_NAME.fullmatch(name) or not self.state.remove_adapter(tenant, name):
            raise not_found(name)

    def lookup(self, tenant: str, name: str) -> tuple[str, Path]:
        """(engine name, directory) of the tenant's adapter `name`; 404 if the tenant has none of that name; 400
        if its directory has gone from the root since, or now leads out of it."""
        found = self.state.adapter(tenant, name) if ADAPTER_NAME.fullmatch(name) else None
        if found is None or self.root is None:
            raise not_found(name)
        try:
            directory = self._confined(found[0])
        except ApiError as e:
            raise ApiError(400, f"adapter `{name}`: {e.message}", "model", "invalid_adapter") from None
        return self.engine_name(tenant, name), directory

    def public(self, message: str) -> str:
        """`message` without where the adapter root lies on the server's disk."""
        return message if self.root is None else message.replace(str(self.root), "<adapter root>")

    def listed(self, tenant: str) -> list[tuple[str, float]]:
        return [(name, loaded_at) for name, _, loaded_at in self.state.adapters(tenant)]

    @staticmethod
    def engine_name(tenant: str, name: str) -> str:
        return f"{tenant}/{name}"
