"""flamia-gen: low-precision attention kernels generated from specs, verified and autotuned."""

__version__ = "0.1.0"

__all__ = ["attention", "__version__"]


def __getattr__(name):
    # `flamia_gen.attention` imports torch and registers the `flamia::` custom ops on first use,
    # so `import flamia_gen` (the CLI, the spec tools) stays free of torch.
    if name == "attention":
        from .runtime.ops import attention

        globals()["attention"] = attention
        return attention
    raise AttributeError(f"module 'flamia_gen' has no attribute {name!r}")
