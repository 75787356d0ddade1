"""dS to shared memory by stmatrix.trans in the backward (flag `bwd_ds_stsm`; templates/sm90/attn_bwd.py.j2;
docs/kernels/attn_bwd.md "dS by stmatrix"). The default of the per-token dQ-on-BF16 tiles (fp8_token, fp8_token_bf16qk)
at D = 64 and of their deterministic copies since round 32 (H100: 0.95–0.98× at D = 64, 0.91–0.99× with bwd_dq_first on
the `_det` D = 128 copies; bitwise equal), of fp8_token's D = 128 tile since round 35 (H100, with bwd_dq_first:
0.93–0.98×, bitwise equal), and since round 36 of fp8_token_bf16qk's D = 128 tile (with two writers and bwd_dq_first:
0.93–0.99×) and fp8_pv's non-deterministic D = 128 tile (0.965–0.989×), and since round 39 of the bf16 route's
non-deterministic D = 128 tile (three runs; 1×16384 causal 0.96–0.98×, the other rows 0.97–1.00×).

CPU: on in exactly those default renders, where the tile's element-wise dS stores give way to the stmatrix copy (one call
per tile copy, none of the old loop); renders for every 16-bit dS tile when asked (bf16, fp8_pv) and is refused on the
8-bit ones; the bench tags turn it the other way from each base kernel's default. `-m compile`: the PTX holds 4
`stmatrix…x4.trans` per tile copy and the tile without it none.
"""

from __future__ import annotations

import re

import jinja2
import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs
from kernel_source import one_tile

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
DQ16 = [v for v in BWD if v.route in ("fp8_token", "fp8_token_bf16qk")]
ON = DQ16 + [v for v in BWD if v.route in ("fp8_pv", "bf16") and v.param("head_dim") == 128
              and not dict(v.params).get("deterministic")]
ELEMENTWISE = "            dst[i] = rdS[i]\n"
STSM_CALL = "self.store_ds(tiled_mma_sdp, rdS, tSsdS[None, None, None, buf])"


def test_default_on_the_per_token_dq16_tiles_and_fp8_pv_and_bf16_d128():
    # two routes × D × causal or not × det or not + fp8_pv's and bf16's D = 128 non-deterministic tiles (causal or not)
    assert len(ON) == 20
    for v in BWD:
        src = render_variant(v)
        on = v in ON
        assert (rendered_params(src).get("bwd_ds_stsm") is True) is on, v.name
        assert ("def store_ds(" in src) is on and ("StMatrix8x8x16bOp(transpose=True, num_matrices=4)" in src) is on
        tile = one_tile(src)
        if v.context.get("v_fmt") != "e4m3" or v.route == "fp8_pv" or v in DQ16:  # the 16-bit dS tiles
            assert tile.count(STSM_CALL) == (1 if on else 0) and (ELEMENTWISE in tile) is not on, v.name


@pytest.mark.parametrize("route", ["bf16", "fp8_pv", "fp8_token"])
def test_renders_on_every_16_bit_ds_tile_and_replaces_the_stores(route):
    v = next(x for x in BWD if x.route == route and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    on, off = render_with_flags(v, bwd_ds_stsm=True), render_with_flags(v, bwd_ds_stsm=False)
    assert rendered_params(on)["bwd_ds_stsm"] is True and "bwd_ds_stsm" not in rendered_params(off)
    assert one_tile(on).count(STSM_CALL) == 1 and ELEMENTWISE not in one_tile(on)
    assert STSM_CALL not in off and ELEMENTWISE in one_tile(off)
    # the destination is the copy's own partition of the same (keys, queries, buffer) view of sdS
    assert "tSsdS = self.ds_store_copy(tiled_mma_sdp).get_slice(tidx).partition_D(sdSt)" in on
    assert "tSsdS = thr_sdp.partition_C(sdSt)" in off


@pytest.mark.parametrize("route", ["fp8_tensor", "mxfp8", "nvfp4_mixed", "fp8_token"])
def test_refused_on_8_bit_ds_tiles(route):
    v = next(x for x in BWD if x.route == route)
    over = {"bwd_dq_bf16": False} if route == "fp8_token" else {}  # fp8_token's tile without dQ on BF16: E4M3 dS
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_ds_stsm"):
        render_with_flags(v, bwd_ds_stsm=True, **over)


def test_ab_tags():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    for hd in (128, 64):
        bwd, _ = base_variants(routes=("fp8_token", "fp8_token_bf16qk", "fp8_pv", "bf16"), head_dim=hd)
        tags = {t: [v for tt, v in experiment_variants((t,), base_variants=bwd, experiments=EXPERIMENTS) if tt == t]
                for t in ("stsm", "nostsm", "stsmdqf")}
        base = lambda v: rendered_params(  # noqa: E731
            render_variant(next(b for b in bwd if v.name.startswith(b.name + "_x"))))
        assert all("bwd_ds_stsm" not in base(v) for v in tags["stsm"] + tags["stsmdqf"])
        assert all(base(v).get("bwd_ds_stsm") is True for v in tags["nostsm"])
        assert {v.route for v in tags["nostsm"]} == (
            {"fp8_token", "fp8_token_bf16qk"} | ({"fp8_pv", "bf16"} if hd == 128 else set()))
        # stsm: the bf16 and fp8_pv tiles without it (D = 128: the deterministic 2 of each; D = 64: all 4 of each);
        # nostsm on every per-token tile (8) and, at D = 128, fp8_pv's and bf16's non-deterministic 2
        assert len(tags["stsm"]) == (4 if hd == 128 else 8) and len(tags["nostsm"]) == (12 if hd == 128 else 8)
        assert len(tags["stsmdqf"]) == 0  # every per-token tile has both since round 36


@pytest.mark.compile
def test_compile_stmatrix_in_both_tile_copies(compile_sm90):
    """fp8_token D = 128 causal (interior and masked copies of the tile): 8 stmatrix x4 trans with the flag, none without."""
    v = next(x for x in DQ16 if x.route == "fp8_token" and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    pat = r"stmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16"
    assert len(re.findall(pat, compile_sm90(v, source=render_with_flags(v, bwd_ds_stsm=True)))) == 8
    assert not re.findall(pat, compile_sm90(v, source=render_with_flags(v, bwd_ds_stsm=False)))
