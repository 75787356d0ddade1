"""The fused quantizer templates (templates/sm90|sm100/quant.py.j2) and its host wrapper.

CPU only. Rendering tests use the build stage's jinja2 settings; `compile` tests cross-
compile real variants with the CuTe DSL in a subprocess (the arch is read at import) and
check the PTX for the converts and divisions the contract fixes.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2
import pytest
import torch

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
                 head_dim=128, tokens_per_cta=32, heads_per_cta=1) -> dict:
    had = "_had" if hadamard else ""
    name = f"quant_{arch}_{fmt}_{granularity}_{exponent_rule}{had}_q_d{head_dim}_t{tokens_per_cta}_h{heads_per_cta}"
    return dict(name=name, arch=arch, cute_arch={"sm90": "sm_90a", "sm100": "sm_100a"}[arch], kind="quant",
                route="test_route", operand="q", fmt=fmt, granularity=granularity, exponent_rule=exponent_rule,
                hadamard=hadamard, head_dim=head_dim, tokens_per_cta=tokens_per_cta, heads_per_cta=heads_per_cta,
                write_transposed=fmt != "e2m1", sm_count=132 if arch == "sm90" else 148,
                spec_hash="0123456789abcdef", flamia_version="0.1.0")


def render(ctx: dict) -> str:
    return _env().get_template(f"{ctx['arch']}/quant.py.j2").render(**ctx)


def _module_literals(src: str) -> dict:
    """NAME, ARCH, PARAMS, ARGS of a rendered module, read without importing cutlass."""
    out = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("NAME", "ARCH", "PARAMS", "ARGS"):
                out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def _representative():
    for arch in ("sm90", "sm100"):
        for fmt, g, rule in SPEC_COMBOS:
            for d in (64, 128):
                yield make_context(arch, fmt, g, rule, False, d, 32, 1)
        yield make_context(arch, "e4m3", "token_block", "ceil", True, 128, 64, 2 if arch == "sm90" else 1)
        yield make_context(arch, "e2m1", "nvfp4", "ceil", True, 64, 128, 4)
        yield make_context(arch, "e5m2", "block1d_32", "ceil", True, 64, 64, 2)


REPRESENTATIVE = list(_representative())


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
