"""Specs: pydantic models of routes and kernel families, and their loading."""

from .enums import (Arch, DiagonalPolicy, DqAccumulator, ExpApprox, ExponentRule, Format, Granularity,
                    KernelKind, Operand, Scheduler)
from .kernel import AttnTunables, KernelFamily, QuantTunables
from .loader import SpecError, SpecSet, default_specs_dir, get_route, load_family, load_route, load_specs
from .route import OperandQuant, Operands, Route, operand_quant

__all__ = [
    "Arch", "DiagonalPolicy", "DqAccumulator", "ExpApprox", "ExponentRule", "Format", "Granularity",
    "KernelKind", "Operand", "Scheduler", "AttnTunables", "KernelFamily", "QuantTunables", "SpecError",
    "SpecSet", "default_specs_dir", "get_route", "load_family", "load_route", "load_specs", "OperandQuant",
    "Operands", "Route", "operand_quant",
]
