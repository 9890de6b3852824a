"""Request bodies of the OpenAI-compatible endpoints (pydantic) and their mapping to
:class:`SamplingParams`. Unknown fields are ignored, as most OpenAI-compatible servers do; fields we
cannot honour (``n > 1``, ``logprobs``, penalties) are refused with a 400 naming the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from ..sampling_params import MAX_TOKEN_INT, SamplingParams
from .errors import APIError

MAX_STOP_STRINGS = 8


class StreamOptions(BaseModel):
    """``stream_options``: only with ``"stream": true`` (see ``check_supported``)."""

    include_usage: StrictBool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's optional fields are nullable and its clients send ``null`` for "default"
        (``"n": null``, ``"stream": null``): a null optional field takes its default. A null
        required field (``model``, ``messages``, ``prompt``) is still refused by name."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required()
        }

    model: str
    # numbers and booleans are strict: "5", 2.0 or true for max_tokens, "0.5" or true for
    # temperature is a client bug (a JSON integer is a fine float)
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    # OpenAI's newer spelling, accepted on both endpoints with the same meaning; it wins when
    # both are sent (the tenant's max_output_tokens caps either: TokenizeStation)
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    logprobs: bool | int | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    user: str | None = None
    # tokenmill extensions (vLLM spells them the same way)
    # the bounds keep every integer inside msgpack's 64-bit range on its way to the engine
    # core (a larger one was a 500); a top_k at or above the vocabulary keeps every token
    top_k: Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_INT)] | None = None
    min_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_INT)]] | None = Field(
        default=None, max_length=MAX_STOP_STRINGS
    )
    # OpenAI options we do not implement: accepted only at their "off" value (check_supported)
    logit_bias: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    def check_supported(self) -> None:
        """Raises APIError(400) for options we do not implement, and for ``stream_options``
        without ``"stream": true`` (as OpenAI does)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400,
                "stream_options is only allowed when stream is true",
                param="stream_options",
                code="invalid_value",
            )
        if self.n != 1:
            raise APIError(
                400, f"n={self.n} is not supported; only n=1", param="n", code="unsupported"
            )
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(
                400,
                "response_format is not supported (only {'type': 'text'})",
                param="response_format",
                code="unsupported",
            )
        for name in ("logit_bias", "tools", "tool_choice", "functions"):
            if getattr(self, name) not in (None, {}, [], "none"):
                raise APIError(
                    400, f"{name} is not supported (leave it out)", param=name, code="unsupported"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(
                    400,
                    f"{name} is not supported (send 0 or leave it out)",
                    param=name,
                    code="unsupported",
                )

    def requested_max_tokens(self) -> int | None:
        """The output-token cap the client asked for (``max_completion_tokens`` or
        ``max_tokens``), None for none."""
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_CommonRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]


class CompletionRequest(_CommonRequest):
    """``POST /v1/completions``; ``prompt`` is text or token ids (one prompt: n=1, batch of 1)."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    echo: StrictBool = False
    best_of: Any = None
    suffix: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported")
        if self.best_of not in (None, 1):
            raise APIError(
                400, "best_of is not supported; only 1", param="best_of", code="unsupported"
            )
        if self.suffix not in (None, ""):
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
