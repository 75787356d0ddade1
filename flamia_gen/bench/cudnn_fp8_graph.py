"""cuDNN frontend graphs for FP8 SDPA forward and backward (``sdpa_fp8`` ops).

Isolated from the adapter because it is the part that depends on the
frontend's Python API, which changes between releases (1.x exposes
``generate_stats``, older ones ``is_inference``; newer engines decline a graph
that asks for Amax_S). Everything here raises on failure; the adapter turns
that into a reported skip with the exception text.

Layout: the packed (T, H, D) buffer of B equal documents of length L is
(B, L, H, D) in memory; cuDNN gets dims (B, H, L, D) with BSHD strides, so no
transpose copy is made. Every operand is FP8 E4M3 with a per-tensor float32
scale; on Hopper the outputs (O, dQ, dK, dV) are FP8 too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SCALAR_DIM = (1, 1, 1, 1)

FWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s",
               "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
BWD_AMAX = ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")


def bshd_strides(b: int, h: int, length: int, d: int) -> tuple[int, int, int, int]:
    """Strides of dims (B, H, L, D) over memory laid out (B, L, H, D)."""
    del b
    return (length * h * d, d, h * d, 1)


def stats_strides(b: int, h: int, length: int) -> tuple[int, int, int, int]:
    del b
    return (h * length, length, 1, 1)


@dataclass
class BuiltGraph:
    graph: Any
    tensors: dict[str, Any] = field(default_factory=dict)  # our name -> graph tensor
    workspace_size: int = 0

    def pack(self, buffers: dict[str, Any]) -> dict[Any, Any]:
        """Variant pack from our names; a missing buffer is a KeyError naming it."""
        return {t: buffers[n] for n, t in self.tensors.items()}


def _finalize(cudnn, g) -> None:
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()


def _new_graph(cudnn, handle):
    fp8 = cudnn.data_type.FP8_E4M3
    return cudnn.pygraph(io_data_type=fp8, intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=handle)


def _scalars(cudnn, g, names, tensors):
    for n in names:
        tensors[n] = g.tensor(name=n, dim=SCALAR_DIM, stride=SCALAR_DIM,
                              data_type=cudnn.data_type.FLOAT)


def _mark_scalar_output(cudnn, t) -> None:
    t.set_output(True).set_dim(SCALAR_DIM).set_stride(SCALAR_DIM).set_data_type(
        cudnn.data_type.FLOAT)


def build_fwd(cudnn, handle, b: int, h: int, length: int, d: int, causal: bool,
              train: bool, declare_amax_s: bool = False) -> BuiltGraph:
    """O (FP8), Amax_O and, when ``train``, the softmax stats for the backward."""
    fp8 = cudnn.data_type.FP8_E4M3
    dims, strides = (b, h, length, d), bshd_strides(b, h, length, d)
    g = _new_graph(cudnn, handle)
    t: dict[str, Any] = {}
    for n in ("q", "k", "v"):
        t[n] = g.tensor(name=n.upper(), dim=dims, stride=strides, data_type=fp8)
    _scalars(cudnn, g, FWD_SCALARS, t)
    kwargs = dict(q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"],
                  descale_k=t["descale_k"], descale_v=t["descale_v"],
                  descale_s=t["descale_s"], scale_s=t["scale_s"], scale_o=t["scale_o"],
                  attn_scale=1.0 / math.sqrt(d), use_causal_mask=causal,
                  name="flamia_bench_sdpa_fp8")
    try:  # frontend >= 1.8 spells it generate_stats
        outs = g.sdpa_fp8(generate_stats=train, **kwargs)
    except TypeError:
        outs = g.sdpa_fp8(is_inference=not train, **kwargs)
    o, stats, amax_s, amax_o = outs
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(fp8)
    t["o"] = o
    if train:
        stats.set_output(True).set_dim((b, h, length, 1)).set_stride(
            stats_strides(b, h, length)).set_data_type(cudnn.data_type.FLOAT)
        t["stats"] = stats
    _mark_scalar_output(cudnn, amax_o)
    t["amax_o"] = amax_o
    if declare_amax_s:  # older engines want every output bound
        _mark_scalar_output(cudnn, amax_s)
        t["amax_s"] = amax_s
    _finalize(cudnn, g)
    return BuiltGraph(g, t, int(g.get_workspace_size()))


def build_bwd(cudnn, handle, b: int, h: int, length: int, d: int, causal: bool) -> BuiltGraph:
    """dQ, dK, dV (FP8) and their amaxes plus Amax_dP, from FP8 q, k, v, o, dO."""
    fp8 = cudnn.data_type.FP8_E4M3
    dims, strides = (b, h, length, d), bshd_strides(b, h, length, d)
    g = _new_graph(cudnn, handle)
    t: dict[str, Any] = {}
    for n in ("q", "k", "v", "o", "dO"):
        t[n] = g.tensor(name=n, dim=dims, stride=strides, data_type=fp8)
    t["stats"] = g.tensor(name="stats", dim=(b, h, length, 1),
                          stride=stats_strides(b, h, length), data_type=cudnn.data_type.FLOAT)
    _scalars(cudnn, g, BWD_SCALARS, t)
    outs = g.sdpa_fp8_backward(
        q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"],
        descale_q=t["descale_q"], descale_k=t["descale_k"], descale_v=t["descale_v"],
        descale_o=t["descale_o"], descale_dO=t["descale_dO"], descale_s=t["descale_s"],
        descale_dP=t["descale_dP"], scale_s=t["scale_s"], scale_dQ=t["scale_dQ"],
        scale_dK=t["scale_dK"], scale_dV=t["scale_dV"], scale_dP=t["scale_dP"],
        attn_scale=1.0 / math.sqrt(d), use_causal_mask=causal,
        name="flamia_bench_sdpa_fp8_backward")
    dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = outs
    for n, x in (("dQ", dq), ("dK", dk), ("dV", dv)):
        x.set_output(True).set_dim(dims).set_stride(strides).set_data_type(fp8)
        t[n] = x
    for n, x in zip(BWD_AMAX, (amax_dq, amax_dk, amax_dv, amax_dp)):
        _mark_scalar_output(cudnn, x)
        t[n] = x
    _finalize(cudnn, g)
    return BuiltGraph(g, t, int(g.get_workspace_size()))


def build_fwd_any(cudnn, handle, b, h, length, d, causal, train) -> BuiltGraph:
    """build_fwd, retried with Amax_S bound if the first form is refused."""
    try:
        return build_fwd(cudnn, handle, b, h, length, d, causal, train)
    except Exception as first:
        try:
            return build_fwd(cudnn, handle, b, h, length, d, causal, train, declare_amax_s=True)
        except Exception:
            raise first from None
