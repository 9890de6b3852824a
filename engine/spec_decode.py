"""Speculative decoding by n-gram prompt lookup: the config, the proposer and the verifier.

A decoding request's own tokens (prompt + output so far) often repeat: code that is edited, a
passage asked back, names and numbers copied from the prompt. The proposer looks for the most
recent earlier occurrence of the request's last ``n`` tokens (``n`` from ``prompt_lookup_max``
down to ``prompt_lookup_min``) and proposes the up to ``K`` tokens that followed it. The engine
then runs the last sampled token and the ``K`` drafts as one chunk of the normal forward (the
paged attention takes multi-token chunks), so one pass gives logits at ``K + 1`` positions, and
the verifier keeps the drafts the target model agrees with plus one token of its own.

Exactness (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
and Chen et al. 2023): greedy keeps the longest prefix of drafts equal to the target's argmax,
then the argmax after it. With temperature the draft distribution ``q`` is a point mass on the
drafted token ``d``, so the rejection-sampling rule reduces to: accept ``d`` with probability
``p(d)``; on rejection sample from ``max(p - q, 0)`` normalised, which is ``p`` with ``d``
removed. The output tokens then follow the target distribution ``p`` exactly.

Why it pays (seed 003 §4.4): a decode step at small batch is bound by reading the weights, so
``K + 1`` positions cost little more than one; each accepted draft is an output token that
cost no step of its own. When drafts are rejected or the batch is large enough that steps are
compute-bound, verification costs more than it saves (diagnoser rule
``spec_decode_ineffective``).
"""

from __future__ import annotations

import numpy as np
import torch

from .sampling import SamplingParams, _filtered_probs
from .spec_config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config", "propose_ngram", "verify"]


def propose_ngram(tokens, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Draft tokens for one request by prompt lookup.

    For ``n`` from ``lookup_max`` down to ``lookup_min``: find the most recent earlier place
    where the last ``n`` tokens occurred and ``k`` tokens followed (else the earliest place,
    which has the most tokens after it), and propose the up to ``k`` tokens that followed it.

    Args:
        tokens: the request's tokens (prompt + output so far), a list of ints or a 1-D int array.
        k: most draft tokens to propose.
        lookup_min, lookup_max: n-gram lengths to try (longest first).

    Returns:
        0..k token ids (empty: no n-gram of those lengths occurred before).
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        pattern = arr[length - n :]
        # candidate starts i with i + n < length: the match is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            # the most recent match with k tokens after it; else the earliest (the longest run)
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[0]) + n
            return arr[start : start + k].tolist()
    return []


def verify(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Check one request's drafts against the target model and pick its tokens.

    Args:
        logits: ``[len(drafts) + 1, vocab]`` float32; row ``i`` is the target's distribution
            for the token after draft ``i - 1`` (row 0: after the last sampled token).
        drafts: the K drafted token ids.
        params: the request's sampling parameters (greedy when temperature ~ 0).
        generator: its CPU generator (None = torch's default generator).

    Returns:
        ``(tokens, num_accepted)``: the accepted drafts followed by one token from the target
        (the correction after a rejection, or the bonus token when all were accepted), so
        ``1 <= len(tokens) == num_accepted + 1 <= K + 1``.
    """
    k = len(drafts)
    if params.greedy:
        best = torch.argmax(logits, dim=-1).tolist()
        a = 0
        while a < k and drafts[a] == best[a]:
            a += 1
        return [*drafts[:a], best[a]], a
    for i, d in enumerate(drafts):
        probs = _filtered_probs(logits[i], params)
        u = torch.rand((), generator=generator)
        if u < probs[d]:
            continue
        residual = probs.clone()
        residual[d] = 0.0
        total = residual.sum()
        if not total > 0:  # p(d) is 1 up to rounding: nothing else to draw, keep the draft
            continue
        token = int(torch.multinomial(residual / total, 1, generator=generator))
        return [*drafts[:i], token], i
    probs = _filtered_probs(logits[k], params)
    if not (torch.isfinite(probs).all() and probs.sum() > 0):
        return [*drafts, int(torch.argmax(logits[k]))], k
    return [*drafts, int(torch.multinomial(probs, 1, generator=generator))], k
