"""The OpenAI request bodies the front accepts, validated before any work starts.

Unknown fields are refused (`extra="forbid"`): a client that sends a parameter we would silently ignore (say
`presence_penalty`) must learn that it had no effect rather than train on samples drawn another way. Fields the
official client sends with neutral values are accepted when neutral and refused otherwise (`_NEUTRAL`).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from mtrain.rollout.protocol import MAX_TOP_LOGPROBS


class FrontError(Exception):
    """One OpenAI-style error: HTTP status, message, type, param (the offending field), code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    # Extra keys (e.g. `refusal`, `audio`: None in messages the official client echoes back) are tolerated here
    # but never reach the template: `as_template_message` keeps role, content, name, tool_calls, tool_call_id.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)

    def as_template_message(self) -> dict[str, Any]:
        """The dict handed to the chat template (and compared between calls of a session)."""
        m: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: StrictBool = False


_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "parallel_tool_calls": None,
            "response_format": None}


class _Sampling(_Strict):
    model: str
    n: StrictInt = Field(1, ge=1, le=64)
    # Numbers are JSON numbers: "1.0" is refused like n="2" (OpenAI's API answers 400 for both)
    temperature: StrictFloat = Field(1.0, ge=0, le=2)
    top_p: StrictFloat = Field(1.0, gt=0, le=1)
    stop: Union[str, list[str], None] = None
    seed: StrictInt | None = Field(None, ge=0, le=2 ** 63 - 65)  # an int64, and choice j samples with seed + j
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return stops

    @model_validator(mode="after")
    def _neutral(self):
        for k, neutral in _NEUTRAL.items():
            v = getattr(self, k, None)
            if v not in (None, neutral, {}):
                raise ValueError(f"{k}={v!r} is not supported by this server (only {neutral!r})")
        return self


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_choice(self):
        tc = self.tool_choice
        if isinstance(tc, dict):
            raise ValueError("tool_choice naming one function is not supported (use 'auto', 'none' or 'required')")
        if tc == "required":  # accepting it without enforcing it would silently differ from what was asked
            raise ValueError("tool_choice='required' is not supported (the engines have no constrained decoding); "
                             "use 'auto' or 'none'")
        if tc == "auto" and not self.tools:
            raise ValueError("tool_choice='auto' needs tools")
        return self

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule: top_logprobs needs logprobs=true
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_logprobs_wanted(self) -> int:
        return self.top_logprobs or 0


class CompletionRequest(_Sampling):
    prompt: Union[str, list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    # the legacy API's logprobs=N: the sampled token's logprob plus the N most likely tokens' (OpenAI allows 0..5)
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = Field(None, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v):
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo=true is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @property
    def budget(self) -> int | None:
        return self.max_tokens

    @property
    def top_logprobs_wanted(self) -> int:
        return self.logprobs or 0
