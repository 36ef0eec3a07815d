"""When a request stops and what text each token adds: the engine's rules, shared by every generator of the
service (engine.py; serve/split_generation.py).

A request's text is decoded a window at a time, not from its first token each time (which made every token of a
long output cost the whole output's decode, and the engine's thread did it for every running request each step).
The text of the tokens before the window is kept; the window is re-decoded with a few tokens of context before
it, which is what a decoder needs to place a leading space or join a character split over tokens; the text the
context gives alone is cut off. Where the context's text changes as the window grows (a cleanup such as " ." ->
"." that reaches back), the whole output is decoded again. When the request ends, the whole output is decoded once
and that is its text, so the text is plain `tokenizer.decode`'s whatever the window did."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

_CONTEXT = 4  # tokens before the window decoded with it
_WINDOW = 8  # new tokens in the window before its text is kept and a new window opens, unless its text ends in an
# incomplete character; at 4 x _WINDOW it is kept even so (if the character completes later, the context's text
# changes, and the whole output is decoded again)


_backends: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> its Rust tokenizer, or None


def _decoder(tokenizer):
    """`tokenizer.decode(ids, skip_special_tokens=True)`; for a fast tokenizer that only hands the ids to its Rust
    tokenizer (no clean-up of spaces, neither `decode` nor `_decode` overridden), that call itself, without
    transformers' ~10 µs of Python around it (64 requests a step: ~0.6 ms of the engine thread's step)."""
    if tokenizer not in _backends:
        from transformers import PreTrainedTokenizerFast

        plain = isinstance(tokenizer, PreTrainedTokenizerFast) and not tokenizer.clean_up_tokenization_spaces and \
            getattr(tokenizer.decode, "__func__", None) is PreTrainedTokenizerFast.decode and \
            getattr(tokenizer._decode, "__func__", None) is PreTrainedTokenizerFast._decode
        _backends[tokenizer] = tokenizer._tokenizer if plain else None
    backend = _backends[tokenizer]
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@dataclass(eq=False)
class TextSoFar:
    """A request's decoding state: `tokens[:start]` give `text[:kept]`; the window's decode starts at `context`."""
    context: int = 0
    start: int = 0
    kept: int = 0
    context_text: str = ""  # decode(tokens[context:start])


def stop_reason(request, token: int, tokenizer, eos_ids) -> str | None:
    """Why `request` ends with `token` (its newest output), if it does; with a tokenizer, `request.text` becomes the
    output's text (without a final stop token, cut before a stop string)."""
    params = request.params
    stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids)
    reason = "stop" if stop_token else "length" if len(request.output) >= params.max_tokens else None
    if tokenizer is None:
        return reason
    tokens = request.output[:-1] if stop_token else request.output
    decode = _decoder(tokenizer)
    if reason is None:  # the window's text: a stop string in what it adds ends the request
        unchanged = _decode(request, tokens, decode)
        if not any(request.text.find(s, max(0, unchanged - len(s) + 1)) >= 0 for s in params.stop):
            return None
        reason = "stop"
    request.text = decode(tokens)  # it ends: the whole output once, as plain decode gives it
    hits = [hit for hit in (request.text.find(s) for s in params.stop) if hit >= 0] if not stop_token else []
    if hits:
        request.text, reason = request.text[:min(hits)], "stop"
    return reason


def _decode(request, tokens: list[int], decode) -> int:
    """`request.text` for `tokens` (the text so far plus the window's); returns how many leading characters are as
    they were before."""
    state = request.text_state
    window = decode(tokens[state.context:])
    if not window.startswith(state.context_text):  # the new tokens changed the context's text: all of it again
        request.text_state = state = TextSoFar()
        window, unchanged = decode(tokens), 0
    else:
        unchanged = state.kept
    request.text = request.text[:state.kept] + window[len(state.context_text):]
    grown = len(tokens) - state.start
    if grown >= 4 * _WINDOW or (grown >= _WINDOW and not request.text.endswith("\ufffd")):  # keep it; a new window
        context = len(tokens)
        while True:  # a context with text in it: a decoder strips a leading space where its text starts
            context = max(0, context - _CONTEXT)
            context_text = decode(tokens[context:])
            if context == 0 or context_text.strip():
                break
        request.text_state = TextSoFar(context, len(tokens), len(request.text), context_text)
    return unchanged


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
