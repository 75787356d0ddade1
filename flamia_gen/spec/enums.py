"""Closed vocabularies of the specs.

Every value a spec can put into a template is a member of one of these enums (or a
number), so no YAML can inject code into `generated/`.
"""

from __future__ import annotations

from enum import Enum


class Format(str, Enum):
    """Element formats (their encodings: `flamia_gen.numerics.formats.format_info`)."""

    bf16 = "bf16"
    e4m3 = "e4m3"  # OCP E4M3 "fn": no inf, NaN = S.1111.111, max 448
    e5m2 = "e5m2"  # IEEE-like, max 57344
    e2m1 = "e2m1"  # FP4, max 6


class Granularity(str, Enum):
    """Which elements share one scale (DESIGN.md §2)."""

    none = "none"  # unscaled (bf16 operands)
    static = "static"  # a compile-time power of two (P̂ in the forward)
    tensor = "tensor"
    block1d_32 = "block1d_32"
    token_block = "token_block"
    token = "token"
    square_32 = "square_32"
    nvfp4 = "nvfp4"


class ExponentRule(str, Enum):
    floor = "floor"  # OCP: floor(log2 amax) - emax; can saturate
    ceil = "ceil"  # smallest exponent with no saturation


class DiagonalPolicy(str, Enum):
    none = "none"
    per_key_v = "per_key_v"  # diagonal tiles use per-key V scales folded into P̂


class ExpApprox(str, Enum):
    ex2 = "ex2"  # MUFU ex2.approx
    poly3 = "poly3"  # Cody-Waite + degree-3 FMA polynomial (part of the elements)
    poly5 = "poly5"


class PReference(str, Enum):
    """The forward's P̂ reference: the running row max m of the logits (V's exponent folded in)."""

    ceil = "ceil"  # m rounded up to an integer: an O rescale is an exact power of two
    exact = "exact"  # the fp32 running max itself: the dominant P̂ of a row is exactly 2^static (outlier rows)


class DqAccumulator(str, Enum):
    fp32_atomic = "fp32_atomic"
    fp32_tma_reduce = "fp32_tma_reduce"


class Operand(str, Enum):
    q = "q"
    k = "k"
    v = "v"
    do = "do"
    p = "p"
    ds = "ds"

    @property
    def is_input(self) -> bool:
        return self in (Operand.q, Operand.k, Operand.v, Operand.do)


class Arch(str, Enum):
    sm90 = "sm90"
    sm100 = "sm100"

    @property
    def cute_arch(self) -> str:
        return {"sm90": "sm_90a", "sm100": "sm_100a"}[self.value]

    @property
    def executable_here(self) -> bool:
        """Whether this project has hardware to run the arch (DESIGN.md §3)."""
        return self is Arch.sm90


class KernelKind(str, Enum):
    quant = "quant"
    attn_fwd = "attn_fwd"
    attn_bwd = "attn_bwd"


class Scheduler(str, Enum):
    static = "static"  # one CTA per work item, grid = work items
    persistent = "persistent"  # grid = SM count, work items fetched in a loop
    longest_first = "longest_first"  # persistent, work items ordered by document length
