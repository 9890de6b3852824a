"""rms_norm (plain and with the fused residual add), rotary_embedding and silu_and_mul against
their torch references (``kernels.reference``, what ``TorchOps`` runs), and ``TritonOps`` as
the model's ops."""

from __future__ import annotations

import inspect

import pytest
import torch

from tokenmill.engine.model_config import RopeConfig
from tokenmill.engine.models.ops import TorchOps, get_ops
from tokenmill.engine.models.rope import RotaryEmbedding
from tokenmill.kernels import cpu
from tokenmill.kernels.ops import TritonOps
from tokenmill.kernels.rms_norm import (
    fused_add_rms_norm,
    reference_fused_add_rms_norm,
    reference_rms_norm,
    rms_norm,
)
from tokenmill.kernels.rotary_embedding import reference_rotary_embedding, rotary_embedding
from tokenmill.kernels.silu_and_mul import reference_silu_and_mul, silu_and_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32: 1e-4. 16-bit: the kernels compute in float32 and round once, the references round
# after every torch op, so results may differ by an ulp or two (bf16 ulp is 2**-7 relative).
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("hidden", [64, 576])  # 576: SmolLM2, not a power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm(hidden, dtype):
    x = randn(7, hidden, dtype=dtype, scale=3.0)
    w = randn(hidden, dtype=dtype, seed=1)
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, reference_rms_norm(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_returns_new_residual(hidden, dtype):
    x = randn(5, hidden, dtype=dtype)
    residual = randn(5, hidden, dtype=dtype, seed=2, scale=4.0)
    w = randn(hidden, dtype=dtype, seed=3)
    x_before, r_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x, residual, w, 1e-6)
    ref_normed, ref_residual = reference_fused_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(new_residual, ref_residual)  # x + residual, rounded once either way
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)  # inputs not clobbered


def test_rms_norm_float32_weight_on_bf16_rows_promotes_like_torch():
    x = randn(3, 64, dtype=torch.bfloat16)
    w = randn(64, seed=4)
    out = rms_norm(x, w, 1e-5)
    ref = reference_rms_norm(x, w, 1e-5)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_fused_qkv_views(head_dim, num_heads, num_kv_heads, dtype):
    t = 6
    qkv = randn(t, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        t, num_kv_heads, head_dim
    )
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    positions = torch.tensor([0, 1, 7, 8, 300, 4095], device=DEVICE)  # per token, unordered runs
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 8192)
    cos, sin = rope.cos_sin(positions)
    ref_q, ref_k = reference_rotary_embedding(q.clone(), k.clone(), cos, sin)
    out_q, out_k = rotary_embedding(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)  # v untouched


def test_rotary_position_zero_is_identity_and_refuses_odd_dims():
    q, k = randn(1, 2, 64), randn(1, 1, 64, seed=5)
    q0, k0 = q.clone(), k.clone()
    cos = torch.ones(1, 64, device=DEVICE)
    sin = torch.zeros(1, 64, device=DEVICE)
    rotary_embedding(q, k, cos, sin)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    with pytest.raises(ValueError, match="even"):
        rotary_embedding(randn(1, 2, 63), randn(1, 1, 63), cos[:, :63], sin[:, :63])


@pytest.mark.parametrize("inter", [100, 1536])  # 1536: SmolLM2 (two column blocks)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(inter, dtype):
    x = randn(3, 2 * inter, dtype=dtype, scale=2.0)
    out = silu_and_mul(x)
    assert out.shape == (3, inter) and out.dtype == dtype
    torch.testing.assert_close(out, reference_silu_and_mul(x), **TOL[dtype])


def test_triton_ops_has_the_torch_ops_interface():
    for name in ("rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul"):
        theirs = inspect.signature(getattr(TorchOps, name))
        for ops in (TritonOps, cpu.CpuOps):
            ours = inspect.signature(getattr(ops, name))
            assert list(ours.parameters) == list(theirs.parameters), (ops.name, name)
    assert get_ops("cpu", "triton") is TritonOps
    # on a CPU the C kernels' ops where they build, torch's otherwise
    assert get_ops("cpu", "auto") is (cpu.CpuOps if cpu.available() else TorchOps)
    assert get_ops("cpu", "torch") is TorchOps
    assert get_ops("cuda", "auto") is TritonOps
    x, w = randn(2, 64), randn(64, seed=6)
    torch.testing.assert_close(TritonOps.rms_norm(x, w, 1e-5), TorchOps.rms_norm(x, w, 1e-5))
