"""symbiosis: one frozen base model served to many tenants, each fine-tuning or generating with its own
PEFT adapters, through split execution (the base layers run in a shared executor)."""

from symbiosis.client.build import from_pretrained
from symbiosis.client.privacy import NoiseMasking
from symbiosis.errors import (
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
from symbiosis.executor.executor import Executor
from symbiosis.transport.client import connect

__all__ = [
    "BadCall",
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
    "connect",
    "from_pretrained",
]
