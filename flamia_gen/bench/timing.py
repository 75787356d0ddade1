"""Timing and memory of one implementation's call (DESIGN §5).

GPU: CUDA events around every call, after a warm-up, median of >= 20 calls;
the callable is expected to rotate through several input sets itself (and a
list of callables is rotated here) so L2 never holds the inputs. Peak memory is
the rise of ``torch.cuda.max_memory_allocated`` over a baseline, measured on
one extra call after the timed ones.

CPU: ``time.perf_counter`` with the same statistics, only so the harness can be
unit-tested without a GPU. CPU numbers are never reported as kernel speed.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

DEFAULT_WARMUP = 5
DEFAULT_REPEATS = 20
MIN_REPEATS_DESIGN = 20  # DESIGN §5: a median of fewer is flagged in the report

# Rates above these cannot be real on the GPUs we have (H200 dense BF16 peak
# ~990, dense FP8 ~1979 TFLOP/s): such a row is "suspect" (a FLOP count that
# includes masked work, a kernel that skipped work, a timer that missed it).
DEFAULT_CEILINGS = {"bf16": 1000.0, "fp8": 2000.0}

Fn = Callable[[], Any]


@dataclass
class TimingStats:
    median_ms: float
    min_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int
    warmup: int
    timer: str  # "cuda-events" or "cpu-perf-counter"
    peak_mem_bytes: int | None = None
    samples_ms: list[float] = field(default_factory=list, repr=False)

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_samples:
            d.pop("samples_ms")
        return d


def percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of already sorted values."""
    if not sorted_vals:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    frac = pos - lo
    return sorted_vals[lo] * (1.0 - frac) + sorted_vals[hi] * frac


def summarize(samples_ms: Sequence[float], warmup: int, timer: str,
              peak_mem_bytes: int | None = None) -> TimingStats:
    vals = sorted(float(s) for s in samples_ms)
    return TimingStats(
        median_ms=percentile(vals, 50.0),
        min_ms=vals[0],
        p20_ms=percentile(vals, 20.0),
        p80_ms=percentile(vals, 80.0),
        repeats=len(vals),
        warmup=warmup,
        timer=timer,
        peak_mem_bytes=peak_mem_bytes,
        samples_ms=list(samples_ms),
    )


def _rotator(fns: Fn | Sequence[Fn]) -> Fn:
    if callable(fns):
        return fns
    fns = list(fns)
    if not fns:
        raise ValueError("no callable to time")
    if len(fns) == 1:
        return fns[0]
    cyc = itertools.cycle(fns)
    return lambda: next(cyc)()


def _check_counts(warmup: int, repeats: int) -> None:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")


def time_cpu(fns: Fn | Sequence[Fn], warmup: int = DEFAULT_WARMUP,
             repeats: int = DEFAULT_REPEATS) -> TimingStats:
    """perf_counter timing; for tests and CPU-only smoke runs, not for reporting."""
    _check_counts(warmup, repeats)
    fn = _rotator(fns)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples, warmup, "cpu-perf-counter")


def measure_peak_memory(fn: Fn, baseline_bytes: int | None = None) -> int:
    """Bytes allocated above ``baseline_bytes`` at the peak of one call of ``fn``.

    The baseline defaults to what is allocated just before the call; pass the
    amount allocated before ``prepare`` to also count the buffers an adapter
    keeps (block masks, FP8 copies, workspaces).
    """
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if baseline_bytes is None else baseline_bytes
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return max(0, peak - base)


def time_cuda(fns: Fn | Sequence[Fn], warmup: int = DEFAULT_WARMUP,
              repeats: int = DEFAULT_REPEATS, memory_baseline_bytes: int | None = None,
              measure_memory: bool = True) -> TimingStats:
    """CUDA-event timing of each call; median/min/p20/p80 in ms, plus peak memory."""
    import torch

    _check_counts(warmup, repeats)
    fn = _rotator(fns)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    peak = measure_peak_memory(fn, memory_baseline_bytes) if measure_memory else None
    return summarize(samples, warmup, "cuda-events", peak)


def time_fn(fns: Fn | Sequence[Fn], device: str = "cuda", **kw: Any) -> TimingStats:
    """Dispatch to the CUDA or the CPU timer by device."""
    if str(device).startswith("cuda"):
        return time_cuda(fns, **kw)
    kw.pop("memory_baseline_bytes", None)
    kw.pop("measure_memory", None)
    return time_cpu(fns, **kw)


def issue_times(fns: Fn | Sequence[Fn], device: str = "cuda", calls: int = 20,
                warmup: int = 0) -> tuple[float, float]:
    """(host ms, wall ms) per call: `calls` calls issued back to back (rotating `fns`) after `warmup` untimed ones
    and a synchronisation; the host clock stops when the last call returns, the wall clock when the device is done.
    A host time near or above the call's device time means the call is host-bound: its GPU waits for launches
    (Python, dispatch), which an event timer counts but cannot attribute. On the CPU the two are the same."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    seq = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    if not seq:
        raise ValueError("no callable to time")
    if str(device).startswith("cuda"):
        import torch

        sync = torch.cuda.synchronize
    else:
        def sync():
            return None
    cyc = itertools.cycle(seq)
    for _ in range(warmup):
        next(cyc)()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        next(cyc)()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3 / calls, (t2 - t0) * 1e3 / calls


def host_issue_ms(fns: Fn | Sequence[Fn], device: str = "cuda", calls: int = 20) -> float:
    """Host time to issue one call, in ms (`issue_times`): the bench's `host ms` column."""
    return issue_times(fns, device, calls)[0]


def check_ceiling(tflops: float | None, precision: str,
                  ceilings: dict[str, float] | None = None) -> tuple[bool, str]:
    """(suspect, note): a rate above the precision's ceiling is not reported as fact."""
    if tflops is None:
        return False, ""
    table = {**DEFAULT_CEILINGS, **(ceilings or {})}
    ceiling = table.get(precision, table["fp8"])
    if tflops > ceiling:
        return True, (f"suspect: {tflops:.0f} TFLOP/s exceeds the {precision} ceiling "
                      f"of {ceiling:.0f}")
    return False, ""
