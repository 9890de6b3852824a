"""One decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3), reading the paged KV cache.

The families agree on the block (pre-norm RMSNorm, GQA attention with RoPE, SwiGLU MLP) and
differ only in switches carried by :class:`ModelConfig`: projection biases, per-head q/k
RMSNorm (Qwen3), sliding windows, RoPE scaling and tied embeddings. Module and parameter names
match Hugging Face checkpoints so weights load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.metadata import AttentionMetadata
from ..model_config import ModelConfig
from .linear import Linear
from .ops import TorchOps
from .rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim; ``forward(x, residual=None)``.

    Without ``residual``: ``[T, H] -> [T, H]``. With it: adds ``x + residual`` first and returns
    ``(normed, new_residual)`` (one fused kernel on CUDA). Same dtype in and out.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = TorchOps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class StackedLinear(Linear):
    """A linear layer holding several checkpoint projections stacked on the output dim
    (q/k/v or gate/up), so one matmul computes them all.

    ``shards`` maps each checkpoint name (e.g. ``q_proj``) to its ``(offset, size)`` rows.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shards[name] = (offset, size)
            offset += size


class Attention(nn.Module):
    """GQA self-attention over the paged cache, through the model's attention backend."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_windows[layer_idx]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = StackedLinear(
            cfg.hidden_size,
            {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=cfg.qkv_bias,
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.ops = TorchOps

    def forward(
        self, x, cos, sin, kv_cache: KVCache, metadata: AttentionMetadata, backend
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary(q, k, cos, sin)
        out = backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale, self.sliding_window
        )
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up in one matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = StackedLinear(
            cfg.hidden_size, {"gate_proj": size, "up_proj": size}, bias=cfg.mlp_bias
        )
        self.down_proj = Linear(size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.ops = TorchOps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block. Carries the residual stream separately so the add fuses into the norm:
    ``(h, residual) -> (mlp_out, residual')``; the caller adds the last ``mlp_out`` back."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, cos, sin, kv_cache, metadata, backend):
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, metadata, backend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm (``model.*`` in checkpoints)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # storage only (the loader fills it): nn.Embedding's own init draws normal_ through
        # torch's Python decompositions under the loader's meta device, 1.9 s of every start
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache.

    Args:
        cfg: the parsed model config.
        backend: an attention backend (``forward(q, k, v, k_cache, v_cache, metadata, scale,
            sliding_window)``), e.g. :class:`~tokenmill.engine.attention.TorchAttentionBackend`.
    """

    def __init__(self, cfg: ModelConfig, backend):
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.tie_weights()

    def use_ops(self, ops) -> None:
        """Route norms, RoPE and SwiGLU through ``ops`` (see :mod:`.ops`), e.g. Triton kernels."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids: ``[num_tokens]`` int64, the new tokens of all sequences, flat.
            positions: ``[num_tokens]`` int64 position of each token in its sequence.
            kv_caches: per layer ``(k_cache, v_cache)``, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]``; updated in place.
            metadata: the step's :class:`AttentionMetadata`.

        Returns:
            Final hidden states ``[num_tokens, hidden_size]`` in the model dtype; pass the rows
            you sample from to :meth:`compute_logits`.
        """
        cos, sin = self.rope_tables(positions, metadata)
        h = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, kv, metadata, self.backend)
        h, _ = self.model.norm(h, residual)
        return h

    def rope_tables(
        self, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's RoPE ``cos, sin`` ``[num_tokens, head_dim]`` float32 for ``positions
        [num_tokens]`` int64 (``dynamic`` scaling reads each token's sequence length from
        ``metadata``)."""
        seq_len_per_token = None
        if self.config.rope.rope_type == "dynamic":
            q_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
            seq_len_per_token = torch.repeat_interleave(metadata.seq_lens, q_lens.long())
        return self.rotary.cos_sin(positions, seq_len_per_token)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` → ``[N, vocab_size]`` float32 logits."""
        return self.lm_head(hidden).float()
