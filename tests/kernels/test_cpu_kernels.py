"""The CPU kernels (kernels/cpu_*.c) against their torch references: GEMV (float32, int8, int4),
decode attention over the paged cache, the element-wise ops; their refusals; and the decoder's
linear layer routing small-row products to the GEMV."""

from __future__ import annotations

import shutil

import pytest
import torch

from tokenmill.engine.models import linear as linear_mod
from tokenmill.kernels import cpu, reference


def _avx2_machine() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    return "avx2" in flags and "fma" in flags


def test_the_kernel_builds_here():
    """On an AVX2 machine with a C compiler (this project's CI) the kernel must build: a
    silent fallback would leave the small-step path untested."""
    if not (_avx2_machine() and shutil.which("cc")):
        pytest.skip("no AVX2/FMA or no C compiler: the kernel cannot build here")
    assert cpu.available(), cpu.unavailable_reason()


@pytest.mark.parametrize(
    ("m", "n", "k", "bias"),
    [
        (1, 37, 19, True),
        (2, 64, 576, False),
        (3, 130, 1536, True),
        (4, 5, 8, False),
        (1, 1, 7, True),
        (8, 70, 576, True),
        (13, 33, 27, False),
        (64, 65, 40, True),
    ],
)
def test_gemv_matches_the_reference(m, n, k, bias):
    """Row counts 1..64 (one 8-row register block, a block and a remainder of 5, eight full
    blocks), K with and without an 8-wide tail, N below and above one thread chunk; within 1e-5
    relative of the float64 reference."""
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu.gemv(x, w, b)
    want = cpu.reference_gemv(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * max(scale, 1.0)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


@pytest.fixture(params=cpu.INT8_ISAS)
def int8_loop(request):
    """Each int8 loop in turn (AVX-512 skipped where the CPU lacks it), the CPU's best after."""
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    if request.param == "avx512" and not {"avx512f", "avx512bw"} <= _cpu_flags():
        pytest.skip("no AVX512F/BW here: the AVX-512 int8 loop cannot run")
    assert cpu.int8_isa(request.param) == request.param
    yield request.param
    cpu.int8_isa(None)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 37, 32), (2, 9, 96), (3, 17, 160), (4, 130, 576), (5, 8, 32), (6, 7, 64), (7, 3, 224),
     (11, 64, 1536), (64, 9, 96)],
)  # fmt: skip
def test_gemv_int8_matches_the_reference(int8_loop, m, n, k):
    """Weight-only int8 in groups of 32 along K, each loop, for row counts 1..64 (every register
    block size, a full block and a remainder) and K that does and does not fill the loops'
    unrolled stride: within 1e-5 relative of the float64 reference (both loops widen int8 to
    float32 exactly). Every group has its own random scale, so a kernel that took one scale a
    row, or the wrong group's, is off by far more."""
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // cpu.INT8_GROUP, generator=g) / 127
    bias = torch.randn(n, generator=g)
    got = cpu.gemv_int8(x, q, scales, bias)
    want = cpu.reference_gemv_int8(x, q, scales, bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1.0)
    one_scale = cpu.reference_gemv_int8(x, q, scales[:, :1].expand_as(scales).contiguous(), bias)
    assert k == 32 or (one_scale - want).abs().max().item() > 1e-2


def test_gemv_int8_refuses_k_off_the_group_and_scales_per_row():
    """K must be a multiple of the group and the scales ``[N, K/32]``: anything else is a
    ValueError naming the shapes, before the kernel reads a byte."""
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    x = torch.randn(1, 48)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        cpu.gemv_int8(x, torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 1))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match=r"scales \(4,\)"):
        cpu.gemv_int8(x, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4))


def _int4_layer(n: int, k: int, g: torch.Generator):
    """Random int4 codes, scales and zeros of ``quantize_int4``'s scheme (one group far from
    zero, so ``z8`` matters) and their :func:`cpu.pack_int4` layout."""
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    s = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4
    z = torch.randn(n, k // 32, generator=g) * 0.02
    z[0, -1] += 3.0
    return q, s, z, *cpu.pack_int4(q, s, z)


def test_int4_layout_packs_two_codes_a_byte_and_unpacks():
    """``pack_int4``: ``qweight[b, g, p, i]`` holds row ``16 b + i``'s codes ``32 g + p`` (low
    nibble) and ``32 g + 16 + p`` (high); the scale word of that row and group holds bf16(s)
    low and bf16(z - 8 bf16(s)) high; ``unpack_int4`` gives them back."""
    g = torch.Generator().manual_seed(11)
    q, s, z, qweight, words = _int4_layer(32, 96, g)
    assert qweight.shape == (2, 3, 16, 16) and qweight.dtype == torch.uint8
    assert words.shape == (2, 3, 16) and words.dtype == torch.int32
    # row 21 = block 1, i = 5; k = 65 = group 2, p = 1
    assert qweight[1, 2, 1, 5].item() == q[21, 65].item() | q[21, 65 + 16].item() << 4
    s16 = s.bfloat16().float()
    assert (words[1, 2, 5].item() << 16) & 0xFFFFFFFF == s16[21, 2].view(torch.int32).item()
    q2, s2, z8 = cpu.unpack_int4(qweight, words)
    assert torch.equal(q2, q)
    assert torch.equal(s2, s16)
    assert torch.equal(z8, (z - 8 * s16).bfloat16().float())
    with pytest.raises(ValueError, match="K by 32"):
        cpu.pack_int4(q[:, :40], s[:, :1], z[:, :1])
    with pytest.raises(ValueError, match="N divisible by 16"):
        cpu.pack_int4(q[:20], s[:20], z[:20])


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 16, 32), (2, 32, 64), (3, 48, 96), (4, 128, 576), (5, 16, 160), (6, 16, 64),
     (7, 32, 96), (8, 48, 32), (9, 16, 64), (11, 64, 1536), (64, 16, 64)],
)  # fmt: skip
def test_gemv_int4_matches_the_reference(int8_loop, m, n, k):
    """Weight-only int4, each float32-activation loop (the int8 switch picks both): row counts
    1..64 (every register block size of both loops, full blocks and remainders), one to eight
    blocks of 16 output rows, one group to 48: within 1e-5 relative of the float64 reference
    on the unpacked weight; the kernel's dequantize equals it."""
    g = torch.Generator().manual_seed(m * 13 + n + k)
    q, s, z, qweight, words = _int4_layer(n, k, g)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    cpu.int4_act("float32")
    try:
        got = cpu.gemv_int4(x, qweight, words, bias)
    finally:
        cpu.int4_act(None)
    want = cpu.reference_gemv_int4(x, qweight, words, bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1.0)
    # and the reference is the quantized weight: q * s + z8 within bf16 of (q - 8) s + z
    exact = ((q.reshape(n, -1, 32) - 8) * s[..., None] + z[..., None]).reshape(n, k)
    w = cpu.dequantize_int4(qweight, words)
    bound = ((15 * s + z.abs() + 8 * s) * 2**-8).repeat_interleave(32, dim=1)
    assert ((w - exact).abs() <= bound).all()
    ref_w = cpu.reference_gemv_int4(torch.eye(k), qweight, words).t()
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 16, 32), (2, 32, 64), (3, 48, 96), (5, 16, 160), (8, 48, 32), (9, 16, 64),
     (11, 64, 1536), (64, 16, 64)],
)  # fmt: skip
def test_gemv_int4_on_int8_activations_matches_its_reference(m, n, k):
    """The VNNI loop (int4 codes times activations quantized to int8 per group of 32): every
    register block size and remainder, one group to 48, within 1e-5 relative of the float64
    reference that quantizes x the same way (the int32 dot products are exact); and within
    what an int8 rounding of x costs of the float32-activation result (a loop that skipped
    the zero term or took another group's scale is off by far more), yet not equal to it."""
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    if cpu.int4_act("int8") != "int8":
        cpu.int4_act(None)
        pytest.skip("no AVX-512 VNNI/VBMI here: int4 runs on float32 activations")
    g = torch.Generator().manual_seed(m * 7 + n + k)
    _, _, _, qweight, words = _int4_layer(n, k, g)
    x = torch.randn(m, k, generator=g)
    if k > 32:
        x[0, :32] = 0.0  # an all-zero group: dx 0, no division by zero
    bias = torch.randn(n, generator=g)
    try:
        got = cpu.gemv_int4(x, qweight, words, bias)
    finally:
        cpu.int4_act(None)
    want = cpu.reference_gemv_int4(x, qweight, words, bias, act="int8")
    scale = max(want.abs().max().item(), 1.0)
    assert (got - want).abs().max().item() <= 1e-5 * scale
    f32 = cpu.reference_gemv_int4(x, qweight, words, bias)
    off = (got - f32).abs().max().item() / f32.abs().max().item()
    assert 1e-6 < off < 5e-3, off
    xq, dx = cpu.quantize_act_int8(x)
    assert xq.dtype == torch.int8 and xq.abs().max().item() <= 127
    assert k == 32 or dx[0, 0].item() == 0.0


@pytest.mark.parametrize(
    ("m", "k", "qdtype", "msg"),
    [
        (65, 64, torch.uint8, "1..64 rows"),
        (1, 64, torch.int8, "qweight must be"),
        (1, 64, "flat", "qweight must be"),
        (1, 96, torch.uint8, "x has 96 columns"),
    ],
)
def test_gemv_int4_refuses_what_it_cannot_take(m, k, qdtype, msg):
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    _, _, _, qweight, words = _int4_layer(16, 64, torch.Generator().manual_seed(2))
    qweight = qweight.reshape(16, 32) if qdtype == "flat" else qweight.to(qdtype)
    with pytest.raises(ValueError, match=msg):
        cpu.gemv_int4(torch.randn(m, k), qweight, words)


def test_int8_loop_is_the_cpus_best_by_default():
    """AVX-512 where the CPU has AVX512F and BW (it widens twice the weights per instruction),
    AVX2 elsewhere; an unknown loop is refused by name."""
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    want = "avx512" if {"avx512f", "avx512bw"} <= _cpu_flags() else "avx2"
    assert cpu.int8_isa() == want
    with pytest.raises(ValueError, match="use must be one of"):
        cpu.int8_isa("sse")


def test_gemv_takes_non_contiguous_inputs():
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    x = torch.randn(16, 2)[:, :1].t()  # [1, 16], stride (1, 2)
    w = torch.randn(16, 24).t()  # [24, 16], transposed
    got = cpu.gemv(x, w)
    assert torch.allclose(got, cpu.reference_gemv(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("x", "w", "b", "msg"),
    [
        (torch.randn(65, 8), torch.randn(3, 8), None, "1..64 rows"),
        (torch.randn(1, 8), torch.randn(3, 9), None, "do not match"),
        (torch.randn(1, 8), torch.randn(3, 8), torch.randn(4), "do not match"),
        (torch.randn(1, 8).double(), torch.randn(3, 8), None, "x must be float32"),
        (torch.randn(1, 8), torch.randn(3, 8).bfloat16(), None, "weight must be float32"),
    ],
)
def test_gemv_refuses_what_it_cannot_take(x, w, b, msg):
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    with pytest.raises(ValueError, match=msg):
        cpu.gemv(x, w, b)


def test_linear_routes_small_rows_to_the_kernel(monkeypatch):
    """models/linear.py: rows within GEMV_ROWS go to the kernel (and equal F.linear), more rows
    keep torch's product."""
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    calls = []
    real = cpu.gemv

    def spy(x, w, b=None):
        calls.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(cpu, "gemv", spy)
    w, b = torch.randn(96, 64), torch.randn(96)
    lo, hi = linear_mod.GEMV_ROWS
    for m in (lo, hi, hi + 1, 40):
        x = torch.randn(m, 64)
        got = linear_mod.linear(x, w, b)
        assert torch.allclose(got, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert calls == [lo, hi]


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),  # --dtype bfloat16
        (torch.float32, torch.bfloat16),  # float32 rows rounded into a bf16 cache
    ],
)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 4)])
def test_decode_attention_matches_the_reference(window, hq, hkv, dtype, cache_dtype):
    """Three sequences of different lengths over shuffled blocks (block size 4), one with a
    -1 slot (nothing stored): the stored K/V equal the reference's store_kv exactly (a bf16
    cache: torch's round-to-nearest-even of the new rows), and the output equals the
    reference's paged_attention on one-token chunks, in float32 over the same cache
    contents, within 1e-5."""
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    g = torch.Generator().manual_seed(hq * 10 + (window or 0))
    d, bs, nb = 16, 4, 32
    lens = [7, 1, 13]
    b = len(lens)
    perm = torch.randperm(nb, generator=g).tolist()
    tables = torch.zeros((b, 4), dtype=torch.int32)
    for i, n in enumerate(lens):
        blocks = [perm.pop() for _ in range(-(-n // bs))]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    slots = torch.tensor(
        [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)]
    )
    slots[1] = -1  # padding: not stored, but still attended (over whatever the cache holds)
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
    # strided views, as the model's
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reference.store_kv(k, v, kc_ref, vc_ref, slots)
    want = reference.paged_attention(
        q.float(),
        kc_ref.float(),
        vc_ref.float(),
        torch.arange(b + 1, dtype=torch.int32),
        seq_lens,
        tables,
        1,
        max(lens),
        d**-0.5,
        window,
    )
    got = cpu.decode_attention(q, k, v, kc, vc, slots, tables, seq_lens, d**-0.5, window)
    assert got is not None
    torch.testing.assert_close(kc, kc_ref, rtol=0, atol=0)
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_declines_what_it_does_not_take():
    """float16 caches or int32 slots: None, and the caches untouched (the caller's torch path
    runs instead)."""
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    kc = torch.zeros(4, 4, 1, 8, dtype=torch.float16)
    args = (torch.tensor([0]), torch.zeros((1, 1), dtype=torch.int32))
    lens = torch.tensor([1], dtype=torch.int32)
    assert cpu.decode_attention(q, k, k, kc, kc.clone(), *args, lens, 0.3) is None
    assert not kc.any()
    kc = torch.zeros(4, 4, 1, 8)
    slots32 = torch.tensor([0], dtype=torch.int32)
    assert cpu.decode_attention(q, k, k, kc, kc.clone(), slots32, args[1], lens, 0.3) is None
    assert not kc.any()


@pytest.mark.parametrize("rows", [1, 3])
def test_cpu_ops_match_the_reference(rows):
    """Each of CpuOps' element-wise ops against kernels/reference.py (float32, within 1e-5),
    rows strided as the model passes them; RoPE works in place."""
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    g = torch.Generator().manual_seed(rows)
    h, d = 48, 16
    x = torch.randn(rows, 2 * h, generator=g)[:, :h]  # strided rows
    w = torch.randn(h, generator=g)
    torch.testing.assert_close(
        cpu.CpuOps.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5
    )
    a, r = torch.randn(rows, h, generator=g), torch.randn(rows, h, generator=g)
    got, got_res = cpu.CpuOps.fused_add_rms_norm(a, r, w, 1e-6)
    want, want_res = reference.fused_add_rms_norm(a, r, w, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    qkv = torch.randn(rows, 5 * d, generator=g)
    q, k = qkv[:, : 3 * d].view(rows, 3, d), qkv[:, 3 * d :].view(rows, 2, d)
    cos, sin = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
    want_q, want_k = reference.rotary_embedding(q.clone(), k.clone(), cos, sin)
    got_q, got_k = cpu.CpuOps.rotary(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    gu = torch.randn(rows, 2 * h, generator=g)
    torch.testing.assert_close(
        cpu.CpuOps.silu_and_mul(gu), reference.silu_and_mul(gu), rtol=1e-5, atol=1e-5
    )
    # other dtypes go to the reference unchanged
    xb = x.contiguous().bfloat16()
    torch.testing.assert_close(
        cpu.CpuOps.rms_norm(xb, w.bfloat16(), 1e-5), reference.rms_norm(xb, w.bfloat16(), 1e-5)
    )


def test_prefetch_distance_is_settable_and_leaves_the_values_alone():
    """The GEMVs' prefetch (``cpu.prefetch_ahead``) moves only when the weights arrive: off and
    at the default 2,048 bytes the products are bitwise equal; a negative distance is refused."""
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 576, generator=g)
    w = torch.randn(300, 576, generator=g)
    q = torch.randint(-127, 128, (300, 576), generator=g, dtype=torch.int8)
    s = torch.rand(300, 576 // cpu.INT8_GROUP, generator=g) / 127
    default = cpu.prefetch_ahead()
    try:
        assert cpu.prefetch_ahead(0) == 0
        off = (cpu.gemv(x, w), cpu.gemv_int8(x, q, s))
        assert cpu.prefetch_ahead(default) == default == 2048
        on = (cpu.gemv(x, w), cpu.gemv_int8(x, q, s))
    finally:
        cpu.prefetch_ahead(default)
    assert torch.equal(off[0], on[0]) and torch.equal(off[1], on[1])
    with pytest.raises(ValueError, match="nbytes must be 0 or more"):
        cpu.prefetch_ahead(-1)
