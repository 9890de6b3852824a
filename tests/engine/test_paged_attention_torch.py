"""The paged layout and the torch backend against a dense, unpaged attention computed here."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.attention import SeqChunk, build_step_inputs
from tokenmill.engine.attention.torch_backend import TorchAttentionBackend, store_kv


def test_metadata_for_a_mixed_step():
    # a decode (7 cached + 1), a chunk starting mid-block (3 cached + 6), a fresh 5-token prefill
    chunks = [SeqChunk(7, 1, [4, 2]), SeqChunk(3, 6, [0, 5, 9]), SeqChunk(0, 5, [1, 3])]
    step = build_step_inputs(chunks, block_size=4)
    m = step.metadata
    assert m.query_start_loc.tolist() == [0, 1, 7, 12]
    assert m.seq_lens.tolist() == [8, 9, 5]
    assert m.block_tables.tolist() == [[4, 2, 0], [0, 5, 9], [1, 3, 0]]
    assert m.query_start_loc.dtype == m.seq_lens.dtype == m.block_tables.dtype == torch.int32
    assert m.slot_mapping.dtype == torch.int64
    # seq 0 pos 7 -> block 2 off 3; seq 1 pos 3..8 -> blocks 0,5,5,5,5,9; seq 2 pos 0..4 -> 1,1,1,1,3
    assert m.slot_mapping.tolist() == [11, 3, 20, 21, 22, 23, 36, 4, 5, 6, 7, 12]
    assert step.positions.tolist() == [7, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4]
    assert step.last_token_indices.tolist() == [0, 6, 11]
    assert (m.max_query_len, m.max_seq_len) == (6, 9)


def test_block_table_too_short_is_refused():
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        build_step_inputs([SeqChunk(4, 5, [0, 1])], block_size=4)


def test_store_kv_skips_padding_slots():
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key = torch.randn(3, 2, 8)
    value = torch.randn(3, 2, 8)
    store_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 11]))
    flat_k, flat_v = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    torch.testing.assert_close(flat_k[5], key[0])
    torch.testing.assert_close(flat_v[11], value[2])
    written = torch.zeros(12, dtype=torch.bool)
    written[[5, 11]] = True
    assert flat_k[~written].abs().sum() == 0  # the padded token went nowhere


def dense_reference(q, k, v, n_cached, window=None):
    """Unpaged causal GQA over one sequence's full K/V ``[L, Hkv, D]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    qpos = torch.arange(n_cached, n_cached + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 5])
def test_backend_equals_dense_attention_on_a_mixed_batch(window):
    torch.manual_seed(0)
    hq, hkv, d, bs = 6, 2, 16, 4
    # (cached, new): a decode, a chunk crossing blocks from mid-block, a fresh prefill, a decode
    # (these four share the batched short-chunk path, padded to 11 queries), a decode verifying
    # 4 drafts, and a 20-token chunk (longer than SHORT_CHUNK: the reference path)
    shapes = [(9, 1), (3, 7), (0, 11), (4, 1), (6, 5), (2, 20)]
    tables = [[7, 1, 10], [2, 8, 0], [3, 9, 5], [4, 6], [11, 12, 13], [14, 15, 16, 17, 18, 19]]
    k_cache = torch.zeros(20, bs, hkv, d)
    v_cache = torch.zeros(20, bs, hkv, d)
    full_k = [torch.randn(c + n, hkv, d) for c, n in shapes]
    full_v = [torch.randn(c + n, hkv, d) for c, n in shapes]
    # pre-fill the cached part
    for (c, _), t, k, v in zip(shapes, tables, full_k, full_v):
        if c:
            pre = build_step_inputs([SeqChunk(0, c, t)], bs).metadata.slot_mapping
            store_kv(k[:c], v[:c], k_cache, v_cache, pre)
    step = build_step_inputs([SeqChunk(c, n, t) for (c, n), t in zip(shapes, tables)], bs)
    q = torch.randn(sum(n for _, n in shapes), hq, d)
    new_k = torch.cat([k[c:] for (c, _), k in zip(shapes, full_k)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(shapes, full_v)])
    out = TorchAttentionBackend().forward(
        q, new_k, new_v, k_cache, v_cache, step.metadata, d**-0.5, window
    )
    starts = step.metadata.query_start_loc_host
    for i, (c, _) in enumerate(shapes):
        ref = dense_reference(q[starts[i] : starts[i + 1]], full_k[i], full_v[i], c, window)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], ref, atol=1e-5, rtol=1e-5)
