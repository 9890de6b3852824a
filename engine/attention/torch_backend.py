"""Attention backend ``torch``: the kernels' plain-torch references (:mod:`tokenmill.kernels.
reference`, which imports no triton) driven by the step's :class:`AttentionMetadata`.

The default on CPU, and what the ``triton`` backend is tested against.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.reference import paged_attention, store_kv

from .metadata import AttentionMetadata

__all__ = ["TorchAttentionBackend", "store_kv"]


class TorchAttentionBackend:
    """Attention backend ``torch``: the default on CPU and the reference for ``triton``."""

    name = "torch"

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
        :func:`tokenmill.kernels.reference.paged_attention`. The host copies of the metadata
        drive the per-sequence loop, so a step on CUDA never syncs to read them."""
        m = metadata
        store_kv(key, value, k_cache, v_cache, m.slot_mapping)
        return paged_attention(
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
            query_start_loc_host=m.query_start_loc_host,
            seq_lens_host=m.seq_lens_host,
        )
