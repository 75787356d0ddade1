"""exp2 approximations of the kernels (flamia_gen.numerics.exp2) and the emulator's use of them."""

import pytest
import torch

from flamia_gen.numerics.exp2 import exp2_poly3, poly_columns, poly_quarters
from flamia_gen.numerics.metrics import cosine
from flamia_gen.numerics.reference import attention
from flamia_gen.spec import get_route
from flamia_gen.spec.enums import ExpApprox


def test_poly3_relative_error_and_edges():
    x = torch.linspace(-30, 8, 200001)
    rel = exp2_poly3(x) / torch.exp2(x) - 1
    assert float(rel.abs().max()) <= 8.8e-5 and float(rel.abs().max()) > 1e-6  # an approximation
    ints = torch.arange(-20.0, 9.0)
    assert torch.equal(exp2_poly3(ints), torch.exp2(ints))  # p(0) = 1 exactly
    assert exp2_poly3(torch.tensor([float("-inf"), -200.0])).tolist() == [0.0, 0.0]


def test_poly_columns_follow_the_tile_columns():
    m = poly_columns(300, delta=6, tile_n=128, quarters=2)
    c = (torch.arange(300) + 6) % 128
    assert torch.equal(m, (c % 32) < 16)
    assert m[:10].all() and not m[10:26].any() and m[26:42].all()  # keys 0-9: columns 6-15
    assert not poly_columns(64, 0, 128, 0).any()


def test_unknown_exp_approx_is_refused():
    assert poly_quarters("ex2") == 0 and poly_quarters("poly3") == 2
    with pytest.raises(ValueError, match="poly5"):
        poly_quarters("poly5")


@pytest.mark.parametrize("route", ["bf16", "fp8_token"])
def test_poly3_route_emulation_is_close_to_ex2_but_not_equal(route):
    g = torch.Generator().manual_seed(0)
    T = 700
    q, k, v = (torch.randn(T, 2, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 200, 700], dtype=torch.int32)
    r = get_route(route)
    rp = r.model_copy(update={"exp_approx": ExpApprox.poly3})
    align = 1 if route == "bf16" else 16
    o1, l1 = attention(q, k, v, cu, True, r, key_align=align, return_lse=True)
    o2, l2 = attention(q, k, v, cu, True, rp, key_align=align, return_lse=True)
    assert not torch.equal(o1, o2)
    assert float(cosine(o1, o2)) > 0.999998
    assert float(((l1 - l2).abs() / l1.abs().clamp_min(1)).max()) < 1e-4  # l carries the polynomial too
