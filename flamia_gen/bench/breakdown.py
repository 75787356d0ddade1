"""Where one call's GPU time goes: every CUDA kernel of a `flamia-gen bench` call (forward or
train: quantizer launches, attention kernels, torch ops around them), from torch.profiler.

    python3 -m flamia_gen.bench.breakdown --workload tiny131072x1 --impls flamia_bf16,flamia_fp8_token

The same adapters and input sets as `flamia-gen bench` (several, rotated, so L2 cannot hold them), so the
rows add up to the bench's time, less the host gaps (wall vs GPU time). Kernel names are shortened;
`--top` rows per call. The host time to issue a call (no profiler attached) is printed beside the GPU sum: where
it is the larger, the call is host-bound (2026-12-03: fp8_token's op forward at 4×4096 was). `--host-profile N`
adds a cProfile of N calls: the host time by function (its own time, then cumulative).
"""

from __future__ import annotations

import argparse

from .adapter import MODES


def kernel_times(fn, calls: int = 3) -> tuple[list[tuple[str, float, int]], float]:
    """([(kernel name, µs per call, launches per call)] sorted by time, wall ms per call) of `fn`."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / calls
    rows = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us, n = rows.get(e.name, (0.0, 0))
        rows[e.name] = (us + e.device_time, n + 1)
    out = sorted(((name, us / calls, n // calls) for name, (us, n) in rows.items()), key=lambda r: -r[1])
    return out, wall_ms


def host_issue_times(fn, calls: int = 20) -> tuple[float, float]:
    """(host ms per call to issue `calls` calls back to back, wall ms per call until the GPU is done), after one
    warm-up call, no profiler attached (`timing.issue_times`). A host time near or above the GPU kernels' sum means
    the call is host-bound: the GPU waits for launches (the op path's Python, the torch.library dispatch), which
    `kernel_times` cannot show."""
    from .timing import issue_times

    return issue_times(fn, "cuda", calls, warmup=1)


def host_profile(fn, calls: int = 50, top: int = 30) -> str:
    """cProfile of `calls` calls issued back to back (the GPU work runs behind them), the `top` functions by their own
    time and by cumulative time: where the op path's host time goes, function by function."""
    import cProfile
    import io
    import pstats

    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def _short(name: str, width: int = 70) -> str:
    name = name.replace("void ", "").split("(")[0]
    return name if len(name) <= width else name[: width - 1] + "…"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="tiny131072x1")
    ap.add_argument("--impls", default="flamia_bf16,flamia_fp8_token")
    ap.add_argument("--mode", default="train", choices=MODES)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                    help="also print a cProfile of CALLS calls (host time by function)")
    a = ap.parse_args(argv)
    from .peers import resolve_impls
    from .workloads import get_workload, make_inputs

    w = get_workload(a.workload)
    inputs = make_inputs(w)
    adapters, notes = resolve_impls(a.impls)
    for note in notes:
        print(note)
    for ad in adapters:
        fn = ad.prepare(w, inputs, a.mode)
        host, wall_np = host_issue_times(fn)
        rows, wall = kernel_times(fn, a.calls)
        total = sum(us for _, us, _ in rows)
        print(f"{ad.name} {w.name} {a.mode}: GPU kernels {total / 1e3:.3f} ms/call; without the profiler host issue "
              f"{host:.3f} ms/call, wall {wall_np:.3f} ms/call (with it: wall {wall:.3f})")
        for name, us, n in rows[: a.top]:
            print(f"  {us / 1e3:8.3f} ms  {100 * us / total:5.1f} %  x{n:<3d} {_short(name)}")
        if a.host_profile:
            print(host_profile(fn, a.host_profile))
        del fn
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
