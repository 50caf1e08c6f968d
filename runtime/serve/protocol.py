"""The OpenAI-compatible API: request bodies (validated, every bad field named) and response objects.

Fields follow OpenAI's chat and completions APIs — tools and tool_choice, response_format, logprobs and
top_logprobs (chat), logprobs and echo (completions) included; `top_k`, `stop_token_ids`, `ignore_eos` and
`chat_template_kwargs` are the extensions vLLM and SGLang accept too. Fields OpenAI defines that k2trt cannot honour
(best_of) are refused with a 400 naming them rather than silently ignored; unknown fields are ignored, as OpenAI's
servers do. What a client sends is bounded: tools by count and size, schemas by size, template arguments by size.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from k2trt.runtime.generation.sampling import API_DEFAULTS, MAX_LOGPROBS, MAX_SEED, SamplingParams, field_problem
from k2trt.schema import json_kind

MAX_N = 16
MAX_TOOLS = 128
MAX_TOOLS_CHARS = 512 << 10  # all the tools, as JSON (each schema is bounded on its own too: grammar.MAX_SCHEMA_CHARS)
MAX_TEMPLATE_KWARGS_CHARS = 16 << 10
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for the completions API (chat: top_logprobs <= MAX_LOGPROBS)
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000  # each: stop strings are searched at every token
MAX_TEMPERATURE = 2.0  # OpenAI's API takes 0..2
MAX_STOP_TOKEN_IDS = 256  # each request's stop ids are a set looked up at every token; bounded like stop strings


class APIError(Exception):
    """An error the client caused (or may retry): becomes {"error": {...}} with this HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    # None: the API's default (sampling.API_DEFAULTS); the ranges are SamplingParams' own (sampling.field_problem)
    temperature: float | None = None  # <= MAX_TEMPERATURE, checked after SamplingParams' rule (NaN: not finite)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: Any = None

    @field_validator("temperature", "top_p", "top_k", "seed")
    @classmethod
    def _sampling_value(cls, v, info: ValidationInfo):
        problem = None if v is None else field_problem(info.field_name, v)
        if problem:
            raise ValueError(problem)
        if info.field_name == "temperature" and v is not None and v > MAX_TEMPERATURE:
            raise ValueError(f"must be at most {MAX_TEMPERATURE:g} (OpenAI's range), got {v}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        bad = [t for t in v or () if t < 0]
        if bad:
            raise ValueError(f"token ids are >= 0, got {bad[0]}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(x) > MAX_STOP_CHARS for x in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def to_sampling_params(self, choice: int = 0) -> SamplingParams:
        """The sampling of choice `choice` (of n): the fields this request gives, the API's defaults for the rest;
        choice i draws with seed + i, and a request without a seed gets a random one for each choice."""
        seed = (self.seed + choice) % (MAX_SEED + 1) if self.seed is not None else random.randrange(MAX_SEED + 1)
        given = {k: v for k in ("temperature", "top_k", "top_p") if (v := getattr(self, k)) is not None}
        return replace(API_DEFAULTS, **given, seed=seed, **self.logprob_params())

    def logprob_params(self) -> dict:
        return {}


MEDIA_PARTS = ("image", "input", "video", "audio")  # image_url, input_image, input_audio, video_url, ...


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # JSON, as text (checked when the conversation is encoded: runtime/text/messages.py)


class ToolCallParam(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking (templates that think keep the last round's)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        # K2.5 and K2.6 are vision-language models; k2trt runs their text model (the vision tower is never loaded)
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text" and kind.split("_")[0] in MEDIA_PARTS:
                    raise ValueError(f"{kind} parts are not supported: this server runs the text model only")
        return content

    @model_validator(mode="after")
    def _role_fields(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as the chat template gets it (runtime/text/messages.py checks it): OpenAI's "developer"
        role is its system role."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of type object; none: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v):
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("must be a JSON schema of type object (a function's arguments are an object)")
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response format needs its json_schema")
        return self


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools):
        if tools:
            names = [t.function.name for t in tools]
            if len(set(names)) != len(names):
                raise ValueError("two tools have the same function name")
            size = len(json.dumps([t.model_dump(exclude_none=True) for t in tools], ensure_ascii=False))
            if size > MAX_TOOLS_CHARS:
                raise ValueError(f"the tools are {size:,} characters as JSON (the limit is {MAX_TOOLS_CHARS:,})")
        return tools

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kwargs):
        if kwargs:
            bad = [k for k in kwargs if not k.isidentifier() or k in RESERVED_TEMPLATE_NAMES]
            if bad:
                raise ValueError(f"{bad[0]!r} cannot be set (it is not a name, or the server sets it)")
            if len(json.dumps(kwargs, ensure_ascii=False)) > MAX_TEMPLATE_KWARGS_CHARS:
                raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_CHARS:,} characters as JSON")
        return kwargs

    @model_validator(mode="after")
    def _tool_fields(self):
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names():
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        if choice == "required" and not self.tools:
            raise ValueError("tool_choice \"required\" needs tools")
        if self.forced_tools() and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format cannot constrain an answer that tool_choice forces to be a tool call")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    def tools_active(self) -> bool:
        """Whether the answer may call tools (the tools are declared, and tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> list[Tool]:
        """The tools a grammar makes the answer call: every one under "required", the named one, else none."""
        if not self.tools or self.tool_choice in (None, "auto", "none"):
            return []
        if self.tool_choice == "required":
            return list(self.tools)
        return [t for t in self.tools if t.function.name == self.tool_choice.function.name]

    def logprob_params(self) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


# what a chat template is given by the server, never by chat_template_kwargs
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                     "pad_token", "unk_token"})


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False

    def logprob_params(self) -> dict:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        """Which of the four shapes, said plainly (a union's own error names each member it tried)."""
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError(f"must be a string or a list, got {json_kind(v)}")
        if not v:
            raise ValueError("must not be empty")
        token_ids = lambda x: isinstance(x, list) and x and all(type(t) is int for t in x)  # noqa: E731
        if all(type(x) is int for x in v) or all(isinstance(x, str) for x in v) or all(token_ids(x) for x in v):
            return v
        i, first = 0, v[0]
        kind = int if type(first) is int else str if isinstance(first, str) else list
        for i, x in enumerate(v):
            if not (type(x) is int if kind is int else isinstance(x, str) if kind is str else token_ids(x)):
                break
        if kind is list:
            raise ValueError(f"must be a list of non-empty lists of token ids like its first item; item {i} is not")
        what = "token ids" if kind is int else "strings"
        raise ValueError(f"must be a list of {what} like its first item; item {i} is {json_kind(v[i])}")

    def new_tokens(self, default: int) -> int:
        return self.max_tokens or default

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# ---- responses -------------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens read from the prefix cache instead of computed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(reason: str | None) -> str | None:
    """Ours -> OpenAI's: a stop token or a stop string is "stop", the length limit "length"; a request the server
    cut short (shutting down) "abort", vLLM's word."""
    return {"stop_token": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort"}.get(reason, reason)


def chat_finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """A chat answer that called tools and stopped by itself ends with "tool_calls"."""
    out = finish_reason(reason)
    return "tool_calls" if called_tools and out == "stop" else out


def now() -> int:
    return int(time.time())
