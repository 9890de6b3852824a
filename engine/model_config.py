"""Read a Hugging Face ``config.json`` into the few numbers our decoder needs.

We parse the JSON ourselves rather than through ``transformers.AutoConfig`` so that a bad folder
fails with one line that names the problem, and so that both RoPE spellings are read: the older
``rope_theta`` + ``rope_scaling`` keys and the ``rope_parameters`` dict that transformers 5 writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary-embedding parameters.

    ``rope_type`` is one of ``default``, ``linear``, ``dynamic``, ``llama3`` (the names
    Hugging Face uses); the other fields are read only by the types that need them.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a Llama-family decoder, as read from ``config.json``.

    ``sliding_windows`` has one entry per layer: ``None`` for full attention, else the window
    size in tokens (a key at position j is visible to a query at position i iff
    ``i - window < j <= i``, the Hugging Face convention).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_queries_per_kv(self) -> int:
        """GQA group size: query heads sharing one KV head."""
        return self.num_attention_heads // self.num_key_value_heads


def _rope_from(cfg: dict) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type dicts (Gemma-style) are not a Llama-family layout.
        raise ModelLoadError("config.json: per-layer rope_parameters are not supported")
    if not isinstance(params, dict):
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _sliding_windows(cfg: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM":
        return (window,) * num_layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        layer_types = cfg.get("layer_types")
        if not cfg.get("use_sliding_window", False) or window is None:
            return (None,) * num_layers
        if layer_types is None:
            first = cfg.get("max_window_layers", num_layers)
            layer_types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            ]
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * num_layers


def _int(cfg: dict, key: str, default: int | None = None, minimum: int = 1) -> int:
    value = cfg.get(key, default) if default is not None else cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"config.json: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive_float(cfg: dict, key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelLoadError(f"config.json: {key} must be a number > 0, got {value!r}")
    return float(value)


def _check_shapes(c: ModelConfig) -> None:
    if c.num_attention_heads % c.num_key_value_heads:
        raise ModelLoadError(
            f"config.json: num_attention_heads ({c.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({c.num_key_value_heads})"
        )
    if c.head_dim % 2:
        raise ModelLoadError(
            f"config.json: head_dim must be even for rotary embeddings, got {c.head_dim}"
        )
    if c.rope.theta <= 0:
        raise ModelLoadError(f"config.json: rope_theta must be > 0, got {c.rope.theta}")
    if c.rope.rope_type != "default" and c.rope.factor <= 0:
        raise ModelLoadError(f"config.json: rope scaling factor must be > 0, got {c.rope.factor}")
    if len(c.sliding_windows) != c.num_hidden_layers:
        raise ModelLoadError(
            f"config.json: layer_types has {len(c.sliding_windows)} entries for {c.num_hidden_layers} layers"
        )
    for w in c.sliding_windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ModelLoadError(
                f"config.json: sliding_window must be an integer >= 1 or null, got {w!r}"
            )
    if any(isinstance(t, bool) or not isinstance(t, int) for t in c.eos_token_ids):
        raise ModelLoadError(
            f"config.json: eos_token_id must be integer(s), got {list(c.eos_token_ids)!r}"
        )


def parse_model_config(cfg: dict) -> ModelConfig:
    """Build a :class:`ModelConfig` from a parsed ``config.json`` dict.

    Raises:
        ModelLoadError: unknown architecture, missing key, or an option we do not implement.
    """
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelLoadError(
            "config.json has no 'architectures' entry; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    try:
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        layers = _int(cfg, "num_hidden_layers")
        kv_heads = (
            _int(cfg, "num_key_value_heads", heads)
            if cfg.get("num_key_value_heads") is not None
            else heads
        )
        head_dim = (
            _int(cfg, "head_dim", hidden // heads)
            if cfg.get("head_dim") is not None
            else hidden // heads
        )
        attn_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        config = ModelConfig(
            architecture=arch,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(cfg, "rms_norm_eps", 1e-6),
            max_position_embeddings=_int(cfg, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always biases q/k/v and never o; Mistral has no biases; Llama and Qwen3
            # follow attention_bias for all four projections.
            qkv_bias=True
            if arch == "Qwen2ForCausalLM"
            else (attn_bias and arch != "MistralForCausalLM"),
            o_bias=attn_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            rope=_rope_from(cfg),
            sliding_windows=_sliding_windows(cfg, arch, layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            raw=cfg,
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json is missing required key {exc.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"config.json has a malformed value: {exc}") from None
    _check_shapes(config)
    return config


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``<model_dir>/config.json``.

    Raises:
        ModelLoadError: the folder or its config.json is missing or unreadable, or the
            architecture is not one of :data:`SUPPORTED_ARCHITECTURES`.
    """
    if model_dir is None or str(model_dir) == "":
        raise ModelLoadError("no model path given")
    try:
        path = Path(model_dir).expanduser()
    except RuntimeError as exc:  # "~user" with no such user
        raise ModelLoadError(f"model path {str(model_dir)!r}: {exc}") from None
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a folder")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"model folder {str(path)!r} has no config.json")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {cfg_file}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file} is not a JSON object")
    return parse_model_config(cfg)
