"""The mixed prefill/decode paged-attention kernel and the split-K decode kernel against their
torch reference (the torch backend's attention), under TRITON_INTERPRET=1 on a CPU or compiled
on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.engine.attention import SeqChunk, build_step_inputs
from tokenmill.kernels.paged_attention import paged_attention, reference_paged_attention
from tokenmill.kernels.paged_decode_attention import paged_decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 must agree to 1e-4. 16-bit: the reference rounds only its output, the kernels also
# round the softmax weights to the input dtype before the P·V product (on CUDA), so allow a few
# output ulps (values here are below ~3 in magnitude).
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}
# GQA ratios 1, 3 (SmolLM2's 9 query heads on 3 KV heads) and 4
HEADS = [(4, 4), (9, 3), (8, 2)]
# a 1-token decode over 20 cached tokens, a 7-token chunk starting mid-block (12 cached, so it
# crosses from block 0 into block 1), a fresh 33-token prefill (non-power-of-two context)
MIXED = [(20, 1), (12, 7), (0, 33)]


def paged_case(specs, num_heads, num_kv_heads, head_dim, block_size=16, dtype=torch.float32):
    """Random paged K/V for sequences ``specs = [(cached, new), ...]`` on shuffled blocks, and
    random queries for the new tokens. Every slot of the cache, used or not, holds random
    values, so a kernel reading a wrong slot cannot go unnoticed."""
    gen = torch.Generator().manual_seed(1234 + 7 * len(specs) + head_dim + num_heads)
    need = [-(-(c + n) // block_size) for c, n in specs]
    ids = list(range(sum(need) + 2))  # two blocks nobody owns
    random.Random(len(specs) + head_dim).shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    shape = (len(ids), block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    step = build_step_inputs(
        [SeqChunk(c, n, t) for (c, n), t in zip(specs, tables)], block_size, DEVICE
    )
    num_tokens = sum(n for _, n in specs)
    query = torch.randn((num_tokens, num_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    return query, k_cache, v_cache, step.metadata


def step_args(meta):
    """The kernels' step arguments (tensors and sizes) out of the engine's metadata."""
    return (
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.max_query_len,
        meta.max_seq_len,
    )


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_mixed_batch_matches_reference(head_dim, num_heads, num_kv_heads):
    q, kc, vc, meta = paged_case(MIXED, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    out = paged_attention(q, kc, vc, *step_args(meta), scale)
    ref = reference_paged_attention(q, kc, vc, *step_args(meta), scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize(
    ("block_m", "block_n"),
    [(16, 16), (32, 64), (64, 32)],  # several query blocks per sequence; key tiles = / > a block
)
@pytest.mark.parametrize("window", [None, 5, 24])
def test_tiles_and_sliding_window(block_m, block_n, window):
    specs = [(20, 1), (12, 7), (0, 33), (0, 16), (15, 1)]  # the last two: exactly one block
    q, kc, vc, meta = paged_case(specs, 9, 3, 64)
    out = paged_attention(
        q, kc, vc, *step_args(meta), 0.125, window, block_m=block_m, block_n=block_n
    )
    ref = reference_paged_attention(q, kc, vc, *step_args(meta), 0.125, window)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_16_bit(dtype):
    q, kc, vc, meta = paged_case(MIXED, 8, 2, 128, dtype=dtype)
    out = paged_attention(q, kc, vc, *step_args(meta), 128**-0.5)
    ref = reference_paged_attention(q, kc, vc, *step_args(meta), 128**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_attention_really_depends_on_the_paged_context():
    """Changing one cached key of one sequence must move exactly that sequence's output."""
    q, kc, vc, meta = paged_case(MIXED, 4, 4, 64)
    before = paged_attention(q, kc, vc, *step_args(meta), 0.125)
    block = int(meta.block_tables[1, 0])  # sequence 1, position 3 (cached, visible to all rows)
    kc[block, 3] += 5.0
    after = paged_attention(q, kc, vc, *step_args(meta), 0.125)
    starts = meta.query_start_loc_host
    assert not torch.allclose(before[starts[1] : starts[2]], after[starts[1] : starts[2]])
    torch.testing.assert_close(before[: starts[1]], after[: starts[1]], atol=0, rtol=0)
    torch.testing.assert_close(before[starts[2] :], after[starts[2] :], atol=0, rtol=0)


# ---- split-K decode ------------------------------------------------------------------------

# one-token queries over contexts of 1, exactly one block, non-power-of-two, and several blocks
DECODE = [(0, 1), (15, 1), (36, 1), (99, 1)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("partition_size", [None, 32])  # one split (direct) / up to four
def test_decode_matches_reference(head_dim, num_heads, num_kv_heads, partition_size):
    q, kc, vc, meta = paged_case(DECODE, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, kc, vc, *step_args(meta), scale, partition_size=partition_size)
    ref = reference_paged_attention(q, kc, vc, *step_args(meta), scale)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("window", [7, 40])
@pytest.mark.parametrize(("partition_size", "block_n"), [(32, 16), (64, 32)])
def test_decode_sliding_window_and_split_shapes(window, partition_size, block_n):
    q, kc, vc, meta = paged_case(DECODE, 9, 3, 64)
    out = paged_decode_attention(
        q, kc, vc, *step_args(meta), 0.125, window, partition_size=partition_size, block_n=block_n
    )
    ref = reference_paged_attention(q, kc, vc, *step_args(meta), 0.125, window)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_16_bit(dtype):
    q, kc, vc, meta = paged_case(DECODE, 8, 2, 128, dtype=dtype)
    out = paged_decode_attention(q, kc, vc, *step_args(meta), 128**-0.5, partition_size=32)
    ref = reference_paged_attention(q, kc, vc, *step_args(meta), 128**-0.5)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_decode_agrees_with_the_mixed_kernel():
    q, kc, vc, meta = paged_case(DECODE, 9, 3, 64)
    split = paged_decode_attention(q, kc, vc, *step_args(meta), 0.125, partition_size=32)
    mixed = paged_attention(q, kc, vc, *step_args(meta), 0.125)
    torch.testing.assert_close(split, mixed, **TOL[torch.float32])


def test_bad_inputs_are_refused():
    q, kc, vc, meta = paged_case(MIXED, 9, 3, 64)
    with pytest.raises(ValueError, match="one token per sequence"):
        paged_decode_attention(q, kc, vc, *step_args(meta), 0.125)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(q[:, :8], kc, vc, *step_args(meta), 0.125)
    with pytest.raises(ValueError, match="cache dtype"):
        paged_attention(q.double(), kc, vc, *step_args(meta), 0.125)
    dq, dkc, dvc, dmeta = paged_case(DECODE, 9, 3, 64)
    with pytest.raises(ValueError, match="multiple of block_n"):
        paged_decode_attention(
            dq, dkc, dvc, *step_args(dmeta), 0.125, partition_size=48, block_n=32
        )


def test_bad_tiles_are_refused():
    q, kc, vc, meta = paged_case(MIXED, 9, 3, 64)
    with pytest.raises(ValueError, match="block_m 8"):
        paged_attention(q, kc, vc, *step_args(meta), 0.125, block_m=8)
    with pytest.raises(ValueError, match="block_n 48"):
        paged_attention(q, kc, vc, *step_args(meta), 0.125, block_n=48)
    dq, dkc, dvc, dmeta = paged_case(DECODE, 9, 3, 64)
    with pytest.raises(ValueError, match="block_n 48"):
        paged_decode_attention(
            dq, dkc, dvc, *step_args(dmeta), 0.125, partition_size=96, block_n=48
        )
