"""The hosted inference engine (Punica's design): continuous batching over a paged KV cache, many LoRA adapters
in one step through segmented kernels, sharing the executor's base weights."""

from symbiosis.engine.engine import Completion, Engine, Finished, GenerationError, RequestHandle, Token
from symbiosis.engine.params import SamplingParams

__all__ = ["Completion", "Engine", "Finished", "GenerationError", "RequestHandle", "SamplingParams", "Token"]
