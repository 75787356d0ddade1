"""Attention forward kernels on the local GPU vs the numerics emulator and fp32.

Per variant and input kind: O cosine vs the route's emulator (≥ 0.99999) and vs exact
fp32 (≥ 0.998 for 8-bit routes on Gaussian inputs), no NaN, every element written
(outputs are poisoned with NaN first), LSE agreement, and the leakage probe run on the
kernel itself: perturbing a later token's q, k, v (×1e4) must leave every earlier O row
of its document, and every row of other documents, bitwise unchanged on exact routes.
"""

from __future__ import annotations

import time

import torch

from ..numerics import quantize
from ..numerics.metrics import cosine
from ..numerics.reference import attention as ref_attention
from ..bench.flops import attention_flops
from ..runtime.attention import per_token_scales
from ..runtime.attn_fwd import make_work_list, run_attn_fwd
from ..spec import get_route

# Kernel vs emulator, every input kind. Outlier rows fail it today (0.99978–0.99982 on
# the H200): most P̂ fall in E4M3's subnormal range, where the kernel (P̂ under the running
# max of the tiles seen so far) and the emulator (P̂ under the final max) round
# differently. The fix belongs in the emulator (emulate the kernel's tile order), not in
# a looser bound here.
EMULATOR_COSINE = 0.99999
FP32_COSINE_8BIT = 0.998


def make_docs(kind: str, gen: torch.Generator) -> list[int]:
    if kind == "tiny_docs":
        return [1, 2, 3, 1, 5, 130, 1, 64, 127, 129]
    if kind == "one_doc":
        return [2048]
    # varied lengths that end mid-tile and include a length-1 document
    return [300, 1000, 1, 129, 2048, 77]


def make_qkv(doc_lens, hq, hkv, d, kind, gen, device):
    T = sum(doc_lens)
    q = torch.randn(T, hq, d, generator=gen, device="cpu")
    k = torch.randn(T, hkv, d, generator=gen, device="cpu")
    v = torch.randn(T, hkv, d, generator=gen, device="cpu")
    if kind == "outlier":
        idx = torch.randint(0, T, (max(1, T // 64),), generator=gen)
        q[idx] *= 30.0
        k[idx] *= 30.0
        v[idx] *= 100.0
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(doc_lens), 0).tolist()), dtype=torch.int32)
    to = dict(device=device)
    return (q.to(torch.bfloat16).to(**to), k.to(torch.bfloat16).to(**to), v.to(torch.bfloat16).to(**to),
            cu.to(**to))


def kernel_inputs(route, q, k, v, cu):
    """What the fused quantizer hands the forward (made here by the emulator, which the
    quantizer kernels are bitwise equal to)."""
    ops = route.operands
    if not ops.q.quantized:
        return dict(q=q.contiguous(), k=k.contiguous(), v=v.contiguous())
    qq = quantize(q, ops.q, cu)
    kq = quantize(k, ops.k, cu)
    vq = quantize(v, ops.v, cu)
    return dict(q=qq.codes, q_scale=per_token_scales(qq.scales, q), k=kq.codes, k_scale=per_token_scales(kq.scales, k),
                v=vq.codes_t, v_scale=per_token_scales(vq.scales, v))


def run_kernel(fn, entry, route, q, k, v, cu, poison=True):
    ins = kernel_inputs(route, q, k, v, cu)
    return run_attn_fwd(fn, entry["args"], cu_seqlens=cu, params=entry["params"], poison=poison, **ins)


def probe_kernel(fn, entry, route, q, k, v, cu, factor=1e4, n_positions=3) -> dict:
    """Perturb token `pos` of a document: every earlier row of that document and every row
    of every other document must not move (rows pos..end of its document may)."""
    o0, _ = run_kernel(fn, entry, route, q, k, v, cu)
    lens = (cu[1:] - cu[:-1]).tolist()
    docs = [i for i, n in enumerate(lens) if n >= 64]
    worst = 0.0
    for i in range(n_positions):
        d = docs[i % len(docs)]
        start, end = int(cu[d]), int(cu[d + 1])
        pos = start + (end - start) * (i + 1) // (n_positions + 1)
        keep = torch.ones(o0.shape[0], dtype=torch.bool, device=o0.device)
        keep[pos:end] = False
        for which in ("q", "k", "v"):
            t = dict(q=q, k=k, v=v)
            t[which] = t[which].clone()
            t[which][pos] = (t[which][pos].float() * factor).to(torch.bfloat16)
            o1, _ = run_kernel(fn, entry, route, t["q"], t["k"], t["v"], cu)
            a, b = o0[keep].float(), o1[keep].float()
            diff = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return {"probe_max_rel_change": worst, "probe_exact": worst == 0.0}


def verify_attn_entry(bundle, entry, *, kinds=("gauss", "outlier", "tiny_docs"), hq=4, hkv=2, seed=0,
                      probe=True) -> list[dict]:
    route = get_route(entry["uses"][0])
    fn = bundle.get(entry["name"])
    params = entry["params"]
    causal = params["causal"]
    d = params["head_dim"]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for kind in kinds:
        t0 = time.perf_counter()
        docs = make_docs(kind, gen)
        q, k, v, cu = make_qkv(docs, hq, hkv, d, kind, gen, "cuda")
        o, lse = run_kernel(fn, entry, route, q, k, v, cu)
        torch.cuda.synchronize()
        emu, emu_lse = ref_attention(q, k, v, cu, causal=causal, route=route.name, tile_m=params["tile_m"],
                                     tile_n=params["tile_n"], return_lse=True)
        exact = ref_attention(q, k, v, cu, causal=causal, route=None)
        nan = int(torch.isnan(o).sum())
        # the kernel writes BF16: the emulator of its numerics includes that final rounding
        c_emu = float(cosine(o.float(), emu.to(torch.bfloat16).float()))
        c_ref = float(cosine(o.float(), exact.float()))
        lse_k = lse.transpose(0, 1) if lse.shape[0] == hq else lse
        fin = torch.isfinite(emu_lse)
        # relative to the row's LSE: outlier rows reach logits of several hundred
        lse_err = float(((lse_k[fin] - emu_lse[fin]).abs() / emu_lse[fin].abs().clamp_min(1.0)).max()) \
            if fin.any() else 0.0
        lse_inf_ok = bool((torch.isinf(lse_k) == torch.isinf(emu_lse)).all())
        need_ref = FP32_COSINE_8BIT if route.quantized else 0.99999
        ok = nan == 0 and c_emu >= EMULATOR_COSINE and (kind == "outlier" or c_ref >= need_ref) and lse_err < 2e-3 \
            and lse_inf_ok
        row = dict(variant=entry["name"], route=route.name, kind=kind, T=int(cu[-1]), docs=len(docs),
                   nan=nan, cos_emulator=c_emu, cos_fp32=c_ref, lse_max_rel_err=lse_err, lse_inf_ok=lse_inf_ok)
        if probe and kind == "gauss" and causal:
            row.update(probe_kernel(fn, entry, route, q, k, v, cu))
            if route.exact:
                ok = ok and row["probe_exact"]
            elif any(oq.granularity.value == "tensor" for _, oq in route.operands.items()):
                # a tensor-wide amax must show up: a probe that sees nothing here is broken
                ok = ok and row["probe_max_rel_change"] > 0
        row["ok"] = ok
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
    return rows


def time_attn_entry(bundle, entry, doc_lens, heads=16, iters=20, inputs_cache: dict | None = None) -> dict:
    """Kernel-only time (inputs already quantized, work list built once outside the
    timer), CUDA events, median; causal FLOPs.
    `inputs_cache` (a dict the caller keeps) shares the input sets between variants of one
    route and shape (making them on the CPU costs seconds at T = 16384)."""
    from ..bench.timing import time_cuda

    route = get_route(entry["uses"][0])
    fn = bundle.get(entry["name"])
    d = entry["params"]["head_dim"]
    p = entry["params"]
    key = (route.name, tuple(doc_lens), heads, d, p["tile_m"], p.get("tile_n"), p["causal"])
    sets = inputs_cache.get(key) if inputs_cache is not None else None
    if sets is None:
        gen = torch.Generator().manual_seed(1)
        sets = []
        for _ in range(3):  # rotate inputs so L2 does not hold them
            q, k, v, cu = make_qkv(doc_lens, heads, heads, d, "gauss", gen, "cuda")
            ins = kernel_inputs(route, q, k, v, cu)
            p = entry["params"]
            work = make_work_list(cu, p["tile_m"], p["causal"], T=q.shape[0], tile_n=p.get("tile_n"))
            sets.append((ins, cu, work))
        if inputs_cache is not None:
            inputs_cache[key] = sets

    def caller(i):
        ins, cu, work = sets[i]
        return lambda: run_attn_fwd(fn, entry["args"], cu_seqlens=cu, params=entry["params"], work=work, **ins)

    st = time_cuda([caller(i) for i in range(len(sets))], warmup=5, repeats=iters, measure_memory=False)
    fl = attention_flops(doc_lens, heads, d, causal=entry["params"]["causal"])
    return dict(variant=entry["name"], median_ms=st.median_ms, tflops=fl / (st.median_ms * 1e-3) / 1e12)
