"""Generation for the adapters the hosted engine does not run (PEFT methods other than plain LoRA: IA3, LoHa,
prefix tuning, ...): each on a split client of the service's executor (PEFT's own model over the shared base
weights, exact), a request at a time per adapter, beside the engine.

It answers as the engine does: `submit(prompt, params, adapter, events)` puts `Token`s, then one `Finished`, into
`events`, and returns a handle with `cancel()`; the tokens are chosen by the engine's own sampling, stops and text
rules (engine/sampling.py, engine/stops.py), inside transformers' `generate()` (which knows how each PEFT method
generates): a logits processor makes the choice, a stopping criterion streams it and says when to stop. The models
of the `cached` adapters used last are kept.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict

import torch

from symbiosis.engine import Finished, GenerationError, Token, sampling, stops
from symbiosis.engine.scheduler import Request
from symbiosis.errors import BadCall


class _Handle:
    def __init__(self):
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def _close(model, lock: threading.Lock) -> None:
    with lock:
        model.get_base_model().symbiosis_session.close()


class SplitGenerator:
    def __init__(self, service, cached: int = 2):
        self.service, self.cached = service, cached
        self._models: OrderedDict[str, tuple[object, threading.Lock]] = OrderedDict()
        self._lock = threading.Lock()
        generation = service.engine.model.generation_config
        eos = generation.eos_token_id if generation is not None else None
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])

    def _model(self, name: str, directory: str):
        """(PeftModel on a split client, its lock), made on first use; beyond `cached`, the least recently used goes
        (its session closes once its running request, if any, ends). Made under the cache's lock: two requests for
        a new adapter make one model."""
        import peft
        from transformers import GenerationConfig

        import symbiosis

        with self._lock:
            if name in self._models:
                self._models.move_to_end(name)
                return self._models[name]
            service = self.service
            base = symbiosis.from_pretrained(service.model_path, service.executor, device=service.executor.device,
                                             name="split-generation")
            # no generation defaults of the checkpoint (a repetition penalty, EOS ids): the engine's rules choose
            # and stop (_run), so the answer is the engine's for the same adapter
            base.generation_config = GenerationConfig(pad_token_id=0)
            model = peft.PeftModel.from_pretrained(base, directory).eval()
            self._models[name] = (model, threading.Lock())
            while len(self._models) > self.cached:
                _, old = self._models.popitem(last=False)
                threading.Thread(target=_close, args=old, daemon=True).start()
            return self._models[name]

    def submit(self, prompt: list[int], params, adapter: tuple[str, str], request_id: str | None = None, events=None,
               owner: str | None = None):  # (one request at a time per model: no queue to take turns in)
        vocab = self.service.engine.model.get_input_embeddings().weight.shape[0]
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise BadCall(f"the prompt is empty or holds token ids outside the vocabulary (0..{vocab - 1})")
        limit = self.service.engine.context_limit
        if limit is not None and len(prompt) + params.max_tokens > limit:
            raise BadCall(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the model's "
                          f"context of {limit} tokens")
        model, lock = self._model(*adapter)
        handle = _Handle()
        threading.Thread(target=self._run, args=(model, lock, prompt, params, events, handle), daemon=True,
                         name="symbiosis-split-generation").start()
        return handle

    def _run(self, model, lock, prompt, params, events, handle) -> None:
        from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria

        device = self.service.executor.device
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device)
            generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(2**62, ())))
        request = Request(uuid.uuid4().hex, prompt, params, None, generator)
        tokenizer, eos_ids = self.service.tokenizer, self.eos_ids
        state = {"choice": None, "reason": None, "error": None}

        class Choose(LogitsProcessor):  # the engine's choice of the next token; every other token masked
            def __call__(self, input_ids, scores):
                choice = sampling.launch(scores[:1], [request]).read([request])[0]
                if choice is None:
                    raise GenerationError("the model's logits are NaN or Inf; the request is stopped", retryable=False)
                state["choice"] = choice
                forced = torch.full_like(scores, float("-inf"))
                forced[:, choice.token] = 0
                return forced

        class Stream(StoppingCriteria):  # streams the token just chosen; stops as the engine would
            def __call__(self, input_ids, scores, **kwargs):
                choice = state["choice"]
                request.output.append(choice.token)
                reason = stops.stop_reason(request, choice.token, tokenizer, eos_ids)
                events.put(Token(choice.token, stops.new_text(request, final=reason is not None), choice.logprob,
                                 choice.top_logprobs))
                state["reason"] = reason
                return torch.tensor([reason is not None or handle.cancelled], device=input_ids.device)

        try:
            with lock, torch.no_grad():
                model.generate(input_ids=torch.tensor([prompt], device=device),
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                               generation_config=GenerationConfig(do_sample=False, max_new_tokens=params.max_tokens,
                                                                  pad_token_id=0),
                               logits_processor=[Choose()], stopping_criteria=[Stream()])
        except Exception as e:  # noqa: BLE001 -- this request's failure
            events.put(Finished(None, e if isinstance(e, GenerationError) else GenerationError(str(e))))
            return
        events.put(Finished("cancelled" if handle.cancelled and state["reason"] is None else state["reason"] or "length"))
