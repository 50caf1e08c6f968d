"""The HTTP server: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus /health and /metrics —
the routes (routes.py) over a serving object (serving.py), with the errors and limits every route shares.

Every error is OpenAI's JSON error object with the right status: 400 for a bad field (naming it) or a prompt past
the context, 401 without a valid API key (when the server has keys: security.py), 404 for an unknown model or path, 413 for a body over the limit, 429 with Retry-After when too many
requests wait, 503 while shutting down. A client that disconnects cancels its request, and its slot is free
before the next step.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k2trt.runtime.serve import protocol
from k2trt.schema import json_kind
from k2trt.runtime.serve.metrics import LOG
from k2trt.runtime.serve.routes import router
from k2trt.runtime.serve.security import Access, RequireApiKey
from k2trt.runtime.serve.serving import Serving


def _error(e: protocol.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _is_union_tag(part) -> bool:
    """pydantic names the member of a union it tried in an error's location ('str', 'list[TextPart]',
    'NamedToolChoice', "literal['none','auto']"): never one of our fields, which are snake_case names or indices."""
    return isinstance(part, str) and (not part.replace("_", "").islower() or not part.isidentifier()
                                      or part in ("str", "int", "float", "bool", "list", "dict"))


def _field(loc) -> str:
    parts = [str(x) for x in loc if x != "body"]
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
                if seen > self.limit:  # a chunked body has no length to refuse it by: counted as it comes
                    raise _TooBig(too_big.message)
            return message

        await self.app(scope, limited, send)


class _TooBig(StarletteHTTPException):
    """A body past the limit, found while it is read. An HTTPException because FastAPI re-raises those from the
    body read (fastapi/routing.py: `except HTTPException: raise`) where it turns any other error into a 400 "error
    parsing the body"; the exception handler answers it as the 413 a declared length gets."""

    def __init__(self, message: str):
        super().__init__(413, message)


class CountRequests:
    """ASGI middleware: count each /v1 request by endpoint and the status it was answered with. Pure ASGI, not
    `@app.middleware("http")`: Starlette's BaseHTTPMiddleware wraps `receive` so that the handler never sees the
    client's http.disconnect (a request whose client left would run to its end)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = 500  # no response started: the outermost handler answers 500

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.metrics.request_done(scope["path"], status)


_UNAUTHORIZED = protocol.APIError(401, "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def _unauthorized(scope, receive, send):
    await _error(_UNAUTHORIZED)(scope, receive, send)


def create_app(serving: Serving, access: Access = Access()) -> FastAPI:
    """Middleware, outermost last added: CORS (a preflight answered without a key), the request counter (every
    answer counted, 401s too), the API key (checked before the body is read), the body limit."""
    app = FastAPI(title="k2trt", docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.add_middleware(BodyLimit, limit=serving.config.max_body_bytes)
    if access.api_keys:
        app.add_middleware(RequireApiKey, keys=access.api_keys, refuse=_unauthorized)
    app.add_middleware(CountRequests, metrics=serving.metrics)  # outside BodyLimit: its 413s are counted too
    if access.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(access.allowed_origins),
                           allow_methods=list(access.allowed_methods), allow_headers=list(access.allowed_headers))
    app.add_exception_handler(protocol.APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _internal)

    app.include_router(router)
    return app


# ---- errors as OpenAI's error objects --------------------------------------------------------------------

async def _api_error(request, e: protocol.APIError):
    return _error(e)


async def _invalid(request, e: RequestValidationError):
    first = e.errors()[0]
    if first.get("type") == "json_invalid":
        return _error(protocol.APIError(400, f"the body is not valid JSON ({first.get('msg')})", param="body"))
    loc = tuple(first.get("loc", ()))
    tag = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tag is not None:  # a value none of a union's members took: the errors of each member it tried
        tried = [x for x in e.errors() if tuple(x.get("loc", ()))[:tag] == loc[:tag] and len(x["loc"]) > tag]
        deeper = next((x for x in tried if len(x["loc"]) > tag + 1), None)
        if deeper is None:  # of no member's shape: say which shapes it may have, and what it was
            field = _field(loc[:tag])
            shapes = sorted({str(x["loc"][tag]) for x in tried})
            return _error(protocol.APIError(400, f"{field}: expected {' or '.join(shapes)}, got "
                                                 f"{json_kind(first.get('input'))}", param=field))
        first = deeper  # of one member's shape, wrong inside: that member's error
        loc = tuple(part for part in first["loc"] if not _is_union_tag(part))
    field = _field(loc)
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    if field == "body" and "not supported" in msg:
        field = msg.split()[0]
    return _error(protocol.APIError(400, f"{field}: {msg}", param=field))


async def _http(request, e: StarletteHTTPException):
    code = "request_too_large" if isinstance(e, _TooBig) else None
    return _error(protocol.APIError(e.status_code, str(e.detail), type_="invalid_request_error", code=code))


async def _internal(request, e: Exception):
    LOG.exception("internal error on %s", request.url.path)
    return _error(protocol.APIError(500, f"internal error: {type(e).__name__}", type_="server_error"))
