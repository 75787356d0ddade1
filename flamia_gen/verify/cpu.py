"""`flamia-gen verify --device cpu`: every route's emulated numerics against the exact
reference, plus the leakage probe (DESIGN.md §5). No GPU: this checks the emulator itself
(the source of truth GPU kernels are later compared with).

    rows = verify_cpu(["mxfp8", "fp8_token"], docs=4, doc_len=512)
    console.print(render_table(rows)); to_json(rows, "verify.json")
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

__all__ = ["verify_cpu", "make_inputs", "render_table", "to_json", "EXPECT_O_COSINE"]

# Honest floors for Gaussian inputs (D = 128, documents ≥ 256 tokens), O vs the fp32 reference;
# the paper's B200 figures are MXFP8 0.9988, NVFP4 mixed 0.9920 (DESIGN.md §6).
EXPECT_O_COSINE = {"bf16": 0.99999, "nvfp4_mixed": 0.99}
_DEFAULT_8BIT = 0.998


def expected_o_cosine(route: str) -> float:
    return EXPECT_O_COSINE.get(route, _DEFAULT_8BIT)


def make_inputs(docs=4, doc_len=512, heads=4, head_dim=128, seed=0, outliers=False, kv_heads=None):
    """BF16-valued fp32 q, k, v, dO (T, H, D) of `docs` equal documents, and cu_seqlens.
    outliers: 1 token in 64 (of q, k, v) scaled by 32, plus a ×8 channel of k (attention-sink
    and massive-activation style)."""
    gen = torch.Generator().manual_seed(seed)
    T = docs * doc_len
    kvh = heads if kv_heads is None else kv_heads

    def rnd(h):
        return torch.randn(T, h, head_dim, generator=gen)

    q, k, v, do = rnd(heads), rnd(kvh), rnd(kvh), rnd(heads)
    if outliers:
        for x in (q, k, v):
            idx = torch.randperm(T, generator=gen)[: max(1, T // 64)]
            x[idx] *= 32.0
        k[..., int(torch.randint(head_dim, (1,), generator=gen))] *= 8.0
    cu = torch.arange(0, T + 1, doc_len, dtype=torch.int32)
    return tuple(x.to(torch.bfloat16).to(torch.float32) for x in (q, k, v, do)) + (cu,)


def _grads(fn, q, k, v, do):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    o = fn(*leaves)
    return [o.detach()] + [g.detach() for g in torch.autograd.grad(o, leaves, do)]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def verify_cpu(routes: list[str] | None = None, *, docs=4, doc_len=512, heads=4, head_dim=128, seed=0,
               outliers=False, tile_m=128, tile_n=128, reference_dtype=torch.float32, probe=True,
               probe_positions=None) -> list[dict]:
    """One dict per route: cosine and relative error of O, dQ, dK, dV vs the exact reference
    (`reference_dtype` fp32 or fp64), the leakage probe (o_leak, dq_leak, exact, and the leak
    outside the perturbed token's 32-token block), whether the route's `exact` claim holds,
    and the runtime in seconds."""
    from ..numerics.metrics import cosine, rel_error
    from ..numerics.probe import leakage_probe
    from ..numerics.reference import attention
    from ..spec.loader import load_specs

    specs = load_specs()
    names = sorted(specs.routes) if not routes else list(routes)
    for n in names:
        specs.route(n)  # unknown route → SpecError naming the allowed ones
    q, k, v, do, cu = make_inputs(docs, doc_len, heads, head_dim, seed, outliers)
    ref = _grads(lambda a, b, c: attention(a, b, c, cu, dtype=reference_dtype), q, k, v, do)
    ref = [r.to(torch.float64) for r in ref]
    rows = []
    for name in names:
        t0 = time.perf_counter()

        def fn(a, b, c, cu_=cu, _n=name):
            return attention(a, b, c, cu_, route=_n, tile_m=tile_m, tile_n=tile_n)

        got = _grads(fn, q, k, v, do)
        row = {"route": name, "exact_claim": bool(specs.routes[name].exact), "docs": docs, "doc_len": doc_len,
               "heads": heads, "head_dim": head_dim, "outliers": outliers, "tile_m": tile_m, "tile_n": tile_n}
        for label, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
            row[f"{label}_cosine"] = float(cosine(g.to(torch.float64), r))
            row[f"{label}_rel_error"] = float(rel_error(g.to(torch.float64), r))
        if probe:
            res = leakage_probe(fn, q, k, v, cu, positions=probe_positions, do=do, seed=seed)
            row.update(o_leak=_finite(max(res.o_leak.values())), dq_leak=_finite(max(res.dq_leak.values())),
                       leak_outside_block=_finite(res.max_leak_outside_block), probe_exact=res.exact,
                       probe_positions=res.positions, exact_ok=(res.exact or not row["exact_claim"]))
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
    return rows


def render_table(rows: list[dict]):
    """A rich Table: one line per route."""
    from rich.table import Table

    t = Table(title="flamia-gen verify --device cpu (emulator vs exact fp32)")
    for col in ("route", "O cos", "dQ cos", "dK cos", "dV cos", "O leak", "dQ leak", "exact", "s"):
        t.add_column(col, justify="left" if col == "route" else "right")

    def fmt(x, spec=".6f"):
        return "-" if x is None else (format(x, spec) if isinstance(x, float) else str(x))

    for r in rows:
        exact = "-" if "probe_exact" not in r else ("yes" if r["probe_exact"] else "no") + (
            "" if r.get("exact_ok", True) else " (CLAIM FAILS)")
        t.add_row(r["route"], fmt(r["o_cosine"]), fmt(r["dq_cosine"]), fmt(r["dk_cosine"]), fmt(r["dv_cosine"]),
                  fmt(r.get("o_leak"), ".2e"), fmt(r.get("dq_leak"), ".2e"), exact, fmt(r["seconds"], ".1f"))
    return t


def to_json(rows: list[dict], path: str | Path) -> Path:
    """Write rows as JSON (atomic replace); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"device": "cpu", "rows": rows}, indent=2, sort_keys=True))
    tmp.replace(path)
    return path
