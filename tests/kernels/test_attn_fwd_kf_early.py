"""fwd_kf_early (experiment flag of templates/sm90/attn_fwd.py.j2, off; docs/kernels/attn_fwd.md "Per-key factors while
QKᵀ runs"): the first column groups' per-key (2^ek, ev) loads move from pass 1 (after the QKᵀ wait) to between the QKᵀ
issue and its wait. These tests check where the flag is taken and refused, that the default renders do not change,
and the rendered order: the loads before `wait_group(0)`, pass 1 using them for exactly the first groups."""

from __future__ import annotations

import pytest

from flamia_gen.bench.fwd_experiments import EXPERIMENTS, experiment_variants
from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags
from flamia_gen.spec import load_specs
from kernel_source import one_tile

VARIANTS = [v for v in make_plan(load_specs()).variants if v.kind.value == "attn_fwd" and v.arch.value == "sm90"]
TOKEN = [v for v in VARIANTS if v.route == "fp8_token" and not v.param("intra_wg_overlap")]


def test_off_by_default_and_absent_from_default_renders():
    for v in TOKEN[:4]:
        src = render_variant(v)
        assert "fwd_kf_early" not in src and "fk_pre" not in src
        assert render_with_flags(v, fwd_kf_early=0) == src


@pytest.mark.parametrize("kfe", [1, 2])
@pytest.mark.parametrize("v", TOKEN[:2] + [v for v in TOKEN if v.param("compute_warpgroups") == 3][:1],
                         ids=lambda v: v.name)
def test_rendered_order(v, kfe):
    src = render_with_flags(v, fwd_kf_early=kfe)
    compile(src, v.name, "exec")
    assert f'"fwd_kf_early": {kfe},' in src
    ot = one_tile(src)
    issue, pre, wait = ot.index("self.gemm(tiled_mma_qk"), ot.index("fk_pre = ["), ot.index("warpgroup.wait_group(0)")
    assert issue < pre < wait  # the loads sit between the QKᵀ issue and its wait
    assert f"for cg in range({kfe})]" in ot and "mask, fk_pre)" in ot
    sm = src[src.index("    def softmax("):]
    assert f"if const_expr(cg < {kfe}):\n                fk = fk_pre[cg]" in sm
    assert "fk = self.load_scales(sScale, base + scale_word(tScS[4 * cg][1], 0), 4)" in sm  # the other groups


@pytest.mark.parametrize("route, extra", [("fp8_tensor", {}), ("bf16", {}), ("fp8_token_bf16qk", {}),
                                          ("fp8_token", {"intra_wg_overlap": True})])
def test_refused_without_per_key_e4m3_factors_or_with_the_overlap(route, extra):
    """fp8_tensor's factors are uniform (read once a unit), bf16 and BF16-QKᵀ kernels load no 2^ek, and the
    intra-warpgroup overlap has its own tile functions."""
    cands = [v for v in VARIANTS if v.route == route and bool(v.param("intra_wg_overlap")) == bool(extra)]
    with pytest.raises(Exception, match="fwd_kf_early_needs_per_key_e4m3_factors_without_overlap"):
        render_with_flags(cands[0], fwd_kf_early=1)


def test_experiment_tags_cover_the_per_key_one_tile_variants_only():
    for tag in ("kfe1", "kfe2", "kfe4"):
        assert tag in EXPERIMENTS
    got = experiment_variants(("kfe1",), route="fp8_token")
    flagged = [v for t, v in got if t == "kfe1"]
    assert flagged and all(not v.param("intra_wg_overlap") and v.name.endswith("_xkfe1") for v in flagged)
    assert len(flagged) == len(TOKEN)
    assert experiment_variants(("kfe1",), route="fp8_tensor") == [(t, v) for t, v in
                                                                  experiment_variants((), route="fp8_tensor")]
