"""The serving object the routes call (runtime/serve/routes.py), kept on `app.state.serving` as vLLM keeps its
OpenAIServing objects: the scheduler thread, the tokenizer, what is served (ServeConfig) and the metrics.

A validated body (protocol.py) becomes one scheduler Request per prompt and choice, each with the body's stop
rules, its choice's sampling (log-probabilities included) and, for a chat whose answer is forced, its grammar
(answer_shape.py); they are submitted to the scheduler thread, and their text (decoded once, in that thread) comes
back as it is generated: joined into one response object, or sent as server-sent events. A chat's text is split
into reasoning_content, content and tool_calls by one parser per choice (runtime/text/chat_output.py), fed as the
text comes, so a stream's deltas join to the whole answer.
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
from k2trt.runtime.serve import logprob_objects, protocol
from k2trt.runtime.serve.answer_shape import AnswerShape, answer_shape
from k2trt.runtime.serve.metrics import LOG, Metrics
from k2trt.runtime.serve.scheduler_thread import End, Handle, QueueFull, SchedulerThread, ShuttingDown
from k2trt.runtime.text.chat_output import Delta, split_answer
from k2trt.runtime.text.grammar import Grammars
from k2trt.runtime.text.messages import MessageError
from k2trt.runtime.text.text_stream import StopRules

# nginx's status for a client that closed the request before the answer: what /metrics and the log record
CLIENT_GONE = 499


class ClientGone(Exception):
    """The client closed its connection: its requests are cancelled, and nothing more is sent."""


_GONE = object()  # the item a request's text queue gets when its client left


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
    shape: AnswerShape | None = None  # a chat's answer shape
    echo: str = ""  # a completion's prompt text, when the body asks for it back

    @property
    def request(self) -> GenRequest:
        return self.handle.request

    def shown(self, start: int, stop: int) -> list:
        """The log-probabilities of tokens start..stop-1 that show (a stop token never does)."""
        req = self.request
        hidden = req.stops.hidden
        return [e for t, e in zip(req.token_ids[start:stop], req.logprobs[start:stop]) if t not in hidden]


class Serving:
    def __init__(self, scheduler_thread: SchedulerThread, tokenizer, config: ServeConfig):
        self.scheduler_thread, self.tokenizer, self.config = scheduler_thread, tokenizer, config
        self.metrics = Metrics(scheduler_thread)
        scheduler_thread.on_done = self.metrics.generation_done
        self.grammars = Grammars(tokenizer)
        # grammars and log-probabilities need the sampler in this process (a pipeline's last rank samples)
        self.constrains = scheduler_thread.scheduler.samples_here

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
        self._check_constraints(body.logprobs, body.forced_tools() or (body.response_format is not None
                                                                      and body.response_format.type != "text"))

        def prepare():
            shape = answer_shape(body, self.tokenizer, self.grammars)
            return shape, chat_prompt(self.tokenizer, body.messages, shape.template_kwargs)

        # rendering and tokenizing a 4 MiB body takes a while: off the event loop, which streams every request
        shape, prompt = await asyncio.to_thread(prepare)
        return await self._generate(request, body, [prompt], chat=True, shape=shape)

    async def completions(self, body: protocol.CompletionRequest, request: Request):
        self._check_model(body.model)
        self._check_constraints(body.logprobs is not None, False)
        encode = self.tokenizer.encode
        prompts = await asyncio.to_thread(lambda: [encode(p) if isinstance(p, str) else list(p)
                                                   for p in body.prompts()])
        echoes = None
        if body.echo:
            echoes = [p if isinstance(p, str) else self._decode(p) for p in body.prompts()]
        return await self._generate(request, body, prompts, chat=False, echoes=echoes)

    def _decode(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids)
        except K2Error as e:
            raise protocol.APIError(400, str(e), param="prompt") from None

    def _check_constraints(self, logprobs: bool, grammar: bool) -> None:
        if not self.constrains and (logprobs or grammar):
            what = "logprobs" if logprobs else "a forced answer (tool_choice required or named, response_format)"
            raise protocol.APIError(400, f"{what} is not supported with --pipeline yet: the last pipeline rank samples",
                                    param="logprobs" if logprobs else "tool_choice")

    def _check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise protocol.APIError(404, f"The model `{name}` does not exist (this server serves "
                                         f"`{self.config.model_name}`)", param="model", code="model_not_found")

    # ---- generation ----------------------------------------------------------------------------------------
    async def _generate(self, request: Request, body, prompts: list[list[int]], chat: bool,
                        shape: AnswerShape | None = None, echoes: list[str] | None = None):
        t0 = time.monotonic()
        choices = self._submit(body, prompts, chat, asyncio.get_running_loop(), shape, echoes)
        watch = asyncio.ensure_future(self._watch_disconnect(request, choices))
        kind = "chat.completion" if chat else "text_completion"
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(watch, choices, rid, kind, body.model, chat, include_usage, t0,
                                                  body),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts = {c.index: "" for c in choices}
        try:
            for c in choices:
                async for text in self._texts(c.handle):
                    texts[c.index] += text
        except ClientGone:
            raise protocol.APIError(CLIENT_GONE, "the client closed the request", code="client_closed_request") \
                from None
        finally:
            watch.cancel()
            _cancel(choices)
        if any(c.request.finish_reason == FINISH_CANCELLED for c in choices):  # aborted: the server is stopping
            raise protocol.APIError(503, "the server shut down before the request finished", type_="server_error")
        out = [self._choice(c, texts[c.index], body, chat) for c in choices]
        _finish_log(choices, rid, t0, chat)
        return {"id": rid, "object": kind, "created": protocol.now(), "model": body.model, "choices": out,
                "usage": _usage(choices)}

    def _submit(self, body, prompts: list[list[int]], chat: bool, loop, shape: AnswerShape | None,
                echoes: list[str] | None) -> list[Choice]:
        """Every prompt's n choices, submitted; an error for any refuses them all (the HTTP error to answer)."""
        try:
            stops = StopRules.of(self.tokenizer, body.stops(), body.stop_token_ids or (), body.ignore_eos)
        except K2Error as e:
            raise protocol.APIError(400, str(e), param="stop_token_ids") from None
        total, queue = len(prompts) * body.n, self.scheduler_thread.max_waiting
        if total > queue:  # could never fit, however long the client waits: not a 429
            what = f"n={body.n}" if len(prompts) == 1 else f"{len(prompts)} prompts" + \
                (f" × n={body.n}" if body.n > 1 else "")
            raise protocol.APIError(400, f"{what} asks for {total} generations, more than the {queue} this server "
                                         f"queues at once; send fewer", param="n" if len(prompts) == 1 else "prompt")
        choices: list[Choice] = []
        try:
            for pi, prompt in enumerate(prompts):
                # without max_tokens a completion may take the rest of the context
                max_new = body.new_tokens(max(1, self.config.max_context - len(prompt)))
                for c in range(body.n):
                    req = GenRequest(list(prompt), max_new, body.to_sampling_params(c), stops,
                                     grammar=shape.grammar if shape else None)
                    choices.append(Choice(pi, len(choices), self.scheduler_thread.submit(req, loop), shape,
                                          echoes[pi] if echoes else ""))
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

    def _choice(self, c: Choice, text: str, body, chat: bool) -> dict:
        """One choice of a whole response: a chat message split as its shape says, or a completion's text (after
        its prompt, with echo); log-probabilities where asked."""
        req = c.request
        if not chat:
            logprobs = self._completion_logprobs(c, 0, len(req.token_ids), body) if body.logprobs is not None else None
            return {"index": c.index, "text": c.echo + text, "finish_reason": protocol.finish_reason(req.finish_reason),
                    "logprobs": logprobs}
        message = {"role": "assistant", **split_answer(c.shape.parser() if c.shape else None, text)}
        logprobs = {"content": logprob_objects.chat_entries(self.tokenizer, c.shown(0, len(req.token_ids)))} \
            if body.logprobs else None
        return {"index": c.index, "message": message, "logprobs": logprobs,
                "finish_reason": protocol.chat_finish_reason(req.finish_reason, bool(message.get("tool_calls")))}

    def _completion_logprobs(self, c: Choice, start: int, stop: int, body) -> dict:
        """The completions API's logprobs of tokens start..stop-1 (with echo, the prompt's come first, once)."""
        req, tok = c.request, self.tokenizer
        ids = [t for t in req.token_ids[start:stop] if t not in req.stops.hidden]
        out = None
        if body.echo and start == 0:
            out = logprob_objects.completion_logprobs(tok, req.prompt_logprobs, req.prompt)
        offset = len(c.echo) + sum(len(tok.id_to_bytes(t).decode("utf-8", errors="replace"))
                                   for t in req.token_ids[:start] if t not in req.stops.hidden)
        return logprob_objects.join(out, logprob_objects.completion_logprobs(tok, c.shown(start, stop), ids, offset))

    async def _watch_disconnect(self, request: Request, choices: list[Choice]) -> None:
        """Wait for the client to leave (ASGI's http.disconnect, which the server sends as soon as the connection
        closes, whatever the request is doing) and cancel its unfinished requests: waiting, prefilling or decoding,
        each frees its place or slot at the scheduler's next iteration. Cancelled when the answer is complete."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass  # a body already read: nothing more comes but the disconnect
        except OSError:  # the transport failed: the client is gone as surely
            pass
        for c in choices:
            req = c.request
            if req.done:
                continue
            state = "waiting" if req.admitted_at is None else "prefilling" if req.first_token_at is None else \
                "decoding"
            self.metrics.client_disconnects.labels(state=state).inc()
            c.handle.cancel()
            c.handle.texts.put_nowait(_GONE)

    async def _texts(self, handle: Handle, end: list | None = None):
        """A request's text as it comes, the last of it included; ClientGone once its client left. `end` (a
        list) receives the End item instead, for a stream that sends the last text with the finish reason."""
        while True:
            item = await handle.texts.get()
            if item is _GONE:
                raise ClientGone()
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

    async def _stream(self, watch: asyncio.Future, choices: list[Choice], rid: str, kind: str, model: str,
                      chat: bool, include_usage: bool, t0: float, body=None):
        created = protocol.now()
        pending: dict[asyncio.Future, int] = {}

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
            texts = {c.index: self._texts(c.handle, ends[c.index]) for c in choices}
            streams = {c.index: _ChoiceStream(self, c, body, chat) for c in choices}
            # interleave the choices as their text arrives
            pending.update({asyncio.ensure_future(anext(q)): i for i, q in texts.items()})
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        text = fut.result()
                    except StopAsyncIteration:  # its End: the last text with the finish reason ("abort" when
                        yield chunk([streams[i].last(ends[i][0].text)])  # the server cut it short)
                        continue
                    part = streams[i].token(text)
                    if part is not None:
                        yield chunk([part])
                    pending[asyncio.ensure_future(anext(texts[i]))] = i
            if include_usage:
                yield chunk([], _usage(choices))
            yield "data: [DONE]\n\n"
            _finish_log(choices, rid, t0, chat)
        except ClientGone:  # nobody to send the rest to
            return
        except protocol.APIError as e:  # the scheduler stopped mid-stream (a pipeline rank died): say so, then end
            yield f"data: {json.dumps(e.body(), ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for fut in pending:
                fut.cancel()
            watch.cancel()
            _cancel(choices)


class _ChoiceStream:
    """One choice's stream: each token's text through its parser (chat) into a delta, with the log-probabilities of
    the tokens since the last chunk sent (a token whose text is held back sends its entry with the next chunk)."""

    def __init__(self, serving: Serving, choice: Choice, body, chat: bool):
        self.serving, self.choice, self.body, self.chat = serving, choice, body, chat
        self.parser = choice.shape.parser() if chat and choice.shape else None
        self.tokens = self.sent = 0  # tokens seen, tokens whose log-probabilities were sent
        self.echo = choice.echo  # sent with the first chunk
        self.called = False

    def _logprobs(self) -> dict | list | None:
        start, self.sent = self.sent, self.tokens
        if self.chat:
            if not self.body.logprobs:
                return None
            return {"content": logprob_objects.chat_entries(self.serving.tokenizer, self.choice.shown(start, self.tokens))}
        if self.body.logprobs is None:
            return None
        return self.serving._completion_logprobs(self.choice, start, self.tokens, self.body)

    def token(self, text: str) -> dict | None:
        self.tokens += 1
        delta = self.parser.feed(text) if self.parser else Delta(content=text)
        if not delta and not self.echo:
            return None
        return self._part(delta, None)

    def last(self, rest: str) -> dict:
        delta = self.parser.feed(rest) if self.parser else Delta(content=rest)
        if self.parser:
            tail = self.parser.finish()
            delta = Delta(delta.reasoning + tail.reasoning, delta.content + tail.content, delta.calls + tail.calls)
        req = self.choice.request
        reason = protocol.chat_finish_reason(req.finish_reason, self.called or bool(delta.calls)) if self.chat else \
            protocol.finish_reason(req.finish_reason)
        return self._part(delta, reason)

    def _part(self, delta: Delta, reason) -> dict:
        index = self.choice.index
        if not self.chat:
            text, self.echo = self.echo + delta.content, ""
            return {"index": index, "text": text, "finish_reason": reason, "logprobs": self._logprobs()}
        d = {}
        if delta.reasoning:
            d["reasoning_content"] = delta.reasoning
        if delta.content:
            d["content"] = delta.content
        if delta.calls:
            self.called = True
            d["tool_calls"] = [c.as_openai() for c in delta.calls]
        part = {"index": index, "delta": d, "finish_reason": reason}
        logprobs = self._logprobs()
        if logprobs is not None:
            part["logprobs"] = logprobs
        return part


def chat_prompt(tokenizer, messages: list[protocol.ChatMessage], template_kwargs: dict | None = None) -> list[int]:
    """The conversation through the checkpoint's chat template (runtime/text/messages.py: message contents stay
    text, only the template's markers are special tokens), with the request's tools and template arguments; a
    conversation the template cannot take is a 400 naming the field at fault."""
    try:
        return tokenizer.encode_chat([m.for_template() for m in messages], **(template_kwargs or {}))
    except MessageError as e:
        raise protocol.APIError(400, str(e), param=e.field) from None
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


def _usage(choices: list[Choice]) -> dict:
    prompts = {c.prompt: len(c.request.prompt) for c in choices}
    cached: dict[int, int] = {}  # a prompt counted once, as its choice that computed most of it
    for c in choices:
        cached[c.prompt] = min(cached.get(c.prompt, len(c.request.prompt)), c.request.cached_tokens or 0)
    return protocol.usage(sum(prompts.values()), sum(len(c.request.token_ids) for c in choices),
                          sum(cached.values()))


def _finish_log(choices: list[Choice], rid: str, t0: float, chat: bool) -> None:
    req = choices[0].request
    ttft = (req.first_token_at - req.submitted_at) if req.first_token_at else None
    LOG.info("%s %s prompt=%d completion=%d choices=%d finish=%s ttft=%s total=%.3fs", rid,
             "chat" if chat else "completion", len(req.prompt), sum(len(c.request.token_ids) for c in choices),
             len(choices), ",".join(sorted({str(c.request.finish_reason) for c in choices})),
             "-" if ttft is None else f"{ttft:.3f}s", time.monotonic() - t0)
