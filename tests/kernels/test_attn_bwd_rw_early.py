"""bwd_rw_early (experiment flag of templates/sm90/attn_bwd.py.j2, off; docs/kernels/attn_bwd.md "Per-query words while
Sᵀ and dPᵀ run"): column group 0's per-query words (LSE·log2 e, D, the Q factor) are loaded between the Sᵀ / dPᵀ issue
and their wait instead of after it. CPU: off in every default render; renders on fp8_token's per-token dQ-on-BF16 tiles
and is refused elsewhere; in the rendered tile the three loads sit before `wait_group(0)` and the pass takes them for
group 0 only."""

from __future__ import annotations

import pytest

from flamia_gen.bench.bwd_experiments import EXPERIMENTS
from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
TOKEN = [v for v in BWD if v.route == "fp8_token"]


def _one_tile(src: str) -> str:
    i = src.index("    def one_tile(")
    return src[i:src.index("\n    @cute.jit", i)]


def test_off_by_default():
    for v in BWD:
        src = render_variant(v)
        assert "bwd_rw_early" not in rendered_params(src) and "pre_lse2" not in src, v.name


@pytest.mark.parametrize("v", TOKEN, ids=lambda v: v.name)
def test_renders_on_the_per_token_tiles(v):
    src = render_with_flags(v, bwd_rw_early=True)
    compile(src, v.name, "exec")
    assert rendered_params(src)["bwd_rw_early"] is True
    tile = _one_tile(src)
    dp, pre, wait = tile.index("self.gemm(tiled_mma_sdp, acc_dP"), tile.index("pre_lse2 = "), \
        tile.index("        warpgroup.wait_group(0)\n")
    assert dp < pre < wait  # the loads while Sᵀ and dPᵀ run
    assert "lse2, dl, qx = pre_lse2, pre_dl, pre_qx" in tile
    assert tile.count("qx = self.load2(sRow, rbase + row_word(c, 2))") == 1  # the other groups still load their own


@pytest.mark.parametrize("route", ["bf16", "fp8_pv", "fp8_token_bf16qk", "mxfp8", "fp8_tensor"])
def test_refused_elsewhere(route):
    v = next(v for v in BWD if v.route == route)
    with pytest.raises(Exception, match="bwd_rw_early_is_built_for_the_per_token_bf16_dq_tiles_only"):
        render_with_flags(v, bwd_rw_early=True)


def test_experiment_tag_applies_to_fp8_token_only():
    when = EXPERIMENTS["rwe"]["when"]
    picked = {v.route for v in BWD if when(dict(v.params))}
    assert picked == {"fp8_token"}
