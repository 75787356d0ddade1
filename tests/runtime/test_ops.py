"""`flamia_gen.attention` and the `flamia::attention_fwd/bwd` custom ops (issue #9).

CPU: registration, fake propagation, make_fx / torch.compile tracing (meta inputs), validation,
the backward's NoKernelError and kernel choice on a fake bundle manifest.
GPU (`-m gpu`, needs FLAMIA_GEN_BUNDLE or the DSL for JIT): forward == packed_attention, compile and
CUDA-graph replay bitwise equal to eager, torch.utils.checkpoint, NoKernelError from the backward.
"""

import json
import warnings

import pytest
import torch

import flamia_gen
from flamia_gen.runtime import NoKernelError
from flamia_gen.runtime import ops as ops_mod

T, HQ, HKV, D = 64, 4, 2, 128


def _qkv(device="cpu", T=T, hq=HQ, hkv=HKV, d=D, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hq, d, generator=g).to(torch.bfloat16).to(device)
    k = torch.randn(T, hkv, d, generator=g).to(torch.bfloat16).to(device)
    v = torch.randn(T, hkv, d, generator=g).to(torch.bfloat16).to(device)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    cu = torch.tensor([0, 30, T], dtype=torch.int32, device=device)
    return q, k, v, cu


def _meta(T=T, hq=HQ, hkv=HKV, d=D, grad=True):
    q = torch.empty(T, hq, d, dtype=torch.bfloat16, device="meta", requires_grad=grad)
    k = torch.empty(T, hkv, d, dtype=torch.bfloat16, device="meta", requires_grad=grad)
    v = torch.empty(T, hkv, d, dtype=torch.bfloat16, device="meta", requires_grad=grad)
    return q, k, v, torch.empty(3, dtype=torch.int32, device="meta")


# ---------------------------------------------------------------- registration and fakes


def test_ops_are_registered_with_their_schemas():
    assert flamia_gen.attention is ops_mod.attention
    from flamia_gen import attention  # noqa: F401  (PEP 562 export)

    fwd = torch.ops.flamia.attention_fwd.default._schema
    bwd = torch.ops.flamia.attention_bwd.default._schema
    assert [a.name for a in fwd.arguments] == ["q", "k", "v", "cu_seqlens", "max_seqlen", "causal", "route",
                                               "softmax_scale", "deterministic", "forward_only"]
    assert [str(a.type) for a in fwd.arguments[4:]] == ["int", "bool", "str", "Optional[float]", "bool", "bool"]
    assert fwd.arguments[-1].default_value is False and fwd.arguments[-2].default_value is False
    assert bwd.arguments[-1].default_value is False
    assert len(fwd.returns) == 2 + ops_mod.NUM_SAVED == 10 and len(bwd.returns) == 3
    assert [a.name for a in bwd.arguments][:7] == ["do", "q", "k", "v", "o", "lse", "cu_seqlens"]
    assert [a.name for a in bwd.arguments][-2:] == ["codes", "deterministic"]
    assert not fwd.is_mutable and not bwd.is_mutable


def test_fake_tensor_propagation_fwd_and_bwd():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q, k, v, cu = (mode.from_tensor(t) for t in _qkv())
        o, lse, *codes = torch.ops.flamia.attention_fwd(q, k, v, cu, 34, True, "fp8_token", None)
        assert o.shape == (T, HQ, D) and o.dtype == torch.bfloat16
        assert lse.shape == (HQ, T) and lse.dtype == torch.float32
        # fp8_token keeps the forward's Q, K, V codes for the backward: codes, codes_t, scales of Q and K,
        # codes and scales of V (the backward reads no Vᵀ)
        tp = (T + 15) // 16 * 16
        assert [tuple(c.shape) for c in codes] == [(T, HQ, D), (HQ, D, tp), (T, HQ), (T, HKV, D), (HKV, D, tp),
                                                   (T, HKV), (T, HKV, D), (T, HKV)]
        assert {c.dtype for c in codes} == {torch.uint8}
        dq, dk, dv = torch.ops.flamia.attention_bwd(o, q, k, v, o, lse, cu, 34, True, "fp8_token", None, codes)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert {dq.dtype, dk.dtype, dv.dtype} == {torch.bfloat16}
        # bf16: nothing to keep (empty placeholders)
        assert [c.shape for c in torch.ops.flamia.attention_fwd(q, k, v, cu, 34, True, "bf16", None)[2:]] == \
            [(0,)] * 8


def test_backward_op_refuses_codes_it_cannot_use():
    q, k, v, cu = _qkv()
    o, lse = q.clone(), torch.zeros(HQ, T)
    codes = [torch.zeros(s, dtype=torch.uint8) for s in ops_mod._saved_shapes(q, k)]
    with pytest.raises(ValueError, match="codes: route 'bf16' keeps no forward codes"):
        torch.ops.flamia.attention_bwd(o, q, k, v, o, lse, cu, 34, True, "bf16", None, codes)
    with pytest.raises(ValueError, match=r"codes\[7\] \(v scales\): torch.uint8 \(3, 2\)"):
        torch.ops.flamia.attention_bwd(o, q, k, v, o, lse, cu, 34, True, "fp8_token", None,
                                       codes[:7] + [torch.zeros(3, 2, dtype=torch.uint8)])
    with pytest.raises(ValueError, match=r"codes\[0\] \(q codes\): must be contiguous"):
        bad = torch.zeros(HQ, T, D, dtype=torch.uint8).transpose(0, 1)
        torch.ops.flamia.attention_bwd(o, q, k, v, o, lse, cu, 34, True, "fp8_token", None, [bad] + codes[1:])
    with pytest.raises(ValueError, match="codes: 5 tensors, expected 8"):
        torch.ops.flamia.attention_bwd(o, q, k, v, o, lse, cu, 34, True, "fp8_token", None, codes[:5])


def test_meta_tensors_run_forward_and_backward():
    q, k, v, cu = _meta()
    o = flamia_gen.attention(q, k, v, cu, 34)
    assert o.shape == (T, HQ, D) and o.dtype == torch.bfloat16 and o.device.type == "meta"
    dq, dk, dv = torch.autograd.grad(o.float().sum(), (q, k, v))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_make_fx_traces_fwd_and_bwd_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v, cu):
        o = flamia_gen.attention(q, k, v, cu, 34, causal=False, route="bf16")
        return torch.autograd.grad(o.float().square().sum(), (q, k, v))

    gm = make_fx(step, tracing_mode="fake")(*_qkv(grad=True))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    targets = [n.target for n in calls]
    assert torch.ops.flamia.attention_fwd.default in targets
    assert torch.ops.flamia.attention_bwd.default in targets
    fwd = next(n for n in calls if n.target is torch.ops.flamia.attention_fwd.default)
    assert list(fwd.args[4:]) == [34, False, "bf16", None]


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_on_meta(dynamic):
    """dynamo + aot_autograd on meta inputs (the fake impls run; no kernel needed): no graph break,
    both ops in the graphs, new shapes recompile (or stay symbolic) without breaking."""
    graphs = []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(g, _):
            graphs.append(g)
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    def loss(q, k, v, cu, m):
        return flamia_gen.attention(q, k, v, cu, m).float().square().sum()

    torch._dynamo.reset()
    f = torch.compile(loss, fullgraph=True, backend=backend, dynamic=dynamic)
    for t, m in ((T, 34), (2 * T, 100)):
        q, k, v, cu = _meta(T=t)
        f(q, k, v, cu, m).backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    code = "\n".join(g.code for g in graphs)
    assert "flamia.attention_fwd" in code and "flamia.attention_bwd" in code


def test_torch_compile_eager_backend_graph_holds_the_op():
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, cu: flamia_gen.attention(q, k, v, cu, 64, route="bf16"),
                      fullgraph=True, backend=backend)
    o = f(*_meta(grad=False))
    assert o.shape == (T, HQ, D)
    assert len(seen) == 1 and "torch.ops.flamia.attention_fwd" in seen[0].code


def test_eager_path_only_for_plain_tensors_outside_tracing_and_modes(monkeypatch):
    """`eager_path_ok`: plain tensors of an eager device, nothing tracing; fake tensors, meta tensors, dispatch and
    torch-function modes, vmap and torch.compile take the ops (whose fake implementations trace)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q, k, v, cu = _qkv()
    assert not ops_mod.eager_path_ok(q, k, v, cu)  # CPU is not a kernel device
    monkeypatch.setattr(ops_mod, "EAGER_DEVICES", frozenset({"cpu", "meta"}))
    assert ops_mod.eager_path_ok(q, k, v, cu)
    assert ops_mod.eager_path_ok(*_meta())  # (meta made an eager device here: only the modes below refuse)
    with Dispatch():
        assert not ops_mod.eager_path_ok(q, k, v, cu)
    with Function():
        assert not ops_mod.eager_path_ok(q, k, v, cu)
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        assert not ops_mod.eager_path_ok(fq)
    assert not ops_mod.eager_path_ok(q.as_subclass(torch.nn.Parameter))
    seen = []
    torch.vmap(lambda x: seen.append(ops_mod.eager_path_ok(x)) or x)(q)
    torch.jit.trace(lambda x: seen.append(ops_mod.eager_path_ok(x)) or x * 2, (q.float(),), check_trace=False)
    assert seen == [False, False]

    # torch.compile: the graph holds the op even where the eager path would run in eager mode
    graphs = []
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, cu: flamia_gen.attention(q, k, v, cu, 64, route="bf16"), fullgraph=True,
                      backend=lambda gm, ex: graphs.append(gm) or gm.forward)
    o = f(*_meta(grad=True))
    assert o.shape == (T, HQ, D) and "torch.ops.flamia.attention_fwd" in graphs[0].code


def test_eager_forward_only_records_no_autograd_node(monkeypatch, tmp_path):
    """On the eager path a call no gradient can follow runs the forward's implementation alone (no autograd node);
    one a backward may follow gets the eager autograd node, with the codes kept as the op keeps them."""
    monkeypatch.setenv("FLAMIA_GEN_BUNDLE", str(_fake_bundle(tmp_path)))
    monkeypatch.setattr(ops_mod, "EAGER_DEVICES", frozenset({"cpu"}))
    _reference_fwd(monkeypatch)
    q, k, v, cu = _qkv()
    o = flamia_gen.attention(q, k, v, cu, 34)
    assert o.grad_fn is None and torch.equal(o, q)
    qg, kg, vg, _ = _qkv(grad=True)
    o = flamia_gen.attention(qg, kg, vg, cu, 34)
    assert type(o.grad_fn).__name__ == "_EagerAttentionBackward" and torch.equal(o, qg.detach())


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("mutate, match", [
    (lambda a: a.update(q=a["q"].float()), "q: dtype"),
    (lambda a: a.update(k=a["k"].half()), "k: dtype"),
    (lambda a: a.update(q=a["q"][..., None]), "q: expected 3 dims"),
    (lambda a: a.update(q=a["q"][..., :96].contiguous(), k=a["k"][..., :96].contiguous(),
                        v=a["v"][..., :96].contiguous()), "unsupported head dim on sm90"),
    (lambda a: a.update(k=a["k"][:, :1].expand(T, 3, D).contiguous(), v=a["v"][:, :1].expand(T, 3, D).contiguous()),
     "k: HQ=4 is not a multiple of HKV=3"),
    (lambda a: a.update(k=a["k"][:32]), "k: shape"),
    (lambda a: a.update(v=a["v"][:32]), "v: shape"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"].long()), "cu_seqlens: dtype"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"][None]), "cu_seqlens: expected 1 dim"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"][:1]), "cu_seqlens: needs num_docs"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"].to("meta")), "cu_seqlens: on meta"),
    (lambda a: a.update(max_seqlen=0), "max_seqlen: must be a positive int"),
    (lambda a: a.update(max_seqlen=34.0), "max_seqlen: expected an int"),
    (lambda a: a.update(max_seqlen=True), "max_seqlen: expected an int"),
    (lambda a: a.update(causal=1), "causal: expected a bool"),
    (lambda a: a.update(route="fp8_tokn"), r"route: unknown route 'fp8_tokn'; allowed values: \[.*'fp8_token'"),
    (lambda a: a.update(softmax_scale="0.1"), "softmax_scale: expected a float"),
])
def test_validation_names_the_argument(mutate, match):
    q, k, v, cu = _qkv()
    a = dict(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=34)
    mutate(a)
    with pytest.raises(ValueError, match=match):
        flamia_gen.attention(**a)


def test_known_routes_come_from_the_specs():
    routes = ops_mod.known_routes()
    assert {"bf16", "fp8_token", "fp8_tensor", "mxfp8"} <= set(routes)


def test_non_contiguous_inputs_are_accepted_and_cpu_is_refused_by_the_kernel_path():
    q, k, v, cu = _qkv()
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not contiguous
    assert not qt.is_contiguous()
    with pytest.raises(ValueError, match="CUDA"):
        flamia_gen.attention(qt, k, v, cu, 34)


# ---------------------------------------------------------------- backward on a fake bundle (CPU)


def _entry(name, kind, uses, params, args=()):
    return {"name": name, "file": f"kernels/{name}.so", "sha256": "0" * 64, "kind": kind, "family": "x",
            "spec_hash": "0", "source_sha256": "0", "uses": list(uses), "params": dict(params), "args": list(args)}


def _fake_bundle(tmp_path, with_bwd=False):
    tok = ["fp8_token.do", "fp8_token.k", "fp8_token.q", "fp8_token.v"]
    variants = [
        _entry("attn_fwd_sm90_fp8_token_d128_m128n128_s2_wg2_preg_longest_first", "attn_fwd", ["fp8_token"],
               {"head_dim": 128, "causal": True, "tile_m": 128, "tile_n": 128}),
        _entry("quant_sm90_e4m3_tok_ceil_d128_t128_h1", "quant", tok, {"head_dim": 128, "with_delta": False}),
    ] + [_entry(f"quant_sm90_e4m3_tok_ceil_delta_d128_t{t}_h1", "quant", ["fp8_token.do"],
                {"head_dim": 128, "with_delta": True, "tokens_per_cta": t}) for t in (32, 64, 128)]
    if with_bwd:
        variants.append(_entry("attn_bwd_sm90_fp8_token_d128_m64n128_s2_wg2_preg_longest_first", "attn_bwd",
                               ["fp8_token"], {"head_dim": 128, "causal": True, "tile_m": 64, "tile_n": 128}))
    d = tmp_path / ("bundle_bwd" if with_bwd else "bundle")
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"format": 1, "arch": "sm90", "variants": variants}))
    return d


def _reference_fwd(monkeypatch):
    """Stand in for the GPU forward (packed_attention) so autograd runs on CPU tensors."""
    def fake_packed(q, k, v, cu, max_seqlen, *, route, causal, softmax_scale, return_lse, keep_codes=False,
                    inputs_checked=False):
        assert inputs_checked  # the op validated q, k, v, cu_seqlens itself
        o, lse = q.clone(), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        if keep_codes:  # the forward's codes: E4M3 1.0 everywhere, scale exponent 0 (127)
            codes = [torch.full(sh, 127 if len(sh) == 2 else 0x38, dtype=torch.uint8) for sh in ops_mod._saved_shapes(q, k)]
            return o, lse, tuple(codes)
        return o, lse

    monkeypatch.setattr(ops_mod, "packed_attention", fake_packed)


def test_backward_without_a_kernel_raises_no_kernel_error(monkeypatch, tmp_path):
    monkeypatch.setenv("FLAMIA_GEN_BUNDLE", str(_fake_bundle(tmp_path)))
    _reference_fwd(monkeypatch)
    q, k, v, cu = _qkv(grad=True)
    o = flamia_gen.attention(q, k, v, cu, 34)
    assert torch.equal(o, q.detach())
    with pytest.raises(NoKernelError, match=r"no backward kernel for route 'fp8_token' \(head_dim=128, "
                                            r"causal=True\) on sm90 yet"):
        o.float().sum().backward()
    # the op itself, directly: same error, before any launch or device check
    lse = torch.zeros(HQ, T)
    with pytest.raises(NoKernelError, match="no backward kernel for route 'bf16'"):
        torch.ops.flamia.attention_bwd(q.detach(), q.detach(), k.detach(), v.detach(), q.detach(), lse, cu, 34,
                                       False, "bf16", None, [])


def test_backward_with_a_kernel_picks_it_and_the_delta_quantizer(monkeypatch, tmp_path):
    from flamia_gen.runtime.attention import _bundle, doc_profile, pick_bwd, pick_do_delta

    d = _fake_bundle(tmp_path, with_bwd=True)
    b = _bundle(str(d.resolve()))
    prof = doc_profile(T, torch.zeros(3, dtype=torch.int32), 34)
    with warnings.catch_warnings():  # no dispatch table for "cpu": the analytic defaults answer
        warnings.simplefilter("ignore", RuntimeWarning)
        bwd = pick_bwd(b, "fp8_token", 128, True, prof)
        dlt = pick_do_delta(str(b.root), "fp8_token", 128, prof)
    assert bwd["kind"] == "attn_bwd" and bwd["params"]["causal"] is True
    assert dlt["params"]["with_delta"] is True and "fp8_token.do" in dlt["uses"]
    # the dispatch table's choice (analytic default t32 here), not merely the first bundled name (t128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        from flamia_gen.runtime.attention import _dispatcher

        want = _dispatcher("cpu").decide("quant", "e4m3_tok_ceil_delta", 128, None, profile=prof).variant
    assert dlt["name"] == want == "quant_sm90_e4m3_tok_ceil_delta_d128_t32_h1"
    with pytest.raises(NoKernelError, match="causal=False"):
        pick_bwd(b, "fp8_token", 128, False, prof)
    # a kernel exists: on CPU tensors the backward stops at the device check (no silent fallback)
    monkeypatch.setenv("FLAMIA_GEN_BUNDLE", str(d))
    q, k, v, cu = _qkv()
    with pytest.raises(ValueError, match="CUDA"):
        torch.ops.flamia.attention_bwd(q, q, k, v, q, torch.zeros(HQ, T), cu, 34, True, "fp8_token", None, [])


def _rendered_bwd_entries():
    """The attn_bwd variants' real ARGS and PARAMS (rendered, no DSL needed)."""
    from flamia_gen.render import rendered_literal
    from flamia_gen.plan import make_plan
    from flamia_gen.render import render_variant
    from flamia_gen.spec import load_specs

    plan = make_plan(load_specs(), arch="sm90")
    return [_entry(v.name, "attn_bwd", v.uses, dict(v.params), rendered_literal(render_variant(v), "ARGS"))
            for v in plan.variants if v.kind.value == "attn_bwd"]


def _generated_quant_entry(name, uses):
    from pathlib import Path

    from flamia_gen.render import rendered_literal

    src = (Path(__file__).resolve().parents[2] / "generated" / "sm90" / f"{name}.py").read_text()
    return _entry(name, "quant", uses, rendered_literal(src, "PARAMS"), rendered_literal(src, "ARGS"))


@pytest.mark.parametrize("path", ["ops", "eager"])
@pytest.mark.parametrize("route", ["fp8_token", "bf16"])
def test_backward_plumbing_with_stand_in_kernels(monkeypatch, tmp_path, route, path):
    """The whole backward host path on CPU, with Python stand-ins for the .so kernels: recomputed
    Q/K/V quantization, the with_delta dO launch, the attn_bwd call (argument names, dtypes and
    shapes checked by run_attn_bwd's own validation), dq = dq_accum → BF16, autograd wiring — through the
    torch.library ops and through the eager path (CPU made an eager device), with the same launches and results."""
    from flamia_gen.runtime.attn_bwd import bwd_schedule
    from flamia_gen.runtime.bundle import Bundle

    tok = ["fp8_token.do", "fp8_token.k", "fp8_token.q", "fp8_token.v"]
    variants = [_generated_quant_entry("quant_sm90_e4m3_tok_ceil_d128_t128_h1", tok),
                _generated_quant_entry("quant_sm90_e4m3_tok_ceil_delta_d128_t128_h1", ["fp8_token.do"]),
                _generated_quant_entry("quant_sm90_bf16_delta_d128_t64_h1", ["bf16.do"])]
    variants += _rendered_bwd_entries()
    d = tmp_path / "bundle"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"format": 1, "arch": "sm90", "variants": variants}))
    calls = []

    def stand_in(name):
        entry = next(v for v in variants if v["name"] == name)

        def fn(*args):
            by = {a["name"]: t for a, t in zip(entry["args"], args)}
            calls.append((name, by))
            if entry["kind"] == "quant":
                if "codes" in by:  # (the bf16 dO launch writes only delta and dq_accum)
                    by["codes"].fill_(0x38)  # E4M3 1.0
                    by["scales"].fill_(127)
                    by["codes_t"].fill_(0x38)
                if "delta" in by:
                    by["delta"].copy_((by["x"].float() * by["o"].float()).sum(-1).transpose(0, 1))
                    by["dq_accum"].zero_()
            else:
                by["dq_accum"].add_(1.0)
                by["dk"].fill_(2.0)
                by["dv"].fill_(3.0)
                if "dq" in by:  # bwd_dq_convert (fp8_token's D = 128 tile since round 45): the call's own dQ
                    by["dq"].copy_(by["dq_accum"])
        return fn

    monkeypatch.setattr(Bundle, "get", lambda self, name: stand_in(name))
    monkeypatch.setattr(ops_mod, "_require_cuda", lambda q: None)
    monkeypatch.setenv("FLAMIA_GEN_BUNDLE", str(d))
    if path == "eager":
        monkeypatch.setattr(ops_mod, "EAGER_DEVICES", frozenset({"cpu"}))
    _reference_fwd(monkeypatch)
    t = 70  # T_pad = 80: the transposed copies are padded
    q, k, v, _ = _qkv(T=t, grad=True)
    cu = torch.tensor([0, 30, t], dtype=torch.int32)
    do = torch.randn(t, HQ, D).to(torch.bfloat16)
    saved = []
    with warnings.catch_warnings(), torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        warnings.simplefilter("ignore", RuntimeWarning)
        o = flamia_gen.attention(q, k, v, cu, 40, route=route)
        # which path ran: the eager path's autograd node, or the one torch.library generates for the op
        assert (type(o.grad_fn).__name__ == "_EagerAttentionBackward") == (path == "eager")
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    # what autograd keeps between forward and backward: o, lse, cu_seqlens and either the BF16 q, k, v
    # or (fp8_token) the forward's nine code tensors in their place
    bf16_saved = [sh for dt, sh in saved if dt == torch.bfloat16]
    if route == "fp8_token":
        assert bf16_saved == [(t, HQ, D)] and len([1 for dt, _ in saved if dt == torch.uint8]) == 8
    else:
        assert sorted(bf16_saved) == sorted([(t, HQ, D), (t, HKV, D), (t, HKV, D), (t, HQ, D)])
    assert torch.equal(dq, torch.ones_like(dq)) and torch.equal(dk, torch.full_like(dk, 2.0))
    assert torch.equal(dv, torch.full_like(dv, 3.0))
    names = [n for n, _ in calls]
    bwd_name, bwd = calls[-1]
    assert bwd_name.startswith(f"attn_bwd_sm90_{route}_d128") and not bwd_name.endswith("noncausal")
    want_delta = (do.float() * o.detach().float()).sum(-1).transpose(0, 1)
    assert torch.allclose(bwd["delta"], want_delta) and bwd["delta"].shape == (HQ, t)
    assert bwd["softmax_scale"] == pytest.approx(D ** -0.5)
    if route == "fp8_token":
        # the forward kept its Q, K, V codes (saves_codes): the backward launches only the dO quantizer
        assert names == ["quant_sm90_e4m3_tok_ceil_delta_d128_t128_h1", bwd_name]
        launch = calls[0][1]
        assert bwd["dq_accum"] is launch["dq_accum"] and bwd["delta"] is launch["delta"]
        assert bwd["q"].view(torch.uint8).eq(0x38).all() and bwd["k_scale"].eq(127).all()
        assert bwd["do"].dtype == torch.float8_e4m3fn and bwd["q_t"].shape == (HQ, D, 80)
        assert bwd["k_t"].shape == (HKV, D, 80) and bwd["v"].shape == (t, HKV, D)
        assert torch.equal(bwd["work"], bwd_schedule(cu, 64, 128, True, key_align=16, T=t).work)
    else:
        assert names == ["quant_sm90_bf16_delta_d128_t64_h1", bwd_name]  # no quantizer, only the dO launch
        assert bwd["dq_accum"] is calls[0][1]["dq_accum"] and bwd["delta"] is calls[0][1]["delta"]
        assert bwd["q"].dtype == torch.bfloat16 and torch.equal(bwd["do"], do)
        assert torch.equal(bwd["work"], bwd_schedule(cu, 64, 128, True, T=t).work)
    assert bwd["row_doc"].tolist() == [[0, 30]] * 30 + [[30, t]] * (t - 30)
    # a gradient of another dtype (o.backward(fp32) passes it as given): the dO launch reads it as BF16
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        o = flamia_gen.attention(q, k, v, cu, 40, route=route)
        dq32, _, _ = torch.autograd.grad(o, (q, k, v), do.float())
    do_launch = calls[-2][1]
    assert do_launch["x"].dtype == torch.bfloat16 and torch.equal(do_launch["x"], do) and torch.equal(dq32, dq)
    # no double backward: the gradient graph ends in an error that names it (eager path) or the op's
    if path == "eager":
        o = flamia_gen.attention(q, k, v, cu, 40, route=route)
        dq2, _, _ = torch.autograd.grad(o, (q, k, v), do.requires_grad_(True), create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            dq2.float().sum().backward()
        do = do.detach()
    # the backward op itself refuses one, by name
    with pytest.raises(ValueError, match=r"do: expected the gradient of o: bfloat16 \(70, 4, 128\)"):
        torch.ops.flamia.attention_bwd(do.float(), q.detach(), k.detach(), v.detach(), o.detach(),
                                       torch.zeros(HQ, t), cu, 40, True, route, None, [], False)


# ---------------------------------------------------------------- GPU


def _gpu_bundle(route, causal=None):
    from flamia_gen.runtime.attention import _current_bundle

    try:
        b = _current_bundle(route)
    except NoKernelError as e:
        pytest.skip(str(e))
    # a bundle built for other routes (`flamia-gen bundle --route ...`, or --variant: causal ones only) skips,
    # it does not fail
    if not any(e["kind"] == "attn_fwd" and route in e["uses"]
               and (causal is None or e["params"].get("causal") == causal) for e in b.variants.values()):
        pytest.skip(f"bundle {b.root} has no attn_fwd kernel for route {route!r}"
                    + ("" if causal is None else f" (causal={causal})"))
    return b


# fp8_token_bf16qk and fp8_pv: the BF16-score routes (first run on the H200 on 2026-12-01); fp8_tensor: the
# two-launch backward of a tensor-scaled dS (first run on the H200 on 2026-12-01, second session)
GPU_CASES = [("fp8_token", True), ("fp8_token", False), ("bf16", True), ("fp8_token_bf16qk", True),
             ("fp8_pv", True), ("fp8_pv", False), ("fp8_tensor", True), ("mxfp8", True), ("mxfp8_exact", True),
             ("mxfp8_exact", False), ("nvfp4_mixed", True)]


def _gpu_inputs(grad=False, seed=0):
    lens = [300, 1000, 1, 129, 2048, 77]
    t = sum(lens)
    q, k, v, _ = _qkv("cuda", T=t, hq=8, hkv=2, grad=grad, seed=seed)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return q, k, v, cu, max(lens)


@pytest.mark.gpu
@pytest.mark.parametrize("route, causal", GPU_CASES)
def test_gpu_forward_equals_packed_attention(route, causal):
    from flamia_gen.runtime import packed_attention

    _gpu_bundle(route, causal)
    q, k, v, cu, m = _gpu_inputs()
    o = flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route)
    ref = packed_attention(q, k, v, cu, m, route=route, causal=causal)
    assert o.dtype == torch.bfloat16 and torch.equal(o, ref)
    o2, lse, *_ = torch.ops.flamia.attention_fwd(q, k, v, cu, m, causal, route, None)
    ref2, rlse = packed_attention(q, k, v, cu, m, route=route, causal=causal, return_lse=True)
    assert torch.equal(o2, ref2) and torch.equal(lse, rlse)


@pytest.mark.gpu
@pytest.mark.parametrize("route, causal", GPU_CASES)
def test_gpu_compile_fullgraph_bitwise_equals_eager(route, causal):
    _gpu_bundle(route)
    q, k, v, cu, m = _gpu_inputs()
    eager = flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, cu: flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route),
                      fullgraph=True)
    assert torch.equal(f(q, k, v, cu), eager)


@pytest.mark.gpu
@pytest.mark.parametrize("route, causal", GPU_CASES)
def test_gpu_cuda_graph_replay_bitwise_equals_eager(route, causal):
    _gpu_bundle(route)
    q, k, v, cu, m = _gpu_inputs()
    eager = flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: bundle load, dispatch caches
        for _ in range(2):
            flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # new data in the same buffers: replay follows it
    q2, k2, v2, _, _ = _gpu_inputs(seed=1)
    for dst, src in ((q, q2), (k, k2), (v, v2)):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_kept_codes_equal_recomputed_codes(causal):
    """fp8_token keeps the forward's Q, K, V codes for the backward (saves_codes): they are the codes the
    backward's own quantizer launches recompute, bit for bit, and the deterministic backward gives the
    same gradients bit for bit either way."""
    from flamia_gen.runtime.attention import SAVED_FIELDS, saves_codes

    assert saves_codes("fp8_token")
    _gpu_bundle("fp8_token")
    q, k, v, cu, m = _gpu_inputs()
    o, lse, *codes = torch.ops.flamia.attention_fwd(q, k, v, cu, m, causal, "fp8_token", None, True)
    assert len(codes) == 8 and all(c.numel() > 0 for c in codes)
    # recomputed by the backward's quantizer choice (ops.backward_with without codes)
    from flamia_gen.runtime.attention import _current_bundle, _pick_cached, _quantize, doc_profile

    b = _current_bundle("fp8_token")
    prof = doc_profile(q.shape[0], cu, m)
    it = iter(codes)
    for x, op in ((q, "q"), (k, "k"), (v, "v")):
        outs = _quantize(b, _pick_cached(str(b.root), "quant", "fp8_token", D, None, prof, op), x, cu)
        for f in SAVED_FIELDS[op]:
            assert torch.equal(next(it), outs[f]), (op, f)
    do = torch.randn_like(o)
    args = (do, q, k, v, o, lse, cu, m, causal, "fp8_token", None)
    from flamia_gen.runtime.attention import bwd_candidates

    if not [e for e in bwd_candidates(b, "fp8_token", D, causal) if e["params"].get("deterministic")]:
        pytest.skip(f"bundle {b.root} has no deterministic fp8_token backward (the codes above were checked)")
    kept = torch.ops.flamia.attention_bwd(*args, codes, True)
    again = torch.ops.flamia.attention_bwd(*args, [], True)
    assert all(torch.equal(a, b) for a, b in zip(kept, again))


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["fp8_token", "fp8_tensor", "mxfp8_exact"])
def test_gpu_forward_only_skips_transposed_codes_bitwise(route):
    """A forward-only call (no_grad): Q's and K's quantizer launches write a 16-token codes_t stub, V's a 16-token
    codes stub. Their other outputs are bitwise those of the full launch, each stub is the full tensor's first 16
    tokens, and O is bitwise the O of a call that keeps everything (poisoned outputs: nothing left unwritten)."""
    from flamia_gen.runtime.attention import _current_bundle, _pick_cached, doc_profile
    from flamia_gen.runtime.quant import run_quantizer

    b = _gpu_bundle(route)
    q, k, v, cu, m = _gpu_inputs(seed=3)
    prof = doc_profile(q.shape[0], cu, m)
    for x, op in ((q, "q"), (k, "k")):
        e = _pick_cached(str(b.root), "quant", route, D, None, prof, op)
        full = run_quantizer(b.get(e["name"]), e["args"], x, cu, poison=True)
        stub = run_quantizer(b.get(e["name"]), e["args"], x, cu, poison=True, skip_transposed=True)
        if "codes_t" not in full:
            continue
        assert stub["codes_t"].shape[-1] == 16
        assert torch.equal(stub["codes_t"], full["codes_t"][..., :16]), op
        for f in full:
            if f not in ("codes_t", "amax_ws"):
                assert torch.equal(stub[f], full[f]), (op, f)
    # V: its row-major codes are a 16-token stub (the forward reads codes_t and the scales), where the kernel
    # supports it (PARAMS codes_stub)
    e = _pick_cached(str(b.root), "quant", route, D, None, prof, "v")
    if e["params"].get("codes_stub"):
        full = run_quantizer(b.get(e["name"]), e["args"], v, cu, poison=True)
        stub = run_quantizer(b.get(e["name"]), e["args"], v, cu, poison=True, skip_codes=True, params=e["params"])
        assert stub["codes"].shape[0] == 16 and torch.equal(stub["codes"], full["codes"][:16])
        for f in full:
            if f not in ("codes", "amax_ws"):
                assert torch.equal(stub[f], full[f]), ("v", f)
    with torch.no_grad():
        o_fwd = flamia_gen.attention(q, k, v, cu, m, route=route)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    o_train = flamia_gen.attention(qg, kg, vg, cu, m, route=route)
    assert not torch.isnan(o_fwd).any() and torch.equal(o_fwd, o_train.detach())


def _has_bwd(route, causal, d=D):
    from flamia_gen.runtime.attention import bwd_candidates

    return bool(bwd_candidates(_gpu_bundle(route), route, d, causal))


@pytest.mark.gpu
@pytest.mark.parametrize("route, causal", GPU_CASES)
def test_gpu_checkpoint(route, causal):
    import torch.utils.checkpoint as cp

    _gpu_bundle(route)
    q, k, v, cu, m = _gpu_inputs(grad=True)
    fn = lambda q, k, v: flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route)  # noqa: E731
    o = cp.checkpoint(fn, q, k, v, use_reentrant=False)
    assert torch.equal(o, fn(q, k, v))
    if not _has_bwd(route, causal):
        with pytest.raises(NoKernelError, match="no backward kernel"):
            o.float().sum().backward()
        return
    g_ck = torch.autograd.grad(o.float().sum(), (q, k, v))
    g = torch.autograd.grad(fn(q, k, v).float().sum(), (q, k, v))
    torch.testing.assert_close(g_ck[0], g[0], rtol=1e-2, atol=1e-2)  # dQ: fp32 atomics, not bitwise
    assert torch.equal(g_ck[1], g[1]) and torch.equal(g_ck[2], g[2])  # dK, dV: deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("route, causal", GPU_CASES)
def test_gpu_backward_raises_until_the_bundle_has_a_kernel(route, causal):
    _gpu_bundle(route)
    q, k, v, cu, m = _gpu_inputs(grad=True)
    o = flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route)
    if _has_bwd(route, causal):
        dq, dk, dv = torch.autograd.grad(o.float().sum(), (q, k, v))
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert all(bool(torch.isfinite(t).all()) for t in (dq, dk, dv))
    else:
        with pytest.raises(NoKernelError, match=f"no backward kernel for route '{route}'"):
            torch.autograd.grad(o.float().sum(), (q, k, v))


def test_deterministic_backward_is_picked_only_when_asked_and_never_substituted(monkeypatch, tmp_path):
    """deterministic=True takes a `_det` backward variant (its own dispatch group); without one in
    the bundle it is NoKernelError, never the non-deterministic kernel. False never takes `_det`."""
    from flamia_gen.runtime.attention import _bundle, doc_profile, pick_bwd

    d = _fake_bundle(tmp_path, with_bwd=True)
    b = _bundle(str(d.resolve()))
    prof = doc_profile(T, torch.zeros(3, dtype=torch.int32), 34)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert not pick_bwd(b, "fp8_token", 128, True, prof)["params"].get("deterministic")
        with pytest.raises(NoKernelError, match="no deterministic backward kernel for route 'fp8_token'"):
            pick_bwd(b, "fp8_token", 128, True, prof, deterministic=True)
    m = json.loads((d / "manifest.json").read_text())
    det = "attn_bwd_sm90_fp8_token_d128_m64n128_s2_wg2_preg_longest_first_det"
    m["variants"].append(_entry(det, "attn_bwd", ["fp8_token"], {"head_dim": 128, "causal": True, "tile_m": 64,
                                                                "tile_n": 128, "deterministic": True}))
    d2 = tmp_path / "bundle_det"
    d2.mkdir()
    (d2 / "manifest.json").write_text(json.dumps(m))
    b2 = _bundle(str(d2.resolve()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert pick_bwd(b2, "fp8_token", 128, True, prof, deterministic=True)["name"] == det
        assert pick_bwd(b2, "fp8_token", 128, True, prof)["name"] != det


def test_deterministic_flag_is_checked_and_reaches_the_backward(monkeypatch, tmp_path):
    monkeypatch.setenv("FLAMIA_GEN_BUNDLE", str(_fake_bundle(tmp_path)))
    _reference_fwd(monkeypatch)
    q, k, v, cu = _qkv(grad=True)
    with pytest.raises(ValueError, match="deterministic: expected a bool"):
        flamia_gen.attention(q, k, v, cu, 34, deterministic=1)
    seen = {}

    def fake_run_backward(do, q, k, v, o, lse, cu, max_seqlen, causal, route, softmax_scale, deterministic=False,
                          codes=None):
        seen["deterministic"] = deterministic
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(ops_mod, "_run_backward", fake_run_backward)
    flamia_gen.attention(q, k, v, cu, 34, deterministic=True).float().sum().backward()
    assert seen == {"deterministic": True}
    flamia_gen.attention(q, k, v, cu, 34).float().sum().backward()
    assert seen == {"deterministic": False}


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["mxfp8", "mxfp8_exact", "nvfp4_mixed"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_token_block_forward_op_equals_the_verified_kernel_call(route, causal):
    """The op's own quantizer launches (token-block codes, per-token Q for mxfp8_exact, the
    per-token K / Vᵀ copies of the diagonal tiles, NVFP4 Q/K dequantized to BF16 with the tensor
    scales as a device scalar for nvfp4_mixed: runtime.attention.fp8_forward_inputs) give
    bitwise the output of the same kernel fed by the emulator's quantization (what `verify`
    checks against the emulator), and the exact route's earlier rows ignore a later token."""
    from flamia_gen.runtime.attention import _pick_cached, doc_profile
    from flamia_gen.spec import get_route
    from flamia_gen.verify.attn_gpu import run_kernel

    b = _gpu_bundle(route)
    q, k, v, cu, m = _gpu_inputs()
    o, lse, *_ = torch.ops.flamia.attention_fwd(q, k, v, cu, m, causal, route, None)
    fwd = _pick_cached(str(b.root), "attn_fwd", route, q.shape[2], causal, doc_profile(q.shape[0], cu, m))
    o_ref, lse_ref = run_kernel(b.get(fwd["name"]), fwd, get_route(route), q, k, v, cu)
    assert not torch.isnan(o.float()).any()
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    if causal and route == "mxfp8_exact":
        pos = 300 + 1000 + 1 + 60  # inside the 129-token document, mid 32-token block
        for t in (q, k, v):
            t2 = t.clone()
            t2[pos] = (t2[pos].float() * 1e4).to(torch.bfloat16)
            args = {id(q): q, id(k): k, id(v): v}
            args[id(t)] = t2
            o2 = torch.ops.flamia.attention_fwd(args[id(q)], args[id(k)], args[id(v)], cu, m, causal, route,
                                                None)[0]
            keep = torch.ones(o.shape[0], dtype=torch.bool, device=o.device)
            keep[pos:300 + 1000 + 1 + 129] = False
            assert torch.equal(o2[keep], o[keep])


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["fp8_token", "bf16", "fp8_token_bf16qk", "fp8_pv", "fp8_tensor"])
def test_gpu_head_dim_64_op_forward_and_backward(route):
    """D = 64 through the op (dispatch, quantizers, forward and backward kernels) vs exact fp32
    attention and its gradients: 8-bit ≥ 0.998 (O) and ≥ 0.997 (dQ, dK, dV), BF16 ≥ 0.9999; no NaN.
    fp8_tensor's gradients ≥ 0.995: its E5M2 dS under one tensor-wide scale (2 mantissa bits) is the
    route's own error (emulator vs fp32 0.996, tests/numerics/test_reference.py), not the kernel's."""
    from flamia_gen.numerics.metrics import cosine
    from flamia_gen.numerics.reference import attention as ref_attention
    from flamia_gen.numerics.reference import attention_backward

    _gpu_bundle(route)
    if not _has_bwd(route, True, d=64):
        pytest.skip(f"bundle has no D=64 backward for {route}")
    lens = [300, 1000, 1, 129, 2048, 77]
    q, k, v, _ = _qkv("cuda", T=sum(lens), hq=8, hkv=2, d=64, grad=True, seed=3)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    o = flamia_gen.attention(q, k, v, cu, max(lens), causal=True, route=route)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    ref = ref_attention(q.detach(), k.detach(), v.detach(), cu, True)
    rq, rk, rv = attention_backward(q.detach(), k.detach(), v.detach(), None, None, do, cu, True)
    from flamia_gen.verify.attn_gpu import expected_grad_cosine

    need_o, need_g = (0.9999, 0.9999) if route == "bf16" else (0.998, expected_grad_cosine(route))
    assert o.shape == q.shape and not torch.isnan(o).any()
    assert cosine(o.float(), ref.float()) >= need_o
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        assert got.shape == want.shape and not torch.isnan(got).any()
        assert cosine(got.float(), want.float()) >= need_g


@pytest.mark.parametrize("route", ["fp8_token", "fp8_token_bf16qk", "fp8_pv", "fp8_tensor"])
def test_backward_with_reads_what_each_fp8_mode_takes(monkeypatch, route):
    """backward_with on the rendered ARGS of each 8-bit backward mode (CPU: quantizer launches and the
    kernel call are recorded, not run): fp8_token quantizes Q, K, V and passes codes; fp8_token_bf16qk
    passes the BF16 q, k with Q/K codes_t and scales (for dK, dQ); fp8_pv passes BF16 q, k and quantizes
    neither (dK, dQ in BF16). The dO launch runs for all three."""
    from types import SimpleNamespace

    from flamia_gen.render import rendered_literal
    from flamia_gen.plan.variants import expand_family
    from flamia_gen.render import render_variant
    from flamia_gen.spec import load_specs

    specs = load_specs()
    fam = specs.families["attn_bwd_sm90"]
    v = next(x for x in expand_family(fam.model_copy(update={"routes": [route]}), specs).variants
             if x.param("head_dim") == D and x.param("causal") and not dict(x.params).get("deterministic"))
    entry = _entry(v.name, "attn_bwd", v.uses, dict(v.params), rendered_literal(render_variant(v), "ARGS"))
    q, k, v_, cu = _qkv()
    do = torch.randn_like(q)
    launched, called = [], {}

    def fake_quantize(b, e, x, cu_, o=None, skip_transposed=False):
        launched.append(e["op"])
        t, h, d = x.shape
        return dict(codes=torch.zeros(t, h, d, dtype=torch.uint8), codes_t=torch.zeros(h, d, 48, dtype=torch.uint8),
                    scales=torch.zeros(t, h, dtype=torch.uint8), delta=torch.zeros(h, t), dq_accum=torch.zeros(t, h, d))

    monkeypatch.setattr(ops_mod, "_quantize", fake_quantize)
    monkeypatch.setattr(ops_mod, "_pick_cached", lambda root, kind, r, d, c, prof, op: {"op": op})
    monkeypatch.setattr(ops_mod, "pick_do_delta", lambda root, r, d, prof: {"op": "do"})
    monkeypatch.setattr(ops_mod, "run_attn_bwd", lambda fn, args, *a, **kw: called.update(a=a, kw=kw) or (None,) * 4)
    b = SimpleNamespace(root="fake", get=lambda name: (lambda *a: None))
    ops_mod.backward_with(b, entry, do, q, k, v_, q, torch.zeros(HQ, T), cu, None)
    pos, kw = called["a"], called["kw"]
    if route in ("fp8_token", "fp8_tensor"):
        assert launched == ["q", "k", "v", "do"] and pos[0].dtype == torch.uint8
        assert {"q_t", "k_t", "q_scale", "k_scale"} <= set(kw)
    elif route == "fp8_token_bf16qk":
        assert launched == ["q", "k", "v", "do"] and pos[0] is not None and pos[0].dtype == q.dtype
        assert torch.equal(pos[0], q) and torch.equal(pos[1], k) and {"q_t", "k_t"} <= set(kw)
    else:
        assert launched == ["v", "do"] and torch.equal(pos[0], q) and torch.equal(pos[1], k)
        assert not ({"q_t", "k_t", "q_scale", "k_scale"} & set(kw))
    assert pos[2].dtype == torch.uint8 and kw["do_t"].dtype == torch.uint8  # V codes, dOᵀ codes


# ---------------------------------------------------------------- forward-only calls (CPU, stand-in kernels)


def test_forward_only_calls_keep_no_codes(monkeypatch, tmp_path):
    """`attention` without a gradient to come (no_grad, or no input requiring one) asks the op for
    forward_only: packed_attention without keep_codes and the op's code outputs empty; with one, codes kept."""
    monkeypatch.setenv("FLAMIA_GEN_BUNDLE", str(_fake_bundle(tmp_path)))
    seen = []

    def fake_packed(q, k, v, cu, max_seqlen, *, route, causal, softmax_scale, return_lse, keep_codes=False,
                    inputs_checked=False):
        seen.append(keep_codes)
        o, lse = q.clone(), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        if keep_codes:
            return o, lse, tuple(torch.zeros(sh, dtype=torch.uint8) for sh in ops_mod._saved_shapes(q, k))
        return o, lse

    monkeypatch.setattr(ops_mod, "packed_attention", fake_packed)
    q, k, v, cu = _qkv()
    flamia_gen.attention(q, k, v, cu, 34)  # no input requires grad
    qg, kg, vg, _ = _qkv(grad=True)
    with torch.no_grad():
        flamia_gen.attention(qg, kg, vg, cu, 34)
    o = flamia_gen.attention(qg, kg, vg, cu, 34)  # a backward may follow: fp8_token keeps its codes
    assert seen == [False, False, True] and o.requires_grad
    out = torch.ops.flamia.attention_fwd(q, k, v, cu, 34, True, "fp8_token", None, False, True)
    assert all(c.numel() == 0 for c in out[2:])
    # the fake implementation agrees (meta tensors)
    qm, km, vm, cum = _meta(grad=False)
    fake = torch.ops.flamia.attention_fwd(qm, km, vm, cum, 34, True, "fp8_token", None, False, True)
    assert all(c.numel() == 0 for c in fake[2:])
    full = torch.ops.flamia.attention_fwd(qm, km, vm, cum, 34, True, "fp8_token", None, False, False)
    assert [tuple(c.shape) for c in full[2:]] == ops_mod._saved_shapes(qm, km)


def test_forward_only_backward_still_works(monkeypatch, tmp_path):
    """forward_only=True with inputs that do require grad (the op called directly): nothing kept, so the
    backward re-quantizes from the saved BF16 inputs (ctx.kept False) instead of reading absent codes."""
    monkeypatch.setenv("FLAMIA_GEN_BUNDLE", str(_fake_bundle(tmp_path)))
    _reference_fwd(monkeypatch)
    got = {}

    def fake_bwd(do, q, k, v, o, lse, cu, max_seqlen, causal, route, softmax_scale, deterministic=False, codes=None):
        got.update(q=q, codes=codes)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(ops_mod, "_run_backward", fake_bwd)
    q, k, v, cu = _qkv(grad=True)
    o = torch.ops.flamia.attention_fwd(q, k, v, cu, 34, True, "fp8_token", None, False, True)[0]
    o.float().sum().backward()
    assert got["q"].dtype == torch.bfloat16 and not got["codes"]  # the BF16 q itself, no kept codes
    assert q.grad is not None and k.grad is not None


def test_fp8_forward_inputs_skips_q_k_transposed_codes(monkeypatch, tmp_path):
    """The forward's quantizer launches with skip_transposed=("q", "k"): Q's and K's codes_t are 16-token
    stubs, V's (the forward's Vᵀ) full; V may not be skipped. With skip_codes=("v",) V's row-major codes are a
    16-token stub (its codes_t and scales full); Q's and K's codes may not be skipped."""
    from flamia_gen.runtime.attention import _bundle, doc_profile, fp8_forward_inputs
    from flamia_gen.runtime.bundle import Bundle

    tok = ["fp8_token.k", "fp8_token.q", "fp8_token.v"]
    fwd_name = "attn_fwd_sm90_fp8_token_d128_m192n128_s2_wg3_preg_longest_first"
    variants = [_generated_quant_entry("quant_sm90_e4m3_tok_ceil_d128_t128_h1", tok),
                _generated_quant_entry(fwd_name, ["fp8_token"])]
    variants[1]["kind"] = "attn_fwd"
    d = tmp_path / "bundle"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"format": 1, "arch": "sm90", "variants": variants}))
    shapes, code_shapes = [], []

    def stand_in(self, name):
        entry = next(v for v in variants if v["name"] == name)

        def fn(*args):
            by = {a["name"]: t for a, t in zip(entry["args"], args)}
            shapes.append(tuple(by["codes_t"].shape))
            code_shapes.append(tuple(by["codes"].shape))
        return fn

    monkeypatch.setattr(Bundle, "get", stand_in)
    t = 70
    q, k, v, _ = _qkv(T=t)
    cu = torch.tensor([0, 30, t], dtype=torch.int32)
    b = _bundle(str(d.resolve()))
    prof = doc_profile(t, cu, 40)
    fwd = variants[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ins = fp8_forward_inputs(b, fwd, "fp8_token", q, k, v, cu, prof, skip_transposed=("q", "k"))
        assert shapes == [(HQ, D, 16), (HKV, D, 16), (HKV, D, 80)] and ins["v"].shape == (HKV, D, 80)
        assert code_shapes == [(t, HQ, D), (t, HKV, D), (t, HKV, D)]
        shapes.clear()
        code_shapes.clear()
        fp8_forward_inputs(b, fwd, "fp8_token", q, k, v, cu, prof)
        assert shapes == [(HQ, D, 80), (HKV, D, 80), (HKV, D, 80)]
        with pytest.raises(ValueError, match="skip_transposed.*'v'"):
            fp8_forward_inputs(b, fwd, "fp8_token", q, k, v, cu, prof, skip_transposed=("v",))
        # V's row-major codes: a 16-token stub (the rendered quantizer says codes_stub); Q's and K's may not be
        assert variants[0]["params"]["codes_stub"] is True
        shapes.clear()
        code_shapes.clear()
        ins = fp8_forward_inputs(b, fwd, "fp8_token", q, k, v, cu, prof, skip_transposed=("q", "k"),
                                 skip_codes=("v",))
        assert code_shapes == [(t, HQ, D), (t, HKV, D), (16, HKV, D)] and ins["v"].shape == (HKV, D, 80)
        assert ins["v_scale"].shape == (t, HKV)
        with pytest.raises(ValueError, match="skip_codes.*'q'"):
            fp8_forward_inputs(b, fwd, "fp8_token", q, k, v, cu, prof, skip_codes=("q",))
