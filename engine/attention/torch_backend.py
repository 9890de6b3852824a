"""Attention backend ``torch``: plain torch driven by the step's :class:`AttentionMetadata`.

The default on CPU. A step whose sequences all decode one token runs
:func:`tokenmill.kernels.cpu.decode_attention` (one C call a layer) where the CPU kernels build
and the tensors are float32. Otherwise decode rows (one new token) and other short chunks (up to
:data:`SHORT_CHUNK` tokens: a decode verifying speculative drafts, the tail of a prompt) take a
batched path: the step's gather indices and visibility mask are built once per step
(:class:`DecodePlan`, cached on the metadata; short chunks padded to the longest) and every
layer runs one ``scaled_dot_product_attention`` over its gathered context, so the per-layer
cost of a small step is a gather and one attention call. A prompt prefilled whole in one chunk
(no earlier context, no sliding window) attends over its own keys and values in one causal
``scaled_dot_product_attention`` (torch's flash kernel, which skips the masked half): one
layer of a 500-token prompt (9 query heads over 3 KV heads) took 4.1 ms against the
reference's 7.2 (AMD EPYC, 2 threads, medians of 20). Other prefill chunks run the kernels' reference (:mod:`tokenmill.kernels.reference`, which imports no triton), which is also
what ``tests/engine/test_paged_attention_torch.py`` holds this backend to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from tokenmill.kernels import cpu
from tokenmill.kernels.reference import _visibility, attend_chunk, store_kv

from .metadata import AttentionMetadata

__all__ = ["SHORT_CHUNK", "DecodePlan", "TorchAttentionBackend", "store_kv"]

# chunks of at most this many new tokens share the batched path: a decode with up to 16 draft
# tokens (engine/spec_config.py: MAX_SPECULATIVE_TOKENS) is 17
SHORT_CHUNK = 17


@dataclass
class DecodePlan:
    """What every layer of one step shares (built once per step, on the cache's device).

    Attributes:
        rows: ``[B * Q]`` int64 query rows of the short chunks, ``Q`` per sequence (a shorter
            chunk repeats its last row as padding); None when ``Q == 1`` and the rows are
            ``0..B-1``.
        valid: ``[B * Q]`` bool, False on padding rows; None when there is none.
        qmax: ``Q``, the longest short chunk (1 when every short chunk is a plain decode).
        tables: ``[B, nblk]`` int64 block ids covering the longest short-chunk context.
        length: ``L``, the longest short-chunk context (tokens).
        mask: ``[B, 1, Q, L]`` bool, True where a query may see a key (causal, within its
            context and sliding window), or None when every key is visible.
        other: indices of the sequences that take the reference path (longer chunks).
        all_slots_valid: the step's ``slot_mapping`` has no ``-1`` padding.
    """

    rows: torch.Tensor | None
    valid: torch.Tensor | None
    qmax: int
    tables: torch.Tensor | None
    length: int
    mask: torch.Tensor | None
    other: list[int]
    all_slots_valid: bool


def decode_plan(m: AttentionMetadata, block_size: int, sliding_window: int | None) -> DecodePlan:
    """The step's :class:`DecodePlan` for ``sliding_window``, cached on ``m``."""
    cache = m.__dict__.setdefault("_torch_plans", {})
    plan = cache.get(sliding_window)
    if plan is not None:
        return plan
    starts, lens = m.query_start_loc_host, m.seq_lens_host
    n = len(lens)
    qlen = [starts[i + 1] - starts[i] for i in range(n)]
    short = [i for i in range(n) if 1 <= qlen[i] <= SHORT_CHUNK]
    other = [i for i in range(n) if not 1 <= qlen[i] <= SHORT_CHUNK]
    device = m.slot_mapping.device
    rows = valid = tables = mask = None
    length, qmax = 0, 1
    if short:
        length = max(lens[i] for i in short)
        qmax = max(qlen[i] for i in short)
        nblk = -(-length // block_size)
        idx = torch.tensor(short, device=device)
        tables = m.block_tables.to(device)[idx, :nblk].long()
        # query j of chunk i (padding repeats the chunk's last query) and its position
        pick = [[min(j, qlen[i] - 1) for j in range(qmax)] for i in short]
        q_rows = [starts[i] + j for i, js in zip(short, pick) for j in js]
        if any(qlen[i] < qmax for i in short):
            valid = torch.tensor([j < qlen[i] for i in short for j in range(qmax)], device=device)
        if valid is not None or q_rows != list(range(len(q_rows))):
            rows = torch.tensor(q_rows, device=device)
        seq = torch.tensor([lens[i] for i in short], device=device)
        qpos = torch.tensor(
            [[lens[i] - qlen[i] + j for j in js] for i, js in zip(short, pick)], device=device
        )
        key_pos = torch.arange(length, device=device)
        allowed = _visibility(qpos, key_pos, sliding_window)  # [B, Q, L]
        allowed &= (key_pos[None, :] < seq[:, None])[:, None, :]
        if not bool(allowed.all()):
            mask = allowed[:, None]  # [B, 1, Q, L]
    plan = DecodePlan(
        rows, valid, qmax, tables, length, mask, other, bool((m.slot_mapping >= 0).all())
    )
    cache[sliding_window] = plan
    return plan


class TorchAttentionBackend:
    """Attention backend ``torch``: the default on CPU and the reference for ``triton``."""

    name = "torch"
    #: the dtype a whole prompt's causal attention multiplies in (its softmax and sums stay
    #: float32 inside torch's flash kernel); float32 unless the loader lowers it (bf16 beside
    #: int8 compute on an AMX host: engine/int8_compute.py, prefill_attention_dtype)
    prefill_dtype: torch.dtype = torch.float32

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V by slot mapping, then attend; shapes as in
        :func:`tokenmill.kernels.reference.paged_attention` (query ``[T, Hq, D]``, caches
        ``[num_blocks, block_size, Hkv, D]``; returns ``[T, Hq, D]`` in query's dtype). The
        host copies of the metadata drive the loops, so a step on CUDA never syncs on them."""
        m = metadata
        if m.max_query_len == 1 and query.device.type == "cpu" and cpu.available():
            # every sequence decodes one token: the C kernel stores and attends in one call
            out = cpu.decode_attention(
                query,
                key,
                value,
                k_cache,
                v_cache,
                m.slot_mapping,
                m.block_tables,
                m.seq_lens,
                scale,
                sliding_window,
            )
            if out is not None:
                return out.to(query.dtype)
        plan = decode_plan(m, k_cache.shape[1], sliding_window)
        if plan.all_slots_valid:
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(
                0, m.slot_mapping, key.to(k_cache.dtype)
            )
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(
                0, m.slot_mapping, value.to(v_cache.dtype)
            )
        else:
            store_kv(key, value, k_cache, v_cache, m.slot_mapping)
        out = torch.empty_like(query)
        if plan.tables is not None:
            nb, qmax = plan.tables.shape[0], plan.qmax
            q = query[: nb * qmax] if plan.rows is None else query[plan.rows]
            res = self._decode(q.view(nb, qmax, *q.shape[1:]), k_cache, v_cache, plan, scale)
            res = res.reshape(nb * qmax, *res.shape[2:])
            if plan.rows is None:
                out[: nb * qmax] = res
            elif plan.valid is None:
                out[plan.rows] = res
            else:
                out[plan.rows[plan.valid]] = res[plan.valid]
        starts, lens = m.query_start_loc_host, m.seq_lens_host
        for i in plan.other:
            s, e = starts[i], starts[i + 1]
            if e - s == lens[i] and sliding_window is None:
                # a whole prompt in one chunk: its keys and values are this step's own
                out[s:e] = self._whole_prompt(
                    query[s:e], key[s:e], value[s:e], scale, self.prefill_dtype
                )
                continue
            out[s:e] = attend_chunk(
                query[s:e], k_cache, v_cache, m.block_tables[i], lens[i], scale, sliding_window
            )
        return out

    @staticmethod
    def _whole_prompt(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Causal attention of a prompt's ``q [L, Hq, D]`` over its own ``k, v [L, Hkv, D]``
        (float32 math, as the reference, unless ``dtype`` says otherwise); ``[L, Hq, D]``."""
        out = F.scaled_dot_product_attention(
            q.to(dtype).transpose(0, 1)[None],  # [1, Hq, L, D]
            k.to(dtype).transpose(0, 1)[None],
            v.to(dtype).transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1).to(q.dtype)

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlan,
        scale: float,
    ) -> torch.Tensor:
        """``q [B, Q, Hq, D]`` → ``[B, Q, Hq, D]``: one SDPA call (float32 math, as the
        reference)."""
        hq = q.shape[2]
        k = k_cache[plan.tables].flatten(1, 2)[:, : plan.length]  # [B, L, Hkv, D]
        v = v_cache[plan.tables].flatten(1, 2)[:, : plan.length]
        hkv = k.shape[2]
        out = F.scaled_dot_product_attention(
            q.float().transpose(1, 2),  # [B, Hq, Q, D]
            k.float().transpose(1, 2),  # [B, Hkv, L, D]
            v.float().transpose(1, 2),
            attn_mask=plan.mask,
            scale=scale,
            enable_gqa=hq != hkv,
        )
        return out.transpose(1, 2).to(q.dtype)
