"""Host side of the NVFP4 (`nvfp4_mixed`) backward's inputs (CPU only).

Route nvfp4_mixed keeps Q, K in NVFP4 for QKᵀ only (the emulator's `_product_spec`: "NVFP4 is QKᵀ-only (E4M3
token-block there)"): its backward recomputes Sᵀ = K·Qᵀ from the forward's NVFP4 Q, K (dequantized to BF16 without
their tensor scales, which come as one device scalar `qk_tensor_scale` = ts_q·ts_k: runtime.nvfp4), while dK = dSᵀ·Q
and dQ = dS·K read E4M3 token-block (ceil) copies of q and k; V, dO, dS as mxfp8 (causal: the per-token V copy on the
forward's diagonal pairs). Its backward variant (PARAMS qk_nvfp4; causal: diag_v, fwd_tile_n 128) takes the
fp8_token_bf16qk backward's ARGS (BF16 q, k; q_t, q_scale, k_t, k_scale the token-block copies), mxfp8's diagonal V
arguments (causal) and, last, `qk_tensor_scale`.

The ARGS here are the fp8_token_bf16qk backward's (generated/) plus what the template adds, as the runtime assumes;
once the template renders an nvfp4_mixed backward with PARAMS qk_nvfp4,
`test_rendered_nvfp4_variant_takes_what_run_attn_bwd_passes` checks its ARGS against these.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flamia_gen.render import rendered_literal
from flamia_gen.runtime import ops as ops_mod
from flamia_gen.runtime.attention import NVFP4_COPY_REP, NoKernelError, copy_rep, token_copy_use
from flamia_gen.runtime.attn_bwd import (DIAG_V_ARGS, QK_NVFP4_ARGS, bwd_schedule, is_diag_v_spec,
                                         is_qk_nvfp4_spec, is_scores_bf16_spec, run_attn_bwd)
from flamia_gen.runtime.nvfp4 import dequantize_bf16

try:  # `python -m pytest` from the repository root: tests/ is a namespace package
    from tests.runtime import bwd_standins as bs
except ImportError:  # plain `pytest` (rootdir not on sys.path): load the sibling module by path
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_flamia_bwd_standins", Path(__file__).with_name("bwd_standins.py"))
    bs = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(bs)

BF16QK_BWD = "attn_bwd_sm90_fp8_token_bf16qk_d128_m64n128_s2_wg2_preg_longest_first"
FP8_BWD = bs.FP8_BWD
HQ, HKV, D = bs.HQ, bs.HKV, bs.D

DIAG_V_SPEC = bs.DIAG_V_SPEC
QK_TS_SPEC = [{"name": "qk_tensor_scale", "dtype": "float32", "shape": ["1"], "role": "in"}]


def _nvfp4_args(causal: bool) -> list:
    """The fp8_token_bf16qk backward's ARGS (BF16 q, k) in the order the template emits the NVFP4 route's: ..., dv,
    [causal] v_diag, v_diag_scale, fwd_tile_m, then qk_tensor_scale."""
    args = bs.generated(BF16QK_BWD if causal else BF16QK_BWD + "_noncausal")[0]
    return args + (DIAG_V_SPEC if causal else []) + QK_TS_SPEC


def _nvfp4_variant(causal: bool = True) -> tuple[list, dict]:
    """(ARGS, PARAMS): the plan's (manifest) params of the nvfp4_mixed backward (q_fmt e2m1, diag_v; no qk_nvfp4,
    no fwd_tile_n: the rendered PARAMS add them)."""
    return _nvfp4_args(causal), dict(bs.plan_bwd("nvfp4_mixed", causal).params)


DOCS = bs.DOCS
_T = sum(DOCS)
_TPAD = -(-_T // 16) * 16
U8 = torch.uint8


def _inputs(lens=DOCS):
    """run_attn_bwd's common inputs for an NVFP4 variant: BF16 q, k (the dequantized NVFP4 values), E4M3 codes for
    v, do and the token-block copies q_t, k_t."""
    cu = bs.cu_seqlens(lens)
    T = int(cu[-1])
    tpad = -(-T // 16) * 16
    g = torch.Generator().manual_seed(0)
    return dict(q=torch.randn(T, HQ, D, generator=g).to(torch.bfloat16),
                k=torch.randn(T, HKV, D, generator=g).to(torch.bfloat16),
                v=torch.zeros(T, HKV, D, dtype=U8), do=torch.zeros(T, HQ, D, dtype=U8),
                lse=torch.zeros(HQ, T), delta=torch.zeros(HQ, T),
                q_t=torch.full((HQ, D, tpad), 0x31, dtype=U8), k_t=torch.full((HKV, D, tpad), 0x32, dtype=U8),
                do_t=torch.zeros(HQ, D, tpad, dtype=U8), q_scale=torch.full((T, HQ), 117, dtype=U8),
                k_scale=torch.full((T, HKV), 118, dtype=U8), v_scale=torch.zeros(T, HKV, dtype=U8),
                do_scale=torch.zeros(T, HQ, dtype=U8), cu_seqlens=cu)


def _ts():
    return dict(qk_tensor_scale=torch.tensor([0.375], dtype=torch.float32))


def _new(causal=True):
    return dict(_ts(), **(bs.diag_v_inputs(_T) if causal else {}))


# ---------------------------------------------------------------- run_attn_bwd


def test_spec_predicates():
    """The NVFP4 variant is told apart by `qk_tensor_scale` and goes through the scores_bf16 path (BF16 q, k)."""
    bf16qk, _ = bs.generated(BF16QK_BWD)
    fp8, _ = bs.generated(FP8_BWD)
    for causal in (True, False):
        nv = _nvfp4_args(causal)
        assert is_qk_nvfp4_spec(nv) and is_scores_bf16_spec(nv)
        assert is_diag_v_spec(nv) is causal
    assert not is_qk_nvfp4_spec(bf16qk) and is_scores_bf16_spec(bf16qk)
    assert not is_qk_nvfp4_spec(fp8 + DIAG_V_SPEC) and not is_scores_bf16_spec(fp8 + DIAG_V_SPEC)
    assert QK_NVFP4_ARGS == ("qk_tensor_scale",)


@pytest.mark.parametrize("causal", [True, False])
def test_run_attn_bwd_passes_bf16_qk_the_copies_and_the_tensor_scale(causal):
    args, params = _nvfp4_variant(causal)
    x = _inputs()
    kw = _new(causal)
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **x, params=params, **kw)
    assert list(seen) == [a["name"] for a in args]
    assert seen["qk_tensor_scale"] is kw["qk_tensor_scale"]
    # Sᵀ = K·Qᵀ on the BF16 (dequantized NVFP4) q, k as given; dK, dQ on the token-block copies viewed as E4M3
    assert seen["q"] is x["q"] and seen["k"] is x["k"] and seen["q"].dtype == torch.bfloat16
    for name, code in (("q_t", 0x31), ("k_t", 0x32)):
        assert seen[name].dtype == torch.float8_e4m3fn and seen[name].data_ptr() == x[name].data_ptr(), name
        assert bool((seen[name].view(U8) == code).all()), name
    assert seen["q_scale"] is x["q_scale"] and seen["k_scale"] is x["k_scale"]
    if causal:
        assert seen["fwd_tile_m"] == 192 and bool((seen["v_diag"].view(U8) == 0x40).all())
    else:
        assert not set(DIAG_V_ARGS) & set(seen)
    # square_32 dS: no windows
    assert torch.equal(seen["work"], bwd_schedule(x["cu_seqlens"], 64, 128, causal, key_align=16, T=_T,
                                                  windows=False).work)


@pytest.mark.parametrize("causal", [True, False])
def test_run_attn_bwd_requires_the_tensor_scale(causal):
    args, params = _nvfp4_variant(causal)
    called = []
    with pytest.raises(ValueError, match=r"^qk_tensor_scale: required: .* ts_q·ts_k"):
        run_attn_bwd(lambda *a: called.append(a), args, **_inputs(), params=params,
                     **bs.merged(_new(causal), qk_tensor_scale=bs.DROP))
    assert not called


def _other_variants():
    bf16qk, p1 = bs.generated(BF16QK_BWD)
    fp8, p2 = bs.generated(FP8_BWD)
    x = _inputs()
    fp8_x = dict(x, q=torch.zeros(_T, HQ, D, dtype=U8), k=torch.zeros(_T, HKV, D, dtype=U8))
    mx = dict(p2, diag_v=True, ds_gran="square_32", fwd_tile_n=128)
    return {"fp8_token_bf16qk": (bf16qk, p1, x, {}), "fp8_token": (fp8, p2, fp8_x, {}),
            "mxfp8": (fp8 + DIAG_V_SPEC, mx, fp8_x, bs.diag_v_inputs(_T))}


@pytest.mark.parametrize("which", ["fp8_token_bf16qk", "fp8_token", "mxfp8"])
def test_run_attn_bwd_refuses_the_tensor_scale_elsewhere(which):
    args, params, x, extra = _other_variants()[which]
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **x, params=params, **extra)  # the variant itself runs
    assert "qk_tensor_scale" not in seen
    called = []
    with pytest.raises(ValueError, match=r"^qk_tensor_scale: only a backward whose ARGS name it \(an NVFP4 route"):
        run_attn_bwd(lambda *a: called.append(a), args, **x, params=params, **extra, **_ts())
    assert not called


F32 = torch.float32
_BAD = [
    (torch.tensor([0.5], dtype=torch.float64), r"^qk_tensor_scale: dtype torch.float64"),
    (torch.tensor([0.5], dtype=torch.bfloat16), r"^qk_tensor_scale: dtype torch.bfloat16"),
    (torch.tensor([0.5, 1.0], dtype=F32), r"^qk_tensor_scale: shape \(2,\), expected \(1,\)"),
    (torch.tensor(0.5, dtype=F32), r"^qk_tensor_scale: expected 1 dims, got shape \(\)"),
    (torch.tensor([[0.5]], dtype=F32), r"^qk_tensor_scale: expected 1 dims"),
    (0.5, r"^qk_tensor_scale: expected a torch.Tensor, got float"),
    (torch.empty(1, dtype=F32, device="meta"), r"^qk_tensor_scale: on meta, expected cpu"),
]


@pytest.mark.parametrize("value, match", _BAD, ids=[str(i) for i in range(len(_BAD))])
def test_run_attn_bwd_refuses_a_bad_tensor_scale(value, match):
    args, params = _nvfp4_variant(True)
    called = []
    with pytest.raises(ValueError, match=match):
        run_attn_bwd(lambda *a: called.append(a), args, **_inputs(), params=params,
                     **bs.merged(_new(True), qk_tensor_scale=value))
    assert not called


def test_run_attn_bwd_takes_bf16_qk_and_e4m3_copies_only():
    """The scores_bf16 path's checks hold for the NVFP4 variant: q, k BF16 (not codes), q_t, k_t E4M3 codes (not
    BF16); and an ARGS list naming qk_tensor_scale with FP8 q, k is refused as malformed."""
    args, params = _nvfp4_variant(True)
    x = _inputs()
    for over, match in ((dict(q=torch.zeros(_T, HQ, D, dtype=U8)), r"^q: dtype torch.uint8"),
                        (dict(k=torch.zeros(_T, HKV, D, dtype=U8)), r"^k: dtype torch.uint8"),
                        (dict(q_t=torch.zeros(HQ, D, _TPAD, dtype=torch.bfloat16)), r"^q_t: dtype torch.bfloat16"),
                        (dict(k_scale=None), r"^k_scale: expected a torch.Tensor")):
        with pytest.raises(ValueError, match=match):
            run_attn_bwd(lambda *a: None, args, **dict(x, **over), params=params, **_new(True))
    fp8, p = bs.generated(FP8_BWD)
    fp8_x = dict(x, q=torch.zeros(_T, HQ, D, dtype=U8), k=torch.zeros(_T, HKV, D, dtype=U8))
    called = []
    with pytest.raises(ValueError, match=r"^args_spec: names qk_tensor_scale but not BF16 q, k"):
        run_attn_bwd(lambda *a: called.append(a), fp8 + QK_TS_SPEC, **fp8_x, params=p, **_ts())
    assert not called


@pytest.fixture(scope="module")
def rendered_nvfp4():
    """The nvfp4_mixed backward variants as the template renders them (skipped while its PARAMS have no qk_nvfp4: the
    template then renders the route as mxfp8): {causal: (plan params, rendered ARGS, rendered PARAMS)}."""
    from flamia_gen.render.render import render_variant

    out = {}
    for causal in (True, False):
        v = bs.plan_bwd("nvfp4_mixed", causal)
        try:
            src = render_variant(v)
        except Exception as e:  # the template's ERROR_... sentinel until it supports the route
            pytest.skip(f"the template does not render {v.name}: {type(e).__name__}: {str(e)[:120]}")
        params = rendered_literal(src, "PARAMS")
        if not params.get("qk_nvfp4"):
            pytest.skip(f"the template renders {v.name} without PARAMS qk_nvfp4 (the NVFP4 backward is not in yet)")
        out[causal] = (dict(v.params), rendered_literal(src, "ARGS"), params)
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_rendered_nvfp4_variant_takes_what_run_attn_bwd_passes(rendered_nvfp4, causal):
    plan_params, args, params = rendered_nvfp4[causal]
    by = {a["name"]: (a["dtype"], a["shape"]) for a in args}
    assert params["qk_nvfp4"] is True and bool(params.get("diag_v")) is causal
    if causal:
        assert params["fwd_tile_n"] == params["tile_n"] == 128
    assert args[-1]["name"] == "qk_tensor_scale"
    want = {a["name"]: (a["dtype"], a["shape"]) for a in _nvfp4_args(causal)}
    assert by == want
    fn, seen = bs.recorder(args)
    run_attn_bwd(fn, args, **_inputs(), params=plan_params, **_new(causal))
    assert set(seen) == set(by)
    # the manifest's params (the plan's) and the rendered ARGS agree for ops.backward_with
    assert ops_mod.qk_nvfp4_operands({"name": "x", "args": args, "params": plan_params}) is True
    assert ops_mod.qk_nvfp4_operands({"name": "x", "args": args, "params": params}) is True


# ---------------------------------------------------------------- the token-block copy's representation


def test_nvfp4_copy_representation_is_the_emulators():
    """The runtime's copy of an NVFP4 operand (E4M3, ceil, token_block) is the emulator's `_product_spec` of the
    route's Q and K, and of nothing else."""
    from flamia_gen.numerics.reference_route import _E4M3_TB, _product_spec
    from flamia_gen.spec import get_route

    ops = get_route("nvfp4_mixed").operands
    for spec in (ops.q, ops.k):
        assert spec.granularity.value == "nvfp4"
        ps = _product_spec(spec)
        assert ps == _E4M3_TB
        assert (ps.format.value, ps.exponent_rule.value, ps.granularity.value, bool(ps.hadamard)) == (
            NVFP4_COPY_REP["fmt"], NVFP4_COPY_REP["exponent_rule"], "token_block", False)
    assert copy_rep({"fmt": "e2m1", "exponent_rule": "ceil"}) == NVFP4_COPY_REP
    assert copy_rep({"fmt": "e2m1", "exponent_rule": "floor"}) == NVFP4_COPY_REP
    assert copy_rep({"fmt": "e4m3", "exponent_rule": "floor"}) == {"fmt": "e4m3", "exponent_rule": "floor"}


# ---------------------------------------------------------------- ops.backward_with on a stand-in bundle


ROUTE = "nvfp4_mixed_cand"  # a candidate route: bundled kernels, no dispatch group, not in the installed plan
NV = "quant_sm90_e2m1_nvfp4_d128_t128_h1"
TB, TB_DELTA, TOK, TOK_DELTA = bs.TB, bs.TB_DELTA, bs.TOK, bs.TOK_DELTA
TB_FLOOR = "quant_sm90_e4m3_tb32_floor_d128_t128_h1"
FWD_N192 = f"attn_fwd_sm90_{ROUTE}_d128_a_m128n192"  # first by name: the op's forward choice
FWD_N128 = f"attn_fwd_sm90_{ROUTE}_d128_b_m192n128"
BWD = f"attn_bwd_sm90_{ROUTE}_d128_m64n128"
BWD_NC = f"attn_bwd_sm90_{ROUTE}_d128_m64n128_noncausal"
# as the plan shares it: mxfp8's token-block quantizer serves nvfp4_mixed's V and dO (its first use is mxfp8's)
TB_USES = ["mxfp8.do", "mxfp8.k", "mxfp8.q", "mxfp8.v", f"{ROUTE}.do", f"{ROUTE}.v"]
TOK_USES = ["fp8_token.do", "fp8_token.k", "fp8_token.q", "fp8_token.v"]
# token-block E4M3 quantizers the copy lookup must pass over (their names sort first): another exponent rule, a
# rotation, another head dim, a dO launch
DECOYS = [
    bs.quant_entry(TB_FLOOR, ["zz_floor.q"], as_name="quant_sm90_aa0_tb32_floor"),
    bs.quant_entry(TB, ["zz_had.q"], as_name="quant_sm90_aa1_tb32_ceil_had", hadamard=True),
    bs.quant_entry(TB, ["zz_d64.q"], as_name="quant_sm90_aa2_tb32_ceil_d64", head_dim=64),
    bs.quant_entry(TB_DELTA, ["zz_delta.do"], as_name="quant_sm90_aa3_tb32_ceil_delta"),
]


def _make_bundle(tmp_path, monkeypatch, *, drop=(), tb_uses=TB_USES, v_quant=None, decoys=(), bwd_over=None):
    """A bundle manifest of the candidate NVFP4 route (its NVFP4 Q/K quantizer, the token-block quantizer serving its
    V, dO and mxfp8's operands, its dO launch, fp8_token's per-token quantizers, two forwards of tile_n 192 and 128,
    the causal and non-causal backward) with Python stand-ins for the kernels. Every quantizer launch fills its
    outputs with values of its own (a launch counter; NVFP4: random codes and finite E4M3 block scales drawn from
    it, tensor scale n + 0.5) and is recorded with its inputs; returns (bundle, launches)."""
    fp = dict(head_dim=128, causal=True, diag_v=True, q_fmt="e2m1")
    variants = list(decoys) + [
        bs.quant_entry(NV, [f"{ROUTE}.k", f"{ROUTE}.q"]),
        bs.quant_entry(TB, list(tb_uses)),
        bs.quant_entry(TB_DELTA, ["mxfp8.do", f"{ROUTE}.do"]),
        bs.quant_entry(TOK, TOK_USES),
        bs.quant_entry(TOK_DELTA, ["fp8_token.do"]),
        bs.manifest_entry(FWD_N192, "attn_fwd", [ROUTE], dict(fp, tile_m=128, tile_n=192)),
        bs.manifest_entry(FWD_N128, "attn_fwd", [ROUTE], dict(fp, tile_m=192, tile_n=128)),
    ]
    if v_quant is not None:
        variants.append(v_quant)
    for name, causal in ((BWD, True), (BWD_NC, False)):
        args, params = (bwd_over or {}).get(name, _nvfp4_variant(causal))
        variants.append(bs.manifest_entry(name, "attn_bwd", [ROUTE], params, args))
    variants = [v for v in variants if v["name"] not in drop]
    return bs.standin_bundle(tmp_path, monkeypatch, "bundle_nvfp4", variants, _fill_nvfp4)


def _fill_nvfp4(name, by, n):
    """A stand-in quantizer's outputs from launch number n: bs.fill_by_launch, or for NVFP4 (a tensor_scale output)
    random packed E2M1 codes, E4M3 block scales in [2^-3, 2^3] and tensor scale n + 0.5."""
    if "tensor_scale" not in by:
        bs.fill_by_launch(name, by, n)
        return
    g = torch.Generator().manual_seed(n)
    by["codes"].copy_(torch.randint(0, 256, by["codes"].shape, generator=g, dtype=torch.uint8))
    by["scales"].copy_(torch.randint(0x20, 0x50, by["scales"].shape, generator=g, dtype=torch.uint8))
    by["tensor_scale"].fill_(n + 0.5)


@pytest.fixture
def nv_bundle(monkeypatch, tmp_path):
    return _make_bundle(tmp_path, monkeypatch)


def _launch_of(launches, inputs, quant, operand):
    """The outputs of the one launch of `quant` on `operand`."""
    which = {id(t): n for n, t in inputs.items()}
    hits = [by for name, by in launches[:-1] if name == quant and which[id(by["x"])] == operand]
    assert len(hits) == 1, (quant, operand, len(hits))
    return hits[0]


# what each kernel argument must be: token-block copies of Q, K (dK, dQ), V and dO as mxfp8
EXPECTED = {
    "q_t": (TB, "q", "codes_t"), "q_scale": (TB, "q", "scales"),
    "k_t": (TB, "k", "codes_t"), "k_scale": (TB, "k", "scales"),
    "v": (TB, "v", "codes"), "v_scale": (TB, "v", "scales"),
    "do": (TB_DELTA, "do", "codes"), "do_t": (TB_DELTA, "do", "codes_t"), "do_scale": (TB_DELTA, "do", "scales"),
    "delta": (TB_DELTA, "do", "delta"), "dq_accum": (TB_DELTA, "do", "dq_accum"),
}
EXPECTED_DIAG = {"v_diag": (TOK, "v", "codes"), "v_diag_scale": (TOK, "v", "scales")}


def _check_nvfp4_qk(launches, inputs):
    """q, k: the NVFP4 launches' codes·block scales in BF16 (not the BF16 inputs, not swapped); qk_tensor_scale:
    fp32 (1,) = ts_q·ts_k of those launches."""
    kern = launches[-1][1]
    lq, lk = (_launch_of(launches, inputs, NV, op) for op in ("q", "k"))
    for name, lo in (("q", lq), ("k", lk)):
        want = dequantize_bf16(lo["codes"], lo["scales"])
        assert kern[name].dtype == torch.bfloat16 and kern[name].shape == inputs[name].shape, name
        assert torch.equal(kern[name], want), name
        assert not torch.equal(kern[name], inputs[name]), name
    assert not torch.equal(dequantize_bf16(lq["codes"], lq["scales"])[:, :HKV],
                           dequantize_bf16(lk["codes"], lk["scales"]))  # a swap would show
    ts = kern["qk_tensor_scale"]
    assert ts.dtype == torch.float32 and tuple(ts.shape) == (1,)
    assert float(lq["tensor_scale"]) != float(lk["tensor_scale"])
    assert float(ts) == float(lq["tensor_scale"]) * float(lk["tensor_scale"])


def test_backward_with_feeds_each_argument_from_the_right_launch(nv_bundle):
    b, launches = nv_bundle
    inputs, o = bs.run_backward(b, BWD, fwd_params=b.variants[FWD_N128]["params"])
    ops = {id(t): n for n, t in inputs.items()}
    assert [(n, ops[id(by["x"])]) for n, by in launches[:-1]] == [
        (TOK, "v"), (NV, "q"), (TB, "q"), (NV, "k"), (TB, "k"), (TB, "v"), (TB_DELTA, "do")]
    assert launches[-1][0] == BWD
    assert launches[-2][1]["o"] is o  # the dO launch (delta = rowsum(dO∘O))
    src = bs.arg_sources(launches, inputs)
    assert {a: src[a] for a in list(EXPECTED) + list(EXPECTED_DIAG)} == dict(EXPECTED, **EXPECTED_DIAG)
    assert src["q"] is None and src["k"] is None  # new tensors (dequantized), no launch's output storage
    _check_nvfp4_qk(launches, inputs)
    kern = launches[-1][1]
    assert kern["fwd_tile_m"] == 192
    for name in ("q_t", "k_t", "v", "v_diag", "do", "do_t"):
        assert kern[name].dtype == torch.float8_e4m3fn, name


def test_backward_with_noncausal_nvfp4_variant(nv_bundle):
    """No diagonal decisions: no per-token V launch, no forward pairing (the op's forward of tile_n 192 is not
    refused); Q and K still launched twice."""
    b, launches = nv_bundle
    inputs, _ = bs.run_backward(b, BWD_NC)
    ops = {id(t): n for n, t in inputs.items()}
    assert [(n, ops[id(by["x"])]) for n, by in launches[:-1]] == [
        (NV, "q"), (TB, "q"), (NV, "k"), (TB, "k"), (TB, "v"), (TB_DELTA, "do")]
    src = bs.arg_sources(launches, inputs)
    assert {a: src[a] for a in EXPECTED} == EXPECTED
    _check_nvfp4_qk(launches, inputs)
    assert not set(EXPECTED_DIAG) & set(launches[-1][1])


def test_backward_with_refuses_forward_codes(nv_bundle):
    b, launches = nv_bundle
    for name in (BWD, BWD_NC):
        with pytest.raises(ValueError, match=r"^codes: backward .* quantizes Q and K twice \(NVFP4 for Sᵀ, E4M3 "
                                             r"token-block for dK, dQ\) itself: it needs the BF16 q, k, v"):
            bs.run_backward(b, name, codes=[torch.zeros(1)], fwd_params=b.variants[FWD_N128]["params"])
    assert launches == []


def test_backward_with_refuses_a_forward_of_another_tile_n(nv_bundle):
    b, launches = nv_bundle
    with pytest.raises(ValueError, match=rf"^fwd_params: forward variant {FWD_N192} .* tile_n=192, but backward "
                                         rf"{BWD} .* tile_n=128"):
        bs.run_backward(b, BWD)
    assert launches == []


def test_backward_with_refuses_params_that_contradict_the_args(monkeypatch, tmp_path):
    """A manifest entry whose PARAMS say NVFP4 Q, K (plan q_fmt e2m1, or the rendered qk_nvfp4) while its ARGS take no
    qk_tensor_scale (a kernel rendered before the template knew the route: FP8 Q, K codes), or the reverse, is refused
    before any launch."""
    fp8, _ = bs.generated(FP8_BWD)
    _, params = _nvfp4_variant(True)
    nc_args, nc_params = _nvfp4_variant(False)
    over = {BWD: (fp8 + DIAG_V_SPEC, params), BWD_NC: (nc_args, dict(nc_params, qk_nvfp4=False))}
    b, launches = _make_bundle(tmp_path, monkeypatch, bwd_over=over)
    with pytest.raises(ValueError, match=rf"^bwd: backward {BWD} has PARAMS q_fmt=e2m1 but its ARGS do not name "
                                         r"qk_tensor_scale"):
        bs.run_backward(b, BWD, fwd_params=b.variants[FWD_N128]["params"])
    with pytest.raises(ValueError, match=r"^bwd: .* PARAMS qk_nvfp4=False but its ARGS name qk_tensor_scale"):
        bs.run_backward(b, BWD_NC)
    assert launches == []
    # the rendered flag wins over q_fmt; both agreeing with the ARGS pass
    assert ops_mod.qk_nvfp4_operands(dict(b.variants[BWD_NC], params=dict(nc_params, qk_nvfp4=True)))
    assert not ops_mod.qk_nvfp4_operands(dict(b.variants[BWD], params=dict(params, q_fmt="e4m3")))


# ---------------------------------------------------------------- the token-block copy lookup


def test_token_block_copy_found_past_decoys(monkeypatch, tmp_path):
    b, launches = _make_bundle(tmp_path, monkeypatch, decoys=DECOYS)
    root = str(b.root)
    quants = sorted(n for n, e in b.variants.items() if e["kind"] == "quant")
    assert quants[:4] == sorted(d["name"] for d in DECOYS)  # they come first by name
    for op in ("q", "k"):
        assert token_copy_use(root, ROUTE, op, D, "token_block") == ("mxfp8", "do")
    # the default (per-token copies) is unchanged: the V copy of the diagonal tiles
    assert token_copy_use(root, ROUTE, "v", D) == ("fp8_token", "do")
    assert token_copy_use(root, ROUTE, "v", D, "token") == ("fp8_token", "do")
    with pytest.raises(ValueError, match=r"^granularity: 'tensor'"):
        token_copy_use(root, ROUTE, "q", D, "tensor")
    # and the op launches that quantizer for q_t, k_t
    inputs, _ = bs.run_backward(b, BWD_NC)
    src = bs.arg_sources(launches, inputs)
    assert {a: src[a] for a in ("q_t", "k_t", "q_scale", "k_scale")} == {a: EXPECTED[a] for a in
                                                                         ("q_t", "k_t", "q_scale", "k_scale")}


def test_token_block_copy_of_the_route_itself(monkeypatch, tmp_path):
    """A route-filtered bundle where the token-block quantizer serves only the NVFP4 route's V and dO: that use
    answers."""
    b, _ = _make_bundle(tmp_path, monkeypatch, tb_uses=[f"{ROUTE}.do", f"{ROUTE}.v"])
    assert token_copy_use(str(b.root), ROUTE, "q", D, "token_block") == (ROUTE, "do")


def test_missing_token_block_copy_raises_naming_it_before_any_launch(monkeypatch, tmp_path):
    """No E4M3 token-block ceil plain quantizer bundled (V is served by a floor one; the ceil dO launch is with_delta,
    the others are decoys): NoKernelError naming the copy, before any launch."""
    v_floor = bs.quant_entry(TB_FLOOR, [f"{ROUTE}.v"])
    b, launches = _make_bundle(tmp_path, monkeypatch, drop=(TB,), v_quant=v_floor, decoys=DECOYS)
    root = str(b.root)
    msg = (rf"no token-block e4m3 \(ceil\) quantizer \(the copy of {ROUTE}.q that dK = dSᵀ·Q and dQ = dS·K read, "
           r"head_dim=128\)")
    with pytest.raises(NoKernelError, match=msg):
        token_copy_use(root, ROUTE, "q", D, "token_block")
    with pytest.raises(NoKernelError, match=msg.replace(".q", ".k")):
        token_copy_use(root, ROUTE, "k", D, "token_block")
    for name in (BWD_NC, BWD):
        with pytest.raises(NoKernelError, match=msg):
            bs.run_backward(b, name, fwd_params=b.variants[FWD_N128]["params"])
    assert launches == []


def test_missing_nvfp4_quantizer_raises_before_any_launch(monkeypatch, tmp_path):
    b, launches = _make_bundle(tmp_path, monkeypatch, drop=(NV,))
    with pytest.raises(NoKernelError, match=rf"no quant kernel for route='{ROUTE}' operand=q"):
        bs.run_backward(b, BWD_NC)
    with pytest.raises(NoKernelError, match=rf"no quantizer for {ROUTE}.q"):
        token_copy_use(str(b.root), ROUTE, "q", D, "token_block")
    assert launches == []


# ---------------------------------------------------------------- verify.attn_gpu on the emulator


def _bwd_entry(causal=True, d=64):
    v = bs.plan_bwd("nvfp4_mixed", causal, d)
    return bs.manifest_entry(v.name, "attn_bwd", ["nvfp4_mixed"], dict(v.params))


def test_verify_pairs_an_nvfp4_entry_and_its_emulator_options():
    from flamia_gen.verify.attn_gpu import (emulator_forward_tiles, emulator_options, expected_grad_cosine,
                                            forward_entry_for)

    b = bs.plan_fwd_bundle("nvfp4_mixed")
    causal, nc = _bwd_entry(True), _bwd_entry(False)
    fe = forward_entry_for(b, causal)
    assert fe["params"]["tile_n"] == 128 and fe["params"]["causal"] and fe["params"]["q_fmt"] == "e2m1"
    tiles = emulator_forward_tiles(b, causal)
    assert tiles == dict(fwd_tile_m=fe["params"]["tile_m"], fwd_tile_n=128)
    assert emulator_forward_tiles(b, nc) == {}
    assert forward_entry_for(b, nc)["params"]["causal"] is False
    assert emulator_options(causal["params"]) == dict(tile_m=64, tile_n=128, key_align=16, mma="sm90_fp8")
    assert expected_grad_cosine("nvfp4_mixed") == 0.985
    no128 = SimpleNamespace(manifest={"variants": [e for e in b.manifest["variants"] if e["params"]["tile_n"] != 128]})
    with pytest.raises(LookupError, match=r"tile_n=128 \(the diag_v backward's fwd_tile_n\)"):
        forward_entry_for(no128, causal)


@pytest.mark.parametrize("fwd_tile_m", [128, 192])
def test_emulator_backward_of_the_nvfp4_route(fwd_tile_m):
    """route_backward for nvfp4_mixed as verify calls it (mma sm90_fp8, key_align 16, the kernel's tiles, the paired
    forward's tiles) runs, is finite, and clears the route's fp32 floor on Gaussian inputs; its dK, dQ products take
    the token-block copies (the FP8 model on them: plan.mma_dk, mma_dq), not QKᵀ (BF16 wgmma: exact)."""
    from flamia_gen.numerics.metrics import cosine
    from flamia_gen.numerics.reference import attention, attention_backward
    from flamia_gen.numerics.reference_route import make_plan
    from flamia_gen.spec import get_route
    from flamia_gen.verify.attn_gpu import expected_grad_cosine

    plan = make_plan(get_route("nvfp4_mixed"), True, 64, 128, 0.125, key_align=16, mma="sm90_fp8",
                     fwd_tile_m=fwd_tile_m, fwd_tile_n=128)
    assert plan.mma_dk and plan.mma_dq and plan.mma_dv and plan.mma_dp and not plan.mma_qk and plan.per_key_v
    g = torch.Generator().manual_seed(3)
    q, k, v, cu = bs.small_qkv(g, (70, 130, 33))
    do = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    o, lse = attention(q, k, v, cu, causal=True, route="nvfp4_mixed", return_lse=True, tile_m=fwd_tile_m, tile_n=128,
                       key_align=16, mma="sm90_fp8")
    o = o.to(torch.bfloat16)
    emu = attention_backward(q, k, v, o, lse, do, cu, True, "nvfp4_mixed", tile_m=64, tile_n=128, mma="sm90_fp8",
                             key_align=16, fwd_tile_m=fwd_tile_m, fwd_tile_n=128)
    exact = attention_backward(q, k, v, o, lse, do, cu, True, None)
    for name, e, x in zip(("dq", "dk", "dv"), emu, exact):
        assert e.shape == x.shape and bool(torch.isfinite(e).all()), name
        assert float(cosine(e, x)) >= expected_grad_cosine("nvfp4_mixed"), name


def test_verify_bwd_entry_on_the_nvfp4_emulator(monkeypatch):
    """verify_bwd_entry for a causal nvfp4_mixed entry, its "kernel" the route's emulator on the paired forward's
    tiles: every bound holds (emulator cosine, the route's fp32 floor, no NaN), the row carries the forward's tiles,
    and no backward probe runs (the route is not exact)."""
    from flamia_gen.verify import attn_gpu

    entry = _bwd_entry(True)
    b = bs.plan_fwd_bundle("nvfp4_mixed")
    tiles = attn_gpu.emulator_forward_tiles(b, entry)
    g = torch.Generator().manual_seed(2)
    q, k, v, cu = bs.small_qkv(g)
    monkeypatch.setattr(attn_gpu, "make_qkv", lambda docs, hq, hkv, d, kind, gen, dev: (q, k, v, cu))
    monkeypatch.setattr(attn_gpu, "_run_bwd", bs.emulated_run_bwd("nvfp4_mixed", **tiles))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    probed = []
    monkeypatch.setattr(attn_gpu, "probe_bwd", lambda *a, **kw: probed.append(1) or {})
    row, = attn_gpu.verify_bwd_entry(b, entry, kinds=("gauss",))
    assert (row["fwd_tile_m"], row["fwd_tile_n"]) == (tiles["fwd_tile_m"], 128)
    assert row["emulator_mma"] == "sm90_fp8" and row["nan"] == 0
    assert row["cos_emulator"] >= attn_gpu.BWD_EMULATOR_COSINE
    assert row["cos_fp32"] >= attn_gpu.expected_grad_cosine("nvfp4_mixed")
    assert row["ok"] is True and probed == []


def test_probe_bwd_on_the_nvfp4_emulator(monkeypatch):
    """The backward probe runs on the route's numerics: dQ rows before the perturbed token stay put in its own
    document only up to the tensor-wide NVFP4 scales, and other documents' dK, dV move (ts_q, ts_k are amaxes over
    the whole call: nvfp4_mixed is not an exact route, so verify does not require the probe)."""
    from flamia_gen.spec import get_route
    from flamia_gen.verify import attn_gpu

    assert not get_route("nvfp4_mixed").exact
    monkeypatch.setattr(attn_gpu, "_run_bwd", bs.emulated_run_bwd("nvfp4_mixed", 128))
    g = torch.Generator().manual_seed(1)
    q, k, v, cu = bs.small_qkv(g)
    do = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    r = attn_gpu.probe_bwd(None, None, q, k, v, do, cu)
    assert r["dq_run_to_run"] == 0.0
    assert r["probe_dkv_other_docs_exact"] is False and r["probe_dkv_other_docs_rows_moved"] > 0
    assert r["probe_dq_exact"] is False
