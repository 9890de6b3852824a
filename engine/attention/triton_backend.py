"""Attention backend ``triton``: same interface and metadata as ``torch``, over the kernels of
:mod:`tokenmill.kernels` (imported with this module, so it needs triton: the registry in
:mod:`tokenmill.engine.attention` imports it only when asked for).

``forward`` stores the step's K/V with the ``store_kv`` kernel, then attends with the split-K
decode kernel when every sequence has one new token, else with the mixed prefill/decode kernel.
Both choices are made from host-side metadata, so a step never waits on the device.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.paged_attention import paged_attention
from tokenmill.kernels.paged_decode_attention import paged_decode_attention
from tokenmill.kernels.store_kv import store_kv

from .metadata import AttentionMetadata


class TritonAttentionBackend:
    """Attention backend ``triton``: the default on CUDA."""

    name = "triton"

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
        """Store this step's K/V by slot mapping, then attend.

        Args:
            query: ``[num_tokens, num_heads, head_dim]``.
            key, value: ``[num_tokens, num_kv_heads, head_dim]``.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, updated in
                place.
            metadata: the step's :class:`AttentionMetadata`.
            scale: softmax scale.
            sliding_window: keys older than this many positions are invisible (None = full).

        Returns:
            ``[num_tokens, num_heads, head_dim]`` in query's dtype.

        Raises:
            ValueError: as :func:`tokenmill.kernels.store_kv.store_kv` and the attention
                kernels.
        """
        m = metadata
        store_kv(key, value, k_cache, v_cache, m.slot_mapping)
        attend = paged_decode_attention if m.max_query_len == 1 else paged_attention
        return attend(
            query,
            k_cache,
            v_cache,
            m.query_start_loc,
            m.seq_lens,
            m.block_tables,
            m.max_query_len,
            m.max_seq_len,
            scale,
            sliding_window,
        )
