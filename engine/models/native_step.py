"""The compiled decode path on CPU: a decoder's small all-decode steps as one C call.

What ``--enforce-eager`` turns off. A decode step of ``B`` sequences with one new token each
and ``B <=`` :data:`MAX_NATIVE_ROWS` runs through :class:`tokenmill.kernels.cpu_step.DecodeStep`
(every layer in C over the same kernels the eager path calls one by one); the embedding lookup,
the RoPE tables and the LM head stay in torch. Anything else (prefill chunks, speculative
verification, larger batches) runs the eager ``nn.Module`` forward.

Why our own compiled step and not ``torch.compile``: on this project's 2-core CPU, inductor
(torch 2.13) compiling the decoder layer's non-attention halves gave a batch-1 ITL of 53.6 ms
(static shapes) and 64.6 ms (dynamic) against 41.5 ms eager, after 22 s of compilation
(``benchmarks/RESULTS.md``, "A small step against its floor"). A step in C needs no shape
buckets or padding either: it takes any batch up to the cut-over as it comes.

:func:`native_decode_for` says whether a loaded model can take the path, and why not
(``reason``): it needs the CPU kernels, float32 activations and every linear layer float32
or weight-only int8 or int4 (``bf16`` keeps the eager path).
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu
from tokenmill.kernels.cpu_step import DecodeStep, StepLayer, StepLinear

from ..attention.metadata import AttentionMetadata
from .decoder import DecoderForCausalLM, KVCache
from .linear import Linear

__all__ = ["MAX_NATIVE_ROWS", "NativeDecode", "native_decode_for"]

# the GEMV kernel's cut-over (kernels/cpu.py: FASTER_ROWS): above it torch's GEMM is faster
# than the kernel, so larger decode steps keep the eager path's dense products
MAX_NATIVE_ROWS = cpu.FASTER_ROWS


def _step_linear(module, name: str) -> StepLinear:
    """A decoder linear as the C step's :class:`StepLinear`; ValueError if it cannot be one."""
    if isinstance(module, Linear):
        return StepLinear(module.weight.detach(), None, _bias(module))
    gemv_scales = getattr(module, "gemv_scales", None)
    method = getattr(module, "method", None)
    if method == "int8" and gemv_scales is not None:
        return StepLinear(module.qweight, gemv_scales, _bias(module))
    if method == "int4" and getattr(module, "path", None) == "gemv":
        return StepLinear(module.qweight, module.group_scales, _bias(module))
    kind = method or type(module).__name__
    if method == "int4":
        kind = "int4 in torch's packed layout"
    raise ValueError(f"{name} is {kind}; the compiled decode step takes float32, int8 or int4")


def _bias(module) -> torch.Tensor | None:
    b = getattr(module, "bias", None)
    return b.detach() if b is not None else None


class NativeDecode:
    """The compiled decode path of one model over its KV caches.

    Args:
        model: a loaded float32 CPU decoder.
        kv_caches: per layer ``(k_cache, v_cache)`` ``[num_blocks, block_size, num_kv_heads,
            head_dim]`` float32 (the caches the eager path uses).

    Raises:
        ValueError: the model or caches cannot take the path (:func:`native_decode_for` turns
            this into its reason).
        RuntimeError: the CPU kernels are unavailable.
    """

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[KVCache]):
        cfg = model.config
        tp = getattr(model, "tensor_parallel", None)
        if tp is not None and tp.world > 1:
            raise ValueError("tensor parallel: the compiled decode step has no all-reduce")
        if next(model.parameters()).dtype != torch.float32:
            raise ValueError("the model runs in a dtype other than float32")
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("the model is not on the CPU")
        layers = []
        for i, (layer, (k_cache, v_cache)) in enumerate(
            zip(model.model.layers, kv_caches, strict=True)
        ):
            attn, mlp = layer.self_attn, layer.mlp
            p = f"layer {i}"
            layers.append(
                StepLayer(
                    input_norm=layer.input_layernorm.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    qkv=_step_linear(attn.qkv_proj, f"{p} qkv_proj"),
                    o=_step_linear(attn.o_proj, f"{p} o_proj"),
                    gate_up=_step_linear(mlp.gate_up_proj, f"{p} gate_up_proj"),
                    down=_step_linear(mlp.down_proj, f"{p} down_proj"),
                    k_cache=k_cache,
                    v_cache=v_cache,
                    q_norm=attn.q_norm.weight.detach() if attn.q_norm is not None else None,
                    k_norm=attn.k_norm.weight.detach() if attn.k_norm is not None else None,
                    window=attn.sliding_window,
                )
            )
        self.model = model
        self.kv_caches = kv_caches
        self.step = DecodeStep(
            layers,
            model.model.norm.weight.detach(),
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            scale=cfg.head_dim**-0.5,
        )

    @staticmethod
    def takes(num_tokens: int, metadata: AttentionMetadata) -> bool:
        """Whether a step of ``num_tokens`` flat tokens runs here: one new token per sequence,
        at most :data:`MAX_NATIVE_ROWS` sequences."""
        return 1 <= num_tokens <= MAX_NATIVE_ROWS and metadata.max_query_len == 1

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Same contract as :meth:`DecoderForCausalLM.forward` for a step :meth:`takes`:
        ``input_ids, positions [B]`` int64 → final hidden states ``[B, hidden_size]``
        float32; writes the step's K/V into the caches."""
        cos, sin = self.model.rope_tables(positions, metadata)
        h = self.model.model.embed_tokens(input_ids).contiguous()
        m = metadata
        return self.step(
            h, cos.contiguous(), sin.contiguous(), m.slot_mapping, m.block_tables, m.seq_lens
        )


def native_decode_for(
    model: DecoderForCausalLM, kv_caches: list[KVCache]
) -> tuple[NativeDecode | None, str | None]:
    """``(path, None)`` when ``model`` can take the compiled decode path, else ``(None,
    reason)`` with a one-line reason (the CPU kernels unavailable, a dtype, a layer kind)."""
    if not cpu.available():
        return None, f"CPU kernels unavailable: {cpu.unavailable_reason()}"
    try:
        return NativeDecode(model, kv_caches), None
    except ValueError as exc:
        return None, str(exc)
