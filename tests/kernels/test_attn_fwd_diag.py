"""Token-block routes on the sm90 forward (mxfp8, mxfp8_exact): the diagonal-tile safeguards.

Route.forward_safeguards decides which per-token copies a causal forward reads on its diagonal
tiles (K for k_fold, V for diagonal=per_key_v) and whether Q rows are per token (exact). The
template's producer loads those copies on the masked key tiles (n >= n_mask of key_tiling); the
emulator's `geometry` must call exactly those tiles diagonal, or kernel and emulator round
different values. CPU only, except the `compile` tests (sm_90a cross-compile).
"""

from __future__ import annotations

import re

import pytest
import torch

from flamia_gen.numerics.reference_route import geometry, make_plan as emu_plan
from flamia_gen.render.render import render_variant
from flamia_gen.runtime.attn_fwd import diag_inputs_needed, run_attn_fwd
from flamia_gen.spec import get_route
from flamia_gen.spec.enums import Granularity

from test_attn_fwd_template import VARIANTS, _fp8_inputs, _key_tiling_fn, _literals

DIAG = [v for v in VARIANTS if v.param("diag_k") or v.param("diag_v")]


def _by(route, causal=True, ovl=False, m=128, n=128):
    return next(v for v in VARIANTS if v.route == route and v.param("causal") == causal
                and v.param("intra_wg_overlap") == ovl and v.param("tile_m") == m and v.param("tile_n") == n)


def test_safeguards_per_route():
    """mxfp8: per-key V on diagonal tiles; mxfp8_exact: + per-key K and per-token Q rows; none
    without a causal mask; per-token routes need none."""
    for route, causal, want in [("mxfp8", True, (False, True, False)), ("mxfp8", False, (False, False, False)),
                                ("mxfp8_exact", True, (True, True, True)),
                                ("mxfp8_exact", False, (False, False, True)),
                                ("fp8_token", True, (False, False, False)), ("bf16", True, (False, False, False))]:
        assert tuple(get_route(route).forward_safeguards(causal)) == want, (route, causal)
        v = _by(route, causal)
        assert (v.param("diag_k"), v.param("diag_v"), v.param("rows_q")) == want


def test_diag_variants_exist_and_take_the_copies():
    assert {v.route for v in DIAG} == {"mxfp8", "mxfp8_exact", "nvfp4_mixed"}
    assert all(v.param("causal") for v in DIAG)
    ex = _literals(render_variant(_by("mxfp8_exact")))
    assert [a["name"] for a in ex["ARGS"]][6:10] == ["k_diag", "k_diag_scale", "v_t_diag", "v_diag_scale"]
    assert ex["PARAMS"]["diag_k"] and ex["PARAMS"]["diag_v"]
    mx = _literals(render_variant(_by("mxfp8")))
    assert [a["name"] for a in mx["ARGS"]][6:8] == ["v_t_diag", "v_diag_scale"]
    assert "k_diag" not in [a["name"] for a in mx["ARGS"]]
    nc = _literals(render_variant(_by("mxfp8_exact", causal=False)))
    assert not any("diag" in a["name"] for a in nc["ARGS"]) and "diag_k" not in nc["PARAMS"]
    # per-token routes render without any diagonal-copy code
    src = render_variant(_by("fp8_token"))
    assert not any(w in src for w in ("k_diag", "v_t_diag", "tma_atom_kd", "tma_atom_vd", "mKds", "mVds"))


@pytest.mark.parametrize("v", [v for v in DIAG if v.param("tile_n") == 128 or v.param("tile_m") == 192],
                         ids=lambda v: v.name)
def test_emulator_diagonal_tiles_are_the_kernel_masked_tiles(v):
    key_tiling, c = _key_tiling_fn(render_variant(v))
    tm, tn = c["TILE_M"], c["TILE_N"]
    plan = emu_plan(get_route(v.route), True, tm, tn, 1.0, key_align=c["KEY_ALIGN"])
    assert plan.per_key_v and plan.per_key_k == v.param("diag_k")
    for s in (0, 1, 6, 15, 16, 1000, 1300, 4099):
        for L in (1, 2, 31, 64, 127, 128, 129, 130, 300, 1000):
            delta = s % c["KEY_ALIGN"]
            g = geometry(plan, 0, L, L, L, "cpu", delta)
            for mb in range(-(-L // tm)):
                _, d, nblk, n_mask, n_lo = key_tiling(mb, s, L)
                assert d == delta
                keys = torch.arange(L)
                want = (keys + delta) // tn >= n_mask  # the producer's `n >= n_mask`
                for r in (mb * tm, min((mb + 1) * tm, L) - 1):
                    assert torch.equal(g.diag[r], want), (s, L, mb, r)
                # exactness: every key a 32-token block can share with a later row is per key
                first = mb * tm
                assert bool(want[first - first % 32:].all()) if first < L else True


def test_run_attn_fwd_passes_diag_copies_in_args_order():
    lit = _literals(render_variant(_by("mxfp8_exact")))
    seen = []
    x = _fp8_inputs()
    T, HKV, tpad = 40, 2, x["v"].shape[2]
    diag = dict(k_diag=torch.ones(T, HKV, 128, dtype=torch.uint8), k_diag_scale=torch.ones(T, HKV, dtype=torch.uint8),
                v_t_diag=torch.ones(HKV, 128, tpad, dtype=torch.uint8),
                v_diag_scale=torch.full((T, HKV), 2, dtype=torch.uint8))
    assert diag_inputs_needed(lit["PARAMS"]) == tuple(diag)
    run_attn_fwd(lambda *a: seen.extend(a), lit["ARGS"], x["q"], x["k"], x["v"], x["q_scale"], x["k_scale"],
                 x["v_scale"], cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"], diag=diag)
    names = [a["name"] for a in lit["ARGS"]]
    assert seen[names.index("k_diag")].dtype == torch.float8_e4m3fn
    assert seen[names.index("v_t_diag")].dtype == torch.float8_e4m3fn
    assert seen[names.index("k_diag_scale")] is diag["k_diag_scale"]
    assert seen[names.index("v_diag_scale")] is diag["v_diag_scale"]
    assert seen[names.index("v_t_diag")].shape == (HKV, 128, tpad)


def test_run_attn_fwd_diag_copies_checked():
    lit = _literals(render_variant(_by("mxfp8")))
    x = _fp8_inputs()
    args = (x["q"], x["k"], x["v"], x["q_scale"], x["k_scale"], x["v_scale"])
    kw = dict(cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"])
    with pytest.raises(ValueError, match="v_t_diag: required"):
        run_attn_fwd(lambda *a: None, lit["ARGS"], *args, **kw)
    good = dict(v_t_diag=x["v"].clone(), v_diag_scale=x["v_scale"].clone())
    with pytest.raises(ValueError, match="k_diag: this variant takes no such input"):
        run_attn_fwd(lambda *a: None, lit["ARGS"], *args, **kw, diag=dict(good, k_diag=x["k"]))
    with pytest.raises(ValueError, match="v_diag_scale: shape"):
        run_attn_fwd(lambda *a: None, lit["ARGS"], *args, **kw, diag=dict(good, v_diag_scale=x["v_scale"][:5]))
    with pytest.raises(ValueError, match="v_t_diag: shape"):
        run_attn_fwd(lambda *a: None, lit["ARGS"], *args, **kw, diag=dict(good, v_t_diag=x["v"][:, :64]))
    run_attn_fwd(lambda *a: None, lit["ARGS"], *args, **kw, diag=good)  # accepted


def test_kernel_inputs_match_the_safeguards():
    """verify's emulator-made inputs: per-token Q for mxfp8_exact, per-token copies on the diagonal."""
    from flamia_gen.numerics import quantize
    from flamia_gen.verify.attn_gpu import kernel_inputs

    g = torch.Generator().manual_seed(0)
    T, H, D = 96, 2, 128
    q, k, v = (torch.randn(T, H, D, generator=g).to(torch.bfloat16) for _ in range(3))
    q[5] *= 300  # one outlier token: its 32-token block scale differs from its neighbours' own
    cu = torch.tensor([0, 70, 96], dtype=torch.int32)
    route = get_route("mxfp8_exact")
    ins = kernel_inputs(route, q, k, v, cu, dict(_by("mxfp8_exact").params))
    tok = route.operands.q.model_copy(update={"granularity": Granularity.token})
    assert torch.equal(ins["q"], quantize(q, tok, cu).codes)
    assert not torch.equal(ins["q"], quantize(q, route.operands.q, cu).codes)
    assert torch.equal(ins["k"], quantize(k, route.operands.k, cu).codes)
    assert set(ins["diag"]) == {"k_diag", "k_diag_scale", "v_t_diag", "v_diag_scale"}
    assert torch.equal(ins["diag"]["k_diag"], quantize(k, tok, cu).codes)
    mx = kernel_inputs(get_route("mxfp8"), q, k, v, cu, dict(_by("mxfp8").params))
    assert set(mx["diag"]) == {"v_t_diag", "v_diag_scale"}
    assert torch.equal(mx["q"], quantize(q, get_route("mxfp8").operands.q, cu).codes)


@pytest.mark.compile
@pytest.mark.parametrize("route", ["mxfp8_exact", "mxfp8"])
def test_compile_diag_variant(compile_sm90, route):
    ptx = compile_sm90(_by(route))
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    # one tensor map per TMA source: Q, K, Vᵀ + the per-token copies
    maps = 5 if route == "mxfp8_exact" else 4
    assert ptx.count("prefetch.tensormap") >= maps, ptx.count("prefetch.tensormap")


@pytest.mark.compile
def test_compile_three_consumer_warpgroups(compile_sm90):
    v = _by("fp8_token", m=192)
    assert v.param("compute_warpgroups") == 3
    ptx = compile_sm90(v)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+160;", ptx)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
