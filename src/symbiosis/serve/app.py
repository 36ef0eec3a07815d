"""The HTTP application: authentication, OpenAI's error envelope for every error, request-size limits,
structured access logs (method, path, status, tenant, duration: never a prompt, a body or a key), `/health`,
`/metrics` (the admin tenant), `/v1/usage`, the tenant's web page (`/ui`, its data at `/v1/dashboard`), and the
OpenAI routes (openai_api.py)."""

from __future__ import annotations

import json
import logging
import time
import uuid
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
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise ApiError(413, f"the request body is over {limit} bytes")
            return message
        await self.app(scope, limited, send)


class AccessLog:
    """ASGI middleware: one structured line a request (method, path, status, tenant, milliseconds; never a body or
    a key), and the request's id in its `x-request-id` header. Plain ASGI: starlette's `@app.middleware("http")`
    passed every chunk of a streamed response through a memory stream and a task of its own, per token."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, request_id, status = time.monotonic(), uuid.uuid4().hex[:16], 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            state = scope.get("state") or {}  # request.state: where the key's check left the tenant
            access_log.info(json.dumps({"request_id": request_id, "method": scope.get("method"),
                                        "path": scope.get("path"), "status": status, "tenant": state.get("tenant"),
                                        "ms": round(1e3 * (time.monotonic() - start), 2)}))


UI_ASSETS = {"ui.js": "text/javascript; charset=utf-8", "ui.css": "text/css; charset=utf-8"}
# the page loads only its own script and style and talks only to this server
UI_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
             "form-action 'none'; frame-ancestors 'none'; base-uri 'none'")


def _ui_file(name: str, media_type: str) -> Response:
    content = resources.files("symbiosis.serve").joinpath("ui", name).read_bytes()
    return Response(content, media_type=media_type, headers={
        "Content-Security-Policy": UI_POLICY, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})


def create_app(service) -> FastAPI:
    app = FastAPI(title="symbiosis", version="0.1.0", docs_url=None, redoc_url=None)

    def tenant(request: Request) -> str:
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

    if service.tinker is not None:
        from symbiosis.serve.tinker import api as tinker_api

        @app.exception_handler(tinker_api.Refused)
        async def refused(request: Request, error: tinker_api.Refused):
            return error.response()

        app.include_router(tinker_api.router(service, service.tinker))
    app.include_router(openai_api.router(service, tenant))
    if service.jobs is not None:
        from symbiosis.serve.jobs import api as jobs_api

        app.include_router(jobs_api.router(service, tenant))
    if service.hmi is not None:
        from symbiosis.serve.hmi import api as hmi_api

        app.include_router(hmi_api.router(service.hmi, tenant))
    app.add_middleware(AccessLog)
    app.add_middleware(BodyLimit)
    return app
