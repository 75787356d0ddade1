"""Orchestration: every implementation on every workload, in one process.

Peers and our routes are measured in the same process on the same input sets
(DESIGN §5), one implementation at a time, with the allocator emptied between
them so one's cached blocks do not inflate the next one's peak memory. Nothing
an implementation does (missing package, unsupported workload, exception, out
of memory) stops the run: it becomes a row with a status and a note.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .accuracy import ACCURACY_WORKLOAD, AccuracyResult, first_line, run_accuracy
from .adapter import MODES, Adapter, PeerSkip, no_cuda_reason, status_of
from .flops import tflops as _tflops
from .flops import workload_flops
from .peers import resolve_impls
from .report import (UNTUNED, BenchRow, collect_metadata, compute_speedups, render_tables, table_text,
                     write_chart, write_json)
from .timing import DEFAULT_REPEATS, DEFAULT_WARMUP, MIN_REPEATS_DESIGN, check_ceiling, host_issue_ms, time_fn
from .workloads import Workload, get_workload, make_inputs, parse_workloads

FLOP_CONVENTION = ("causal fwd per head per document 4*D*L(L+1)/2 (non-causal 4*D*L^2), "
                   "bwd 2.5x fwd, train = fwd + bwd = 3.5x fwd; masked work never counted")


class NoCudaError(RuntimeError):
    """The benchmark was asked to run on CUDA and there is no CUDA device."""


@dataclass
class BenchResult:
    rows: list[BenchRow]
    accuracy: list[AccuracyResult] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    json_path: Path | None = None
    table_path: Path | None = None
    chart_path: Path | None = None


def _as_workloads(workloads: str | Sequence[str | Workload]) -> list[Workload]:
    if isinstance(workloads, str):
        return parse_workloads(workloads)
    out = []
    for w in workloads:
        out.append(w if isinstance(w, Workload) else get_workload(w))
    if not out:
        raise ValueError("no workload given")
    return out


def _as_adapters(impls: str | Sequence[str | Adapter]) -> tuple[list[Adapter], list[str]]:
    if isinstance(impls, str):
        return resolve_impls(impls)
    adapters: list[Adapter] = []
    notes: list[str] = []
    for i in impls:
        if isinstance(i, str):
            found, n = resolve_impls(i)
            adapters += found
            notes += n
        else:
            adapters.append(i)
    return adapters, notes


def _free(device: str) -> None:
    if device.startswith("cuda"):  # on the CPU there is no allocator cache to empty
        import torch

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextmanager
def _kernel_substitutions(is_peer: bool):
    """Our rows: the kernels run in place of the dispatch table's choices (`runtime.attention.substitutions`)."""
    if is_peer:
        yield []
        return
    from ..runtime.attention import substitutions

    with substitutions() as rec:
        yield rec


def bench_one(adapter: Adapter, workload: Workload, inputs, mode: str, device: str,
              repeats: int, warmup: int, ceilings: dict[str, float] | None = None,
              availability: tuple[bool, str] | None = None) -> BenchRow:
    """One row: availability, support, prepare, time, rate, ceiling check."""
    row = BenchRow(impl=adapter.name, workload=workload.name, mode=mode,
                   precision=adapter.precision, is_peer=getattr(adapter, "is_peer", True),
                   memory_note=getattr(adapter, "memory_note", ""))
    ok, reason = availability if availability is not None else adapter.available()
    if not ok:
        row.status, row.note = status_of(reason), reason
        return row
    ok, reason = adapter.supports(workload)
    if not ok:
        row.status, row.note = "skipped", reason
        return row
    fn = None
    subs: list = []
    try:
        baseline = None
        if device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()  # before prepare: its buffers count
        with _kernel_substitutions(row.is_peer) as subs:
            fn = adapter.prepare(workload, inputs, mode)
            stats = time_fn(fn, device=device, warmup=warmup, repeats=repeats,
                            memory_baseline_bytes=baseline)
        row.median_ms, row.min_ms = stats.median_ms, stats.min_ms
        row.p20_ms, row.p80_ms = stats.p20_ms, stats.p80_ms
        row.repeats, row.timer = stats.repeats, stats.timer
        row.host_ms = host_issue_ms(fn, device=device)
        if stats.peak_mem_bytes is not None:
            row.peak_mib = stats.peak_mem_bytes / 2**20
        row.flops = workload_flops(workload, mode)
        row.tflops = _tflops(row.flops, row.median_ms)
        row.suspect, note = check_ceiling(row.tflops, adapter.precision, ceilings)
        if note:
            row.note = note
        if repeats < MIN_REPEATS_DESIGN:
            row.note = "; ".join(x for x in (row.note, f"only {repeats} repeats") if x)
        if subs:  # not the tuned kernels: the row must not pass for the table's choice
            ran = ", ".join(f"{b} for {a}" for a, b in dict.fromkeys(subs))
            row.note = "; ".join(x for x in (row.note, f"{UNTUNED}: ran {ran}") if x)
    except PeerSkip as exc:
        row.status, row.note = "skipped", str(exc)
    except Exception as exc:
        msg = first_line(exc)
        if "out of memory" in msg.lower():
            msg = "out of memory: " + msg
        row.status, row.note = "error", msg
    finally:
        del fn
        _free(device)
    return row


def run_bench(workloads: str | Sequence[str | Workload], impls: str | Sequence[str | Adapter] = "all",
              mode: str = "fwd", out_dir: str | Path | None = None,
              repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
              accuracy: bool = True, seed: int = 0, n_rotations: int | None = None,
              device: str = "cuda", outliers: bool = False,
              ceilings: dict[str, float] | None = None, accuracy_workload: str = ACCURACY_WORKLOAD,
              console=None, quiet: bool = False, notes: Sequence[str] = ()) -> BenchResult:
    """Benchmark ``impls`` on ``workloads`` in ``mode`` and write the report to ``out_dir``.

    ``device='cpu'`` uses the perf_counter timer and is meant for tests only.
    Raises NoCudaError when ``device`` is CUDA and there is none, ValueError on
    a bad workload/impl/mode.
    """
    import torch

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    wls = _as_workloads(workloads)
    adapters, resolve_notes = _as_adapters(impls)
    notes = [*notes, *resolve_notes]
    device = str(device)
    if device.startswith("cuda") and no_cuda_reason():
        raise NoCudaError("no CUDA device: flamia-gen bench needs a GPU")
    if console is None and not quiet:
        from ..console import make_console

        console = make_console()

    def log(msg: str) -> None:
        if console is not None and not quiet:
            console.log(msg)

    availability = {}
    for a in adapters:
        try:
            availability[a.name] = a.available()
        except Exception as exc:  # a broken adapter is a row, not a crash
            availability[a.name] = (False, f"available() raised {first_line(exc)}")
    rows: list[BenchRow] = []
    for wl in wls:
        log(f"[cyan]{wl.name}[/]: {wl.describe()}, H={wl.heads}, D={wl.head_dim}, mode={mode}")
        try:
            inputs = make_inputs(wl, torch.bfloat16, device, seed, n_rotations)
        except Exception as exc:
            for a in adapters:
                rows.append(BenchRow(a.name, wl.name, mode, a.precision, "error",
                                     f"inputs: {first_line(exc)}", getattr(a, "is_peer", True)))
            _free(device)
            continue
        for a in adapters:
            row = bench_one(a, wl, inputs, mode, device, repeats, warmup, ceilings,
                            availability[a.name])
            rows.append(row)
            if row.status == "ok":
                log(f"  {a.name}: {row.median_ms:.3f} ms, {row.tflops or 0:.0f} TFLOP/s")
            else:
                log(f"  {a.name}: {row.status} ({row.note})")
        del inputs
        _free(device)

    acc: list[AccuracyResult] = []
    if accuracy:
        log(f"accuracy on {accuracy_workload} vs fp32 reference")
        try:
            acc = run_accuracy(adapters, get_workload(accuracy_workload), device, seed, outliers)
        except Exception as exc:
            notes.append(f"accuracy failed: {first_line(exc)}")
        by_impl = {a.impl: a for a in acc}
        for r in rows:
            a = by_impl.get(r.impl)
            if a is not None and r.workload == accuracy_workload and a.status == "ok":
                r.o_cos, r.dq_cos = a.o_cos, a.dq_cos
        _free(device)

    compute_speedups(rows)
    meta = collect_metadata(adapters, extra={
        "mode": mode, "repeats": repeats, "warmup": warmup, "seed": seed,
        "n_rotations": n_rotations, "device": device, "outliers": outliers,
        "workloads": [w.to_dict() for w in wls], "flop_convention": FLOP_CONVENTION,
        "ceilings_tflops": ceilings or {}, "accuracy_workload": accuracy_workload if accuracy else None,
        "notes": notes,
    })
    result = BenchResult(rows=rows, accuracy=acc, metadata=meta)
    title = f"flamia-gen bench ({mode}, {meta.get('gpu') or device})"
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        result.json_path = write_json(out / f"bench_{mode}.json", rows, meta, acc)
        result.table_path = out / f"bench_{mode}.txt"
        result.table_path.write_text(table_text(rows, acc, title=title))
        result.chart_path = write_chart(out / f"bench_{mode}.png", rows, title=title)
    if console is not None and not quiet:
        render_tables(rows, acc, console=console, title=title)
        for n in notes:
            console.print(f"[yellow]note[/]: {n}")
    return result
