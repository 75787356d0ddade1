"""A kernel family: which kind of kernel, for which arch and routes, over which tunables.

The plan stage expands a family into concrete variants; the rules of what is legal for
an arch live here (static) and in `flamia_gen.plan.feasibility` (analytic, per point).
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .enums import Arch, KernelKind, Operand, Scheduler

_IDENT = r"^[a-z][a-z0-9_]{0,47}$"


class QuantTunables(BaseModel):
    """Search space of the fused quantizer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_cta: list[Literal[32, 64, 128]] = [32]
    heads_per_cta: list[Literal[1, 2, 4]] = [1]


class AttnTunables(BaseModel):
    """Search space of the attention kernels (forward and backward)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tile_m: list[Literal[64, 128, 192]] = [128]
    tile_n: list[Literal[64, 128, 176, 192, 256]] = [128]
    stages: list[Literal[1, 2, 3, 4]] = [2]
    compute_warpgroups: list[Literal[1, 2, 3]] = [2]
    p_in_registers: list[bool] = [True]
    intra_wg_overlap: list[bool] = [True]
    scheduler: list[Scheduler] = [Scheduler.longest_first]
    causal: list[bool] = [True, False]
    # backward only: dQ partials reduce-added in a fixed order (bitwise reproducible runs)
    deterministic: list[bool] = [False]


def tunables_model(kind) -> type[QuantTunables] | type[AttnTunables]:
    """The kind decides which tunables model parses a family's `tunables` block."""
    return QuantTunables if kind == KernelKind.quant else AttnTunables  # a str enum: "quant" matches too


class KernelFamily(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_IDENT)
    arch: Arch
    kind: KernelKind
    template: str = Field(pattern=r"^(sm90|sm100)/[a-z0-9_]+\.py\.j2$")
    routes: list[str] = Field(min_length=1)
    operands: list[Operand] = [Operand.q, Operand.k, Operand.v, Operand.do]
    head_dims: list[Literal[64, 128]] = [128]
    # How each 8-bit operand reaches the MMA. sm90 FP8 wgmma takes both operands K-major
    # only; sm100 also takes MN-major 8-bit operands (DESIGN.md §3).
    operand_layouts: dict[Operand, Literal["k_major", "mn_major"]] = {}
    sm_count: int = Field(132, ge=1, le=1024, description="persistent grids: SMs of the target GPU")
    tunables: Union[QuantTunables, AttnTunables]

    @model_validator(mode="before")
    @classmethod
    def _pick_tunables(cls, data):
        # The kind decides which tunables model parses the block, so a misspelled
        # tunable is an error naming the field, not a silent union fallback.
        if isinstance(data, dict) and isinstance(data.get("tunables"), dict):
            data = dict(data)
            data["tunables"] = tunables_model(data.get("kind")).model_validate(data["tunables"])
        return data

    @model_validator(mode="after")
    def _arch_rules(self) -> "KernelFamily":
        if not self.template.startswith(self.arch.value + "/"):
            raise ValueError(f"template={self.template!r} is not under {self.arch.value}/")
        if self.kind is KernelKind.quant and not isinstance(self.tunables, QuantTunables):
            raise ValueError("kind='quant' takes quantizer tunables (tokens_per_cta, heads_per_cta)")
        if self.kind is not KernelKind.quant:
            if not isinstance(self.tunables, AttnTunables):
                raise ValueError(f"kind={self.kind.value!r} takes attention tunables")
            if self.arch is Arch.sm90 and any(n > 256 for n in self.tunables.tile_n):
                raise ValueError("sm90 wgmma takes N ≤ 256")
        if self.arch is Arch.sm90:
            mn = sorted(o.value for o, lay in self.operand_layouts.items() if lay == "mn_major")
            if mn:
                raise ValueError(f"operand_layouts: {mn} 'mn_major' is impossible on sm90 (FP8 wgmma "
                                 "takes K-major operands only); allowed values: ['k_major']")
        if self.kind is KernelKind.quant:
            bad = [o.value for o in self.operands if not o.is_input]
            if bad:
                raise ValueError(f"operands={bad}: the quantizer handles inputs only; allowed values: "
                                 "['q', 'k', 'v', 'do']")
        return self
