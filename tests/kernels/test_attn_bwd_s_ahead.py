"""The next tile's Sᵀ issued under this tile's dQ epilogue (flag `bwd_s_ahead`; docs/kernels/attn_bwd.md "The next
tile's Sᵀ under the dQ epilogue"; templates/sm90/attn_bwd.py.j2). Experiment, off: measured round 46 (H100) at
1.02–1.04× the default causal, 0.99–1.02× non-causal, bitwise equal.

CPU: off in every default render; on fp8_token's D = 128 non-deterministic tiles every tile but a unit's last issues
the next tile's Sᵀ after its own dK, from the next Q stage, and waits one group later on that path; `mma` issues a
unit's first Sᵀ and peels the unit's last tile into compile-time copies that issue none (ptxas must find the same
groups in flight at every tile's entry). Refused where it is not built (bf16: C7512; deterministic, diagonal-copy,
32×32-block tiles; no bwd_dq_first). `-m compile`: the flagged tile compiles for sm_90a and ptxas keeps every wgmma
asynchronous (a runtime branch on "last tile" made it serialise them: C7514).

`bwd_s_ahead_late` (with it): the next Sᵀ issued after the tile's dQ hand-off instead of before the dQ epilogue
(round 46: 1.00–1.01×, i.e. what `sahead` lost was the early wait and issue, not the accumulator held across tiles).
"""

from __future__ import annotations

import re
import textwrap

import jinja2
import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
ON_OK = [v for v in BWD if v.route == "fp8_token" and v.param("head_dim") == 128
         and not dict(v.params).get("deterministic")]
NEXT_S = "self.gemm(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, q_next.index], True)"


def _method(src: str, name: str) -> str:
    start = src.index(f"    def {name}(")
    end = src.find("\n    @cute.jit", start)
    return src[start:end if end > 0 else len(src)]


def _branches(tile: str) -> tuple[str, str]:
    """The tail's two compile-time paths: `if const_expr(ahead):` and its `else:` (8-space indentation)."""
    head, rest = tile.split("        if const_expr(ahead):\n")
    ahead, last = rest.split("\n        else:\n", 1)
    last = last.split("\n        pipe_q.consumer_release(q_state)\n")[0]
    return ahead, last


def test_off_by_default():
    for v in BWD:
        src = render_variant(v)
        assert "bwd_s_ahead" not in rendered_params(src), v.name
        assert "q_next" not in src and "ahead: cutlass.Constexpr" not in src, v.name


def test_on_off_explicitly_is_the_default():
    for v in ON_OK:
        assert render_with_flags(v, bwd_s_ahead=False) == render_variant(v)


@pytest.mark.parametrize("v", ON_OK, ids=lambda v: v.name)
def test_the_next_s_is_issued_after_dk_with_one_more_group_in_flight(v):
    src = render_with_flags(v, bwd_s_ahead=True)
    assert rendered_params(src)["bwd_s_ahead"] is True
    tile = _method(src, "one_tile")
    # the tile no longer issues its own Sᵀ nor waits for its Q stage: both were done by the tile before (or mma)
    assert "acc_S = cute.make_rmem_tensor" not in tile
    assert "pipe_q.consumer_wait(q_state)" not in tile
    assert tile.count("self.gemm(tiled_mma_sdp, acc_dP, tSrV, tSrdO[None, None, None, st], True)") == 1
    ahead, last = _branches(tile)
    # ahead: dQ, dK, then the next stage's wait and its Sᵀ; one group more in flight at both waits
    dk = "self.gemm(tiled_mma_dkv, acc_dK, tdKrdS, tdKrQ[None, None, None, st], False)"
    pre = tile.split("        if const_expr(ahead):\n")[0]
    code = [ln.strip() for ln in pre.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert code[-1] == dk
    assert ahead.index("q_next.advance()") < ahead.index("pipe_q.consumer_wait(q_next)") < ahead.index(NEXT_S)
    waits = re.findall(r"warpgroup\.wait_group\((\d)\)", ahead)
    assert waits == ["2", "1"], waits
    assert re.findall(r"warpgroup\.wait_group\((\d)\)", last) == ["1", "0"]
    assert NEXT_S not in last
    # the dQ epilogue between the waits is the same on both paths
    epi = [textwrap.dedent(b.split("warpgroup.wait_group(", 1)[1].split("\n", 1)[1].rsplit("warpgroup.wait_group(", 1)[0])
           for b in (ahead, last)]
    assert epi[0] == epi[1] and "DQ_FULL_BAR" in epi[0]
    # and it is the default tile's, indented once more
    default_tile = _method(render_variant(v), "one_tile")
    assert textwrap.indent(epi[0], " " * 8) in default_tile


@pytest.mark.parametrize("v", ON_OK, ids=lambda v: v.name)
def test_mma_issues_the_first_s_and_peels_the_last_tile(v):
    mma = _method(render_with_flags(v, bwd_s_ahead=True), "mma")
    first = "self.gemm(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, q_state.index], True)"
    assert mma.count(first) == 1
    assert mma.index("pipe_kv.consumer_wait(kv_state)") < mma.index("pipe_q.consumer_wait(q_state)") < mma.index(
        first) < mma.index("for hh in cutlass.range(group, unroll=1):")
    calls = re.findall(r"acc_S, (True|False), (True|False)\)", mma)
    # in the loop: interior and masked copies that issue the next Sᵀ; after it: the unit's last tile, both copies
    assert calls == [("False", "True"), ("True", "True"), ("False", "False"), ("True", "False")], calls
    loop, peeled = mma.split("                head = hkv * group + group - 1\n")
    assert "if (hh < group - 1) | (mi < m_hi - m_lo - 1):" in loop
    assert "m_block = m_hi - 1" in peeled
    assert peeled.index("acc_S, True, False)") < peeled.index("pipe_kv.consumer_release(kv_state)")
    assert "acc_S = cute.make_rmem_tensor(" in mma.split("while unit < num_units:")[0]


@pytest.mark.parametrize("v", ON_OK, ids=lambda v: v.name)
def test_late_issues_the_next_s_after_the_hand_off(v):
    src = render_with_flags(v, bwd_s_ahead=True, bwd_s_ahead_late=True)
    assert rendered_params(src)["bwd_s_ahead_late"] is True
    ahead, last = _branches(_method(src, "one_tile"))
    # the default's waits around the epilogue, the next Sᵀ after the hand-off to the writer warp, then dK's wait
    assert re.findall(r"warpgroup\.wait_group\((\d)\)", ahead) == ["1", "1"]
    assert ahead.index("DQ_FULL_BAR") < ahead.index("pipe_q.consumer_wait(q_next)") < ahead.index(NEXT_S) < ahead.rindex(
        "warpgroup.wait_group(1)")
    assert last == _branches(_method(render_with_flags(v, bwd_s_ahead=True), "one_tile"))[1]
    assert _method(src, "mma") == _method(render_with_flags(v, bwd_s_ahead=True), "mma")


def test_refusals():
    def one(route, **kw):
        return next(v for v in BWD if v.route == route and v.param("head_dim") == kw.get("hd", 128)
                    and bool(dict(v.params).get("deterministic")) is kw.get("det", False))

    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_s_ahead_serialises_the_bf16_tile"):
        render_with_flags(one("bf16"), bwd_s_ahead=True)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_s_ahead_is_built_for_the_plain"):
        render_with_flags(one("fp8_token", det=True), bwd_s_ahead=True)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_s_ahead_needs_bwd_dq_first"):
        render_with_flags(ON_OK[0], bwd_s_ahead=True, bwd_dq_first=False)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_s_ahead_needs"):
        render_with_flags(ON_OK[0], bwd_s_ahead=True, stages=1)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_s_ahead_late_needs_bwd_s_ahead"):
        render_with_flags(ON_OK[0], bwd_s_ahead_late=True)
    mx = [v for v in BWD if v.route == "mxfp8" and not dict(v.params).get("deterministic")]
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_s_ahead"):
        render_with_flags(mx[0], bwd_s_ahead=True)


def test_ab_tag():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("fp8_token", "bf16"), head_dim=128)
    for tag in ("sahead", "saheadlate"):
        tagged = [v for t, v in experiment_variants((tag,), base_variants=bwd, experiments=EXPERIMENTS) if t == tag]
        assert sorted(v.name for v in tagged) == sorted(f"{v.name}_x{tag}" for v in ON_OK)
        p = [rendered_params(render_variant(v)) for v in tagged]
        assert all(x["bwd_s_ahead"] is True and (x.get("bwd_s_ahead_late") is True) is (tag == "saheadlate") for x in p)


@pytest.mark.compile
def test_compile_not_serialised(compile_sm90, tmp_path):
    """fp8_token D = 128 causal with the flag: compiles for sm_90a, waits with two groups in flight, and ptxas keeps
    every wgmma asynchronous (the SASS)."""
    from flamia_gen.bench.sass import describe, missing_tools, serialised

    if missing_tools():
        pytest.skip(missing_tools())
    v = next(x for x in ON_OK if x.param("causal"))
    ptx = compile_sm90(v, source=render_with_flags(v, bwd_s_ahead=True))
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+2;", ptx)
    loops = describe(str(tmp_path / f"{v.name}.o"))["loops"]
    assert loops and not any(serialised(lp) for lp in loops), loops
