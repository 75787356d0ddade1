"""FLOP counting for packed causal attention (DESIGN §5).

Forward, per head, for one document of length L and head dim D:
  causal      4·D·L(L+1)/2   (QKᵀ and PV each 2·D per visible (query, key) pair;
                              a causal document has L(L+1)/2 visible pairs)
  non-causal  4·D·L²
Backward is 2.5x the forward (five matmuls to the forward's two); a training
call is forward + backward = 3.5x. Masked work (pairs across documents or
above the diagonal) is never counted, so a kernel that computes and throws
away masked tiles does not get credit for them.

All arithmetic is on Python ints: exact, no overflow for T = 2^24.
"""

from __future__ import annotations

from typing import Iterable

MODES = ("fwd", "bwd", "train")
# Multipliers over the forward, as (numerator, denominator) so counts stay ints.
_MODE_FACTOR = {"fwd": (2, 2), "bwd": (5, 2), "train": (7, 2)}


def fwd_flops_doc(length: int, head_dim: int, causal: bool = True) -> int:
    """Forward FLOPs of one head over one document."""
    if length < 0 or head_dim < 0:
        raise ValueError("length and head_dim must be >= 0")
    if causal:
        return 4 * head_dim * length * (length + 1) // 2
    return 4 * head_dim * length * length


def attention_flops(doc_lens: Iterable[int], heads: int, head_dim: int,
                    causal: bool = True, mode: str = "fwd") -> int:
    """FLOPs of one call over packed documents, summed over documents and heads."""
    if mode not in _MODE_FACTOR:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    num, den = _MODE_FACTOR[mode]
    fwd = heads * sum(fwd_flops_doc(n, head_dim, causal) for n in doc_lens)
    # fwd is a multiple of 4, so the 5/2 and 7/2 factors stay exact.
    return fwd * num // den


def workload_flops(workload, mode: str = "fwd") -> int:
    """FLOPs of one call of ``mode`` on a :class:`~flamia_gen.bench.workloads.Workload`."""
    return attention_flops(workload.doc_lens, workload.heads, workload.head_dim,
                           workload.causal, mode)


def tflops(flops: int | float, ms: float | None) -> float | None:
    """Rate in TFLOP/s of ``flops`` done in ``ms`` milliseconds (None if no time)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12
