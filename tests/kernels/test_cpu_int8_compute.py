"""int8 compute's two C passes (kernels/cpu_int8_compute.c) against the torch expressions they
replace (engine/int8_compute.py): the same int8 codes and scales, bit for bit, for both terms;
the int32 sums back to float32 bit for bit; the layer's result the same with and without them;
their refusals."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine import int8_compute as ic
from tokenmill.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable here")


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 3 % k] *= 60.0  # an outlier channel, as the model's activations have
    if m > 2:
        x[1] = 0.0  # an all-zero row: the smallest scale, codes 0
    return x


@pytest.mark.parametrize(("m", "k"), [(1, 7), (3, 96), (17, 576), (130, 1536), (64, 33)])
@pytest.mark.parametrize("terms", [1, 2])
def test_quantize_gives_torchs_codes_and_scales_for_each_term(m, k, terms):
    x = _activations(m, k, m * k)
    q, s = cpu.int8_compute_quantize(x, terms)
    assert q.shape == (terms * m, k) and q.dtype == torch.int8 and s.shape == (terms * m,)
    q1, s1 = ic.quantize_rows(x)
    assert torch.equal(q[:m], q1) and torch.equal(s[:m], s1.flatten())
    if terms == 2:
        q2, s2 = ic.quantize_rows(x - q1.float() * s1)
        assert torch.equal(q[m:], q2) and torch.equal(s[m:], s2.flatten())
        assert q2.abs().max() > 0  # the second term is not empty
    assert q[:m].abs().amax(dim=1)[0] == 127  # a row's largest value maps to 127


def test_quantize_reads_strided_rows():
    wide = _activations(40, 200, 5)
    x = wide[:, 10:106]  # rows 200 floats apart
    q, s = cpu.int8_compute_quantize(x, 2)
    q_ref, s_ref = cpu.int8_compute_quantize(x.contiguous(), 2)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("acc_dtype", [torch.int32, torch.float32])
@pytest.mark.parametrize("inplace", [False, True])
def test_dequant_is_the_torch_expression_bit_for_bit(terms, bias, acc_dtype, inplace):
    g = torch.Generator().manual_seed(terms)
    m, n = 37, 130
    acc = torch.randint(-(2**24), 2**24, (terms * m, n), generator=g, dtype=torch.int32)
    s = torch.rand(terms * m, generator=g) * 1e-3
    cs = torch.rand(n, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    given = acc.clone().to(acc_dtype)
    got = cpu.int8_compute_dequant(given, s, cs, b, terms, inplace=inplace)
    assert (got.data_ptr() == given.data_ptr()) == inplace
    ref = acc[:m].to(torch.float32).mul_(s[:m, None])
    if terms == 2:
        ref.add_(acc[m:].to(torch.float32).mul_(s[m:, None]))
    ref.mul_(cs)
    if b is not None:
        ref.add_(b)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("terms", [1, 2])
def test_int8_linear_gives_the_same_result_with_and_without_the_c_passes(terms, monkeypatch):
    g = torch.Generator().manual_seed(7)
    x = _activations(50, 576, 3)
    w = torch.randint(-127, 128, (576, 96), generator=g, dtype=torch.int8)
    cs, b = torch.rand(96, generator=g) * 0.01, torch.randn(96, generator=g)
    with_c = ic.int8_linear(x, w, cs, b, terms)
    monkeypatch.setattr(cpu, "available", lambda: False)
    without = ic.int8_linear(x, w, cs, b, terms)
    assert torch.equal(with_c, without)


@pytest.mark.parametrize(
    ("call", "msg"),
    [
        (lambda: cpu.int8_compute_quantize(torch.zeros(4, 8, dtype=torch.float64), 1), "float32"),
        (lambda: cpu.int8_compute_quantize(torch.zeros(4, 8), 3), "terms"),
        (lambda: cpu.int8_compute_quantize(torch.zeros(4, 8).t(), 1), "unit column stride"),
        (
            lambda: cpu.int8_compute_dequant(
                torch.zeros(5, 4, dtype=torch.int32), torch.zeros(5), torch.zeros(4), None, 2
            ),
            "terms",
        ),
        (
            lambda: cpu.int8_compute_dequant(
                torch.zeros(4, 4, dtype=torch.int32), torch.zeros(4), torch.zeros(3), None, 1
            ),
            "col_scales",
        ),
    ],
)
def test_the_passes_refuse_what_they_cannot_take(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()
