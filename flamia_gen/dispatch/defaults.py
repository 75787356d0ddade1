"""Groups, analytic defaults and spec hashes, from the plan (no optuna, no torch).

A *group* is what a table entry must match exactly: (arch, kind, route, head dim) and,
for attention, causal. For a quantizer the "route" is the operand representation tag
(`e4m3_tb32_ceil`): one quantizer variant serves every route.operand with that
representation (the plan keys it so).

**The analytic default of a group** is its first feasible variant in *spec order*: the
variants are sorted by the position of each tunable's value in the family's YAML list
(tunables compared in the order the family model declares them, e.g. `tokens_per_cta`
then `heads_per_cta`), then by name. So the first value of every tunable list is the
default, and when the plan prunes that point the next feasible one in the same order
takes its place. `quant_sm90.yaml` lists `tokens_per_cta: [32, 64, 128]`, so the default
quantizer of every group is its `t32` variant. The tuner measures candidates in the same
order (default first).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

GROUP_ONLY_PARAMS = ("causal", "deterministic")  # attention tunables that are part of the group, not searched
DET_SUFFIX = "_det"  # group route tag of the deterministic backward variants: a user choice, never a tuning one


@dataclass(frozen=True)
class Group:
    arch: str
    kind: str
    route: str  # route name (attention) or representation tag (quantizer)
    head_dim: int
    causal: bool | None  # None for kinds where it does not apply (quantizer)
    candidates: tuple[str, ...]  # feasible variants, spec order; candidates[0] is the default

    @property
    def key(self) -> str:
        return group_key(self.kind, self.route, self.head_dim, self.causal)

    @property
    def default(self) -> str:
        return self.candidates[0]


def group_key(kind: str, route: str, head_dim: int, causal: bool | None = None) -> str:
    kind = str(getattr(kind, "value", kind))
    key = f"{kind}/{route}/d{int(head_dim)}"
    if kind != "quant":
        if causal is None:
            raise ValueError(f"kind={kind!r} needs causal=True/False")
        key += "/causal" if causal else "/noncausal"
    return key


def group_route(route: str, deterministic: bool = False) -> str:
    """The route tag of a dispatch group: deterministic backward variants form their own groups
    (`fp8_token_det`), so the tuner never trades reproducibility for speed."""
    return route + DET_SUFFIX if deterministic else route


def _group_fields(v) -> tuple[str, str, str, int, bool | None]:
    kind = v.kind.value
    causal = bool(v.param("causal")) if kind != "quant" else None
    route = group_route(v.route, bool(dict(v.params).get("deterministic")))
    return v.arch.value, kind, route, int(v.param("head_dim")), causal


def _spec_order(v, fam) -> tuple:
    idx = []
    tun = fam.tunables
    for f in type(tun).model_fields:
        if f in GROUP_ONLY_PARAMS:
            continue
        values = [getattr(x, "value", x) for x in getattr(tun, f)]
        p = dict(v.params).get(f)
        idx.append(values.index(p) if p in values else len(values))
    return tuple(idx)


def plan_groups(plan, specs) -> dict[str, Group]:
    """group key → Group, over every variant of the plan (one arch per plan is expected;
    keys of several arches would collide, so an arch-mixed plan is refused)."""
    arches = {v.arch.value for v in plan.variants}
    if len(arches) > 1:
        raise ValueError(f"plan_groups takes a plan of one arch, got {sorted(arches)}")
    members: dict[tuple, list] = {}
    for v in plan.variants:
        members.setdefault(_group_fields(v), []).append(v)
    out = {}
    for (arch, kind, route, d, causal), vs in sorted(members.items(), key=lambda kv: str(kv[0])):
        ordered = sorted(vs, key=lambda v: (_spec_order(v, specs.families[v.family]), v.name))
        g = Group(arch, kind, route, d, causal, tuple(v.name for v in ordered))
        out[g.key] = g
    return out


def default_variants(plan, specs) -> dict[str, str]:
    """group key → the analytic default variant."""
    return {k: g.default for k, g in plan_groups(plan, specs).items()}


def _h(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def spec_hashes(specs, plan, arch: str) -> dict[str, dict[str, str]]:
    """Content hashes a table is frozen against: every route the arch's families serve
    (the route's own `spec_hash()`), and every family of the arch (its parsed spec plus the
    names and spec hashes of its feasible variants). Any change → tables are stale."""
    arch = str(getattr(arch, "value", arch))
    fams = {n: f for n, f in specs.families.items() if f.arch.value == arch}
    routes = sorted({r for f in fams.values() for r in f.routes})
    fam_hash = {}
    for n, f in sorted(fams.items()):
        vs = sorted((v.name, v.spec_hash) for v in plan.variants if v.family == n)
        fam_hash[n] = _h({"family": f.model_dump(mode="json"), "variants": vs})
    return {"routes": {r: specs.route(r).spec_hash() for r in routes}, "families": fam_hash}


def quant_tag(plan, route: str, operand: str, head_dim: int | None = None) -> str:
    """The representation tag of the quantizer serving `route.operand` in this plan."""
    use = f"{route}.{operand}"
    for v in plan.variants:
        if v.kind.value == "quant" and use in v.uses and (head_dim is None or v.param("head_dim") == head_dim):
            return v.route
    raise KeyError(f"no quantizer variant serves {use!r}")


__all__ = ["Group", "group_key", "group_route", "plan_groups", "default_variants", "spec_hashes", "quant_tag", "DET_SUFFIX"]
