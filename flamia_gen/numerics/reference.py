"""Reference attention over packed documents: exact (route=None) or the emulated kernel
numerics of a route, forward and backward (DESIGN.md §1, §4; docs/numerics.md).

    attention(q, k, v, cu_seqlens, causal=True, route=None, *, tile_m=128, tile_n=128,
              dtype=torch.float32, return_lse=False, scale=None, key_align=1, mma="exact")
    attention_backward(q, k, v, o, lse, do, cu_seqlens, causal=True, route=None, *,
                       tile_m=128, tile_n=128, scale=None, mma="exact", key_align=1,
                       fwd_tile_m=None, fwd_tile_n=None) -> (dq, dk, dv)

Both are differentiable / explicit respectively; `attention(..., route=R)` is an autograd
function whose backward is `attention_backward(..., route=R)`.
"""

from __future__ import annotations

import torch

from ..spec.route import Route
from .reference_exact import check_inputs, exact_attention
from .reference_route import route_backward, route_forward

__all__ = ["attention", "attention_backward", "resolve_route"]


def resolve_route(route: Route | str | None) -> Route | None:
    if route is None or isinstance(route, Route):
        return route
    if isinstance(route, str):
        from ..spec.loader import get_route

        return get_route(route)
    raise ValueError(f"route must be None, a route name or a Route, got {type(route).__name__}")


class _RouteAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, causal, route, tile_m, tile_n, scale, key_align, mma):
        o, lse = route_forward(route, q, k, v, cu_seqlens, causal, tile_m=tile_m, tile_n=tile_n, scale=scale,
                               key_align=key_align, mma=mma)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.cfg = (causal, route, tile_m, tile_n, scale, key_align)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, cu = ctx.saved_tensors
        causal, route, tile_m, tile_n, scale, key_align = ctx.cfg
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = route_backward(route, q, k, v, o, lse, do, cu, causal, tile_m=tile_m, tile_n=tile_n,
                                    scale=scale, key_align=key_align)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None


def attention(q, k, v, cu_seqlens, causal=True, route=None, *, tile_m=128, tile_n=128, dtype=torch.float32,
              return_lse=False, scale=None, key_align=1, mma="exact"):
    """Attention over packed documents `(T, H, D)` with int32 `cu_seqlens`.

    route=None: exact, computed in `dtype` (fp32 or fp64), differentiable by autograd.
    route (name or Route): the route's emulated kernel numerics (inputs rounded to BF16 as the
    kernel receives them, fp32 arithmetic); autograd gives the emulated dQ, dK, dV. O is returned
    in `dtype`; LSE (T, Hq) fp32 natural log, +inf for a row with no visible key (O = 0 there).
    `tile_m`, `tile_n`, `key_align` are the forward kernel's tiling (its key tiles start at the
    document start rounded down to `key_align`): they set the diagonal tiles and the order in
    which P̂ is rounded under the running max. `mma`: "exact" (fp32 sums) or "sm90_fp8" (the
    Hopper FP8 tensor cores' truncated accumulation, numerics.mma: slow, for kernel checks).
    """
    r = resolve_route(route)
    if r is None:
        return exact_attention(q, k, v, cu_seqlens, causal, dtype=dtype, scale=scale, return_lse=return_lse)
    check_inputs(q, k, v, cu_seqlens)
    o, lse = _RouteAttention.apply(q, k, v, cu_seqlens, causal, r, tile_m, tile_n, scale, key_align, mma)
    o = o.to(dtype)
    return (o, lse) if return_lse else o


def attention_backward(q, k, v, o, lse, do, cu_seqlens, causal=True, route=None, *, tile_m=128, tile_n=128,
                       scale=None, mma="exact", key_align=1, fwd_tile_m=None, fwd_tile_n=None, dq_bf16=False,
                       dk_bf16=False):
    """(dQ, dK, dV) fp32 of `attention` for output gradient `do`.

    route=None: gradients of the exact fp32 attention (autograd of the exact forward; `o`, `lse`
    are not needed and ignored). With a route: the emulated kernel backward, which recomputes
    scores from the forward's quantized operands and diagonal decisions, takes `o` and `lse`
    as given (D = rowsum(dÔ∘O) uses them) and processes documents in query chunks. `mma`: the
    tensor-core model of the recomputed scores ("exact" or "sm90_fp8", numerics.mma). `tile_m`,
    `tile_n`, `key_align`: the forward kernel's tiling (its diagonal decisions are repeated), or under
    "sm90_fp8" the backward kernel's, the forward's tiles then `fwd_tile_m`, `fwd_tile_n` (default:
    the same).
    """
    r = resolve_route(route)
    if r is not None:
        return route_backward(r, q, k, v, o, lse, do, cu_seqlens, causal, tile_m=tile_m, tile_n=tile_n,
                              scale=scale, mma=mma, key_align=key_align, fwd_tile_m=fwd_tile_m,
                              fwd_tile_n=fwd_tile_n, dq_bf16=dq_bf16, dk_bf16=dk_bf16)
    with torch.enable_grad():
        leaves = [t.detach().to(torch.float32).requires_grad_(True) for t in (q, k, v)]
        out = exact_attention(*leaves, cu_seqlens, causal, scale=scale)
        grads = torch.autograd.grad(out, leaves, do.to(torch.float32))
    return tuple(grads)
