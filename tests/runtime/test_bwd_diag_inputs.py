"""Host side of the token-block (`mxfp8`) backward's diagonal inputs (CPU only).

A `diag_v` backward (PARAMS diag_v, ds_gran square_32, fwd_tile_n) takes, besides the fp8 backward's
arguments, the per-token V copy (`v_diag`, `v_diag_scale`) and the forward's `fwd_tile_m`; its schedule keeps
every document apart (square_32 dS blocks must not mix documents: `bwd_schedule(windows=False)`); the op
launches the per-token V quantizer and refuses a forward of another tile_n (`ops.backward_with`); verify
pairs it with a forward of that tile_n and tells the emulator the forward's tiles.

The diag variant's ARGS here are the fp8_token backward's (generated/) plus the three the template adds; when
the shipped plan has a real diag_v backward, `test_rendered_diag_variant_takes_the_three_arguments` checks
that its ARGS name them as this file assumes.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flamia_gen.render import rendered_literal
from flamia_gen.runtime import ops as ops_mod
from flamia_gen.runtime.attn_bwd import (DIAG_V_ARGS, bwd_schedule, bwd_tiles, bwd_windows, is_diag_v_spec,
                                         make_work_list, run_attn_bwd)

try:  # `python -m pytest` from the repository root: tests/ is a namespace package
    from tests.runtime import bwd_standins as bs
except ImportError:  # plain `pytest` (rootdir not on sys.path): load the sibling module by path
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_flamia_bwd_standins", Path(__file__).with_name("bwd_standins.py"))
    bs = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(bs)

FP8_BWD = bs.FP8_BWD
DIAG_ARGS = bs.DIAG_V_SPEC
DIAG_PARAMS = {"diag_v": True, "ds_gran": "square_32", "fwd_tile_n": 128}
HQ, HKV, D = bs.HQ, bs.HKV, bs.D


def _plain_variant() -> tuple[list, dict]:
    return bs.generated(FP8_BWD)


def _diag_variant() -> tuple[list, dict]:
    """The fp8_token backward's ARGS and PARAMS with what a diag_v backward adds (the unit list and the counter, as
    every non-deterministic backward renders since 2026-12-02)."""
    args, params = bs.generated(FP8_BWD)
    return args + DIAG_ARGS, dict(params, **DIAG_PARAMS)


# documents shorter than a key tile (128) that share tile_n chunks: windows=True merges them
SHORT_DOCS = [5, 1, 30, 200, 7, 7, 60, 300, 1, 2]


# ---------------------------------------------------------------- bwd_schedule(windows=False)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("key_align", [1, 16])
def test_bwd_schedule_without_windows_keeps_every_document_apart(causal, key_align):
    cu = bs.cu_seqlens(SHORT_DOCS)
    T = int(cu[-1])
    merged = bwd_schedule(cu, 64, 128, causal, key_align=key_align, T=T)
    apart = bwd_schedule(cu, 64, 128, causal, key_align=key_align, T=T, windows=False)
    # the negative control: with windows these short documents are merged (a window flag, fewer documents)
    assert int((merged.work[:, 2] == 1).sum()) > 0 and int((merged.cu < T).sum()) < cu.numel() - 1
    # same shapes and dtypes (run_attn_bwd's schedule checks), no window flag, the real documents
    for a, b, name in zip(merged, apart, merged._fields):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.int32 and b.is_contiguous(), name
    assert torch.equal(apart.cu, cu)
    valid = apart.work[:, 0] >= 0
    assert bool((apart.work[valid, 2] == 0).all()) and bool((apart.work[~valid] == -1).all())
    # every document's own key tiles, once each (no document shares a tile with another)
    _, _, nkt, _ = bwd_tiles(cu, 64, 128, key_align)
    items = sorted((int(d), int(n)) for d, n, _ in apart.work[valid].tolist())
    assert items == [(d, n) for d in range(len(SHORT_DOCS)) for n in range(int(nkt[d]))]
    assert torch.equal(apart.work, make_work_list(cu, 64, 128, causal, key_align=key_align, T=T))
    assert torch.equal(apart.row_doc, merged.row_doc)  # per-token bounds do not depend on windows
    assert apart.row_doc.tolist()[:7] == [[0, 5]] * 5 + [[5, 6], [6, 36]]


def test_bwd_schedule_without_windows_equals_windows_when_nothing_merges():
    cu = bs.cu_seqlens([300, 129, 1000])  # every document ≥ tile_n: windows change nothing
    a = bwd_schedule(cu, 64, 128, True, key_align=16, T=1429)
    b = bwd_schedule(cu, 64, 128, True, key_align=16, T=1429, windows=False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_square_32_backward_schedules_have_no_windows():
    from flamia_gen.runtime.attention import bwd_schedule_cached

    cu = bs.cu_seqlens(SHORT_DOCS)
    T = int(cu[-1])
    plain = dict(tile_m=64, tile_n=128, causal=True, ds_gran="token")
    square = dict(plain, ds_gran="square_32")
    assert bwd_windows(plain) and bwd_windows({}) and not bwd_windows(square)
    a = bwd_schedule_cached(cu, T, plain, fp8=True)
    b = bwd_schedule_cached(cu, T, square, fp8=True)  # same cu, tiles and alignment: the cache key must differ
    assert torch.equal(a.work, bwd_schedule(cu, 64, 128, True, key_align=16, T=T).work)
    assert torch.equal(b.work, bwd_schedule(cu, 64, 128, True, key_align=16, T=T, windows=False).work)
    assert not torch.equal(a.work, b.work)
    assert bwd_schedule_cached(cu, T, square, fp8=True) is b


# ---------------------------------------------------------------- run_attn_bwd


def test_run_attn_bwd_passes_the_diagonal_inputs_and_no_windows():
    args, params = _diag_variant()
    assert is_diag_v_spec(args) and not is_diag_v_spec(_plain_variant()[0])
    x = bs.fp8_inputs(SHORT_DOCS)
    T = x["q"].shape[0]
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **x, params=params, **bs.diag_v_inputs(T))
    assert seen["v_diag"].dtype == torch.float8_e4m3fn and seen["v_diag"].shape == (T, HKV, D)
    assert bool((seen["v_diag"].view(torch.uint8) == 0x40).all()) and bool((seen["v_diag_scale"] == 121).all())
    assert seen["fwd_tile_m"] == 192 and type(seen["fwd_tile_m"]) is int
    # the schedule it builds for a square_32 variant without bwd_sq32_windows keeps the documents apart
    assert "bwd_sq32_windows" not in params
    assert torch.equal(seen["work"], bwd_schedule(x["cu_seqlens"], 64, 128, True, key_align=16, T=T,
                                                  windows=False, hkv=HKV, head_section=2).work)
    assert torch.equal(seen["cu_seqlens"], x["cu_seqlens"])
    # with the flag (the template's default since 2026-12-02) the short documents share windows
    fn, win = bs.recorder(args)
    run_attn_bwd(fn, args, **x, params=dict(params, bwd_sq32_windows=True), **bs.diag_v_inputs(T))
    assert torch.equal(win["work"], bwd_schedule(x["cu_seqlens"], 64, 128, True, key_align=16, T=T,
                                                 hkv=HKV, head_section=2).work)
    assert int((win["work"][:, 2] == 1).sum()) > 0
    # the plain variant (same inputs, no diagonal arguments) still merges them
    pargs, pparams = _plain_variant()
    fn, plain = bs.recorder(pargs)
    run_attn_bwd(fn, pargs, **x, params=pparams)
    assert int((plain["work"][:, 2] == 1).sum()) > 0 and "v_diag" not in plain


_T = sum(SHORT_DOCS)


@pytest.mark.parametrize("over, match", [
    (dict(v_diag=bs.DROP), r"^v_diag: required"),
    (dict(v_diag_scale=bs.DROP), r"^v_diag_scale: required"),
    (dict(fwd_tile_m=bs.DROP), r"^fwd_tile_m: required"),
    (dict(v_diag=torch.zeros(_T, HQ, D, dtype=torch.uint8)),
     rf"^v_diag: shape \({_T}, 4, 128\), expected \({_T}, 2, 128\)"),
    (dict(v_diag=torch.zeros(_T + 1, HKV, D, dtype=torch.uint8)), r"^v_diag: shape"),
    (dict(v_diag=torch.zeros(_T, HKV, D, dtype=torch.bfloat16)), r"^v_diag: dtype torch.bfloat16"),
    (dict(v_diag=torch.zeros(_T, HKV, D, dtype=torch.float8_e5m2)), r"^v_diag: dtype"),
    (dict(v_diag=torch.zeros(HKV, _T, D, dtype=torch.uint8).transpose(0, 1)), r"^v_diag: must be contiguous"),
    (dict(v_diag_scale=torch.zeros(_T, HKV, dtype=torch.int32)), r"^v_diag_scale: dtype"),
    (dict(v_diag_scale=torch.zeros(_T, HQ, dtype=torch.uint8)), r"^v_diag_scale: shape"),
    (dict(v_diag_scale=torch.zeros(_T, HKV, D, dtype=torch.uint8)), r"^v_diag_scale: expected 2 dims"),
    (dict(fwd_tile_m=96), r"^fwd_tile_m: 96 is not a positive multiple of 64"),
    (dict(fwd_tile_m=0), r"^fwd_tile_m: 0 is not a positive multiple of 64"),
    (dict(fwd_tile_m=-128), r"^fwd_tile_m: -128 is not"),
    (dict(fwd_tile_m=128.0), r"^fwd_tile_m: expected an int"),
    (dict(fwd_tile_m=True), r"^fwd_tile_m: expected an int"),
    (dict(fwd_tile_m=torch.tensor(128)), r"^fwd_tile_m: expected an int"),
])
def test_run_attn_bwd_refuses_bad_diagonal_inputs(over, match):
    args, params = _diag_variant()
    called = []
    with pytest.raises(ValueError, match=match):
        run_attn_bwd(lambda *a: called.append(a), args, **bs.fp8_inputs(SHORT_DOCS), params=params,
                     **bs.merged(bs.diag_v_inputs(_T), **over))
    assert not called


@pytest.mark.parametrize("name", DIAG_V_ARGS)
def test_run_attn_bwd_refuses_diagonal_inputs_a_plain_variant_does_not_take(name):
    args, params = _plain_variant()
    called = []
    with pytest.raises(ValueError, match=rf"^{name}: only a backward whose ARGS name it"):
        run_attn_bwd(lambda *a: called.append(a), args, **bs.fp8_inputs(SHORT_DOCS), params=params,
                     **{name: bs.diag_v_inputs(_T)[name]})
    assert not called


def test_run_attn_bwd_takes_v_diag_as_float8_codes():
    args, params = _diag_variant()
    kw = bs.diag_v_inputs(_T)
    kw["v_diag"] = kw["v_diag"].view(torch.float8_e4m3fn)
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **bs.fp8_inputs(SHORT_DOCS), params=params, **kw)
    assert seen["v_diag"] is kw["v_diag"]


@pytest.fixture(scope="module")
def rendered_diag():
    """The mxfp8 backward as the template renders it (route built as a candidate: the shipped families may not
    list it yet): (plan variant, rendered ARGS, rendered PARAMS)."""
    from flamia_gen.bench.bwd_experiments import with_candidates
    from flamia_gen.plan import make_plan
    from flamia_gen.render import render_variant
    from flamia_gen.spec import load_specs

    plan = make_plan(with_candidates(load_specs(), ["mxfp8"]), arch="sm90", routes=["mxfp8"])
    diag = [v for v in plan.variants if v.kind.value == "attn_bwd" and v.param("head_dim") == 128
            and v.param("causal") and dict(v.params).get("diag_v") and not dict(v.params).get("deterministic")]
    if not diag:
        pytest.skip("the plan has no diag_v backward for mxfp8 yet")
    src = render_variant(diag[0])
    return diag[0], rendered_literal(src, "ARGS"), rendered_literal(src, "PARAMS")


def test_rendered_diag_variant_takes_what_run_attn_bwd_passes(rendered_diag):
    """The template's ARGS name the three arguments as assumed here, its PARAMS' fwd_tile_n is what the runtime
    derives from the manifest's (plan) params, and run_attn_bwd feeds the rendered ARGS with the manifest
    params (no fwd_tile_n there) without a windowed schedule."""
    from flamia_gen.runtime.attn_bwd import fwd_tile_n_of

    v, args, params = rendered_diag
    by = {a["name"]: a for a in args}
    assert set(DIAG_V_ARGS) <= set(by) and is_diag_v_spec(args)
    assert {n: (by[n]["dtype"], by[n]["shape"]) for n in DIAG_V_ARGS} == \
        {a["name"]: (a["dtype"], a["shape"]) for a in DIAG_ARGS}
    manifest_params = dict(v.params)
    assert params["ds_gran"] == manifest_params["ds_gran"] == "square_32"
    assert params["fwd_tile_n"] == fwd_tile_n_of(manifest_params) == fwd_tile_n_of(params)
    assert not bwd_windows(manifest_params)
    x = bs.fp8_inputs(SHORT_DOCS)
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **x, params=manifest_params, **bs.diag_v_inputs(_T))
    assert seen["fwd_tile_m"] == 192 and int((seen["work"][:, 2] == 1).sum()) == 0


def test_bwd_experiments_bundles_a_forward_the_diag_backward_pairs_with(rendered_diag, monkeypatch):
    """bench.bwd_experiments keeps one forward per causality, and for a diag_v backward one of its fwd_tile_n
    too: here the plan lists the tile_n = 192 forwards first, so the first forward would not pair."""
    import flamia_gen.bench.bwd_experiments as bx
    import flamia_gen.plan as plan_mod
    import flamia_gen.plan.op_support as op_support

    real = plan_mod.make_plan

    def n192_first(*a, **kw):
        p = real(*a, **kw)
        vs = sorted(p.variants, key=lambda v: not (v.kind.value == "attn_fwd" and dict(v.params).get("tile_n") == 192))
        return SimpleNamespace(variants=vs)

    monkeypatch.setattr(plan_mod, "make_plan", n192_first)
    # the support's own plan (plan.op_support, since 2026-12-05): the same reordering
    monkeypatch.setattr(op_support, "make_plan", n192_first)
    bwd, support = bx.base_variants(routes=(), candidates=["mxfp8"])
    fwd = [s for s in support if s.kind.value == "attn_fwd"]
    assert {s.param("tile_n") for s in fwd} == {192, 128}  # the first per causality, and the pairing one
    diag = [b for b in bwd if dict(b.params).get("diag_v")]
    assert diag
    for b in diag:
        bp = dict(b.params)
        assert any(s.kind.value == "attn_fwd" and s.route == "mxfp8" and s.param("causal") == bp["causal"]
                   and s.param("tile_n") == bp["tile_n"] for s in support), b.name


# ---------------------------------------------------------------- ops.backward_with


ROUTE = "mxfp8_cand"  # a candidate route: bundled kernels, no dispatch group, not in the installed plan
TB, TB_DELTA, TOK = bs.TB, bs.TB_DELTA, bs.TOK
FWD_N192 = f"attn_fwd_sm90_{ROUTE}_d128_a_m128n192"  # first by name
FWD_N128 = f"attn_fwd_sm90_{ROUTE}_d128_b_m192n128"
BWD = f"attn_bwd_sm90_{ROUTE}_d128_m64n128"
CODE = {TB: 0x30, TOK: 0x40, TB_DELTA: 0x38}  # what each stand-in quantizer writes


def _fill_code(name, by, n):
    """A stand-in quantizer's outputs: its CODE (codes, codes_t), CODE + 80 (scales), zero delta, dq_accum."""
    by["codes"].fill_(CODE[name])
    by["codes_t"].fill_(CODE[name])
    by["scales"].fill_(CODE[name] + 80)
    if "delta" in by:
        by["delta"].zero_()
        by["dq_accum"].zero_()


@pytest.fixture
def diag_bundle(monkeypatch, tmp_path):
    """A bundle manifest of the candidate route (token-block Q/K/V/dO quantizers, the per-token quantizer of
    another route as the V copy, two forwards of tile_n 192 and 128, one diag_v backward) with Python
    stand-ins for the kernels; returns (bundle, backward entry, launches)."""
    bargs, bparams = _diag_variant()
    fp = dict(head_dim=128, causal=True, diag_v=True)
    variants = [
        bs.quant_entry(TB, [f"{ROUTE}.q", f"{ROUTE}.k", f"{ROUTE}.v"]),
        bs.quant_entry(TB_DELTA, [f"{ROUTE}.do"]),
        bs.quant_entry(TOK, ["fp8_token.v"]),
        bs.manifest_entry(FWD_N192, "attn_fwd", [ROUTE], dict(fp, tile_m=128, tile_n=192)),
        bs.manifest_entry(FWD_N128, "attn_fwd", [ROUTE], dict(fp, tile_m=192, tile_n=128)),
        # manifest params are the plan's: no fwd_tile_n (the template renders it as tile_n: fwd_tile_n_of)
        bs.manifest_entry(BWD, "attn_bwd", [ROUTE], {k: x for k, x in bparams.items() if k != "fwd_tile_n"}, bargs),
    ]
    b, launches = bs.standin_bundle(tmp_path, monkeypatch, "bundle_diag", variants, _fill_code)
    return b, b.variants[BWD], launches


def test_forward_choice_of_a_candidate_route_is_the_first_bundled_forward(diag_bundle):
    """`_pick_cached(..., "attn_fwd", ...)` for a route with bundle variants but no dispatch group does not
    raise: the dispatcher's KeyError falls back to the bundle's first forward by name (what the op's forward
    ran)."""
    from flamia_gen.runtime.attention import _pick_cached

    b, bwd, _ = diag_bundle
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        prof = bs.profile_of(sum(SHORT_DOCS), bs.cu_seqlens(SHORT_DOCS))
        assert _pick_cached(str(b.root), "attn_fwd", ROUTE, 128, True, prof)["name"] == FWD_N192
        assert ops_mod.forward_choice(b, bwd, 128, prof)["name"] == FWD_N192


def test_backward_with_refuses_the_op_forward_of_another_tile_n(diag_bundle):
    b, bwd, launches = diag_bundle
    q, k, v, do, cu = bs.bf16_inputs(SHORT_DOCS, with_o=False)
    T = q.shape[0]
    with warnings.catch_warnings(), pytest.raises(ValueError) as e:
        warnings.simplefilter("ignore", RuntimeWarning)
        ops_mod.backward_with(b, bwd, do, q, k, v, do, torch.zeros(HQ, T), cu, bs.profile_of(T, cu))
    msg = str(e.value)
    assert msg.startswith("fwd_params: forward variant " + FWD_N192) and "tile_n=192" in msg
    assert BWD in msg and "tile_n=128 (its fwd_tile_n)" in msg
    assert launches == []  # refused before any launch


def test_backward_with_refuses_given_forward_params_of_another_tile_n(diag_bundle):
    b, bwd, launches = diag_bundle
    q, k, v, do, cu = bs.bf16_inputs(SHORT_DOCS, with_o=False)
    T = q.shape[0]
    n192 = b.variants[FWD_N192]["params"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(ValueError, match=r"^fwd_params: the forward variant given as fwd_params has tile_n=192, "
                                             rf"but backward {BWD} .* tile_n=128"):
            ops_mod.backward_with(b, bwd, do, q, k, v, do, torch.zeros(HQ, T), cu, bs.profile_of(T, cu),
                                  fwd_params=n192)
        with pytest.raises(ValueError, match=r"^fwd_params: .* causal=False"):
            ops_mod.backward_with(b, bwd, do, q, k, v, do, torch.zeros(HQ, T), cu, bs.profile_of(T, cu),
                                  fwd_params=dict(b.variants[FWD_N128]["params"], causal=False))
        with pytest.raises(ValueError, match=r"^fwd_params: expected the forward variant's PARAMS"):
            ops_mod.backward_with(b, bwd, do, q, k, v, do, torch.zeros(HQ, T), cu, bs.profile_of(T, cu),
                                  fwd_params={"tile_n": 128})
    assert launches == []


def test_backward_with_launches_the_per_token_v_copy(diag_bundle):
    """The paired forward's tile_m, the per-token quantizer's V codes (not the token-block ones) as v_diag,
    its scales, and a schedule without windows reach the kernel."""
    b, bwd, launches = diag_bundle
    q, k, v, do, cu = bs.bf16_inputs(SHORT_DOCS, with_o=False)
    T = q.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ops_mod.backward_with(b, bwd, do, q, k, v, do, torch.zeros(HQ, T), cu, bs.profile_of(T, cu),
                              fwd_params=b.variants[FWD_N128]["params"])
    names = [n for n, _ in launches]
    assert names == [TOK, TB, TB, TB, TB_DELTA, BWD]
    assert launches[0][1]["x"] is v  # the per-token copy quantizes V
    kern = launches[-1][1]
    assert kern["fwd_tile_m"] == 192
    assert kern["v_diag"].dtype == torch.float8_e4m3fn and bool((kern["v_diag"].view(torch.uint8) == 0x40).all())
    assert bool((kern["v_diag_scale"] == 0x40 + 80).all()) and kern["v_diag_scale"].shape == (T, HKV)
    assert bool((kern["v"].view(torch.uint8) == 0x30).all())  # V itself: the token-block codes
    assert torch.equal(kern["work"], bwd_schedule(cu, 64, 128, True, key_align=16, T=T, windows=False, hkv=HKV,
                                                  head_section=2).work)
    assert int((kern["work"][:, 2] == 1).sum()) == 0


def test_backward_with_pairs_with_the_op_forward_when_its_tile_n_fits(diag_bundle, monkeypatch):
    b, bwd, launches = diag_bundle
    q, k, v, do, cu = bs.bf16_inputs(SHORT_DOCS, with_o=False)
    T = q.shape[0]
    real = ops_mod._pick_cached
    monkeypatch.setattr(ops_mod, "_pick_cached", lambda root, kind, *a: b.variants[FWD_N128] if kind == "attn_fwd"
                        else real(root, kind, *a))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ops_mod.backward_with(b, bwd, do, q, k, v, do, torch.zeros(HQ, T), cu, bs.profile_of(T, cu))
    assert launches[-1][0] == BWD and launches[-1][1]["fwd_tile_m"] == 192


def test_backward_with_refuses_codes_for_a_diag_variant(diag_bundle):
    b, bwd, launches = diag_bundle
    q, k, v, do, cu = bs.bf16_inputs(SHORT_DOCS, with_o=False)
    T = q.shape[0]
    with pytest.raises(ValueError, match=r"^codes: .* needs the BF16 v"):
        ops_mod.backward_with(b, bwd, do, q, k, v, do, torch.zeros(HQ, T), cu, bs.profile_of(T, cu),
                              codes=[torch.zeros(1)], fwd_params=b.variants[FWD_N128]["params"])
    assert launches == []


def test_backward_with_a_plain_variant_ignores_fwd_params(monkeypatch):
    """Non-diag variants: the same launches and kernel arguments with or without fwd_params (any tile_n)."""
    args, params = _plain_variant()
    entry = bs.manifest_entry(FP8_BWD, "attn_bwd", ["fp8_token"], params, args)
    q, k, v, do, cu = bs.bf16_inputs(SHORT_DOCS, with_o=False)
    T = q.shape[0]
    launched, called = [], []

    def fake_quantize(b, e, x, cu_, o=None, skip_transposed=False):
        launched.append(e["op"])
        t, h, d = x.shape
        return dict(codes=torch.zeros(t, h, d, dtype=torch.uint8),
                    codes_t=torch.zeros(h, d, -(-t // 16) * 16, dtype=torch.uint8),
                    scales=torch.zeros(t, h, dtype=torch.uint8), delta=torch.zeros(h, t), dq_accum=torch.zeros(t, h, d))

    monkeypatch.setattr(ops_mod, "_quantize", fake_quantize)
    monkeypatch.setattr(ops_mod, "_pick_cached", lambda root, kind, r, d, c, prof, op: {"op": op})
    monkeypatch.setattr(ops_mod, "pick_do_delta", lambda root, r, d, prof: {"op": "do"})
    b = SimpleNamespace(root="fake", get=lambda name: (lambda *a: called.append([x for x in a])))
    for fp in (None, {"tile_m": 128, "tile_n": 192}):
        launched.clear()
        ops_mod.backward_with(b, entry, do, q, k, v, do, torch.zeros(HQ, T), cu, None, fwd_params=fp)
        assert launched == ["q", "k", "v", "do"]
    assert len(called) == 2 and len(called[0]) == len(args) == len(called[1])


# ---------------------------------------------------------------- verify.attn_gpu


def _verify_bundle(route=ROUTE):
    fp = dict(head_dim=128, causal=True)
    return SimpleNamespace(manifest={"variants": [
        bs.manifest_entry("f_other_route", "attn_fwd", ["fp8_token"], dict(fp, tile_m=128, tile_n=128)),
        bs.manifest_entry("f_n192", "attn_fwd", [route], dict(fp, tile_m=128, tile_n=192)),
        bs.manifest_entry("f_noncausal", "attn_fwd", [route], dict(fp, causal=False, tile_m=128, tile_n=128)),
        bs.manifest_entry("f_n128", "attn_fwd", [route], dict(fp, tile_m=192, tile_n=128)),
    ]})


def test_forward_entry_for_pairs_a_diag_backward_with_its_fwd_tile_n():
    from flamia_gen.verify.attn_gpu import emulator_forward_tiles, forward_entry_for

    b = _verify_bundle()
    plain = bs.manifest_entry("bp", "attn_bwd", [ROUTE], dict(head_dim=128, causal=True, tile_m=64, tile_n=128))
    diag = bs.manifest_entry("bd", "attn_bwd", [ROUTE], dict(plain["params"], **DIAG_PARAMS))
    assert forward_entry_for(b, plain)["name"] == "f_n192"  # unchanged: the first of the route
    assert forward_entry_for(b, diag)["name"] == "f_n128"
    # a bundle manifest's params (the plan's) have no fwd_tile_n: the backward's tile_n stands for it
    plan_style = dict(diag, params={k: x for k, x in diag["params"].items() if k != "fwd_tile_n"})
    assert forward_entry_for(b, plan_style)["name"] == "f_n128"
    assert emulator_forward_tiles(b, diag) == dict(fwd_tile_m=192, fwd_tile_n=128)
    assert emulator_forward_tiles(b, plain) == {}
    with pytest.raises(LookupError, match="tile_n=192 \\(the diag_v backward's fwd_tile_n\\)"):
        forward_entry_for(b, dict(diag, params=dict(diag["params"], fwd_tile_n=192, causal=False)))


def test_run_bwd_passes_the_paired_forward_params(monkeypatch):
    from flamia_gen.verify import attn_gpu

    b = _verify_bundle()
    b.get = lambda name: name
    diag = bs.manifest_entry("bd", "attn_bwd", [ROUTE],
                             dict(head_dim=128, causal=True, tile_m=64, tile_n=128, **DIAG_PARAMS))
    q, k, v, do, cu = bs.bf16_inputs(SHORT_DOCS, with_o=False)
    ran, seen = [], {}
    monkeypatch.setattr(attn_gpu, "run_kernel", lambda fn, e, *a: ran.append(e["name"]) or (do, torch.zeros(HQ, 1)))
    monkeypatch.setattr(ops_mod, "backward_with", lambda *a, **kw: seen.update(kw) or (q, k, v, None))
    monkeypatch.setattr(attn_gpu, "get_route", lambda name: name)
    attn_gpu._run_bwd(b, diag, q, k, v, do, cu)
    assert ran == ["f_n128"] and seen["fwd_params"] is b.manifest["variants"][3]["params"]
    # backward_setup keeps its three-value return for its other callers (bench.one_call)
    assert len(attn_gpu.backward_setup(b, diag, q, k, v, cu)) == 3
    o, lse, prof, fwd = attn_gpu.backward_setup(b, diag, q, k, v, cu, with_forward=True)
    assert fwd["name"] == "f_n128"


@pytest.mark.parametrize("diag", [True, False])
def test_verify_bwd_entry_gives_the_emulator_the_forward_tiles_only_for_diag_entries(monkeypatch, diag):
    """Both route-emulator calls get fwd_tile_m / fwd_tile_n of the paired forward (diag_v entries only);
    the exact fp32 call and every other entry's calls are unchanged."""
    import inspect

    import flamia_gen.numerics.reference as ref
    from flamia_gen.verify import attn_gpu

    # the keywords passed exist on the real emulator (stood in for below)
    assert {"fwd_tile_m", "fwd_tile_n"} <= set(inspect.signature(ref.attention_backward).parameters)
    params = dict(head_dim=128, causal=True, tile_m=64, tile_n=128, v_fmt="e4m3", **(DIAG_PARAMS if diag else {}))
    entry = bs.manifest_entry("bwd", "attn_bwd", ["mxfp8"], params)
    b = _verify_bundle("mxfp8")
    q, k, v, do, cu = bs.bf16_inputs([40, 60], with_o=False)
    calls = []

    def fake_emulator(q_, k_, v_, o, lse, do_, cu_, causal, route, **kw):
        calls.append((route, kw))
        return q_.float(), k_.float(), v_.float()

    monkeypatch.setattr(ref, "attention_backward", fake_emulator)
    monkeypatch.setattr(attn_gpu, "make_qkv", lambda docs, hq, hkv, d, kind, gen, dev: (q, k, v, cu))
    monkeypatch.setattr(attn_gpu, "_run_bwd", lambda *a, **kw: (do, torch.zeros(HQ, q.shape[0]), q, k, v))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    rows = attn_gpu.verify_bwd_entry(b, entry, kinds=("gauss",), probe=False)
    routed = [kw for r, kw in calls if r is not None]
    assert len(routed) == 2 and len(calls) == 3
    for kw in routed:
        if diag:
            assert kw["fwd_tile_m"] == 192 and kw["fwd_tile_n"] == 128
            assert kw["tile_m"] == 64 and kw["tile_n"] == 128  # the backward's own tiles stay
        else:
            assert "fwd_tile_m" not in kw and "fwd_tile_n" not in kw
    assert [kw for r, kw in calls if r is None] == [{}]
    assert rows[0]["ok"] and (rows[0].get("fwd_tile_m") == 192) == diag
