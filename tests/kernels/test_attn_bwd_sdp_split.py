"""The Sᵀ wait split from the dPᵀ wait (flag `bwd_sdp_split`; bf16 tile since the forty-first session, fp8_token's
D = 128 tile since the forty-second; with bwd_dq_first the default of the bf16 route's D = 128 non-deterministic tile
since round 43 and of its D = 128 deterministic and D = 64 non-deterministic tiles since round 44; with
bwd_dq_scale_late and bwd_dq_convert the default of fp8_token's D = 128 non-deterministic tile since round 45; off
elsewhere; templates/sm90/attn_bwd.py.j2; docs/perf-notes.md rounds 41–45): P and dV's issue while dPᵀ runs, dS while
dV runs.

CPU: on in exactly those default renders (bf16's with bwd_dq_first); on, one_tile waits for Sᵀ alone (wait_group(1)), computes P, issues dV, waits for
dPᵀ with dV in flight (wait_group(1)) and only then reads dPᵀ for dS; the P pass records the masked pairs and the dS
pass zeroes them from that record (a masked pair's dPᵀ may be NaN: P = 0 times it is not 0); on fp8_token's tile acc_S
keeps P unscaled and dV's operand takes its factor in the conversion. Refused on the other FP8 tiles and without
mask-free interior tiles. `-m compile`: no wgmma serialised, no spill stores in the tile loops (bf16: no stack).
`bwd_sdp_split_interior` (forty-fourth session, experiment): the split on the interior copy only, the masked copy fused.
"""

from __future__ import annotations

import re

import jinja2
import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs
from kernel_source import method_source, one_tile

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
BF16 = [v for v in BWD if v.route == "bf16"]
# fp8_token's tile with bwd_rw_early (D = 128, not deterministic): the one FP8 tile the split is built for
FP8T = [v for v in BWD if v.route == "fp8_token" and v.param("head_dim") == 128
        and not dict(v.params).get("deterministic")]


# the split and FA4's order (bwd_dq_first) are the default of these six and no other: bf16 D = 128 (round 43; its
# deterministic copies since round 44) and D = 64 non-deterministic (round 44), causal or not
DEFAULT_ON = [v for v in BF16 if v.param("head_dim") == 128 or not dict(v.params).get("deterministic")]


def test_default_on_the_bf16_tiles_but_the_d64_deterministic_ones():
    assert len(DEFAULT_ON) == 6 and {bool(v.param("causal")) for v in DEFAULT_ON} == {True, False}
    assert {(v.param("head_dim"), bool(dict(v.params).get("deterministic"))) for v in DEFAULT_ON} == {
        (128, False), (128, True), (64, False)}
    assert len([v for v in BF16 if v not in DEFAULT_ON]) == 2  # D = 64 deterministic, causal or not: fused
    for v in BWD:
        p = rendered_params(render_variant(v))
        assert (p.get("bwd_sdp_split") is True) is (v in DEFAULT_ON or v in FP8T), v.name
        if v in DEFAULT_ON:  # the default is the timed `splitdqf` copy: both flags, byte for byte
            assert p.get("bwd_dq_first") is True
            assert render_variant(v) == render_with_flags(v, bwd_sdp_split=True, bwd_dq_first=True)
            # and `nosplit` renders the fused tile (dK issued before dQ)
            off = one_tile(render_with_flags(v, bwd_sdp_split=False, bwd_dq_first=False))
            assert "mbits" not in off and off.index("self.gemm(tiled_mma_dkv, acc_dK,") < off.index(
                "self.gemm(tiled_mma_dq, acc_dQ,")


def test_default_on_fp8_tokens_d128_tile_with_the_late_scale_and_the_calls_conversion():
    """Round 45 (H100, two runs: causal 0.93–0.96×, non-causal 0.97–1.00× the fused tile): fp8_token's D = 128
    non-deterministic tiles are the timed `splitslc` copies byte for byte; `nosplitslc` renders the fused tile with the
    factor in the tile and no conversion launch, as before round 45."""
    assert len(FP8T) == 2 and {bool(v.param("causal")) for v in FP8T} == {True, False}
    for v in FP8T:
        src = render_variant(v)
        p = rendered_params(src)
        assert p["bwd_sdp_split"] is True and p["bwd_dq_scale_late"] is True and p["bwd_dq_convert"] is True
        assert src == render_with_flags(v, bwd_sdp_split=True, bwd_dq_scale_late=True, bwd_dq_convert=True)
        off = render_with_flags(v, bwd_sdp_split=False, bwd_dq_scale_late=False, bwd_dq_convert=False)
        q = rendered_params(off)
        assert not any(k in q for k in ("bwd_sdp_split", "bwd_dq_scale_late", "bwd_dq_convert"))
        assert "mbits" not in one_tile(off) and '"name": "dq"' not in off
        # split off alone: the late scale and the conversion go with it (they are the split's defaults, not its own)
        assert render_with_flags(v, bwd_sdp_split=False) == off
    # every other FP8 backward keeps the fused pass, its dQ factor in the tile and the runtime's conversion
    for v in BWD:
        if v.route != "bf16" and v not in FP8T:
            p = rendered_params(render_variant(v))
            assert not any(k in p for k in ("bwd_sdp_split", "bwd_dq_scale_late", "bwd_dq_convert")), v.name


@pytest.mark.parametrize("v", BF16 + FP8T, ids=lambda v: v.name)
def test_the_order_of_waits_and_passes(v):
    src = render_with_flags(v, bwd_sdp_split=True)
    assert rendered_params(src)["bwd_sdp_split"] is True
    t = one_tile(src)
    fp8 = v.route == "fp8_token"
    s_issue = t.index("self.gemm(tiled_mma_sdp, acc_S,")
    dp_issue = t.index("self.gemm(tiled_mma_sdp, acc_dP,")
    w1 = t.index("warpgroup.wait_group(1)", dp_issue)
    p_pass = t.index("p = ex2(acc_S[i] * kf[rh] * qx[cp] - lse2[cp])" if fp8 else
                     "p = ex2(acc_S[i] * scale_log2 - lse2[cp])")
    dv = t.index("self.gemm(tiled_mma_dkv, acc_dV, tdVrP,")
    w2 = t.index("warpgroup.wait_group(1)", dv)
    ds_pass = t.index("ds = acc_S[i] * (acc_dP[i] * vf[rh] - dl[cp])" if fp8 else "ds = acc_S[i] * (acc_dP[i] - dl[cp])")
    assert s_issue < dp_issue < w1 < p_pass < dv < w2 < ds_pass
    assert "acc_dP" not in t[w1:w2]  # dPᵀ's accumulator is not touched before its wait
    # the P pass zeroes masked pairs and records them; the dS pass zeroes from the record (never P = 0 times a NaN)
    assert t.count("p = Float32(0.0)") == 1 and t.count("ds = Float32(0.0)") == 1
    assert t[p_pass:dv].count("outdoc = ") == 1 and t[p_pass:dv].count("mbits = mbits | Uint32(1 << i)") == 1
    assert re.search(r"if \(mbits & Uint32\(1 << i\)\) != Uint32\(0\):\n\s+ds = Float32\(0\.0\)", t[ds_pass:])
    assert ("kk > qq" in t[p_pass:dv]) is bool(v.param("causal"))
    # the flag's block replaces the fused pass: one ex2 pass, one dV issue
    assert t.count("p = ex2(") == 1 and t.count("self.gemm(tiled_mma_dkv, acc_dV,") == 1
    if fp8:
        # P stays unscaled (dS reads it after dV's issue): dV's factor is applied in the conversion only
        assert "acc_S[i] = acc_S[i] * pf" not in t and "dv_scale_rows" not in t
        assert t[p_pass:dv].count("self.convert_p_scaled(acc_S, tdVrP,") == 2 and "self.convert_p(acc_S, tdVrP)" not in t


def test_fp8_conversion_scales_a_copy():
    """convert_p_scaled multiplies each packed value by 2^(8 + edo − R) of its column and key row, and never writes
    acc_S (the fused pass's in-place products, so dV's codes are the same)."""
    src = render_with_flags(FP8T[0], bwd_sdp_split=True)
    body = method_source(src, "convert_p_scaled")
    assert "acc_S[" in body and not re.search(r"acc_S\[[^\]]*\]\s*=", body)
    assert re.search(r"pow2i\(Int32\(8 - 127\) \+ Int32\(f32_bits\(ed\[j // 2\]\[j % 2\]\)\)\s+- rr\[rh\]\)", body)
    assert "pack_e4m3x4(v[0], v[1], v[2], v[3])" in body
    # interior tiles (R = the max of every column's edo): the flush clamp only; masked tiles keep pow2i's two
    inner = body[body.index("if const_expr(interior):"):body.index("else:", body.index("if const_expr(interior):"))]
    assert "cutlass.max(" in inner and "cutlass.min(" not in inner and "pow2i(" not in inner
    t = one_tile(src)
    assert "self.convert_p_scaled(acc_S, tdVrP, sRow, rbase, tScS, run[2], run[3], False)" in t  # masked: per row
    assert "self.convert_p_scaled(acc_S, tdVrP, sRow, rbase, tScS, r_int, r_int, True)" in t
    # its factor indices assume p_pack's order: entry j of a pack is accumulator (cg + j // 2, rh, cp = j % 2)
    ns: dict = {}
    exec(compile(src[src.index("def p_pack("):src.index("def row_word(")], "p_pack", "exec"), ns)  # plain Python
    for kb in range(2):
        for q in range(2):
            for rh in range(2):
                got = [(a // 4, (a // 2) % 2, a % 2) for a in ns["p_pack"](kb, q, rh)]
                assert got == [(4 * kb + 2 * q + j // 2, rh, j % 2) for j in range(4)]


@pytest.mark.parametrize("route", ["fp8_pv", "mxfp8", "fp8_tensor", "fp8_token_bf16qk"])
def test_refused_on_other_fp8_tiles(route):
    v = next(x for x in BWD if x.route == route)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_sdp_split"):
        render_with_flags(v, bwd_sdp_split=True)


def test_refused_on_fp8_token_without_its_early_row_words():
    v = next(x for x in BWD if x.route == "fp8_token" and x.param("head_dim") == 64)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_sdp_split"):
        render_with_flags(v, bwd_sdp_split=True)


def test_refused_without_mask_free_interior_tiles():
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_sdp_split"):
        render_with_flags(BF16[0], bwd_sdp_split=True, bwd_interior_nomask=False)


def test_ab_tags():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    for hd in (128, 64):
        bwd, _ = base_variants(routes=("fp8_token", "bf16"), head_dim=hd)
        got = [(t, v) for t, v in experiment_variants(("split", "splitdqf"), base_variants=bwd,
                                                      experiments=EXPERIMENTS) if t]  # "" tags the base variants
        # bf16's copies build on the tiles without the split default only: the D = 64 deterministic ones (round 44)
        off = [v for v in bwd if v.route == "bf16" and v not in DEFAULT_ON]
        assert len(off) == (0 if hd == 128 else 2)
        assert sorted(v.name for t, v in got if v.route == "bf16") == sorted(
            v.name + "_x" + t for v in off for t in ("split", "splitdqf"))
        # fp8_token's tile (D = 128, bwd_rw_early) has the split by default since round 45: neither copy
        fp8 = [v for v in bwd if v.name in {x.name for x in FP8T}]
        assert len(fp8) == (2 if hd == 128 else 0)
        assert not [v for t, v in got if v.route == "fp8_token"]
        for t, v in got:
            p = rendered_params(render_variant(v))
            assert p["bwd_sdp_split"] is True
            assert (p.get("bwd_dq_first") is True) is (t == "splitdqf" or v.route == "fp8_token")
        undo = [v for t, v in experiment_variants(("nosplit",), base_variants=bwd, experiments=EXPERIMENTS) if t]
        assert sorted(v.name for v in undo) == sorted(v.name + "_xnosplit" for v in DEFAULT_ON
                                                      if v.param("head_dim") == hd)
        for v in undo:
            p = rendered_params(render_variant(v))
            assert "bwd_sdp_split" not in p and "bwd_dq_first" not in p
        sl = [v for t, v in experiment_variants(("splitsl",), base_variants=bwd, experiments=EXPERIMENTS) if t]
        assert len(sl) == len(off)
        for v in sl:
            p = rendered_params(render_variant(v))
            assert p["bwd_sdp_split"] is True and p["bwd_dq_scale_late"] is True
        # fp8_token's undo copies: wholly (nosplitslc) and the late scale with the conversion only (splitnosl)
        fx = dict(bx_tags(("nosplitslc", "splitnosl"), hd=hd))
        for t, want in (("nosplitslc", set()), ("splitnosl", {"bwd_sdp_split"})):
            assert sorted(v.name for v in fx[t]) == sorted(v.name + "_x" + t for v in fp8)
            for v in fx[t]:
                p = rendered_params(render_variant(v))
                assert {k for k in ("bwd_sdp_split", "bwd_dq_scale_late", "bwd_dq_convert") if p.get(k)} == want


@pytest.mark.parametrize("v", [next(x for x in DEFAULT_ON if x.param("causal") and x.param("head_dim") == 128
                                    and not dict(x.params).get("deterministic"))]
                         + [x for x in FP8T if x.param("causal")], ids=lambda v: v.name)
def test_split_on_interior_tiles_only(v):
    """bwd_sdp_split_interior (forty-fourth session, experiment): the interior copy of one_tile (mask=False) runs the
    split, the masked copy the fused pass; the same pass bodies as the split and fused renders, one level deeper."""
    src = render_with_flags(v, bwd_sdp_split=True, bwd_sdp_split_interior=True)
    assert rendered_params(src)["bwd_sdp_split_interior"] is True
    t = one_tile(src)
    fp8 = v.route == "fp8_token"
    head = "        if const_expr(not mask):\n            # bwd_sdp_split_interior"
    assert t.count(head) == 1
    split_at, else_at = t.index(head), t.index("\n        else:\n", t.index(head))
    split_part, fused_part = t[split_at:else_at], t[else_at:]
    # the split branch: Sᵀ waited alone, dV issued, then the dPᵀ wait; the fused branch: both waited together
    assert "            warpgroup.wait_group(1)" in split_part and "warpgroup.wait_group(0)" not in split_part
    assert fused_part.index("            warpgroup.wait_group(0)") < fused_part.index(
        "            self.gemm(tiled_mma_dkv, acc_dV, tdVrP,")
    assert "mbits" not in fused_part and t.count("self.gemm(tiled_mma_dkv, acc_dV,") == 2
    # each branch is the flagged render's pass, indented one level
    ref_split = one_tile(render_with_flags(v, bwd_sdp_split=True))
    ref_fused = one_tile(render_with_flags(v, bwd_sdp_split=False, **({} if fp8 else {"bwd_dq_first": True})))
    deeper = lambda block: "\n".join(("    " + ln) if ln else ln for ln in block.split("\n"))  # noqa: E731
    first_split = "# bwd_sdp_split (fp8_token)" if fp8 else "# bwd_sdp_split: wait for Sᵀ only"
    s0 = ref_split.index(first_split)
    s1 = ref_split.index("self.gemm(tiled_mma_dkv, acc_dV, tdVrP,", s0)
    assert deeper(ref_split[s0:s1].rstrip()).strip() in split_part
    f0 = ref_fused.index("        warpgroup.wait_group(0)\n")
    f1 = ref_fused.index("self.gemm(tiled_mma_dkv, acc_dV, tdVrP,", f0)
    assert deeper(ref_fused[f0:f1].rstrip()).strip() in fused_part
    # the other renders carry no trace of the flag
    for other in (render_variant(v), render_with_flags(v, bwd_sdp_split=True)):
        assert "bwd_sdp_split_interior" not in other


def test_split_interior_needs_the_split():
    v = next(x for x in FP8T if x.param("causal"))
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_sdp_split_interior_needs_bwd_sdp_split"):
        render_with_flags(v, bwd_sdp_split=False, bwd_sdp_split_interior=True)
    tags = dict(bx_tags(("splitint",)))
    assert len(tags["splitint"]) == 4  # bf16's 2 split tiles + fp8_token's 2 (with its default late scale)
    for v in tags["splitint"]:
        p = rendered_params(render_variant(v))
        assert p["bwd_sdp_split_interior"] is True
        assert (p.get("bwd_dq_convert") is True) is (v.route == "fp8_token")


def bx_tags(tags, hd=128):
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("fp8_token", "bf16"), head_dim=hd)
    bwd = [v for v in bwd if not dict(v.params).get("deterministic")]
    got = experiment_variants(tags, base_variants=bwd, experiments=EXPERIMENTS)
    return [(t, [v for tt, v in got if tt == t]) for t in tags]


@pytest.mark.compile
@pytest.mark.parametrize("route", ["bf16", "fp8_token"])
def test_compile_not_serialised_and_no_spill_stores(route, compile_sm90, tmp_path):
    from flamia_gen.bench.sass import describe, missing_tools, serialised

    if missing_tools():
        pytest.skip(missing_tools())
    v = next(x for x in (BF16 if route == "bf16" else FP8T) if x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    ptx = compile_sm90(v, source=render_with_flags(v, bwd_sdp_split=True))
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) >= 4  # two a tile copy
    d = describe(str(tmp_path / f"{v.name}.o"))
    assert d["loops"] and not any(serialised(lp) for lp in d["loops"]), d["loops"]
    # bf16: no local memory at all (the fused default has 56 B); fp8_token: no spill stores in its tile loops (the
    # fused default has 3 a loop), some reloads of values spilled once before the loop
    assert all(lp["stl"] == 0 for lp in d["loops"]), d["loops"]
    if route == "bf16":
        assert d["stack"] == 0 and all(lp["ldl"] == 0 for lp in d["loops"])



@pytest.mark.compile
def test_compile_interior_split_fp8_token(compile_sm90, tmp_path):
    """fp8_token with bwd_sdp_split_interior and bwd_dq_scale_late (tag splitslint; sm_90a in the forty-fourth session:
    interior path 801 instructions, 4 spill loads, against the default's 859 and 8): the split's waits in the interior
    copy, no wgmma serialised, and its interior path issues fewer instructions than the default's."""
    from flamia_gen.bench.sass import describe, missing_tools, serialised

    if missing_tools():
        pytest.skip(missing_tools())
    v = next(x for x in FP8T if x.param("causal"))
    ptx = compile_sm90(v, source=render_with_flags(v, bwd_sdp_split=True, bwd_sdp_split_interior=True,
                                                   bwd_dq_scale_late=True))
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) >= 2  # the interior copy's two
    d = describe(str(tmp_path / f"{v.name}.o"))
    assert d["loops"] and not any(serialised(lp) for lp in d["loops"]), d["loops"]
    paths = [lp["paths"] for lp in d["loops"] if lp.get("paths")]
    assert paths and paths[0][0]["instructions"] < 859, paths