"""dQ's softmax scale left to the dQ conversion (flag `bwd_dq_scale_late`; templates/sm90/attn_bwd.py.j2;
docs/kernels/attn_bwd.md "SASS of FA4's sm90 backward against ours"): the bf16 route's dQ partial is reduce-added
without its multiply by the softmax scale (FA4's tile does the same and scales in its post-processing), and
`runtime.attn_bwd.dq_from_accum` multiplies once while it converts dq_accum to BF16. Since the forty-first session
also the per-token dQ-on-BF16 tiles with dO's factor folded (`bwd_dof_fold`: fp8_token, fp8_token_bf16qk), whose
row factor softmax_scale·2^edo is the same for every key tile: the conversion builds it from dO's scale codes.
Since round 45 the default of fp8_token's D = 128 non-deterministic tile, with bwd_sdp_split and bwd_dq_convert (the
call's own conversion launch applies the factor); off elsewhere.

CPU: on in exactly those two default renders; on, the tiles' dQ partial loses exactly its multiply (every dQ store path:
the writer warp's staging stores and the direct reduce-adds) and the params say so, so the runtime scales; refused on
the other FP8 tiles (their row factor changes with the key tile's dS scale group). The conversion: one fp32
multiply, one rounding to BF16, in natural order for a chunk-swizzled accumulator; the FP8 row factor has the
producer's bits for every code (0, the NaN code 255). `-m compile`: the sm_90a PTX has 32 multiplies a tile copy
fewer.
"""

from __future__ import annotations

import re

import jinja2
import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.runtime.attn_bwd import dq_accum_natural, dq_from_accum
from flamia_gen.spec import load_specs
from kernel_source import one_tile

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
BF16 = [v for v in BWD if v.route == "bf16"]
DOF = [v for v in BWD if v.route in ("fp8_token", "fp8_token_bf16qk")]  # the bwd_dof_fold tiles
SCALED = ("acc_dQ[2 * j] * f", "acc_dQ[2 * j + 1] * f")


# fp8_token's D = 128 non-deterministic tiles, causal or not: the late scale with the split and the call's conversion
FP8T = [v for v in BWD if v.route == "fp8_token" and v.param("head_dim") == 128
        and not dict(v.params).get("deterministic")]


def test_on_by_default_only_on_fp8_tokens_d128_tile():
    assert len(FP8T) == 2
    for v in BWD:
        p = rendered_params(render_variant(v))
        assert (p.get("bwd_dq_scale_late") is True) is (v in FP8T), v.name
        if v in FP8T:
            assert p["bwd_sdp_split"] is True and p["bwd_dq_convert"] is True


@pytest.mark.parametrize("v", BF16 + DOF, ids=lambda v: v.name)
def test_tiles_lose_exactly_the_partial_multiply(v):
    off, on = one_tile(render_with_flags(v, bwd_dq_scale_late=False)), render_with_flags(v, bwd_dq_scale_late=True)
    assert rendered_params(on)["bwd_dq_scale_late"] is True
    tile = one_tile(on)
    assert any(s in off for s in SCALED), v.name  # the default scales each partial ...
    assert not any(s in tile for s in SCALED), v.name  # ... the flag scales none
    # the partials still reach dq_accum (staging stores or reduce-adds), unscaled
    assert "v2[0] = acc_dQ[2 * j]  #" in tile or "red_add_v2_f32(mdQacc.iterator + off, acc_dQ[2 * j], acc_dQ[2 * j + 1])" in tile
    # nothing else in the tile changes: removing the flag's lines from `on` gives `off` less the multiplies
    assert tile.replace("  # bwd_dq_scale_late: the runtime scales dq_accum once", "").count("acc_dQ[2 * j]") \
        == off.count("acc_dQ[2 * j]")


def test_dof_fold_tiles_are_the_fp8_tiles_it_builds_on():
    assert len(DOF) == 16  # fp8_token and fp8_token_bf16qk: D = 64 and 128, causal or not, _det or not
    assert all(rendered_params(render_variant(v)).get("bwd_dof_fold") is True for v in DOF)


@pytest.mark.parametrize("route", ["fp8_pv", "mxfp8", "mxfp8_exact", "fp8_tensor", "nvfp4_mixed"])
def test_refused_on_other_fp8_routes(route):
    v = next(x for x in BWD if x.route == route)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dq_scale_late"):
        render_with_flags(v, bwd_dq_scale_late=True)


def test_conversion_scales_once_in_fp32_then_rounds():
    g = torch.Generator().manual_seed(0)
    acc = torch.randn(37, 4, 64, generator=g) * 3
    scale = 128 ** -0.5
    got = dq_from_accum(acc, {"bwd_dq_scale_late": True}, scale)
    assert got.dtype == torch.bfloat16 and got.shape == acc.shape
    assert torch.equal(got, (acc * scale).to(torch.bfloat16))
    assert not torch.equal(got, acc.to(torch.bfloat16))  # the scale was applied
    # without the flag the accumulator already carries the scale: a plain rounding
    assert torch.equal(dq_from_accum(acc, {}, scale), acc.to(torch.bfloat16))


def test_fp8_row_factor_has_the_producers_bits():
    from flamia_gen.runtime.attn_bwd import dq_row_factor

    codes = torch.tensor([[0, 1, 100, 127], [130, 200, 254, 255]], dtype=torch.uint8)
    scale = 128 ** -0.5
    got = dq_row_factor(codes, scale)
    assert got.dtype == torch.float32
    want = [[0.0, 2.0 ** -126 * scale, 2.0 ** -27 * scale, scale], [8 * scale, 2.0 ** 73 * scale, 2.0 ** 127 * scale,
                                                                   scale]]
    assert torch.equal(got, torch.tensor(want, dtype=torch.float32))  # 255: a NaN dO row keeps factor 1


def test_fp8_conversion_applies_the_row_factor_per_token_and_head():
    from flamia_gen.runtime.attn_bwd import dq_row_factor

    g = torch.Generator().manual_seed(2)
    acc = torch.randn(19, 3, 64, generator=g) * 5
    codes = torch.randint(110, 140, (19, 3), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[4, 1] = 255
    p = {"bwd_dq_scale_late": True, "do_fmt": "e4m3"}
    got = dq_from_accum(acc, p, 0.125, codes)
    want = (acc * dq_row_factor(codes, 0.125)[..., None]).to(torch.bfloat16)
    assert torch.equal(got, want)
    # row (4, 1) took factor 0.125 (code 255), row (0, 0) 2^(code − 127)·0.125
    assert torch.equal(got[4, 1], (acc[4, 1] * 0.125).to(torch.bfloat16))
    e = int(codes[0, 0]) - 127
    assert torch.equal(got[0, 0], (acc[0, 0] * (2.0 ** e * 0.125)).to(torch.bfloat16))
    with pytest.raises(ValueError, match="do_scale"):
        dq_from_accum(acc, p, 0.125)


def test_conversion_of_a_chunk_swizzled_accumulator():
    acc = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(1))
    p = {"bwd_dq_tile_copy": True}
    assert torch.equal(dq_from_accum(acc, p, 0.3), dq_accum_natural(acc, torch.bfloat16))
    assert torch.equal(dq_from_accum(acc, {**p, "bwd_dq_scale_late": True}, 0.3),
                       (dq_accum_natural(acc) * 0.3).to(torch.bfloat16))


def test_ab_tag_builds_on_the_bf16_and_dof_fold_tiles_only():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("fp8_token", "bf16", "fp8_pv", "mxfp8"), head_dim=128)
    got = [v for t, v in experiment_variants(("dqsl",), base_variants=bwd, experiments=EXPERIMENTS) if t == "dqsl"]
    assert got and {v.route for v in got} == {"bf16", "fp8_token"}
    # every bf16 and fp8_token tile but fp8_token's two that have it by default (round 45)
    assert len(got) == sum(1 for v in bwd if v.route in ("bf16", "fp8_token")) - 2
    assert not {v.name for v in got} & {v.name + "_xdqsl" for v in FP8T}
    assert all(dict(v.params).get("bwd_dq_scale_late") is True for v in got)


@pytest.mark.compile
@pytest.mark.parametrize("route,fewer", [("bf16", 64), ("fp8_token", 68)])
def test_compile_drops_the_partial_multiplies(compile_sm90, route, fewer):
    """D = 128 causal: the flag's PTX has 32 fp32 multiplies a tile copy fewer (the dQ partial of the thread's 32
    accumulator words) × the tile's two copies (interior and masked); on fp8_token also the two rows' softmax_scale ×
    2^edo a copy. No other arithmetic changes count."""
    v = next(x for x in BF16 + DOF if x.route == route and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))

    def counts(ptx):
        return {op: len(re.findall(rf"^\s*{re.escape(op)}\s", ptx, re.M))
                for op in ("mul.f32", "mul.rn.f32", "sub.f32", "ex2.approx.ftz.f32")}
    # without the call's own conversion (its multiplies are the factor's), and fp8_token's tile fused as before round
    # 45 (its default since is the split with both flags: test_attn_bwd_sdp_split.py)
    rest = dict(bwd_dq_convert=False, **({"bwd_sdp_split": False} if route == "fp8_token" else {}))
    on = counts(compile_sm90(v, source=render_with_flags(v, bwd_dq_scale_late=True, **rest)))
    off = counts(compile_sm90(v, source=render_with_flags(v, bwd_dq_scale_late=False, **rest)))
    muls = (off["mul.f32"] + off["mul.rn.f32"]) - (on["mul.f32"] + on["mul.rn.f32"])
    assert muls == fewer, (on, off)
    assert off["sub.f32"] > 0 and off["ex2.approx.ftz.f32"] == 64  # the softmax and dS arithmetic is there ...
    assert (on["sub.f32"], on["ex2.approx.ftz.f32"]) == (off["sub.f32"], off["ex2.approx.ftz.f32"])  # ... unchanged
