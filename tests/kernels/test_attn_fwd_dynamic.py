"""The forward's template flag `fwd_dynamic` (persistent CTAs that take the next unit from an atomic counter): on by
default (since 2026-12-02), what it renders (the counter ARG, warp 0's publish and the consumers' receive in the order that cannot
deadlock, the barrier counts), refused with one CTA per unit, and that it cross-compiles (`-m compile`). Runtime side:
the last test here (a zeroed counter per call). The H200 A/B: `bench.fwd_experiments` tag nodyn (the round-robin before it)."""

from __future__ import annotations

import re

import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_literal
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
FWD = [v for v in PLAN.variants if v.kind.value == "attn_fwd"]


def _fp8_m192():
    return next(x for x in FWD if x.route == "fp8_token" and x.param("head_dim") == 128 and x.param("causal")
                and x.param("tile_m") == 192 and x.param("compute_warpgroups") == 3)


def test_dynamic_scheduler_is_the_default_of_every_persistent_forward():
    """Every sm90 forward of the plan is persistent and renders the counter; fwd_dynamic=false (tag nodyn) renders the
    round-robin without it, and one CTA per unit (scheduler static) has no counter either."""
    from flamia_gen.bench.fwd_experiments import experiment_variants

    assert FWD
    for v in FWD:
        src = render_variant(v)
        assert v.param("scheduler") != "static", v.name
        assert "unit_counter" in src and ".publish_next(" in src, v.name
        assert rendered_literal(src, "PARAMS")["fwd_dynamic"] is True, v.name
    v = _fp8_m192()
    off = render_with_flags(v, fwd_dynamic=False)
    assert "unit_counter" not in off and "publish_next" not in off
    assert "fwd_dynamic" not in rendered_literal(off, "PARAMS")
    static = render_with_flags(v, scheduler="static")
    assert "unit_counter" not in static and "class StaticScheduler:" in static
    tagged = {t: x for t, x in experiment_variants(("nodyn",), base_variants=[v])}
    assert dict(tagged["nodyn"].params)["fwd_dynamic"] is False


def test_dynamic_scheduler_renders_the_counter_and_the_hand_over():
    """On: the ARGS take `unit_counter` right after `work` (the __call__ and the fake args in the same place), warp 0
    publishes each next unit (atomic add, UNIT_EMPTY, the word, UNIT_FULL) after issuing the unit's loads, every
    consumer thread receives it (UNIT_FULL, the word, UNIT_EMPTY) after its epilogue and arrives once on UNIT_EMPTY
    before its loop; the barrier count is warp 0 plus the consumer warpgroups; the ids do not collide with the ring's."""
    v = _fp8_m192()
    src = render_variant(v)
    assert src == render_with_flags(v, fwd_dynamic=True)
    names = [a["name"] for a in rendered_literal(src, "ARGS")]
    assert names[names.index("work") + 1] == "unit_counter"
    assert rendered_literal(src, "PARAMS")["fwd_dynamic"] is True
    assert "mWork: cute.Tensor, mUnitCtr: cute.Tensor, softmax_scale: Float32" in src
    assert "args = (*inputs, cu, row_doc, work, unit_counter, Float32(1.0), o, lse, stream)" in src
    assert re.search(r"^UNIT_THREADS = 32 \+ 128 \* 3  #", src, re.M)
    full = int(re.search(r"^UNIT_FULL_BAR = (\d+)", src, re.M).group(1))
    empty = int(re.search(r"^UNIT_EMPTY_BAR = (\d+)", src, re.M).group(1))
    ring0 = int(re.search(r"^EX2_RING_BAR0 = (\d+)", src, re.M).group(1))
    used = set(range(1, 4)) | set(range(ring0, ring0 + 3))  # the epilogue's 1 … WG, the ring's
    assert full != empty and not {full, empty} & used and max(full, empty) < 16
    pub = src[src.index("    def publish_next("):src.index("    def receive_next(")]
    rec = src[src.index("    def receive_next("):src.index("    def next_unit(")]
    order = lambda text, keys: [k for _, k in sorted((text.index(k), k) for k in keys)]  # noqa: E731
    keys = ["atomic_add_i32(", "barrier(barrier_id=UNIT_EMPTY_BAR", "sUnit[0] = v", "barrier_arrive(barrier_id=UNIT_FULL_BAR"]
    assert order(pub, keys) == keys
    keys = ["barrier(barrier_id=UNIT_FULL_BAR", "v = sUnit[0]", "barrier_arrive(barrier_id=UNIT_EMPTY_BAR"]
    assert order(rec, keys) == keys
    assert src.count(".publish_next(mUnitCtr, sUnit)") == 1 and src.count(".receive_next(sUnit)") == 1
    load = src[src.index("    def load(self"):src.index("    def load_k(self")]
    assert load.index("kv_state.advance()") < load.index(".publish_next(")  # after the unit's loads
    mma = src[src.index("    def mma(self"):src.index("    def one_tile(self") if "    def one_tile(self" in src else None]
    assert mma.index("# sUnit starts free") < mma.index("while unit < num_units:") < mma.index("self.epilogue(") \
        < mma.index(".receive_next(sUnit)")
    with pytest.raises(Exception, match="fwd_dynamic_needs_persistent_ctas"):
        render_with_flags(v, fwd_dynamic=True, scheduler="static")


@pytest.mark.compile
def test_compile_dynamic_scheduler(compile_sm90):
    v = _fp8_m192()
    ptx = compile_sm90(v)
    assert len(re.findall(r"atom\.global\.add\.s32", ptx)) == 1
    bars = re.findall(r"bar(?:rier)?(?:\.cta)?\.(sync|arrive)(?:\.aligned)?\s+(8|9),\s*(\d+)", ptx)
    assert bars and {int(n) for _, _, n in bars} == {32 + 128 * 3}
    assert {k for k, _, _ in bars} == {"sync", "arrive"}


def test_run_attn_fwd_gives_the_dynamic_scheduler_a_zeroed_counter_per_call():
    """The wrapper passes a fresh zeroed int32 word as `unit_counter` (in ARGS order) on every call: what a launch
    leaves there (the number of units it handed out) must not reach the next launch."""
    torch = pytest.importorskip("torch")
    from flamia_gen.runtime.attn_fwd import run_attn_fwd

    v = _fp8_m192()
    src = render_variant(v)
    lit_args, params = rendered_literal(src, "ARGS"), rendered_literal(src, "PARAMS")
    T, HQ, HKV, D = 40, 4, 2, 128
    g = torch.Generator().manual_seed(0)
    x = dict(q=torch.randint(0, 0x70, (T, HQ, D), dtype=torch.uint8, generator=g),
             k=torch.randint(0, 0x70, (T, HKV, D), dtype=torch.uint8, generator=g),
             v=torch.randint(0, 0x70, (HKV, D, 48), dtype=torch.uint8, generator=g),
             q_scale=torch.full((T, HQ), 127, dtype=torch.uint8), k_scale=torch.full((T, HKV), 127, dtype=torch.uint8),
             v_scale=torch.full((T, HKV), 127, dtype=torch.uint8))
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)
    names = [a["name"] for a in lit_args]
    counters = []
    for _ in range(2):
        seen = []
        run_attn_fwd(lambda *a: seen.extend(a), lit_args, x["q"], x["k"], x["v"], x["q_scale"], x["k_scale"],
                     x["v_scale"], cu_seqlens=cu, params=params)
        assert len(seen) == len(names)
        c = seen[names.index("unit_counter")]
        assert c.dtype == torch.int32 and c.shape == (1,) and int(c[0]) == 0
        c += 7  # a launch leaves its count behind
        counters.append(c)
    assert counters[0] is not counters[1] and int(counters[0][0]) == 7
