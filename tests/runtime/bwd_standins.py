"""Shared helpers of the CPU-only backward-input tests (test_bwd_diag_inputs, test_bwd_exact_inputs,
test_bwd_nvfp4_inputs): generated ARGS / PARAMS, plan variants, bundle-manifest entries and a stand-in bundle
whose kernels are Python functions recording their launches. Not a test module (no tests collected here)."""

from __future__ import annotations

import json
import warnings
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import torch

from flamia_gen.render import rendered_literal
from flamia_gen.runtime import ops as ops_mod

ROOT = Path(__file__).resolve().parents[2]
FP8_BWD = "attn_bwd_sm90_fp8_token_d128_m64n128_s2_wg2_preg_longest_first"
HQ, HKV, D = 4, 2, 128
DOCS = [5, 1, 30, 200, 7, 60, 300, 2]
TB = "quant_sm90_e4m3_tb32_ceil_d128_t128_h1"
TB_DELTA = "quant_sm90_e4m3_tb32_ceil_delta_d128_t128_h1"
TOK = "quant_sm90_e4m3_tok_ceil_d128_t128_h1"
TOK_DELTA = "quant_sm90_e4m3_tok_ceil_delta_d128_t128_h1"
# mxfp8's diagonal V arguments, as the template appends them to a diag_v backward's ARGS
DIAG_V_SPEC = [
    {"name": "v_diag", "dtype": "float8_e4m3fn", "shape": ["T", "HKV", "D"], "role": "in"},
    {"name": "v_diag_scale", "dtype": "uint8", "shape": ["T", "HKV"], "role": "in"},
    {"name": "fwd_tile_m", "dtype": "int32", "shape": [], "role": "scalar"},
]
DROP = object()  # an override value for `merged`: leave that key out


def generated(name: str) -> tuple[list, dict]:
    """(ARGS, PARAMS) of the checked-in generated/sm90/<name>.py."""
    src = (ROOT / "generated" / "sm90" / f"{name}.py").read_text()
    return rendered_literal(src, "ARGS"), rendered_literal(src, "PARAMS")


@lru_cache(maxsize=None)
def plan_variants(family: str, route: str):
    """The plan's variants of `family` expanded for `route` alone."""
    from flamia_gen.plan.variants import expand_family
    from flamia_gen.spec import load_specs

    specs = load_specs()
    return expand_family(specs.families[family].model_copy(update={"routes": [route]}), specs).variants


def plan_bwd(route: str, causal: bool, d: int = D):
    """The plan's first non-deterministic attn_bwd_sm90 variant of `route` with this head_dim and causality."""
    return next(v for v in plan_variants("attn_bwd_sm90", route) if v.param("head_dim") == d
                and v.param("causal") == causal and not dict(v.params).get("deterministic"))


def cu_seqlens(lens):
    """int32 cu_seqlens of documents of these lengths."""
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def fp8_inputs(lens=DOCS):
    """run_attn_bwd's common inputs of an FP8 (fp8_token ARGS) variant: zero uint8 codes and scales."""
    cu = cu_seqlens(lens)
    T = int(cu[-1])
    tpad = -(-T // 16) * 16
    u8 = torch.uint8
    return dict(q=torch.zeros(T, HQ, D, dtype=u8), k=torch.zeros(T, HKV, D, dtype=u8),
                v=torch.zeros(T, HKV, D, dtype=u8), do=torch.zeros(T, HQ, D, dtype=u8),
                lse=torch.zeros(HQ, T), delta=torch.zeros(HQ, T),
                q_t=torch.zeros(HQ, D, tpad, dtype=u8), k_t=torch.zeros(HKV, D, tpad, dtype=u8),
                do_t=torch.zeros(HQ, D, tpad, dtype=u8), q_scale=torch.zeros(T, HQ, dtype=u8),
                k_scale=torch.zeros(T, HKV, dtype=u8), v_scale=torch.zeros(T, HKV, dtype=u8),
                do_scale=torch.zeros(T, HQ, dtype=u8), cu_seqlens=cu)


def diag_v_inputs(T):
    """The diagonal V arguments for T tokens: v_diag codes 0x40, v_diag_scale 121, fwd_tile_m 192."""
    return dict(v_diag=torch.full((T, HKV, D), 0x40, dtype=torch.uint8),
                v_diag_scale=torch.full((T, HKV), 121, dtype=torch.uint8), fwd_tile_m=192)


def recorder(args_spec):
    """(kernel stand-in, dict): the stand-in checks the argument count and records each argument by name."""
    seen = {}

    def fn(*a):
        assert len(a) == len(args_spec)
        seen.update({s["name"]: t for s, t in zip(args_spec, a)})
    return fn, seen


def merged(base: dict, **over) -> dict:
    """`base` with `over` applied, keys overridden with DROP left out."""
    kw = dict(base, **over)
    return {k: v for k, v in kw.items() if v is not DROP}


def manifest_entry(name, kind, uses, params, args=()):
    """A bundle manifest's variant entry (placeholder file and hashes)."""
    return {"name": name, "file": f"kernels/{name}.so", "sha256": "0" * 64, "kind": kind, "family": "x",
            "spec_hash": "0", "source_sha256": "0", "uses": list(uses), "params": dict(params), "args": list(args)}


def quant_entry(name, uses, **over):
    """The manifest entry of generated quantizer `name` (PARAMS updated by `over`; `as_name` renames it)."""
    args, params = generated(name)
    return manifest_entry(over.pop("as_name", name), "quant", uses, dict(params, **over), args)


def fill_by_launch(name, by, n):
    """A stand-in quantizer's outputs, told apart by launch number n: codes n, codes_t n+100, scales n+200, delta n."""
    by["codes"].fill_(n)
    by["codes_t"].fill_(n + 100)
    by["scales"].fill_(n + 200)
    if "delta" in by:
        by["delta"].fill_(float(n))
        by["dq_accum"].zero_()


def standin_bundle(tmp_path, monkeypatch, dirname, variants, fill):
    """Write a manifest of `variants` under tmp_path/dirname and load it with every kernel a Python stand-in that
    records (name, {arg: tensor}) in `launches` and, for a quantizer, calls fill(name, by, launch number);
    returns (bundle, launches)."""
    from flamia_gen.runtime.attention import _bundle
    from flamia_gen.runtime.bundle import Bundle

    d = tmp_path / dirname
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"format": 1, "arch": "sm90", "variants": variants}))
    launches = []

    def stand_in(name):
        entry = next(v for v in variants if v["name"] == name)

        def fn(*args):
            by = {a["name"]: t for a, t in zip(entry["args"], args)}
            launches.append((name, by))
            if entry["kind"] == "quant":
                fill(name, by, len(launches))
        return fn

    monkeypatch.setattr(Bundle, "get", lambda self, name: stand_in(name))
    return _bundle(str(d.resolve())), launches


def bf16_inputs(lens=DOCS, seed=0, with_o=True):
    """Seeded BF16 (q, k, v, do[, o], cu_seqlens) for documents of these lengths."""
    g = torch.Generator().manual_seed(seed)
    cu = cu_seqlens(lens)
    T = int(cu[-1])
    q = torch.randn(T, HQ, D, generator=g).to(torch.bfloat16)
    k = torch.randn(T, HKV, D, generator=g).to(torch.bfloat16)
    v = torch.randn(T, HKV, D, generator=g).to(torch.bfloat16)
    do = torch.randn(T, HQ, D, generator=g).to(torch.bfloat16)
    if not with_o:
        return q, k, v, do, cu
    o = torch.randn(T, HQ, D, generator=g).to(torch.bfloat16)
    return q, k, v, do, o, cu


def profile_of(T, cu):
    """The runtime's document profile of cu_seqlens (max length 300)."""
    from flamia_gen.runtime.attention import doc_profile

    return doc_profile(T, cu, 300)


def run_backward(b, bwd_name, **kw):
    """ops.backward_with of bundle b's backward on bf16_inputs() (kw: codes, fwd_params); returns (inputs, o)."""
    q, k, v, do, o, cu = bf16_inputs()
    T = q.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the dispatch table knows no candidate route
        ops_mod.backward_with(b, b.variants[bwd_name], do, q, k, v, o, torch.zeros(HQ, T), cu, profile_of(T, cu),
                              **kw)
    return dict(q=q, k=k, v=v, do=do), o


def arg_sources(launches, inputs):
    """Per kernel argument, the (quantizer, operand, output field) it is (same storage), or None."""
    kern = launches[-1][1]
    which = {id(t): n for n, t in inputs.items()}
    outs = {}
    for name, by in launches[:-1]:
        for field in ("codes", "codes_t", "scales", "tensor_scale", "delta", "dq_accum"):
            if field in by:
                outs[(by[field].data_ptr(), tuple(by[field].shape))] = (name, which[id(by["x"])], field)
    return {a: outs.get((t.data_ptr(), tuple(t.shape))) for a, t in kern.items() if isinstance(t, torch.Tensor)}


def plan_fwd_bundle(route, d=64):
    """A bundle stand-in whose manifest lists the plan's forward variants of `route` at head_dim d (plan order)."""
    fw = [manifest_entry(v.name, "attn_fwd", [route], dict(v.params)) for v in plan_variants("attn_fwd_sm90", route)
          if v.param("head_dim") == d]
    return SimpleNamespace(manifest={"variants": fw})


def small_qkv(g, lens=(64, 130, 40)):
    """Random BF16 q (2 heads), k, v (1 head) of head_dim 64 and their cu_seqlens."""
    cu = cu_seqlens(list(lens))
    T = int(cu[-1])
    q = torch.randn(T, 2, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(T, 1, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(T, 1, 64, generator=g).to(torch.bfloat16)
    return q, k, v, cu


def emulated_run_bwd(route, fwd_tile_m=192, fwd_tile_n=128):
    """verify.attn_gpu._run_bwd's stand-in: the route's emulator as the kernel (the forward on the paired forward's
    tiles, the backward on the kernel's tiles under the FP8 model), on the CPU."""
    from flamia_gen.numerics.reference import attention, attention_backward

    def run(bundle, entry, q, k, v, do, cu, poison=True, keep=None):  # keep: no call-made workspace here
        o, lse = attention(q, k, v, cu, causal=True, route=route, return_lse=True, tile_m=fwd_tile_m,
                           tile_n=fwd_tile_n, key_align=16, mma="sm90_fp8")
        o = o.to(torch.bfloat16)
        dq, dk, dv = attention_backward(q, k, v, o, lse, do, cu, True, route, tile_m=64, tile_n=128, key_align=16,
                                        mma="sm90_fp8", fwd_tile_m=fwd_tile_m, fwd_tile_n=fwd_tile_n)
        return o, lse.transpose(0, 1), dq.to(torch.bfloat16), dk.to(torch.bfloat16), dv.to(torch.bfloat16)
    return run
