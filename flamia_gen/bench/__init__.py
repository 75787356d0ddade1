"""Benchmark harness: our attention kernels and the peers, side by side.

Modules, one job each: ``workloads`` (packed-document workloads by name),
``flops`` (the FLOP convention), ``timing`` (CUDA-event timing, peak memory),
``adapter``/``peers`` (one adapter per implementation, a registry),
``accuracy`` (cosine vs an fp32 reference), ``report`` (table, JSON, chart),
``runner`` (orchestration) and ``cli`` (``flamia-gen bench``).
Importing this package imports no optional peer library.
"""

from .flops import attention_flops, workload_flops
from .workloads import PAPER_WORKLOADS, Workload, get_workload, make_inputs, parse_workloads

__all__ = [
    "PAPER_WORKLOADS",
    "Workload",
    "attention_flops",
    "get_workload",
    "make_inputs",
    "parse_workloads",
    "workload_flops",
]
