"""Triton kernels for the engine's hot path (DESIGN.md §3).

The kernels take tensors and sizes (``query_start_loc``, ``seq_lens``, ``block_tables``,
``slot_mapping``, ``max_query_len``, ``scale``, ...), never engine types: this package imports
nothing from :mod:`tokenmill.engine`. The engine's adapters live beside the engine's other
backends (:mod:`tokenmill.engine.attention.triton_backend`, and
:func:`tokenmill.engine.models.ops.get_ops` picking :class:`.ops.TritonOps`).

One module per kernel, each with its torch reference beside it (``reference_*``):

- :mod:`.store_kv` — write new K/V into the paged cache through ``slot_mapping``.
- :mod:`.paged_attention` — causal GQA attention over a batch mixing prefill chunks and decodes.
- :mod:`.paged_decode_attention` — split-K (flash-decoding) attention for one-token queries.
- :mod:`.rms_norm` — RMSNorm with an optional fused residual add.
- :mod:`.rotary_embedding` — neox-style RoPE, in place on q and k.
- :mod:`.silu_and_mul` — SwiGLU's ``silu(gate) * up``.

The references themselves are plain torch in :mod:`.reference`, which imports no triton: the
engine's CPU path (the ``torch`` attention backend and ``TorchOps``) runs them too. :mod:`.ops`
bundles the element-wise kernels as ``TritonOps`` for the model. Tool: :mod:`.compile_check`
compiles every kernel for a GPU target without a GPU (the engine-level greedy comparison of the
two backends is ``scripts/greedy_check.py``).

Importing this package needs nothing; importing a kernel module needs ``triton``. On a machine
without CUDA the kernels run only under ``TRITON_INTERPRET=1`` (set before the first import of
a kernel module).
"""
