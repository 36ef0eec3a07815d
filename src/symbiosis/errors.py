"""Every error symbiosis raises on purpose: one base class, one subclass per kind of problem.

Each message names the offending thing (file, tensor, layer, client) so that a user can act on it
without reading our source.
"""


class SymbiosisError(Exception):
    """Base class of all symbiosis errors."""


class CheckpointError(SymbiosisError):
    """A model directory or safetensors file is missing, not a model, truncated or corrupt."""


class FingerprintMismatch(SymbiosisError):
    """Client and executor were built from different checkpoints."""


class UnknownLayer(SymbiosisError):
    """A call named a base layer the executor does not serve."""


class UnknownClient(SymbiosisError):
    """A call came from a client id the executor does not know (never attached, or detached)."""


class BadCall(SymbiosisError):
    """A call's tensor has the wrong shape, dtype or size for the layer it names."""


class UnsupportedAdapter(SymbiosisError):
    """A PEFT method that cannot run exactly on a split model."""


class VirtualWeightAccess(UnsupportedAdapter):
    """Client code tried to read the values of a base weight, which only the executor holds."""


class ExecutorOutOfMemory(SymbiosisError):
    """The executor's device had no memory left for a call; that call fails, everything else carries on."""


class ExecutorUnavailable(SymbiosisError):
    """The executor cannot be reached, or stopped answering within the configured timeout."""


class Unauthorized(SymbiosisError):
    """A client presented no token, or the wrong one."""


class AdapterError(SymbiosisError):
    """An adapter directory is missing, incomplete, or belongs to another base model."""
