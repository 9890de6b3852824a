"""The decoder's dense linear layer, with the matmul a small CPU step runs fastest.

On this project's CPU (torch 2.13, float32, 2 threads; ``benchmarks/RESULTS.md``, "Speculative
decoding"), ``F.linear`` on a few rows is far from the memory-bandwidth floor: 2-64 rows of
SmolLM2's gate/up projection take 345-1,029 µs against 159 µs for one row, and the 49,152-wide
LM head takes 20.7 ms for 2 rows against 8.7 ms for one. Computed the other way round,
``W @ xᵀ``, the same products take 235-840 µs and 5.3 ms, and a single row through the LM head
is faster padded to two (5.1 ms). Those are the shapes of decode steps at small batch and of
speculative verification (1 + K rows per request), so this module picks the formulation by
row count; prefill chunks and other devices and dtypes keep ``F.linear``.

A single row (a batch-1 decode step) also goes through ``W @ xᵀ``, padded to two rows. Timed
one layer at a time with the weight hot in cache, one row via ``F.linear`` looked fastest; but a
real step streams 538 MB of weights from memory, and over a pass of all 121 weight matrices of
SmolLM2-135M (``benchmarks/step_overhead.py``, "GEMV pass") one row via ``F.linear``
(MKL's GEMV) reads 14.4 GB/s and takes ~36 ms, the same row padded to two through ``W @ xᵀ``
~25 ms (~21 GB/s): single-stream ITL 49 -> 42 ms.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.kernels import cpu as cpu_gemv

__all__ = ["Linear", "linear"]

# rows that go to our AVX2 GEMV kernel (kernels/cpu_gemv.c) when it is available
GEMV_ROWS = (1, cpu_gemv.FASTER_ROWS)
# rows for which W @ xᵀ beats F.linear here (measured 2..64; at 128 they tie, at 256 it loses)
TRANSPOSED_ROWS = (2, 64)
# a single row through a layer at least this wide runs padded to two rows: every layer (until
# 2026-12-01 only the LM head, 16,384; benchmarks/step_overhead.py's "before")
PAD_ONE_ROW_OUT_FEATURES = 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` float32 on CPU, ``weight [N, K]``, ``bias [N]`` → ``[M, N]`` (contiguous),
    the same product as ``F.linear`` computed as ``(W @ xᵀ)ᵀ`` where that is faster (see the
    module docstring). Any other input goes to ``F.linear`` unchanged."""
    if x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    m = x.shape[0]
    if GEMV_ROWS[0] <= m <= GEMV_ROWS[1] and cpu_gemv.available():
        return cpu_gemv.gemv(x, weight, bias)
    if m == 1 and weight.shape[0] >= PAD_ONE_ROW_OUT_FEATURES:
        out = torch.mm(weight, torch.cat((x, x)).t())[:, :1].t().contiguous()
    elif TRANSPOSED_ROWS[0] <= m <= TRANSPOSED_ROWS[1]:
        out = torch.mm(weight, x.t()).t().contiguous()
    else:
        return F.linear(x, weight, bias)
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (same parameters, state dict and
    quantization: ``quantize_model`` replaces it like any ``nn.Linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
