"""Causal-leakage probe (DESIGN.md §5).

Perturb one future token's q, k, v or dO (×factor, all heads) and measure how much every
EARLIER O row and dQ row of the same document, and every row of every other document, moves.
dK and dV are not measured: earlier keys' gradients legitimately depend on later queries.
A route is exact when every measured change is exactly 0 (bitwise equal rows).

The change of a row is ‖Δ‖ / ‖base‖ over its heads and head dim (`metrics.max_rel_change`:
0 iff the row is bitwise equal, inf when a zero row moves); a probe value is the max over
measured rows, and a NaN (a NaN/Inf appeared) counts as inf, never as 0.
`*_outside_block` restricts the same-document rows to those in an earlier 32-token block than
the perturbed token (what a token-block route like `mxfp8` must keep at exactly 0).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from .metrics import max_rel_change

__all__ = ["ProbeRecord", "ProbeResult", "leakage_probe", "default_positions"]

OPERANDS = ("q", "k", "v", "do")


@dataclass(frozen=True)
class ProbeRecord:
    operand: str
    position: int  # global token index that was perturbed
    doc: int
    o_leak: float
    dq_leak: float
    o_leak_outside_block: float
    dq_leak_outside_block: float


@dataclass
class ProbeResult:
    o_leak: dict[str, float]  # per operand: max change of earlier/other-doc O rows
    dq_leak: dict[str, float]  # per operand: same for dQ rows
    o_leak_outside_block: dict[str, float]
    dq_leak_outside_block: dict[str, float]
    max_leak: float
    exact: bool  # max_leak == 0.0 exactly
    positions: list[int]
    factor: float
    block: int
    records: list[ProbeRecord] = field(default_factory=list)

    @property
    def max_leak_outside_block(self) -> float:
        vals = list(self.o_leak_outside_block.values()) + list(self.dq_leak_outside_block.values())
        return max(vals, default=0.0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["max_leak_outside_block"] = self.max_leak_outside_block
        return d


def default_positions(cu_seqlens: torch.Tensor) -> list[int]:
    """Two positions in the longest document: inside a 32-token block past its middle (so the
    block holds earlier rows) and the last token."""
    cl = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cl, cl[1:])]
    d = max(range(len(lens)), key=lambda i: lens[i])
    s, L = cl[d], lens[d]
    if L < 2:
        return [s] if L else []
    mid = min(L - 1, (L // 2 // 32) * 32 + 17)
    return sorted({s + max(1, mid), s + L - 1})


def _doc_of(cl: list[int], pos: int) -> int:
    for d, (a, b) in enumerate(zip(cl, cl[1:])):
        if a <= pos < b:
            return d
    raise ValueError(f"position {pos} is outside the packed rows [0, {cl[-1]})")


def _row_masks(cl: list[int], pos: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(measured rows, measured rows in an earlier block) as (T,) bool masks."""
    T = cl[-1]
    d = _doc_of(cl, pos)
    s, e = cl[d], cl[d + 1]
    t = torch.arange(T, device=device)
    other = (t < s) | (t >= e)
    earlier = (t >= s) & (t < pos)
    earlier_block = earlier & ((t - s) // block < (pos - s) // block)
    return other | earlier, other | earlier_block


def _run(attn_fn, q, k, v, cu, do):
    qq = q.detach().clone().requires_grad_(True)
    o = attn_fn(qq, k, v, cu)
    (dq,) = torch.autograd.grad(o, qq, do)
    return o.detach(), dq.detach()


def _change(new: torch.Tensor, base: torch.Tensor, rows: torch.Tensor) -> float:
    c = max_rel_change(new, base, rows=rows)
    return math.inf if math.isnan(c) else c


def leakage_probe(attn_fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cu_seqlens: torch.Tensor, *, positions: Sequence[int] | None = None, factor: float = 1e4,
                  operands: Sequence[str] = OPERANDS, do: torch.Tensor | None = None, seed: int = 0,
                  block: int = 32) -> ProbeResult:
    """Run the probe. `attn_fn(q, k, v, cu_seqlens) -> O` must be autograd capable (dQ comes
    from torch.autograd.grad with `do`, drawn from N(0,1) with `seed` when not given).
    `positions` are global token indices to perturb (default: `default_positions`)."""
    bad = [op for op in operands if op not in OPERANDS]
    if bad:
        raise ValueError(f"operands {bad} unknown; allowed values: {list(OPERANDS)}")
    if do is None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        do = torch.randn(q.shape, generator=gen, dtype=torch.float32).to(q.device, q.dtype)
    cl = cu_seqlens.tolist()
    pos_list = list(default_positions(cu_seqlens) if positions is None else positions)
    o0, dq0 = _run(attn_fn, q, k, v, cu_seqlens, do)
    records = []
    for op in operands:
        for p in pos_list:
            inputs = {"q": q, "k": k, "v": v, "do": do}
            x = inputs[op].detach().clone()
            x[p] = x[p] * factor
            inputs[op] = x
            o1, dq1 = _run(attn_fn, inputs["q"], inputs["k"], inputs["v"], cu_seqlens, inputs["do"])
            rows, rows_blk = _row_masks(cl, p, block, q.device)
            records.append(ProbeRecord(op, p, _doc_of(cl, p), _change(o1, o0, rows), _change(dq1, dq0, rows),
                                       _change(o1, o0, rows_blk), _change(dq1, dq0, rows_blk)))
    return _summarise(records, operands, pos_list, factor, block)


def _summarise(records, operands, positions, factor, block) -> ProbeResult:
    def per_op(attr):
        return {op: max((getattr(r, attr) for r in records if r.operand == op), default=0.0) for op in operands}

    o, dq = per_op("o_leak"), per_op("dq_leak")
    mx = max(list(o.values()) + list(dq.values()), default=0.0)
    return ProbeResult(o, dq, per_op("o_leak_outside_block"), per_op("dq_leak_outside_block"), mx,
                       mx == 0.0, list(positions), float(factor), block, records)
