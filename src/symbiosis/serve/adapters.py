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
        try:
            directory = (self.root / relative).resolve(strict=True)
        except (OSError, RuntimeError):
            raise ApiError(400, f"no adapter directory `{lora_path}` under the adapter root", "lora_path") from None
        if directory != self.root and self.root not in directory.parents:
            raise ApiError(400, f"`{lora_path}` leads outside the adapter root", "lora_path")
        if not directory.is_dir():
            raise ApiError(400, f"`{lora_path}` is not a directory", "lora_path")
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            file = directory / name
            if not file.is_file() or (file.is_symlink() and self.root not in file.resolve().parents):
                raise ApiError(400, f"`{lora_path}` has no {name} (a PEFT adapter saved with safetensors)",
                               "lora_path")
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
            raise ApiError(400, str(e).replace(str(self.root), "<adapter root>"), "lora_path", "invalid_adapter") from None
        if not self.state.add_adapter(tenant, name, os.fspath(directory.relative_to(self.root))):
            raise ApiError(400, f"you have an adapter named `{name}` already; unload it first", "lora_name",
                           "adapter_exists")

    def unload(self, tenant: str, name: str) -> None:
        if not ADAPTER_NAME.fullmatch(name) or not self.state.remove_adapter(tenant, name):
            raise not_found(name)

    def lookup(self, tenant: str, name: str) -> tuple[str, Path]:
        """(engine name, directory) of the tenant's adapter `name`; 404 if the tenant has none of that name, or
        if its directory has gone from the root since."""
        found = self.state.adapter(tenant, name) if ADAPTER_NAME.fullmatch(name) else None
        if found is None or self.root is None:
            raise not_found(name)
        directory = self.root / found[0]
        return self.engine_name(tenant, name), directory

    def listed(self, tenant: str) -> list[tuple[str, float]]:
        return [(name, loaded_at) for name, _, loaded_at in self.state.adapters(tenant)]

    @staticmethod
    def engine_name(tenant: str, name: str) -> str:
        return f"{tenant}/{name}"
