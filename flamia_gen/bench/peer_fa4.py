"""FlashAttention-4 (``flash_attn.cute``, PyPI ``flash-attn-4``) varlen, packed.

The interface moves between betas: in recent ones the 4th positional parameter
is ``qv``, not ``cu_seqlens_q``, so everything after v goes by keyword, and the
signature is checked before the first call. The result may be ``out`` or
``(out, lse)``; the first element is the output.
"""

from __future__ import annotations

import inspect

from .adapter import (NO_CUDA, Adapter, PeerSkip, cu_seqlens_per_device, dist_version, first_output,
                      no_cuda_reason, try_import)

MODULE = "flash_attn.cute"
REQUIRED_KWARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "causal")


def missing_kwargs(fn) -> list[str]:
    """Keyword arguments we pass that ``fn`` does not accept ([] if it takes **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []  # a builtin without a signature: find out at call time
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [k for k in REQUIRED_KWARGS if k not in params]


class Fa4Adapter(Adapter):
    name = "fa4"
    precision = "bf16"
    memory_note = "packed varlen (T,H,D), no padding"

    def _func(self):
        mod, reason = try_import(MODULE)
        if mod is None:
            return None, reason
        fn = getattr(mod, "flash_attn_varlen_func", None)
        if fn is None:
            return None, f"not installed: {MODULE} has no flash_attn_varlen_func"
        return fn, ""

    def available(self) -> tuple[bool, str]:
        fn, reason = self._func()
        if fn is None:
            return False, reason
        reason = no_cuda_reason()
        if reason:
            return False, reason
        import torch

        major, minor = torch.cuda.get_device_capability()
        if major < 9:
            return False, f"needs sm90 or newer, this GPU is sm{major}{minor}"
        missing = missing_kwargs(fn)
        if missing:
            return False, f"flash_attn_varlen_func takes no {', '.join(missing)} (interface changed)"
        return True, ""

    def versions(self) -> dict[str, str]:
        out = {}
        for dist in ("flash-attn-4", "flash-attn-cute", "nvidia-cutlass-dsl", "quack-kernels"):
            v = dist_version(dist)
            if v:
                out[dist] = v
        return out

    def build(self, workload):
        fn, reason = self._func()
        if fn is None:
            raise PeerSkip(reason)
        if no_cuda_reason():
            raise RuntimeError(NO_CUDA)
        cu_of = cu_seqlens_per_device(workload)
        max_len = int(workload.max_seqlen)  # a Python int, not a tensor
        causal = workload.causal

        def f(q, k, v):
            cu = cu_of(q.device)
            res = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                     max_seqlen_k=max_len, causal=causal)
            return first_output(res)

        return f
