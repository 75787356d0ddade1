"""bwd_rw_early (flag of templates/sm90/attn_bwd.py.j2; default on fp8_token's D = 128 tile since round 38;
docs/kernels/attn_bwd.md "Per-query words while Sᵀ and dPᵀ run"): column group 0's per-query words (LSE·log2 e, D, the Q
factor) are loaded between the Sᵀ / dPᵀ issue and their wait instead of after it. CPU: on in the default render of
fp8_token's D = 128 non-deterministic tile only; renders on fp8_token's per-token dQ-on-BF16 tiles and is refused
elsewhere; in the rendered tile the three loads sit before `wait_group(0)` and the pass takes them for group 0 only."""

from __future__ import annotations

import pytest

from flamia_gen.bench.bwd_experiments import EXPERIMENTS
from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs
from kernel_source import one_tile

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
TOKEN = [v for v in BWD if v.route == "fp8_token"]


def _default_on(v) -> bool:
    return v.route == "fp8_token" and v.param("head_dim") == 128 and not dict(v.params).get("deterministic")


def test_on_by_default_on_fp8_tokens_d128_tile_only():
    for v in BWD:
        src = render_variant(v)
        on = rendered_params(src).get("bwd_rw_early") is True
        assert on is _default_on(v) and ("pre_lse2" in src) is on, v.name
        if on:  # bwd_rw_early=False renders the kernel before round 38
            off = render_with_flags(v, bwd_rw_early=False)
            assert "bwd_rw_early" not in rendered_params(off) and "pre_lse2" not in off


@pytest.mark.parametrize("v", TOKEN, ids=lambda v: v.name)
def test_renders_on_the_per_token_tiles(v):
    src = render_with_flags(v, bwd_rw_early=True)
    compile(src, v.name, "exec")
    assert rendered_params(src)["bwd_rw_early"] is True
    tile = one_tile(src)
    # the first wait after the issue: both (the fused pass) or Sᵀ's alone (the split, fp8_token's D = 128 default
    # since round 45)
    dp, pre = tile.index("self.gemm(tiled_mma_sdp, acc_dP"), tile.index("pre_lse2 = ")
    wait = tile.index("        warpgroup.wait_group(", dp)
    assert dp < pre < wait  # the loads while Sᵀ and dPᵀ run
    # the fused pass takes the three at once; the split takes LSE and the Q factor for P, D for dS after the dPᵀ wait
    split = rendered_params(src).get("bwd_sdp_split") is True
    assert ("lse2, qx = pre_lse2, pre_qx" in tile and "dl = pre_dl" in tile) if split else \
        "lse2, dl, qx = pre_lse2, pre_dl, pre_qx" in tile
    assert tile.count("qx = self.load2(sRow, rbase + row_word(c, 2))") == 1  # the other groups still load their own


@pytest.mark.parametrize("route", ["bf16", "fp8_pv", "fp8_token_bf16qk", "mxfp8", "fp8_tensor"])
def test_refused_elsewhere(route):
    v = next(v for v in BWD if v.route == route)
    with pytest.raises(Exception, match="bwd_rw_early_is_built_for_the_per_token_bf16_dq_tiles_only"):
        render_with_flags(v, bwd_rw_early=True)


def test_experiment_tags_turn_the_flag_where_it_is_not_the_default():
    on, off = EXPERIMENTS["rwe"]["when"], EXPERIMENTS["norwe"]["when"]
    assert {v.route for v in BWD if on(dict(v.params))} == {"fp8_token"}
    for v in BWD:
        p = dict(v.params)
        assert off(p) is _default_on(v), v.name
        assert not (on(p) and off(p)), v.name
    for tag, want in (("kt", False), ("nokt", True)):  # bwd_no_kt's pair (round 38's other adoption)
        when = EXPERIMENTS[tag]["when"]
        for v in BWD:
            if when(dict(v.params)):
                assert (rendered_params(render_with_flags(v, **EXPERIMENTS[tag]["over"])).get("bwd_no_kt") is True) \
                    is want and (tag == "kt") is _default_on(v), v.name
