"""Runtime: bundle loading, host wrappers of the kernels, and the attention entry points.

Imports neither the DSL nor optuna: it runs on GPU hosts that only have torch and
apache-tvm-ffi."""

from .attention import NoKernelError, available_routes, packed_attention

__all__ = ["NoKernelError", "available_routes", "packed_attention"]
