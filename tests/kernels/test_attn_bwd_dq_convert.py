"""The call's own dQ conversion (flag `bwd_dq_convert`; forty-fourth session; with bwd_sdp_split and bwd_dq_scale_late
the default of fp8_token's D = 128 non-deterministic tile since round 45; templates/sm90/attn_bwd.py.j2;
docs/perf-notes.md rounds 44–45): the backward's jit function launches a second, vectorised kernel after the backward
that writes BF16 dQ from dq_accum — with the row factor `bwd_dq_scale_late` leaves out — and the runtime returns that
tensor instead of converting with torch.

CPU: exactly those two default renders have it; the flag adds the `dq` out argument right after dv (ARGS, the jit signature and the fake
compile arguments agree), the conversion reads dO's scale code on the FP8 dqsl tiles (masked to its byte) and
multiplies with mul.rn; refused on the tiles whose call is not plain (deterministic, tensor-scaled dS, diagonal and
exact routes, NVFP4 Q·K, the tile copy). run_attn_bwd hands the kernel a `dq` (NaN-poisoned on request) and returns it.
`-m compile`: the conversion's SASS is two 16-byte loads and one 16-byte store a row chunk, no flushing multiply.
"""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_literal, rendered_params
from flamia_gen.runtime.attn_bwd import dq_from_accum, run_attn_bwd
from flamia_gen.spec import load_specs
from kernel_source import method_source

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]


def _plain(route, causal=True, d=128):
    return next(v for v in BWD if v.route == route and v.param("head_dim") == d and bool(v.param("causal")) is causal
                and not dict(v.params).get("deterministic"))


FP8T = _plain("fp8_token")
BF16 = _plain("bf16")
LATE = dict(bwd_dq_convert=True, bwd_dq_scale_late=True)


def test_default_only_on_fp8_tokens_d128_tile():
    on = [v for v in BWD if v.route == "fp8_token" and v.param("head_dim") == 128
          and not dict(v.params).get("deterministic")]
    assert len(on) == 2 and FP8T in on
    for v in BWD:
        src = render_variant(v)
        has = "dq" in {a["name"] for a in rendered_literal(src, "ARGS")}
        assert has is ("def dq_convert" in src) is (rendered_params(src).get("bwd_dq_convert") is True) is (v in on), \
            v.name
        if v in on:  # with the late scale: the conversion applies the row factor from dO's scale code
            assert rendered_params(src)["bwd_dq_scale_late"] is True and "mdOs" in method_source(src, "dq_convert")


@pytest.mark.parametrize("v", [FP8T, BF16, _plain("fp8_token", False), _plain("bf16", True, 64)],
                         ids=lambda v: v.name)
@pytest.mark.parametrize("late", [False, True])
def test_the_dq_argument_and_the_conversion(v, late):
    src = render_with_flags(v, bwd_dq_convert=True, bwd_dq_scale_late=late)
    assert rendered_params(src)["bwd_dq_convert"] is True
    names = [a["name"] for a in rendered_literal(src, "ARGS")]
    assert names[names.index("dv") + 1] == "dq"
    dq = next(a for a in rendered_literal(src, "ARGS") if a["name"] == "dq")
    assert dq == {"name": "dq", "dtype": "bfloat16", "shape": ["T", "HQ", "D"], "role": "out"}
    # the jit signature and the fake compile arguments take it in the same place
    call = method_source(src, "__call__")
    assert re.search(r"mdK: cute\.Tensor, mdV: cute\.Tensor,\n\s+mdQ: cute\.Tensor,", call)
    assert "dq_accum, dk, dv, dq_out, stream)" in src
    # the conversion is launched after the backward, on the same stream
    assert call.index(").launch(grid=[grid_x, 1, 1]") < call.index("self.dq_convert(mdQacc, mdQ,")
    conv = method_source(src, "dq_convert")
    fp8 = v.route != "bf16"
    assert ("mdOs" in conv) is (late and fp8)
    assert ("mul_rn(" in conv) is late
    if late and fp8:
        assert "& Uint32(255)" in conv and "if code == Uint32(255):" in conv  # the byte, and the NaN code's 1
    d = v.param("head_dim")
    assert f"k = tidx % {d // 8}" in conv and f"off = cute.assume(r * {d} + k * 8, divby=8)" in conv


@pytest.mark.parametrize("route,over", [("fp8_token", {"deterministic": True}), ("bf16", {"deterministic": True}),
                                        ("fp8_tensor", {}), ("mxfp8", {}), ("mxfp8_exact", {}), ("nvfp4_mixed", {})])
def test_refused_where_the_call_is_not_plain(route, over):
    v = next(x for x in BWD if x.route == route and x.param("head_dim") == 128
             and bool(dict(x.params).get("deterministic")) is bool(over.get("deterministic")))
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dq_convert_is_built_for_the_plain"):
        render_with_flags(v, bwd_dq_convert=True)


def test_refused_with_the_tile_copy():
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dq_convert_is_built_for_the_plain"):
        render_with_flags(FP8T, bwd_dq_convert=True, bwd_dq_tile_copy=True)


# ----------------------------------------------------------------------------- runtime
def _standins():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_flamia_bwd_standins_dqc", Path(__file__).resolve().parents[1] / "runtime" / "bwd_standins.py")
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)
    return bs


@pytest.mark.parametrize("poison", [False, True])
def test_run_attn_bwd_returns_the_calls_dq(poison):
    bs = _standins()
    src = render_with_flags(FP8T, **LATE)
    args, params = rendered_literal(src, "ARGS"), rendered_literal(src, "PARAMS")
    seen = {}

    def fn(*a):
        assert len(a) == len(args)
        seen.update({s["name"]: t for s, t in zip(args, a)})
        seen["dq_before"] = seen["dq"].clone()
        seen["dq"].fill_(0.5)  # the conversion's stand-in
    x = bs.fp8_inputs()
    dq, dk, dv, acc = run_attn_bwd(fn, args, **x, params=params, poison=poison)
    assert dq is seen["dq"] and dq.dtype == torch.bfloat16 and dq.shape == acc.shape
    assert bool((dq == 0.5).all())
    if poison:  # (without it the storage is uninitialised: nothing to assert)
        assert bool(seen["dq_before"].isnan().all())
    # without the flag the runtime converts the accumulator itself (with the late row factor: the tile's default)
    src0 = render_with_flags(FP8T, bwd_dq_convert=False)
    args0, params0 = rendered_literal(src0, "ARGS"), rendered_literal(src0, "PARAMS")
    assert params0["bwd_dq_scale_late"] is True
    fn0, seen0 = bs.recorder(args0)
    dq0, _, _, acc0 = run_attn_bwd(fn0, args0, **x, params=params0)
    assert "dq" not in seen0 and torch.equal(dq0, dq_from_accum(acc0, params0, 1.0 / 128 ** 0.5, x["do_scale"]))


# ----------------------------------------------------------------------------- compile
@pytest.mark.compile
@pytest.mark.parametrize("v", [FP8T, BF16], ids=lambda v: v.name)
def test_compile_the_conversion(v, compile_sm90, tmp_path):
    from flamia_gen.bench.sass import describe, function_sass, missing_tools

    if missing_tools():
        pytest.skip(missing_tools())
    compile_sm90(v, source=render_with_flags(v, **LATE))
    obj = str(tmp_path / f"{v.name}.o")
    d = describe(obj)
    assert d["functions"] == 2 and d["reg"] >= 128  # the attention kernel's registers, not the conversion's
    sass = function_sass(obj, "dq_convert")
    ops = [re.search(r"\*/\s+(?:@!?P\d\s+)?([A-Z][A-Z0-9_.]*)", x).group(1) for x in sass]
    rows = 64 // (128 // (v.param("head_dim") // 8))  # a thread's rows a CTA
    assert ops.count("LDG.E.128") == 2 * rows and ops.count("STG.E.128") == rows
    assert ops.count("F2FP.BF16.F32.PACK_AB") == 4 * rows
    assert not [o for o in ops if o.startswith("FMUL") and "FTZ" in o]
    assert ops.count("LDG.E.U8") == (rows if v.route != "bf16" else 0)
