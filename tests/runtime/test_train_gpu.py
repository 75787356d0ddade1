"""Training through `flamia_gen.attention` on the GPU (issue #9): forward AND backward.

All tests are `@pytest.mark.gpu` and skip (with a reason) without a CUDA device, without a bundle
(FLAMIA_GEN_BUNDLE, or the DSL for JIT), or when the bundle has no backward kernel for the route.

- compile: torch.compile(fullgraph=True) of the loss, grads by torch.autograd.grad == eager
  (dK, dV bitwise; dQ close: it is accumulated with fp32 atomics, so not bitwise);
- CUDA graphs: forward + backward captured together, replay == eager, replay follows new inputs;
- leakage probe on the op: perturbing token p (q, k, v, dO) never moves an earlier row of its
  document nor any row of another document on the exact routes, and does move earlier rows on
  fp8_tensor (a tensor-wide scale leaks by design);
- a tiny 2-layer transformer trains through the op (fp8_token and bf16), compiled.

`torch.autograd.grad` is called outside the compiled function: dynamo refuses it inside a graph
(`torch._dynamo.config.trace_autograd_ops=False`); the backward is still compiled (aot_autograd),
and the graph holds `flamia.attention_bwd`.
"""

import pytest
import torch

import flamia_gen
from flamia_gen.runtime import NoKernelError

try:  # `python -m pytest` from the repository root: tests/ is a namespace package
    from tests.runtime.test_ops import D, GPU_CASES, _gpu_bundle, _gpu_inputs, _has_bwd
except ImportError:  # plain `pytest` (rootdir not on sys.path): load the sibling module by path
    import importlib.util
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location("_flamia_test_ops", Path(__file__).with_name("test_ops.py"))
    _test_ops = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_test_ops)
    D, GPU_CASES, _gpu_bundle, _gpu_inputs, _has_bwd = (
        _test_ops.D, _test_ops.GPU_CASES, _test_ops._gpu_bundle, _test_ops._gpu_inputs, _test_ops._has_bwd)

DQ_TOL = dict(rtol=1e-2, atol=1e-2)  # dQ: fp32 atomics (order varies), as in test_ops.test_gpu_checkpoint


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _need_bwd(route, causal=True):
    """Skip without CUDA, without a bundle (`_gpu_bundle` skips) or without the route's backward."""
    _need_cuda()
    if not _has_bwd(route, causal):
        pytest.skip(f"the bundle has no backward kernel for route {route!r} (head_dim={D}, causal={causal})")


def _loss(q, k, v, cu, m, causal, route):
    return flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route).float().square().sum()


# ---------------------------------------------------------------- 1. torch.compile(fullgraph=True), fwd + bwd


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["fp8_token", "bf16", "fp8_token_bf16qk", "fp8_pv", "fp8_tensor", "mxfp8_exact"])
def test_gpu_train_step_compile_fullgraph(route):
    causal = True
    _need_bwd(route, causal)
    q, k, v, cu, m = _gpu_inputs(grad=True)

    loss_e = _loss(q, k, v, cu, m, causal, route)
    g_e = torch.autograd.grad(loss_e, (q, k, v))

    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, cu: _loss(q, k, v, cu, m, causal, route), fullgraph=True)
    loss_c = f(q, k, v, cu)
    g_c = torch.autograd.grad(loss_c, (q, k, v))
    torch.cuda.synchronize()

    # the forward op is the same opaque kernel; only the fp32 reduction order of the sum may differ
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=0.0)
    for name, a, b in zip("qkv", g_c, g_e):
        assert a.shape == b.shape and a.dtype == torch.bfloat16, name
        assert bool(torch.isfinite(a).all()), f"d{name}: non-finite under compile"
    # dO = 2*o is exact in both (a power-of-two multiple of a BF16 value), so the backward sees the
    # same inputs: dK, dV (deterministic) bitwise, dQ close
    assert torch.equal(g_c[1], g_e[1]), "dK: compiled != eager"
    assert torch.equal(g_c[2], g_e[2]), "dV: compiled != eager"
    torch.testing.assert_close(g_c[0], g_e[0], **DQ_TOL)
    # a second compiled step (no recompile, cached graph) gives the same dK, dV again
    g_c2 = torch.autograd.grad(f(q, k, v, cu), (q, k, v))
    assert torch.equal(g_c2[1], g_e[1]) and torch.equal(g_c2[2], g_e[2])
    torch.testing.assert_close(g_c2[0], g_e[0], **DQ_TOL)


# ---------------------------------------------------------------- 2. CUDA graph of forward + backward


@pytest.mark.gpu
@pytest.mark.parametrize("route, causal", GPU_CASES)
def test_gpu_train_step_cuda_graph(route, causal):
    _need_bwd(route, causal)
    q, k, v, cu, m = _gpu_inputs(grad=True)

    def step():
        o = flamia_gen.attention(q, k, v, cu, m, causal=causal, route=route)
        dq, dk, dv = torch.autograd.grad(o.float().square().sum(), (q, k, v))
        return o, dq, dk, dv

    def check(got, want, when):
        o, dq, dk, dv = got
        eo, edq, edk, edv = want
        assert torch.equal(o, eo), f"O: replay != eager ({when})"
        assert torch.equal(dk, edk), f"dK: replay != eager ({when})"
        assert torch.equal(dv, edv), f"dV: replay != eager ({when})"
        torch.testing.assert_close(dq, edq, **DQ_TOL)

    eager = [t.detach().clone() for t in step()]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: bundle load, dispatch and work-list caches (fwd and bwd)
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    g.replay()
    torch.cuda.synchronize()
    check(out, eager, "same inputs")

    # new data in the same buffers: the replay follows it
    q2, k2, v2, _, _ = _gpu_inputs(seed=1)
    with torch.no_grad():
        for dst, src in ((q, q2), (k, k2), (v, v2)):
            dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in out]
    fresh = [t.detach() for t in step()]
    torch.cuda.synchronize()
    assert not torch.equal(fresh[0], eager[0])  # the new inputs do change the answer
    check(replayed, fresh, "new inputs")


# ---------------------------------------------------------------- 3. leakage probe through the op


# (document index in _gpu_inputs' lens [300, 1000, 1, 129, 2048, 77], offset of p inside it):
# p sits mid-tile (817 % 128 = 49, 2767 % 128 = 79), so earlier rows share p's query/key tiles.
PROBES = [(1, 517), (4, 1337)]
SCALE = 1e4


def _fwd_bwd(q, k, v, cu, m, route, do):
    """(o, (dq, dk, dv) or None) for fresh leaves (causal)."""
    q, k, v = (t.detach().clone().requires_grad_(do is not None) for t in (q, k, v))
    o = flamia_gen.attention(q, k, v, cu, m, causal=True, route=route)
    if do is None:
        return o.detach(), None
    return o.detach(), torch.autograd.grad(o, (q, k, v), do)


def _perturbed(t, p):
    t = t.clone()
    t[p] = t[p] * SCALE
    return t


def _noise(a, b):
    """Run-to-run noise (max |a - b|) between two identical calls."""
    return (a.float() - b.float()).abs().max().item()


def _assert_rows_unchanged(name, new, base, rows, noise):
    """Bitwise when the quantity is run-to-run reproducible (noise == 0). Otherwise (dQ's fp32
    atomics may add in a different order from run to run, moving BF16 results by about an ulp)
    the rows may only differ by the observed noise: atol 4x the largest difference seen between two
    identical calls, plus rtol 2^-7 (two BF16 ulps). A real leak of a 1e4-scaled token (or of a
    scale shared across rows: an FP8 step is 2^-3 relative) is far above that."""
    a, b = new[rows], base[rows]
    if noise == 0.0:
        bad = (a != b).flatten(1).any(1).sum().item()
        assert torch.equal(a, b), f"{name}: {bad} protected rows changed"
    else:
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=4 * noise,
                                   msg=lambda m: f"{name}: protected rows moved beyond run-to-run noise "
                                                 f"({noise:.3g}): {m}")


def _exact_route_probe(route):
    q, k, v, cu, m = _gpu_inputs()
    T = q.shape[0]
    idx = torch.arange(T, device=q.device)
    bounds = cu.tolist()
    has_bwd = _has_bwd(route, True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(q.device)

    base_o, base_g = _fwd_bwd(q, k, v, cu, m, route, do if has_bwd else None)
    again_o, again_g = _fwd_bwd(q, k, v, cu, m, route, do if has_bwd else None)
    assert torch.equal(base_o, again_o), "the forward is not reproducible"
    noise = [_noise(a, b) for a, b in zip(base_g, again_g)] if has_bwd else None
    if has_bwd:
        # sanity: atomics noise, if any, is a rounding effect, not garbage
        for name, n, g in zip(("dQ", "dK", "dV"), noise, base_g):
            assert n <= 1e-2 * max(g.float().abs().max().item(), 1e-30), f"{name}: run-to-run noise {n}"

    for doc, off in PROBES:
        start, end = bounds[doc], bounds[doc + 1]
        assert end - start >= 64 and off < end - start
        p = start + off
        keep = (idx < p) | (idx >= end)  # earlier rows of p's document and every other document
        other = (idx < start) | (idx >= end)  # rows of the other documents
        for which in ("q", "k", "v", "do"):
            if which == "do" and not has_bwd:
                continue
            qi, ki, vi, doi = (_perturbed(t, p) if which == n else t
                               for t, n in ((q, "q"), (k, "k"), (v, "v"), (do, "do")))
            o, g = _fwd_bwd(qi, ki, vi, cu, m, route, doi if has_bwd else None)
            tag = f"{route}: {which}[{p}] x{SCALE:g} (doc {doc} = [{start}, {end}))"
            if which != "do":
                assert not torch.equal(o[p:end], base_o[p:end]), f"{tag}: the perturbation had no effect"
            _assert_rows_unchanged(f"O, {tag}", o, base_o, keep, 0.0)  # the forward is always exact
            if has_bwd:
                dq, dk, dv = g
                if which in ("q", "do"):
                    assert not torch.equal(dq[p], base_g[0][p]), f"{tag}: dQ[p] did not move"
                _assert_rows_unchanged(f"dQ, {tag}", dq, base_g[0], keep, noise[0])
                _assert_rows_unchanged(f"dK, {tag}", dk, base_g[1], other, noise[1])
                _assert_rows_unchanged(f"dV, {tag}", dv, base_g[2], other, noise[2])
    if not has_bwd:
        pytest.skip(f"forward probe passed; the bundle has no backward kernel for route {route!r} (causal)")


def _tensor_scale_probe(route):
    q, k, v, cu, m = _gpu_inputs()
    try:
        base_o = flamia_gen.attention(q, k, v, cu, m, causal=True, route=route)
    except NoKernelError as e:
        pytest.skip(f"no {route} forward in the bundle: {e}")
    has_bwd = _has_bwd(route, True)
    idx = torch.arange(q.shape[0], device=q.device)
    bounds = cu.tolist()
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(q.device)
    if has_bwd:
        base_o, base_g = _fwd_bwd(q, k, v, cu, m, route, do)
        noise = _noise(base_g[0], _fwd_bwd(q, k, v, cu, m, route, do)[1][0])
    for doc, off in PROBES:
        start, end = bounds[doc], bounds[doc + 1]
        p = start + off
        earlier = (idx >= start) & (idx < p)
        other = (idx < start) | (idx >= end)
        for which in ("q", "k"):
            qi, ki = (_perturbed(q, p), k) if which == "q" else (q, _perturbed(k, p))
            o, g = _fwd_bwd(qi, ki, v, cu, m, route, do if has_bwd else None)
            tag = f"{route}: {which}[{p}] x{SCALE:g}"
            # one scale for the whole tensor: the outlier moves every code, hence earlier rows
            assert not torch.equal(o[earlier], base_o[earlier]), f"{tag}: expected a leak into earlier rows"
            assert not torch.equal(o[other], base_o[other]), f"{tag}: expected a leak into other documents"
            if has_bwd:
                moved = (g[0][earlier].float() - base_g[0][earlier].float()).abs().max().item()
                assert moved > 4 * noise, f"{tag}: dQ of earlier rows moved {moved:.3g} (noise {noise:.3g})"


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["fp8_token", "bf16", "fp8_tensor", "fp8_token_bf16qk", "fp8_pv", "mxfp8_exact"])
def test_gpu_leakage_probe_on_the_op(route):
    """fp8_token, fp8_token_bf16qk, fp8_pv, mxfp8_exact (and bf16, the control) are exact: a token only reaches its own
    and later rows of its document. fp8_tensor is leaky by design (specs/routes/fp8_tensor.yaml): the probe must see it."""
    _need_cuda()
    _gpu_bundle(route)
    if route == "fp8_tensor":
        _tensor_scale_probe(route)
    else:
        _exact_route_probe(route)


# ---------------------------------------------------------------- 4. a tiny transformer trains through the op


VOCAB, D_MODEL, HEADS, HEAD_DIM = 512, 256, 2, 128
LM_LENS = [512, 256, 1024, 256]  # T = 2048
LM_STEPS = 30
P_PATTERN = 0.75  # next = (7 * token + 3) % VOCAB with this probability, else uniform


class _Block(torch.nn.Module):
    def __init__(self, route):
        super().__init__()
        self.route = route
        self.ln1 = torch.nn.LayerNorm(D_MODEL)
        self.qkv = torch.nn.Linear(D_MODEL, 3 * HEADS * HEAD_DIM, bias=False)
        self.proj = torch.nn.Linear(HEADS * HEAD_DIM, D_MODEL, bias=False)
        self.ln2 = torch.nn.LayerNorm(D_MODEL)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D_MODEL, 4 * D_MODEL), torch.nn.GELU(),
                                       torch.nn.Linear(4 * D_MODEL, D_MODEL))

    def attend(self, q, k, v, cu, max_seqlen):
        return flamia_gen.attention(q, k, v, cu, max_seqlen, causal=True, route=self.route)

    def forward(self, x, cu, max_seqlen):
        T = x.shape[0]
        qkv = self.qkv(self.ln1(x)).view(T, 3, HEADS, HEAD_DIM).to(torch.bfloat16)
        q, k, v = (qkv[:, i].contiguous() for i in range(3))  # (T, H, 128) BF16 contiguous
        o = self.attend(q, k, v, cu, max_seqlen)
        x = x + self.proj(o.reshape(T, HEADS * HEAD_DIM).to(x.dtype))
        return x + self.mlp(self.ln2(x))


class _TinyLM(torch.nn.Module):
    block = _Block

    def __init__(self, route):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D_MODEL)
        self.blocks = torch.nn.ModuleList([self.block(route) for _ in range(2)])
        self.ln_f = torch.nn.LayerNorm(D_MODEL)
        self.head = torch.nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens, targets, cu, max_seqlen):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x, cu, max_seqlen)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100)


def _lm_batches(steps=LM_STEPS, lens=LM_LENS, seed=1234):
    """`steps` packed rows (tokens, targets) from a fixed generator: inside a document the next
    token is (7 * token + 3) % VOCAB with probability P_PATTERN, else uniform (so the loss has a
    floor of about 2.1 nats, far from 0: a relative comparison of two routes stays meaningful);
    targets stop at document ends (-100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        toks, tgts = [], []
        for n in lens:
            rnd = torch.randint(VOCAB, (n,), generator=g).tolist()
            keep = (torch.rand(n, generator=g) < P_PATTERN).tolist()
            t = [rnd[0]]
            for i in range(1, n):
                t.append((7 * t[-1] + 3) % VOCAB if keep[i] else rnd[i])
            toks += t
            tgts += t[1:] + [-100]
        out.append((torch.tensor(toks), torch.tensor(tgts)))
    return out


def _cu(lens, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _train_lm(route, batches, device, model_cls=_TinyLM, compile=True, steps=LM_STEPS):
    torch.manual_seed(0)  # the same initial weights for every route
    model = model_cls(route).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fwd = torch.compile(model) if compile else model
    cu, m = _cu(LM_LENS, device), max(LM_LENS)
    losses = []
    for tokens, targets in batches[:steps]:
        loss = fwd(tokens.to(device), targets.to(device), cu, m)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
def test_gpu_two_layer_transformer_trains():
    for route in ("fp8_token", "bf16"):
        _need_bwd(route, True)
    batches = _lm_batches()
    torch._dynamo.reset()
    losses = {route: _train_lm(route, batches, "cuda") for route in ("fp8_token", "bf16")}
    for route, ls in losses.items():
        assert all(torch.isfinite(torch.tensor(ls))), f"{route}: non-finite loss {ls}"
        assert ls[-1] <= 0.7 * ls[0], f"{route}: loss {ls[0]:.3f} -> {ls[-1]:.3f}, less than a 30% drop ({ls})"
    f8, b16 = losses["fp8_token"][-1], losses["bf16"][-1]
    assert abs(f8 - b16) <= 0.15 * b16, f"final loss fp8_token {f8:.4f} vs bf16 {b16:.4f}: more than 15% apart"
