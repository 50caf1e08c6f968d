"""The HTTP server: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus /health and /metrics —
the routes (routes.py) over a serving object (serving.py), with the errors and limits every route shares.

Every error is OpenAI's JSON error object with the right status: 400 for a bad field (naming it) or a prompt past
the context, 404 for an unknown model or path, 413 for a body over the limit, 429 with Retry-After when too many
requests wait, 503 while shutting down. A client that disconnects cancels its request, and its slot is free
before the next step.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k2trt.runtime.serve import protocol
from k2trt.runtime.serve.metrics import LOG
from k2trt.runtime.serve.routes import router
from k2trt.runtime.serve.serving import Serving


def _error(e: protocol.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _field(loc) -> str:
    parts = [str(x) for x in loc if x not in ("body",)]
    return ".".join(parts) or "body"


class BodyLimit:
    """ASGI middleware: refuse a request body over the limit (413) before the app reads it all."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = protocol.APIError(413, f"the request body exceeds {self.limit} bytes", code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _error(too_big)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooBig()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooBig:
            await _error(too_big)(scope, receive, send)


class _TooBig(Exception):
    pass


def create_app(serving: Serving) -> FastAPI:
    app = FastAPI(title="k2trt", docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.add_middleware(BodyLimit, limit=serving.config.max_body_bytes)
    app.add_exception_handler(protocol.APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _internal)

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            serving.metrics.request_done(request.url.path, response.status_code)
        return response

    app.include_router(router)
    return app


# ---- errors as OpenAI's error objects --------------------------------------------------------------------

async def _api_error(request, e: protocol.APIError):
    return _error(e)


async def _invalid(request, e: RequestValidationError):
    first = e.errors()[0]
    if first.get("type") == "json_invalid":
        return _error(protocol.APIError(400, f"the body is not valid JSON ({first.get('msg')})", param="body"))
    field = _field(first.get("loc", ()))
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    if field == "body" and "not supported" in msg:
        field = msg.split()[0]
    return _error(protocol.APIError(400, f"{field}: {msg}", param=field))


async def _http(request, e: StarletteHTTPException):
    return _error(protocol.APIError(e.status_code, str(e.detail), type_="invalid_request_error"))


async def _internal(request, e: Exception):
    LOG.exception("internal error on %s", request.url.path)
    return _error(protocol.APIError(500, f"internal error: {type(e).__name__}", type_="server_error"))
