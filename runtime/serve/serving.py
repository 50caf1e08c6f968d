"""The serving object the routes call (runtime/serve/routes.py), kept on `app.state.serving` as vLLM keeps its
OpenAIServing objects: the scheduler thread, the tokenizer, what is served (ServeConfig) and the metrics.

A validated body (protocol.py) becomes one scheduler Request per prompt and choice, each with the body's stop
rules and its choice's sampling; they are submitted to the scheduler thread, and their text (decoded once, in
that thread) comes back as it is generated: joined into one response object, or sent as server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from k2trt.errors import K2Error
from k2trt.runtime.generation.limits import ContextTooLong, RequestError
from k2trt.runtime.generation.scheduler import FINISH_CANCELLED
from k2trt.runtime.generation.scheduler import Request as GenRequest
from k2trt.runtime.serve import protocol
from k2trt.runtime.serve.metrics import LOG, Metrics
from k2trt.runtime.serve.scheduler_thread import End, Handle, QueueFull, SchedulerThread, ShuttingDown
from k2trt.runtime.text.text_stream import StopRules

DISCONNECT_POLL_S = 0.25


@dataclass
class ServeConfig:
    model_name: str  # what /v1/models lists and requests must name
    max_context: int  # the scheduler's Limits.max_context
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1


@dataclass(eq=False)
class Choice:
    """One of a response's choices: the request generating it, for one prompt of the body."""

    prompt: int  # index of its prompt in the body
    index: int  # its index among the response's choices
    handle: Handle

    @property
    def request(self) -> GenRequest:
        return self.handle.request


class Serving:
    def __init__(self, scheduler_thread: SchedulerThread, tokenizer, config: ServeConfig):
        self.scheduler_thread, self.tokenizer, self.config = scheduler_thread, tokenizer, config
        self.metrics = Metrics(scheduler_thread)
        scheduler_thread.on_done = self.metrics.generation_done

    # ---- what the routes ask ---------------------------------------------------------------------------
    def stopped(self) -> protocol.APIError | None:
        """The error every route answers once the scheduler thread has died (a backend failure), else None."""
        error = self.scheduler_thread.error
        return None if error is None else protocol.APIError(503, f"the scheduler stopped: {error}",
                                                            type_="server_error")

    def model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": protocol.now(), "owned_by": "k2trt",
                "max_model_len": self.config.max_context}

    async def chat(self, body: protocol.ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        # rendering and tokenizing a 4 MiB body takes a while: off the event loop, which streams every request
        prompt = await asyncio.to_thread(chat_prompt, self.tokenizer, body.messages)
        return await self._generate(request, body, [prompt], chat=True)

    async def completions(self, body: protocol.CompletionRequest, request: Request):
        self._check_model(body.model)
        encode = self.tokenizer.encode
        prompts = await asyncio.to_thread(lambda: [encode(p) if isinstance(p, str) else list(p)
                                                   for p in body.prompts()])
        return await self._generate(request, body, prompts, chat=False)

    def _check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise protocol.APIError(404, f"The model `{name}` does not exist (this server serves "
                                         f"`{self.config.model_name}`)", param="model", code="model_not_found")

    # ---- generation ----------------------------------------------------------------------------------------
    async def _generate(self, request: Request, body, prompts: list[list[int]], chat: bool):
        t0 = time.monotonic()
        choices = self._submit(body, prompts, chat, asyncio.get_running_loop())
        kind = "chat.completion" if chat else "text_completion"
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(request, choices, rid, kind, body.model, chat, include_usage, t0),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts = {c.index: "" for c in choices}
        try:
            for c in choices:
                async for text in self._texts(request, c.handle):
                    texts[c.index] += text
        finally:
            _cancel(choices)
        out = [_choice(c.index, texts[c.index], c.request, chat) for c in choices]
        _finish_log(choices, rid, t0, chat)
        return {"id": rid, "object": kind, "created": protocol.now(), "model": body.model, "choices": out,
                "usage": _usage(choices)}

    def _submit(self, body, prompts: list[list[int]], chat: bool, loop) -> list[Choice]:
        """Every prompt's n choices, submitted; an error for any refuses them all (the HTTP error to answer)."""
        stops = StopRules.of(self.tokenizer, body.stops(), body.stop_token_ids or (), body.ignore_eos)
        choices: list[Choice] = []
        try:
            for pi, prompt in enumerate(prompts):
                # without max_tokens a completion may take the rest of the context
                max_new = body.new_tokens(max(1, self.config.max_context - len(prompt)))
                for c in range(body.n):
                    req = GenRequest(list(prompt), max_new, body.to_sampling_params(c), stops)
                    choices.append(Choice(pi, len(choices), self.scheduler_thread.submit(req, loop)))
        except QueueFull as e:
            _cancel(choices)
            raise protocol.APIError(429, f"too many requests are waiting ({e}); retry later", type_="rate_limit_error",
                                    headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except ShuttingDown as e:
            _cancel(choices)
            raise protocol.APIError(503, str(e), type_="server_error", headers={"Retry-After": "5"}) from None
        except RequestError as e:
            _cancel(choices)
            raise request_error(e, chat) from None
        except K2Error as e:
            _cancel(choices)
            raise protocol.APIError(400, str(e)) from None
        return choices

    async def _texts(self, request: Request, handle: Handle, end: list | None = None):
        """A request's text as it comes, the last of it included; cancels it if the client goes away. `end` (a
        list) receives the End item instead, for a stream that sends the last text with the finish reason."""
        while True:
            try:
                item = await asyncio.wait_for(handle.texts.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    handle.cancel()
                    return
                continue
            if isinstance(item, End):
                stopped = self.stopped()
                if stopped is not None:
                    raise protocol.APIError(500, stopped.message, type_="server_error")
                if end is None:
                    yield item.text
                else:
                    end.append(item)
                return
            yield item

    async def _stream(self, request: Request, choices: list[Choice], rid: str, kind: str, model: str, chat: bool,
                      include_usage: bool, t0: float):
        created = protocol.now()

        def chunk(parts, usage=None):
            d = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created, "model": model,
                 "choices": parts}
            if include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                             for c in choices])
            ends: dict[int, list] = {c.index: [] for c in choices}
            texts = {c.index: self._texts(request, c.handle, ends[c.index]) for c in choices}
            by_index = {c.index: c for c in choices}
            # interleave the choices as their text arrives
            pending = {asyncio.ensure_future(anext(q)): i for i, q in texts.items()}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        text = fut.result()
                    except StopAsyncIteration:
                        req = by_index[i].request
                        if req.finish_reason in (None, FINISH_CANCELLED) or not ends[i]:
                            continue  # the client went away
                        yield chunk([_delta(i, ends[i][0].text, protocol.finish_reason(req.finish_reason), chat)])
                        continue
                    if text:
                        yield chunk([_delta(i, text, None, chat)])
                    pending[asyncio.ensure_future(anext(texts[i]))] = i
            if include_usage:
                yield chunk([], _usage(choices))
            yield "data: [DONE]\n\n"
            _finish_log(choices, rid, t0, chat)
        finally:
            _cancel(choices)


def chat_prompt(tokenizer, messages: list[protocol.ChatMessage]) -> list[int]:
    """The conversation through the checkpoint's chat template (runtime/text/messages.py: message contents stay
    text, only the template's markers are special tokens). OpenAI's "developer" role is its system role."""
    try:
        return tokenizer.encode_chat([{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                                       **({"name": m.name} if m.name else {})} for m in messages])
    except K2Error as e:
        raise protocol.APIError(400, str(e), param="messages") from None


def request_error(e: RequestError, chat: bool) -> protocol.APIError:
    """The one mapping of a request the scheduler refuses to its HTTP error: a 400 naming the field at fault (the
    prompt is a chat's messages), in OpenAI's words and code when it is past the context."""
    param = {"prompt": "messages" if chat else "prompt", "max_new_tokens": "max_tokens"}[e.field]
    if isinstance(e, ContextTooLong):
        return protocol.APIError(
            400, f"This model's maximum context length is {e.max_context} tokens. However, you requested "
                 f"{e.prompt_tokens + e.new_tokens} tokens ({e.prompt_tokens} in the prompt, {e.new_tokens} in the "
                 f"completion).", param=param, code="context_length_exceeded")
    return protocol.APIError(400, str(e), param=param)


def _cancel(choices: list[Choice]) -> None:
    for c in choices:
        if not c.request.done:
            c.handle.cancel()


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


def _usage(choices: list[Choice]) -> dict:
    prompts = {c.prompt: len(c.request.prompt) for c in choices}
    return protocol.usage(sum(prompts.values()), sum(len(c.request.token_ids) for c in choices))


def _finish_log(choices: list[Choice], rid: str, t0: float, chat: bool) -> None:
    req = choices[0].request
    ttft = (req.first_token_at - req.submitted_at) if req.first_token_at else None
    LOG.info("%s %s prompt=%d completion=%d choices=%d finish=%s ttft=%s total=%.3fs", rid,
             "chat" if chat else "completion", len(req.prompt), sum(len(c.request.token_ids) for c in choices),
             len(choices), ",".join(sorted({str(c.request.finish_reason) for c in choices})),
             "-" if ttft is None else f"{ttft:.3f}s", time.monotonic() - t0)
