"""The fp8_tensor backward (templates/sm90/attn_bwd.py.j2 with do5 / ds5 / dst): E5M2 dO and dS, dS scaled
per tensor from the call's amax, which a first launch of the same kernel (amax_pass = 1, `amax_sweep`)
max-reduces into ds_amax. CPU only: render, host wrapper (two launches, in order, around one zeroed
buffer), input checks, the kernel's E5M2 exponent rule against the quantizer contract, and a
cross-compile for sm_90a whose PTX must hold the mixed E4M3/E5M2 wgmmas and no dQ row amax.
The kernel's values are checked on the GPU by `flamia-gen verify --device cuda`."""

from __future__ import annotations

import ast

import pytest
import torch

from flamia_gen.numerics.formats import Format
from flamia_gen.numerics.quantize import pow2_exponent
from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, rendered_literals
from flamia_gen.runtime.attn_bwd import (check_bwd_inputs, is_do_e5m2_spec, is_ds_tensor_spec, num_work,
                                         run_attn_bwd)
from flamia_gen.spec import ExponentRule, load_specs


@pytest.fixture(scope="module")
def variants():
    plan = make_plan(load_specs(), routes=["fp8_tensor", "fp8_token"])
    return [v for v in plan.variants if v.kind.value == "attn_bwd"]


def _literals(src: str) -> dict:
    return rendered_literals(src, ("PARAMS", "ARGS"))


def _tensor_variant(variants, causal=True, det=False):
    return next(v for v in variants if v.route == "fp8_tensor" and v.param("causal") == causal
                and bool(dict(v.params).get("deterministic", False)) == det and v.param("head_dim") == 128)


def test_args_take_e5m2_do_and_the_amax_buffer(variants):
    lit = _literals(render_variant(_tensor_variant(variants)))
    spec = {a["name"]: a for a in lit["ARGS"]}
    assert spec["do"]["dtype"] == spec["do_t"]["dtype"] == "float8_e5m2"
    assert spec["q"]["dtype"] == spec["k_t"]["dtype"] == spec["v"]["dtype"] == "float8_e4m3fn"
    assert spec["ds_amax"] == {"name": "ds_amax", "dtype": "float32", "shape": ["2"], "role": "inout"}
    assert spec["amax_pass"] == {"name": "amax_pass", "dtype": "int32", "shape": [], "role": "scalar"}
    assert is_do_e5m2_spec(lit["ARGS"]) and is_ds_tensor_spec(lit["ARGS"])
    token = next(v for v in variants if v.route == "fp8_token")
    tok_args = _literals(render_variant(token))["ARGS"]
    assert not is_do_e5m2_spec(tok_args) and not is_ds_tensor_spec(tok_args)


def test_render_has_the_sweep_and_no_running_ds_references(variants):
    for v in (v for v in variants if v.route == "fp8_tensor"):
        src = render_variant(v)
        assert "def amax_sweep(" in src and "if amax_pass != 0:" in src
        assert "ds_exponent_e5m2(mDsAmax[0])" in src and "ds_exponent_e5m2(mDsAmax[1])" in src
        assert "run[rh] = e_k" in src  # dK's exponent is the tensor one
        # no per-row dQ amax and no running dK reference in the main pass
        assert "atomic_max(sAmax" not in src and "ds_exponent(quad_max_nan" not in src
        assert "self.convert_p(acc_S, tdKrdS, True)" in src
        assert ("(kk > qq)" in src) == v.param("causal")
    for v in (v for v in variants if v.route == "fp8_token"):
        src = render_variant(v)
        assert "amax_sweep" not in src and "Float8E5M2" not in src and "ds_amax" not in src


@pytest.mark.parametrize("amax", [0.0, 1e-30, 3.0, 57344.0, 57345.0, 1.75 * 2.0 ** 20, 1.7500001 * 2.0 ** 20,
                                  2.0 ** -126, 6e37, 2.0 ** 127 * 1.9])
def test_kernel_e5m2_exponent_rule_matches_the_quantizer_contract(variants, amax):
    """ds_exponent_e5m2 as rendered (the kernel's own function, run here on Python ints) = pow2_exponent(E5M2,
    ceil)."""
    import struct
    from types import SimpleNamespace

    src = render_variant(_tensor_variant(variants))
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "ds_exponent_e5m2")
    ns = dict(f32_bits=lambda x: struct.unpack("<I", struct.pack("<f", x))[0], Int32=int,
              Uint32=lambda x: x & 0xFFFFFFFF, cutlass=SimpleNamespace(min=min, max=max))
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "ds_exponent_e5m2", "exec"), ns)
    kernel = ns["ds_exponent_e5m2"](amax)
    e, _, _ = pow2_exponent(torch.tensor([amax], dtype=torch.float32), Format.e5m2, ExponentRule.ceil)
    if amax < 2.0 ** -126:  # subnormal amax: the kernel flushes to −127 (E5M2 codes of such a group are 0)
        assert kernel == -127
    else:
        assert kernel == int(e[0])


def _inputs():
    from tests.kernels.test_attn_bwd_template import _fp8_inputs

    return _fp8_inputs()  # uint8 codes and scales, T = 40, HQ = 4, HKV = 2, D = 128


def test_check_inputs_takes_e5m2_do_only_when_asked():
    x = _inputs()
    x.update(do=x["do"].view(torch.float8_e5m2), do_t=x["do_t"].view(torch.float8_e5m2))
    assert check_bwd_inputs(**x, fp8=True, do_e5m2=True) == (40, 4, 2, 128)
    with pytest.raises(ValueError, match="do: dtype"):
        check_bwd_inputs(**x, fp8=True)  # an E4M3 kernel refuses E5M2 codes
    y = _inputs()
    y.update(do=y["do"].view(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="do: dtype"):
        check_bwd_inputs(**y, fp8=True, do_e5m2=True)


def test_run_attn_bwd_launches_the_sweep_then_the_main_pass(variants):
    v = _tensor_variant(variants)
    lit = _literals(render_variant(v))
    calls = []

    def fn(*a):
        by = dict(zip([x["name"] for x in lit["ARGS"]], a))
        calls.append((by["amax_pass"], by["ds_amax"], by["ds_amax"].clone(), by))
        by["ds_amax"].fill_(7.0)  # what launch 1 leaves behind: launch 2 must see it (no re-zeroing)

    dq, dk, dv, acc = run_attn_bwd(fn, lit["ARGS"], **_inputs(), params=lit["PARAMS"], poison=True)
    assert [c[0] for c in calls] == [1, 0]
    assert calls[0][1] is calls[1][1]  # one buffer for both launches
    assert torch.equal(calls[0][2], torch.zeros(2)) and torch.equal(calls[1][2], torch.full((2,), 7.0))
    by = calls[1][3]
    assert by["do"].dtype == torch.float8_e5m2 and by["do_t"].dtype == torch.float8_e5m2
    assert by["q"].dtype == torch.float8_e4m3fn and by["dk"] is dk and by["dq_accum"] is acc
    assert by["work"].shape == (num_work(40, 2, 128), 3)
    # the next call starts from a fresh zeroed buffer
    calls.clear()
    run_attn_bwd(fn, lit["ARGS"], **_inputs(), params=lit["PARAMS"])
    assert torch.equal(calls[0][2], torch.zeros(2))


@pytest.mark.compile
def test_compile_fp8_tensor_variant(variants, compile_sm90):
    ptx = compile_sm90(_tensor_variant(variants))
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in ptx  # Sᵀ = K·Qᵀ
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e5m2" in ptx  # dPᵀ = V·dOᵀ
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e5m2" in ptx  # dV = Pᵀ·dO
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e4m3" in ptx  # dK = dSᵀ·Q
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e5m2.e4m3" in ptx  # dQ = dS·K
    assert "cvt.rn.satfinite.e5m2x2.f32" in ptx
    assert "atom.global.max.u32" in ptx or "red.global.max.u32" in ptx  # the sweep's two maxima
    assert "atom.shared.max.u32" not in ptx  # no per-row dQ amax
