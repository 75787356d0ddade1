"""GPU side of tuning: device info, CUDA-event timing, and one hook per kernel kind.

Importing this module touches no GPU (torch is imported inside the functions); only
calling them does. A hook answers two questions for a bundle entry:

    hook.verify(bundle, entry, device) -> (ok, reason)        once per variant and process
    hook.time(bundle, entry, workload, device, warmup, repeats) -> [ms, ...]

Quantizer (`QuantHook`): verified bitwise against the emulator on several input kinds
(`flamia_gen.verify.quant_gpu.verify_quantizer`); timed on the bucket's representative
workload `x: (T, H, D)` BF16 with its `cu_seqlens`: outputs preallocated, warm-up, then
CUDA events around every call, inputs rotated over enough copies that L2 cannot hold
them (DESIGN §5). The attention forward (`AttnFwdHook`) and backward (`AttnBwdHook`) are
verified against the emulator and fp32 first, then timed on the bucket's packed row.
"""

from __future__ import annotations

import ctypes
import math
from typing import Callable


def cuda_driver_version() -> str | None:
    """`12.8`-style driver version from libcuda, or None without a driver."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            return f"{v.value // 1000}.{(v.value % 1000) // 10}"
    return None


def gpu_info(device: int = 0) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: timing needs a GPU (use --runner fake for a dry run)")
    props = torch.cuda.get_device_properties(device)
    return {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "cuda_driver": cuda_driver_version(), "cuda_runtime": torch.version.cuda,
            "capability": f"{props.major}.{props.minor}", "device": int(device)}


def l2_bytes(device: int = 0) -> int:
    import torch

    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))


def time_cuda(calls: list[Callable[[], object]], *, warmup: int = 5, repeats: int = 30) -> list[float]:
    """CUDA events around each call (rotating over `calls`), after `warmup` calls; one
    synchronize at the end. Milliseconds per call (`flamia_gen.bench.timing.time_cuda`'s
    samples, no memory probe)."""
    from ..bench.timing import time_cuda as _time_cuda

    return _time_cuda(calls, warmup=warmup, repeats=repeats, measure_memory=False).samples_ms


def _operand_quant(entry: dict):
    from ..verify.gpu import _operand_quant_of

    return _operand_quant_of(entry)


class QuantHook:
    kind = "quant"
    VERIFY_KINDS = ("random", "outlier", "tiny_docs", "zeros_block")

    def __init__(self, verify_fn: Callable | None = None):
        self.verify_fn = verify_fn

    def verify(self, bundle, entry: dict, device: int) -> tuple[bool, str]:
        import torch

        try:
            with torch.cuda.device(device):
                fn = bundle.get(entry["name"])
                if self.verify_fn is not None:
                    return self.verify_fn(fn, entry)
                from ..verify.quant_gpu import verify_quantizer

                rows = verify_quantizer(fn, entry["args"], _operand_quant(entry), kinds=self.VERIFY_KINDS,
                                        D=entry["params"]["head_dim"])
        except Exception as e:  # a kernel that crashes fails verification, it does not stop the study
            return False, f"{type(e).__name__}: {e}"[:300]
        bad = [r for r in rows if not r.get("ok")]
        if not bad:
            return True, ""
        r = bad[0]
        detail = r.get("error") or f"{r.get('mismatches')} mismatches, first at {r.get('first')}"
        return False, f"{r.get('field')} on input {r.get('kind')!r}: {detail} ({len(bad)} failing field(s))"

    def time(self, bundle, entry: dict, workload, device: int, *, warmup: int = 5, repeats: int = 30) -> list[float]:
        import torch

        from ..runtime.quant import allocate_outputs, check_quant_inputs, takes_o

        dev = torch.device("cuda", device)
        with torch.cuda.device(device):
            fn = bundle.get(entry["name"])
            T, H, D = workload.tokens, workload.heads, entry["params"]["head_dim"]
            cu = torch.tensor(workload.cu_seqlens(), dtype=torch.int32, device=dev)
            x_bytes = T * H * D * 2
            copies = max(1, min(8, math.ceil(2 * l2_bytes(device) / max(1, x_bytes))))
            g = torch.Generator(device=dev).manual_seed(0)
            calls = []
            for _ in range(copies):
                x = torch.randn(T, H, D, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
                check_quant_inputs(x, cu)
                outs = allocate_outputs(entry["args"], T, H, D, cu.numel() - 1, dev)
                inputs = {"x": x, "cu_seqlens": cu}
                if takes_o(entry["args"]):  # the dO launch (with_delta) also reads the forward output
                    inputs["o"] = torch.randn(T, H, D, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
                args = [inputs[a["name"]] if a.get("role") == "in" else outs[a["name"]] for a in entry["args"]]
                calls.append(lambda args=args: fn(*args))
            return time_cuda(calls, warmup=warmup, repeats=repeats)


def _verify_attention(rows_fn: Callable[[], list[dict]], device: int) -> tuple[bool, str]:
    """(ok, reason) from an attention verifier's rows (forward or backward), run on `device`;
    the reason names the first failing input and its numbers."""
    import torch

    try:
        with torch.cuda.device(device):
            rows = rows_fn()
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"[:300]
    bad = [r for r in rows if not r.get("ok")]
    if not bad:
        return True, ""
    r = bad[0]
    probe = f" probe={r['probe_max_rel_change']}" if "probe_max_rel_change" in r else ""
    flips = f" p_flip_rows={r['p_flip_rows']}" if "p_flip_rows" in r else ""
    return False, (f"input {r.get('kind')!r}: cos_emulator={r.get('cos_emulator')} cos_fp32={r.get('cos_fp32')} "
                   f"nan={r.get('nan')}{probe}{flips}")


class AttnFwdHook:
    """The attention forward: verified against the emulator and fp32 (and the leakage
    probe on exact routes) before it may be timed; timed kernel-only on the bucket's
    representative packed row, inputs pre-quantized by the emulator (bitwise what the
    quantizer kernels write)."""

    kind = "attn_fwd"

    def verify(self, bundle, entry: dict, device: int) -> tuple[bool, str]:
        from ..verify.attn_gpu import verify_attn_entry

        return _verify_attention(lambda: verify_attn_entry(bundle, entry, kinds=("gauss", "tiny_docs")), device)

    def time(self, bundle, entry: dict, workload, device: int, *, warmup: int = 5, repeats: int = 30) -> list[float]:
        import torch

        from ..runtime.attn_fwd import run_attn_fwd
        from ..spec import get_route
        from ..verify.attn_gpu import make_qkv, timed_call_inputs

        dev = torch.device("cuda", device)
        with torch.cuda.device(device):
            fn = bundle.get(entry["name"])
            route = get_route(entry["uses"][0])
            lens = list(workload.doc_lens)
            g = torch.Generator().manual_seed(0)
            calls = []
            for _ in range(2):  # two input sets: L2 (60 MB) does not hold the working set
                q, k, v, cu = make_qkv(lens, workload.heads, workload.heads, entry["params"]["head_dim"], "gauss", g,
                                       dev)
                kw = timed_call_inputs(route, q, k, v, cu, entry["params"])
                calls.append(lambda kw=kw: run_attn_fwd(fn, entry["args"], params=entry["params"], **kw))
            return time_cuda(calls, warmup=warmup, repeats=repeats)


class AttnBwdHook:
    """The attention backward: verified against the emulator (given the kernel forward's O and
    LSE) and fp32 before it may be timed; timed through `ops.backward_with` (the Q/K/V quantizer launches,
    which the op skips on routes that keep the forward's codes, the dO launch and the kernel: the same for
    every candidate of a group) on the bucket's packed row, O and LSE from a forward variant of the bundle."""

    kind = "attn_bwd"

    def verify(self, bundle, entry: dict, device: int) -> tuple[bool, str]:
        from ..verify.attn_gpu import verify_bwd_entry

        return _verify_attention(lambda: verify_bwd_entry(bundle, entry, kinds=("gauss", "tiny_docs"), probe=False),
                                 device)

    def time(self, bundle, entry: dict, workload, device: int, *, warmup: int = 5, repeats: int = 30) -> list[float]:
        import torch

        from ..runtime.ops import backward_with
        from ..verify.attn_gpu import backward_setup, make_qkv

        dev = torch.device("cuda", device)
        with torch.cuda.device(device):
            lens = list(workload.doc_lens)
            g = torch.Generator().manual_seed(0)
            calls = []
            for _ in range(2):  # two input sets: L2 does not hold the working set
                q, k, v, cu = make_qkv(lens, workload.heads, workload.heads, entry["params"]["head_dim"], "gauss", g,
                                       dev)
                do = torch.randn(q.shape, generator=g).to(torch.bfloat16).to(dev)
                o, lse, prof, fwd = backward_setup(bundle, entry, q, k, v, cu, with_forward=True)
                # fwd_params: a diag_v backward repeats the diagonal decisions of the forward that made O, LSE
                calls.append(lambda a=(do, q, k, v, o, lse, cu, prof), fp=fwd["params"]:
                             backward_with(bundle, entry, *a, fwd_params=fp))
            return time_cuda(calls, warmup=warmup, repeats=repeats)


def default_hooks() -> dict:
    return {"quant": QuantHook(), "attn_fwd": AttnFwdHook(), "attn_bwd": AttnBwdHook()}


KIND_HOOKS = ("quant", "attn_fwd", "attn_bwd")

__all__ = ["cuda_driver_version", "gpu_info", "l2_bytes", "time_cuda", "QuantHook", "AttnFwdHook", "AttnBwdHook",
           "default_hooks",
           "KIND_HOOKS"]
