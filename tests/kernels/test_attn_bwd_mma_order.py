"""The BF16 backward tile's wgmma order (flag `bwd_mma_overlap`) and its dS store by stmatrix (flag `bwd_ds_stsm`):
both experiments, off by default (docs/kernels/attn_bwd.md "The MMAs' order in a BF16 tile")."""
from __future__ import annotations

import re

import jinja2
import pytest

from flamia_gen.plan.variants import expand_family
from flamia_gen.render.render import render_variant
from flamia_gen.spec import load_specs

from test_attn_bwd_template import _render_with


def _variants(route):
    specs = load_specs()
    fam = specs.families["attn_bwd_sm90"]
    return expand_family(fam.model_copy(update={"routes": [route]}), specs).variants


BF16 = _variants("bf16")


def _one_tile(src: str) -> str:
    body = src[src.index("    def one_tile("):]
    return body[:body.index("\n    @cute.jit", 10)]


def test_flags_off_render_the_default_bytes():
    for v in BF16:
        src = render_variant(v)
        assert _render_with(v, bwd_mma_overlap=False, bwd_ds_stsm=False) == src
        assert "StMatrix" not in src and "wait_group(1)" not in src


@pytest.mark.parametrize("causal", [True, False])
def test_mma_overlap_order(causal):
    """Sᵀ and dPᵀ issued, wait for Sᵀ alone (wait_group(1)), the P pass, dV issued, wait for dPᵀ (wait_group(1)), the
    dS pass, dS to shared memory, the 256-thread barrier, dQ issued then dK, wait for dQ (wait_group(1)), the dQ
    stores handed to the writer, then wait_group(0) before the Q stage is released."""
    v = next(v for v in BF16 if v.param("head_dim") == 128 and v.param("causal") == causal
             and not dict(v.params).get("deterministic"))
    body = _one_tile(_render_with(v, bwd_mma_overlap=True))
    seq = [
        "self.gemm(tiled_mma_sdp, acc_S,",
        "self.gemm(tiled_mma_sdp, acc_dP,",
        "warpgroup.wait_group(1)",
        "p = ex2(",
        "self.gemm(tiled_mma_dkv, acc_dV,",
        "warpgroup.wait_group(1)",
        "ds = acc_S[i] * (acc_dP[i] - dl[cp])",
        "dst[i] = rdS[i]",
        "cute.arch.barrier(barrier_id=1,",
        "self.gemm(tiled_mma_dq, acc_dQ,",
        "self.gemm(tiled_mma_dkv, acc_dK,",
        "warpgroup.wait_group(1)",
        "cute.arch.barrier(barrier_id=DQ_EMPTY_BAR",
        "cute.arch.barrier_arrive(barrier_id=DQ_FULL_BAR",
        "warpgroup.wait_group(0)",
        "pipe_q.consumer_release(q_state)",
    ]
    at = 0
    for s in seq:
        at = body.index(s, at) + 1
    assert body.count("warpgroup.wait_group(0)") == 1 and body.count("warpgroup.wait_group(1)") == 3
    # both passes zero the masked pairs (the dS pass sets 0: a NaN dP of another document does not leak through 0·NaN)
    assert body.count("p = Float32(0.0)") == 1 and body.count("ds = Float32(0.0)") == 1
    assert body.count("kk > qq") == (2 if causal else 0)


@pytest.mark.parametrize("route", ["fp8_token", "fp8_pv", "mxfp8"])
def test_flags_refuse_the_fp8_tiles(route):
    v = next(v for v in _variants(route) if v.param("head_dim") == 128 and v.param("causal"))
    for flag in ("bwd_mma_overlap", "bwd_ds_stsm"):
        with pytest.raises(jinja2.exceptions.UndefinedError, match=flag):
            _render_with(v, **{flag: True})


def test_mma_overlap_needs_the_writer_warp_and_interior_tiles():
    """Not with the deterministic dQ (no writer warp there), without the writer warp, or with masks everywhere."""
    v = next(v for v in BF16 if v.param("head_dim") == 128 and v.param("causal") and not dict(v.params).get("deterministic"))
    det = next(v for v in BF16 if v.param("head_dim") == 128 and v.param("causal") and dict(v.params).get("deterministic"))
    for w, over in ((v, {"bwd_dq_warp": False}), (v, {"bwd_interior_nomask": False}), (det, {})):
        with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_mma_overlap"):
            _render_with(w, bwd_mma_overlap=True, **over)


@pytest.mark.parametrize("overlap", [False, True])
def test_ds_stsm_stores_through_the_tiled_copy(overlap):
    v = next(v for v in BF16 if v.param("head_dim") == 128 and v.param("causal"))
    src = _render_with(v, bwd_ds_stsm=True, bwd_mma_overlap=overlap)
    assert "StMatrix8x8x16bOp(transpose=True, num_matrices=4)" in src
    assert "tSsdS = self.ds_store_copy(tiled_mma_sdp).get_slice(tidx).partition_D(sdSt)" in src
    body = _one_tile(src)
    assert "dst[i] = rdS[i]" not in body
    assert len(re.findall(r"cute\.copy\(stsm, stsm\.get_slice\(tidx\)\.retile\(rdS\), tSsdS\[None, None, None, buf\]\)",
                          body)) == 1


@pytest.mark.compile
def test_compile_both_flags(compile_sm90):
    """sm_90a: the dS leaves in 4 stmatrix per tile copy (8 in the kernel: interior and masked copies), no 16-bit
    stores of it, and the four wgmma waits per copy of the overlap order."""
    v = next(v for v in BF16 if v.param("head_dim") == 128 and v.param("causal")
             and not dict(v.params).get("deterministic"))
    ptx = compile_sm90(v, source=_render_with(v, bwd_mma_overlap=True, bwd_ds_stsm=True))
    assert len(re.findall(r"stmatrix\.sync\.aligned\.(?:m8n8\.)?x4\.trans\.shared(?:::cta)?\.b16", ptx)) == 8
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == 6
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)) == 2



# ----------------------------------------------------------------------------- bwd_dq_tma_writer
def _writer(src: str) -> str:
    body = src[src.index("    def dq_writer("):]
    return body[:body.index("\n    @cute.jit", 10)]


@pytest.mark.parametrize("route", ["bf16", "fp8_token"])
def test_dq_tma_writer_hands_the_box_to_the_writer(route):
    """The consumers wait DQ_EMPTY, fill the dense staging tile (rows outside the document 0 on masked tiles), fence and
    arrive on DQ_FULL, with no 256-thread barrier and no TMA issue of their own; the writer waits DQ_FULL and issues
    one TMA reduce of the box, commits, waits for its read and hands the tile back. Off renders the default bytes."""
    v = next(v for v in _variants(route) if v.param("head_dim") == 128 and v.param("causal")
             and not dict(v.params).get("deterministic"))
    assert _render_with(v, bwd_dq_tma_writer=False) == render_variant(v)
    src = _render_with(v, bwd_dq_tma=True, bwd_dq_tma_writer=True)
    tile = _one_tile(src)
    seq = ["cute.arch.barrier(barrier_id=DQ_EMPTY_BAR", "tdQsdQ[i] = v", "cute.arch.fence_view_async_shared()",
           "cute.arch.barrier_arrive(barrier_id=DQ_FULL_BAR"]
    at = tile.index("HQ = mdQacc.shape[1]")  # the dQ write-out: the tile's last stretch
    for s in seq:
        at = tile.index(s, at) + 1
    assert "cute.copy(tma_atom_dq" not in tile and "bulk_reduce_add_f32(" not in tile
    w = _writer(src)
    at = 0
    for s in ["cute.arch.barrier(barrier_id=DQ_FULL_BAR", "cute.copy(tma_atom_dq, tdQs, tdQg)",
              "cute.arch.cp_async_bulk_commit_group()", "cute.arch.cp_async_bulk_wait_group(0, read=True)",
              "cute.arch.barrier_arrive(barrier_id=DQ_EMPTY_BAR"]:
        at = w.index(s, at) + 1
    assert "bulk_reduce_add_f32(" not in w
    assert "self.dq_writer(mCu, mWork, sUnit, mdQacc, sdQ, HKV, num_units, tma_atom_dq, mdQt)" in src


def test_mma_overlap_with_the_tma_writer():
    """bwd_mma_overlap's own body with the TMA writer: the dense staging tile (rows outside the document 0 on masked tiles),
    handed over as the default body does; without the writer (the consumers issuing the TMA reduce) it still refuses."""
    v = next(v for v in BF16 if v.param("head_dim") == 128 and v.param("causal")
             and not dict(v.params).get("deterministic"))
    tile = _one_tile(_render_with(v, bwd_dq_tma=True, bwd_dq_tma_writer=True, bwd_mma_overlap=True))
    ov = tile[:tile.index("        return q_state")]  # the overlap body comes first in one_tile
    at = ov.index("self.gemm(tiled_mma_dkv, acc_dK,")
    for s in ["cute.arch.barrier(barrier_id=DQ_EMPTY_BAR", "tdQsdQ = tiled_mma_dq.get_slice(tidx).partition_C(sdQ)",
              "if (qrow0 + tdQcdQ[i][0] < 0) | (qrow0 + tdQcdQ[i][0] >= doc_len):", "tdQsdQ[i] = v",
              "cute.arch.fence_view_async_shared()", "cute.arch.barrier_arrive(barrier_id=DQ_FULL_BAR",
              "warpgroup.wait_group(0)"]:
        at = ov.index(s, at) + 1
    assert "v = acc_dQ[i] * softmax_scale" in ov and "cute.autovec_copy(v2, dst2)" not in ov
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_mma_overlap"):
        _render_with(v, bwd_dq_tma=True, bwd_mma_overlap=True)


def test_dq_tma_writer_refusals():
    v = next(v for v in BF16 if v.param("head_dim") == 128 and v.param("causal") and not dict(v.params).get("deterministic"))
    d64 = next(v for v in BF16 if v.param("head_dim") == 64 and v.param("causal") and not dict(v.params).get("deterministic"))
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dq_tma_writer"):
        _render_with(v, bwd_dq_tma=True, bwd_dq_tma_writer=True, bwd_dq_warp=False)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dq_tma_writer"):
        _render_with(d64, bwd_dq_tma=True, bwd_dq_tma_writer=True)  # two writer warps at D = 64
    # without bwd_dq_tma the flag does nothing
    assert _render_with(v, bwd_dq_tma_writer=True) == render_variant(v)


@pytest.mark.compile
def test_compile_dq_tma_writer(compile_sm90):
    v = next(v for v in BF16 if v.param("head_dim") == 128 and v.param("causal")
             and not dict(v.params).get("deterministic"))
    ptx = compile_sm90(v, source=_render_with(v, bwd_dq_tma=True, bwd_dq_tma_writer=True))
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx)) == 1
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" not in ptx


# ----------------------------------------------------------------------------- experiment copies: feasibility
def test_experiment_copies_past_the_shared_memory_limit_are_left_out(capsys):
    """An experiment copy goes through the planner's feasibility check: bf16 D = 128 with 4 Q/dO stages needs more
    shared memory than an SM gives one CTA (a two-stage dQ staging copy once failed only at launch, 2026-12-03)."""
    from flamia_gen.bench.fwd_experiments import experiment_variants

    base = [v for v in BF16 if v.param("head_dim") == 128]
    ex = {"big": dict(over={"stages": 4}, when=lambda p: True, note=""),
          "ok": dict(over={"bwd_ds_stsm": True}, when=lambda p: True, note="")}
    out = experiment_variants(["big", "ok"], base_variants=base, experiments=ex)
    assert [t for t, _ in out].count("big") == 0 and [t for t, _ in out].count("ok") == len(base)
    assert "shared memory" in capsys.readouterr().err
