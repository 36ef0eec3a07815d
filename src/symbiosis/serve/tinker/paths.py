"""Names a client chooses and the paths the Tinker API hands out: checked before any file is touched.

    tinker://{model_id}/weights/{name}           a training checkpoint (adapter + optimizer state)
    tinker://{model_id}/sampler_weights/{name}   weights to sample from (the adapter)

model_id is `{session_id}:train:{n}` (the SDK builds it so itself); names are 1-64 of [A-Za-z0-9._-] and not
`.` or `..`. A path resolves only to a checkpoint row of the caller's (store.py), whose directory this service
made: no name or path a client sends is ever joined to a directory unchecked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from symbiosis.errors import BadCall

NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
SESSION = re.compile(r"[0-9a-f]{20}")
MODEL_ID = re.compile(r"([0-9a-f]{20}):train:([0-9]{1,9})")
KINDS = {"weights": "training", "sampler_weights": "sampler"}


def check_name(name: str, what: str = "name") -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or name in (".", ".."):
        raise BadCall(f"{what} must be 1-64 of [A-Za-z0-9._-], got {str(name)[:80]!r}")
    return name


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def model_directory_name(model: str) -> str:
    """A model id as a directory name (its `:` as `-`: ids hold hex digits, digits and `train` only)."""
    if not MODEL_ID.fullmatch(model):
        raise BadCall(f"not a model id of this service: {model[:80]!r}")
    return model.replace(":", "-")


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str  # "weights" or "sampler_weights"
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @classmethod
    def parse(cls, path: str) -> "TinkerPath":
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise BadCall(f"not a tinker:// path: {str(path)[:120]!r}")
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in KINDS or not MODEL_ID.fullmatch(parts[0]):
            raise BadCall(f"{path[:120]!r} is not tinker://MODEL_ID/weights|sampler_weights/NAME")
        return cls(parts[0], parts[1], check_name(parts[2], "the checkpoint's name"))
