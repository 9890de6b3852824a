"""Engine configuration: every knob the runbooks tell an operator to turn is a field here and a
flag of ``tokenmill serve``.

Each field is declared with :func:`knob`: its default, its help text and the bounds its flag
accepts are written once, here. ``tokenmill serve`` and ``tokenmill generate`` build their
options from these fields (``engine/cli.py``), as vLLM's ``EngineArgs`` does from its config
classes.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .messages import DEFAULT_BLOCK_SIZE

QUANTIZATIONS = ("none", "int8", "int4")
SCHEDULING_POLICIES = ("fcfs", "priority")
ADMISSION_POLICIES = ("strict", "skip_ahead")
PREFIX_CACHE_SCOPES = ("tenant", "global")

# 1 GiB holds ~1,450 blocks of 16 tokens for SmolLM2-135M in float32 (46 KiB per token).
DEFAULT_KV_CACHE_MEMORY = 1 << 30


#: --int4-activations: the CPU int4 GEMV's activation modes (kernels/cpu.py: int4_act)
INT4_ACTIVATIONS = ("auto", "int8", "float32")


def knob(default: Any, help: str, *, min: float | None = None, max: float | None = None) -> Any:
    """A config field with its documentation.

    Args:
        default: the field's default (and its flag's).
        help: one or two sentences for ``--help`` and for readers of this class.
        min, max: the flag's accepted range (inclusive); :meth:`EngineConfig.validate` checks
            the field itself, for callers that do not come through the command line.
    """
    return field(default=default, metadata={"help": help, "min": min, "max": max})


@dataclass
class EngineConfig:
    """Settings of one engine (model, KV cache, scheduler); each field's help says what it
    does (``EngineConfig.field_help(name)``)."""

    model: str | None = knob(None, "Hugging Face model folder (default: the fetched SmolLM2).")
    dtype: str = knob(
        "auto",
        "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bfloat16 on CUDA); the "
        "activation dtype when --quantization is set.",
    )
    quantization: str = knob(
        "none",
        "none | int8 | int4: weight-only quantization of every linear layer and the LM head "
        "(int8 symmetric and int4 asymmetric, a scale per 32 weights along the input; int8 per "
        "output row where torch's packed kernel runs it).",
    )
    int4_activations: str = knob(
        "auto",
        "auto | int8 | float32: what --quantization int4's decode GEMV on CPU multiplies its "
        "codes by. int8 (auto where the CPU has AVX-512 VNNI and VBMI): each activation row "
        "rounded to int8 per 32, exact integer dot products, about a fifth faster a step but "
        "+1.9 points of perplexity on SmolLM2-135M; float32: the activations as they are.",
    )
    int8_compute: str = knob(
        "auto",
        "auto | on | fast | off: with --quantization on a CPU, run prefill chunks and decode "
        "batches above the GEMV cut-over as int8 GEMMs (int32 sums; oneDNN's AMX, AVX-512 VNNI "
        "or AVX2 kernel, whichever the CPU has). on: activations as two int8 terms in every "
        "layer but the MLP's gate/up projection, within about 1.3 points of the weight-only "
        "model's perplexity; fast: one term everywhere, about +4 points; auto: on where the CPU has AVX-512 VNNI or AMX; off: the weights dequantized "
        "into a float32 GEMM.",
    )
    enforce_eager: bool = knob(
        False,
        "Run every step through the eager module forward: no compiled decode step "
        "(engine/models/native_step.py on CPU).",
    )
    device: str = knob("auto", "auto | cpu | cuda[:N]")
    tensor_parallel_size: int = knob(
        1,
        "Ranks one model is split across (heads and MLP channels; gloo on CPU), each a "
        "process on this host; two all-reduces a layer.",
        min=1,
        max=64,
    )
    tensor_parallel_join_timeout: float = knob(
        120.0,
        "Seconds every tensor-parallel rank has to join the group; past it the start fails "
        "naming the ranks missing (with MASTER_ADDR set, ranks on other hosts run "
        "`tokenmill tp-worker`).",
        min=1.0,
    )
    data_parallel_size: int = knob(
        1,
        "Engine cores behind one API (tokenmill serve), each a full copy of the model (and "
        "tensor-parallel itself when --tensor-parallel-size > 1); requests go to the one with "
        "the fewest outstanding tokens.",
        min=1,
        max=64,
    )
    router_prefix_affinity: bool = knob(
        False,
        "With --data-parallel-size > 1: send a request to the replica that last served the "
        "same first 4 KV blocks of prompt (its prefix cache may hold them) while it holds at "
        "most 8192 outstanding tokens more than the least loaded replica.",
    )
    disaggregation: str = knob(
        "",
        "'prefill=P,decode=D' (tokenmill serve): P prefill and D decode engine cores (up to 8 "
        "a side), each request's KV sent from its prefill core to its decode core over "
        "torch.distributed (gloo; NCCL on CUDA).",
    )
    prefill_devices: str = knob(
        "",
        "With --disaggregation: CPU cores the prefill side is pinned to (e.g. 0 or 0-3), "
        "shared evenly among its cores.",
    )
    decode_devices: str = knob(
        "",
        "With --disaggregation: CPU cores the decode side is pinned to (e.g. 1), shared "
        "evenly among its cores.",
    )
    remote_decode_listen: str = knob(
        "",
        "With --disaggregation: HOST:PORT on this host where the decode cores, each on another "
        "host (tokenmill pd-worker --connect HOST:PORT+2j for decode core j), connect; the KV "
        "link's rendezvous is on HOST too. Empty: every core runs here.",
    )
    decode_kv_cache_memory: int | None = knob(
        None,
        "With --disaggregation: KV cache bytes of each decode core on CPU (default "
        "--kv-cache-memory); the prefill side holds a prompt's KV only until it is sent.",
        min=1,
    )
    decode_num_gpu_blocks_override: int | None = knob(
        None,
        "With --disaggregation: exact number of KV blocks of each decode core (experiments, "
        "tests; default --num-gpu-blocks-override).",
        min=1,
    )
    load_format: str = knob("auto", "auto | safetensors | dummy (random weights)")
    attention_backend: str = knob(
        "auto", "auto | torch | triton (auto: triton on CUDA, torch on CPU)"
    )
    block_size: int = knob(DEFAULT_BLOCK_SIZE, "Tokens per KV block.", min=1, max=1024)
    max_num_batched_tokens: int = knob(
        2048, "Token budget of one engine step (prefill chunks + decodes).", min=1
    )
    max_num_seqs: int = knob(64, "Requests running at once.", min=1)
    max_model_len: int | None = knob(
        None,
        "Context limit, prompt + output (default: the model's max_position_embeddings).",
        min=1,
    )
    enable_chunked_prefill: bool = knob(
        True,
        "Split long prompts across steps and mix them with decodes. Off, a prompt is "
        "prefilled whole in a prefill-only step (decodes wait that step).",
    )
    long_prefill_token_threshold: int = knob(
        0, "Cap on one request's prefill chunk per step (0 = none).", min=0
    )
    enable_prefix_caching: bool = knob(True, "Reuse the KV blocks of identical prompt prefixes.")
    prefix_cache_scope: str = knob("tenant", "tenant (tenants never share blocks) | global")
    kv_watermark: float = knob(
        0.01,
        "Fraction of KV blocks kept free for running requests when admitting.",
        min=0.0,
        max=0.99,
    )
    scheduling_policy: str = knob(
        "fcfs", "fcfs | priority (lower value = served first, then arrival)"
    )
    kv_cache_memory: int = knob(DEFAULT_KV_CACHE_MEMORY, "KV cache bytes on CPU.", min=1)
    cpu_threads: int = knob(
        0,
        "CPU threads for the forward; 0 = the cores other processes leave free, re-read every "
        "second (engine/cpu_threads.py). CPU only.",
        min=0,
    )
    gpu_memory_utilization: float = knob(
        0.9,
        "Fraction of GPU memory the engine may use (weights, activations and KV cache) on CUDA.",
        min=0.01,
        max=1.0,
    )
    num_gpu_blocks_override: int | None = knob(
        None, "Exact number of KV blocks (experiments, tests).", min=1
    )
    peak_bandwidth_gbps: float | None = knob(
        None,
        "Roofline: the device's peak memory bandwidth in GB/s (default: the GPU's datasheet "
        "figure, or a probe on the CPU).",
        min=0.001,
    )
    peak_gflops: float | None = knob(
        None,
        "Roofline: the device's peak compute in GFLOP/s for the model's dtype (default: the "
        "GPU's datasheet figure, or a probe on the CPU).",
        min=0.001,
    )
    speculative_config: str | None = knob(
        None,
        'Speculative decoding as JSON, vLLM\'s spelling: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} '
        "(n-gram prompt lookup; engine/spec_decode.py). Off when unset.",
    )
    admission_policy: str = knob(
        "strict",
        "strict (FCFS admission stops at a request that does not fit) | skip_ahead "
        "(smaller requests that fit may pass it; symptom case C01, head-of-line blocking).",
    )
    max_admission_skips: int = knob(
        32,
        "skip_ahead: passes allowed before admission waits (so a big request is not starved).",
        min=0,
    )
    fault_nan_fraction: float = knob(
        0.0,
        "Fault drill: this fraction of requests (chosen by a hash of the request id) get NaN "
        "logits at their first sampled token and fail with nan_logits.",
        min=0.0,
        max=1.0,
    )
    fault_leak_blocks_on_abort: bool = knob(
        False, "Fault drill: aborted requests keep their KV blocks (a simulated leak, case C05)."
    )
    fault_slow_rank: int = knob(
        0,
        "Fault drill (tensor parallel): this worker rank (1..N-1; 0 = none) also spends "
        "--fault-slow-rank-ms in every step's forward, as a rank on a busy core would.",
        min=0,
    )
    fault_slow_rank_ms: float = knob(
        20.0, "Fault drill: the extra forward time of --fault-slow-rank (ms).", min=0.0
    )
    fault_crash_after_steps: int = knob(
        0,
        "Fault drill: the engine core exits (status 70) after this many working steps, every "
        "time it starts (0 = off): a crash loop.",
        min=0,
    )
    fault_kv_transfer_delay_ms: float = knob(
        0.0,
        "Fault drill (--disaggregation): every request's KV transfer from the prefill to the "
        "decode core takes this much longer (ms), as a slow link would.",
        min=0.0,
    )

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        positive = (
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "kv_cache_memory",
            "tensor_parallel_size",
            "data_parallel_size",
        )
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
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission_policy must be one of {', '.join(ADMISSION_POLICIES)}")
        for name in ("peak_bandwidth_gbps", "peak_gflops"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_admission_skips < 0:
            raise ValueError("max_admission_skips must be >= 0")
        from .spec_config import parse_speculative_config

        parse_speculative_config(self.speculative_config)  # ValueError naming the field
        from .int8_compute import INT8_COMPUTE_MODES

        if self.int8_compute not in INT8_COMPUTE_MODES:
            raise ValueError(
                f"int8_compute must be one of {', '.join(INT8_COMPUTE_MODES)}, got "
                f"{self.int8_compute!r}"
            )
        if self.int8_compute in ("on", "fast") and self.quantization == "none":
            raise ValueError(
                f"--int8-compute {self.int8_compute} computes quantized layers in int8: it needs "
                "--quantization int8 or int4"
            )
        if self.int4_activations not in INT4_ACTIVATIONS:
            raise ValueError(
                f"int4_activations must be one of {', '.join(INT4_ACTIVATIONS)}, got "
                f"{self.int4_activations!r}"
            )
        self.pd_spec()  # ValueError naming the flag
        if self.fault_kv_transfer_delay_ms < 0:
            raise ValueError("fault_kv_transfer_delay_ms must be >= 0")
        if not 0 <= self.fault_nan_fraction <= 1:
            raise ValueError(f"fault_nan_fraction must be in [0, 1], got {self.fault_nan_fraction}")

    def pd_spec(self):
        """The parsed ``--disaggregation`` flags (``engine/parallel/pd_spec.py``), None when
        colocated.

        Raises:
            ValueError: a malformed spec or placement, or one combined with data or tensor
                parallelism (not built), one line.
        """
        from .parallel.pd_spec import parse_disaggregation

        spec = parse_disaggregation(
            self.disaggregation,
            self.prefill_devices,
            self.decode_devices,
            cpu_count=os.cpu_count() or 1,
        )
        if spec is None and (
            self.decode_kv_cache_memory is not None
            or self.decode_num_gpu_blocks_override is not None
            or self.remote_decode_listen
        ):
            raise ValueError(
                "--decode-kv-cache-memory, --decode-num-gpu-blocks-override and "
                "--remote-decode-listen need --disaggregation"
            )
        if self.remote_decode_listen and spec is not None:
            from .parallel.pd_spec import split_host_port

            try:
                _, port = split_host_port(self.remote_decode_listen)
            except ValueError as exc:
                raise ValueError(f"--remote-decode-listen: {exc}") from None
            if port + 2 * spec.decode - 1 > 65535:
                raise ValueError(
                    f"--remote-decode-listen: {spec.decode} decode core(s) take ports {port}.."
                    f"{port + 2 * spec.decode - 1}, past 65535"
                )
        if spec is not None and (self.data_parallel_size > 1 or self.tensor_parallel_size > 1):
            raise ValueError(
                "--disaggregation sets its own engine cores (prefill=P,decode=D); it does not "
                "combine with --data-parallel-size or --tensor-parallel-size yet"
            )
        return spec

    def model_len(self, max_position_embeddings: int) -> int:
        """The context limit in tokens: ``max_model_len`` when set, never above the model's
        ``max_position_embeddings``."""
        return min(self.max_model_len or max_position_embeddings, max_position_embeddings)

    def to_dict(self) -> dict:
        """Plain dict of all fields (for the config-at-start event and the health page)."""
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def field_help(cls, name: str) -> str:
        """The help text of field ``name``."""
        return next(f.metadata["help"] for f in fields(cls) if f.name == name)
