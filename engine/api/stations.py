"""The tokenize, admission and metering stations (the gateway has its own module)."""

from __future__ import annotations

from dataclasses import dataclass

from ..tokenizer import encode_chat
from .errors import APIError
from .gateway import Tenant
from .protocol import ChatCompletionRequest, CompletionRequest


@dataclass
class Tokenized:
    """Token ids ready for the engine and the output budget granted."""

    prompt_token_ids: list[int]
    max_tokens: int
    prompt_param: str
    max_param: str = "max_tokens"  # or max_completion_tokens, as the client named it


class TokenizeStation:
    """Chat template + encoding, then the length checks, before any engine work.

    Args:
        tokenizer: the model's Hugging Face tokenizer (the server sets it once loaded, before
            it serves: None until then).
        max_model_len: context limit (prompt + output) in tokens.
        vocab_size: token ids a completion prompt may hold are ``[0, vocab_size)``.
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def encode(self, body: ChatCompletionRequest | CompletionRequest) -> tuple[list[int], str]:
        if isinstance(body, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                return encode_chat(self.tokenizer, messages), "messages"
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
        if isinstance(body.prompt, str):
            return self.tokenizer.encode(body.prompt), "prompt"
        bad = next((t for t in body.prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                param="prompt",
            )
        return list(body.prompt), "prompt"

    def run(self, body: ChatCompletionRequest | CompletionRequest, tenant: Tenant) -> Tokenized:
        """Raises APIError(400) naming ``messages``/``prompt`` or ``max_tokens`` when too long,
        or when the text cannot be tokenized (e.g. lone UTF-16 surrogates)."""
        try:
            ids, param = self.encode(body)
        except APIError:
            raise
        except Exception as exc:  # the tokenizer's own errors on strange text
            param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            if _has_lone_surrogate(body):
                reason = "it holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text"
            else:
                reason = " ".join(str(exc).split())[:160]
            raise APIError(
                400, f"{param} could not be tokenized: {reason}", param=param, code="invalid_text"
            ) from None
        n = len(ids)
        if not ids:
            raise APIError(400, f"{param} encodes to no tokens", param=param)
        if n >= self.max_model_len:
            raise APIError(
                400,
                f"{param} is {n} tokens; the model's context is {self.max_model_len} tokens",
                param=param,
                code="context_length_exceeded",
            )
        if tenant.max_prompt_tokens and n > tenant.max_prompt_tokens:
            raise APIError(
                400,
                f"{param} is {n} tokens; tenant {tenant.name!r} allows {tenant.max_prompt_tokens}",
                param=param,
                code="prompt_too_long",
            )
        requested = body.requested_max_tokens()
        max_param = (
            "max_completion_tokens"
            if getattr(body, "max_completion_tokens", None)
            else "max_tokens"
        )
        if requested is None:
            granted = self.max_model_len - n
            if tenant.max_output_tokens:
                granted = min(granted, tenant.max_output_tokens)
        else:
            if n + requested > self.max_model_len:
                raise APIError(
                    400,
                    f"{max_param}={requested} plus the {n}-token {param} exceeds the model's context of "
                    f"{self.max_model_len} tokens",
                    param=max_param,
                    code="context_length_exceeded",
                )
            if tenant.max_output_tokens and requested > tenant.max_output_tokens:
                raise APIError(
                    400,
                    f"{max_param}={requested} is over tenant {tenant.name!r}'s limit of {tenant.max_output_tokens}",
                    param=max_param,
                )
            granted = requested
        return Tokenized(ids, granted, param, max_param)


def _has_lone_surrogate(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether the prompt text holds a UTF-16 surrogate code point (JSON ``"\\ud800"``)."""
    if isinstance(body, ChatCompletionRequest):
        texts = [m.text() for m in body.messages]
    else:
        texts = [body.prompt] if isinstance(body.prompt, str) else [str(body.prompt)]
    return any(0xD800 <= ord(c) <= 0xDFFF for t in texts for c in t)


class AdmissionStation:
    """A bounded queue in front of the engine: at most ``max_num_seqs + max_queue_len`` requests
    in flight; beyond that new requests are refused with 429 and ``Retry-After`` instead of
    piling up (memory stays bounded, and clients back off)."""

    def __init__(self, max_num_seqs: int, max_queue_len: int, *, limit_flag: str | None = None):
        self.max_num_seqs = max_num_seqs
        self.max_queue_len = max_queue_len
        # the flag a refusal names (default: --max-queue-len, the server's)
        self.limit_flag = limit_flag
        self.in_flight = 0
        self.rejected = 0

    @property
    def capacity(self) -> int:
        return self.max_num_seqs + self.max_queue_len

    @property
    def queue_depth(self) -> int:
        return max(0, self.in_flight - self.max_num_seqs)

    def enter(self) -> None:
        if self.in_flight >= self.capacity:
            self.rejected += 1
            limit = (
                f"{self.limit_flag} {self.capacity}"
                if self.limit_flag
                else f"--max-queue-len {self.max_queue_len}"
            )
            raise APIError(
                429,
                f"server queue is full ({self.queue_depth} requests waiting, {limit})",
                code="queue_full",
                retry_after=2,
            )
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)


def usage_of(out) -> dict:
    """The OpenAI ``usage`` object of a finished :class:`RequestOutput`."""
    return {
        "prompt_tokens": out.stats.input_tokens,
        "completion_tokens": out.stats.output_tokens,
        "total_tokens": out.stats.input_tokens + out.stats.output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.stats.cached_tokens},
    }


def billed_usage(
    prompt_tokens: int, output_tokens: int, cached_tokens: int, *, prefill_started: bool
) -> dict:
    """The OpenAI ``usage`` object a request is metered with when it did not finish on its own
    (the client left, the server shut down, the engine failed it), from the engine's final
    record of it. The rule, the same as for a finished request: the prompt counts (in full, its
    prefix-cache hits as ``cached_tokens``) once the engine began computing it
    (``prefill_started``), not while it only waited in the queue; the output counts every token
    the engine generated, those of the step the abort arrived in included. All counts in tokens.
    """
    prompt = prompt_tokens if prefill_started else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output_tokens,
        "total_tokens": prompt + output_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens if prefill_started else 0},
    }


class MeteringStation:
    """Turns a finished request's token counts into its OpenAI ``usage`` object. Per-tenant
    totals are the Prometheus counters (``tokenmill_prompt_tokens_total``,
    ``tokenmill_generation_tokens_total``, ``tokenmill_cached_prompt_tokens_total``, label
    ``tenant``) and the ``requests`` rows, both fed from the same timeline; nothing is kept
    here."""

    def record(
        self, tenant: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int
    ) -> dict:
        """One finished request of ``tenant``; returns its OpenAI ``usage`` object."""
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }
