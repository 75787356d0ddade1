"""dK issued after dQ in the backward's dQ-on-BF16 tiles (flag `bwd_dq_first`; the default of fp8_token's and
fp8_token_bf16qk's non-deterministic D = 64 tiles since round 30, of their deterministic D = 128 tiles since round 32 and of
fp8_token's non-deterministic D = 128 tile (with bwd_ds_stsm) since round 35, of fp8_token_bf16qk's (with two writers
and bwd_ds_stsm) since round 36;
templates/sm90/attn_bwd.py.j2; docs/kernels/attn_bwd.md "dK after dQ").

CPU: on in exactly those default renders; where the flag renders, one_tile issues dK = dSᵀ·Q right after dQ = dS·K, waits with
one group left in flight (dK), and releases the Q stage (dK's B operand) only after a full wait at the tile's end;
refused where dQ is not on BF16 (except the bf16 route, where it is an experiment since the forty-first session: FA4's
order). `-m compile`: cross-compiles for sm_90a without ptxas serialising the wgmmas (the SASS; fp8_pv's tile did
serialise with it, which is why the flag is built for the dq16 tiles and the bf16 route only).
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


ON = [v for v in DQ16 if v.param("head_dim") == 128 or not dict(v.params).get("deterministic")]
# the bf16 route's tiles take it with bwd_sdp_split (FA4's order): D = 128 (round 43; deterministic since round 44) and
# D = 64 non-deterministic (round 44)
ON_BF16 = [v for v in BWD if v.route == "bf16" and (v.param("head_dim") == 128 or not dict(v.params).get("deterministic"))]


def test_default_on_every_d128_tile_and_the_non_deterministic_d64_ones():
    assert len(ON) == 12  # two routes × causal or not × (D = 128 det or not, D = 64 not deterministic)
    assert len(ON_BF16) == 6  # (D = 128 det or not, D = 64 not deterministic) × causal or not
    for v in BWD:
        assert (rendered_params(render_variant(v)).get("bwd_dq_first") is True) is (v in ON + ON_BF16), v.name


@pytest.mark.parametrize("v", [next(v for v in DQ16 if v.route == r and v.param("causal")
                                    and v.param("head_dim") == d) for r in ("fp8_token", "fp8_token_bf16qk")
                               for d in (64, 128)]
                         + [next(v for v in BWD if v.route == "bf16" and v.param("causal") and v.param("head_dim") == d
                                 and not dict(v.params).get("deterministic")) for d in (64, 128)],
                         ids=lambda v: v.name)
def test_dk_after_dq_and_the_stage_released_after_dk(v):
    on, off = one_tile(render_with_flags(v, bwd_dq_first=True)), one_tile(render_with_flags(v, bwd_dq_first=False))
    # bf16's default has the split too (tests/kernels/test_attn_bwd_sdp_split.py), as fp8_token's D = 128 one since
    # round 45: here without it
    if v in ON_BF16 or rendered_params(render_variant(v)).get("bwd_sdp_split") is True:
        on, off = (one_tile(render_with_flags(v, bwd_dq_first=f, bwd_sdp_split=False)) for f in (True, False))
        assert "bwd_dq_first" in rendered_params(render_variant(v))
    else:
        assert one_tile(render_variant(v)) == (on if v in ON else off)
    assert rendered_params(render_with_flags(v, bwd_dq_first=True))["bwd_dq_first"] is True
    dk = "self.gemm(tiled_mma_dkv, acc_dK, tdKrdS,"
    dq = "self.gemm(tiled_mma_dq, acc_dQ,"
    for src, first in ((on, True), (off, False)):
        assert src.count(dk) == 1 and src.count(dq) == 1
        assert (src.index(dk) > src.index(dq)) is first
        waits = re.findall(r"warpgroup\.wait_group\((\d)\)", src)
        assert ("1" in waits) is first
        # the Q stage (dK's B) is released after the last wait of the tile, never between dK's issue and its wait
        rel = src.index("pipe_q.consumer_release(q_state)")
        last_wait = src.rindex("warpgroup.wait_group(0)")
        assert (rel > last_wait) if first else (rel > src.index(dq))
        if first:
            assert src.index(dk) < src.index("warpgroup.wait_group(1)") < rel
            assert src[last_wait:rel].count("\n") <= 2  # released right after the full wait


@pytest.mark.parametrize("v", [next(x for x in BWD if x.route == r) for r in ("fp8_pv", "mxfp8", "fp8_tensor")]
                         + [next(x for x in DQ16 if x.route == "fp8_token")], ids=lambda v: v.name)
def test_refused_without_dq_on_bf16(v):
    over = {"bwd_dq_bf16": False} if v.route == "fp8_token" else {}
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dq_first"):
        render_with_flags(v, bwd_dq_first=True, **over)


def test_ab_tag():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    # D = 128: every per-token tile has it, the bf16 route's 4 too (rounds 43–44); D = 64: the det ones lack it (the
    # bf16 route's 2 among them: its 2 others have it since round 44)
    for hd, n_on, n_off in ((128, 0, 8), (64, 6, 4)):
        bwd, _ = base_variants(routes=("fp8_token", "fp8_token_bf16qk", "fp8_pv", "bf16"), head_dim=hd)
        on = [v for t, v in experiment_variants(("dqfirst",), base_variants=bwd, experiments=EXPERIMENTS) if t == "dqfirst"]
        off = [v for t, v in experiment_variants(("nodqfirst",), base_variants=bwd, experiments=EXPERIMENTS)
               if t == "nodqfirst"]
        assert len(on) == n_on and len(off) == n_off
        assert {v.route for v in off} == {"fp8_token", "fp8_token_bf16qk"}
        assert {v.route for v in on} == (set() if hd == 128 else {"bf16", "fp8_token", "fp8_token_bf16qk"})
        assert all(dict(v.params).get("deterministic") for v in on)
        # each tag turns the flag the other way from its base kernel's default (the tags' `when` mirrors the template)
        base = lambda v: rendered_params(  # noqa: E731
            render_variant(next(b for b in bwd if v.name.startswith(b.name + "_x"))))
        assert all("bwd_dq_first" not in base(v) for v in on)
        assert all(base(v).get("bwd_dq_first") is True for v in off)


@pytest.mark.compile
@pytest.mark.parametrize("route", ["fp8_token", "bf16"])
def test_compile_dq_first_not_serialised(compile_sm90, tmp_path, route):
    """The flagged D = 128 tile compiles for sm_90a and ptxas keeps its wgmmas asynchronous (the SASS)."""
    from flamia_gen.bench.sass import describe, missing_tools, serialised

    if missing_tools():
        pytest.skip(missing_tools())

    v = next(x for x in BWD if x.route == route and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    ptx = compile_sm90(v, source=render_with_flags(v, bwd_dq_first=True))
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)
    loops = describe(str(tmp_path / f"{v.name}.o"))["loops"]
    assert loops and not any(serialised(lp) for lp in loops), loops
