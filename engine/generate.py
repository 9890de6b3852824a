"""Offline generation with a minimal block allocation (no scheduler): every prompt gets the
blocks for ``prompt + max_tokens`` up front, all prompts are prefilled in one step, then the
batch decodes one token per sequence per step until each stops.

This is what ``tokenmill generate`` runs; the serving engine's scheduler replaces the fixed
allocation with a block manager and continuous batching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import SeqChunk, build_step_inputs
from .errors import PromptTooLongError
from .kv_cache import allocate_kv_caches
from .models.decoder import DecoderForCausalLM
from .sampling import SamplingParams, sample_token


@dataclass
class GenerationResult:
    """One finished sequence.

    Attributes:
        prompt_token_ids / output_token_ids: token ids in and out.
        text: decoded output (special tokens skipped).
        finish_reason: ``stop`` (a stop/EOS token) or ``length`` (max_tokens reached).
        ttft_s: time to first token in s, from the call's start to the first sampled token.
        e2e_s: end-to-end latency in s, from the call's start to this sequence's last token.
    """

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float
    e2e_s: float


def load_tokenizer(model_dir: str | Path):
    """The Hugging Face tokenizer saved in ``model_dir`` (tokenizer.json + tokenizer_config.json)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def encode_chat(tokenizer, message: str) -> list[int]:
    """Token ids of a one-turn chat through the model's own chat template, ready for the reply."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """Raises PromptTooLongError when prompt + output cannot fit the model's context."""
    if prompt_len + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"prompt of {prompt_len} tokens + max_tokens {max_tokens} exceeds the model's "
            f"context of {max_model_len} tokens"
        )


class OfflineGenerator:
    """Runs batches of prompts through a model with a fixed block allocation.

    Args:
        model: a loaded :class:`DecoderForCausalLM`.
        tokenizer: its Hugging Face tokenizer (used for EOS and detokenizing).
        block_size: tokens per KV block.
    """

    def __init__(self, model: DecoderForCausalLM, tokenizer, block_size: int = 16):
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = eos

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        """Generate for every prompt (token ids); results in prompt order.

        Raises:
            PromptTooLongError: a prompt is empty or does not fit with ``params.max_tokens``.
            ValueError: out-of-range sampling parameters.
        """
        params.validate()
        cfg = self.model.config
        for p in prompts:
            if not p:
                raise PromptTooLongError("prompt is empty: at least one token is needed")
            check_context(len(p), params.max_tokens, cfg.max_position_embeddings)
        param = next(self.model.parameters())
        device, bs = param.device, self.block_size
        tables, next_block = [], 0
        for p in prompts:
            n = -(-(len(p) + params.max_tokens) // bs)
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
        caches = allocate_kv_caches(cfg, next_block, bs, param.dtype, device)
        gens = [
            torch.Generator().manual_seed(params.seed + i) if params.seed is not None else None
            for i in range(len(prompts))
        ]
        stop_ids = self.eos_token_ids | set(params.stop_token_ids)

        start = time.perf_counter()
        outputs: list[list[int]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * len(prompts)
        ttft = [0.0] * len(prompts)
        e2e = [0.0] * len(prompts)
        # step 0: prefill every prompt whole; later steps: one token per unfinished sequence
        chunks = [SeqChunk(0, len(p), t) for p, t in zip(prompts, tables)]
        active = list(range(len(prompts)))
        tokens = [tok for p in prompts for tok in p]
        while active:
            step = build_step_inputs(chunks, bs, device)
            hidden = self.model(
                torch.tensor(tokens, device=device), step.positions, caches, step.metadata
            )
            logits = self.model.compute_logits(hidden[step.last_token_indices]).cpu()
            now = time.perf_counter() - start
            still, chunks, tokens = [], [], []
            for row, i in enumerate(active):
                tok = sample_token(logits[row], params, gens[i])
                if not outputs[i]:
                    ttft[i] = now
                outputs[i].append(tok)
                if tok in stop_ids:
                    finish[i] = "stop"
                elif len(outputs[i]) >= params.max_tokens:
                    finish[i] = "length"
                if finish[i] is not None:
                    e2e[i] = now
                    continue
                still.append(i)
                chunks.append(SeqChunk(len(prompts[i]) + len(outputs[i]) - 1, 1, tables[i]))
                tokens.append(tok)
            active = still
        return [
            GenerationResult(
                prompt_token_ids=list(p),
                output_token_ids=out,
                text=self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer else "",
                finish_reason=str(f),
                ttft_s=t,
                e2e_s=e,
            )
            for p, out, f, t, e in zip(prompts, outputs, finish, ttft, e2e)
        ]
