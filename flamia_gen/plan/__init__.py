"""Plan: spec × tunables → concrete, analytically feasible, uniquely named variants."""

from .feasibility import check_quant, quant_smem_bytes
from .naming import procedural_name
from .variants import Plan, Pruned, Variant, expand_family, make_plan

__all__ = ["check_quant", "quant_smem_bytes", "procedural_name", "Plan", "Pruned", "Variant",
           "expand_family", "make_plan"]
