"""The store_kv kernel against the torch reference: slot mapping, padding, strided inputs."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.attention import SeqChunk, build_step_inputs
from tokenmill.kernels.store_kv import reference_store_kv, store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (
        torch.randn(shape, generator=gen).to(dtype).to(DEVICE),
        torch.randn(shape, generator=gen).to(dtype).to(DEVICE),
    )


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_matches_reference_and_skips_padding(head_dim, num_kv_heads, dtype):
    # a decode, a chunk that starts mid-block and crosses a block, a fresh prefill of exactly
    # one block; then two padding tokens (slot -1)
    chunks = [SeqChunk(20, 1, [5, 2]), SeqChunk(12, 7, [0, 6]), SeqChunk(0, 16, [3])]
    step = build_step_inputs(chunks, 16, DEVICE)
    slots = torch.cat([step.metadata.slot_mapping, torch.tensor([-1, -1], device=DEVICE)])
    n = slots.shape[0]
    gen = torch.Generator().manual_seed(1)
    key = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    value = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    k_cache, v_cache = caches(8, 16, num_kv_heads, head_dim, dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv(key, value, k_cache, v_cache, slots)
    reference_store_kv(key, value, k_ref, v_ref, slots)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # a copy: bit-exact
    flat_k, flat_v = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    valid = slots >= 0
    assert torch.equal(flat_k[slots[valid]], key[valid])
    assert torch.equal(flat_v[slots[valid]], value[valid])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    written[slots[valid]] = True
    untouched_k = k_before.view(-1, num_kv_heads, head_dim)[~written]
    assert torch.equal(flat_k[~written], untouched_k)  # padding and other slots left alone
    assert torch.equal(flat_v[~written], v_before.view(-1, num_kv_heads, head_dim)[~written])
    assert int(written.sum()) == 24


def test_strided_key_value_views_and_dtype_cast():
    """K and V as slices of a fused qkv projection (row stride > heads*dim), cast to bf16."""
    t, hq, hkv, d = 5, 6, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE)
    key = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    value = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    assert not key.is_contiguous()
    slots = torch.tensor([3, 17, -1, 40, 0], dtype=torch.int64, device=DEVICE)
    k_cache, v_cache = caches(3, 16, hkv, d, torch.bfloat16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    reference_store_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache.view(-1, hkv, d)[40], key[3].to(torch.bfloat16))


def test_bad_arguments_are_refused():
    k_cache, v_cache = caches(2, 16, 2, 64, torch.float32)
    key = torch.randn(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        store_kv(
            key, key, k_cache, v_cache, torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
        )
    with pytest.raises(ValueError, match="do not match"):
        store_kv(key[:, :1], key[:, :1], k_cache, v_cache, torch.tensor([0, 1, 2], device=DEVICE))
