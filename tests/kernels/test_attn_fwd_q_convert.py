"""fwd_q_convert (experiment flag of templates/sm90/attn_fwd.py.j2; docs/kernels/attn_fwd.md "Where the end-to-end
forward stands"): the kernel takes BF16 q and converts each unit's Q tile itself with the quantizer contract's
per-token E4M3 formulas, so a forward-only call runs no Q quantizer launch. CPU checks: where the flag is taken and
refused, the default renders untouched, the ARGS, the contract formulas (the same text as the quantizer's), and the
runtime's input assembly; the compile test builds it for sm_90a. The GPU check (codes and O bitwise equal to the
two-launch path) is `fwd_experiments run` with tag `qconv` (not yet run)."""

from __future__ import annotations

import pytest
import torch

from flamia_gen.bench.fwd_experiments import experiment_variants
from flamia_gen.plan import make_plan
from flamia_gen.render.render import HEADER, _environment, render_variant, templates_dir
from flamia_gen.runtime.attention import assemble_forward_inputs
from flamia_gen.spec import load_specs

VARIANTS = [v for v in make_plan(load_specs()).variants if v.kind.value == "attn_fwd" and v.arch.value == "sm90"]
TOKEN = [v for v in VARIANTS if v.route == "fp8_token"]


def _render_with(v, **extra) -> str:
    body = _environment(templates_dir()).get_template(v.template).render(**dict(v.context, **extra))
    return HEADER.format(template=v.template, name=v.name, spec_hash=v.spec_hash) + body


def _args(src: str) -> list[dict]:
    from flamia_gen.build.bundle import _module_literal

    return _module_literal(src, "ARGS")


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_off_by_default(v):
    src = render_variant(v)
    assert "fwd_q_convert" not in src and "q_exponent" not in src
    if v.route == "fp8_token":
        assert _render_with(v, fwd_q_convert=False) == src


@pytest.mark.parametrize("route", ["fp8_tensor", "mxfp8", "mxfp8_exact", "bf16", "fp8_pv", "nvfp4_mixed"])
def test_refused_where_q_is_not_per_token_e4m3(route):
    v = next(v for v in VARIANTS if v.route == route)
    with pytest.raises(Exception, match="fwd_q_convert_needs_e4m3_per_token_q"):
        _render_with(v, fwd_q_convert=True)


@pytest.mark.parametrize("v", TOKEN, ids=lambda v: v.name)
def test_rendered_kernel_takes_bf16_q(v):
    src = _render_with(v, fwd_q_convert=True)
    compile(src, v.name, "exec")
    args = _args(src)
    names = [a["name"] for a in args]
    assert "q_scale" not in names and args[0] == {"name": "q", "dtype": "bfloat16", "shape": ["T", "HQ", "D"],
                                                  "role": "in"}
    assert names[1:] == [a["name"] for a in _args(render_variant(v))][2:]  # the rest unchanged
    assert '"fwd_q_convert": True' in src and "mQs" not in src
    assert "sQb_layout = make_smem_layout(BFloat16, (m, d))" in src and "self.bytes_q = m * d * 2" in src
    # the conversion: 2 threads per row, D/2 elements each in 16-byte chunks (amax pass, then codes), amax shared
    # with the partner, codes to sQ, code to sQc, acc_O zeroed after it
    ch = v.param("head_dim") // 16
    assert src.count(f"cute.local_tile(sQb, (1, 8), (qr, qh * {ch} + c))") == 2
    assert f"cute.local_tile(sQ, (1, 8), (qr, qh * {ch} + c))" in src and "sQc[qr] = Int32(qcode)" in src
    assert src.index("qcode, qmult, qnan, qzero = q_exponent(qa)") < src.index("acc_O.fill(0.0)  # (after")
    assert "shuffle_sync_bfly(qa, offset=1)" in src and 'fence_proxy("async.shared", space="cta")' in src
    assert "row_q[rh] = bits_f32(Uint32(qc) << Uint32(23)) * scale_log2" in src


def _fn_body(src: str, name: str) -> list[str]:
    i = src.index(f"def {name}(")
    body = src[i:src.index("\n\n\n", i)].splitlines()[1:]
    # code lines only, the contract's constants substituted (quant_body is generic over the format)
    return [ln.strip() for ln in body if ln.strip() and not ln.strip().startswith(("#", '"""', "fwd_q_convert",
                                                                                  "`exponent`"))]


def test_exponent_is_the_quantizers_contract():
    """q_exponent is line for line the E4M3 ceil `exponent` of the token quantizer the forward would launch."""
    from pathlib import Path

    fwd = _render_with(TOKEN[0], fwd_q_convert=True)
    qsrc = Path(__file__).resolve().parents[2] / "generated" / "sm90" / "quant_sm90_e4m3_tok_ceil_d128_t128_h1.py"
    ref = _fn_body(qsrc.read_text(), "exponent")
    got = _fn_body(fwd, "q_exponent")
    assert len(ref) == 11 and got == ref


def test_experiment_copies():
    tags = [(t, v.name) for t, v in experiment_variants(("qconv",), route="fp8_token") if t]
    assert len(tags) == len(TOKEN) and all(n.endswith("_xqconv") for _, n in tags)
    for route in ("fp8_tensor", "mxfp8", "bf16"):
        assert experiment_variants(("qconv",), route=route) == experiment_variants((), route=route)


def test_runtime_assembly_passes_bf16_q_and_launches_no_q_quantizer():
    v = TOKEN[0]
    params = dict(v.params, fwd_q_convert=True)
    q = torch.randn(40, 4, 128).to(torch.bfloat16)
    k = torch.randn(40, 2, 128).to(torch.bfloat16)
    launched = []

    def quant(x, op, per_token):
        launched.append(op)
        T, H = x.shape[:2]
        return dict(codes=torch.zeros(T, H, 128, dtype=torch.uint8), scales=torch.zeros(T, H, dtype=torch.uint8),
                    codes_t=torch.zeros(H, 128, 48, dtype=torch.uint8))

    ins = assemble_forward_inputs(params, q, k, k.clone(), quant)
    assert launched == ["k", "v"] and ins["q"].dtype == torch.bfloat16 and torch.equal(ins["q"], q)
    assert "q_scale" not in ins and ins["k_scale"].shape == (40, 2)


@pytest.mark.compile
def test_compile_q_convert(compile_sm90):
    v = next(v for v in TOKEN if v.param("causal") and v.param("head_dim") == 128 and v.param("tile_m") == 192)
    ptx = compile_sm90(v, source=_render_with(v, fwd_q_convert=True))
    assert "fence.proxy.async.shared::cta" in ptx and "max.u32" in ptx and "mul.rn.f32" in ptx


@pytest.mark.parametrize("name", ["f32_bits", "umax", "usel", "mul_rn"])
def test_helpers_are_the_quantizers_ptx(name):
    """The scalar helpers the conversion uses emit the quantizer's very PTX (so no compiler flag can change a bit);
    pack_e4m3x4 is the quantizer's cvt_e4m3x4 (same two cvt.rn.satfinite.e4m3x2.f32, byte i = input i)."""
    from pathlib import Path

    fwd = _render_with(TOKEN[0], fwd_q_convert=True)
    qsrc = (Path(__file__).resolve().parents[2] / "generated" / "sm90" / "quant_sm90_e4m3_tok_ceil_d128_t128_h1.py")
    assert _fn_body(fwd, name) == _fn_body(qsrc.read_text(), name)
    strings = lambda src, fn: [ln for ln in _fn_body(src, fn) if '"' in ln and "cvt" in ln]
    assert strings(fwd, "pack_e4m3x4") == strings(qsrc.read_text(), "cvt_e4m3x4")


def _literals(src: str) -> dict:
    from flamia_gen.build.bundle import _module_literal

    return {n: _module_literal(src, n) for n in ("ARGS", "PARAMS")}


def _qconv_inputs(T=40, HQ=4, HKV=2, D=128):
    return dict(q=torch.randn(T, HQ, D).to(torch.bfloat16), k=torch.zeros(T, HKV, D, dtype=torch.uint8),
                v=torch.zeros(HKV, D, 48, dtype=torch.uint8), k_scale=torch.full((T, HKV), 127, dtype=torch.uint8),
                v_scale=torch.full((T, HKV), 127, dtype=torch.uint8), cu_seqlens=torch.tensor([0, 17, T]).int())


def test_fwd_mode_and_run_attn_fwd_pass_bf16_q_in_args_order():
    """The first GPU run (2026-12-04) stopped here: run_attn_fwd took the kernel for an fp8 one and refused BF16 q.
    A recording fake kernel: q as given (BF16), K and Vᵀ viewed as E4M3, no q_scale anywhere."""
    from flamia_gen.runtime.attn_fwd import fwd_mode, run_attn_fwd

    v = next(v for v in TOKEN if v.param("causal") and v.param("head_dim") == 128)
    lit = _literals(_render_with(v, fwd_q_convert=True))
    assert fwd_mode(lit["ARGS"]) == "q_bf16" and fwd_mode(_literals(render_variant(v))["ARGS"]) == "fp8"
    x, seen = _qconv_inputs(), []
    o, lse = run_attn_fwd(lambda *a: seen.extend(a), lit["ARGS"], x["q"], x["k"], x["v"], k_scale=x["k_scale"],
                          v_scale=x["v_scale"], cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"], poison=True)
    names = [a["name"] for a in lit["ARGS"]]
    got = dict(zip(names, seen))
    assert len(seen) == len(names) and "q_scale" not in got
    assert got["q"] is x["q"] and got["k"].dtype == torch.float8_e4m3fn and got["v_t"].dtype == torch.float8_e4m3fn
    assert got["k_scale"] is x["k_scale"] and got["v_scale"] is x["v_scale"] and got["o"] is o


@pytest.mark.parametrize("mutate, match", [
    (lambda x: x.update(q=torch.zeros(40, 4, 128, dtype=torch.uint8)), "q: dtype torch.uint8 not in .*bfloat16"),
    (lambda x: x.update(q_scale=torch.zeros(40, 4, dtype=torch.uint8)), "q_scale: this variant converts BF16 q"),
    (lambda x: x.update(k=torch.zeros(40, 2, 128, dtype=torch.bfloat16)), "k: dtype"),
    (lambda x: x.update(k_scale=None), "k_scale: expected a torch.Tensor"),
    (lambda x: x.update(v_scale=torch.zeros(40, 4, dtype=torch.uint8)), r"v_scale: shape \(40, 4\)"),
])
def test_run_attn_fwd_q_convert_input_checks(mutate, match):
    from flamia_gen.runtime.attn_fwd import run_attn_fwd

    v = next(v for v in TOKEN if v.param("causal") and v.param("head_dim") == 128)
    lit = _literals(_render_with(v, fwd_q_convert=True))
    x = _qconv_inputs()
    mutate(x)
    kw = {n: x[n] for n in ("q_scale", "k_scale", "v_scale") if n in x}
    with pytest.raises(ValueError, match=match):
        run_attn_fwd(lambda *a: None, lit["ARGS"], x["q"], x["k"], x["v"], cu_seqlens=x["cu_seqlens"],
                     params=lit["PARAMS"], **kw)


def test_timed_inputs_not_shared_with_the_base():
    """fwd_experiments times a copy with its base's cached input sets: a q_convert copy needs its own (BF16 q)."""
    from flamia_gen.verify.attn_gpu import timed_inputs_key

    p = dict(TOKEN[0].params)
    base = timed_inputs_key("fp8_token", [4096] * 4, 16, p)
    assert timed_inputs_key("fp8_token", [4096] * 4, 16, dict(p, fwd_q_convert=True)) != base
    assert timed_inputs_key("fp8_token", [4096] * 4, 16, dict(p, fwd_fused_exp=True)) == base
