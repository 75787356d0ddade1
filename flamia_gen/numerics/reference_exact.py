"""Exact attention over packed documents (fp32 or fp64), differentiable by plain autograd.

This is the accuracy yardstick (DESIGN.md §5): no quantization, no BF16 rounding, natural-log
softmax. It shares no numerics code with the route emulator (`reference_route`), so the two
check each other (the `bf16` route's explicit backward must equal autograd of this forward).
"""

from __future__ import annotations

import math

import torch

__all__ = ["exact_attention", "check_inputs", "chunk_rows", "doc_ranges", "query_chunks", "softmax_scale",
           "visible_mask"]


# ---- packed-document geometry, shared with the route emulator


def check_inputs(q, k, v, cu_seqlens):
    """Validate packed (T, H, D) inputs; returns (T, Hq, D, group) with group = Hq // Hkv."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point (T, H, D) tensor")
    T, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k and v must be (T, Hkv, D) = (T={T}, Hkv, D={D}); got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if Hq % k.shape[1]:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({k.shape[1]})")
    cu = cu_seqlens
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
        raise ValueError("cu_seqlens must be a 1-D integer tensor (num_docs + 1,)")
    cl = cu.tolist()
    if cl[0] != 0 or cl[-1] != T or any(b < a for a, b in zip(cl, cl[1:])):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={T}; got {cl}")
    return T, Hq, D, Hq // k.shape[1]


def softmax_scale(head_dim, scale=None):
    """The score scale: `scale` as a float, or 1/sqrt(head_dim) when None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def doc_ranges(cu_seqlens):
    """[(start, end)] of the non-empty documents."""
    cl = cu_seqlens.tolist()
    return [(a, b) for a, b in zip(cl, cl[1:]) if b > a]


SCORE_BUDGET = 1 << 24  # elements of one (heads × rows × keys) score-sized temporary (64 MiB fp32)


def chunk_rows(chunk, heads, length, align=1):
    """Query rows per step: at most `chunk`, fewer when heads × rows × length would exceed
    SCORE_BUDGET, a multiple of `align` (the query tile) and at least `align`."""
    fit = SCORE_BUDGET // max(1, heads * length)
    return max(align, (min(chunk, fit) // align) * align)


def query_chunks(length, chunk):
    """[(a, b)] doc-local query row ranges of at most `chunk` rows."""
    return [(a, min(a + chunk, length)) for a in range(0, length, chunk)]


def visible_mask(a, rows, keys, causal, device):
    """(rows, keys) bool: key j visible to doc-local query a + r (all keys when not causal)."""
    if not causal:
        return torch.ones(rows, keys, dtype=torch.bool, device=device)
    i = torch.arange(a, a + rows, device=device)[:, None]
    j = torch.arange(keys, device=device)[None, :]
    return j <= i


def _exact_chunk(qc, kd, vd, a, causal, scale):
    """One query chunk of one document. qc (H, M, D), kd/vd (H, N, D); rows are doc-local a.."""
    s = torch.einsum("hmd,hnd->hmn", qc, kd) * scale
    vis = visible_mask(a, qc.shape[1], kd.shape[1], causal, s.device)
    s = s.masked_fill(~vis, float("-inf"))
    empty = ~vis.any(dim=-1)  # (M,): rows with no visible key (from the mask, not the values)
    m = s.amax(dim=-1, keepdim=True).detach() if s.shape[-1] else s.new_zeros(*s.shape[:-1], 1)
    m = torch.where(empty[None, :, None], torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(dim=-1)
    l_safe = torch.where(empty[None, :], torch.ones_like(l), l)
    o = torch.einsum("hmn,hnd->hmd", p, vd) / l_safe[..., None]
    lse = torch.where(empty[None, :], torch.full_like(l, float("inf")), m[..., 0] + torch.log(l_safe))
    return o, lse


def exact_attention(q, k, v, cu_seqlens, causal=True, *, dtype=torch.float32, scale=None,
                    chunk=1024, return_lse=False):
    """softmax(scale·QKᵀ + mask)·V per document, computed in `dtype` (fp32 or fp64).

    q (T, Hq, D), k/v (T, Hkv, D), Hq a multiple of Hkv (GQA: q head h reads kv head
    h // (Hq/Hkv)). Returns O (T, Hq, D) in `dtype`, and LSE (T, Hq) in natural log units when
    `return_lse` (+inf, with O = 0, for a row with no visible key). Queries are processed in
    chunks of at most `chunk` rows (fewer for long documents, `chunk_rows`) so a long document
    never materialises L×L at once (autograd still keeps the per-chunk probabilities for its
    backward: use route="bf16", whose backward is explicit and chunked, for long documents).
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    T, Hq, D, group = check_inputs(q, k, v, cu_seqlens)
    scale = softmax_scale(D, scale)
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    heads = torch.arange(Hq, device=q.device) // group
    outs, lses = [], []
    for s, e in doc_ranges(cu_seqlens):
        kd = kf[s:e].permute(1, 0, 2).index_select(0, heads)
        vd = vf[s:e].permute(1, 0, 2).index_select(0, heads)
        for a, b in query_chunks(e - s, chunk_rows(chunk, Hq, e - s)):
            n = b if causal else e - s
            o, lse = _exact_chunk(qf[s + a:s + b].permute(1, 0, 2), kd[:, :n], vd[:, :n], a, causal, scale)
            outs.append(o.permute(1, 0, 2))
            lses.append(lse.permute(1, 0))
    o = torch.cat(outs) if outs else qf.new_zeros((0, Hq, D))
    lse = torch.cat(lses) if lses else qf.new_zeros((0, Hq))
    if o.shape[0] != T:  # only when cu_seqlens does not cover T (rejected by check_inputs)
        raise AssertionError("documents do not tile the packed rows")
    return (o, lse.to(torch.float32)) if return_lse else o
