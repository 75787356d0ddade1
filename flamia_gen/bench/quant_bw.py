"""Quantizer bandwidth benchmark (issue #4): achieved bytes/s of our fused quantizer
against a device-to-device copy and against a torch.compile'd quantizer of the same
granularity, measured in the same process.

Bytes counted (DESIGN §5 "fewest bytes"): BF16 read once (2 B/elt), codes written once
(1 B/elt), the K-major copy written once (1 B/elt), scales. The copy moves 2 B read +
2 B written per element. A speed is never asserted in a test: this prints and saves.
"""

from __future__ import annotations

import math

import torch

from .timing import time_cuda


def quant_bytes(T: int, H: int, D: int, transposed: bool, scale_bytes: int) -> int:
    return T * H * D * 2 + T * H * D * (2 if transposed else 1) + scale_bytes


def torch_quantizer(granularity: str, block: int = 32):
    """A plain torch implementation (codes + K-major copy + UE8M0 scales), for
    torch.compile. Token-block grouping here ignores documents (one long document):
    it is a speed peer, not a numerics reference. The exponent is the contract's own
    (``numerics.quantize.pow2_exponent``, E4M3 ``ceil``: pure tensor ops, compiles into one
    graph); importing it needs the spec package (pydantic), so this raises ImportError on a
    host without it."""
    from ..numerics.quantize import pow2_exponent
    from ..spec.enums import ExponentRule, Format

    def quant(x: torch.Tensor):
        T, H, D = x.shape
        xf = x.float()
        if granularity == "token":
            amax = xf.abs().amax(dim=-1, keepdim=True)
        elif granularity == "token_block":
            Tp = math.ceil(T / block) * block
            xp = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, Tp - T))
            amax = xp.abs().view(Tp // block, block, H, D).amax(dim=(1, 3), keepdim=True)
            amax = amax.expand(Tp // block, block, H, 1).reshape(Tp, H, 1)[:T]
        elif granularity == "tensor":
            amax = xf.abs().amax().reshape(1, 1, 1)
        else:
            raise ValueError(f"granularity {granularity!r} has no torch peer here")
        e, _, _ = pow2_exponent(amax, Format.e4m3, ExponentRule.ceil)
        codes = (xf * torch.exp2(-e.float())).to(torch.float8_e4m3fn)
        codes_t = codes.permute(1, 2, 0).contiguous()
        scales = (e + 127).to(torch.uint8)
        return codes, codes_t, scales

    return quant


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def copy_bandwidth(numel: int, iters: int = 30) -> dict:
    x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    stats = time_cuda(lambda: y.copy_(x), warmup=5, repeats=iters, measure_memory=False)
    return dict(impl="d2d copy", median_ms=stats.median_ms, gbps=_gbps(4 * numel, stats.median_ms))


def _scale_bytes(outs: dict) -> int:
    return sum(t.numel() * t.element_size() for n, t in outs.items() if n in ("scales", "tensor_scale"))


def _compile_peer_ms(g: str, xs, iters: int) -> float | None:
    """Median ms of the torch.compile'd quantizer of granularity ``g`` (None: no numerics package here)."""
    try:
        quant = torch_quantizer(g)
    except ImportError:
        return None
    f = torch.compile(quant, dynamic=False)
    return time_cuda([(lambda x=x: f(x)) for x in xs], warmup=3, repeats=iters, measure_memory=False).median_ms


def run_quant_bandwidth(bundle, *, T: int = 65536, H: int = 16, D: int = 128, doc_len: int = 4096,
                        names=None, iters: int = 30, compile_peer: bool = True) -> list[dict]:
    """Every quantizer in the bundle (head_dim D) on a packed row of equal documents:
    achieved GB/s, ratio to the copy, and to torch.compile'd quantizer of the same
    granularity where one exists."""
    from ..runtime.quant import allocate_outputs

    cu = torch.arange(0, T + 1, doc_len, dtype=torch.int32, device="cuda")
    if int(cu[-1]) != T:
        cu = torch.cat([cu, torch.tensor([T], dtype=torch.int32, device="cuda")])
    xs = [torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    copy = copy_bandwidth(T * H * D, iters)
    rows = [dict(copy, ratio_copy=1.0)]
    peer_ms: dict[str, float | None] = {}  # granularity -> torch.compile median, measured once
    for entry in bundle.manifest["variants"]:
        if entry["kind"] != "quant" or entry["params"]["head_dim"] != D or (names and entry["name"] not in names):
            continue
        params = entry["params"]
        g = params["granularity"]
        fn = bundle.get(entry["name"])
        outs = [allocate_outputs(entry["args"], T, H, D, cu.numel() - 1, "cuda") for _ in xs]
        with_delta = bool(params.get("with_delta"))
        calls = []
        for i in range(len(xs)):
            by = dict(outs[i], x=xs[i], cu_seqlens=cu)
            if with_delta:
                by["o"] = xs[(i + 1) % len(xs)]  # the dO launch reads the forward output too
            args = [by[a["name"]] for a in entry["args"]]  # bound once, not per timed call
            calls.append(lambda args=args, fn=fn: fn(*args))

        if params.get("fmt") == "bf16":  # the bf16 route's dO launch writes no codes: it reads x only
            nbytes = T * H * D * 2
        else:
            nbytes = quant_bytes(T, H, D, params["write_transposed"], _scale_bytes(outs[0]))
        if with_delta:
            nbytes += T * H * D * (2 + 4) + H * T * 4  # reads o, zeroes dq_accum (fp32), writes delta
        if g in ("tensor", "nvfp4"):
            nbytes += T * H * D * 2  # the amax pass reads x once more: count it, it is real traffic
        st = time_cuda(calls, warmup=5, repeats=iters, measure_memory=False)
        row = dict(impl=entry["name"], granularity=g, median_ms=st.median_ms, gbps=_gbps(nbytes, st.median_ms))
        row["ratio_copy"] = row["gbps"] / copy["gbps"]
        if compile_peer and g in ("token", "token_block", "tensor") and params["fmt"] == "e4m3":
            if g not in peer_ms:
                peer_ms[g] = _compile_peer_ms(g, xs, iters)
            if peer_ms[g] is not None:
                row["torch_compile_ms"] = peer_ms[g]
                row["speedup_vs_torch_compile"] = peer_ms[g] / st.median_ms
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'impl':48s} {'ms':>8s} {'GB/s':>8s} {'/copy':>6s} {'vs torch.compile':>17s}"]
    for r in rows:
        tc = f"{r['speedup_vs_torch_compile']:.2f}x" if "speedup_vs_torch_compile" in r else "-"
        lines.append(f"{r['impl']:48s} {r['median_ms']:8.3f} {r['gbps']:8.0f} {r.get('ratio_copy', 0):6.2f} {tc:>17s}")
    return "\n".join(lines)
