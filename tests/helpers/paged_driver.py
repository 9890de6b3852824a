"""Test helper: drive a model step by step over the paged cache, the way the engine will.

Each sequence walks through its token list: prompt tokens in chunks of up to ``chunk`` per step,
then one token per step (decode). Sequences advance together, so steps mix prefill chunks of
different sizes with decodes. Blocks are handed out shuffled so block-table bugs cannot hide.
"""

from __future__ import annotations

import random

import torch

from tokenmill.engine.attention import SeqChunk, build_step_inputs
from tokenmill.engine.kv_cache import allocate_kv_caches
from tokenmill.engine.models.native_step import NativeDecode


def run_paged(
    model,
    sequences: list[list[int]],
    prompt_lens: list[int],
    chunk: int,
    block_size: int = 4,
    native: bool = False,
):
    """Returns per sequence a ``[len(seq), vocab]`` float32 tensor of the logits at every position.
    ``native``: the steps the compiled decode step takes (all-decode, few rows) run through it
    (:class:`NativeDecode`), the others through the module; the count is ``run_paged.native_steps``."""
    cfg = model.config
    need = [(len(s) + block_size - 1) // block_size for s in sequences]
    ids = list(range(sum(need)))
    random.Random(0).shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    caches = allocate_kv_caches(cfg, sum(need), block_size, dtype, device)
    done = [0] * len(sequences)
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    fast = NativeDecode(model, caches) if native else None
    run_paged.native_steps = 0
    with torch.no_grad():
        while any(d < len(s) for d, s in zip(done, sequences)):
            active = [i for i, s in enumerate(sequences) if done[i] < len(s)]
            chunks, tokens = [], []
            for i in active:
                n = min(chunk, prompt_lens[i] - done[i]) if done[i] < prompt_lens[i] else 1
                chunks.append(SeqChunk(done[i], n, tables[i]))
                tokens.extend(sequences[i][done[i] : done[i] + n])
            step = build_step_inputs(chunks, block_size, device)
            input_ids = torch.tensor(tokens, device=device)
            if fast is not None and fast.takes(len(tokens), step.metadata):
                hidden = fast.forward(input_ids, step.positions, step.metadata)
                run_paged.native_steps += 1
            else:
                hidden = model(input_ids, step.positions, caches, step.metadata)
            out = model.compute_logits(hidden)
            starts = step.metadata.query_start_loc_host
            for j, i in enumerate(active):
                logits[i].append(out[starts[j] : starts[j + 1]])
                done[i] += chunks[j].num_new
    return [torch.cat(parts) for parts in logits]


def mixed_greedy_requests(n: int = 16):
    """``n`` greedy chat-free prompts of 1-4 sentences with 8-40 output tokens (``ignore_eos``):
    run together, the batch shrinks from ``n`` rows to 1 as they finish. Returns ``(prompts,
    params)``."""
    from tokenmill.engine.sampling import SamplingParams

    words = "the quick brown fox jumps over a lazy dog while bright stars watch".split()  # noqa: SIM905
    prompts = [" ".join(words[: 3 + i % 11]) + f" {i}." * (1 + i % 4) for i in range(n)]
    params = [
        SamplingParams(temperature=0, max_tokens=8 + (i * 7) % 33, ignore_eos=True)
        for i in range(n)
    ]
    return prompts, params
