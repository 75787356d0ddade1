"""Accuracy metrics: values, fp64 accumulation, zero conventions and NaN poisoning."""

import math

import pytest
import torch

from flamia_gen.numerics.metrics import cosine, max_rel_change, rel_error, sqnr_db


def test_cosine_values():
    a = torch.tensor([1.0, 0.0, 0.0])
    assert cosine(a, a) == pytest.approx(1.0, abs=1e-15)
    assert cosine(a, -a) == pytest.approx(-1.0, abs=1e-15)
    assert cosine(a, torch.tensor([0.0, 2.0, 0.0])) == 0.0
    assert cosine(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == pytest.approx(1 / math.sqrt(2), abs=1e-15)
    assert isinstance(cosine(a, a), float)
    # shapes are flattened
    x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(0))
    assert cosine(x, 3 * x) == pytest.approx(1.0, abs=1e-12)


def test_cosine_is_fp64():
    # 1 - cos ≈ 5e-9: below fp32 resolution of the result, resolved in fp64
    g = torch.Generator().manual_seed(1)
    a = torch.randn(100_000, generator=g)
    b = a + 1e-4 * torch.randn(100_000, generator=g)
    ad, bd = a.double(), b.double()
    want = float((ad @ bd) / (ad.norm() * bd.norm()))
    assert abs(cosine(a, b) - want) < 1e-14
    assert cosine(a, b) < 1.0


def test_nan_and_inf_poison_every_metric():
    a = torch.randn(1000)
    b = a.clone()
    for bad in (math.nan, math.inf, -math.inf):
        c = a.clone()
        c[500] = bad
        for args in ((c, b), (b, c)):
            cs = cosine(*args)
            assert math.isnan(cs)
            assert not (cs >= 0.99) and not (cs <= 1.0)  # never passes a threshold
            assert math.isnan(rel_error(*args))
            assert math.isnan(sqnr_db(*args))
            assert math.isnan(max_rel_change(*args))


def test_rel_error():
    b = torch.tensor([3.0, 4.0])
    assert rel_error(b * 1.01, b) == pytest.approx(0.01, rel=1e-6)
    assert rel_error(torch.tensor([3.0, 5.0]), b) == pytest.approx(1 / 5, rel=1e-12)
    assert rel_error(b, b) == 0.0
    z = torch.zeros(2)
    assert rel_error(z, z) == 0.0
    assert rel_error(b, z) == math.inf
    assert rel_error(z, b) == 1.0
    with pytest.raises(ValueError, match="same shape"):
        rel_error(torch.zeros(2), torch.zeros(3))


def test_sqnr_db():
    g = torch.Generator().manual_seed(2)
    ref = torch.randn(10_000, generator=g)
    noise = torch.randn(10_000, generator=g)
    noise = noise / noise.norm() * ref.norm() * 0.1  # noise power 1 % of signal power
    assert sqnr_db(ref + noise, ref) == pytest.approx(20.0, abs=1e-4)
    assert sqnr_db(ref, ref) == math.inf
    assert sqnr_db(ref, torch.zeros_like(ref)) == -math.inf


def test_max_rel_change_rows_and_zero_conventions():
    b = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [3.0, 4.0]])
    a = b.clone()
    assert max_rel_change(a, b) == 0.0
    a[1, 1] = 2.25  # row 1 changes by 12.5 %
    assert max_rel_change(a, b) == 0.125
    a[3] = torch.tensor([3.0, 4.5])  # row 3 by 0.5 / 5 = 10 %: 0.125 stays the max
    assert max_rel_change(a, b) == 0.125
    a[3] = torch.tensor([3.0, 5.0])  # now 20 %
    assert max_rel_change(a, b) == pytest.approx(0.2, rel=1e-12)
    # the both-zero row counts as 0, a zero reference row that moves as inf
    assert max_rel_change(a, b, rows=[2]) == 0.0
    a[2, 0] = 1e-30
    assert max_rel_change(a, b) == math.inf
    # row selection: index list, tensor, bool mask, slice
    assert max_rel_change(a, b, rows=[0, 1]) == 0.125
    assert max_rel_change(a, b, rows=torch.tensor([1, 3])) == pytest.approx(0.2, rel=1e-12)
    assert max_rel_change(a, b, rows=torch.tensor([True, True, False, False])) == 0.125
    assert max_rel_change(a, b, rows=slice(0, 1)) == 0.0
    assert max_rel_change(a, b, rows=torch.zeros(4, dtype=torch.bool)) == 0.0  # no rows
    # NaN outside the selected rows does not matter, inside it does
    a[0, 0] = math.nan
    assert max_rel_change(a, b, rows=[1]) == 0.125
    assert math.isnan(max_rel_change(a, b, rows=[0, 1]))


def test_max_rel_change_rows_are_dim0_flattened():
    g = torch.Generator().manual_seed(3)
    b = torch.randn(6, 2, 8, generator=g)
    a = b.clone()
    a[4, 1] += 0.5 * b[4, 1]  # half of the row's second head
    want = float((a[4].double() - b[4].double()).norm() / b[4].double().norm())
    assert want == pytest.approx(float(0.5 * b[4, 1].norm() / b[4].norm()), rel=1e-6)
    assert max_rel_change(a, b) == pytest.approx(want, rel=1e-12)
    # tiny relative changes are resolved (fp64): one bf16-ish ulp in a large row
    a2 = b.clone()
    a2[0, 0, 0] = torch.nextafter(b[0, 0, 0], torch.tensor(math.inf))
    assert max_rel_change(a2, b) > 0.0
