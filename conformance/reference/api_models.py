"""Pydantic request bodies of the reference server, with SGLang's (and OpenAI's) field names.

Unknown fields are ignored as SGLang does; wrong types and out-of-range values become a 400
JSON error in ``server.py``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

TokenIds = list[StrictInt]


class SamplingParamsIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_new_tokens: StrictInt = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    ignore_eos: StrictBool = False
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[TokenIds] = None
    sampling_seed: Optional[StrictInt] = None
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = -1
    n: StrictInt = Field(1, ge=1, le=64)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class SessionParamsIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    rid: Optional[str] = None
    offset: Optional[StrictInt] = None
    replace: Optional[StrictBool] = None
    drop_previous_output: Optional[StrictBool] = None


class GenerateIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[TokenIds, list[TokenIds]]] = None
    sampling_params: Optional[Union[SamplingParamsIn, list[SamplingParamsIn]]] = None
    return_logprob: Union[StrictBool, list[StrictBool]] = False
    logprob_start_len: Union[StrictInt, list[StrictInt]] = -1
    top_logprobs_num: Union[StrictInt, list[StrictInt]] = 0
    rid: Optional[Union[str, list[str]]] = None
    session_params: Optional[SessionParamsIn] = None
    stream: StrictBool = False

    @field_validator("input_ids")
    @classmethod
    def _non_negative(cls, v):
        rows = v if v and isinstance(v[0], list) else [v or []]
        for row in rows:
            if any(t < 0 for t in row):
                raise ValueError("token ids must be >= 0")
        return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class CompletionIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    max_tokens: StrictInt = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Optional[Union[str, list[str]]] = None
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    echo: StrictBool = False
    seed: Optional[StrictInt] = None
    n: StrictInt = Field(1, ge=1, le=64)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: keep the text ones
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=0)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[StrictInt] = None
    n: StrictInt = Field(1, ge=1, le=64)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)

    def new_tokens(self) -> int:
        return next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), 128)


class OpenSessionIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    capacity_of_str_len: StrictInt = Field(65536, ge=1)
    session_id: Optional[str] = None
    streaming: StrictBool = False
    timeout: Optional[float] = Field(None, gt=0)


class CloseSessionIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: str


class AbortIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: Optional[str] = ""
    abort_all: StrictBool = False


def per_item(value: Any, n: int, name: str) -> list[Any]:
    """Broadcast a scalar-or-list batch field to ``n`` items (ValueError on a bad length)."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} items for a batch of {n}")
        return value
    return [value] * n
