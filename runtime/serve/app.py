"""The HTTP server: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus /health and /metrics.

Every error is OpenAI's JSON error object with the right status: 400 for a bad field (naming it) or a prompt past
the context, 404 for an unknown model or path, 413 for a body over the limit, 429 with Retry-After when too many
requests wait, 503 while shutting down. A client that disconnects cancels its request, and its slot is free
before the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k2trt.errors import K2Error
from k2trt.runtime.generation.limits import ContextTooLong, PromptError
from k2trt.runtime.generation.scheduler import Request as GenRequest
from k2trt.runtime.serve import protocol
from k2trt.runtime.serve.scheduler_thread import End, Handle, QueueFull, SchedulerThread, ShuttingDown
from k2trt.runtime.serve.metrics import LOG, Metrics
from k2trt.runtime.text.text_stream import StopRules

DISCONNECT_POLL_S = 0.25


@dataclass
class ServeConfig:
    model_name: str  # what /v1/models lists and requests must name
    max_context: int
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1


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


def create_app(engine: SchedulerThread, tokenizer, config: ServeConfig) -> FastAPI:
    app = FastAPI(title="k2trt", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    metrics = Metrics(engine)
    engine.on_done = metrics.generation_done
    app.state.engine, app.state.metrics = engine, metrics

    # ---- errors as OpenAI's error objects --------------------------------------------------------------
    @app.exception_handler(protocol.APIError)
    async def _api_error(request, e: protocol.APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return _error(protocol.APIError(400, f"the body is not valid JSON ({first.get('msg')})", param="body"))
        field = _field(first.get("loc", ()))
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        if field == "body" and "not supported" in msg:
            field = msg.split()[0]
        return _error(protocol.APIError(400, f"{field}: {msg}", param=field))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return _error(protocol.APIError(e.status_code, str(e.detail), type_="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        LOG.exception("internal error on %s", request.url.path)
        return _error(protocol.APIError(500, f"internal error: {type(e).__name__}", type_="server_error"))

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            metrics.request_done(request.url.path, response.status_code)
        return response

    # ---- the routes ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine.error is not None:
            return _error(protocol.APIError(503, f"the engine stopped: {engine.error}", type_="server_error"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(config)]}

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatCompletionRequest, request: Request):
        _check_model(body.model, config)
        # rendering and tokenizing a 4 MiB body takes a while: off the event loop, which streams every request
        prompt = await asyncio.to_thread(chat_prompt, tokenizer, body.messages)
        return await _generate(request, body, [prompt], chat=True)

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        _check_model(body.model, config)
        prompts = await asyncio.to_thread(
            lambda: [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()])
        return await _generate(request, body, prompts, chat=False)

    # ---- generation -------------------------------------------------------------------------------------
    async def _generate(request: Request, body, prompts: list[list[int]], chat: bool):
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        handles: list[tuple[int, int, Handle]] = []  # (prompt index, choice index, handle)
        stops = StopRules.of(tokenizer, body.stops(), body.stop_token_ids or (), body.ignore_eos)
        try:
            for pi, prompt in enumerate(prompts):
                # without max_tokens a completion may take the rest of the context
                max_new = body.new_tokens(max(1, config.max_context - len(prompt)))
                for c in range(body.n):
                    req = GenRequest(list(prompt), max_new, body.to_sampling_params(c), stops)
                    handles.append((pi, len(handles), engine.submit(req, loop)))
        except QueueFull as e:
            _cancel(handles)
            raise protocol.APIError(429, f"too many requests are waiting ({e}); retry later", type_="rate_limit_error",
                             headers={"Retry-After": str(config.retry_after_s)}) from None
        except ShuttingDown as e:
            _cancel(handles)
            raise protocol.APIError(503, str(e), type_="server_error", headers={"Retry-After": "5"}) from None
        except PromptError as e:
            _cancel(handles)
            raise prompt_error(e, "messages" if chat else "prompt") from None
        except K2Error as e:
            _cancel(handles)
            raise protocol.APIError(400, str(e)) from None
        kind = "chat.completion" if chat else "text_completion"
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(request, handles, rid, kind, body.model, chat, include_usage, t0),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts = {i: "" for _, i, _ in handles}
        try:
            for _, i, h in handles:
                async for text in _texts(request, h):
                    texts[i] += text
        finally:
            _cancel(handles)
        choices = [_choice(i, texts[i], h.request, chat) for _, i, h in handles]
        _finish_log(handles, rid, t0, chat)
        return {"id": rid, "object": kind, "created": protocol.now(), "model": body.model, "choices": choices,
                "usage": _usage(handles)}

    async def _texts(request: Request, handle: Handle, end: list | None = None):
        """A request's text as it comes, the last of it included; cancels it if the client goes away. `end` (a
        list) receives the End item, for a stream that sends the last of the text with the finish reason."""
        while True:
            try:
                item = await asyncio.wait_for(handle.texts.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    handle.cancel()
                    return
                continue
            if isinstance(item, End):
                if engine.error is not None:
                    raise protocol.APIError(500, f"the engine stopped: {engine.error}", type_="server_error")
                if end is None:
                    yield item.text
                else:
                    end.append(item)
                return
            yield item

    async def _stream(request, handles, rid, kind, model, chat, include_usage, t0):
        created = protocol.now()

        def chunk(choices, usage=None):
            d = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created, "model": model,
                 "choices": choices}
            if include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                             for _, i, _ in handles])
            ends: dict[int, list] = {i: [] for _, i, _ in handles}
            queues = {i: _texts(request, h, ends[i]) for _, i, h in handles}
            # interleave the choices as their tokens arrive
            pending = {asyncio.ensure_future(anext(q)): i for i, q in queues.items()}
            by_index = {i: h for _, i, h in handles}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        text = fut.result()
                    except StopAsyncIteration:
                        req = by_index[i].request
                        if req.finish_reason is None or req.finish_reason == "cancelled" or not ends[i]:
                            continue  # the client went away
                        yield chunk([_delta(i, ends[i][0].text, protocol.finish_reason(req.finish_reason), chat)])
                        continue
                    if text:
                        yield chunk([_delta(i, text, None, chat)])
                    pending[asyncio.ensure_future(anext(queues[i]))] = i
            if include_usage:
                yield chunk([], _usage(handles))
            yield "data: [DONE]\n\n"
            _finish_log(handles, rid, t0, chat)
        finally:
            _cancel(handles)

    def _finish_log(handles, rid, t0, chat) -> None:
        req = handles[0][2].request
        ttft = (req.first_token_at - req.submitted_at) if req.first_token_at else None
        LOG.info("%s %s prompt=%d completion=%d choices=%d finish=%s ttft=%s total=%.3fs", rid,
                 "chat" if chat else "completion", len(req.prompt),
                 sum(len(h.request.token_ids) for _, _, h in handles),
                 len(handles), ",".join(sorted({str(h.request.finish_reason) for _, _, h in handles})),
                 "-" if ttft is None else f"{ttft:.3f}s", time.monotonic() - t0)

    return app


def _model_card(config: ServeConfig) -> dict:
    return {"id": config.model_name, "object": "model", "created": protocol.now(), "owned_by": "k2trt",
            "max_model_len": config.max_context}


def _check_model(name: str, config: ServeConfig) -> None:
    if name != config.model_name:
        raise protocol.APIError(404, f"The model `{name}` does not exist (this server serves `{config.model_name}`)",
                         param="model", code="model_not_found")


def chat_prompt(tokenizer, messages: list[protocol.ChatMessage]) -> list[int]:
    """The conversation through the checkpoint's chat template (runtime/text/messages.py: message contents stay text,
    only the template's markers are special tokens). OpenAI's "developer" role is its system role."""
    try:
        return tokenizer.encode_chat([{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                                       **({"name": m.name} if m.name else {})} for m in messages])
    except K2Error as e:
        raise protocol.APIError(400, str(e), param="messages") from None


def prompt_error(e: PromptError, param: str) -> protocol.APIError:
    """The one mapping of a prompt the scheduler refuses to its HTTP error: 400, naming the prompt (or the
    messages), in OpenAI's words and code when it is past the context."""
    if isinstance(e, ContextTooLong):
        return protocol.APIError(
            400, f"This model's maximum context length is {e.max_context} tokens. However, you requested "
                 f"{e.prompt_tokens + e.new_tokens} tokens ({e.prompt_tokens} in the prompt, {e.new_tokens} in the "
                 f"completion).", param=param, code="context_length_exceeded")
    return protocol.APIError(400, str(e), param=param)


def _cancel(handles) -> None:
    for _, _, h in handles:
        if not h.request.done:
            h.cancel()


def _choice(index: int, text: str, req: GenRequest, chat: bool) -> dict:
    reason = protocol.finish_reason(req.finish_reason)
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                "logprobs": None}
    return {"index": index, "text": text, "finish_reason": reason, "logprobs": None}


def _delta(index: int, text: str, reason, chat: bool) -> dict:
    if chat:
        return {"index": index, "delta": {"content": text} if text else {}, "finish_reason": reason}
    return {"index": index, "text": text, "finish_reason": reason, "logprobs": None}


def _usage(handles) -> dict:
    prompts = {}
    for pi, _, h in handles:
        prompts[pi] = len(h.request.prompt)
    return protocol.usage(sum(prompts.values()), sum(len(h.request.token_ids) for _, _, h in handles))

