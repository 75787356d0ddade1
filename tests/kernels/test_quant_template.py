"""The fused quantizer templates (templates/sm90|sm100/quant.py.j2) and its host wrapper.

CPU only. Rendering tests use the build stage's jinja2 settings; `compile` tests cross-
compile real variants with the CuTe DSL in a subprocess (the arch is read at import) and
check the PTX for the converts and divisions the contract fixes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2
import pytest
import torch

from flamia_gen.render.render import rendered_literals
from flamia_gen.runtime.quant import allocate_outputs, check_quant_inputs, shape_of

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "templates"

# (fmt, granularity, exponent_rule) pairs that routes in specs/ use for q, k, v, do
SPEC_COMBOS = [("e4m3", "tensor", "ceil"), ("e5m2", "tensor", "ceil"), ("e4m3", "token", "ceil"),
               ("e4m3", "token_block", "ceil"), ("e4m3", "block1d_32", "floor"),
               ("e4m3", "token_block", "floor"), ("e2m1", "nvfp4", "ceil")]


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def make_context(arch="sm90", fmt="e4m3", granularity="token", exponent_rule="ceil", hadamard=False,
                 head_dim=128, tokens_per_cta=32, heads_per_cta=1, with_delta=None) -> dict:
    """with_delta=None leaves the key out (the template defaults it to False)."""
    had = "_had" if hadamard else ""
    op = "do_delta" if with_delta else "q"
    name = f"quant_{arch}_{fmt}_{granularity}_{exponent_rule}{had}_{op}_d{head_dim}_t{tokens_per_cta}_h{heads_per_cta}"
    ctx = dict(name=name, arch=arch, cute_arch={"sm90": "sm_90a", "sm100": "sm_100a"}[arch], kind="quant",
               route="test_route", operand="do" if with_delta else "q", fmt=fmt, granularity=granularity,
               exponent_rule=exponent_rule, hadamard=hadamard, head_dim=head_dim, tokens_per_cta=tokens_per_cta,
               heads_per_cta=heads_per_cta, write_transposed=fmt != "e2m1", sm_count=132 if arch == "sm90" else 148,
               spec_hash="0123456789abcdef", flamia_version="0.1.0")
    if with_delta is not None:
        ctx["with_delta"] = with_delta
    return ctx


def render(ctx: dict) -> str:
    return _env().get_template(f"{ctx['arch']}/quant.py.j2").render(**ctx)


def _module_literals(src: str) -> dict:
    return rendered_literals(src, ("NAME", "ARCH", "PARAMS", "ARGS"))


def _representative():
    for arch in ("sm90", "sm100"):
        for fmt, g, rule in SPEC_COMBOS:
            for d in (64, 128):
                yield make_context(arch, fmt, g, rule, False, d, 32, 1)
        yield make_context(arch, "e4m3", "token_block", "ceil", True, 128, 64, 2 if arch == "sm90" else 1)
        yield make_context(arch, "e2m1", "nvfp4", "ceil", True, 64, 128, 4)
        yield make_context(arch, "e5m2", "block1d_32", "ceil", True, 64, 64, 2)


REPRESENTATIVE = list(_representative())

# (fmt, granularity, exponent_rule) of the dO operand in specs/: the dO launch (with_delta)
DO_COMBOS = [("e5m2", "tensor", "ceil"), ("e4m3", "token", "ceil"), ("e4m3", "token_block", "ceil"),
             ("e4m3", "block1d_32", "floor")]
DELTA_REPRESENTATIVE = [make_context(arch, fmt, g, rule, False, d, t, 1, with_delta=True)
                        for arch in ("sm90", "sm100") for fmt, g, rule in DO_COMBOS for d in (64, 128)
                        for t in (32, 64)]


@pytest.mark.parametrize("ctx", REPRESENTATIVE, ids=lambda c: c["name"])
def test_render_is_deterministic_python(ctx):
    a, b = render(ctx), render(dict(ctx))
    assert a == b
    compile(a, f"{ctx['name']}.py", "exec")
    lit = _module_literals(a)
    assert lit["NAME"] == ctx["name"] and lit["ARCH"] == ctx["cute_arch"]
    assert lit["PARAMS"]["granularity"] == ctx["granularity"]
    assert "def compile_args()" in a and "def can_implement(" in a
    for banned in ("/work/", "/tmp/", "import os", "import torch"):
        assert banned not in a


@pytest.mark.parametrize("ctx", REPRESENTATIVE, ids=lambda c: c["name"])
def test_args_shapes_evaluate(ctx):
    args = _module_literals(render(ctx))["ARGS"]
    names = [a["name"] for a in args]
    assert names[:4] == ["x", "cu_seqlens", "codes", "scales"]
    T, H, D, nd = 37, 3, ctx["head_dim"], 5
    shapes = {a["name"]: shape_of(a["shape"], T, H, D, nd) for a in args}
    assert shapes["x"] == (T, H, D) and shapes["cu_seqlens"] == (nd + 1,)
    g = ctx["granularity"]
    assert shapes["codes"] == ((T, H, D // 2) if ctx["fmt"] == "e2m1" else (T, H, D))
    assert shapes["scales"] == {"tensor": (1,), "token": (T, H), "token_block": (T, H),
                                "block1d_32": (T, H, D // 32), "nvfp4": (T, H, D // 16)}[g]
    assert ("codes_t" in shapes) == (ctx["fmt"] != "e2m1")
    if "codes_t" in shapes:
        assert shapes["codes_t"] == (H, D, 48)
    assert ("tensor_scale" in shapes) == (g == "nvfp4")
    assert ("amax_ws" in shapes) == (g in ("tensor", "nvfp4"))


def test_allocate_outputs_poison():
    args = _module_literals(render(make_context(fmt="e2m1", granularity="nvfp4")))["ARGS"]
    outs = allocate_outputs(args, 5, 2, 128, 1, "cpu", poison=True)
    assert set(outs) == {"codes", "scales", "tensor_scale", "amax_ws"}
    assert (outs["codes"] == 0xAB).all() and outs["codes"].shape == (5, 2, 64)
    assert outs["tensor_scale"].view(torch.int32).item() == 0xABABABAB - 2 ** 32
    assert outs["amax_ws"].item() == 0


@pytest.mark.parametrize("T", [5, 16, 33])
def test_allocate_outputs_token_codes_hold_t_pad_rows(T):
    """(T, H, D) codes live in storage of T_pad rows (the tail zero): the forward's row-permuting K TMA
    (k_row_perm) reads whole 16-token groups, and attn_fwd.k_rows_for_tma then passes K without a copy."""
    from flamia_gen.runtime.attn_fwd import k_rows_for_tma

    args = _module_literals(render(make_context(fmt="e4m3", granularity="token")))["ARGS"]
    for poison in (False, True):
        outs = allocate_outputs(args, T, 2, 128, 1, "cpu", poison=poison)
        codes, t_pad = outs["codes"], -(-T // 16) * 16
        assert codes.shape == (T, 2, 128) and codes.is_contiguous() and codes.storage_offset() == 0
        assert codes.untyped_storage().nbytes() == t_pad * 2 * 128
        full = torch.empty(0, dtype=codes.dtype).set_(codes.untyped_storage()).view(t_pad, 2, 128)
        assert (full[T:] == 0).all()  # the rows past T: read by the TMA, masked by the kernel, zero
        if poison:
            assert (codes == 0xAB).all()
        assert k_rows_for_tma(codes, t_pad) is codes
        assert outs["scales"].untyped_storage().nbytes() == T * 2  # only the codes are padded


def _x(T=8, H=2, D=128, dtype=torch.bfloat16):
    return torch.zeros(T, H, D, dtype=dtype)


def _cu(*v, dtype=torch.int32):
    return torch.tensor(v, dtype=dtype)


def test_check_quant_inputs_ok():
    assert check_quant_inputs(_x(), _cu(0, 3, 8)) == (8, 2, 128, 2)


@pytest.mark.parametrize("x, cu, match", [
    (_x(dtype=torch.float16), _cu(0, 8), "x must be bfloat16"),
    (_x().transpose(0, 1), _cu(0, 8), "x must be contiguous"),
    (_x(D=96), _cu(0, 8), "head dim D=96"),
    (torch.zeros(8, 128, dtype=torch.bfloat16), _cu(0, 8), "x must be 3-D"),
    (_x(), _cu(0, 8, dtype=torch.int64), "cu_seqlens must be int32"),
    (_x(), _cu(0, 8).view(1, 2), "cu_seqlens must be 1-D"),
    (_x(), _cu(1, 8), r"cu_seqlens\[0\] must be 0"),
    (_x(), _cu(0, 7), r"cu_seqlens\[-1\] must equal T"),
    (_x(), "0,8", "cu_seqlens must be a torch.Tensor"),
])
def test_check_quant_inputs_errors(x, cu, match):
    with pytest.raises(ValueError, match=match):
        check_quant_inputs(x, cu)


def test_check_quant_inputs_device():
    x = _x()
    cu = _cu(0, 8).to("meta")
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        check_quant_inputs(x, cu)


def test_runtime_imports_without_dsl():
    code = ("import sys; sys.modules['cutlass'] = None; "
            "import flamia_gen.runtime.quant, flamia_gen.verify.quant_gpu; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# ----------------------------------------------------------------------------- compile
_COMPILE_SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, sys, glob
    path, name = sys.argv[1], sys.argv[2]
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
    import cutlass.cute as cute
    fn, args = m.compile_args()
    c = cute.compile(fn, *args, options="--enable-tvm-ffi --keep-ptx")
    c.export_to_c(name + ".o", function_name=name)
    ptx = "".join(open(p).read() for p in glob.glob("*.ptx"))
    print(json.dumps({"ok": True, "o_bytes": os.path.getsize(name + ".o"), "ptx": ptx}))
""")


def _dsl_available() -> bool:
    try:
        import cutlass  # noqa: F401
        return True
    except Exception:
        return False


def _compile(ctx: dict, tmp_path: Path) -> dict:
    src = render(ctx)
    path = tmp_path / f"{ctx['name']}.py"
    path.write_text(src)
    env = dict(os.environ, CUTE_DSL_ARCH=ctx["cute_arch"])
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(path), ctx["name"]], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


COMPILE_CASES = [
    make_context("sm90", "e4m3", "token", "ceil", False, 128, 32, 1),
    make_context("sm90", "e4m3", "token_block", "ceil", True, 64, 64, 2),
    make_context("sm90", "e2m1", "nvfp4", "ceil", False, 128, 32, 1),
    make_context("sm100", "e5m2", "tensor", "ceil", False, 128, 64, 1),
    make_context("sm100", "e2m1", "nvfp4", "ceil", False, 64, 32, 1),
]


@pytest.mark.compile
@pytest.mark.skipif(not _dsl_available(), reason="needs nvidia-cutlass-dsl")
@pytest.mark.parametrize("ctx", COMPILE_CASES, ids=lambda c: c["name"])
def test_compile_and_export(ctx, tmp_path):
    res = _compile(ctx, tmp_path)
    assert res["ok"] and res["o_bytes"] > 0
    ptx = res["ptx"]
    assert f".target {ctx['cute_arch']}" in ptx
    assert "ld.global.v4" in ptx  # 16-byte loads
    if ctx["fmt"] == "e2m1":
        assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # E4M3 block scales
        assert ("cvt.rn.satfinite.e2m1x2.f32" in ptx) == (ctx["arch"] == "sm100")
    else:
        assert f"cvt.rn.satfinite.{ctx['fmt']}x2.f32" in ptx
        assert "st.global.v4" in ptx  # 16-byte stores (codes and codes_t)
    assert ".ftz" not in ptx  # subnormals kept everywhere


# ----------------------------------------------------------------------------- dO launch (with_delta)
@pytest.mark.parametrize("ctx", DELTA_REPRESENTATIVE, ids=lambda c: c["name"])
def test_delta_render_is_deterministic_and_args(ctx):
    a, b = render(ctx), render(dict(ctx))
    assert a == b
    compile(a, f"{ctx['name']}.py", "exec")
    lit = _module_literals(a)
    assert lit["PARAMS"]["with_delta"] is True
    args = lit["ARGS"]
    names = [x["name"] for x in args]
    want = ["x", "cu_seqlens", "o", "codes", "scales", "codes_t"]
    if ctx["granularity"] == "tensor":
        want.append("amax_ws")
    assert names == want + ["delta", "dq_accum"]
    roles = {x["name"]: (x["dtype"], x["role"]) for x in args}
    assert roles["o"] == ("bfloat16", "in")
    assert roles["delta"] == ("float32", "out") and roles["dq_accum"] == ("float32", "out")
    T, H, D = 37, 3, ctx["head_dim"]
    shapes = {x["name"]: shape_of(x["shape"], T, H, D, 5) for x in args}
    assert shapes["o"] == (T, H, D) and shapes["delta"] == (H, T) and shapes["dq_accum"] == (T, H, D)
    # the launcher and the fake compile args follow ARGS
    assert "mX: cute.Tensor, mCu: cute.Tensor, mO: cute.Tensor, mCodes" in a
    assert "mDelta: cute.Tensor, mDqAcc: cute.Tensor," in a
    assert "args = (x, cu, o, codes, scales, codes_t" in a and "delta, dq_accum, stream)" in a


@pytest.mark.parametrize("ctx", REPRESENTATIVE, ids=lambda c: c["name"])
def test_plain_variants_unchanged_by_delta(ctx):
    """with_delta=False renders exactly as before the flag existed (PARAMS aside): the 40
    sm90 variants verified on the H200 keep their kernels."""
    a = render(ctx)
    b = render(dict(ctx, with_delta=False))
    assert a == b
    lit = _module_literals(a)
    assert lit["PARAMS"]["with_delta"] is False
    assert not {"o", "delta", "dq_accum"} & {x["name"] for x in lit["ARGS"]}
    for marker in ("mDelta", "mDqAcc", "lane_delta", "group_sum", "dec_e"):
        assert marker not in a


@pytest.mark.parametrize("kw", [dict(fmt="e2m1", granularity="nvfp4"), dict(hadamard=True)])
def test_delta_render_refuses_fp4_and_hadamard(kw):
    with pytest.raises(jinja2.UndefinedError, match="with_delta_needs_an_8bit_format_without_hadamard"):
        render(make_context(with_delta=True, **kw))


def _delta_args():
    return _module_literals(render(make_context("sm90", "e4m3", "token", "ceil", with_delta=True)))["ARGS"]


def test_allocate_outputs_delta_poison():
    outs = allocate_outputs(_delta_args(), 5, 2, 128, 1, "cpu", poison=True)
    assert set(outs) == {"codes", "scales", "codes_t", "delta", "dq_accum"}
    assert outs["delta"].shape == (2, 5) and outs["delta"].dtype == torch.float32
    assert outs["dq_accum"].shape == (5, 2, 128) and outs["dq_accum"].dtype == torch.float32
    assert (outs["dq_accum"].view(torch.int32) == 0xABABABAB - 2 ** 32).all()  # the kernel must zero it
    assert (outs["delta"].view(torch.int32) == 0xABABABAB - 2 ** 32).all()


def test_run_quantizer_passes_o_in_args_order():
    from flamia_gen.runtime.quant import run_quantizer, takes_o

    args = _delta_args()
    assert takes_o(args) and not takes_o(_module_literals(render(make_context()))["ARGS"])
    x, o, cu = _x(T=8, H=2), torch.ones(8, 2, 128, dtype=torch.bfloat16), _cu(0, 3, 8)
    seen = []
    outs = run_quantizer(lambda *t: seen.extend(t), args, x, cu, o=o)
    assert [tuple(t.shape) for t in seen] == [(8, 2, 128), (3,), (8, 2, 128), (8, 2, 128), (8, 2), (2, 128, 16),
                                              (2, 8), (8, 2, 128)]
    assert seen[0] is x and seen[1] is cu and seen[2] is o
    assert seen[6] is outs["delta"] and seen[7] is outs["dq_accum"]


@pytest.mark.parametrize("o, match", [
    (None, "dO launch .*pass o"),
    (torch.ones(8, 2, 128, dtype=torch.float32), "o must be bfloat16"),
    (torch.ones(8, 2, 64, dtype=torch.bfloat16), r"o has shape \(8, 2, 64\)"),
    (torch.ones(8, 128, 2, dtype=torch.bfloat16).transpose(1, 2), "o must be contiguous"),
    ("o", "o must be a torch.Tensor"),
])
def test_run_quantizer_delta_input_errors(o, match):
    from flamia_gen.runtime.quant import run_quantizer

    with pytest.raises(ValueError, match=match):
        run_quantizer(lambda *t: None, _delta_args(), _x(T=8, H=2), _cu(0, 8), o=o)


def test_run_quantizer_refuses_o_for_plain_variant():
    from flamia_gen.runtime.quant import run_quantizer

    args = _module_literals(render(make_context()))["ARGS"]
    with pytest.raises(ValueError, match="does not take it"):
        run_quantizer(lambda *t: None, args, _x(T=8, H=2), _cu(0, 8), o=torch.ones(8, 2, 128, dtype=torch.bfloat16))


DELTA_COMPILE_CASES = [
    make_context("sm90", "e4m3", "token_block", "ceil", False, 128, 64, 1, with_delta=True),
    make_context("sm100", "e5m2", "tensor", "ceil", False, 64, 32, 1, with_delta=True),
]


@pytest.mark.compile
@pytest.mark.skipif(not _dsl_available(), reason="needs nvidia-cutlass-dsl")
@pytest.mark.parametrize("ctx", DELTA_COMPILE_CASES, ids=lambda c: c["name"])
def test_compile_delta_variant(ctx, tmp_path):
    res = _compile(ctx, tmp_path)
    assert res["ok"] and res["o_bytes"] > 0
    ptx = res["ptx"]
    assert f".target {ctx['cute_arch']}" in ptx
    fmt = ctx["fmt"]
    assert f"cvt.rn.satfinite.{fmt}x2.f32" in ptx and f"cvt.rn.f16x2.{fmt}x2" in ptx  # encode, exact decode
    assert "add.rn.f32" in ptx and "mul.rn.f32" in ptx and "shfl.sync.bfly" in ptx
    assert "fma.rn.f32" not in ptx and ".ftz" not in ptx  # mul + add, never contracted, subnormals kept
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx  # x and o loads; codes and dq_accum stores


def _emulator_kernel(oq, zero_dq=True, sum_delta=False):
    """A stand-in kernel on CPU: fills the delta ARGS outputs from the emulator."""
    from flamia_gen.numerics import delta_from_quantized, quantize

    def fn(x, cu, o, codes, scales, codes_t, delta, dq_accum):
        q = quantize(x, oq, cu)
        codes.copy_(q.codes), scales.copy_(q.scales), codes_t.copy_(q.codes_t)
        if sum_delta:  # a plain sum: right value, wrong order
            delta.copy_((q.dequantize() * o.float()).sum(-1).T)
        else:
            delta.copy_(delta_from_quantized(q, o))
        if zero_dq:
            dq_accum.zero_()
    return fn


@pytest.mark.parametrize("zero_dq, sum_delta, bad", [(True, False, set()), (False, False, {"dq_accum"}),
                                                     (True, True, {"delta"})])
def test_verify_quantizer_delta_fields_on_cpu(monkeypatch, zero_dq, sum_delta, bad):
    import flamia_gen.verify.quant_gpu as vq
    from flamia_gen.spec.route import OperandQuant

    real_make_input, real_make_o = vq.make_input, vq.make_o
    monkeypatch.setattr(vq, "make_input", lambda *a, **k: real_make_input(*a, **dict(k, device="cpu")))
    monkeypatch.setattr(vq, "make_o", lambda *a, **k: real_make_o(*a, **dict(k, device="cpu")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    oq = OperandQuant(format="e4m3", granularity="token", exponent_rule="ceil")
    rows = vq.verify_quantizer(_emulator_kernel(oq, zero_dq, sum_delta), _delta_args(), oq, T=300, H=2, D=128)
    fields = {r["field"] for r in rows}
    assert {"codes", "scales", "codes_t", "delta", "dq_accum"} == fields
    assert len(rows) == 5 * len(vq.KINDS)
    failing = {r["field"] for r in rows if not r["ok"]}
    assert failing == bad
    # NaN rows (nan_inf input) compare equal whatever their payload
    assert all(r["ok"] for r in rows if r["field"] == "delta" and r["kind"] == "nan_inf") or "delta" in bad


def test_allocate_outputs_plan_cache_per_args_and_sizes():
    """The output plan is cached on (ARGS object, sizes): fresh tensors every call, new sizes give new shapes, and
    another ARGS object (even an equal-looking one with other shapes) never reads the cached plan."""
    args = _module_literals(render(make_context(fmt="e4m3", granularity="token")))["ARGS"]
    a, b = allocate_outputs(args, 40, 2, 128, 1, "cpu"), allocate_outputs(args, 40, 2, 128, 1, "cpu")
    assert {n: t.shape for n, t in a.items()} == {n: t.shape for n, t in b.items()}
    assert all(a[n].data_ptr() != b[n].data_ptr() for n in a)
    assert allocate_outputs(args, 64, 3, 64, 2, "cpu")["codes"].shape == (64, 3, 64)
    other = [dict(e, shape=["T", "H"]) if e["name"] == "codes" else e for e in args]
    assert allocate_outputs(other, 40, 2, 128, 1, "cpu")["codes"].shape == (40, 2)
    assert allocate_outputs(args, 40, 2, 128, 1, "cpu")["codes"].shape == (40, 2, 128)


@pytest.mark.parametrize("ctx", REPRESENTATIVE, ids=lambda c: c["name"])
def test_codes_stub_exactly_where_codes_t_is_written(ctx):
    """A quantizer that writes codes_t stores row-major codes only for tokens below the codes tensor's first mode
    (TC), and says so in PARAMS (codes_stub): the runtime stubs V's codes on forward-only calls only for such a
    kernel. The scales are stored for every token either way (the forward reads V's per-token exponents)."""
    src = render(ctx)
    lit = _module_literals(src)
    wt = lit["PARAMS"]["write_transposed"]
    assert lit["PARAMS"].get("codes_stub", False) is wt
    assert ("cute.size(mCodes, mode=[0])" in src) is wt and ("if t < TC:" in src) is wt
    if wt:
        lines = src.splitlines()
        i = next(n for n, ln in enumerate(lines) if ln.strip() == "if t < TC:")
        indent = len(lines[i]) - len(lines[i].lstrip())
        assert lines[i + 3].strip() == "cute.autovec_copy(cw, dst)"  # the codes store, under the predicate
        assert all(len(ln) - len(ln.lstrip()) == indent + 4 for ln in lines[i + 1:i + 4])
        if ctx["granularity"] == "token":  # the per-token scale: beside the predicate, not under it
            sc = next(n for n in range(i, len(lines)) if "mScales.iterator[row] = " in lines[n])
            assert lines[sc - 1].strip() == "if k == 0:" and len(lines[sc - 1]) - len(lines[sc - 1].lstrip()) == indent
