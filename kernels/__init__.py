"""Triton kernels for the engine's hot path (DESIGN.md §3).

One module per kernel, each with its torch reference beside it (``reference_*``):

- :mod:`.store_kv` — write new K/V into the paged cache through ``slot_mapping``.
- :mod:`.paged_attention` — causal GQA attention over a batch mixing prefill chunks and decodes.
- :mod:`.paged_decode_attention` — split-K (flash-decoding) attention for one-token queries.
- :mod:`.rms_norm` — RMSNorm with an optional fused residual add.
- :mod:`.rotary_embedding` — neox-style RoPE, in place on q and k.
- :mod:`.silu_and_mul` — SwiGLU's ``silu(gate) * up``.

:mod:`.ops` bundles the element-wise kernels as ``TritonOps`` for the model and
:mod:`.backend` is the ``triton`` attention backend. Tools: :mod:`.compile_check` compiles
every kernel for a GPU target without a GPU; :mod:`.greedy_check` compares the engine's greedy
output on the two backends (run by ``scripts/gpu_check.sh``). Importing this package needs ``triton``;
on a machine without CUDA the kernels run only under ``TRITON_INTERPRET=1`` (set before the
first import of a kernel module).
"""
