"""The Sᵀ wait split from the dPᵀ wait on the bf16 tile (flag `bwd_sdp_split`, experiment, off; forty-first session;
templates/sm90/attn_bwd.py.j2; docs/perf-notes.md round 41): P and dV's issue while dPᵀ runs, dS while dV runs.

CPU: off in every default render; on, one_tile waits for Sᵀ alone (wait_group(1)), computes P, issues dV, waits for
dPᵀ with dV in flight (wait_group(1)) and only then reads dPᵀ for dS; masked pairs are zeroed in both passes (a
masked pair's dPᵀ may be NaN); refused on the FP8 routes and without mask-free interior tiles. `-m compile`: no wgmma
serialised, no stack.
"""

from __future__ import annotations

import re

import jinja2
import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
BF16 = [v for v in BWD if v.route == "bf16"]


def _one_tile(src: str) -> str:
    start = src.index("    def one_tile(")
    return src[start:src.index("\n    @cute.jit", start)]


def test_off_by_default_everywhere():
    for v in BWD:
        assert "bwd_sdp_split" not in rendered_params(render_variant(v)), v.name


@pytest.mark.parametrize("v", BF16, ids=lambda v: v.name)
def test_the_order_of_waits_and_passes(v):
    src = render_with_flags(v, bwd_sdp_split=True)
    assert rendered_params(src)["bwd_sdp_split"] is True
    t = _one_tile(src)
    s_issue = t.index("self.gemm(tiled_mma_sdp, acc_S,")
    dp_issue = t.index("self.gemm(tiled_mma_sdp, acc_dP,")
    w1 = t.index("warpgroup.wait_group(1)", dp_issue)
    p_pass = t.index("p = ex2(acc_S[i] * scale_log2 - lse2[cp])")
    dv = t.index("self.gemm(tiled_mma_dkv, acc_dV, tdVrP,")
    w2 = t.index("warpgroup.wait_group(1)", dv)
    ds_pass = t.index("ds = acc_S[i] * (acc_dP[i] - dl[cp])")
    assert s_issue < dp_issue < w1 < p_pass < dv < w2 < ds_pass
    assert "acc_dP" not in t[w1:w2]  # dPᵀ's accumulator is not touched before its wait
    # masked pairs are zeroed in both passes (the dS pass never relies on P = 0 times a NaN dPᵀ)
    assert t.count("p = Float32(0.0)") == 1 and t.count("ds = Float32(0.0)") == 1
    assert t[p_pass:dv].count("outdoc = ") == 1 and t[ds_pass:].count("outdoc = ") >= 1
    if v.param("causal"):
        assert t[p_pass:dv].count("kk > qq") == 1 and t[ds_pass:].count("kk > qq") >= 1
    # the flag's block replaces the fused pass: one ex2 pass, one dV issue
    assert t.count("p = ex2(") == 1 and t.count("self.gemm(tiled_mma_dkv, acc_dV,") == 1


@pytest.mark.parametrize("route", ["fp8_token", "fp8_pv", "mxfp8", "fp8_tensor"])
def test_refused_on_fp8_routes(route):
    v = next(x for x in BWD if x.route == route)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_sdp_split"):
        render_with_flags(v, bwd_sdp_split=True)


def test_refused_without_mask_free_interior_tiles():
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_sdp_split"):
        render_with_flags(BF16[0], bwd_sdp_split=True, bwd_interior_nomask=False)


def test_ab_tags():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("fp8_token", "bf16"), head_dim=128)
    got = [(t, v) for t, v in experiment_variants(("split", "splitdqf"), base_variants=bwd, experiments=EXPERIMENTS)
           if t]  # "" tags the base variants the copies are compared with
    assert {t for t, _ in got} == {"split", "splitdqf"} and all(v.route == "bf16" for _, v in got)
    assert len(got) == 2 * sum(1 for v in bwd if v.route == "bf16")
    for t, v in got:
        p = rendered_params(render_variant(v))
        assert p["bwd_sdp_split"] is True and (p.get("bwd_dq_first") is True) is (t == "splitdqf")


@pytest.mark.compile
def test_compile_not_serialised_and_no_stack(compile_sm90, tmp_path):
    from flamia_gen.bench.sass import describe, missing_tools, serialised

    if missing_tools():
        pytest.skip(missing_tools())
    v = next(x for x in BF16 if x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    ptx = compile_sm90(v, source=render_with_flags(v, bwd_sdp_split=True))
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) >= 4  # two a tile copy
    d = describe(str(tmp_path / f"{v.name}.o"))
    assert d["loops"] and not any(serialised(lp) for lp in d["loops"]), d["loops"]
    assert d["stack"] == 0 and all(lp["stl"] == 0 and lp["ldl"] == 0 for lp in d["loops"])
