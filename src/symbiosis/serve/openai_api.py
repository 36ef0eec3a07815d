"""OpenAI's inference API on the hosted engine: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (JSON or
Server-Sent Events in OpenAI's chunk format, ending with `data: [DONE]`), and vLLM's `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`.

`model` is the base's served name or one of the caller's adapters. Greedy decoding (`temperature` 0) is the
engine's, which equals plain transformers + PEFT; with a `seed`, sampling is reproducible (choice i of `n` uses
seed + i). A chat is rendered with the adapter's own chat template when its directory has one
(`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`), else the base tokenizer's.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from symbiosis.engine import GenerationError, SamplingParams
from symbiosis.client.adapter_files import read_json
from symbiosis.errors import AdapterError, BadCall, SymbiosisError
from symbiosis.serve.errors import ApiError, not_found
from symbiosis.serve.generation import Generation
from symbiosis.serve.schemas import MAX_PROMPTS, ChatRequest, CompletionRequest, LoadAdapterRequest, UnloadAdapterRequest
from symbiosis.serve.templates import TemplateError

MAX_CHAT_TEMPLATE_BYTES = 1 << 20
# Completion prompts of more characters are tokenized on a worker thread: the tokenizer holds the event loop, every
# tenant's, for as long as it runs (a 7.8 MB prompt: 7 s); shorter ones are not worth the thread's hand-off. (A chat
# is always rendered and tokenized off the loop: its template's run time is not its text's length.)
OFF_LOOP_CHARS = 1 << 16


def router(service, tenant_dependency) -> APIRouter:
    api = APIRouter()
    caller = Depends(tenant_dependency)

    @api.get("/v1/models")
    def list_models(tenant: str = caller):
        return {"object": "list", "data": [service.model_card(service.base_name, None)] + [
            service.model_card(name, created) for name, created in service.adapters.listed(tenant)]}

    @api.get("/v1/models/{model:path}")
    def retrieve_model(model: str, tenant: str = caller):
        if model == service.base_name:
            return service.model_card(model, None)
        listed = dict(service.adapters.listed(tenant))
        if model not in listed:
            raise not_found(model)
        return service.model_card(model, listed[model])

    @api.post("/v1/load_lora_adapter")
    def load_adapter(body: LoadAdapterRequest, tenant: str = caller):
        service.adapters.load(tenant, body.lora_name, body.lora_path)
        return {"status": "ok", "lora_name": body.lora_name}

    @api.post("/v1/unload_lora_adapter")
    def unload_adapter(body: UnloadAdapterRequest, tenant: str = caller):
        service.adapters.unload(tenant, body.lora_name)
        return {"status": "ok", "lora_name": body.lora_name}

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, tenant: str = caller):
        adapter = service.resolve(tenant, body.model)
        text = [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)]
        prompts = await _tokenized(lambda: _completion_prompts(body.prompt, service.tokenizer), map(len, text))
        return await _run(service, tenant, body, request, adapter, prompts, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request, tenant: str = caller):
        adapter, tokenizer = service.resolve(tenant, body.model), service.tokenizer
        template = None if adapter is None else _adapter_chat_template(adapter[1])
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]

        def render() -> list[int]:
            if template is not None:  # the tenant's own: a program, run in a worker process (serve/templates.py)
                try:
                    prompt = service.templates.render(tenant, template, messages)
                except TemplateError as e:
                    raise ApiError(400, str(e), "messages") from None
                except OSError:
                    raise ApiError(503, "the chat template renderer could not start; try again") from None
            else:
                try:
                    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                except Exception as e:  # noqa: BLE001 -- no template, or one that refuses these messages
                    raise ApiError(400, f"cannot render these messages with the model's chat template: {e}",
                                   "messages") from None
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
        # (always off the event loop: a template, even the base's, runs as long as its messages make it)
        ids = await asyncio.to_thread(render)
        return await _run(service, tenant, body, request, adapter, [ids], chat=True)

    return api


async def _tokenized(work, lengths):
    """`work()`, on a worker thread when the texts (`lengths`: their characters) are long."""
    return await asyncio.to_thread(work) if sum(lengths) > OFF_LOOP_CHARS else work()


def _completion_prompts(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], int):  # (the schema's union made the list one type: list[int])
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt must hold 1 to {MAX_PROMPTS} prompts", "prompt")
    encoded = []
    for p in prompts:
        ids = tokenizer(p)["input_ids"] if isinstance(p, str) else list(p)
        if not ids:
            raise ApiError(400, "a prompt is empty", "prompt")
        encoded.append(ids)
    return encoded


def _adapter_chat_template(directory: Path) -> str | None:
    """The adapter's own chat template, if its directory has one (read as text: it runs in a worker process, see
    serve/templates.py). The directory's files were confined to the adapter root when it was resolved."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        if jinja.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
            raise ApiError(400, f"the adapter's chat_template.jinja is over {MAX_CHAT_TEMPLATE_BYTES} bytes", "model")
        return jinja.read_text(encoding="utf-8", errors="replace")
    config = directory / "tokenizer_config.json"
    if config.is_file():
        try:
            template = read_json(config, "a tokenizer config", MAX_CHAT_TEMPLATE_BYTES)
        except AdapterError as e:
            raise ApiError(400, str(e).replace(str(config), "the adapter's tokenizer_config.json"), "model") from None
        template = template.get("chat_template") if isinstance(template, dict) else None
        return template if isinstance(template, str) else None
    return None


def _params(service, body, prompt_length: int, index: int, chat: bool) -> SamplingParams:
    if chat:
        limit = body.max_completion_tokens or body.max_tokens
        if limit is None:  # a chat runs to the end of the context (at most max_chat_tokens)
            limit = max(1, min(service.max_chat_tokens, service.context_limit - prompt_length))
        if body.top_logprobs is not None and not body.logprobs:  # (OpenAI refuses it too)
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        limit = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        logprobs = body.logprobs
    seed = None if body.seed is None else (body.seed + index) % 2**63
    try:
        return SamplingParams(max_tokens=limit, temperature=body.temperature, top_p=body.top_p, seed=seed,
                              stop=body.stop_strings(), logprobs=logprobs)
    except BadCall as e:
        raise ApiError(400, str(e), "stop" if "stop" in str(e) else None) from None


async def _run(service, tenant: str, body, request: Request, adapter, prompts: list[list[int]], chat: bool):
    expanded = [(p, i) for p in prompts for i in range(body.n)]
    params = [_params(service, body, len(p), i, chat) for p, i in expanded]
    service.admission.enter(tenant)
    admitted = True
    try:
        adapter = None if adapter is None else (adapter[0], str(adapter[1]))
        generation = Generation(lambda: service.generator_for(adapter), [p for p, _ in expanded], params, adapter,
                                owner=tenant)
        try:
            await generation.start()
        except BadCall as e:  # the prompt does not fit, or bad ids: this request's alone
            raise ApiError(400, str(e), "messages" if chat else "prompt",
                           "context_length_exceeded" if "exceeds" in str(e) else None) from None
        except SymbiosisError as e:  # the adapter's files changed into something unreadable
            raise ApiError(400, service.public(str(e)), "model", "invalid_adapter") from None
        if body.stream:
            admitted = False  # the stream leaves admission when it ends
            relay = request.scope.get("extensions", {}).get("symbiosis.chunks")  # behind a front process
            if relay is not None and not (body.logprobs if chat else body.logprobs is not None):
                return _RelayedStream(service, tenant, body, generation, len(prompts), chat, relay)
            return StreamingResponse(_stream(service, tenant, body, generation, len(prompts), chat),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        async with generation:
            async for _ in generation.events(disconnected=request.is_disconnected):
                pass
        if not generation.done:  # the client went away
            return JSONResponse({}, status_code=499)
        _raise_failure(service, generation)
        service.finished(tenant, body.model, generation, len(prompts), error=False)
        return _response(service, body, generation, len(prompts), chat)
    finally:
        if admitted:
            service.admission.leave(tenant)


def _raise_failure(service, generation) -> None:
    for choice in generation.choices:
        if isinstance(choice.error, GenerationError):
            status = 500 if choice.error.retryable else 422
            raise ApiError(status, service.public(str(choice.error)), code="generation_failed")
        if choice.error is not None:
            raise ApiError(500, service.public(f"generation failed: {choice.error}"), code="generation_failed")


def _usage(generation, distinct_prompts: int) -> dict:
    prompt = generation.prompt_tokens(distinct_prompts)
    completion = generation.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_text(tokenizer, token_id: int) -> str:
    """A token as text; a token that is part of a character alone is shown as the tokenizer's own token
    string, so that no two tokens look the same (they key OpenAI's top_logprobs dictionaries)."""
    text = tokenizer.decode([token_id])
    return text if "\ufffd" not in text else tokenizer.convert_ids_to_tokens(token_id)


def _completion_logprobs(service, tokens, offset: int = 0) -> dict:
    text = lambda token_id: _token_text(service.tokenizer, token_id)  # noqa: E731
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token.text)
    return {"tokens": [text(t.id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{text(i): lp for i, lp in t.top_logprobs or []} for t in tokens], "text_offset": offsets}


def _chat_logprobs(service, tokens) -> dict:
    def entry(token_id, logprob):
        text = _token_text(service.tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs or []]}
                        for t in tokens]}


def _response(service, body, generation, distinct_prompts: int, chat: bool) -> dict:
    created, choices = int(time.time()), []
    for choice in generation.choices:
        if chat:
            choices.append({"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                            "logprobs": _chat_logprobs(service, choice.tokens) if body.logprobs else None,
                            "finish_reason": choice.finish_reason})
        else:
            choices.append({"index": choice.index, "text": choice.text, "finish_reason": choice.finish_reason,
                            "logprobs": None if body.logprobs is None else _completion_logprobs(service, choice.tokens)})
    return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "object": "chat.completion" if chat else
            "text_completion", "created": created, "model": body.model, "choices": choices,
            "usage": _usage(generation, distinct_prompts), "system_fingerprint": service.fingerprint}


def _json(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _sse(payload) -> bytes:
    return b"data: " + _json(payload) + b"\n\n"


class _Chunks:
    """One stream's SSE chunks. Every chunk is {"id", "object", "created", "model", "choices",
    "system_fingerprint"[, "usage"]}: the fields around the choices are encoded once."""

    def __init__(self, service, body, chat: bool):
        self.service, self.body, self.chat = service, body, chat
        identifier = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = _sse({"id": identifier, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": body.model, "choices": None})
        self.head = head[:head.rindex(b"null")]
        self.tail = b',"system_fingerprint":' + _json(service.fingerprint)
        self.offsets: dict[int, int] = {}  # choice -> its text's length so far (completions' text_offset)

    def chunk(self, choices: list, **extra) -> bytes:
        more = b"".join(b',"%s":%s' % (key.encode(), _json(value)) for key, value in extra.items())
        return self.head + _json(choices) + self.tail + more + b"}\n\n"

    def role(self, choices) -> bytes:
        """A chat's first chunk: the assistant's role for every choice."""
        return self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for c in choices])

    def token(self, choice, token) -> bytes:
        offset = self.offsets.get(choice.index, 0)
        self.offsets[choice.index] = offset + len(token.text)
        if self.chat:
            logprobs = _chat_logprobs(self.service, [token]) if self.body.logprobs else None
            piece = {"delta": {"content": token.text}}
        else:
            logprobs = None if self.body.logprobs is None else _completion_logprobs(self.service, [token], offset)
            piece = {"text": token.text}
        return self.chunk([{"index": choice.index, **piece, "logprobs": logprobs, "finish_reason": None}])

    def token_format(self) -> tuple[str, str, str]:
        """(prefix, middle, suffix): a token's chunk without log-probabilities is prefix + its choice's index +
        middle + its text as JSON + suffix, as `token` writes it (a front process writes them: bridge.py)."""
        piece, close = (b',"delta":{"content":', b"}") if self.chat else (b',"text":', b"")
        return ((self.head + b'[{"index":').decode(), piece.decode(),
                (close + b',"logprobs":null,"finish_reason":null}]' + self.tail + b"}\n\n").decode())

    def finish(self, choice) -> bytes:
        return self.chunk([{"index": choice.index, "finish_reason": choice.finish_reason, "logprobs": None,
                            **({"delta": {}} if self.chat else {"text": ""})}])

    def usage(self, generation, distinct_prompts: int) -> bytes:
        return self.chunk([], usage=_usage(generation, distinct_prompts))


def _error_event(service, choice) -> bytes:
    """A choice that failed mid-stream, as an `error` event (the openai client raises it)."""
    error = ApiError(500 if getattr(choice.error, "retryable", True) else 422, service.public(str(choice.error)),
                     code="generation_failed")
    return _sse(error.body())


async def _stream(service, tenant: str, body, generation, distinct_prompts: int, chat: bool):
    """SSE chunks as tokens come; an error mid-way is sent as an `error` event."""
    chunks, failed = _Chunks(service, body, chat), False
    try:
        async with generation:
            if chat:
                yield chunks.role(generation.choices)
            async for bunch in generation.bunches():  # the events there are, as one write
                parts = []
                for choice, token in bunch:
                    if token is not None:
                        parts.append(chunks.token(choice, token))
                    elif choice.error is not None:
                        failed = True
                        yield b"".join(parts) + _error_event(service, choice)
                        return
                    else:
                        parts.append(chunks.finish(choice))
                yield b"".join(parts)
            if body.include_usage():
                yield chunks.usage(generation, distinct_prompts)
            yield b"data: [DONE]\n\n"
    finally:
        service.admission.leave(tenant)
        if generation.done:
            service.finished(tenant, body.model, generation, distinct_prompts, error=failed)


class _RelayedStream(Response):
    """A stream without log-probabilities behind a front process (`relay`: the bridge's exchange, bridge.py): each
    token goes to the front as (choice, text) as it comes, with no task woken for it, and the front writes its
    chunk from the stream's `token_format`: the per-token Python left in this process, beside the engine's
    thread, is a few microseconds (docs/PERFORMANCE.md section 9)."""

    def __init__(self, service, tenant: str, body, generation, distinct_prompts: int, chat: bool, relay):
        # (Response's own __init__ would give the headers a content-length: 0)
        self.status_code, self.media_type, self.background = 200, "text/event-stream", None
        self.init_headers({"Cache-Control": "no-cache"})
        self.service, self.tenant, self.body, self.generation = service, tenant, body, generation
        self.distinct_prompts, self.chat, self.relay = distinct_prompts, chat, relay

    async def __call__(self, scope, receive, send) -> None:
        chunks, generation, relay, failed = _Chunks(self.service, self.body, self.chat), self.generation, self.relay, None

        def forward(choice, token) -> None:
            nonlocal failed
            if failed is not None:  # after an error, the stream is over: the rest is cancelled
                return
            if token is not None:
                relay.chunk(choice.index, token.text)
            elif choice.error is not None:
                failed = choice
                generation.cancel()
            else:
                relay.body(chunks.finish(choice))

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
        try:
            async with generation:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                relay.chunk_format(*chunks.token_format())
                if self.chat:
                    relay.body(chunks.role(generation.choices))
                if not await generation.relay(forward, disconnected):
                    return  # the client went
                if generation.relay_error is not None:  # (logged): the stream ends with a server error
                    end = _sse(ApiError(500, "the server failed to stream this completion; it was logged").body())
                elif failed is not None:
                    end = _error_event(self.service, failed)
                else:
                    end = (chunks.usage(generation, self.distinct_prompts) if self.body.include_usage() else b"") + \
                        b"data: [DONE]\n\n"
                await send({"type": "http.response.body", "body": end, "more_body": False})
        finally:
            self.service.admission.leave(self.tenant)
            if generation.done:
                self.service.finished(self.tenant, self.body.model, generation, self.distinct_prompts,
                                      error=failed is not None or generation.relay_error is not None)
