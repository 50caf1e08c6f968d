"""The OpenAI-compatible API: request bodies (validated, every bad field named) and response objects.

Fields follow OpenAI's chat and completions APIs; `top_k`, `stop_token_ids` and `ignore_eos` are the extensions vLLM and
SGLang accept too. Fields OpenAI defines that k2trt cannot honour (logprobs, tools, response formats) are refused
with a 400 naming them rather than silently ignored; unknown fields are ignored, as OpenAI's servers do.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from k2trt.runtime.generation.sampling import API_DEFAULTS, MAX_SEED, SamplingParams, field_problem

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000  # each: stop strings are searched at every token
MAX_TEMPERATURE = 2.0  # OpenAI's API takes 0..2


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
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    # None: the API's default (sampling.API_DEFAULTS); the ranges are SamplingParams' own (sampling.field_problem)
    temperature: float | None = Field(default=None, le=MAX_TEMPERATURE)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None

    @field_validator("temperature", "top_p", "top_k", "seed")
    @classmethod
    def _sampling_value(cls, v, info: ValidationInfo):
        problem = None if v is None else field_problem(info.field_name, v)
        if problem:
            raise ValueError(problem)
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
        asked = {"logprobs": bool(self.logprobs), "top_logprobs": self.top_logprobs not in (None, 0),
                 "echo": bool(self.echo), "best_of": self.best_of not in (None, 1)}
        for name, yes in asked.items():
            if yes:
                raise ValueError(f"{name} is not supported")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def to_sampling_params(self, choice: int = 0) -> SamplingParams:
        """The sampling of choice `choice` (of n): the fields this request gives, the API's defaults for the rest;
        choice i draws with seed + i, and a request without a seed gets a random one for each choice."""
        seed = (self.seed + choice) % (MAX_SEED + 1) if self.seed is not None else random.randrange(MAX_SEED + 1)
        given = {k: v for k in ("temperature", "top_k", "top_p") if (v := getattr(self, k)) is not None}
        return replace(API_DEFAULTS, **given, seed=seed)


MEDIA_PARTS = ("image", "input", "video", "audio")  # image_url, input_image, input_audio, video_url, ...


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]  # no tools: a "tool" message is refused
    content: str | list[TextPart] | None = None
    name: str | None = None

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

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None

    @model_validator(mode="after")
    def _chat_unsupported(self):
        if self.tools:
            raise ValueError("tools is not supported")
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format is not supported")
        return self

    def new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        return v

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


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    """Ours -> OpenAI's: a stop token or a stop string is "stop", the length limit "length"."""
    return {"stop_token": "stop", "stop_string": "stop", "length": "length"}.get(reason, reason)


def now() -> int:
    return int(time.time())
