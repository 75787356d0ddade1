"""flamia-gen: low-precision attention kernels generated from specs, verified and autotuned."""

__version__ = "0.1.0"
