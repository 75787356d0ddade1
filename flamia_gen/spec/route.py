"""A route: for each operand of attention training, a format and a scaling granularity,
plus the safeguards (DESIGN.md §2). Pydantic parses YAML into these frozen models; the
cross-field rules live here and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .enums import DiagonalPolicy, DqAccumulator, ExpApprox, ExponentRule, Format, Granularity, Operand, PReference

_IDENT = r"^[a-z][a-z0-9_]{0,47}$"

# Which granularities an operand may take. P and dS are produced inside the kernel.
_ALLOWED_GRANULARITY: dict[Operand, set[Granularity]] = {
    Operand.q: {Granularity.none, Granularity.tensor, Granularity.block1d_32, Granularity.token_block,
                Granularity.token, Granularity.nvfp4},
    Operand.k: {Granularity.none, Granularity.tensor, Granularity.block1d_32, Granularity.token_block,
                Granularity.token, Granularity.nvfp4},
    Operand.v: {Granularity.none, Granularity.tensor, Granularity.block1d_32, Granularity.token_block,
                Granularity.token},
    Operand.do: {Granularity.none, Granularity.tensor, Granularity.block1d_32, Granularity.token_block,
                 Granularity.token},
    Operand.p: {Granularity.none, Granularity.static},
    Operand.ds: {Granularity.none, Granularity.tensor, Granularity.square_32, Granularity.token,
                 Granularity.static},
}


class OperandQuant(BaseModel):
    """How one operand is represented."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Format
    granularity: Granularity
    exponent_rule: ExponentRule = ExponentRule.ceil
    block: int = Field(32, description="tokens (token_block), elements (block1d) or side (square)")
    hadamard: bool = False
    static_exponent: int = Field(0, ge=-126, le=127,
                                 description="granularity=static: headroom exponent; codes = encode(x · 2**static_exponent), "
                                             "i.e. the scale is 2**-static_exponent (P̂ in [0, 1] × 2^8 for E4M3)")

    @model_validator(mode="after")
    def _format_matches_granularity(self) -> "OperandQuant":
        f, g = self.format, self.granularity
        if f is Format.bf16 and g is not Granularity.none:
            raise ValueError(f"granularity={g.value!r} needs an 8/4-bit format; bf16 takes 'none'")
        if f is not Format.bf16 and g is Granularity.none:
            raise ValueError(f"format={f.value!r} needs a scale granularity, not 'none'")
        if (f is Format.e2m1) != (g is Granularity.nvfp4):
            raise ValueError("format 'e2m1' and granularity 'nvfp4' go together "
                             f"(got format={f.value!r}, granularity={g.value!r})")
        if g in (Granularity.token_block, Granularity.block1d_32, Granularity.square_32) and self.block != 32:
            raise ValueError(f"granularity={g.value!r} needs block=32 (got block={self.block}); "
                             "allowed values: 32")
        return self

    @property
    def quantized(self) -> bool:
        return self.format is not Format.bf16

    def short_str(self) -> str:
        """Legible tag, torchao style: e4m3_tb32_ceil, e2m1_nvfp4, bf16."""
        if not self.quantized:
            return "bf16"
        g = {Granularity.token_block: "tb", Granularity.block1d_32: "b1d", Granularity.square_32: "sq",
             Granularity.token: "tok", Granularity.tensor: "tsr", Granularity.static: "st",
             Granularity.nvfp4: "nvfp4"}[self.granularity]
        if self.granularity in (Granularity.token_block, Granularity.block1d_32, Granularity.square_32):
            g += str(self.block)
        s = f"{self.format.value}_{g}"
        if self.granularity not in (Granularity.static, Granularity.nvfp4):
            s += f"_{self.exponent_rule.value}"
        if self.hadamard:
            s += "_had"
        return s


class Operands(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    q: OperandQuant
    k: OperandQuant
    v: OperandQuant
    do: OperandQuant
    p: OperandQuant
    ds: OperandQuant

    def items(self):
        return [(Operand(name), getattr(self, name)) for name in ("q", "k", "v", "do", "p", "ds")]

    @model_validator(mode="after")
    def _per_operand_rules(self) -> "Operands":
        for op, oq in self.items():
            allowed = _ALLOWED_GRANULARITY[op]
            if oq.granularity not in allowed:
                raise ValueError(
                    f"{op.value}.granularity={oq.granularity.value!r} is not allowed for operand "
                    f"{op.value!r}; allowed values: {sorted(a.value for a in allowed)}")
            if oq.hadamard and op not in (Operand.q, Operand.k):
                raise ValueError(f"{op.value}.hadamard=true: the rotation is only defined for q and k "
                                 "(it cancels in QKᵀ)")
        if self.q.hadamard != self.k.hadamard:
            raise ValueError("q.hadamard and k.hadamard must be equal (the rotation must cancel in QKᵀ)")
        return self


class Route(BaseModel):
    """A named recipe for attention training in low precision."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_IDENT)
    description: str = ""
    operands: Operands
    diagonal: DiagonalPolicy = DiagonalPolicy.none
    k_fold: bool = False
    causal_dq_scale: bool = False
    dq_accumulator: DqAccumulator = DqAccumulator.fp32_atomic
    exp_approx: ExpApprox = ExpApprox.ex2
    scores_bf16: bool = Field(False, description="QKᵀ (forward and its backward recomputation) on the BF16 inputs; "
                                                 "q and k's representation serves only dK = dSᵀ·Q and dQ = dS·K")
    p_reference: PReference = Field(PReference.ceil, description="the forward's P̂ reference: the running row max, "
                                                                 "rounded up to an integer (ceil) or as is (exact)")
    exact: bool = Field(False, description="claims O_i, dQ_i bitwise independent of later positions")

    @field_validator("description")
    @classmethod
    def _one_line(cls, v: str) -> str:
        return " ".join(v.split())

    @model_validator(mode="after")
    def _safeguards(self) -> "Route":
        ops = self.operands
        if self.diagonal is DiagonalPolicy.per_key_v and ops.v.granularity is not Granularity.token_block:
            raise ValueError("diagonal='per_key_v' only applies when v.granularity='token_block' "
                             f"(got v.granularity={ops.v.granularity.value!r})")
        if self.k_fold and ops.k.granularity is not Granularity.token_block:
            raise ValueError("k_fold=true only applies when k.granularity='token_block'")
        if self.causal_dq_scale and not ops.ds.quantized:
            raise ValueError("causal_dq_scale=true needs a quantized ds")
        if self.scores_bf16:
            bad = [op for op, oq in (("q", ops.q), ("k", ops.k)) if oq.format not in (Format.e4m3, Format.e5m2)
                   or oq.granularity not in (Granularity.token, Granularity.token_block) or oq.hadamard]
            if bad:
                raise ValueError(f"scores_bf16=true: q and k serve only the dK and dQ products, so they must be "
                                 f"E4M3/E5M2 per token or token_block without a Hadamard rotation (operands {bad})")
            if self.k_fold:
                raise ValueError("scores_bf16=true with k_fold=true: QKᵀ takes no K scale to fold")
        if self.p_reference is PReference.exact and not ops.p.quantized:
            raise ValueError("p_reference='exact' only applies to a quantized p (a BF16 P̂ has no rounding reference)")
        if self.exact:
            leaky = [op.value for op, oq in ops.items()
                     if oq.granularity in (Granularity.tensor, Granularity.nvfp4)
                     or (oq.quantized and oq.exponent_rule is ExponentRule.floor
                         and oq.granularity is not Granularity.static)]
            if leaky:
                raise ValueError(f"exact=true is impossible with tensor-wide, nvfp4 or floor-exponent "
                                 f"scales (operands {leaky}): a later token moves their scale")
            if ops.v.granularity is Granularity.token_block and self.diagonal is not DiagonalPolicy.per_key_v:
                raise ValueError("exact=true with token_block V needs diagonal='per_key_v'")
            if ops.k.granularity is Granularity.token_block and not self.k_fold:
                raise ValueError("exact=true with token_block K needs k_fold=true")
            if ops.ds.quantized and ops.ds.granularity is not Granularity.token and not self.causal_dq_scale:
                raise ValueError("exact=true with a block-scaled ds needs causal_dq_scale=true")
        return self

    @property
    def bf16_scores(self) -> bool:
        """QKᵀ runs on the BF16 inputs: the route says so (scores_bf16), or its q, k are BF16 while its
        PV side is 8-bit (fp8_pv). The one rule the planner's `scores_bf16` variant key follows."""
        ops = self.operands
        return self.scores_bf16 or (not ops.q.quantized and ops.v.quantized)

    @property
    def quantized(self) -> bool:
        return any(oq.quantized for _, oq in self.operands.items())

    def forward_safeguards(self, causal: bool) -> "ForwardSafeguards":
        """Which token-block operands a causal forward replaces by their per-token copies, and
        where (the emulator, the templates and the runtime all read this one rule):
        per_key_k / per_key_v on diagonal tiles (k_fold / diagonal=per_key_v), per-token Q rows
        in QKᵀ for an exact route. Nothing applies without a causal mask."""
        ops, tb = self.operands, Granularity.token_block
        return ForwardSafeguards(
            per_key_k=causal and self.k_fold and ops.k.granularity is tb,
            per_key_v=causal and self.diagonal is DiagonalPolicy.per_key_v and ops.v.granularity is tb,
            rows_q=self.exact and ops.q.granularity is tb and not self.scores_bf16)  # BF16 scores: no Q scale in QKᵀ

    def spec_hash(self) -> str:
        """Content hash of the parsed route (not the YAML text): comments and key order don't count."""
        d = self.model_dump(mode="json")
        for key, default in _HASH_OMITS_DEFAULT.items():  # fields added later: routes that keep their
            if d.get(key) == default:                     # defaults keep the hash they had (tables stay valid)
                d.pop(key)
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_HASH_OMITS_DEFAULT = {"scores_bf16": False, "p_reference": PReference.ceil.value}


class ForwardSafeguards(NamedTuple):
    per_key_k: bool  # K per key (token scale) on diagonal tiles, in QKᵀ and in dS·K
    per_key_v: bool  # V per key on diagonal tiles, in PV and in dO·Vᵀ
    rows_q: bool  # Q per token in QKᵀ (O_i then depends on q_i's own scale only)


def operand_quant(route: Route, operand: Operand | str) -> OperandQuant:
    return getattr(route.operands, Operand(operand).value)


__all__ = ["ForwardSafeguards", "OperandQuant", "Operands", "Route", "operand_quant"]
