"""Rotary position embedding (neox layout: rotate the two halves of each head) with the
scaling types Llama-family checkpoints ask for.

Frequencies follow the Hugging Face definitions (``transformers.modeling_rope_utils``), which
are what the checkpoints were trained with: ``linear`` divides every frequency by ``factor``;
``llama3`` leaves high frequencies, divides low ones by ``factor`` and blends between
(Llama 3.1 report); ``dynamic`` (NTK-aware) raises the base once a sequence outgrows
``max_position_embeddings``: base' = base * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2)).
"""

from __future__ import annotations

import math

import torch

from ..model_config import RopeConfig


def base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """``[dim // 2]`` float32 inverse frequencies ``theta ** (-2i / dim)``, on the CPU."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def llama3_inv_freq(cfg: RopeConfig, dim: int) -> torch.Tensor:
    """Llama 3.1 frequency scaling; ``[dim // 2]`` float32."""
    inv_freq = base_inv_freq(cfg.theta, dim)
    old_ctx = cfg.original_max_position_embeddings or 8192
    low_wavelen = old_ctx / cfg.low_freq_factor
    high_wavelen = old_ctx / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old_ctx / wavelen - cfg.low_freq_factor) / (
        cfg.high_freq_factor - cfg.low_freq_factor
    )
    blended = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """Applies RoPE to query and key given each token's position.

    Args:
        cfg: the model's :class:`RopeConfig`.
        head_dim: rotary dimension (the whole head).
        max_position_embeddings: the model's trained context, used by ``dynamic``.
    """

    def __init__(self, cfg: RopeConfig, head_dim: int, max_position_embeddings: int):
        self.cfg = cfg
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        if cfg.rope_type == "llama3":
            inv_freq = llama3_inv_freq(cfg, head_dim)
        elif cfg.rope_type == "linear":
            inv_freq = base_inv_freq(cfg.theta, head_dim) / cfg.factor
        else:
            inv_freq = base_inv_freq(cfg.theta, head_dim)
        # Kept off the module tree (and off any meta/default device): built on the CPU in
        # float32, copied to a device on first use there.
        self._inv_freq = {"cpu": inv_freq}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """``[head_dim // 2]`` float32 inverse frequencies on ``device``."""
        key = str(device)
        if key not in self._inv_freq:
            self._inv_freq[key] = self._inv_freq["cpu"].to(device)
        return self._inv_freq[key]

    def _dynamic_inv_freq(self, seq_len_per_token: torch.Tensor) -> torch.Tensor:
        """``[T, dim // 2]`` NTK-scaled frequencies for tokens of sequences of the given lengths."""
        d = self.head_dim
        length = seq_len_per_token.float().clamp(min=self.max_position_embeddings)[:, None]
        f = self.cfg.factor
        base = self.cfg.theta * ((f * length / self.max_position_embeddings) - (f - 1)) ** (
            d / (d - 2)
        )
        exps = torch.arange(0, d, 2, dtype=torch.int64, device=length.device).float() / d
        return 1.0 / (base**exps)

    def cos_sin(
        self, positions: torch.Tensor, seq_len_per_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables ``[T, head_dim]`` float32 for ``positions [T]`` int64.

        ``seq_len_per_token [T]`` (the length of each token's sequence at the end of this step)
        is used only by ``dynamic`` scaling, matching Hugging Face's single-sequence behaviour.
        """
        pos = positions.float()[:, None]
        if self.cfg.rope_type == "dynamic" and seq_len_per_token is not None:
            freqs = pos * self._dynamic_inv_freq(seq_len_per_token)
        else:
            freqs = pos * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
