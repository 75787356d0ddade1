"""Runtime: bundle loading, host wrappers of the kernels, and the attention entry points.

Imports neither the DSL nor optuna: it runs on GPU hosts that only have torch and
apache-tvm-ffi."""

from .attention import NoKernelError, available_routes, packed_attention


def autograd_attention(q, k, v, cu_seqlens, max_seqlen, **kw):
    """`flamia_gen.attention` (the torch.library op: forward and backward kernels, autograd);
    imported on first use so that loading the runtime registers no ops."""
    from .ops import attention

    return attention(q, k, v, cu_seqlens, max_seqlen, **kw)


__all__ = ["NoKernelError", "available_routes", "packed_attention", "autograd_attention"]
