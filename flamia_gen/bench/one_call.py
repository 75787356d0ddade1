"""Run one attention kernel of a bundle a few times on one packed row: the target for a
profiler (Nsight Compute) on the GPU host, where the kernels come from a bundle.

    python3 -m flamia_gen.bench.one_call --variant attn_fwd_sm90_fp8_token_... --docs 16384 --heads 16
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section LaunchStats --section Occupancy -k regex:Attn --launch-skip 2 --launch-count 1 \\
        python3 -m flamia_gen.bench.one_call --variant ... --calls 3

Forward variants run kernel-only (inputs pre-quantized, work list built once); backward
variants run as the op does (quantizer launches, then the kernel; `-k` picks the kernel).

`--peer fa4` runs FA4's varlen forward and backward (one training step per call, BF16, causal) on the same
inputs instead, so a peer's kernels are profiled by the same command line (`-k regex:Backward`).
"""

from __future__ import annotations

import argparse
import os


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default=os.environ.get("FLAMIA_GEN_BUNDLE"), help="bundle dir ($FLAMIA_GEN_BUNDLE)")
    ap.add_argument("--variant", default=None, help="attn_fwd_… or attn_bwd_… name in the bundle")
    ap.add_argument("--peer", choices=("fa4",), default=None,
                    help="run a peer's forward + backward instead of a bundle variant")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim of --peer's inputs")
    ap.add_argument("--docs", default="16384", help="document lengths, comma-separated (e.g. 4096,4096)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args(argv)
    import torch

    from ..runtime.bundle import load_bundle
    from ..spec import get_route
    from ..verify.attn_gpu import backward_setup, make_qkv, timed_call_inputs

    if (a.peer is None) == (a.variant is None):
        ap.error("give exactly one of --variant and --peer")
    if a.peer:
        return _run_peer(a, torch)
    if not a.bundle:
        ap.error("--bundle or $FLAMIA_GEN_BUNDLE is required")
    b = load_bundle(a.bundle)
    entry = next((e for e in b.manifest["variants"] if e["name"] == a.variant), None)
    if entry is None or entry["kind"] not in ("attn_fwd", "attn_bwd"):
        names = sorted(e["name"] for e in b.manifest["variants"] if e["kind"].startswith("attn"))
        ap.error(f"--variant {a.variant!r}: not an attention variant of {a.bundle}; have {names}")
    lens = [int(x) for x in a.docs.split(",") if x]
    route = get_route(entry["uses"][0])
    g = torch.Generator().manual_seed(0)
    q, k, v, cu = make_qkv(lens, a.heads, a.heads, entry["params"]["head_dim"], "gauss", g, "cuda")
    if entry["kind"] == "attn_fwd":
        from ..runtime.attn_fwd import run_attn_fwd

        kw = timed_call_inputs(route, q, k, v, cu, entry["params"])
        fn = b.get(entry["name"])
        call = lambda: run_attn_fwd(fn, entry["args"], params=entry["params"], **kw)  # noqa: E731
    else:
        from ..runtime.ops import backward_with

        do = torch.randn(q.shape, generator=g).to(torch.bfloat16).cuda()
        o, lse, prof, fwd = backward_setup(b, entry, q, k, v, cu, with_forward=True)
        # with the forward that made O, LSE (a diag_v backward repeats its diagonal decisions)
        call = lambda: backward_with(b, entry, do, q, k, v, o, lse, cu, prof, fwd_params=fwd["params"])  # noqa: E731
    for _ in range(a.calls):
        call()
    torch.cuda.synchronize()
    print(f"{a.variant}: {a.calls} calls on {len(lens)} docs, T={sum(lens)}, H={a.heads}")
    return 0


def _run_peer(a, torch) -> int:
    """FA4's forward and backward, causal BF16, on the inputs a bundle variant would get (make_qkv, seed 0)."""
    from ..verify.attn_gpu import make_qkv
    from .peer_fa4 import Fa4Adapter

    fn, reason = Fa4Adapter()._func()
    if fn is None:
        raise SystemExit(f"--peer fa4: {reason}")
    lens = [int(x) for x in a.docs.split(",") if x]
    g = torch.Generator().manual_seed(0)
    q, k, v, cu = make_qkv(lens, a.heads, a.heads, a.head_dim, "gauss", g, "cuda")
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    do = torch.randn(q.shape, generator=g).to(torch.bfloat16).cuda()
    cu = cu.to(device="cuda", dtype=torch.int32)
    for _ in range(a.calls):
        res = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                 causal=True)
        out = res[0] if isinstance(res, tuple) else res
        torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    print(f"fa4: {a.calls} training steps on {len(lens)} docs, T={sum(lens)}, H={a.heads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
