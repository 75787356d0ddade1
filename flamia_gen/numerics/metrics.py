"""Accuracy metrics, computed in fp64 and returned as Python floats.

NaN policy: a NaN or ±Inf anywhere in an input makes every metric NaN, so a result never
passes a ``>=`` (or ``<=``) threshold by accident (``nan >= 0.99`` is False).

Zero conventions (0/0 is "no difference", x/0 with x ≠ 0 is "infinitely different"):

* ``cosine``: both all-zero → 1.0; exactly one all-zero → 0.0.
* ``rel_error`` and each row of ``max_rel_change``: ``b`` zero and ``a`` zero → 0.0;
  ``b`` zero and ``a`` not → inf.
* ``sqnr_db``: identical → inf; ``ref`` all-zero and ``x`` not → -inf.
"""

from __future__ import annotations

import math

import torch

__all__ = ["cosine", "rel_error", "sqnr_db", "max_rel_change"]


def _pair(a: torch.Tensor, b: torch.Tensor, names=("a", "b")) -> tuple[torch.Tensor, torch.Tensor]:
    for n, t in zip(names, (a, b)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"{names[0]} and {names[1]} must have the same shape, "
                         f"got {tuple(a.shape)} and {tuple(b.shape)}")
    return a.detach().to(torch.float64), b.detach().to(torch.float64)


def _finite(*ts: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors, in fp64."""
    a, b = _pair(a, b)
    if not _finite(a, b):
        return math.nan
    a, b = a.reshape(-1), b.reshape(-1)
    na, nb = torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(b).item()
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(torch.dot(a, b).item() / (na * nb))


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (Frobenius, fp64); ``b`` is the reference."""
    a, b = _pair(a, b)
    if not _finite(a, b):
        return math.nan
    num = torch.linalg.vector_norm(a - b).item()
    den = torch.linalg.vector_norm(b).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10·log10(‖ref‖² / ‖x − ref‖²)`` in dB."""
    x, ref = _pair(x, ref, ("x", "ref"))
    if not _finite(x, ref):
        return math.nan
    noise = torch.sum((x - ref) ** 2).item()
    sig = torch.sum(ref ** 2).item()
    if noise == 0.0:
        return math.inf
    if sig == 0.0:
        return -math.inf
    return 10.0 * math.log10(sig / noise)


def max_rel_change(a: torch.Tensor, b: torch.Tensor, rows=None) -> float:
    """max over rows i of ‖a_i − b_i‖ / ‖b_i‖, fp64 (the leakage probe's measure).

    A row is ``a[i]`` along dim 0, flattened (for ``(T, H, D)``: token i, all heads;
    reshape to ``(T*H, D)`` for per-head rows). ``rows`` selects rows along dim 0: None (all),
    a bool mask, an index tensor / list, or a slice. ``b`` is the unperturbed reference.
    Per row: 0/0 → 0, x/0 → inf. No rows selected → 0.0. NaN/Inf anywhere selected → NaN.
    """
    a, b = _pair(a, b)
    if a.dim() == 0:
        a, b = a.reshape(1), b.reshape(1)
    if rows is not None:
        if isinstance(rows, (list, tuple)):
            rows = torch.as_tensor(rows, dtype=torch.long)
        if isinstance(rows, torch.Tensor):
            rows = rows.to(a.device)
        a, b = a[rows], b[rows]
    if a.shape[0] == 0:
        return 0.0
    if not _finite(a, b):
        return math.nan
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    num = torch.linalg.vector_norm(a - b, dim=1)
    den = torch.linalg.vector_norm(b, dim=1)
    ratio = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)),
                        torch.where(num > 0, torch.full_like(num, math.inf), torch.zeros_like(num)))
    return float(ratio.max().item())
