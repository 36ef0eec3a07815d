"""The HTTP application: authentication, OpenAI's error envelope for every error, request-size limits,
structured access logs (method, path, status, tenant, duration: never a prompt, a body or a key), `/health`,
`/metrics` (the admin tenant), `/v1/usage`, the tenant's web page (`/ui`, its data at `/v1/dashboard`), and the
OpenAI routes (openai_api.py)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from symbiosis.serve import dashboard, openai_api
from symbiosis.serve.errors import ApiError
from symbiosis.serve.keys import ADMIN
from symbiosis.train.data import MAX_FILE_BYTES

MAX_BODY_BYTES = 8 << 20
MAX_UPLOAD_BYTES = MAX_FILE_BYTES + (1 << 20)  # a training file and its multipart envelope
access_log = logging.getLogger("symbiosis.serve.access")
# a request's id: unique in the service's life (a random prefix per process, then a count), not a secret: one
# `os.urandom` a request was ~16 µs of the event loop here (a Tinker loop's four requests an iteration)
_ID_PREFIX, _ID_NUMBERS = os.urandom(4).hex(), itertools.count()


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes (`uploads` for POST /v1/files) is answered 413 before it
    is read whole."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES, uploads: int = MAX_UPLOAD_BYTES):
        self.app, self.limit, self.uploads = app, limit, uploads

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.uploads if scope.get("path") == "/v1/files" else self.limit
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await ApiError(413, f"the request body is over {limit} bytes").response()(scope, receive, send)
        seen, over, replacing = 0, None, None

        async def limited():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = ApiError(413, f"the request body is over {limit} bytes")
                    raise over
            return message

        async def answered(message):
            # A body without its length that runs over is found while a route parses it, and FastAPI answers what
            # its parser raised with a 400 ("error parsing the body"): the 413 goes out in place of that answer (a
            # route that answers the 413 itself, as the Tinker API's do in their own envelope, is left alone).
            nonlocal replacing
            if replacing is None and message["type"] == "http.response.start":
                replacing = over is not None and message["status"] == 400
                if replacing:
                    return await over.response()(scope, receive, send)
            if not replacing:
                await send(message)
        await self.app(scope, limited, answered)


class AccessLog:
    """ASGI middleware: one structured line a request (method, path, status, tenant, milliseconds; never a body or
    a key), and the request's id in its `x-request-id` header. Plain ASGI: starlette's `@app.middleware("http")`
    passed every chunk of a streamed response through a memory stream and a task of its own, per token."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, request_id, status = time.monotonic(), f"{_ID_PREFIX}{next(_ID_NUMBERS):08x}", 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if access_log.isEnabledFor(logging.INFO):
                state = scope.get("state") or {}  # request.state: where the key's check left the tenant
                access_log.info(json.dumps({"request_id": request_id, "method": scope.get("method"),
                                            "path": scope.get("path"), "status": status,
                                            "tenant": state.get("tenant"),
                                            "ms": round(1e3 * (time.monotonic() - start), 2)}))


class PlainRoutes:
    """ASGI: the requests a training loop sends several times an iteration (`routes`: POST path -> handler) answered
    before FastAPI, whose routing, middlewares, request and response objects took ~60% of the HTTP thread's
    interpreter time for each, the interpreter that the training pass needs too (docs/PERFORMANCE.md, section 10).

    A handler takes the request's headers (lower-case names), its body and the request's state (where it leaves
    the tenant for the access log) and returns (status, media type, body); it raises an exception with a
    `response()` (ApiError, the Tinker API's Refused) to answer an error."""

    def __init__(self, app, routes: dict[str, Callable[[dict, bytes, dict], Awaitable[tuple[int, bytes, bytes]]]]):
        self.app, self.routes = app, routes

    async def __call__(self, scope, receive, send):
        handler = self.routes.get(scope.get("path")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            return await self.app(scope, receive, send)
        try:
            status, media_type, content = await handler(dict(scope["headers"]), await _body(receive),
                                                        scope.setdefault("state", {}))
        except Exception as error:  # noqa: BLE001 - every failure answered, as the app's handlers do
            if not hasattr(error, "response"):
                logging.getLogger("symbiosis.serve").exception("unexpected error on %s", scope.get("path"))
                error = ApiError(500, "the server failed to answer this request; it was logged")
            return await error.response()(scope, receive, send)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", media_type), (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})


async def _body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(400, "the client disconnected before sending its body")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


UI_ASSETS = {"ui.js": "text/javascript; charset=utf-8", "ui.css": "text/css; charset=utf-8"}
# the page loads only its own script and style and talks only to this server
UI_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
             "form-action 'none'; frame-ancestors 'none'; base-uri 'none'")


def _ui_file(name: str, media_type: str) -> Response:
    content = resources.files("symbiosis.serve").joinpath("ui", name).read_bytes()
    return Response(content, media_type=media_type, headers={
        "Content-Security-Policy": UI_POLICY, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})


def create_app(service):
    """The service's ASGI application: the size limit, the access log and the plain routes around FastAPI's."""
    app = FastAPI(title="symbiosis", version="0.1.0", docs_url=None, redoc_url=None)

    async def tenant(request: Request) -> str:  # (async: FastAPI would run a plain function on a worker thread)
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        found = service.keys.tenant_of(key.strip()) if scheme.lower() == "bearer" else None
        if found is None:
            raise ApiError(401, "Incorrect API key provided. Send `Authorization: Bearer KEY` with your key.",
                           code="invalid_api_key")
        request.state.tenant = found
        return found

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request')}"
        return ApiError(400, message, where[0] if where else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        status = error.status_code if error.status_code in (404, 405) else 400
        return ApiError(status, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logging.getLogger("symbiosis.serve").exception("unexpected error on %s", request.url.path)
        return ApiError(500, "the server failed to answer this request; it was logged").response()

    @app.get("/health")
    def health():
        return {"status": "ok", "model": service.base_name}

    @app.get("/metrics")
    def metrics(caller: str = Depends(tenant)):
        if caller != ADMIN:
            raise ApiError(403, "only the admin tenant may read the metrics", code="forbidden")
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/usage")
    def usage(caller: str = Depends(tenant), of: str | None = None):
        """Your usage per model; the admin tenant may read anyone's (`?of=TENANT`) or everyone's."""
        if caller != ADMIN:
            if of not in (None, caller):
                raise ApiError(403, "only the admin tenant may read other tenants' usage", "of")
            return {"object": "list", "data": service.state.usage(caller)}
        return {"object": "list", "data": service.state.usage(of)}

    @app.get("/v1/dashboard")
    def dashboard_data(caller: str = Depends(tenant)):
        """What the tenant's page plots (dashboard.py)."""
        return dashboard.snapshot(service, caller)

    @app.get("/ui")
    def ui_page():
        return _ui_file("index.html", "text/html; charset=utf-8")

    @app.get("/ui/{name}")
    def ui_asset(name: str):
        if name not in UI_ASSETS:
            raise ApiError(404, "no such file")
        return _ui_file(name, UI_ASSETS[name])

    plain = {}
    if service.tinker is not None:
        from symbiosis.serve.tinker import api as tinker_api

        @app.exception_handler(tinker_api.Refused)
        async def refused(request: Request, error: tinker_api.Refused):
            return error.response()

        tinker_router, plain = tinker_api.routes(service, service.tinker)
        app.include_router(tinker_router)
    app.include_router(openai_api.router(service, tenant))
    if service.jobs is not None:
        from symbiosis.serve.jobs import api as jobs_api

        app.include_router(jobs_api.router(service, tenant))
    if service.hmi is not None:
        from symbiosis.serve.hmi import api as hmi_api

        app.include_router(hmi_api.router(service.hmi, tenant))
    return BodyLimit(AccessLog(PlainRoutes(app, plain)))
