"""The template flags `bwd_head_section` (the unit list with KV heads in sections; runtime side:
tests/runtime/test_attn_bwd_head_units.py), `bwd_persistent` and `bwd_dynamic`: what they render and that they
cross-compile (`-m compile`). Default since 2026-12-02 (fourteenth session): persistent CTAs taking units from an atomic
counter over sections of 2, where the schedule allows; one CTA per unit (the thirteenth session's default) renders with
bwd_persistent=false. The H200 A/B: `bench.bwd_experiments` tags pers, onecta, hs0, hs1, dhs1, dyndet."""

from __future__ import annotations

import re

import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_literal
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]


def _dynamic_by_default(p: dict) -> bool:
    """The template's BWD_DYNAMIC_DEFAULT: no ordered dQ, no tensor-scaled dS (fp8_tensor's two launches)."""
    return not p.get("deterministic") and p.get("ds_gran") != "tensor"


def test_dynamic_scheduler_and_two_head_sections_by_default_where_the_schedule_allows():
    """Default: persistent CTAs that take units from the counter (the dynamic class, grid = min(units, SMs)) with the KV
    heads in sections of 2; the round-robin (and no unit list) for the deterministic dQ and fp8_tensor. The experiment
    module's predicate agrees with the template. No default renders one CTA per unit (nor its padding exit)."""
    from flamia_gen.bench.bwd_experiments import _dynamic_default

    seen = {True: 0, False: 0}
    for v in BWD:
        src = render_variant(v)
        p = rendered_literal(src, "PARAMS")
        dyn = _dynamic_by_default(dict(v.params))
        assert dyn == _dynamic_default(dict(v.params)), v.name
        seen[dyn] += 1
        assert "class StaticScheduler:" not in src and "exit_cta" not in src and "bwd_persistent" not in p, v.name
        if dyn:
            assert p.get("bwd_dynamic") is True and p.get("bwd_head_section") == 2, v.name
            assert "class DynamicScheduler:" in src and "unit_counter" in src, v.name
        else:
            assert "bwd_dynamic" not in p and "bwd_head_section" not in p and "unit_counter" not in src, v.name
            assert "class LongestFirstScheduler:" in src, v.name
    assert seen[True] >= 8 and seen[False] >= 8
    assert any(dict(v.params).get("ds_gran") == "square_32" and _dynamic_by_default(dict(v.params)) for v in BWD)
    det = next(x for x in BWD if dict(x.params).get("deterministic"))
    with pytest.raises(Exception, match="deterministic_dq_needs_a_persistent_scheduler"):
        render_with_flags(det, bwd_persistent=False)
    # sections keep its order
    assert rendered_literal(render_with_flags(det, bwd_head_section=2), "PARAMS")["bwd_head_section"] == 2


def test_one_cta_per_unit_renders_the_padding_exit_first():
    """bwd_persistent off (the thirteenth session's default, tag onecta): the static class, sections of 2, and a padding
    unit's CTA leaves before any set-up (its first statement), every thread of it."""
    v = next(x for x in BWD if x.route == "fp8_token" and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    src = render_with_flags(v, bwd_persistent=False)
    p = rendered_literal(src, "PARAMS")
    assert p.get("bwd_persistent") is False and p.get("bwd_head_section") == 2 and "bwd_dynamic" not in p
    assert "class StaticScheduler:" in src and "class LongestFirstScheduler:" not in src and "unit_counter" not in src
    body = src[src.index("    def kernel(self"):]
    body = body[body.index("):\n") + 3:]
    first = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")][:2]
    assert first == ["if mWork[StaticScheduler.initial_unit(), 0] < 0:", "exit_cta()"], first


def test_flag_renders_the_unit_list():
    v = next(x for x in BWD if x.route == "fp8_token" and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    off = render_with_flags(v, bwd_dynamic=False, bwd_head_section=0)
    off_params = rendered_literal(off, "PARAMS")
    assert "bwd_head_section" not in off_params and "bwd_persistent" not in off_params
    assert next(a for a in rendered_literal(off, "ARGS") if a["name"] == "work")["shape"] == ["NUM_WORK", "3"]
    assert "hkv = mWork[item, 3]" not in off
    on = render_with_flags(v, bwd_head_section=2)
    assert rendered_literal(on, "PARAMS")["bwd_head_section"] == 2
    assert next(a for a in rendered_literal(on, "ARGS") if a["name"] == "work")["shape"] == ["NUM_UNITS", "4"]
    assert "hkv = mWork[item, 3]" in on and "item = unit // HKV" not in on
    # every unit count is the unit list's length (not × HKV): the grid and the loops' bound
    assert len(re.findall(r"num_units = mWork\.shape\[0\]\n", on)) == 2 and "mWork.shape[0] * HKV" not in on
    assert "work = make_fake_compact_tensor(Int32, (nw, 4)" in on


@pytest.mark.compile
def test_compile_head_sections_one_cta_per_unit(compile_sm90):
    """Cross-compiles the flag with the one-CTA-per-unit scheduler (the A/B copy `onecta` of bench.bwd_experiments)."""
    v = next(x for x in BWD if x.route == "bf16" and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    ptx = compile_sm90(v, source=render_with_flags(v, bwd_persistent=False))  # bwd_head_section 2 by default
    assert "cp.reduce.async.bulk" in ptx
    assert len(re.findall(r"^\s*exit;", ptx, re.M)) == 1  # the padding unit's early exit


# ---------------------------------------------------------------- bwd_dynamic (the default since 2026-12-02)


def test_dynamic_scheduler_renders_the_counter_and_the_hand_over():
    """bwd_dynamic (the default where the schedule allows): the ARGS take `unit_counter` after `work`, warp 0 publishes
    each next unit (an atomic add on the counter, UNIT_EMPTY then UNIT_FULL) and every other role receives it (UNIT_FULL
    then UNIT_EMPTY, after one UNIT_EMPTY arrive before its loop); the barrier counts include exactly the warps that
    take part; refused with one CTA per unit or fp8_tensor's two launches."""
    v = next(x for x in BWD if x.route == "fp8_token" and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    src = render_variant(v)
    assert src == render_with_flags(v, bwd_dynamic=True, bwd_persistent=True, bwd_head_section=2)
    names = [a["name"] for a in rendered_literal(src, "ARGS")]
    assert names[names.index("work") + 1] == "unit_counter"
    assert rendered_literal(src, "PARAMS")["bwd_dynamic"] is True
    m = re.search(r"^UNIT_THREADS = 32 \+ 128 \* 2 \+ 32 \* (\d)  #", src, re.M)
    assert m and int(m.group(1)) == 2  # warp 0, two consumer warpgroups, two writer warps (fp8_token D = 128, round 32)
    pub = src[src.index("    def publish_next("):src.index("    def receive_next(")]
    rec = src[src.index("    def receive_next("):src.index("    def next_unit(")]
    order = lambda text, keys: [k for _, k in sorted((text.index(k), k) for k in keys)]  # noqa: E731
    assert order(pub, ["atomic_add_i32(", "barrier(barrier_id=UNIT_EMPTY_BAR", "sUnit[0] = v",
                       "barrier_arrive(barrier_id=UNIT_FULL_BAR"]) == ["atomic_add_i32(",
                                                                        "barrier(barrier_id=UNIT_EMPTY_BAR",
                                                                        "sUnit[0] = v",
                                                                        "barrier_arrive(barrier_id=UNIT_FULL_BAR"]
    assert order(rec, ["barrier(barrier_id=UNIT_FULL_BAR", "v = sUnit[0]", "barrier_arrive(barrier_id=UNIT_EMPTY_BAR"]) \
        == ["barrier(barrier_id=UNIT_FULL_BAR", "v = sUnit[0]", "barrier_arrive(barrier_id=UNIT_EMPTY_BAR"]
    assert src.count(".publish_next(mUnitCtr, sUnit)") == 1 and src.count(".receive_next(sUnit)") == 2
    assert src.count("barrier_arrive(barrier_id=UNIT_EMPTY_BAR, number_of_threads=UNIT_THREADS)  # sUnit starts free") == 2
    det = next(x for x in BWD if x.route == "fp8_token" and dict(x.params).get("deterministic"))
    # no writer warp
    assert re.search(r"^UNIT_THREADS = 32 \+ 128 \* 2  #", render_with_flags(det, bwd_dynamic=True), re.M)
    with pytest.raises(Exception, match="bwd_dynamic_needs_persistent_ctas_and_one_launch"):
        render_with_flags(v, bwd_dynamic=True, bwd_persistent=False)
    dst = next(x for x in BWD if x.route == "fp8_tensor")
    with pytest.raises(Exception, match="bwd_dynamic_needs_persistent_ctas_and_one_launch"):
        render_with_flags(dst, bwd_dynamic=True)


@pytest.mark.compile
@pytest.mark.parametrize("det", [False, True])
def test_compile_dynamic_scheduler(compile_sm90, det):
    v = next(x for x in BWD if x.route == "fp8_token" and x.param("head_dim") == 128 and x.param("causal")
             and bool(dict(x.params).get("deterministic")) is det)
    ptx = compile_sm90(v, source=render_with_flags(v, bwd_dynamic=True, bwd_head_section=2) if det else None)
    assert len(re.findall(r"atom\.global\.add\.s32", ptx)) == 1
    bars = re.findall(r"bar(?:rier)?(?:\.cta)?\.(sync|arrive)(?:\.aligned)?\s+(9|10),\s*(\d+)", ptx)
    # warp 0, 256 consumer threads and (not deterministic) the writer warps: two at D = 128 since round 32
    assert bars and {int(n) for _, _, n in bars} == {288 if det else 352}


def test_experiment_build_takes_routes_and_head_dim(monkeypatch, tmp_path):
    """`bwd_experiments build --routes mxfp8 --only pers`: the route's backward variants at the head dim, the pers copies
    of the non-deterministic ones, and their op path's forwards and quantizers; nothing of the default routes."""
    from flamia_gen.bench import bwd_experiments as bx

    got = {}

    def fake_bundle(out, vs, jobs=2):
        got["vs"] = list(vs)
        return {"variants": [{"name": v.name} for v in vs]}

    monkeypatch.setattr(bx, "build_variants_bundle", fake_bundle)
    assert bx.main(["build", "-o", str(tmp_path / "b"), "--only", "pers", "--routes", "mxfp8", "--head-dim", "64"]) == 0
    bwd = [v for v in got["vs"] if v.kind.value == "attn_bwd"]
    assert bwd and {v.route for v in bwd} == {"mxfp8"} and {v.param("head_dim") for v in bwd} == {64}
    pers = [v for v in bwd if v.name.endswith("_xpers")]
    assert len(pers) == 2 and not any(dict(v.params).get("deterministic") for v in pers)
    assert all(dict(v.params)["bwd_dynamic"] is False for v in pers)
    assert any(v.kind.value == "attn_fwd" for v in got["vs"]) and any(v.kind.value == "quant" for v in got["vs"])
