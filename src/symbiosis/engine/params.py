"""What one request asks for: how to sample, when to stop, what to report."""

from __future__ import annotations

from dataclasses import dataclass

from symbiosis.errors import BadCall

MAX_LOGPROBS = 20  # top alternatives a request may ask for per token (OpenAI's own limit)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0: greedy (the argmax, as transformers' greedy search). Otherwise the logits are divided by
    `temperature`, cut to the `top_k` largest and to the smallest set whose probability reaches `top_p`
    (transformers' order and semantics), and one token is drawn with the request's own generator, seeded by
    `seed` when given (the same seed, prompt and adapter draw the same tokens, whatever else is batched).

    Stops at `max_tokens`, at any of `stop_token_ids` or the model's end-of-sequence ids (unless
    `ignore_eos`), or when the text ends with one of `stop` (the stop text is cut off the output; needs the
    engine's tokenizer). `logprobs`: report each chosen token's log-probability under the model (raw logits, before
    temperature), with the `logprobs` most likely alternatives."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be a positive integer, got {self.max_tokens!r}"),
            (0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature!r}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be a non-negative integer (0: off), got {self.top_k!r}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (len(self.stop) <= 16, f"at most 16 stop strings, got {len(self.stop)}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise BadCall(message)
