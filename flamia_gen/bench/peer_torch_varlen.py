"""torch's own packed attention, ``torch.nn.attention.varlen.varlen_attn``.

Causal is ``window_size=(-1, 0)`` from torch 2.11; an earlier prototype took
``is_causal``. The signature is read at run time and whichever exists is used.
"""

from __future__ import annotations

import inspect

from .adapter import (NO_CUDA, Adapter, PeerSkip, cu_seqlens_per_device, first_output, no_cuda_reason,
                      try_import)

MODULE = "torch.nn.attention.varlen"


def causal_kwargs(fn, causal: bool) -> dict | None:
    """The keyword arguments that make ``fn`` causal (or not); None if it has neither form."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {"window_size": (-1, 0) if causal else (-1, -1)}
    if "window_size" in params:
        return {"window_size": (-1, 0) if causal else (-1, -1)}
    if "is_causal" in params:
        return {"is_causal": causal}
    return None


class TorchVarlenAdapter(Adapter):
    name = "torch_varlen"
    precision = "bf16"
    memory_note = "packed varlen (T,H,D), no padding"

    def _func(self):
        mod, reason = try_import(MODULE)
        if mod is None:
            return None, reason
        fn = getattr(mod, "varlen_attn", None)
        if fn is None:
            return None, f"not installed: {MODULE} has no varlen_attn"
        return fn, ""

    def available(self) -> tuple[bool, str]:
        fn, reason = self._func()
        if fn is None:
            return False, reason
        if causal_kwargs(fn, True) is None:
            return False, "varlen_attn takes neither window_size nor is_causal (interface changed)"
        reason = no_cuda_reason()
        return (reason is None), (reason or "")

    def versions(self) -> dict[str, str]:
        import torch

        return {"torch": torch.__version__}

    def build(self, workload):
        fn, reason = self._func()
        if fn is None:
            raise PeerSkip(reason)
        if no_cuda_reason():
            raise RuntimeError(NO_CUDA)
        extra = causal_kwargs(fn, workload.causal)
        if extra is None:
            raise PeerSkip("varlen_attn takes neither window_size nor is_causal")
        max_len = int(workload.max_seqlen)
        cu_of = cu_seqlens_per_device(workload)

        def f(q, k, v):
            cu = cu_of(q.device)
            return first_output(fn(q, k, v, cu, cu, max_len, max_len, **extra))

        return f
