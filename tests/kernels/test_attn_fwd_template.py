"""The sm90 attention forward template (templates/sm90/attn_fwd.py.j2) and its host wrapper.

CPU only: rendering, the work list, input checks; `compile` tests cross-compile a real
fp8_token variant for sm_90a through the build worker in a subprocess and check the PTX for
FP8 wgmma.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_literals
from flamia_gen.runtime.attn_fwd import check_fwd_inputs, make_work_list, num_work, run_attn_fwd
from flamia_gen.spec import load_specs

REPO = Path(__file__).resolve().parents[2]


def _attn_variants():
    plan = make_plan(load_specs())
    return [v for v in plan.variants if v.kind.value == "attn_fwd" and v.arch.value == "sm90"]


VARIANTS = _attn_variants()


def _literals(src: str) -> dict:
    return rendered_literals(src, ("NAME", "ARCH", "PARAMS", "ARGS"))


# ----------------------------------------------------------------------------- render
def test_spec_has_four_compilable_variants():
    names = {v.name for v in VARIANTS}
    assert len(names) >= 4
    assert any(v.param("q_fmt") == "e4m3" for v in VARIANTS) and any(v.route == "bf16" for v in VARIANTS)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_render_deterministic_and_parses(v):
    a, b = render_variant(v), render_variant(v)
    assert a == b
    ast.parse(a)
    lit = _literals(a)
    assert lit["NAME"] == v.name and lit["ARCH"] == "sm_90a"
    assert lit["PARAMS"]["tile_n"] == v.param("tile_n")
    names = [x["name"] for x in lit["ARGS"]]
    tail = ["cu_seqlens", "row_doc", "work", "unit_counter", "softmax_scale", "o", "lse"]  # unit_counter: fwd_dynamic
    if v.param("q_fmt") == "e4m3" and not dict(v.params).get("scores_bf16"):
        from flamia_gen.runtime.attn_fwd import diag_inputs_needed

        diag = list(diag_inputs_needed(lit["PARAMS"]))  # the token-block routes' diagonal-tile copies
        assert names == ["q", "q_scale", "k", "k_scale", "v_t", "v_scale"] + diag + tail
        assert "QGMMA" not in a  # sanity: the source is DSL, not SASS
    elif v.param("q_fmt") == "e2m1" or dict(v.params).get("scores_bf16"):
        # nvfp4_mixed (BF16 QKᵀ on dequantized NVFP4), fp8_token_bf16qk / fp8_pv (BF16 QKᵀ on q, k): FP8 PV
        from flamia_gen.runtime.attn_fwd import diag_inputs_needed

        diag = list(diag_inputs_needed(lit["PARAMS"]))
        assert names == ["q", "k", "v_t", "v_scale"] + diag + ["qk_tensor_scale"] + tail
    else:
        assert names == ["q", "k", "v"] + tail
    for x in lit["ARGS"]:
        assert set(x) == {"name", "dtype", "shape", "role"}
    for tok in ("def load(", "def mma(", "def softmax(", "def epilogue(", "def can_implement(",
                "def _setup_attributes(", "def compile_args("):
        assert tok in a


def test_render_variants_differ_where_they_should():
    src = {v.name: render_variant(v) for v in VARIANTS}
    ovl = [n for n in src if "_ovl_" in n]
    plain = [n for n in src if "_ovl_" not in n]
    assert ovl and plain
    assert all("def overlap_tile(" in src[n] for n in ovl)
    assert not any("def overlap_tile(" in src[n] for n in plain)
    for n, s in src.items():
        assert ("key > row0" in s) == (not n.endswith("_noncausal"))


# ----------------------------------------------------------------------------- work list
def test_work_list_order_padding_and_counts():
    cu = torch.tensor([0, 5, 5, 300, 301], dtype=torch.int32)  # lengths 5, 0, 295, 1
    w = make_work_list(cu, 128, causal=True)
    assert w.dtype == torch.int32 and w.shape == (num_work(301, 4, 128), 3) == (7, 3)
    assert w.tolist() == [[2, 2, 0], [2, 1, 0], [0, 0, 0], [2, 0, 0], [3, 0, 0], [-1, -1, -1], [-1, -1, -1]]
    w2 = make_work_list(cu, 128, causal=False, T=301)
    # non-causal: every tile of a document does the same work; ties keep (doc, m_block) order
    assert w2.tolist()[:5] == [[2, 0, 0], [2, 1, 0], [2, 2, 0], [0, 0, 0], [3, 0, 0]]


@pytest.mark.parametrize("causal", [True, False])
def test_work_list_covers_every_tile_once(causal):
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 700, (23,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)]).to(torch.int32)
    T = int(cu[-1])
    tile_m, tile_n = 128, 192
    w = make_work_list(cu, tile_m, causal, T=T, tile_n=tile_n)
    assert w.shape[0] == -(-T // tile_m) + 23
    real = w[w[:, 0] >= 0]
    expect = {(d, m) for d in range(23) for m in range(-(-int(lens[d]) // tile_m))}
    assert {tuple(r[:2]) for r in real.tolist()} == expect and len(real) == len(expect)
    assert (w[len(real):] == -1).all()  # padding last
    keys = [min(int(lens[d]), (m + 1) * tile_m) if causal else int(lens[d]) for d, m, _ in real.tolist()]
    cost = [-(-k // tile_n) for k in keys]
    assert cost == sorted(cost, reverse=True)


def test_work_list_many_tiny_documents():
    cu = torch.arange(0, 1001, dtype=torch.int32)  # 1000 documents of one token
    w = make_work_list(cu, 128, True)
    assert w.shape[0] == 8 + 1000
    assert (w[:1000, 1] == 0).all() and (w[1000:] == -1).all()
    assert sorted(w[:1000, 0].tolist()) == list(range(1000))


# ----------------------------------------------------------------------------- input checks
def _fp8_inputs(T=40, HQ=4, HKV=2, D=128):
    tpad = -(-T // 16) * 16
    return dict(q=torch.zeros(T, HQ, D, dtype=torch.uint8), k=torch.zeros(T, HKV, D, dtype=torch.uint8),
                v=torch.zeros(HKV, D, tpad, dtype=torch.uint8), q_scale=torch.zeros(T, HQ, dtype=torch.uint8),
                k_scale=torch.zeros(T, HKV, dtype=torch.uint8), v_scale=torch.zeros(T, HKV, dtype=torch.uint8),
                cu_seqlens=torch.tensor([0, 10, T], dtype=torch.int32))


def _bf16_inputs(T=40, HQ=4, HKV=2, D=128):
    return dict(q=torch.zeros(T, HQ, D, dtype=torch.bfloat16), k=torch.zeros(T, HKV, D, dtype=torch.bfloat16),
                v=torch.zeros(T, HKV, D, dtype=torch.bfloat16), cu_seqlens=torch.tensor([0, 10, T], dtype=torch.int32))


def test_check_inputs_ok():
    assert check_fwd_inputs(**_fp8_inputs(), fp8=True, head_dim=128) == (40, 4, 2, 128)
    assert check_fwd_inputs(**_bf16_inputs(), fp8=False) == (40, 4, 2, 128)
    x = _fp8_inputs()
    x["q"] = x["q"].view(torch.float8_e4m3fn)
    check_fwd_inputs(**x, fp8=True)


@pytest.mark.parametrize("mutate, match", [
    (lambda x: x.update(q=x["q"].to(torch.int32)), "q: dtype"),
    (lambda x: x.update(q=torch.zeros(40, 4, 96, dtype=torch.uint8)), "unsupported head dim on sm90"),
    (lambda x: x.update(k=torch.zeros(40, 3, 128, dtype=torch.uint8)), "k: HQ=4 is not a multiple of HKV=3"),
    (lambda x: x.update(v=torch.zeros(2, 128, 40, dtype=torch.uint8)), "v_t: T_PAD=40"),
    (lambda x: x.update(k_scale=torch.zeros(40, 4, dtype=torch.uint8)), "k_scale: shape"),
    (lambda x: x.update(v_scale=torch.zeros(40, 2, dtype=torch.int8)), "v_scale: dtype"),
    (lambda x: x.update(q=torch.zeros(4, 40, 128, dtype=torch.uint8).transpose(0, 1)), "q: must be contiguous"),
    (lambda x: x.update(cu_seqlens=torch.tensor([0, 10, 40], dtype=torch.int64)), "cu_seqlens: dtype"),
    (lambda x: x.update(cu_seqlens=torch.tensor([0, 30, 20, 40], dtype=torch.int32)), "non-decreasing"),
    (lambda x: x.update(cu_seqlens=torch.tensor([0, 10, 39], dtype=torch.int32)), r"cu_seqlens\[-1\]"),
])
def test_check_inputs_errors(mutate, match):
    x = _fp8_inputs()
    mutate(x)
    with pytest.raises(ValueError, match=match):
        check_fwd_inputs(**x, fp8=True)


def test_check_inputs_head_dim_mismatch_and_bf16_scales():
    with pytest.raises(ValueError, match="compiled for"):
        check_fwd_inputs(**_fp8_inputs(D=64), fp8=True, head_dim=128)
    with pytest.raises(ValueError, match="q_scale: the bf16 route takes no scales"):
        check_fwd_inputs(**_bf16_inputs(), q_scale=torch.zeros(40, 4, dtype=torch.uint8), fp8=False)


def test_run_attn_fwd_calls_in_args_order():
    """A fake tvm-ffi function records what the wrapper passes, in ARGS order."""
    v = next(v for v in VARIANTS if v.param("q_fmt") == "e4m3")
    lit = _literals(render_variant(v))
    seen = []

    def fake(*args):
        seen.extend(args)

    x = _fp8_inputs()
    o, lse = run_attn_fwd(fake, lit["ARGS"], x["q"], x["k"], x["v"], x["q_scale"], x["k_scale"], x["v_scale"],
                          cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"], poison=True)
    assert [a["name"] for a in lit["ARGS"]] == ["q", "q_scale", "k", "k_scale", "v_t", "v_scale", "cu_seqlens",
                                                "row_doc", "work", "unit_counter", "softmax_scale", "o", "lse"]
    assert seen[0].dtype == torch.float8_e4m3fn and seen[4].dtype == torch.float8_e4m3fn
    assert seen[7].shape == (40, 2) and seen[7].dtype == torch.int32  # documents [0, 10), [10, 40)
    assert seen[7][:10].tolist() == [[0, 10]] * 10 and seen[7][10:].tolist() == [[10, 40]] * 30
    assert seen[8].shape == (num_work(40, 2, lit["PARAMS"]["tile_m"]), 3)
    assert seen[9].tolist() == [0] and seen[9].dtype == torch.int32  # fwd_dynamic's unit counter, zeroed
    assert seen[10] == pytest.approx(128 ** -0.5)
    assert seen[11] is o and seen[12] is lse
    assert o.shape == (40, 4, 128) and o.dtype == torch.bfloat16 and torch.isnan(o.float()).all()
    assert lse.shape == (4, 40) and lse.dtype == torch.float32


def test_run_attn_fwd_check_false_skips_the_checks_only():
    """check=False (the op path: inputs validated by the op, codes from the bundle's quantizers) passes the same
    arguments in the same order; check=True still names a bad input."""
    v = next(v for v in VARIANTS if v.param("q_fmt") == "e4m3")
    lit = _literals(render_variant(v))
    x = _fp8_inputs()
    calls = []
    for check in (True, False):
        seen = []
        run_attn_fwd(lambda *a: seen.extend(a), lit["ARGS"], x["q"], x["k"], x["v"], x["q_scale"], x["k_scale"],
                     x["v_scale"], cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"], check=check)
        calls.append(seen)
    assert len(calls[0]) == len(calls[1]) == len(lit["ARGS"])
    for a, b in zip(*calls):
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype
            if a.dtype != torch.bfloat16 and a.dtype != torch.float32:  # inputs, schedule, counter (not o, lse)
                assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                   b.view(torch.uint8) if b.element_size() == 1 else b)
        else:
            assert a == b
    with pytest.raises(ValueError, match="q_scale"):
        run_attn_fwd(lambda *a: None, lit["ARGS"], x["q"], x["k"], x["v"], x["q_scale"].float(), x["k_scale"],
                     x["v_scale"], cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"])
    # the int32 offset bound holds with check=False too (no caller's validation covers it): a q of 2^31 elements,
    # as a zero-stride view (no memory), is refused before any launch
    huge = torch.zeros(1, dtype=x["q"].dtype).expand(2 ** 31 // (4 * 128), 4, 128)
    with pytest.raises(ValueError, match="int32 element offsets"):
        run_attn_fwd(lambda *a: pytest.fail("launched"), lit["ARGS"], huge, x["k"], x["v"], x["q_scale"],
                     x["k_scale"], x["v_scale"], cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"], check=False)


def test_runtime_imports_without_dsl():
    code = "import sys; sys.modules['cutlass'] = None; import flamia_gen.runtime.attn_fwd; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# ----------------------------------------------------------------------------- compile
@pytest.mark.compile
def test_compile_fp8_token_variant(compile_sm90):
    v = next(v for v in VARIANTS if v.param("q_fmt") == "e4m3" and "_ovl_" in v.name and not v.name.endswith("_noncausal"))
    ptx = compile_sm90(v)
    n = v.param("tile_n")
    assert f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3" in ptx  # QKᵀ
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # PV, P from registers
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert "cp.async.bulk.tensor" in ptx


@pytest.mark.compile
def test_compile_bf16_variant(compile_sm90):
    v = next(v for v in VARIANTS if v.route == "bf16" and "_ovl_" not in v.name)
    ptx = compile_sm90(v)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx


# ----------------------------------------------------------------------------- key tiling (TMA alignment)
# Bug class (H200, 2026-11-29): the fp8 route crashed with "illegal instruction" whenever a
# document started at a token that is not a multiple of 16. Vᵀ codes are (HKV, D, T_PAD) with
# keys contiguous, and a TMA tile load's innermost coordinate must be a multiple of 16 bytes;
# the kernel offset the Vᵀ TMA by doc_start on that axis. Key tiles now start at
# key_base = doc_start rounded down to 16 and mask the delta leading keys of the previous document.
def _key_tiling_fn(src: str):
    """`key_tiling` of a rendered variant, run on Python ints (no DSL needed)."""
    tree = ast.parse(src)
    consts = {}
    fn = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("TILE_M", "TILE_N", "KEY_ALIGN"):
            consts[node.targets[0].id] = ast.literal_eval(node.value)
        if isinstance(node, ast.FunctionDef) and node.name == "key_tiling":
            fn = node
    assert fn is not None and set(consts) == {"TILE_M", "TILE_N", "KEY_ALIGN"}
    ns = dict(consts, cutlass=type("C", (), {"min": staticmethod(min), "max": staticmethod(max)}))
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "key_tiling", "exec"), ns)
    return ns["key_tiling"], consts


@pytest.mark.parametrize("v", [v for v in VARIANTS if v.param("q_fmt") == "e4m3"], ids=lambda v: v.name)
def test_fp8_vt_tma_never_offset_by_doc_start_on_its_contiguous_axis(v):
    src = render_variant(v)
    assert "domain_offset((0, doc_start)" not in src
    assert src.count("domain_offset((0, key_base), mV[None, None, hkv])") == 1
    assert "KEY_ALIGN = 16" in src
    # every TMA coordinate/offset on K and V goes through key_base, never doc_start (k_row_perm: K's rank-5 view
    # takes key_base as its token offset, a multiple of 16 so the permutation stays inside 16-key groups)
    assert "domain_offset((doc_start, 0), mK" not in src and "domain_offset((doc_start, " not in src
    k_off = ("domain_offset((key_base, hkv * self.head_dim), mK" if _literals(src)["PARAMS"]["k_row_perm"]
             else "domain_offset((key_base, 0), mK")
    assert k_off in src


def _tile_order(nblk, n_mask, n_lo):
    """Order of key tiles (producer and consumers), as documented in key_tiling."""
    return list(range(nblk - 1, n_mask - 1, -1)) + ([0] if n_lo else []) + list(range(n_mask - 1, n_lo - 1, -1))


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_key_tiling_aligned_and_covers_and_masks(v):
    key_tiling, c = _key_tiling_fn(render_variant(v))
    causal = v.param("causal")
    tm, tn, align = c["TILE_M"], c["TILE_N"], c["KEY_ALIGN"]
    fp8 = v.param("v_fmt") == "e4m3"  # the FP8 PV side (nvfp4_mixed, the BF16-score routes too): Vᵀ E4M3 K-major (16-aligned TMA)
    assert align == (16 if fp8 else 1)
    g = torch.Generator().manual_seed(1)
    starts = [0, 1, 3, 6, 15, 16, 17, 1000, 1024, 1300, 4099] + torch.randint(0, 10 ** 6, (40,), generator=g).tolist()
    lens = [1, 2, 3, 5, 64, 127, 128, 129, 130, 255, 300, 1000, 4096]
    for s in starts:
        for L in lens:
            for mb in range(-(-L // tm)):
                kb, delta, nblk, n_mask, n_lo = key_tiling(mb, s, L)
                assert kb + delta == s and 0 <= delta < 16 and kb % align == 0
                if not fp8:
                    assert delta == 0 and n_lo == 0
                order = _tile_order(nblk, n_mask, n_lo)
                assert sorted(order) == list(range(nblk)), (s, L, mb)
                masked = set(range(n_mask, nblk)) | ({0} if n_lo else set())
                rows = range(mb * tm, min((mb + 1) * tm, L))
                last_visible = max(rows) if causal else L - 1
                for n in range(nblk):
                    keys = range(n * tn - delta, (n + 1) * tn - delta)  # document-local
                    # TMA coordinate of the tile on Vᵀ's contiguous axis: 16-byte aligned
                    assert not fp8 or (kb + n * tn) % 16 == 0
                    needs_mask = keys[0] < 0 or keys[-1] >= L or (causal and keys[-1] > rows[0])
                    assert not needs_mask or n in masked, (s, L, mb, n)
                # every visible key of the tile's rows is in a visited tile
                assert (last_visible + delta) // tn < nblk


@pytest.mark.parametrize("v", [v for v in VARIANTS if v.param("tile_n") == 128 or v.route == "fp8_token"],
                         ids=lambda v: v.name)
def test_emulator_visits_key_tiles_in_the_kernel_order(v):
    """The emulator rounds P̂ under the running max in the kernel's tile order
    (numerics.reference_route.tile_visit_rank): it must be key_tiling's order, row by row."""
    from flamia_gen.numerics.reference_route import make_plan as emu_plan, tile_visit_rank
    from flamia_gen.spec import get_route

    key_tiling, c = _key_tiling_fn(render_variant(v))
    tm, tn = c["TILE_M"], c["TILE_N"]
    plan = emu_plan(get_route(v.route), v.param("causal"), tm, tn, 1.0, key_align=c["KEY_ALIGN"])
    for s in (0, 1, 6, 15, 16, 1000, 1300, 4099):
        for L in (1, 2, 64, 127, 128, 129, 130, 300, 1000):
            delta = s % c["KEY_ALIGN"]
            n_tiles = (L + delta + tn - 1) // tn
            rows = torch.arange(L)
            order = tile_visit_rank(plan, rows, L, delta, n_tiles).argsort(dim=1)
            for mb in range(-(-L // tm)):
                _, d, nblk, n_mask, n_lo = key_tiling(mb, s, L)
                assert d == delta
                want = _tile_order(nblk, n_mask, n_lo)
                for r in (mb * tm, min((mb + 1) * tm, L) - 1):
                    assert order[r, :nblk].tolist() == want, (s, L, mb, r)


# ----------------------------------------------------------------------------- K-row permutation (fp8)
# K_ROW_PERM (template flag, on by default for the E4M3-QKᵀ mode since 2026-12-02): the K tile's smem rows are loaded in the key order
# key_of_col, so that the QKᵀ accumulator of thread t already holds the keys of the k32 E4M3 A
# fragment of PV (no quad shuffles). Everything that names a key by its S column (the per-key
# scale words, the masks) must go through the same map. These tests run the rendered helpers on
# Python ints against the wgmma fragment layouts.
def _module_fns(src: str, names):
    tree = ast.parse(src)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {f.name for f in fns} == set(names)
    ns: dict = {}
    exec(compile(ast.Module(body=fns, type_ignores=[]), "helpers", "exec"), ns)
    return [ns[n] for n in names]


_FP8 = [v for v in VARIANTS if v.param("q_fmt") == "e4m3" and not dict(v.params).get("scores_bf16")]  # E4M3 QKᵀ
_HELPERS = ("key_of_col", "col_of_key", "scale_word", "p_pack")


def test_k_row_perm_default_on_for_e4m3_qk_only():
    """On for the E4M3-QKᵀ mode (round 12), off (the identity key map) for every other mode; k_row_perm=False
    renders the shuffle path of the P permutation again."""
    for v in VARIANTS:
        src = render_variant(v)
        on = v in _FP8
        assert (f"K_ROW_PERM = {on}" in src) and _literals(src)["PARAMS"]["k_row_perm"] is on
        key_of_col, col_of_key, _, _ = _module_fns(src, _HELPERS)
        identity = all(key_of_col(c) == c == col_of_key(c) for c in range(v.param("tile_n")))
        assert identity is not on
        assert ("shuffle_sync(send_a" in src) is (not on and v.param("v_fmt") == "e4m3")  # FP8 P̂ by shuffles
    for v in _FP8:
        off = render_with_flags(v, k_row_perm=False)
        assert "K_ROW_PERM = False" in off and "shuffle_sync(send_a" in off


@pytest.mark.parametrize("v", _FP8, ids=lambda v: v.name)
def test_k_row_perm_mapping_matches_fragments_scales_and_mask(v):
    src = render_with_flags(v, k_row_perm=True)
    ast.parse(src)
    assert "K_ROW_PERM = True" in src and _literals(src)["PARAMS"]["k_row_perm"] is True
    assert "shuffle_sync(send_a" not in src  # P goes to PV without shuffles
    key_of_col, col_of_key, scale_word, p_pack = _module_fns(src, _HELPERS)
    n = v.param("tile_n")
    # bijection inside every 16-key group, col_of_key its inverse
    assert sorted(key_of_col(c) for c in range(n)) == list(range(n))
    for c in range(n):
        assert key_of_col(c) // 16 == c // 16 and col_of_key(key_of_col(c)) == c
    # accumulator (m64nNk32 C): thread (g = lane // 4, t = lane % 4), index cp + 2·rh + 4·cg holds
    # row g + 8·rh, column 8·cg + 2t + cp. FP8 A (k32): register 4·kb + 2·q + rh, byte j holds
    # row g + 8·rh, k = 32·kb + 16·q + 4t + j. With K rows permuted, column c is key key_of_col(c)
    # and PV's k index is the natural key (V unpermuted).
    for t in range(4):
        for kb in range(n // 32):
            for q in range(2):
                for rh in range(2):
                    idx = p_pack(kb, q, rh)
                    for j, i in enumerate(idx):
                        cp, rh_i, cg = i % 2, (i // 2) % 2, i // 4
                        assert rh_i == rh
                        assert key_of_col(8 * cg + 2 * t + cp) == 32 * kb + 16 * q + 4 * t + j
        # the softmax's mask key: key_of_col(col) = key_of_col(8·cg + cp) + key_of_col(2t)
        for cg in range(n // 8):
            for cp in range(2):
                assert key_of_col(8 * cg + 2 * t + cp) == key_of_col(8 * cg + cp) + key_of_col(2 * t)
    # every acc index packed exactly once
    packed = [i for kb in range(n // 32) for q in range(2) for rh in range(2) for i in p_pack(kb, q, rh)]
    assert sorted(packed) == list(range(n // 2))
    # scale words: the producer writes key k at scale_word(col_of_key(k), w); the consumer reads
    # column c's words with one 16-byte load at scale_word(c even, 0) and one 8-byte load at
    # scale_word(c even, 2); the mask of column c uses key_of_col(c): the same key.
    words = [scale_word(col_of_key(k), w) for k in range(n) for w in range(3)]
    assert len(set(words)) == len(words) and max(words) < 4 * n
    for c in range(0, n, 2):
        assert scale_word(c, 0) % 4 == 0 and scale_word(c, 2) % 2 == 0
        assert [scale_word(c, 0) + d for d in range(4)] == [scale_word(c, 0), scale_word(c + 1, 0),
                                                            scale_word(c, 1), scale_word(c + 1, 1)]
        assert scale_word(c, 2) + 1 == scale_word(c + 1, 2)
        for cc in (c, c + 1):
            k = key_of_col(cc)
            assert scale_word(col_of_key(k), 0) == scale_word(cc, 0)
    # the K TMA view: smem row r of a 16-aligned tile receives token offset
    # (2, 4, 2, ·):(1, 4, 2, 16)(r), which must be key_of_col(r)
    assert "((2, 4, 2, k_tpad16), k_row), stride=((k_row, 4 * k_row, 2 * k_row, 16 * k_row), 1)" in src
    for r in range(n):
        assert (r % 2) * 1 + ((r // 2) % 4) * 4 + ((r // 8) % 2) * 2 + (r // 16) * 16 == key_of_col(r)
    # key tiles of the permuted K start at multiples of 16 (the permutation is per 16-key group)
    key_tiling, _ = _key_tiling_fn(src)
    for s in (0, 1, 15, 17, 1000, 4099):
        assert key_tiling(0, s, 100)[0] % 16 == 0


def test_k_rows_for_tma_pads_only_when_needed():
    from flamia_gen.runtime.attn_fwd import k_rows_for_tma
    k = torch.arange(40 * 2 * 8, dtype=torch.int32).to(torch.uint8).view(40, 2, 8)
    assert k_rows_for_tma(k, 48) is not k
    kp = k_rows_for_tma(k, 48)
    assert kp.shape == k.shape and torch.equal(kp, k)
    assert kp.untyped_storage().nbytes() >= 48 * 2 * 8 and kp.is_contiguous()
    big = torch.zeros(48, 2, 8, dtype=torch.uint8)
    view = big[:40]
    assert k_rows_for_tma(view, 48) is view  # storage already holds T_PAD rows
    assert k_rows_for_tma(k, 40) is k


def test_run_attn_fwd_k_row_perm_passes_padded_k():
    v = _FP8[0]
    lit = _literals(render_with_flags(v, k_row_perm=True))
    seen = []
    x = _fp8_inputs()  # T = 40, T_PAD = 48
    run_attn_fwd(lambda *a: seen.extend(a), lit["ARGS"], x["q"], x["k"], x["v"], x["q_scale"], x["k_scale"],
                 x["v_scale"], cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"])
    k = seen[2]
    assert k.shape == (40, 2, 128) and k.untyped_storage().nbytes() >= 48 * 2 * 128


@pytest.mark.compile
def test_compile_fp8_k_row_perm_variant(compile_sm90):
    v = next(v for v in _FP8 if "_ovl_" in v.name and not v.name.endswith("_noncausal"))
    compile_sm90(v, source=render_with_flags(v, k_row_perm=True))


# ----------------------------------------------------------------------------- performance-experiment flags
# kv_stages, release_k_early, exp_poly_frac, ovl_pingpong (template flags, all at their defaults;
# flamia_gen/bench/fwd_experiments.py builds them into one bundle for a GPU session). At their
# defaults the rendered source must be byte-identical to the verified kernel. kv_stages' default is its absence
# (none: the variant's `stages`), and render_variant refuses a None value, so it is not set here.
_EXP_OFF = dict(release_k_early=False, exp_poly_frac=0, ovl_pingpong=True)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_experiment_flags_off_by_default_render_identical(v):
    src = render_variant(v)
    assert render_with_flags(v, **_EXP_OFF) == src
    for tok in ("factor_slot", "ex2_poly3", "RELEASE_K_EARLY", "EXP_POLY_QUARTERS", "kv_stages",
                "ovl_pingpong", "release_k_early", "exp_poly_frac", "pv_defer", "max_tree", "v_prev", "fk_prefetch",
                "fkp0"):
        assert tok not in src


def _factor_slot_fn(src: str):
    (fn,) = _module_fns(src, ("factor_slot",))
    stages = next(ast.literal_eval(n.value) for n in ast.parse(src).body
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "STAGES")
    fn.__globals__["STAGES"] = stages
    return fn, stages


def _pipe_states(stages, n, phase0):
    """(index, phase) per tile as the DSL's PipelineState.advance gives them."""
    idx, ph = 0, phase0
    for _ in range(n):
        yield idx, ph
        idx += 1
        if idx == stages:
            idx, ph = 0, ph ^ 1


def _factor_race(slot_of, stages, n_tiles=64):
    """Eager producer vs consumer order with K released right after QKᵀ: producer writes the
    factors of tile t as soon as the consumers released K of tile t − stages (its K-empty wait);
    the consumers' program order per tile is QKᵀ(t), release K(t), softmax(t) [reads slot(t)],
    and QKᵀ(t+1) follows softmax(t) (overlap or not). Returns the first (t, t') where tile t's
    write lands on a slot whose earlier tile t' was not yet read, or None."""
    reads_done = set()
    for t in range(n_tiles):
        # write(t) happens right after release(t − stages): the softmaxes done by then are
        # those of tiles ≤ t − stages − 1 (softmax(t − stages) comes after that release)
        reads_done = set(range(t - stages))
        for t2 in range(t):
            if slot_of(t2) == slot_of(t) and t2 not in reads_done:
                return t, t2
    return None


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("v", _FP8, ids=lambda v: v.name)
def test_release_k_early_factor_slots_protocol(v, stages):
    src = render_with_flags(v, release_k_early=True, kv_stages=stages)
    lit = _literals(src)["PARAMS"]
    assert lit["release_k_early"] is True and lit["stages"] == lit["kv_stages"] == stages
    assert f"STAGES = {stages}" in src and "RELEASE_K_EARLY = True" in src
    factor_slot, S = _factor_slot_fn(src)
    assert S == stages
    # producer (phase starts at 1, passes phase ^ 1) and consumers agree on every tile's slot
    prod = [factor_slot(i, p ^ 1) for i, p in _pipe_states(S, 200, 1)]
    cons = [factor_slot(i, p) for i, p in _pipe_states(S, 200, 0)]
    assert prod == cons and set(cons) == set(range(2 * S))
    assert all(cons[t] == cons[t % (2 * S)] for t in range(200))  # reuse distance 2·stages
    assert _factor_race(lambda t: cons[t], S) is None
    # negative control: one slot per stage (the default layout) races with the early release
    assert _factor_race(lambda t: t % S, S) is not None
    # the factor buffer has 2·stages slots, on both sides of the allocation
    assert src.count("2 * self.stages * self.scale_words") == 2
    if lit.get("fwd_ukv_bare_k"):  # fp8_tensor: the producer writes no per-key factor at all (round 24)
        assert "sScale[base + scale_word(" not in src and "pipe_k.sync_object_full.arrive(" not in src
    else:
        assert "base = factor_slot(kv_state.index, kv_state.phase ^ 1) * self.scale_words" in src
    # K is released before the softmax reads the factors, in every consumer path
    for fn in ("def one_tile(", "def overlap_tile(", "def first_tile("):
        if fn not in src:
            continue
        body = src[src.index(fn):]
        body = body[:body.index("    @cute.jit", 10) if "    @cute.jit" in body[10:] else len(body)]
        rel, sm = body.find("pipe_k.consumer_release(kv_state)"), body.find("self.softmax(")
        assert 0 < rel < sm, fn
        assert "factor_slot(kv_state.index, kv_state.phase)" in body[sm:sm + 200]
    # smem still fits with 3 stages at n192 (scales doubled)
    n, d = v.param("tile_n"), v.param("head_dim")
    smem = 128 * d + stages * 2 * n * d + 128 * (d + 8) * 2 + 2 * stages * 4 * n * 4 + 4 * 1024
    assert smem <= 232448


def _ex2_poly3_emulated(src: str):
    """The PTX of ex2_poly3 (constants read from the rendered source) on numpy float32."""
    import re
    import struct

    import numpy as np

    i = src.index("def ex2_poly3(")
    body = src[i:i + 2000]
    hexf = lambda h: struct.unpack("<f", struct.pack("<I", int(h, 16)))[0]  # noqa: E731
    lo = hexf(re.search(r"max\.ftz\.f32 xc, \$1, 0f([0-9A-F]{8})", body).group(1))
    magic = hexf(re.search(r"add\.rm\.ftz\.f32 xr, xc, 0f([0-9A-F]{8})", body).group(1))
    c3, c2 = map(hexf, re.search(r"fma\.rn\.ftz\.f32 p, f, 0f([0-9A-F]{8}), 0f([0-9A-F]{8})", body).groups())
    c1, c0 = map(hexf, re.findall(r"fma\.rn\.ftz\.f32 p, p, f, 0f([0-9A-F]{8})", body))
    assert "shl.b32 ri, ri, 23" in body and "add.s32 ri, ri, pb" in body

    def f(x):
        x = np.asarray(x, np.float32)
        xc = np.where(np.isnan(x), np.float32(lo), np.maximum(x, np.float32(lo)))
        xr = (np.float32(magic) + np.floor(xc)).astype(np.float32)  # add.rm: exact for |x| < 2^22
        fr = (xc - (xr - np.float32(magic))).astype(np.float32)
        p = np.float32(c0) + fr.astype(np.float64) * (c1 + fr.astype(np.float64) * (c2 + fr.astype(np.float64) * c3))
        p = p.astype(np.float32)
        bits = (xr.view(np.uint32) << np.uint32(23)) + p.view(np.uint32)
        return bits.astype(np.uint32).view(np.float32)
    return f


@pytest.mark.parametrize("frac, quarters", [(0.25, 1), (0.5, 2)])
def test_exp_poly_frac_render_and_accuracy(frac, quarters):
    import numpy as np

    v = next(v for v in _FP8 if "_ovl_" not in v.name and v.param("causal"))
    src = render_with_flags(v, exp_poly_frac=frac)
    assert _literals(src)["PARAMS"]["exp_poly_frac"] == frac
    assert f"EXP_POLY_QUARTERS = {quarters}" in src
    assert "if const_expr(cg % 4 < EXP_POLY_QUARTERS):" in src
    ncg = v.param("tile_n") // 8
    assert sum(cg % 4 < quarters for cg in range(ncg)) / ncg == frac  # the fraction of elements
    f = _ex2_poly3_emulated(src)
    x = np.concatenate([np.linspace(-126, 8, 200001, dtype=np.float32), np.float32([0, 1, 7.999, 8])])
    rel = np.abs(f(x).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < 1e-4
    assert f(np.float32([-np.inf, -1000.0, np.nan])).tolist() == [0.0, 0.0, 0.0]
    assert np.all(f(np.float32([-127.0, -130.0])) < 2.0 ** -126)  # below ex2.approx.ftz's range: ~0


def test_three_consumer_warpgroups_render_registers_and_tiling():
    w3 = [v for v in VARIANTS if v.param("compute_warpgroups") == 3]
    assert w3 and all(v.param("tile_m") == 192 and not v.param("intra_wg_overlap") for v in w3)
    # D = 128: m192n128 only (n192: registers), and not BF16 (shared memory); D = 64 fits all of them
    w3_128 = [v for v in w3 if v.param("head_dim") == 128]
    assert all(v.param("tile_n") == 128 for v in w3_128)
    assert {v.route for v in w3_128} == {"fp8_tensor", "fp8_token", "fp8_token_bf16qk", "fp8_pv", "mxfp8", "mxfp8_exact",
                                         "nvfp4_mixed"}
    assert {(v.route, v.param("tile_n")) for v in w3 if v.param("head_dim") == 64} == {
        (r, n) for r in ("bf16", "fp8_tensor", "fp8_token", "fp8_token_bf16qk", "fp8_pv", "mxfp8", "mxfp8_exact",
                         "nvfp4_mixed") for n in (128, 192)}
    for v in w3:
        src = render_variant(v)
        lit = _literals(src)["PARAMS"]
        assert lit["tile_m"] == 192 and lit["compute_warpgroups"] == 3
        assert "TILE_M = 192" in src and "NUM_WG = 3" in src
        assert "self.regs_producer = 32" in src and "self.regs_consumer = 160" in src
        assert 128 * 32 + 3 * 128 * 160 <= 65536  # setmaxnreg budget of the 512-thread CTA
        assert "def sched_wait(" not in src  # ping-pong is a 2-warpgroup protocol
        test_key_tiling_aligned_and_covers_and_masks(v)


def test_np_experiment_launches_one_cta_per_unit():
    """Tag np (not yet run on a GPU): the static scheduler class, grid = units, every unit's own CTA; the default
    stays persistent."""
    from flamia_gen.bench.fwd_experiments import experiment_variants

    tagged = [(t, v) for t, v in experiment_variants(("np",), base_variants=_FP8) if t == "np"]
    assert len(tagged) == len(_FP8)
    for _, v in tagged:
        src = render_variant(v)
        assert "class StaticScheduler:" in src and "class LongestFirstScheduler:" not in src
        assert _literals(src)["PARAMS"]["scheduler"] == "static"
        base = render_variant(next(b for b in _FP8 if b.name + "_xnp" == v.name))
        assert "class LongestFirstScheduler:" in base


def test_nopp_experiment_drops_only_the_ping_pong():
    from flamia_gen.bench.fwd_experiments import experiment_variants

    tagged = experiment_variants(("nopp",), base_variants=_FP8)
    nopp = [v for t, v in tagged if t == "nopp"]
    assert nopp and all(v.param("intra_wg_overlap") for v in nopp)
    for v in nopp:
        src = render_variant(v)
        assert "def sched_wait(" not in src and "def overlap_tile(" in src
        assert _literals(src)["PARAMS"]["ovl_pingpong"] is False
        base = render_variant(next(b for b in _FP8 if b.name + "_xnopp" == v.name))
        assert "def sched_wait(" in base


def test_fwd_experiments_module_imports_without_dsl_and_names():
    code = ("import sys; sys.modules['cutlass'] = None; import flamia_gen.bench.fwd_experiments as m; "
            "tv = m.experiment_variants(); names = [v.name for _, v in tv]; "
            "assert len(names) == len(set(names)); "
            "assert all(m.split_name(v.name) == ((v.name[:-len(t) - 2], t) if t else (v.name, '')) for t, v in tv); "
            "print(len(names))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.strip()) > 6


@pytest.mark.parametrize("route", ["bf16", "fp8_token"])
def test_route_exp_approx_poly3_selects_the_polynomial(route):
    """`exp_approx: poly3` on a route renders half of the exp2s on the FMA pipe (the emulator's
    numerics.exp2.POLY_QUARTERS); ex2 routes render without the polynomial at all."""
    from flamia_gen.numerics.exp2 import POLY_QUARTERS

    v = next(v for v in VARIANTS if v.route == route)
    assert "ex2_poly3" not in render_variant(v)
    src = render_with_flags(v, exp_approx="poly3")
    assert f"EXP_POLY_QUARTERS = {POLY_QUARTERS['poly3']}" in src and "def ex2_poly3" in src
    assert '"exp_approx": "poly3"' in src


@pytest.mark.compile
@pytest.mark.parametrize("route", ["fp8_token", "bf16"])
def test_compile_head_dim_64(compile_sm90, route):
    """D = 64 renders and cross-compiles (the spec ships D = 128 only until a D = 64 variant is
    verified and tuned on the H200: adding it to specs/kernels re-tunes the table)."""
    v = next(v for v in VARIANTS if v.route == route and v.param("causal") and "_ovl_" not in v.name
             and v.param("tile_n") == 128)
    src = render_with_flags(v, head_dim=64)
    assert "HEAD_DIM = 64" in src and '"head_dim": 64' in src
    ptx = compile_sm90(v, source=src)
    k = "k32.f32.e4m3.e4m3" if route == "fp8_token" else "k16.f32.bf16.bf16"
    assert f"wgmma.mma_async.sync.aligned.m64n64{k}" in ptx  # PV: N = D = 64


# ----------------------------------------------------------------------------- round 12 (2026-12-02)
# ex2_ring (on for the E4M3-QKᵀ mode without intra-warpgroup overlap; since 2026-12-03 also the BF16-QKᵀ mode at
# D = 64 and nvfp4_mixed): the consumer warpgroups take turns
# for pass 2 of the softmax through a ring of named barriers. pv_defer, max_tree, fk_prefetch: measured, not adopted,
# removed in round 13.
def _ring_expected(v) -> bool:
    """The E4M3-QKᵀ mode; since 2026-12-03 also the BF16-QKᵀ mode at D = 64 and nvfp4_mixed (its QKᵀ is BF16 too)."""
    qk16 = v.param("q_fmt") == "e2m1" or bool(dict(v.params).get("scores_bf16"))
    mode = v in _FP8 or (qk16 and (v.param("head_dim") == 64 or v.param("q_fmt") == "e2m1"))
    return mode and not v.param("intra_wg_overlap") and v.param("compute_warpgroups") >= 2


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_ex2_ring_default_and_barrier_ids(v):
    src = render_variant(v)
    on = _ring_expected(v)
    assert ("EX2_RING_BAR0" in src) is on and ('"ex2_ring": True' in src) is on
    if not on:
        return
    wg = v.param("compute_warpgroups")
    bar0 = next(ast.literal_eval(n.value) for n in ast.parse(src).body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "EX2_RING_BAR0")
    ring_ids = set(range(bar0, bar0 + wg))
    # 0: __syncthreads, 1 … WG: the epilogue's per-warpgroup barriers, 3 and 4: the ping-pong's (never together
    # with the ring: the ring is off with intra-warpgroup overlap); 16 hardware named barriers
    assert not ring_ids & ({0} | set(range(1, wg + 1)) | {3, 4}) and max(ring_ids) <= 15
    assert "def sched_wait(" not in src
    # softmax: wait for this warpgroup's turn right before pass 2, hand it on right after the pass-2 loop
    body = src[src.index("    def softmax("):src.index("    def load_scales(")]
    wait = body.index("cute.arch.barrier(barrier_id=EX2_RING_BAR0 + cwg, number_of_threads=256)")
    p2 = body.index("# pass 2: one ex2 per element")
    arrive = body.index("cute.arch.barrier_arrive(barrier_id=EX2_RING_BAR0 + nxt, number_of_threads=256)")
    assert wait < p2 < body.index("e = ex2(") < arrive < body.index("row_sum[rh] = row_sum[rh] * scale_o[rh] + rs[rh]")
    assert body.count("barrier(barrier_id=EX2_RING_BAR0") == 1 and body.count("barrier_arrive(barrier_id=EX2_RING_BAR0") == 1
    assert f"if nxt == {wg}:" in body
    # the first turn is warpgroup 0's: the last warpgroup arrives once before the unit loop
    mma = src[src.index("    def mma("):src.index("    def gemm(")]
    assert f"if wg == {wg - 1}:\n            cute.arch.barrier_arrive(barrier_id=EX2_RING_BAR0, number_of_threads=256)" in mma
    assert mma.index("barrier_arrive(barrier_id=EX2_RING_BAR0") < mma.index("while unit < num_units:")
    assert render_with_flags(v, ex2_ring=False).count("EX2_RING_BAR0") == 0


def _ring_protocol(src: str):
    """(wg, first barrier id, wait id of warpgroup w, arrive id of warpgroup w) as the rendered kernel has them: the
    first arrive's id is read from the source, and the ids of each warpgroup's wait and hand-on come from running the
    rendered statements of softmax on Python ints."""
    import re
    import textwrap
    from types import SimpleNamespace

    lit = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(src).body
           if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) in ("EX2_RING_BAR0", "NUM_WG")}
    wg, bar0 = lit["NUM_WG"], lit["EX2_RING_BAR0"]
    first = re.search(r"if wg == (\d+):\n\s+cute\.arch\.barrier_arrive\(barrier_id=EX2_RING_BAR0([^,]*),", src)
    assert first and int(first.group(1)) == wg - 1  # the last warpgroup gives warpgroup 0 its first turn
    first_id = eval("EX2_RING_BAR0" + first.group(2), {"EX2_RING_BAR0": bar0})
    sm = src[src.index("    def softmax("):src.index("    def load_scales(")]
    wait = sm[sm.index("cute.arch.barrier(barrier_id="):].split("\n")[0].strip()
    i = sm.index("nxt = cwg + 1")
    j = sm.index("\n", sm.index("barrier_arrive(barrier_id=EX2_RING_BAR0 + nxt", i))
    hand_on = textwrap.dedent(sm[sm.rindex("\n", 0, i) + 1:j])

    def ids(w):
        seen = []
        arch = SimpleNamespace(barrier=lambda barrier_id, number_of_threads: seen.append(("wait", barrier_id)),
                               barrier_arrive=lambda barrier_id, number_of_threads: seen.append(("arrive", barrier_id)))
        env = {"cwg": w, "Int32": int, "EX2_RING_BAR0": bar0, "cute": SimpleNamespace(arch=arch)}
        exec(wait, env)
        exec(hand_on, env)
        assert [k for k, _ in seen] == ["wait", "arrive"]
        return seen[0][1], seen[1][1]

    return wg, first_id, [ids(w)[0] for w in range(wg)], [ids(w)[1] for w in range(wg)]


@pytest.mark.parametrize("v", [next(v for v in _FP8 if _ring_expected(v) and v.param("compute_warpgroups") == n)
                               for n in (2, 3)] + [next(v for v in VARIANTS if v not in _FP8 and _ring_expected(v))],
                         ids=lambda v: v.name)
def test_ex2_ring_protocol_alternates_and_never_deadlocks(v):
    """The ring as the rendered kernel runs it (barrier ids read from its source), on a model of named barriers
    (bar.sync of one warpgroup completes once another warpgroup's bar.arrive on the same id is in, count 2 × 128):
    under any interleaving every warpgroup finishes its tiles and the pass-2 phases run strictly in turn
    0, 1, …, wg − 1, 0, …"""
    import random

    wg, first_id, wait_id, arrive_id = _ring_protocol(render_variant(v))
    tiles = 7
    for seed in range(200):
        rnd = random.Random(seed)
        arrived = {first_id: 1}  # arrives per barrier id not yet matched by a sync; the one before the unit loop
        done = [0] * wg
        order = []
        while any(d < tiles for d in done):
            ready = [w for w in range(wg) if done[w] < tiles and arrived.get(wait_id[w], 0) > 0]
            assert ready, f"deadlock at {done}"
            w = rnd.choice(ready)
            arrived[wait_id[w]] -= 1  # its bar.sync completes
            assert arrived[wait_id[w]] == 0  # never two arrives pending on one id: the count cannot overrun
            order.append(w)  # pass 2
            arrived[arrive_id[w]] = arrived.get(arrive_id[w], 0) + 1  # bar.arrive on the next one's
            done[w] += 1
        assert order == [i % wg for i in range(wg * tiles)]
        assert {k: n for k, n in arrived.items() if n} == {first_id: 1}  # the one arrive left pending at exit


@pytest.mark.parametrize("v", [v for v in _FP8 if "_wg3_" in v.name][:2], ids=lambda v: v.name)
def test_round12_experiment_flags_render(v):
    src = render_with_flags(v, ex2_ring=8)
    assert _literals(src)["PARAMS"]["ex2_ring"] == 8
    # ex2_ring = 8: the turn is handed on inside pass 2, after column group 7
    sm = src[src.index("    def softmax("):src.index("    def load_scales(")]
    assert "if const_expr(cg == 7):" in sm


@pytest.mark.compile
def test_compile_round12_default_and_experiments(compile_sm90):
    v = next(v for v in _FP8 if "_wg3_" in v.name and not v.name.endswith("_noncausal"))
    ptx = compile_sm90(v)
    assert "bar.arrive" in ptx and "cp.async.bulk.tensor.5d" in ptx  # the ring; K through the rank-5 TMA
    compile_sm90(v, source=render_with_flags(v, ex2_ring=8))


@pytest.mark.parametrize("route", ["fp8_token", "nvfp4_mixed", "fp8_pv"])
def test_every_forward_experiment_changes_the_kernel_it_copies(route):
    """An experiment copy renders differently from its base variant (outside PARAMS and the name): a flag that
    is already the default there, or that the template ignores for that mode, would time one kernel twice."""
    from flamia_gen.bench.fwd_experiments import EXPERIMENTS, experiment_variants, split_name

    def body(src: str, name: str) -> str:
        src = src.replace(name, "NAME")
        return src[src.index("# Runtime call signature"):]  # from ARGS on: after PARAMS

    base = {v.name: v for _, v in experiment_variants((), route=route)}
    tagged = experiment_variants(tuple(EXPERIMENTS), route=route)
    seen = set()
    for tag, v in tagged:
        if not tag:
            continue
        b = base[split_name(v.name)[0]]
        assert body(render_variant(v), v.name) != body(render_variant(b), b.name), (tag, b.name)
        seen.add(tag)
    assert ("ringon" in seen) is (route == "fp8_pv") and ("nokperm" in seen) is (route == "fp8_token")
    assert "noring" in seen  # the E4M3-QKᵀ mode; the BF16-QKᵀ mode at D = 64 and nvfp4_mixed


@pytest.mark.parametrize("v", [v for v in VARIANTS if v.param("causal") and dict(v.params).get("diag_v")],
                         ids=lambda v: v.name)
def test_short_documents_read_the_diagonal_copies_on_every_pair(v):
    """The backward's windows (bwd_sq32_windows) take the per-token V (and K) copies on every pair of a window's
    documents. That is what the forward did: a document shorter than the backward's tile_n (128; every document of a
    backward window is) has all its key tiles masked (n_mask 0), at any start, and the forward's own windows mask
    every tile too (its load: `if window != 0: n_mask, n_lo = 0, 0`)."""
    key_tiling, c = _key_tiling_fn(render_variant(v))
    assert c["TILE_M"] >= 128  # one forward query tile holds such a document
    g = torch.Generator().manual_seed(5)
    starts = [0, 1, 15, 16, 17, 31, 1000] + torch.randint(0, 10 ** 6, (30,), generator=g).tolist()
    for s in starts:
        for L in range(1, 128):
            kb, delta, nblk, n_mask, n_lo = key_tiling(0, s, L)
            assert n_mask == 0 and nblk >= 1, (s, L, n_mask)
    src = render_variant(v)
    assert "n_mask, n_lo = Int32(0), Int32(0)  # window: every tile masked" in src


@pytest.mark.parametrize("v", [v for v in _FP8 if "_fp8_tensor_" in v.name], ids=lambda v: v.name)
def test_ukv_bare_k_producer_writes_no_factors(v):
    """fwd_ukv_bare_k (round 24, default): with uniform K / V factors the producer loads and writes no per-key factor
    (the consumers read none), and the 2-warpgroup consumers release K right after QKᵀ; `ukvfac` renders the kernel
    before (per-key factors written, K held until after the softmax)."""
    src = render_variant(v)
    lit = _literals(src)["PARAMS"]
    if not lit.get("fwd_uniform_kv"):
        pytest.skip("not a uniform-factor variant")
    old = render_with_flags(v, fwd_ukv_bare_k=False)
    assert lit["fwd_ukv_bare_k"] is True and "fwd_ukv_bare_k" not in _literals(old)["PARAMS"]
    load_k = lambda s: s[s.index("def load_k("):s.index("def load_k(") + 4000]  # noqa: E731
    assert "mKs[tok, hkv]" not in load_k(src) and "pipe_k.producer_acquire(kv_state)" in load_k(src)
    assert "mKs[tok, hkv]" in load_k(old) and "sScale[base + scale_word(c, 0)]" in load_k(old)
    fn = "def overlap_tile(" if "def overlap_tile(" in src else "def one_tile("
    for s_, early in ((src, v.param("compute_warpgroups") == 2), (old, False)):
        body = s_[s_.index(fn):]
        rel, sm = body.find("pipe_k.consumer_release(kv_state)"), body.find("self.softmax(")
        assert (0 < rel < sm) is early, (fn, early)


@pytest.mark.parametrize("route", ["fp8_tensor", "bf16"])
def test_noex2_diagnostic_drops_pass_2s_ex2_only_in_its_copies(route):
    """`noex2` (timing only, round 24): its copies evaluate pass 2 without ex2 (the row rescale keeps its ex2), the
    default renders keep one ex2 per score."""
    from flamia_gen.bench.fwd_experiments import experiment_variants

    from flamia_gen.bench.fwd_experiments import DEFAULT_EXPERIMENTS

    assert "noex2" not in DEFAULT_EXPERIMENTS and "qend" in DEFAULT_EXPERIMENTS  # a diagnostic only when asked for
    pairs = experiment_variants(("noex2",), route=route)
    base = {v.name: v for t, v in pairs if not t}
    copies = [v for t, v in pairs if t == "noex2"]
    assert copies and len(copies) == len(base)
    for v in copies[:2]:
        src, ref = render_variant(v), render_variant(base[v.name.removesuffix("_xnoex2")])
        assert "e = ex2(" in ref and "e = ex2(" not in src
        assert "# diag_no_ex2: no MUFU" in src and "diag_no_ex2" not in ref
        assert "scale_o[rh] = ex2(" in src
