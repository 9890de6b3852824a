"""Allocation of the paged KV cache (DESIGN.md §3): per layer a K and a V tensor of
``[num_blocks, block_size, num_kv_heads, head_dim]``."""

from __future__ import annotations

import torch

from .model_config import ModelConfig


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def allocate_kv_caches(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed caches, one ``(k_cache, v_cache)`` pair per layer.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
