"""dO's power-of-two factor out of the backward's softmax pass (flag `bwd_dof_fold`, twenty-seventh session; the
default of the per-token dQ-on-BF16 tiles since round 30; templates/sm90/attn_bwd.py.j2, docs/kernels/attn_bwd.md). The producer writes D·2^−edo, 2^(eq+edo) and 2^edo;
the pass computes ds' = ds·2^−edo, dK's fold and dQ's row factor put 2^edo back. CPU: the render (default unchanged,
refusals, the words, the pass, dQ's factor, on by default), the A/B tag, and the arithmetic the flag rests on — every value bit for
bit the default's, edge rows included — replayed in fp32; `-m compile`: sm_90a, not serialised, fewer multiplies."""

from __future__ import annotations

import ast

import jinja2
import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
TILES = [v for v in BWD if v.route in ("fp8_token", "fp8_token_bf16qk")]


def _tile(src: str) -> str:
    i = src.index("    def one_tile(")
    return src[i:src.index("    def ", i + 10)]


@pytest.mark.parametrize("v", TILES, ids=lambda v: v.name)
def test_flag_moves_dos_factor_to_the_words_and_dq_rows(v):
    on, off = render_variant(v), render_with_flags(v, bwd_dof_fold=False)
    ast.parse(on)
    assert rendered_params(on)["bwd_dof_fold"] is True and "bwd_dof_fold" not in rendered_params(off)
    assert render_with_flags(v, bwd_dof_fold=True) == on
    # fp8_token's D = 128 tile is split by default since round 45 (with the late dQ scale): its fused pass here, which
    # is what the fold's absence falls back to
    split = rendered_params(on).get("bwd_sdp_split") is True
    t_on, t_off = _tile(render_with_flags(v, bwd_sdp_split=False) if split else on), _tile(off)
    assert "dof = self.load2(sRow, rbase + row_word(c, 4))" in t_off and "row_word(c, 4)" not in t_on
    assert "ds = p * (acc_dP[i] * vf[rh] * dof[cp] - dl[cp])" in t_off
    assert "ds = p * (acc_dP[i] * vf[rh] - dl[cp])" in t_on and "dof[cp]" not in t_on
    r = "col_of_query(r)" if v.route == "fp8_token" else "r"  # fp8_token's query rows are permuted
    assert f"dqf[rh] = softmax_scale * sRow[rbase + row_word({r}, 4)]" in t_on
    assert "dqf[rh] = softmax_scale\n" in t_off
    # the producer: D·2^−edo, 2^(eq+edo), 2^edo; a NaN row (code 255) keeps factor 1
    for s in ("nan_row = dcs[j] == Int32(255)", "bits_f32(Uint32(Int32(254) - dcs[j]) << Uint32(23))",
              "sRow[rbase + row_word(c, 1)] = vals[4 * j + 1] * fdi", "sRow[rbase + row_word(c, 3)] = vals[4 * j + 3] * fdo",
              "sRow[rbase + row_word(c, 4)] = fdo"):
        assert s in on and s not in off, s


def _refused():
    seen, out = set(), []
    for x in BWD:
        if x.route not in ("fp8_token", "fp8_token_bf16qk") and x.route not in seen:
            seen.add(x.route)
            out.append(x)
    return out


@pytest.mark.parametrize("v", _refused(), ids=lambda v: v.name)
def test_flag_refused_elsewhere(v):
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dof_fold"):
        render_with_flags(v, bwd_dof_fold=True)
    if v.route == "mxfp8":  # mxfp8's dQ on BF16 (an experiment itself) does not take it either
        with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dof_fold"):
            render_with_flags(v, bwd_dof_fold=True, bwd_dq_bf16=True)


def test_refused_without_dq_on_bf16():
    v = next(x for x in TILES if x.route == "fp8_token")
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dof_fold"):
        render_with_flags(v, bwd_dof_fold=True, bwd_dq_bf16=False)


def test_ab_tag():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("fp8_token", "fp8_token_bf16qk", "fp8_pv", "mxfp8"))
    tagged = [v for t, v in experiment_variants(("nodoffold",), base_variants=bwd, experiments=EXPERIMENTS)
              if t == "nodoffold"]
    assert len(tagged) == 8 and {v.route for v in tagged} == {"fp8_token", "fp8_token_bf16qk"}
    for v in tagged:
        base = next(x for x in bwd if v.name.startswith(x.name + "_x"))
        p, b = rendered_params(render_variant(v)), rendered_params(render_variant(base))
        assert b["bwd_dof_fold"] is True and "bwd_dof_fold" not in p  # the base has the fold by default, the copy not
        # and only the fold moves (with bwd_rw_early, which loads the folded tile's words: fp8_token's D = 128 default)
        # (and, on that tile since round 45, the split, the late dQ scale and the call's conversion, which need both)
        needs_fold = {k: True for k in ("bwd_rw_early", "bwd_sdp_split", "bwd_dq_scale_late", "bwd_dq_convert")
                      if b.get(k)}
        assert "bwd_rw_early" not in p and {**p, "bwd_dof_fold": True, **needs_fold, "name": b["name"]} == b


def _pow2(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's 2^(code − 127) from a UE8M0 code: bits_f32(code << 23) (code 0 reads as 0.0, 255 as +Inf)."""
    return (codes.to(torch.int32) << 23).view(torch.float32)


def test_the_fold_is_bitwise_in_fp32_edge_rows_included():
    """Replays the default's and the flag's arithmetic for one tile (keys × queries) in fp32, the kernel's factors
    from their scale codes: dK's y (the E4M3 fold's input) and dQ's scaled partial rows are bit for bit equal wherever
    no intermediate is an fp32 subnormal, including an all-zero dO row (code 0: D = 0, dPᵀ = 0) and a NaN row
    (code 255) whose masked pairs stay 0."""
    g = torch.Generator().manual_seed(3)
    n, m, d = 128, 64, 32
    s = torch.randn(n, m, generator=g) * 4
    dp = torch.randn(n, m, generator=g) * 3
    kc = torch.randint(118, 136, (n,), generator=g)
    vc = torch.randint(110, 140, (n,), generator=g)
    qc = torch.randint(118, 136, (m,), generator=g)
    dc = torch.randint(90, 140, (m,), generator=g)
    dl = torch.randn(m, generator=g)
    qx = _pow2(qc) * 0.12752
    dc[5], dp[:, 5], dl[5] = 0, 0.0, 0.0  # an all-zero dO row: its codes, dPᵀ and D are 0
    dc[9], dp[:, 9], dl[9] = 255, float("nan"), float("nan")  # a NaN dO row
    visible = torch.rand(n, m, generator=g) < 0.7
    kf, vf, qf, dof = _pow2(kc)[:, None], _pow2(vc)[:, None], _pow2(qc), _pow2(dc)
    x = s * kf * qx
    lse2 = x.max(0).values + torch.rand(m, generator=g) + 0.5  # P ≤ 1 as the forward's LSE makes it
    p = torch.exp2(x - lse2)

    # the default: ds = p·(dPᵀ·2^ev·2^edo − D); y = ds·2^eq; dQ partial = (BF16(dS)·K̂)·softmax_scale
    ds = torch.where(visible, p * (dp * vf * dof - dl), torch.zeros(()))
    y = ds * qf
    # the flag: the producer's words, then ds' = p·(dPᵀ·2^ev − D'); y = ds'·2^(eq+edo); partial ·softmax_scale·2^edo
    nan_row = dc == 255
    fdo = torch.where(nan_row, torch.ones(()), dof)
    fdi = torch.where(nan_row, torch.ones(()), _pow2(254 - dc.clamp(max=254)))
    ds1 = torch.where(visible, p * (dp * vf - dl * fdi), torch.zeros(()))
    y1 = ds1 * (qf * fdo)
    # exact but where an intermediate is an fp32 subnormal (p, ds or ds' below 2^−126, ~30 binades under the row's
    # amax): there one form rounds (or, on the GPU, flushes) and the other does not
    tiny = 2.0 ** -126
    sub = lambda t: (t != 0) & (t.abs() < tiny)  # noqa: E731
    exact = ~(sub(p) | sub(ds) | sub(ds1))
    assert exact.float().mean() > 0.95
    assert torch.equal(y.isnan(), y1.isnan())
    assert torch.equal(torch.nan_to_num(y)[exact], torch.nan_to_num(y1)[exact])
    assert (torch.nan_to_num(y - y1).abs()[~exact] < 2.0 ** -120).all()
    assert y[:, 9].isnan().any() and (y[~visible[:, 9], 9] == 0).all() and (y1[~visible[:, 9], 9] == 0).all()
    assert (y[:, 5] == 0).all() and (y1[:, 5] == 0).all()
    ds, ds1 = torch.where(exact, ds, torch.zeros(())), torch.where(exact, ds1, torch.zeros(()))

    khat = (torch.randint(-60, 60, (n, d), generator=g).float() / 8) * _pow2(kc)[:, None]  # E4M3-like codes·2^ek
    ss = 0.08838834764831845
    part = (ds.t().to(torch.bfloat16).float() @ khat) * ss
    part1 = (ds1.t().to(torch.bfloat16).float() @ khat) * (ss * fdo)[:, None]
    assert torch.equal(part.isnan(), part1.isnan())
    assert torch.equal(torch.nan_to_num(part), torch.nan_to_num(part1))


@pytest.mark.compile
def test_compile_dof_fold(compile_sm90, tmp_path):
    """fp8_token's D = 128 tile (the fold on by default) compiles for sm_90a, its wgmmas stay asynchronous and its tile
    loops issue fewer multiplies than without the fold (one per element pair of the softmax pass)."""
    from flamia_gen.bench.sass import describe, missing_tools, serialised

    v = next(x for x in TILES if x.route == "fp8_token" and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    compile_sm90(v)
    if missing_tools():
        pytest.skip(missing_tools())
    on = describe(str(tmp_path / f"{v.name}.o"))["loops"]
    assert on and not any(serialised(lp) for lp in on), on
    compile_sm90(v, source=render_with_flags(v, bwd_dof_fold=False))
    off = describe(str(tmp_path / f"{v.name}.o"))["loops"]
    fmul = lambda loops: sum(lp["ops"].get("FMUL", 0) for lp in loops)  # noqa: E731
    assert fmul(on) < fmul(off) - 32, (fmul(on), fmul(off))
