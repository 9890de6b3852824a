"""The row count up to which the C GEMV kernels (:mod:`.cpu`) beat torch's product: the callers'
cut-over. A constant with no imports, so the planner prices steps by it without loading torch."""

# rows up to which gemv/gemv_int8 beat torch's product on the project's 2-core AVX2 VM, the
# callers' cut-over. benchmarks/step_overhead.py's GEMV pass (every weight of SmolLM2-135M once,
# streamed from memory, 2026-12-01): the kernel 47.1 ms at 8 rows and 85.9 at 16 against
# models/linear.py's W @ xᵀ at 74.4 and 76.6. Past ~12 rows the kernel is bound by its FMAs
# (one x load each), and torch's blocked GEMM does better.
FASTER_ROWS = 12
