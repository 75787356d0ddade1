"""The backward's unit boundary (docs/kernels/attn_bwd.md "The unit boundary"; templates/sm90/attn_bwd.py.j2): two
experiments, off by default, built in the thirty-second session, not yet run on a GPU.

`bwd_kv_early`: the K/V stage released after a unit's last Sᵀ / dPᵀ instead of after its last tile.

CPU: off in every default render; renders for fp8_token's per-token K̂ tile (D = 64 and 128, causal or not,
deterministic or not) and is refused where a later step of the tile still reads the K/V stage (dQ on sK or sKt: bf16,
fp8_pv, fp8_token_bf16qk, the 32×32-block and tensor-scaled tiles). The safety argument is checked on the rendered
source: in both copies of the tile, nothing after the release reads sK, sV or sKt (only the tile's Sᵀ and dPᵀ
products do, before their wait), the stage is released once per unit (the end-of-unit release is gone), and K̂'s scale
codes are loaded before the unit's K/V wait. `-m compile`: the flagged tile compiles for sm_90a with one more mbarrier
arrive site per tile copy.

`bwd_q_ahead`: the producer issues a unit's first STAGES query tiles before it acquires the K/V stage. CPU: renders on
every backward tile, moves the K/V issue (acquire, copies, advance) from before the tile loop to after tile
n_pre − 1 unchanged, and leaves the consumers' code as it was.
"""

from __future__ import annotations

import re

import jinja2
import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
ON_OK = [v for v in BWD if v.route == "fp8_token"]
RELEASE = "pipe_kv.consumer_release("
EARLY = "            pipe_kv.consumer_release(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))\n"


def _method(src: str, name: str) -> str:
    start = src.index(f"    def {name}(")
    end = src.find("\n    @cute.jit", start)
    return src[start:end if end > 0 else len(src)]


def test_off_by_default():
    for v in BWD:
        src = render_variant(v)
        assert "bwd_kv_early" not in rendered_params(src), v.name
        assert "kv_last" not in src and "def k_hat_codes(" not in src, v.name
        assert _method(src, "mma").count(RELEASE) == 1, v.name  # the end-of-unit release


def test_renders_on_every_fp8_token_tile():
    assert len(ON_OK) == 8  # D 64 / 128 × causal or not × deterministic or not
    for v in ON_OK:
        src = render_with_flags(v, bwd_kv_early=True)
        assert rendered_params(src)["bwd_kv_early"] is True
        mma, tile = _method(src, "mma"), _method(src, "one_tile")
        # released once per unit, by its last tile: the mma loop's own release is gone
        assert RELEASE not in mma
        assert "if (hh == group - 1) & (mi == m_hi - m_lo - 1):" in mma
        assert tile.count(EARLY) == 1 and "        if kv_last != 0:\n" in tile
        # K̂'s scale codes before the K/V wait, K̂ built from them after it
        assert mma.index("khc = self.k_hat_codes(mKs, k_tok0, hkv, T, tidx)") < mma.index(
            "pipe_kv.consumer_wait(kv_state)") < mma.index("self.k_to_bf16(sK, sK16, khc, k_tok0, hkv, T, tidx)")
        assert "kc = khc[i]" in _method(src, "k_to_bf16") and "mKs[" not in _method(src, "k_to_bf16")


@pytest.mark.parametrize("v", ON_OK, ids=lambda v: v.name)
def test_nothing_reads_the_stage_after_the_release(v):
    """The invariant the flag rests on: after the release (right after the Sᵀ / dPᵀ wait) the tile touches none of
    sK, sV, sKt or their wgmma fragments; dQ reads sK16 (tdQrK is K̂), dV and dK the Q stage."""
    src = render_with_flags(v, bwd_kv_early=True)
    tile = _method(src, "one_tile")
    head, tail = tile.split(EARLY)
    # released right after the tile's first wait, the one for Sᵀ and dPᵀ
    assert head.count("warpgroup.wait_group(") == 1
    assert "        warpgroup.wait_group(0)\n        if kv_last != 0:\n" in head
    # the products before the release are the stage's readers
    assert "tSrK" in head and "tSrV" in head
    for name in ("tSrK", "tSrV", "sK[", "sV[", "sKt", "tdQrKt"):
        assert name not in tail, (v.name, name)
    # and dQ's B operand is K̂ in sK16 (mma builds tdQrK from sKb = a view of sK16)
    mma = _method(src, "mma")
    assert "sKb = cute.composition(sK16," in mma and "tdQrK = wg_dq.make_fragment_B(wg_dq.partition_B(sKb))" in mma


@pytest.mark.parametrize("route", ["bf16", "fp8_pv", "fp8_token_bf16qk", "fp8_tensor", "mxfp8", "mxfp8_exact",
                                   "nvfp4_mixed"])
def test_refused_where_the_tile_reads_the_stage_later(route):
    v = next(x for x in BWD if x.route == route and x.param("head_dim") == 128)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_kv_early"):
        render_with_flags(v, bwd_kv_early=True)


def test_refused_on_fp8_tokens_e4m3_dq_tile():
    """Without dQ on BF16, fp8_token's dQ reads the E4M3 Kᵀ tile of the stage."""
    v = next(x for x in ON_OK if x.param("head_dim") == 128)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_kv_early"):
        render_with_flags(v, bwd_kv_early=True, bwd_dq_bf16=False)


def test_ab_tag():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    for hd in (128, 64):
        bwd, _ = base_variants(routes=("fp8_token", "fp8_token_bf16qk", "bf16"), head_dim=hd)
        tagged = [v for t, v in experiment_variants(("kvearly",), base_variants=bwd, experiments=EXPERIMENTS)
                  if t == "kvearly"]
        assert len(tagged) == 4 and {v.route for v in tagged} == {"fp8_token"}
        assert all(rendered_params(render_variant(v))["bwd_kv_early"] is True for v in tagged)


@pytest.mark.compile
def test_compile_one_more_arrive_per_tile_copy(compile_sm90):
    """fp8_token D = 128 causal: the flagged kernel compiles; its PTX has the early release in both tile copies (two
    more mbarrier arrives) and drops the end-of-unit one."""
    v = next(x for x in ON_OK if x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    pat = r"mbarrier\.arrive"
    on = len(re.findall(pat, compile_sm90(v, source=render_with_flags(v, bwd_kv_early=True))))
    off = len(re.findall(pat, compile_sm90(v)))
    assert on == off + 1, (on, off)


PRODUCER_KV = "pipe_kv.producer_acquire(kv_state)"


def test_q_ahead_off_by_default_and_renders_everywhere():
    for v in BWD:
        src = render_variant(v)
        assert "bwd_q_ahead" not in rendered_params(src) and "n_pre" not in src, v.name
        on = render_with_flags(v, bwd_q_ahead=True)
        assert rendered_params(on)["bwd_q_ahead"] is True
        load, load_on = _method(src, "load"), _method(on, "load")
        # the K/V issue: one block, once per unit, in the tile loop after the unit's first STAGES tiles
        assert load.count(PRODUCER_KV) == 1 and load_on.count(PRODUCER_KV) == 1
        assert "n_pre = cutlass.min(Int32(self.stages), group * (m_hi - m_lo))" in load_on
        kv = load_on.index(PRODUCER_KV)
        assert load_on.index("for mi in cutlass.range(m_hi - m_lo, unroll=1):") < kv
        assert load_on.rindex("q_state.advance()", 0, kv) > load_on.index("for mi in cutlass.range(")
        assert load_on[:kv].rstrip().endswith("if hh * (m_hi - m_lo) + mi == n_pre - 1:")
        # the block itself is the default's, 12 columns deeper
        block = load[load.index("                " + PRODUCER_KV):load.index("                kv_state.advance()\n")]
        moved = "\n".join(("            " + ln) if ln else ln for ln in block.split("\n"))
        assert moved in load_on, v.name
        # the consumers and the dQ writer are untouched
        for name in ("mma", "one_tile"):
            assert _method(src, name) == _method(on, name), (v.name, name)


def test_q_ahead_tag():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("fp8_token", "bf16", "mxfp8_exact"), head_dim=128)
    tagged = [v for t, v in experiment_variants(("qahead",), base_variants=bwd, experiments=EXPERIMENTS)
              if t == "qahead"]
    assert len(tagged) == len(bwd) == 12


@pytest.mark.compile
def test_compile_q_ahead(compile_sm90):
    """bf16 D = 128 causal: the reordered producer compiles; the K/V TMA copies are still issued once per unit."""
    v = next(x for x in BWD if x.route == "bf16" and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    pat = r"cp\.async\.bulk\.tensor"
    on = compile_sm90(v, source=render_with_flags(v, bwd_q_ahead=True))
    assert len(re.findall(pat, on)) == len(re.findall(pat, compile_sm90(v)))


def test_both_flags_together():
    """bwd_q_ahead with bwd_kv_early (the tag set a GPU session may combine): one producer-side K/V issue in the tile
    loop, one consumer-side release in the tile; the render is valid Python."""
    for v in ON_OK:
        src = render_with_flags(v, bwd_kv_early=True, bwd_q_ahead=True)
        compile(src, v.name, "exec")
        assert _method(src, "load").count(PRODUCER_KV) == 1 and _method(src, "one_tile").count(EARLY) == 1
