"""When a request stops and what text each token adds: the engine's rules, shared by every generator of the
service (engine.py; serve/split_generation.py)."""

from __future__ import annotations


def stop_reason(request, token: int, tokenizer, eos_ids) -> str | None:
    """Why `request` ends with `token` (its newest output), if it does; with a tokenizer, `request.text` becomes the
    output's text (without a final stop token, cut before a stop string)."""
    params = request.params
    reason = "stop" if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids) else None
    if tokenizer is not None:
        request.text = tokenizer.decode(request.output[:-1] if reason else request.output, skip_special_tokens=True)
        hits = [request.text.find(s) for s in params.stop if s in request.text] if reason is None else []
        if hits:
            request.text, reason = request.text[:min(hits)], "stop"
    if reason is None and len(request.output) >= params.max_tokens:
        reason = "length"
    return reason


def new_text(request, final: bool) -> str:
    """The text that the newest token adds, held back while it might still become a stop string or ends in an
    incomplete character."""
    end = len(request.text)
    if not final:
        end -= max((len(s) - 1 for s in request.params.stop), default=0)
        while end > request.emitted and request.text[end - 1] == "\ufffd":
            end -= 1
    delta = request.text[request.emitted:max(end, request.emitted)]
    request.emitted += len(delta)
    return delta
