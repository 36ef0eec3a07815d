"""symbiosis: one frozen base model served to many tenants, each fine-tuning or generating with its own
PEFT adapters, through split execution (the base layers run in a shared executor).

The public names load on first use, so `import symbiosis` (and the `symbiosis` command) does not import
torch: the command sets process-wide defaults (OpenMP's wait policy) that torch reads when it loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from symbiosis.errors import (
    AdapterError,
    BadCall,
    CheckpointError,
    ExecutorOutOfMemory,
    ExecutorUnavailable,
    FingerprintMismatch,
    SymbiosisError,
    UnknownClient,
    UnknownLayer,
    Unauthorized,
    UnsupportedAdapter,
    VirtualWeightAccess,
)

if TYPE_CHECKING:
    from symbiosis.client.build import from_pretrained
    from symbiosis.client.captured import CapturedStep
    from symbiosis.client.loss import causal_lm_loss
    from symbiosis.client.privacy import NoiseMasking
    from symbiosis.executor.executor import Executor
    from symbiosis.transport.client import connect

_LAZY = {
    "from_pretrained": "symbiosis.client.build",
    "CapturedStep": "symbiosis.client.captured",
    "causal_lm_loss": "symbiosis.client.loss",
    "NoiseMasking": "symbiosis.client.privacy",
    "Executor": "symbiosis.executor.executor",
    "connect": "symbiosis.transport.client",
}

__all__ = [
    "AdapterError",
    "BadCall",
    "CapturedStep",
    "CheckpointError",
    "Executor",
    "ExecutorOutOfMemory",
    "ExecutorUnavailable",
    "FingerprintMismatch",
    "NoiseMasking",
    "SymbiosisError",
    "UnknownClient",
    "UnknownLayer",
    "Unauthorized",
    "UnsupportedAdapter",
    "VirtualWeightAccess",
    "causal_lm_loss",
    "connect",
    "from_pretrained",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'symbiosis' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
