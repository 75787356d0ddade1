"""Host side of the exact token-block (`mxfp8_exact`) backward's inputs (CPU only).

An exact token-block route (Route.forward_safeguards; the emulator's Plan.causal_rows_q, causal_rows_do, per_key_k)
reads Q and dO PER TOKEN in S = Q·Kᵀ, dP = dO·Vᵀ and D = rowsum(dO∘O), their token-block codes_t in dK = dSᵀ·Q
and dV = Pᵀ·dO, and (causal, k_fold) K per token on the forward's diagonal key tiles in S and dQ. Its backward
variant (PARAMS rows_q, rows_do; causal: diag_k, diag_v) takes the fp8_token backward's ARGS with `q`, `q_scale`,
`do`, `do_scale` meaning the per-token copies, plus `q_t_scale`, `do_t_scale` (the token-block scales of `q_t`,
`do_t`) and, causal, the mxfp8 diagonal V arguments and `k_diag`, `k_t_diag`, `k_diag_scale`.

The ARGS here are the fp8_token backward's (generated/) plus what the template adds, as the runtime assumes; when
the template renders an mxfp8_exact backward, `test_rendered_exact_variant_takes_what_run_attn_bwd_passes`
checks its ARGS against these.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from flamia_gen.render import rendered_literal
from flamia_gen.runtime import ops as ops_mod
from flamia_gen.runtime.attention import NoKernelError, token_copy_do_delta
from flamia_gen.runtime.attn_bwd import (DIAG_K_ARGS, DIAG_V_ARGS, ROWS_ARGS, bwd_schedule, is_diag_k_spec,
                                         is_diag_v_spec, is_rows_spec, run_attn_bwd)

try:  # `python -m pytest` from the repository root: tests/ is a namespace package
    from tests.runtime import bwd_standins as bs
except ImportError:  # plain `pytest` (rootdir not on sys.path): load the sibling module by path
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_flamia_bwd_standins", Path(__file__).with_name("bwd_standins.py"))
    bs = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(bs)

FP8_BWD = bs.FP8_BWD
HQ, HKV, D = bs.HQ, bs.HKV, bs.D

DIAG_V_SPEC = bs.DIAG_V_SPEC
ROWS_SPEC = [
    {"name": "q_t_scale", "dtype": "uint8", "shape": ["T", "HQ"], "role": "in"},
    {"name": "do_t_scale", "dtype": "uint8", "shape": ["T", "HQ"], "role": "in"},
]
DIAG_K_SPEC = [
    {"name": "k_diag", "dtype": "float8_e4m3fn", "shape": ["T", "HKV", "D"], "role": "in"},
    {"name": "k_t_diag", "dtype": "float8_e4m3fn", "shape": ["HKV", "D", "T_PAD"], "role": "in"},
    {"name": "k_diag_scale", "dtype": "uint8", "shape": ["T", "HKV"], "role": "in"},
]
NEW_ARGS = ROWS_ARGS + DIAG_K_ARGS


def _exact_args(causal: bool) -> list:
    """The fp8_token backward's ARGS in the order the template emits the exact route's: ..., dv, [causal] v_diag,
    v_diag_scale, fwd_tile_m, then q_t_scale, do_t_scale, then [causal] k_diag, k_t_diag, k_diag_scale."""
    args, _ = bs.generated(FP8_BWD)
    # (less the `dq` out argument of fp8_token's call-side conversion, round 45: the exact route's call has none)
    args = [a for a in args if a["name"] != "dq"]
    return args + (DIAG_V_SPEC if causal else []) + ROWS_SPEC + (DIAG_K_SPEC if causal else [])


def _exact_variant(causal: bool = True) -> tuple[list, dict]:
    """(ARGS, PARAMS): the plan's (manifest) params of the mxfp8_exact backward (rows_q, diag_k, diag_v; no
    rows_do, no fwd_tile_n: the rendered PARAMS add them)."""
    return _exact_args(causal), dict(bs.plan_bwd("mxfp8_exact", causal).params)


DOCS = bs.DOCS
_T = sum(DOCS)
_TPAD = -(-_T // 16) * 16


def _rows(T=_T):
    return dict(q_t_scale=torch.full((T, HQ), 117, dtype=torch.uint8),
                do_t_scale=torch.full((T, HQ), 118, dtype=torch.uint8))


def _diag_k(T=_T, tpad=_TPAD):
    return dict(k_diag=torch.full((T, HKV, D), 0x41, dtype=torch.uint8),
                k_t_diag=torch.full((HKV, D, tpad), 0x42, dtype=torch.uint8),
                k_diag_scale=torch.full((T, HKV), 119, dtype=torch.uint8))


def _new(causal=True):
    return dict(_rows(), **(dict(bs.diag_v_inputs(_T), **_diag_k()) if causal else {}))


# ---------------------------------------------------------------- run_attn_bwd


def test_spec_predicates():
    plain, _ = bs.generated(FP8_BWD)
    causal, nc = _exact_args(True), _exact_args(False)
    assert is_rows_spec(causal) and is_rows_spec(nc) and not is_rows_spec(plain)
    assert is_diag_k_spec(causal) and not is_diag_k_spec(nc) and not is_diag_k_spec(plain)
    assert is_diag_v_spec(causal) and not is_diag_v_spec(nc)


def test_run_attn_bwd_passes_the_split_and_per_token_k_inputs():
    args, params = _exact_variant(True)
    x = bs.fp8_inputs()
    kw = _new(True)
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **x, params=params, **kw)
    assert seen["q_t_scale"] is kw["q_t_scale"] and seen["do_t_scale"] is kw["do_t_scale"]
    assert seen["k_diag_scale"] is kw["k_diag_scale"]
    for name, shape, code in (("k_diag", (_T, HKV, D), 0x41), ("k_t_diag", (HKV, D, _TPAD), 0x42)):
        assert seen[name].dtype == torch.float8_e4m3fn and seen[name].shape == shape, name
        assert seen[name].data_ptr() == kw[name].data_ptr()  # a view, no copy
        assert bool((seen[name].view(torch.uint8) == code).all()), name
    # the rest as for mxfp8 (diagonal V, the forward's tile_m, no windows for square_32 dS)
    assert seen["fwd_tile_m"] == 192 and bool((seen["v_diag"].view(torch.uint8) == 0x40).all())
    assert torch.equal(seen["work"], bwd_schedule(x["cu_seqlens"], 64, 128, True, key_align=16, T=_T,
                                                  windows=False).work)


def test_run_attn_bwd_noncausal_exact_variant_takes_the_split_scales_only():
    args, params = _exact_variant(False)
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **bs.fp8_inputs(), params=params, **_rows())
    assert bool((seen["q_t_scale"] == 117).all()) and bool((seen["do_t_scale"] == 118).all())
    assert not any(n in seen for n in DIAG_K_ARGS + DIAG_V_ARGS)
    for name, t in _diag_k().items():
        with pytest.raises(ValueError, match=rf"^{name}: only a backward whose ARGS name it \(a diag_k variant"):
            run_attn_bwd(fn, args, **bs.fp8_inputs(), params=params, **_rows(), **{name: t})


@pytest.mark.parametrize("name", NEW_ARGS)
def test_run_attn_bwd_requires_each_new_argument(name):
    args, params = _exact_variant(True)
    called = []
    with pytest.raises(ValueError, match=rf"^{name}: required: "):
        run_attn_bwd(lambda *a: called.append(a), args, **bs.fp8_inputs(), params=params,
                     **bs.merged(_new(True), **{name: bs.DROP}))
    assert not called


@pytest.mark.parametrize("name", NEW_ARGS)
def test_run_attn_bwd_refuses_new_arguments_a_plain_variant_does_not_take(name):
    args, params = bs.generated(FP8_BWD)
    called = []
    with pytest.raises(ValueError, match=rf"^{name}: only a backward whose ARGS name it"):
        run_attn_bwd(lambda *a: called.append(a), args, **bs.fp8_inputs(), params=params, **{name: _new(True)[name]})
    assert not called


def test_run_attn_bwd_refuses_the_new_arguments_for_the_mxfp8_diag_variant():
    """mxfp8 (not exact) takes the diagonal V copy but none of the exact route's arguments."""
    args, params = bs.generated(FP8_BWD)
    args = args + DIAG_V_SPEC
    params = dict(params, diag_v=True, ds_gran="square_32", fwd_tile_n=128)
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **bs.fp8_inputs(), params=params, **bs.diag_v_inputs(_T))
    assert seen["fwd_tile_m"] == 192
    with pytest.raises(ValueError, match=r"^q_t_scale: only a backward whose ARGS name it"):
        run_attn_bwd(fn, args, **bs.fp8_inputs(), params=params, **bs.diag_v_inputs(_T), **_rows())


U8 = torch.uint8
_BAD = [
    ("q_t_scale", torch.zeros(_T, HKV, dtype=U8), rf"^q_t_scale: shape \({_T}, 2\), expected \({_T}, 4\)"),
    ("q_t_scale", torch.zeros(_T + 1, HQ, dtype=U8), r"^q_t_scale: shape"),
    ("q_t_scale", torch.zeros(_T, HQ, dtype=torch.int32), r"^q_t_scale: dtype torch.int32"),
    ("q_t_scale", torch.zeros(_T, HQ, dtype=torch.float8_e4m3fn), r"^q_t_scale: dtype"),
    ("q_t_scale", torch.zeros(_T, HQ, 1, dtype=U8), r"^q_t_scale: expected 2 dims"),
    ("q_t_scale", torch.zeros(HQ, _T, dtype=U8).t(), r"^q_t_scale: must be contiguous"),
    ("q_t_scale", [0] * _T, r"^q_t_scale: expected a torch.Tensor"),
    ("do_t_scale", torch.zeros(_T, HKV, dtype=U8), r"^do_t_scale: shape"),
    ("do_t_scale", torch.zeros(_T, HQ, dtype=torch.bfloat16), r"^do_t_scale: dtype"),
    ("k_diag", torch.zeros(_T, HQ, D, dtype=U8), rf"^k_diag: shape \({_T}, 4, 128\), expected \({_T}, 2, 128\)"),
    ("k_diag", torch.zeros(_T, HKV, 64, dtype=U8), r"^k_diag: shape"),
    ("k_diag", torch.zeros(_T, HKV, D, dtype=torch.bfloat16), r"^k_diag: dtype torch.bfloat16"),
    ("k_diag", torch.zeros(_T, HKV, D, dtype=torch.float8_e5m2), r"^k_diag: dtype"),
    ("k_diag", torch.zeros(HKV, _T, D, dtype=U8).transpose(0, 1), r"^k_diag: must be contiguous"),
    ("k_t_diag", torch.zeros(_T, HKV, D, dtype=U8), r"^k_t_diag: shape"),
    ("k_t_diag", torch.zeros(HQ, D, _TPAD, dtype=U8), r"^k_t_diag: shape"),
    ("k_t_diag", torch.zeros(HKV, D, _TPAD + 16, dtype=U8), rf"^k_t_diag: T_PAD={_TPAD + 16} differs from k_t's {_TPAD}"),
    ("k_t_diag", torch.zeros(HKV, D, _T, dtype=U8), rf"^k_t_diag: T_PAD={_T} must be ≥ T={_T} and a multiple of 16"),
    ("k_t_diag", torch.zeros(HKV, D, _TPAD - 16, dtype=U8), r"^k_t_diag: T_PAD=.* must be ≥ T"),
    ("k_t_diag", torch.zeros(HKV, D, _TPAD, dtype=torch.float16), r"^k_t_diag: dtype"),
    ("k_diag_scale", torch.zeros(_T, HQ, dtype=U8), r"^k_diag_scale: shape"),
    ("k_diag_scale", torch.zeros(_T, HKV, dtype=torch.int8), r"^k_diag_scale: dtype"),
    ("k_diag_scale", torch.zeros(_T, HKV, D, dtype=U8), r"^k_diag_scale: expected 2 dims"),
]


@pytest.mark.parametrize("name, value, match", _BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(_BAD)])
def test_run_attn_bwd_refuses_bad_new_arguments(name, value, match):
    assert _T % 16 != 0  # so T_PAD = T is not a multiple of 16 (the T_PAD = T case above)
    args, params = _exact_variant(True)
    called = []
    with pytest.raises(ValueError, match=match):
        run_attn_bwd(lambda *a: called.append(a), args, **bs.fp8_inputs(), params=params,
                     **bs.merged(_new(True), **{name: value}))
    assert not called


def test_run_attn_bwd_takes_float8_codes_as_they_are():
    args, params = _exact_variant(True)
    kw = _new(True)
    kw["k_diag"] = kw["k_diag"].view(torch.float8_e4m3fn)
    kw["k_t_diag"] = kw["k_t_diag"].view(torch.float8_e4m3fn)
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **bs.fp8_inputs(), params=params, **kw)
    assert seen["k_diag"] is kw["k_diag"] and seen["k_t_diag"] is kw["k_t_diag"]


@pytest.fixture(scope="module")
def rendered_exact():
    """The mxfp8_exact backward variants as the template renders them (skipped while the template refuses
    rows_q / diag_k): {causal: (plan params, rendered ARGS, rendered PARAMS)}."""
    from flamia_gen.render.render import render_variant

    out = {}
    for causal in (True, False):
        v = bs.plan_bwd("mxfp8_exact", causal)
        try:
            src = render_variant(v)
        except Exception as e:  # the template's ERROR_... sentinel (jinja2 UndefinedError) until it supports the route
            pytest.skip(f"the template does not render {v.name} yet: {type(e).__name__}: {str(e)[:120]}")
        out[causal] = (dict(v.params), rendered_literal(src, "ARGS"), rendered_literal(src, "PARAMS"))
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_rendered_exact_variant_takes_what_run_attn_bwd_passes(rendered_exact, causal):
    plan_params, args, params = rendered_exact[causal]
    by = {a["name"]: (a["dtype"], a["shape"]) for a in args}
    assert params["rows_q"] is True and params["rows_do"] is True
    assert bool(params.get("diag_k")) == bool(params.get("diag_v")) == causal
    if causal:
        assert params["fwd_tile_n"] == params["tile_n"] == 128
    # the names, dtypes and shapes run_attn_bwd checks and ops.backward_with fills
    want = ROWS_SPEC + (DIAG_K_SPEC + DIAG_V_SPEC if causal else [])
    assert {a["name"]: (a["dtype"], a["shape"]) for a in want} == {n: by[n] for n in (a["name"] for a in want)}
    assert not (set(DIAG_K_ARGS + DIAG_V_ARGS) & set(by)) or causal
    assert {a["name"] for a in args} == {a["name"] for a in _exact_args(causal)}
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **bs.fp8_inputs(), params=plan_params, **_new(causal))
    assert set(seen) == set(by)


# ---------------------------------------------------------------- ops.backward_with on a stand-in bundle


ROUTE = "mxfp8_exact_cand"  # a candidate route: bundled kernels, no dispatch group, not in the installed plan
TB, TB_DELTA, TOK, TOK_DELTA = bs.TB, bs.TB_DELTA, bs.TOK, bs.TOK_DELTA
FWD_N192 = f"attn_fwd_sm90_{ROUTE}_d128_a_m128n192"  # first by name: the op's forward choice
FWD_N128 = f"attn_fwd_sm90_{ROUTE}_d128_b_m192n128"
BWD = f"attn_bwd_sm90_{ROUTE}_d128_m64n128"
BWD_NC = f"attn_bwd_sm90_{ROUTE}_d128_m64n128_noncausal"
TOK_USES = ["fp8_token.do", "fp8_token.k", "fp8_token.q", "fp8_token.v"]


def _make_bundle(tmp_path, monkeypatch, *, drop=(), tok_uses=TOK_USES, tb_delta_uses=(f"{ROUTE}.do",),
                 bwd_over=None):
    """A bundle manifest of the candidate exact route (its token-block Q/K/V/dO quantizers and dO launch, another
    route's per-token quantizer and per-token dO launch, two forwards of tile_n 192 and 128, the causal and
    non-causal backward) with Python stand-ins for the kernels. Every quantizer launch fills its outputs with
    values of its own (a launch counter), and is recorded with its inputs; returns (bundle, launches)."""
    fp = dict(head_dim=128, causal=True, diag_v=True, diag_k=True)
    variants = [
        bs.quant_entry(TB, [f"{ROUTE}.do", f"{ROUTE}.k", f"{ROUTE}.q", f"{ROUTE}.v"]),
        bs.quant_entry(TB_DELTA, list(tb_delta_uses)),
        bs.quant_entry(TOK, list(tok_uses)),
        bs.quant_entry(TOK_DELTA, ["fp8_token.do"]),
        bs.manifest_entry(FWD_N192, "attn_fwd", [ROUTE], dict(fp, tile_m=128, tile_n=192)),
        bs.manifest_entry(FWD_N128, "attn_fwd", [ROUTE], dict(fp, tile_m=192, tile_n=128)),
    ]
    for name, causal in ((BWD, True), (BWD_NC, False)):
        args, params = _exact_variant(causal)
        args, params = (bwd_over or {}).get(name, (args, params))
        variants.append(bs.manifest_entry(name, "attn_bwd", [ROUTE], params, args))
    variants = [v for v in variants if v["name"] not in drop]
    return bs.standin_bundle(tmp_path, monkeypatch, "bundle_exact", variants, bs.fill_by_launch)


@pytest.fixture
def exact_bundle(monkeypatch, tmp_path):
    return _make_bundle(tmp_path, monkeypatch)


# what each kernel argument of the exact backward must be: per-token Q, dO in S, dP, D; token-block Q, dO in dK,
# dV; token-block K everywhere but the forward's diagonal tiles (k_diag: per-token K); V as mxfp8
EXPECTED = {
    "q": (TOK, "q", "codes"), "q_scale": (TOK, "q", "scales"),
    "q_t": (TB, "q", "codes_t"), "q_t_scale": (TB, "q", "scales"),
    "k": (TB, "k", "codes"), "k_t": (TB, "k", "codes_t"), "k_scale": (TB, "k", "scales"),
    "v": (TB, "v", "codes"), "v_scale": (TB, "v", "scales"),
    "do": (TOK_DELTA, "do", "codes"), "do_scale": (TOK_DELTA, "do", "scales"),
    "delta": (TOK_DELTA, "do", "delta"), "dq_accum": (TOK_DELTA, "do", "dq_accum"),
    "do_t": (TB, "do", "codes_t"), "do_t_scale": (TB, "do", "scales"),
}
EXPECTED_DIAG = {
    "k_diag": (TOK, "k", "codes"), "k_t_diag": (TOK, "k", "codes_t"), "k_diag_scale": (TOK, "k", "scales"),
    "v_diag": (TOK, "v", "codes"), "v_diag_scale": (TOK, "v", "scales"),
}


def test_backward_with_feeds_each_argument_from_the_right_launch(exact_bundle):
    b, launches = exact_bundle
    inputs, o = bs.run_backward(b, BWD, fwd_params=b.variants[FWD_N128]["params"])
    ops = {id(t): n for n, t in inputs.items()}
    assert [(n, ops[id(by["x"])]) for n, by in launches[:-1]] == [
        (TOK, "v"), (TOK, "q"), (TB, "q"), (TB, "k"), (TOK, "k"), (TB, "v"), (TOK_DELTA, "do"), (TB, "do")]
    assert launches[-1][0] == BWD
    # only the dO launch takes o (delta from the per-token dO); the token-block dO launch is a plain one
    assert launches[6][1]["o"] is o and "o" not in launches[7][1]
    src = bs.arg_sources(launches, inputs)
    got = {a: src[a] for a in list(EXPECTED) + list(EXPECTED_DIAG)}
    assert got == dict(EXPECTED, **EXPECTED_DIAG)
    kern = launches[-1][1]
    assert kern["fwd_tile_m"] == 192
    for name in ("q", "q_t", "k", "k_t", "k_diag", "k_t_diag", "v", "v_diag", "do", "do_t"):
        assert kern[name].dtype == torch.float8_e4m3fn, name


def test_backward_with_noncausal_exact_variant(exact_bundle):
    """No diagonal decisions: no per-token K or V launch, no forward pairing (the op's forward of tile_n 192 is
    not refused); Q and dO still split."""
    b, launches = exact_bundle
    inputs, _ = bs.run_backward(b, BWD_NC)
    ops = {id(t): n for n, t in inputs.items()}
    assert [(n, ops[id(by["x"])]) for n, by in launches[:-1]] == [
        (TOK, "q"), (TB, "q"), (TB, "k"), (TB, "v"), (TOK_DELTA, "do"), (TB, "do")]
    src = bs.arg_sources(launches, inputs)
    assert {a: src[a] for a in EXPECTED} == EXPECTED
    assert not set(EXPECTED_DIAG) & set(launches[-1][1])


def test_backward_with_refuses_a_forward_of_another_tile_n(exact_bundle):
    b, launches = exact_bundle
    q, k, v, do, o, cu = bs.bf16_inputs()
    T = q.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(ValueError, match=rf"^fwd_params: forward variant {FWD_N192} .* tile_n=192, but backward "
                                             rf"{BWD} .* tile_n=128"):
            ops_mod.backward_with(b, b.variants[BWD], do, q, k, v, o, torch.zeros(HQ, T), cu, bs.profile_of(T, cu))
        with pytest.raises(ValueError, match=r"^fwd_params: the forward variant given as fwd_params has tile_n=192"):
            ops_mod.backward_with(b, b.variants[BWD], do, q, k, v, o, torch.zeros(HQ, T), cu, bs.profile_of(T, cu),
                                  fwd_params=b.variants[FWD_N192]["params"])
    assert launches == []


def test_backward_with_refuses_forward_codes(exact_bundle):
    b, launches = exact_bundle
    for name in (BWD, BWD_NC):
        with pytest.raises(ValueError, match=r"^codes: .* quantizes Q, dO.* twice .* needs the BF16 q, k, v"):
            bs.run_backward(b, name, codes=[torch.zeros(1)], fwd_params=b.variants[FWD_N128]["params"])
    assert launches == []


def test_backward_with_refuses_params_that_contradict_the_args(monkeypatch, tmp_path):
    """A manifest entry whose PARAMS flag an operand split its ARGS do not take (or the reverse) is refused before
    any launch: the launches would not be the ones the kernel reads."""
    args, params = _exact_variant(True)
    plain, _ = bs.generated(FP8_BWD)
    over = {BWD: (plain + DIAG_V_SPEC, params),  # PARAMS rows_q, diag_k; ARGS without q_t_scale, k_diag
            BWD_NC: (_exact_args(False), dict(bs.plan_bwd("mxfp8_exact", False).params, rows_q=False))}
    b, launches = _make_bundle(tmp_path, monkeypatch, bwd_over=over)
    with pytest.raises(ValueError, match=rf"^bwd: backward {BWD} has PARAMS rows_q=True but its ARGS do not name "
                                         r"q_t_scale"):
        bs.run_backward(b, BWD, fwd_params=b.variants[FWD_N128]["params"])
    with pytest.raises(ValueError, match=r"^bwd: .* PARAMS rows_q=False but its ARGS name q_t_scale"):
        bs.run_backward(b, BWD_NC)
    assert launches == []


def test_per_token_do_launch_skips_another_representations_delta_launch(monkeypatch, tmp_path):
    """The per-token plain quantizer's first use is a route whose dO launch is token-block (the naive pick,
    pick_do_delta of token_copy_use's route, would be TB_DELTA): the per-token one is found on another route."""
    from flamia_gen.runtime.attention import token_copy_use

    b, launches = _make_bundle(tmp_path, monkeypatch, tok_uses=["a_decoy.v"] + TOK_USES,
                               tb_delta_uses=(f"{ROUTE}.do", "a_decoy.do"))
    root = str(b.root)
    prof = bs.profile_of(_T, bs.cu_seqlens(DOCS))
    assert token_copy_use(root, ROUTE, "do", D) == ("a_decoy", "v")
    from flamia_gen.runtime.attention import pick_do_delta

    assert pick_do_delta(root, "a_decoy", D, prof)["name"] == TB_DELTA  # the naive choice
    assert token_copy_do_delta(root, ROUTE, D, prof)["name"] == TOK_DELTA
    inputs, _ = bs.run_backward(b, BWD, fwd_params=b.variants[FWD_N128]["params"])
    src = bs.arg_sources(launches, inputs)
    assert src["do"] == (TOK_DELTA, "do", "codes") and src["delta"] == (TOK_DELTA, "do", "delta")


@pytest.mark.parametrize("decoy", [False, True])
def test_backward_with_without_a_per_token_do_launch_raises_before_any_launch(monkeypatch, tmp_path, decoy):
    kw = dict(tok_uses=["a_decoy.v"] + TOK_USES, tb_delta_uses=(f"{ROUTE}.do", "a_decoy.do")) if decoy else {}
    b, launches = _make_bundle(tmp_path, monkeypatch, drop=(TOK_DELTA,), **kw)
    with pytest.raises(NoKernelError, match=r"no per-token e4m3 \(ceil\) dO launch .* route 'mxfp8_exact_cand'"):
        bs.run_backward(b, BWD, fwd_params=b.variants[FWD_N128]["params"])
    with pytest.raises(NoKernelError, match=r"no per-token e4m3"):
        bs.run_backward(b, BWD_NC)
    assert launches == []


def test_backward_with_without_a_per_token_quantizer_raises_before_any_launch(monkeypatch, tmp_path):
    b, launches = _make_bundle(tmp_path, monkeypatch, drop=(TOK,))
    with pytest.raises(NoKernelError, match=r"no per-token e4m3 quantizer"):
        bs.run_backward(b, BWD_NC)
    assert launches == []


def test_mxfp8_diag_backward_launches_are_unchanged(monkeypatch, tmp_path):
    """A variant without the split (mxfp8's diag_v backward): one token-block Q, K, V launch each and the route's
    own dO launch (token-block, with_delta) for do, do_t and delta."""
    plain, fparams = bs.generated(FP8_BWD)
    mx = (plain + DIAG_V_SPEC, dict(bs.plan_bwd("mxfp8_exact", True).params, rows_q=False, diag_k=False))
    b, launches = _make_bundle(tmp_path, monkeypatch, bwd_over={BWD: mx})
    inputs, _ = bs.run_backward(b, BWD, fwd_params=b.variants[FWD_N128]["params"])
    ops = {id(t): n for n, t in inputs.items()}
    assert [(n, ops[id(by["x"])]) for n, by in launches[:-1]] == [
        (TOK, "v"), (TB, "q"), (TB, "k"), (TB, "v"), (TB_DELTA, "do")]
    src = bs.arg_sources(launches, inputs)
    assert src["q"] == (TB, "q", "codes") and src["q_t"] == (TB, "q", "codes_t")
    assert src["do"] == (TB_DELTA, "do", "codes") and src["do_t"] == (TB_DELTA, "do", "codes_t")


# ---------------------------------------------------------------- verify.attn_gpu


def test_forward_pairing_keys_on_diag_k_too():
    from flamia_gen.verify.attn_gpu import emulator_forward_tiles, forward_entry_for

    fp = dict(head_dim=128, causal=True)
    n192 = bs.manifest_entry("f_n192", "attn_fwd", ["r"], dict(fp, tile_m=128, tile_n=192))
    n128 = bs.manifest_entry("f_n128", "attn_fwd", ["r"], dict(fp, tile_m=192, tile_n=128))
    from types import SimpleNamespace

    b = SimpleNamespace(manifest={"variants": [n192, n128]})
    base = dict(fp, tile_m=64, tile_n=128)
    k_only = bs.manifest_entry("bk", "attn_bwd", ["r"], dict(base, diag_k=True, diag_v=False))
    plain = bs.manifest_entry("bp", "attn_bwd", ["r"], dict(base, diag_k=False, diag_v=False))
    assert forward_entry_for(b, k_only)["name"] == "f_n128" and forward_entry_for(b, plain)["name"] == "f_n192"
    assert emulator_forward_tiles(b, k_only) == dict(fwd_tile_m=192, fwd_tile_n=128)
    assert emulator_forward_tiles(b, plain) == {}
    with pytest.raises(LookupError, match=r"tile_n=128 \(the diag_k backward's fwd_tile_n\)"):
        forward_entry_for(SimpleNamespace(manifest={"variants": [n192]}), k_only)


def test_emulator_takes_the_paired_forward_tiles_of_an_exact_entry():
    """verify's emulator call for a causal mxfp8_exact backward (k_fold under the FP8 model: route_backward needs
    fwd_tile_n == tile_n) with the forward the pairing picks from the plan's forwards; a forward of tile_n 192
    would be refused."""
    from flamia_gen.numerics.reference import attention, attention_backward
    from flamia_gen.verify.attn_gpu import emulator_forward_tiles, emulator_options

    bwd = bs.plan_bwd("mxfp8_exact", True, d=64)
    entry = bs.manifest_entry(bwd.name, "attn_bwd", ["mxfp8_exact"], dict(bwd.params))
    b = bs.plan_fwd_bundle("mxfp8_exact")
    assert {e["params"]["tile_n"] for e in b.manifest["variants"]} == {128, 192}
    tiles = emulator_forward_tiles(b, entry)
    assert tiles["fwd_tile_n"] == entry["params"]["tile_n"] == 128
    opts = emulator_options(entry["params"])
    assert opts["mma"] == "sm90_fp8"
    g = torch.Generator().manual_seed(0)
    cu = bs.cu_seqlens([70, 130])
    T = int(cu[-1])
    q, do = (torch.randn(T, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(T, 1, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    o, lse = attention(q, k, v, cu, causal=True, route="mxfp8_exact", return_lse=True)
    kw = dict(tile_m=64, tile_n=128, mma=opts["mma"], key_align=opts["key_align"])
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, cu, True, "mxfp8_exact", **kw, **tiles)
    assert all(bool(torch.isfinite(t).all()) for t in (dq, dk, dv))
    with pytest.raises(ValueError, match=r"needs fwd_tile_n == tile_n"):
        attention_backward(q, k, v, o, lse, do, cu, True, "mxfp8_exact", **kw, fwd_tile_m=128, fwd_tile_n=192)


@pytest.mark.parametrize("route, exact", [("mxfp8_exact", True), ("mxfp8", False)])
def test_probe_bwd_on_the_route_emulator(monkeypatch, route, exact):
    """The backward probe's criteria hold for mxfp8_exact's numerics (dQ rows before the perturbed token exactly
    unchanged, other documents' dK, dV bit for bit) and catch mxfp8's 32-token-block leak."""
    from flamia_gen.verify import attn_gpu

    monkeypatch.setattr(attn_gpu, "_run_bwd", bs.emulated_run_bwd(route))
    g = torch.Generator().manual_seed(1)
    q, k, v, cu = bs.small_qkv(g)
    do = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    r = attn_gpu.probe_bwd(None, None, q, k, v, do, cu)
    assert r["dq_run_to_run"] == 0.0 and r["probe_dkv_other_docs_exact"]
    assert r["probe_dq_exact"] is exact and (r["probe_dq_max_rel_change"] == 0.0) is exact


@pytest.mark.parametrize("leak", [False, True])
def test_verify_bwd_entry_probes_an_exact_causal_entry(monkeypatch, leak):
    """verify_bwd_entry runs the backward probe for a causal mxfp8_exact entry (route exact) and its verdict decides
    `ok`: a "kernel" with the route's numerics (the emulator on the paired forward's tiles) passes the probe and
    every bound; the same run with a probe that saw dQ move fails."""
    from flamia_gen.verify import attn_gpu

    bwd = bs.plan_bwd("mxfp8_exact", True, d=64)
    entry = bs.manifest_entry(bwd.name, "attn_bwd", ["mxfp8_exact"], dict(bwd.params))
    b = bs.plan_fwd_bundle("mxfp8_exact")
    tiles = attn_gpu.emulator_forward_tiles(b, entry)
    g = torch.Generator().manual_seed(2)
    q, k, v, cu = bs.small_qkv(g)
    monkeypatch.setattr(attn_gpu, "make_qkv", lambda docs, hq, hkv, d, kind, gen, dev: (q, k, v, cu))
    monkeypatch.setattr(attn_gpu, "_run_bwd", bs.emulated_run_bwd("mxfp8_exact", **tiles))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    probed = []
    real_probe = attn_gpu.probe_bwd

    def probe(*a, **kw):
        r = real_probe(*a, **kw)
        probed.append(dict(r))
        if leak:
            r.update(probe_dq_max_rel_change=1e-3, probe_dq_exact=False)
        return r

    monkeypatch.setattr(attn_gpu, "probe_bwd", probe)
    row, = attn_gpu.verify_bwd_entry(b, entry, kinds=("gauss",))
    assert len(probed) == 1 and probed[0]["probe_dq_exact"] and probed[0]["probe_dkv_other_docs_exact"]
    assert (row["fwd_tile_m"], row["fwd_tile_n"]) == (tiles["fwd_tile_m"], tiles["fwd_tile_n"]) and tiles["fwd_tile_n"] == 128
    assert row["cos_emulator"] >= attn_gpu.BWD_EMULATOR_COSINE and row["nan"] == 0
    assert row["cos_fp32"] >= attn_gpu.expected_grad_cosine("mxfp8_exact")
    assert row["ok"] is (not leak)
