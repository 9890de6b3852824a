"""Engine configuration: every knob the runbooks tell an operator to turn is a field here and a
flag of ``tokenmill serve``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

SCHEDULING_POLICIES = ("fcfs", "priority")
ADMISSION_POLICIES = ("strict", "skip_ahead")
PREFIX_CACHE_SCOPES = ("tenant", "global")

# 1 GiB holds ~1,450 blocks of 16 tokens for SmolLM2-135M in float32 (46 KiB per token).
DEFAULT_KV_CACHE_MEMORY = 1 << 30


@dataclass
class EngineConfig:
    """Settings of one engine (model, KV cache, scheduler).

    Attributes:
        model: Hugging Face folder; None = the default model (fetched on first use).
        dtype / device / load_format / attention_backend: as for the loader.
        block_size: tokens per KV block.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: most requests running at once.
        max_model_len: context limit (prompt + output); None = the model's
            ``max_position_embeddings``.
        enable_chunked_prefill: split long prompts across steps and mix them with decodes. Off,
            a prompt is prefilled whole in a prefill-only step (decodes wait that step).
        long_prefill_token_threshold: cap on one request's chunk per step (0 = no cap).
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        prefix_cache_scope: ``tenant`` (tenants never share blocks) or ``global``.
        kv_watermark: fraction of all blocks kept free for running requests when admitting.
        scheduling_policy: ``fcfs`` or ``priority`` (lower value = served first, then arrival).
        kv_cache_memory: bytes of KV cache on the CPU.
        gpu_memory_utilization: fraction of GPU memory the engine may use (weights,
            activations and KV cache) on CUDA.
        num_gpu_blocks_override: exact number of KV blocks (experiments, tests).
        seed: seed of the engine's default sampling generator.
        admission_policy: ``strict`` (FCFS admission stops at the first waiting request whose
            blocks do not fit) or ``skip_ahead`` (later requests that fit may pass it; symptom
            case C01, head-of-line blocking).
        max_admission_skips: with ``skip_ahead``, how many later requests may pass one waiting
            request before admission waits for it (so a big request is not starved).
        fault_nan_fraction: fault injection for drills and scenarios, never for production:
            this fraction of requests (chosen by a hash of the request id) get NaN logits at
            their first sampled token and fail with ``nan_logits``.
        fault_leak_blocks_on_abort: fault injection: aborted requests keep their KV blocks
            (a simulated block leak, symptom case C05).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    prefix_cache_scope: str = "tenant"
    kv_watermark: float = 0.01
    scheduling_policy: str = "fcfs"
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    admission_policy: str = "strict"
    max_admission_skips: int = 32
    fault_nan_fraction: float = 0.0
    fault_leak_blocks_on_abort: bool = False

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_memory")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size > 1024:
            raise ValueError(f"block_size must be <= 1024 tokens, got {self.block_size}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix_cache_scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission_policy must be one of {', '.join(ADMISSION_POLICIES)}")
        if self.max_admission_skips < 0:
            raise ValueError("max_admission_skips must be >= 0")
        if not 0 <= self.fault_nan_fraction <= 1:
            raise ValueError(f"fault_nan_fraction must be in [0, 1], got {self.fault_nan_fraction}")

    def to_dict(self) -> dict:
        """Plain dict of all fields (for the config-at-start event and the health page)."""
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
