"""The sm90 attention backward template (templates/sm90/attn_bwd.py.j2, family
specs/kernels/attn_bwd_sm90.yaml) and its host wrapper. CPU only: rendering, the work list against
the kernel's own tiling function, input checks, and `compile` tests that cross-compile one bf16 and
one fp8_token variant (and their deterministic `_det` twins) for sm_90a in a subprocess. The
deterministic mode's ordering argument and host side: tests/runtime/test_attn_bwd_deterministic.py.
The kernel itself is checked on the GPU by `flamia-gen verify --device cuda` (docs/kernels/attn_bwd.md).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_literal, rendered_literals
from flamia_gen.runtime.attn_bwd import check_bwd_inputs, make_work_list, num_units, num_work, run_attn_bwd
from flamia_gen.spec import load_specs

REPO = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module")
def variants():
    plan = make_plan(load_specs())
    return [v for v in plan.variants if v.kind.value == "attn_bwd"]


def _literals(src: str) -> dict:
    return rendered_literals(src, ("NAME", "ARCH", "PARAMS", "ARGS", "TILE_M", "TILE_N", "KEY_ALIGN"))


def _is_det(v) -> bool:
    return bool(dict(v.params).get("deterministic", False))  # only deterministic variants carry the key


ROUTES = ("bf16", "fp8_tensor", "fp8_token", "fp8_token_bf16qk", "fp8_pv", "mxfp8", "mxfp8_exact", "nvfp4_mixed")


def test_family_expands_to_eight_variants_per_head_dim(variants):
    names = sorted(v.name for v in variants)
    assert names == sorted(
        f"attn_bwd_sm90_{r}_d{d}_m64n128_s2_wg2_preg_longest_first{det}{nc}"
        for r in ROUTES for d in (64, 128) for det in ("", "_det") for nc in ("", "_noncausal"))
    assert all(_is_det(v) == ("_det" in v.name) for v in variants)


def test_render_deterministic_and_parses(variants):
    for v in variants:
        a, b = render_variant(v), render_variant(v)
        assert a == b
        lit = _literals(a)
        assert lit["NAME"] == v.name and lit["ARCH"] == "sm_90a"
        assert lit["PARAMS"]["kind"] == "attn_bwd" and lit["PARAMS"]["tile_m"] == 64 and lit["TILE_N"] == 128
        # unit_counter: the atomic-counter scheduler (bwd_dynamic), every non-deterministic variant but fp8_tensor's
        dyn = not _is_det(v) and v.route != "fp8_tensor"
        tail = ["lse", "delta", "cu_seqlens", "row_doc", "work"] + (["unit_counter"] if dyn else []) \
            + (["dq_sem", "dq_tile_off"] if _is_det(v) else [])
        tail += ["softmax_scale", "dq_accum", "dk", "dv"]
        # the call's own BF16 dQ (bwd_dq_convert): fp8_token's D = 128 non-deterministic tile since round 45
        if v.route == "fp8_token" and v.param("head_dim") == 128 and not _is_det(v):
            tail += ["dq"]
        if v.route == "fp8_tensor":  # tensor-scaled dS: two launches around the call's dS amax
            tail += ["ds_amax", "amax_pass"]
        names = [x["name"] for x in lit["ARGS"]]
        causal = v.param("causal")
        if v.route in ("mxfp8", "mxfp8_exact", "nvfp4_mixed"):  # after the tail: the token-block routes' extras
            tail += (["v_diag", "v_diag_scale", "fwd_tile_m"] if causal else []) + {
                "mxfp8": [], "mxfp8_exact": ["q_t_scale", "do_t_scale"] + (["k_diag", "k_t_diag", "k_diag_scale"]
                                                                           if causal else []),
                "nvfp4_mixed": ["qk_tensor_scale"]}[v.route]
        if v.route in ("fp8_tensor", "fp8_token", "fp8_token_bf16qk", "mxfp8", "mxfp8_exact", "nvfp4_mixed"):
            # (bf16qk, nvfp4_mixed: q, k BF16, the codes in q_t, k_t)
            assert names == ["q", "q_t", "q_scale", "k", "k_t", "k_scale", "v", "v_scale", "do", "do_t",
                             "do_scale"] + tail
            assert lit["KEY_ALIGN"] == 16
            # every K-major (tokens-contiguous) TMA is offset by a 16-aligned base, never doc_start
            assert "domain_offset((0, doc_start)" not in a
            no_kt = lit["PARAMS"].get("bwd_no_kt") is True  # no Kᵀ load at all (fp8_token's D = 128 default)
            assert ("domain_offset((0, k0), mKt" in a) is not no_kt and "domain_offset((0, base), mQt" in a
        elif v.route == "fp8_pv":  # BF16 Q, K, dS; 8-bit V, dO
            assert names == ["q", "k", "v", "v_scale", "do", "do_t", "do_scale"] + tail
            assert lit["KEY_ALIGN"] == 16
        else:
            assert names == ["q", "k", "v", "do"] + tail
            assert lit["KEY_ALIGN"] == 1
        for tok in ("def load(", "def mma(", "def one_tile(", "def epilogue(", "def can_implement(",
                    "def _setup_attributes(", "def compile_args("):
            assert tok in a
        assert ("(kk > qq)" in a) == (not v.name.endswith("_noncausal"))


# ----------------------------------------------------------------------------- deterministic mode
_SEMAPHORE_CODE = ("dq_sem", "dq_tile_off", "mSem", "mQtOff", "wait_dq_turn", "pass_dq_turn", "ld.global.acquire",
                   "red.release", "nanosleep", "DQ_BARRIER", "Deterministic")


def test_non_deterministic_render_has_no_semaphore_code(variants):
    """`deterministic` false or absent renders today's kernel: no semaphore, no new argument."""
    plain = [v for v in variants if not _is_det(v)]
    assert len(plain) == 4 * len(ROUTES)  # routes × causal/non-causal × D = 64, 128
    for v in plain:
        src = render_variant(v)
        assert "deterministic" not in v.context
        assert [tok for tok in _SEMAPHORE_CODE if tok in src] == []
        assert '"deterministic_dq": False,' in src and '"deterministic": True' not in src
        assert render_with_flags(v, deterministic=False) == src  # false and undefined render the same bytes


def test_deterministic_render_waits_on_the_key_tile_index(variants):
    for v in (v for v in variants if _is_det(v)):
        src = render_variant(v)
        lit = _literals(src)
        assert lit["PARAMS"]["deterministic_dq"] is True and lit["PARAMS"]["deterministic"] is True
        assert [tok for tok in _SEMAPHORE_CODE if tok not in src] == []
        spec = {x["name"]: x for x in lit["ARGS"]}
        assert spec["dq_sem"] == {"name": "dq_sem", "dtype": "int32", "shape": ["HQ", "NUM_QTILES"], "role": "inout"}
        assert spec["dq_tile_off"] == {"name": "dq_tile_off", "dtype": "int32", "shape": ["NUM_DOCS+1"], "role": "in"}
        # the column of (document, query tile) and the turn n_block (runtime test: = contributors before it)
        assert "qt0 = mQtOff[doc]" in src and "tidx, mSem, qt0 + m_block, n_block" in src
        assert "sem_ptr = mSem.iterator + (head * mSem.shape[1] + sem_col)" in src
        # wait → adds → pass, in this order, around the dQ reduce-add
        i_wait = src.index("self.wait_dq_turn(sem_ptr, sem_turn, tidx)")
        i_add = src.index("red_add_v2_f32(mdQacc.iterator + off")
        i_pass = src.index("self.pass_dq_turn(sem_ptr, tidx)")
        assert i_wait < i_add < i_pass


def test_deterministic_needs_the_persistent_scheduler(variants):
    import jinja2

    v = next(v for v in variants if _is_det(v))
    with pytest.raises(jinja2.UndefinedError, match="deterministic_dq_needs_a_persistent_scheduler"):
        render_with_flags(v, scheduler="static")


# ----------------------------------------------------------------------------- tiling and work list
def _bwd_tiling(src: str):
    """The rendered kernel's bwd_tiling, run on Python ints."""
    tree = ast.parse(src)
    lit = _literals(src)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "bwd_tiling")
    ns = dict(TILE_M=lit["TILE_M"], TILE_N=lit["TILE_N"], KEY_ALIGN=lit["KEY_ALIGN"],
              cutlass=type("C", (), {"min": staticmethod(min), "max": staticmethod(max)}))
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "bwd_tiling", "exec"), ns)
    return ns["bwd_tiling"], lit


@pytest.mark.parametrize("route", ["bf16", "fp8_token"])
@pytest.mark.parametrize("causal", [True, False])
def test_tiling_covers_every_visible_pair_once(variants, route, causal):
    """Every (query, key) pair a row can see is in exactly one (key tile, query tile) the kernel
    visits; tiles start 16-aligned for FP8 (TMA on the tokens-contiguous copies)."""
    v = next(v for v in variants if v.route == route and v.param("causal") == causal)
    tiling, lit = _bwd_tiling(render_variant(v))
    M, N, A = lit["TILE_M"], lit["TILE_N"], lit["KEY_ALIGN"]
    for start, L in [(0, 1), (0, 200), (1000, 300), (7, 64), (1, 129), (16, 64), (130, 0)]:
        seen = {}
        nkt = -(-(L + start % A) // N) + 1
        for n in range(nkt):
            base, delta, m_lo, m_hi = tiling(n, start, L)
            assert base % A == 0 and base == start - delta
            for m in range(m_lo, m_hi):
                for kk in range(n * N - delta, (n + 1) * N - delta):
                    for qq in range(m * M - delta, (m + 1) * M - delta):
                        if 0 <= kk < L and 0 <= qq < L and (not causal or kk <= qq):
                            seen[(qq, kk)] = seen.get((qq, kk), 0) + 1
        expect = {(i, j) for i in range(L) for j in range(L) if not causal or j <= i}
        assert set(seen) == expect and all(c == 1 for c in seen.values())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("align", [1, 16])
def test_work_list_matches_kernel_tiling(variants, causal, align):
    v = next(v for v in variants if v.param("causal") == causal and (v.route == "fp8_token") == (align == 16))
    tiling, lit = _bwd_tiling(render_variant(v))
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(0, 500, (19,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)]).to(torch.int32)
    T = int(cu[-1])
    w = make_work_list(cu, 64, 128, causal, key_align=align, T=T)
    assert w.shape == (num_work(T, 19, 128), 3) and w.dtype == torch.int32
    real = w[w[:, 0] >= 0].tolist()
    expect = set()
    for d in range(19):
        s, L = int(cu[d]), int(lens[d])
        for n in range(-(-(L + 15) // 128) + 1):
            _, _, m_lo, m_hi = tiling(n, s, L)
            if m_lo < m_hi:
                expect.add((d, n, m_hi - m_lo))
    cost = {}
    for d, n, c in expect:
        cost[(d, n)] = c
    assert {(d, n) for d, n, _ in real} == set(cost) and len(real) == len(cost)
    costs = [cost[(d, n)] for d, n, _ in real]
    assert costs == sorted(costs, reverse=True)
    assert (w[len(real):] == -1).all()


# ----------------------------------------------------------------------------- input checks
def _fp8_inputs(T=40, HQ=4, HKV=2, D=128):
    tpad = -(-T // 16) * 16
    u8 = torch.uint8
    return dict(q=torch.zeros(T, HQ, D, dtype=u8), k=torch.zeros(T, HKV, D, dtype=u8),
                v=torch.zeros(T, HKV, D, dtype=u8), do=torch.zeros(T, HQ, D, dtype=u8),
                lse=torch.zeros(HQ, T), delta=torch.zeros(HQ, T),
                q_t=torch.zeros(HQ, D, tpad, dtype=u8), k_t=torch.zeros(HKV, D, tpad, dtype=u8),
                do_t=torch.zeros(HQ, D, tpad, dtype=u8), q_scale=torch.zeros(T, HQ, dtype=u8),
                k_scale=torch.zeros(T, HKV, dtype=u8), v_scale=torch.zeros(T, HKV, dtype=u8),
                do_scale=torch.zeros(T, HQ, dtype=u8), cu_seqlens=torch.tensor([0, 10, T], dtype=torch.int32))


def _bf16_inputs(T=40, HQ=4, HKV=2, D=128):
    b = torch.bfloat16
    return dict(q=torch.zeros(T, HQ, D, dtype=b), k=torch.zeros(T, HKV, D, dtype=b),
                v=torch.zeros(T, HKV, D, dtype=b), do=torch.zeros(T, HQ, D, dtype=b),
                lse=torch.zeros(HQ, T), delta=torch.zeros(HQ, T), cu_seqlens=torch.tensor([0, 10, T], dtype=torch.int32))


def test_check_inputs_ok():
    assert check_bwd_inputs(**_fp8_inputs(), fp8=True, head_dim=128) == (40, 4, 2, 128)
    assert check_bwd_inputs(**_bf16_inputs(), fp8=False) == (40, 4, 2, 128)


@pytest.mark.parametrize("mutate, match", [
    (lambda x: x.update(q=x["q"].to(torch.int32)), "q: dtype"),
    (lambda x: x.update(q=torch.zeros(40, 4, 96, dtype=torch.uint8)), "unsupported head dim"),
    (lambda x: x.update(k=torch.zeros(40, 3, 128, dtype=torch.uint8)), "k: HQ=4 is not a multiple of HKV=3"),
    (lambda x: x.update(v=torch.zeros(40, 4, 128, dtype=torch.uint8)), "v: shape"),
    (lambda x: x.update(do=torch.zeros(41, 4, 128, dtype=torch.uint8)), "do: shape"),
    (lambda x: x.update(k_t=torch.zeros(2, 128, 40, dtype=torch.uint8)), "k_t: T_PAD=40"),
    (lambda x: x.update(do_t=torch.zeros(4, 128, 64, dtype=torch.uint8)), "do_t: T_PAD=64 differs"),
    (lambda x: x.update(do_scale=torch.zeros(40, 2, dtype=torch.uint8)), "do_scale: shape"),
    (lambda x: x.update(v_scale=torch.zeros(40, 2, dtype=torch.int8)), "v_scale: dtype"),
    (lambda x: x.update(lse=torch.zeros(40, 4)), "lse: shape"),
    (lambda x: x.update(delta=torch.zeros(4, 40, dtype=torch.float64)), "delta: dtype"),
    (lambda x: x.update(dq_accum=torch.zeros(40, 4, 128, dtype=torch.bfloat16)), "dq_accum: dtype"),
    (lambda x: x.update(q=torch.zeros(4, 40, 128, dtype=torch.uint8).transpose(0, 1)), "q: must be contiguous"),
    (lambda x: x.update(cu_seqlens=torch.tensor([0, 30, 20, 40], dtype=torch.int32)), "non-decreasing"),
    (lambda x: x.update(cu_seqlens=torch.tensor([0, 10, 39], dtype=torch.int32)), r"cu_seqlens\[-1\]"),
])
def test_check_inputs_errors(mutate, match):
    x = _fp8_inputs()
    mutate(x)
    with pytest.raises(ValueError, match=match):
        check_bwd_inputs(**x, fp8=True)


def test_check_inputs_bf16_takes_no_scales():
    with pytest.raises(ValueError, match="k_scale: the bf16 route takes no"):
        check_bwd_inputs(**_bf16_inputs(), k_scale=torch.zeros(40, 2, dtype=torch.uint8), fp8=False)


@pytest.mark.parametrize("route", ["bf16", "fp8_token"])
def test_run_attn_bwd_calls_in_args_order(variants, route):
    v = next(v for v in variants if v.route == route and v.param("causal"))
    lit = _literals(render_variant(v))
    seen = []
    x = _fp8_inputs() if route == "fp8_token" else _bf16_inputs()
    dq, dk, dv, acc = run_attn_bwd(lambda *a: seen.extend(a), lit["ARGS"], **x, params=lit["PARAMS"], poison=True)
    assert len(seen) == len(lit["ARGS"])
    by = dict(zip([a["name"] for a in lit["ARGS"]], seen))
    assert by["dk"] is dk and by["dv"] is dv and by["dq_accum"] is acc
    assert by["softmax_scale"] == pytest.approx(128 ** -0.5)
    # the default (one CTA per unit): the unit list, (doc, n_block, window, KV head) per row
    assert lit["PARAMS"]["bwd_head_section"] == 2
    assert by["work"].shape == (num_units(40, 2, 128, 2), 4) == (min(num_work(40, 2, 128), 5) * 2, 4)
    if route == "fp8_token":
        assert by["q"].dtype == torch.float8_e4m3fn and by["k_t"].dtype == torch.float8_e4m3fn
    assert dq.dtype == torch.bfloat16 and dq.shape == (40, 4, 128) and dk.shape == (40, 2, 128)
    assert torch.isnan(dk.float()).all() and acc.dtype == torch.float32


def test_runtime_imports_without_dsl():
    code = "import sys; sys.modules['cutlass'] = None; import flamia_gen.runtime.attn_bwd; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# ----------------------------------------------------------------------------- compile
@pytest.mark.compile
def test_compile_fp8_token_variant(variants, compile_sm90):
    v = next(v for v in variants if v.route == "fp8_token" and v.param("causal"))
    ptx = compile_sm90(v)
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in ptx  # Sᵀ, dPᵀ
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # dV, dK (A from registers)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    # dQ on BF16 dS (bwd_dq_bf16, default since 2026-12-04): a BF16 wgmma, no dQ-scale amax across warpgroups
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx
    assert "atom.shared.max.u32" not in ptx
    # dQ reduce-add: one vector red per column pair (profile 2026-11-29: the scalar atomics' stalls
    # were ~20 % of the backward's warp samples); since then (bwd_dq_bulk, default on) the partial goes
    # through shared memory and one bulk reduce-add per row, issued by the writer warps: their row loop
    # unrolled, tile_m / (32 · writers) copies in the PTX — 1 with the two writers of D = 128 since round 32;
    # no per-element reduce or atomic left
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 1
    assert "red.global.add" not in ptx and "atom.global.add.f32" not in ptx
    assert "setmaxnreg.inc" in ptx and "cp.async.bulk.tensor" in ptx


@pytest.mark.compile
def test_compile_bf16_variant(variants, compile_sm90):
    v = next(v for v in variants if v.route == "bf16" and v.param("causal"))
    ptx = compile_sm90(v)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx


@pytest.mark.compile
@pytest.mark.parametrize("route, causal", [("fp8_token", True), ("bf16", False)])
def test_compile_deterministic_variant(variants, compile_sm90, route, causal):
    """The `_det` variants cross-compile; the semaphore protocol is in the PTX."""
    v = next(v for v in variants if v.route == route and v.param("causal") == causal and _is_det(v))
    ptx = compile_sm90(v)
    assert "ld.global.acquire.gpu.b32" in ptx and "nanosleep.u32" in ptx  # the spin-wait
    assert "fence.acq_rel.gpu" in ptx and "red.release.gpu.global.add.s32" in ptx  # publish, increment
    assert re.search(r"bar\.sync\s+2, 256;", ptx)  # the consumers' protocol barrier
    assert "red.global.add.v2.f32" in ptx  # the dQ reduce-add itself
    assert "wgmma.mma_async" in ptx


@pytest.mark.compile
@pytest.mark.parametrize("route", ["fp8_token", "bf16"])
def test_compile_head_dim_64(variants, compile_sm90, route):
    """D = 64 renders and cross-compiles (shipped: D = 128 only, until verified on the H200)."""
    v = next(v for v in variants if v.route == route and v.param("causal"))
    src = render_with_flags(v, head_dim=64)
    assert '"head_dim": 64' in src
    ptx = compile_sm90(v, source=src)
    assert "wgmma.mma_async" in ptx


# ----------------------------------------------------------------------------- dQ bulk reduce-add
def test_dq_bulk_on_by_default_for_non_deterministic_variants_only(variants):
    """bwd_dq_bulk: non-deterministic variants stage the dQ partial in shared memory and add it with one
    bulk reduce-add per document row; the deterministic ones keep the ordered per-element red path."""
    for v in variants:
        src = render_variant(v)
        lit = _literals(src)
        if _is_det(v):
            assert "bwd_dq_bulk" not in lit["PARAMS"] and "bulk_reduce_add_f32" not in src
            assert "red_add_v2_f32(mdQacc.iterator + off" in src
            assert render_with_flags(v, bwd_dq_bulk=True) == src  # the flag cannot turn the ordered path off
        else:
            assert lit["PARAMS"]["bwd_dq_bulk"] is True
            assert "red_add_v2_f32(mdQacc" not in src
            # the rows' copies: from the dQ writer warp (bwd_dq_warp, on except fp8_tensor's two launches), else from
            # the consumer threads < tile_m
            writer = "bulk_reduce_add_f32(mdQacc.iterator + off, sdQ.iterator + r * DQ_LD, self.head_dim * 4)"
            consumer = "bulk_reduce_add_f32(mdQacc.iterator + off, sdQ.iterator + tidx * DQ_LD, self.head_dim * 4)"
            warp = bool(lit["PARAMS"].get("bwd_dq_warp"))
            assert warp is (v.route != "fp8_tensor")
            assert (writer in src, consumer in src) == (warp, not warp)
            assert consumer in render_with_flags(v, bwd_dq_warp=False)
            off = render_with_flags(v, bwd_dq_bulk=False)
            assert "bulk_reduce_add_f32" not in off and "bwd_dq_bulk" not in _literals(off)["PARAMS"]


def test_dq_bulk_staging_rows_are_bank_conflict_free_and_aligned(variants):
    """The rendered row stride DQ_LD: the 8-byte stores of a half-warp (rows g = 0..3, column pairs
    t = 0..3 of the wgmma accumulator) hit 16 distinct bank pairs; rows start 16-byte aligned and a
    row's D words are a whole number of 16-byte units (bulk copy rules)."""
    for d in (64, 128):
        v = next(v for v in variants if v.param("head_dim") == d and not _is_det(v))
        lit = {}
        for node in ast.parse(render_variant(v)).body:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                    node.targets[0].id in ("HEAD_DIM", "DQ_LD"):
                lit[node.targets[0].id] = eval(compile(ast.Expression(node.value), "c", "eval"), {}, dict(lit))
        ld = lit["DQ_LD"]
        assert lit["HEAD_DIM"] == d and (ld * 4) % 16 == 0 and (d * 4) % 16 == 0 and ld >= d
        for c0 in range(0, d, 8):
            banks = [((g * ld + c0 + 2 * t) % 32) // 2 for g in range(4) for t in range(4)]
            assert len(set(banks)) == 16, (d, c0)


def test_dq_bulk_order_of_wait_store_fence_barrier_issue(variants):
    """Without the writer warp (bwd_dq_warp=False), the staging buffer's protocol in one_tile: the previous tile's bulk reads end (wait_group.read)
    before the barrier that precedes the dQ wgmma; the stores of this tile come after that wgmma, then
    the async-proxy fence and the barrier, then one thread per row issues and commits; the CTA waits for
    every group before it exits."""
    v = next(v for v in variants if v.route == "fp8_token" and v.param("causal") and not _is_det(v))
    # the consumers' own copies (the writer warp: test_attn_bwd_dq_warp.py)
    src = render_with_flags(v, bwd_dq_warp=False)
    body = src[src.index("    def one_tile("):src.index("    def epilogue(")]
    i_wait = body.index("cute.arch.cp_async_bulk_wait_group(0, read=True)")
    i_gemm = body.index("self.gemm(tiled_mma_dq, acc_dQ")
    i_store = body.index("cute.autovec_copy(v2, dst2)")
    i_fence = body.index("cute.arch.fence_view_async_shared()", i_store)
    i_bar = body.index("cute.arch.barrier(barrier_id=1", i_fence)
    i_issue = body.index("bulk_reduce_add_f32(", i_bar)
    i_commit = body.index("cute.arch.cp_async_bulk_commit_group()", i_issue)
    assert i_wait < i_gemm < i_store < i_fence < i_bar < i_issue < i_commit
    mma = src[src.index("    def mma("):src.index("    def load2(")]
    assert mma.replace("@cute.jit", "").rstrip().endswith("cute.arch.cp_async_bulk_wait_group(0, read=False)")


@pytest.mark.compile
def test_compile_dq_bulk_bf16(variants, compile_sm90):
    v = next(v for v in variants if v.route == "bf16" and v.param("causal") and not _is_det(v))
    ptx = compile_sm90(v)
    # the writer warps' unrolled row loop: tile_m / (32 · writers) copies (two writers at D = 128 since round 32)
    writers = rendered_literal(render_variant(v), "DQ_WRITERS")
    assert writers == 2 and ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == \
        v.param("tile_m") // (32 * writers)
    assert re.search(r"cp.async.bulk.wait_group.read\s+0;", ptx) and "cp.async.bulk.commit_group" in ptx
    assert "red.global.add" not in ptx
