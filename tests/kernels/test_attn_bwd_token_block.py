"""The token-block backward on sm90 (route mxfp8): square_32 dS (modes `sq32`) and the forward's per-token V on its
diagonal tiles (`dgv`), templates/sm90/attn_bwd.py.j2; docs/kernels/attn_bwd.md "The token-block backward".

specs/kernels/attn_bwd_sm90.yaml does not list mxfp8 until its kernels verify on a GPU: the variants come from the
family with its routes replaced. CPU only, except the `compile` tests.
"""

from __future__ import annotations

import ast

import jinja2
import pytest

from flamia_gen.plan.feasibility import SMEM_LIMIT, attn_bwd_smem_bytes
from flamia_gen.plan.variants import expand_family
from flamia_gen.render.render import render_variant, render_with_flags
from flamia_gen.spec import Arch, load_specs

from test_attn_fwd_template import _literals

ROUTE = "mxfp8"


def _variants(route):
    specs = load_specs()
    fam = specs.families["attn_bwd_sm90"]
    return expand_family(fam.model_copy(update={"routes": [route]}), specs).variants


VARIANTS = _variants(ROUTE)


def _pick(causal=True, det=False, d=128):
    return next(v for v in VARIANTS if v.param("head_dim") == d and v.param("causal") == causal
                and bool(dict(v.params).get("deterministic")) == det)


def test_variants_fit_and_carry_the_forward_pairing():
    assert len(VARIANTS) == 8
    for v in VARIANTS:
        p = dict(v.params)
        assert p["ds_gran"] == "square_32" and p["v_gran"] == "token_block"
        assert p["diag_v"] is p["causal"]  # the forward's diagonal safeguard exists only under a causal mask
        smem = attn_bwd_smem_bytes(p, 1)
        # (the per-token dS tile as rendered before dQ went to BF16: bwd_dq_bf16 off)
        plain = attn_bwd_smem_bytes(dict(p, diag_v=False, ds_gran="token", bwd_dq_bf16=False), 1)
        # the diagonal V tile and stash (causal), the warps' block maxima, and (bwd_sq32_windows) each key row's
        # max and each query's group key
        extra = (128 * p["head_dim"] + 8 * 4 * 256 if p["causal"] else 0) + 64 + 4 * (128 + 64)
        assert smem == plain + extra and smem <= SMEM_LIMIT[Arch.sm90]


def test_render_causal_takes_the_diagonal_copy_and_the_forward_tile():
    lit = _literals(render_variant(_pick()))
    names = [a["name"] for a in lit["ARGS"]]
    assert names[-3:] == ["v_diag", "v_diag_scale", "fwd_tile_m"]
    dt = {a["name"]: a["dtype"] for a in lit["ARGS"]}
    assert dt["v_diag"] == "float8_e4m3fn" and dt["v_diag_scale"] == "uint8" and dt["fwd_tile_m"] == "int32"
    assert lit["PARAMS"]["diag_v"] is True and lit["PARAMS"]["fwd_tile_n"] == lit["PARAMS"]["tile_n"] == 128
    nc = _literals(render_variant(_pick(causal=False)))
    assert "v_diag" not in [a["name"] for a in nc["ARGS"]] and "diag_v" not in nc["PARAMS"]


def test_render_square_32_blocks():
    src = render_variant(_pick())
    body = src[src.index("    def one_tile("):]
    # dK: one exponent per two warps' key rows, swapped through shared memory behind a 64-thread barrier
    assert "cute.arch.barrier(barrier_id=SQ32_BARRIER0 + warp // 2, number_of_threads=64)" in body
    assert "blk = fmax_nan(blk, sBlk[warp ^ 1])" in body and "e = e_blk" in body
    # dQ: the row's 32-row block: column keys of the block, quad max, per-row select
    assert "bk[cg // 4] = cutlass.max(bk[cg // 4], Int32(amk[cp]))" in body
    assert "kb = cutlass.select_(tdQcdQ[2 * rh][0] >= 32, bk[1], bk[0])" in body
    # fp8_token keeps its per-key and per-row exponents
    tok = render_variant(next(v for v in _variants("fp8_token") if v.name == _pick().name.replace(ROUTE, "fp8_token")))
    assert "SQ32_BARRIER0" not in tok and "e = ds_exponent(quad_max_nan(mx[rh]))" in tok


def _diag_v_mode(src: str):
    """The rendered kernel's diag_v_mode, run on Python ints."""
    tree = ast.parse(src)
    lit = _literals(src)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "diag_v_mode")
    ns = dict(TILE_M=lit["PARAMS"]["tile_m"], TILE_N=lit["PARAMS"]["tile_n"],
              cutlass=type("C", (), {"min": staticmethod(min), "max": staticmethod(max)}))
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "diag_v_mode", "exec"), ns)
    return ns["diag_v_mode"]


@pytest.mark.parametrize("fwd_tile_m", [128, 192])
def test_diag_v_mode_is_the_forwards_diagonal_rule(fwd_tile_m):
    """Per backward tile (64 query columns from doc-local m·64 − δ, keys n·128 − δ …), the mode says which columns
    the forward computed with per-token V: numerics.reference_route.geometry's rule (forward query tiles of
    fwd_tile_m rows from the document start, key tiles of 128 from doc_start − δ), pair by pair."""
    mode_of = _diag_v_mode(render_variant(_pick()))
    modes = set()
    for delta in (0, 1, 5, 15):
        for m in range(12):
            for n in range(7):
                mode = mode_of(n, m, delta, fwd_tile_m)
                modes.add(mode)
                for c in range(64):
                    q = m * 64 - delta + c
                    if q < 0:
                        continue  # the previous document's rows: masked
                    diag = n >= ((q // fwd_tile_m) * fwd_tile_m + delta) // 128
                    kernel = mode == 2 or (mode == 1 and c < delta)
                    assert kernel == diag, (delta, m, n, c, mode)
    assert modes == {0, 1, 2}


def test_guards():
    v = _pick()
    with pytest.raises(jinja2.UndefinedError, match="diag_v_backward_is_built_for"):
        render_with_flags(v, ds_gran="token")
    tok = next(t for t in _variants("fp8_token") if t.name == v.name.replace(ROUTE, "fp8_token"))
    with pytest.raises(jinja2.UndefinedError, match="built_for_token_block_routes_with_square_32_ds_only"):
        render_with_flags(tok, diag_k=True)
    with pytest.raises(jinja2.UndefinedError, match="square_32_ds_needs_bwd_alu_trim"):
        render_with_flags(v, bwd_alu_trim=False)


@pytest.mark.compile
@pytest.mark.parametrize("causal", [True, False])
def test_compile(compile_sm90, tmp_path, causal):
    """Cross-compiles for sm_90a; with the toolkit's ptxas (when this host has one): no wgmma serialisation (C7511
    registers, C7512, C7515 a branch merging accumulator registers: the first dp_diag_v had it)."""
    import shutil
    import subprocess

    v = _pick(causal=causal)
    ptx = compile_sm90(v)
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    import re

    # the dK block exponent's 64-thread barrier (id 3 + warp // 2, a register) exists only with square_32 dS
    assert re.search(r"bar\.sync\s+%r\d+, 64;", ptx)
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas on this host")
    (tmp_path / "k.ptx").write_text(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for code in ("C7511", "C7512", "C7515"):
        assert code not in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]


# ----------------------------------------------------------------------------- mxfp8_exact (rows, k_fold, causal dQ)
EXACT = _variants("mxfp8_exact")


def _pick_exact(causal=True, det=False, d=128):
    return next(v for v in EXACT if v.param("head_dim") == d and v.param("causal") == causal
                and bool(dict(v.params).get("deterministic")) == det)


def test_exact_variants_fit():
    assert len(EXACT) == 8
    for v in EXACT:
        p = dict(v.params)
        assert p["rows_q"] is True and p["diag_k"] is p["diag_v"] is p["causal"]
        smem = attn_bwd_smem_bytes(p, 1)
        assert smem == attn_bwd_smem_bytes(dict(p, diag_k=False), 1) + (2 * 128 * p["head_dim"] if p["causal"] else 0)
        assert smem <= SMEM_LIMIT[Arch.sm90]


def test_exact_render_args_and_rows():
    lit = _literals(render_variant(_pick_exact()))
    names = [a["name"] for a in lit["ARGS"]]
    assert names[-8:] == ["v_diag", "v_diag_scale", "fwd_tile_m", "q_t_scale", "do_t_scale", "k_diag", "k_t_diag",
                          "k_diag_scale"]
    assert {"rows_q", "rows_do", "diag_k", "diag_v"} <= set(lit["PARAMS"])
    nc = _literals(render_variant(_pick_exact(causal=False)))
    assert [a["name"] for a in nc["ARGS"]][-2:] == ["q_t_scale", "do_t_scale"]
    src = render_variant(_pick_exact())
    # dK's Q fold from the token-block scales, dV's reference from the token-block dO's; Sᵀ's from the per-token ones
    assert "qtc = Int32(mQts[tok, head])" in src and "bits_f32(Uint32(dts[j]))" in src
    assert "qc = Int32(mQs[tok, head])" in src and "dcs[j] = Int32(mdOs[tok, head])" in src
    # k_fold on the masked tiles: Sᵀ, dPᵀ and dQ from the copies the forward read; causal dQ scale per row (no
    # 32-row block exponent for dQ), square_32 for dK
    body = src[src.index("    def one_tile("):]
    assert "self.sdp_diag(" in body and "self.dq_diag(" in body and "kfe = kfd[rh]" in body
    assert "bk[cg // 4]" not in body and "SQ32_BARRIER0" in body
    # mxfp8 (no k_fold, no rows) renders neither
    plain = render_variant(_pick())
    assert "sdp_diag" not in plain and "mQts" not in plain and "dts[j]" not in plain


def test_exact_guards():
    v = _pick_exact()
    with pytest.raises(jinja2.UndefinedError, match="diag_k_needs_diag_v"):
        render_with_flags(v, diag_v=False)
    with pytest.raises(jinja2.UndefinedError, match="diag_k_needs_bwd_interior_nomask"):
        render_with_flags(v, bwd_interior_nomask=False)


@pytest.mark.compile
@pytest.mark.parametrize("causal", [True, False])
def test_compile_exact(compile_sm90, tmp_path, causal):
    import shutil
    import subprocess

    ptx = compile_sm90(_pick_exact(causal=causal))
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in ptx
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas on this host")
    (tmp_path / "k.ptx").write_text(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for code in ("C7511", "C7512", "C7515"):
        assert code not in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]


# ----------------------------------------------------------------------------- nvfp4_mixed (NVFP4 Q, K in Sᵀ only)
MIXED = _variants("nvfp4_mixed")


def test_nvfp4_mixed_render():
    v = next(v for v in MIXED if v.param("head_dim") == 128 and v.param("causal") and not dict(v.params).get("deterministic"))
    src = render_variant(v)
    lit = _literals(src)
    dt = {a["name"]: a["dtype"] for a in lit["ARGS"]}
    # Sᵀ on q, k dequantized to BF16 (the scores_bf16 path) with ts_q·ts_k in x; dK, dQ on E4M3 token-block copies
    assert dt["q"] == dt["k"] == "bfloat16" and dt["q_t"] == dt["k_t"] == "float8_e4m3fn"
    assert [a["name"] for a in lit["ARGS"]][-4:] == ["v_diag", "v_diag_scale", "fwd_tile_m", "qk_tensor_scale"]
    assert lit["PARAMS"]["qk_nvfp4"] is True and lit["PARAMS"]["diag_v"] is True
    assert "qk_scale_log2 = mQkts[0] * scale_log2" in src and "= qk_scale_log2  # NVFP4" in src
    assert "p = ex2(acc_S[i] * qx[cp] - lse2[cp])" in src and "self.gemm(tiled_mma_s, acc_S, tSrK" in src
    nc = _literals(render_variant(next(v for v in MIXED if v.param("head_dim") == 128 and not v.param("causal"))))
    assert [a["name"] for a in nc["ARGS"]][-1] == "qk_tensor_scale" and "v_diag" not in [a["name"] for a in nc["ARGS"]]
    for w in MIXED:
        p = dict(w.params)
        assert attn_bwd_smem_bytes(p, 1) == attn_bwd_smem_bytes(dict(p, q_fmt="e4m3"), 1) + 128 * p["head_dim"] + \
            2 * 64 * p["head_dim"]  # BF16 K, and Q per stage, beside the codes
        assert attn_bwd_smem_bytes(p, 1) <= SMEM_LIMIT[Arch.sm90]


@pytest.mark.compile
def test_compile_nvfp4_mixed(compile_sm90):
    v = next(v for v in MIXED if v.param("head_dim") == 128 and v.param("causal") and not dict(v.params).get("deterministic"))
    ptx = compile_sm90(v)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx  # Sᵀ = K·Qᵀ on BF16
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # dV, dK


# ---------------------------------------------------------------- bwd_sq32_windows (2026-12-02, fourteenth session)
@pytest.mark.parametrize("route", ["mxfp8", "mxfp8_exact", "nvfp4_mixed"])
def test_sq32_windows_by_default_and_only_in_the_masked_tile(route):
    """On by default for every 32×32-block dS variant (PARAMS carry it, so the runtime gives them windows); the window
    code sits only in the masked copy of one_tile (a window's tiles are all masked): the key rows' maxima before the
    warp pair's barrier, the block ∩ document max per key row after it, the per-column group keys behind one more
    256-thread barrier (dQ: not with mxfp8_exact's per-row causal dQ scale), and the per-token copies on every pair
    of a window. Off renders the kernel before it."""
    from flamia_gen.runtime.attn_bwd import bwd_windows

    for v in _variants(route):
        src = render_variant(v)
        p = _literals(src)["PARAMS"]
        assert p["bwd_sq32_windows"] is True and bwd_windows(p), v.name
        assert "SQW_KEY0 = 2 * NUM_WG * 4" in src and "SQW_Q0 = SQW_KEY0 + TILE_N" in src
        body = src[src.index("    def one_tile("):]
        body = body[:body.index("\n    @cute.jit", 10)]
        masked = body.index("if const_expr(mask):") if "if const_expr(mask):" in body else 0
        store = body.index("sBlk[SQW_KEY0 + tScS[2 * rh][0]] = rmx")
        pair = body.index("cute.arch.barrier(barrier_id=SQ32_BARRIER0 + warp // 2, number_of_threads=64)")
        group = body.index("g = fmax_nan(g, sBlk[SQW_KEY0 + lo + j])")
        assert masked < store < pair < group
        has_dq = "sBlk[SQW_Q0 + tidx] = Float32(gk)" in body
        assert has_dq is (route != "mxfp8_exact"), v.name
        if has_dq:
            assert body.index("sBlk[SQW_Q0 + tidx] = Float32(gk)") < body.index(
                "kb = Int32(sBlk[SQW_Q0 + tdQcdQ[2 * rh][0]])")
        if p["causal"]:
            assert "vmode = Int32(2)  # the forward read the per-token copies" in src
        off = render_with_flags(v, bwd_sq32_windows=False)
        lit = _literals(off)["PARAMS"]
        assert "bwd_sq32_windows" not in lit and not bwd_windows(lit) and "SQW_KEY0" not in off


def test_sq32_windows_smem_in_the_feasibility_model():
    v = _pick()
    p = dict(v.params)
    with_w = attn_bwd_smem_bytes(p, 1)
    # the warps' block maxima (one word per consumer warp) and the window words (a key row's max, a query's group key)
    assert with_w - attn_bwd_smem_bytes(dict(p, ds_gran="token"), 1) == 4 * 8 * 2 + 4 * (128 + 64)


def _third_copy_src(v):
    return render_variant(v)


@pytest.mark.parametrize("route", ["mxfp8", "mxfp8_exact"])
def test_sq32_window_copy_flag_renders_a_third_one_tile(route):
    """bwd_sq32_win_copy (on by default since 2026-12-03; A/B tag nosq3): the loop calls one_tile three ways — interior
    (False, False), masked outside a window (True, False), a window's tile (True, True) — and the window code is
    compile time (`const_expr(win)`), so the masked copy has none of it. On renders the default bytes; off renders
    two copies."""
    for v in _variants(route):
        assert render_with_flags(v, bwd_sq32_win_copy=True) == render_variant(v)
        off = render_with_flags(v, bwd_sq32_win_copy=False)
        assert "win: cutlass.Constexpr[bool]" not in off and "bwd_sq32_win_copy" not in _literals(off)["PARAMS"]
        src = _third_copy_src(v)
        assert _literals(src)["PARAMS"]["bwd_sq32_win_copy"] is True
        assert "mask: cutlass.Constexpr[bool], win: cutlass.Constexpr[bool]):" in src
        ends = [ln.rstrip() for ln in src.splitlines()]
        for tail in ("False, False)", "True, False)", "True, True)"):
            assert sum(ln.endswith(", " + tail) for ln in ends) == 1, tail
        assert "elif window == 0:" in src
        body = src[src.index("    def one_tile("):]
        body = body[:body.index("\n    @cute.jit", 10)]
        assert "if const_expr(win):" in body and "if window != 0:" not in body
        assert ("dq_win = win  # compile time" in body) is (route != "mxfp8_exact")


@pytest.mark.compile
def test_compile_sq32_window_copy(compile_sm90):
    """The flag compiles, and the PTX has the third copy: one more warp-pair (64-thread) barrier than the default (two
    copies of one_tile: 2), and two more 256-thread barriers (the copy's own two, plus the dQ group keys' one)."""
    import re

    v = _pick()
    pair = r"bar(?:rier)?(?:\.cta)?\.sync(?:\.aligned)?\s+[^,;]+,\s*64;"
    full = r"bar(?:rier)?(?:\.cta)?\.sync(?:\.aligned)?\s+[^,;]+,\s*256;"
    three = compile_sm90(v)
    two = compile_sm90(v, source=render_with_flags(v, bwd_sq32_win_copy=False))
    assert (len(re.findall(pair, two)), len(re.findall(pair, three))) == (2, 3)
    assert len(re.findall(full, three)) == len(re.findall(full, two)) + 2
