"""The roofline arithmetic of one engine step: bytes moved and FLOPs done, from the model's shapes.

Torch-free. :class:`ModelCost` is built once per engine from the model's :class:`ModelConfig`
and the bytes its linear layers store (:meth:`ModelCost.from_config`); :func:`step_cost` turns
one step's chunks into the four numbers every ``StepRecord`` carries:

* ``weight_bytes`` — every decoder linear layer's weights read once (in their storage dtype:
  4 bytes a float32 weight, 1 an int8, half a byte an int4, with their scale tables), plus the
  LM head once when any row samples. The embedding rows looked up (one hidden vector per token)
  and the norms are left out: next to the linear layers they are noise.
* ``kv_read_bytes`` — the KV cache attention reads: per chunk, its context (start + new tokens,
  the new tokens' own K/V included) × the KV bytes of one token over all layers; a layer with a
  sliding window reads at most ``window + new tokens - 1`` of them.
* ``kv_write_bytes`` — the new tokens' K/V: new tokens × KV bytes per token.
* ``flops`` — linear layers ``2 × params × tokens`` (LM head ``2 × hidden × vocab`` per sampled
  row), plus attention ``4 × heads × head_dim`` per (query, key) pair per layer (``QKᵀ`` and
  ``PV``, 2 FLOP per multiply-add each), causal: a chunk of ``q`` tokens starting at ``s``
  attends to ``Σ_{i=1..q} (s + i)`` keys (capped at the window per query on windowed layers).
  Biases, norms, RoPE, softmax and the activation are left out (all O(tokens × hidden)).

Units: bytes and FLOP (not FLOP/s). The store derives intensity (FLOP/byte), achieved GB/s and
GFLOP/s from these and ``forward_ms`` (``tokenmill.telemetry.schema``: the roofline SQL).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from .model_config import ModelConfig

#: Bytes per stored weight of each dtype name (``int4`` packs two weights per byte).
DTYPE_BYTES = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "int8": 1.0,
    "int4": 0.5,
}


class StepCost(NamedTuple):
    """One step's traffic (bytes) and work (FLOP)."""

    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: int


class Chunk(NamedTuple):
    """What :func:`step_cost` needs of one scheduled chunk (a ``ScheduledChunk`` fits too):
    ``num_new_tokens`` tokens computed from position ``start``; ``samples`` when its last row
    goes through the LM head."""

    start: int
    num_new_tokens: int
    samples: bool


@dataclass(frozen=True)
class ModelCost:
    """The per-token and per-step constants of one loaded model.

    Attributes:
        num_layers, num_heads, head_dim: the decoder's shape.
        linear_params: weights of every decoder linear layer over all layers (q/k/v, o,
            gate/up, down), biases not counted.
        lm_head_params: ``hidden × vocab``.
        linear_weight_bytes: bytes those decoder weights take as stored.
        lm_head_weight_bytes: bytes the LM head's weight takes as stored (the embedding's, when
            tied and not quantized).
        kv_bytes_per_token_layer: K and V bytes of one token in one layer
            (``2 × num_kv_heads × head_dim × KV dtype size``).
        sliding_windows: per layer, None (full attention) or the window in tokens.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    linear_params: int
    lm_head_params: int
    linear_weight_bytes: int
    lm_head_weight_bytes: int
    kv_bytes_per_token_layer: int
    sliding_windows: tuple[int | None, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (K and V)."""
        return self.kv_bytes_per_token_layer * self.num_layers

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        *,
        weight_dtype_bytes: float = 4.0,
        kv_dtype_bytes: int = 4,
        linear_weight_bytes: int | None = None,
        lm_head_weight_bytes: int | None = None,
    ) -> ModelCost:
        """The costs of a Llama-family decoder with ``cfg``'s shapes.

        Args:
            cfg: the model's config.
            weight_dtype_bytes: bytes per weight when the stored sizes are not given
                (:data:`DTYPE_BYTES`).
            kv_dtype_bytes: bytes per element of the KV cache (the model's activation dtype).
            linear_weight_bytes, lm_head_weight_bytes: the bytes the loaded model's decoder
                linear layers and LM head store (quantized weights with their scale tables);
                None: ``params × weight_dtype_bytes``.
        """
        h, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        per_layer = h * (q + 2 * kv) + q * h + h * 2 * cfg.intermediate_size
        per_layer += cfg.intermediate_size * h
        linear = per_layer * cfg.num_hidden_layers
        head = h * cfg.vocab_size
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            head_dim=d,
            linear_params=linear,
            lm_head_params=head,
            linear_weight_bytes=int(
                linear * weight_dtype_bytes if linear_weight_bytes is None else linear_weight_bytes
            ),
            lm_head_weight_bytes=int(
                head * weight_dtype_bytes if lm_head_weight_bytes is None else lm_head_weight_bytes
            ),
            kv_bytes_per_token_layer=2 * kv * kv_dtype_bytes,
            sliding_windows=tuple(cfg.sliding_windows),
        )


def attended_keys(start: int, num_new_tokens: int, window: int | None = None) -> int:
    """Σ over a chunk's queries of the keys each attends to (causal): the query at position
    ``p`` sees ``min(p + 1, window)`` keys, so a chunk of ``q`` tokens from ``start`` = s sums
    ``Σ_{i=1..q} min(s + i, window)`` (``q·s + q(q+1)/2`` without a window)."""
    s, q = start, num_new_tokens
    if q <= 0:
        return 0
    if window is None or s + q <= window:
        return q * s + q * (q + 1) // 2
    if s >= window:
        return q * window
    # positions s+1..window grow, the rest are capped at the window
    return (window * (window + 1) - s * (s + 1)) // 2 + (s + q - window) * window


def step_cost(cost: ModelCost, chunks: Iterable) -> StepCost:
    """Bytes and FLOPs of one step over ``chunks`` (each with ``start``, ``num_new_tokens`` and
    ``samples``, such as :class:`Chunk` or the scheduler's ``ScheduledChunk``).

    Returns:
        ``(weight_bytes, kv_read_bytes, kv_write_bytes, flops)``; all zero for no tokens.
    """
    windows: dict[int | None, int] = {}
    for w in cost.sliding_windows:
        windows[w] = windows.get(w, 0) + 1
    tokens = sampled = kv_read_tokens = pairs = 0
    for c in chunks:
        s, q = c.start, c.num_new_tokens
        if q <= 0:
            continue
        tokens += q
        sampled += getattr(c, "num_logit_rows", int(bool(c.samples)))
        for w, layers in windows.items():
            context = s + q if w is None else min(s + q, w + q - 1)
            kv_read_tokens += context * layers
            pairs += attended_keys(s, q, w) * layers
    if not tokens:
        return StepCost(0, 0, 0, 0)
    weight = cost.linear_weight_bytes + (cost.lm_head_weight_bytes if sampled else 0)
    flops = 2 * cost.linear_params * tokens + 2 * cost.lm_head_params * sampled
    flops += 4 * cost.num_heads * cost.head_dim * pairs
    return StepCost(
        weight_bytes=weight,
        kv_read_bytes=kv_read_tokens * cost.kv_bytes_per_token_layer,
        kv_write_bytes=tokens * cost.kv_bytes_per_token,
        flops=flops,
    )
