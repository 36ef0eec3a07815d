"""Errors in OpenAI's envelope, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status the
official `openai` client maps to its exception classes (400 BadRequestError, 401 AuthenticationError, 403
PermissionDeniedError, 404 NotFoundError, 409 ConflictError, 422 UnprocessableEntityError, 429 RateLimitError,
5xx InternalServerError). The client retries 408, 409, 429 and 5xx: a request that cannot succeed on retry never
gets one of those (a conflict, 409, is retried by the client; this service answers a name already taken with 400)."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
         422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def not_found(model: str) -> ApiError:
    """The same answer for a model that does not exist and one that is another tenant's (no existence leak)."""
    return ApiError(404, f"The model `{model}` does not exist or you do not have access to it.", "model",
                    "model_not_found")


async def json_object(request, error=ApiError) -> dict:
    """The request's body as a JSON object, or `error(400, why)`."""
    return json_fields(await request.body(), error)


def json_fields(body: bytes, error=ApiError) -> dict:
    """A request body's bytes as a JSON object, or `error(400, why)` (for routes that read the body themselves)."""
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):  # (nested past the parser's depth: a server error otherwise)
        raise error(400, "the body is not JSON that can be read (malformed, or nested too deep)") from None
    if not isinstance(fields, dict):
        raise error(400, "the body is not a JSON object")
    return fields
