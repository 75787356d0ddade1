"""The bf16 route's dO launch (templates/common/do_delta_body.py.j2 through sm90/quant.py.j2): no codes,
only D = rowsum(dO∘O) in the dO launch's fixed order (flamia_gen.numerics.delta.delta_bf16) and the
zeroed dQ accumulator. CPU: the plan entry, the rendered ARGS/PARAMS, the reference's order and
errors; `compile`: cross-compiles for sm_90a. On the H200 `verify --device cuda` compares D bit for
bit with delta_bf16 on every quantizer input kind (docs/perf-notes.md, round 7).
"""

from __future__ import annotations


import pytest
import torch

from flamia_gen.numerics.delta import delta_bf16
from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, rendered_literal
from flamia_gen.spec import load_specs


@pytest.fixture(scope="module")
def variants():
    plan = make_plan(load_specs(), arch="sm90")
    return [v for v in plan.variants if v.kind.value == "quant" and v.param("fmt") == "bf16"]


def test_one_do_launch_per_point_and_nothing_else(variants):
    assert sorted(v.name for v in variants) == sorted(
        f"quant_sm90_bf16_delta_d{d}_t{t}_h1" for d in (64, 128) for t in (32, 64, 128))
    for v in variants:
        src = render_variant(v)
        assert render_variant(v) == src
        args = rendered_literal(src, "ARGS")
        assert [a["name"] for a in args] == ["x", "cu_seqlens", "o", "delta", "dq_accum"]
        assert [a["role"] for a in args] == ["in", "in", "in", "out", "out"]
        p = rendered_literal(src, "PARAMS")
        assert p["fmt"] == "bf16" and p["with_delta"] is True and p["head_dim"] == v.param("head_dim")
        # the 8-bit quantizer body is not in it: no codes, no scales, no converts
        assert "codes" not in src and "cvt.rn.satfinite" not in src and "class DoDeltaSm90" in src
        # the fixed order: one mul.rn per product, add.rn left to right, a butterfly over D/16 lanes
        assert "mul.rn.f32" in src and "add.rn.f32" in src and f"group_sum(lane_dot(xw, ow), {v.param('head_dim') // 16})" in src


def test_delta_bf16_order_and_value():
    g = torch.Generator().manual_seed(0)
    do = torch.randn(37, 3, 128, generator=g).to(torch.bfloat16)
    o = torch.randn(37, 3, 128, generator=g).to(torch.bfloat16)
    d = delta_bf16(do, o)
    assert d.shape == (3, 37) and d.dtype == torch.float32
    exact = (do.double() * o.double()).sum(-1).t()
    assert torch.allclose(d.double(), exact, rtol=1e-5, atol=1e-5)
    # the contract's order, spelled out for one row: 8 lanes of 16 in order, then the butterfly
    p = (do[5, 1].float() * o[5, 1].float()).tolist()
    lanes = []
    for k in range(8):
        a = torch.tensor(p[16 * k], dtype=torch.float32)
        for i in range(1, 16):
            a = a + torch.tensor(p[16 * k + i], dtype=torch.float32)
        lanes.append(a)
    while len(lanes) > 1:
        lanes = [lanes[i] + lanes[i + 1] for i in range(0, len(lanes), 2)]
    assert d[1, 5].item() == lanes[0].item()


def test_delta_bf16_refuses_bad_inputs():
    x = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do must be a BF16"):
        delta_bf16(x.float(), x)
    with pytest.raises(ValueError, match="must match dO"):
        delta_bf16(x, torch.zeros(4, 2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="16 times a power of two"):
        delta_bf16(torch.zeros(4, 2, 96, dtype=torch.bfloat16), torch.zeros(4, 2, 96, dtype=torch.bfloat16))


@pytest.mark.compile
def test_compile(variants, compile_sm90):
    v = next(v for v in variants if v.param("head_dim") == 128 and v.param("tokens_per_cta") == 32)
    ptx = compile_sm90(v)
    assert "add.rn.f32" in ptx and "mul.rn.f32" in ptx and "shfl.sync.bfly" in ptx
