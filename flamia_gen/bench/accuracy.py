"""Accuracy of each implementation against an fp32 reference (DESIGN §5).

O and dQ of every implementation are compared with exact attention computed
in float32 over the same BF16 inputs, per document, by cosine similarity (in
float64) and relative error. dQ is the gradient that leaks across tokens in
leaky FP8 schemes, so it is the one to watch.

The reference is self-contained (query rows in chunks, so memory stays
bounded by ``H * chunk * L`` per step); if the numerics package's
``flamia_gen.numerics.reference.attention`` is importable and works on these
inputs it is used instead, and the report says which one ran.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

ACCURACY_WORKLOAD = "eq4x4096"  # DESIGN §6: the paper's accuracy figures are on 4x4096
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024


def cosine(a, b) -> float:
    """Cosine similarity of two tensors, flattened, accumulated in float64."""
    import torch

    x = a.detach().reshape(-1).to(torch.float64)
    y = b.detach().reshape(-1).to(torch.float64)
    if x.numel() != y.numel():
        raise ValueError(f"cosine of tensors with {x.numel()} and {y.numel()} elements")
    nx, ny = torch.linalg.vector_norm(x), torch.linalg.vector_norm(y)
    if nx == 0 and ny == 0:
        return 1.0
    if nx == 0 or ny == 0:
        return 0.0
    return float(torch.dot(x, y) / (nx * ny))


def rel_error(a, ref) -> float:
    """||a - ref|| / ||ref|| in float64 (inf if ref is zero and a is not)."""
    import torch

    x = a.detach().reshape(-1).to(torch.float64)
    y = ref.detach().reshape(-1).to(torch.float64)
    num = float(torch.linalg.vector_norm(x - y))
    den = float(torch.linalg.vector_norm(y))
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def reference_o_dq(q, k, v, d_out, doc_lens: Sequence[int], causal: bool = True,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """Exact attention O and dQ in float32, per document, query rows in chunks.

    q, k, v, d_out: packed (T, H, D). Returns (o, dq) float32 (T, H, D) on the
    inputs' device. dQ_i = scale * sum_j P_ij (dP_ij - D_i) K_j with
    dP = dO V^T and D_i = dO_i . O_i; every term is local to a query row, so
    chunking over query rows is exact.
    """
    import torch

    t, h, d = q.shape
    scale = 1.0 / math.sqrt(d)
    o = torch.empty((t, h, d), dtype=torch.float32, device=q.device)
    dq = torch.empty_like(o)
    start = 0
    for length in doc_lens:
        end = start + length
        qd, kd, vd, gd = (x[start:end].to(torch.float32).transpose(0, 1)  # (H, L, D)
                          for x in (q, k, v, d_out))
        # Four (H, rows, L) float32 temporaries live at once.
        rows = max(1, chunk_bytes // max(1, 16 * h * length))
        for a in range(0, length, rows):
            b = min(length, a + rows)
            kv = b if causal else length
            s = torch.matmul(qd[:, a:b], kd[:, :kv].transpose(1, 2)) * scale
            if causal:
                qi = torch.arange(a, b, device=q.device).unsqueeze(1)
                kj = torch.arange(kv, device=q.device).unsqueeze(0)
                s.masked_fill_(kj > qi, float("-inf"))
            p = torch.softmax(s, dim=-1)
            del s
            oc = torch.matmul(p, vd[:, :kv])
            dp = torch.matmul(gd[:, a:b], vd[:, :kv].transpose(1, 2))
            dsum = (gd[:, a:b] * oc).sum(-1, keepdim=True)
            ds = p * (dp - dsum)
            del dp, p
            dqc = torch.matmul(ds, kd[:, :kv]) * scale
            o[start + a:start + b] = oc.transpose(0, 1)
            dq[start + a:start + b] = dqc.transpose(0, 1)
        start = end
    return o, dq


def _external_reference():
    try:
        from flamia_gen.numerics.reference import attention  # type: ignore[attr-defined]
    except Exception:
        return None
    return attention if callable(attention) else None


def reference(q, k, v, d_out, workload) -> tuple[Any, Any, str]:
    """(o, dq, which) — the numerics package's reference if it works here, else ours."""
    import torch

    from .adapter import first_output

    ext = _external_reference()
    if ext is not None:
        try:
            cu = workload.cu_seqlens(q.device)
            qf, kf, vf = (x.detach().to(torch.float32).requires_grad_(True) for x in (q, k, v))
            o = first_output(ext(qf, kf, vf, cu, causal=workload.causal))
            if tuple(o.shape) == tuple(q.shape):
                (dq,) = torch.autograd.grad(o, (qf,), d_out.to(torch.float32))
                return o.detach(), dq, "flamia_gen.numerics.reference.attention"
        except Exception:
            pass  # its interface is not what we guessed: use our own
    o, dq = reference_o_dq(q, k, v, d_out, workload.doc_lens, workload.causal)
    return o, dq, "flamia_gen.bench.accuracy.reference_o_dq (fp32)"


@dataclass
class AccuracyResult:
    impl: str
    workload: str
    status: str  # 'ok', 'skipped', 'not installed', 'unavailable', 'error'
    o_cos: float | None = None
    dq_cos: float | None = None
    o_rel: float | None = None
    dq_rel: float | None = None
    note: str = ""
    reference: str = ""
    outliers: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_accuracy(adapters, workload=None, device: Any = "cuda", seed: int = 0,
                 outliers: bool = False, dtype: Any = None) -> list[AccuracyResult]:
    """O and dQ cosine of each adapter on ``workload`` (default 4x4096)."""
    import torch

    from .adapter import PeerSkip, fixed_grad_output, status_of
    from .workloads import get_workload, make_inputs

    wl = workload or get_workload(ACCURACY_WORKLOAD)
    (q, k, v), = [tuple(s) for s in make_inputs(wl, dtype or torch.bfloat16, device, seed,
                                                n_rotations=1, outliers=outliers)]
    d_out = fixed_grad_output(q, seed=seed + 1)
    o_ref, dq_ref, which = reference(q, k, v, d_out, wl)
    results: list[AccuracyResult] = []
    for a in adapters:
        res = AccuracyResult(a.name, wl.name, "ok", reference=which, outliers=outliers)
        ok, reason = a.available()
        if not ok:
            res.status, res.note = status_of(reason), reason
            results.append(res)
            continue
        ok, reason = a.supports(wl)
        if not ok:
            res.status, res.note = "skipped", reason
            results.append(res)
            continue
        try:
            try:
                o, dq = a.compute(wl, q, k, v, d_out, need_grad=True)
            except PeerSkip:
                raise
            except Exception as exc:  # no backward: still report O
                o, dq = a.compute(wl, q, k, v, d_out, need_grad=False)
                res.note = f"no dQ: {first_line(exc)}"
            res.o_cos, res.o_rel = cosine(o, o_ref), rel_error(o, o_ref)
            if dq is not None:
                res.dq_cos, res.dq_rel = cosine(dq, dq_ref), rel_error(dq, dq_ref)
        except PeerSkip as exc:
            res.status, res.note = "skipped", str(exc)
        except Exception as exc:
            res.status, res.note = "error", first_line(exc)
        results.append(res)
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
    return results


def first_line(exc: BaseException, limit: int = 240) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    return f"{type(exc).__name__}: {msg}"[:limit]
