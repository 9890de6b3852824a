"""Attention backend ``triton``: same interface and metadata as ``torch``.

``forward`` stores the step's K/V with the ``store_kv`` kernel, then attends with the split-K
decode kernel when every sequence has one new token, else with the mixed prefill/decode kernel.
Both choices are made from host-side metadata, so a step never waits on the device.
"""

from __future__ import annotations

import torch

from tokenmill.engine.attention.metadata import AttentionMetadata

from .paged_attention import paged_attention
from .paged_decode_attention import paged_decode_attention
from .store_kv import store_kv


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
            ValueError: as :func:`~.store_kv.store_kv` and the attention kernels.
        """
        store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        if metadata.max_query_len == 1:
            return paged_decode_attention(query, k_cache, v_cache, metadata, scale, sliding_window)
        return paged_attention(query, k_cache, v_cache, metadata, scale, sliding_window)
