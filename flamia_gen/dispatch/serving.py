"""What a table dispatches to: the variants a deployment bundle must hold (`flamia-gen bundle --table TABLE`).

The runtime asks the table for every kernel (quantizers, forward, backward) and takes the named one from the bundle;
a name the bundle lacks falls back to another variant of the group, untuned (`runtime.attention._pick` warns). A bundle
of a whole route holds every variant the specs allow (tens of kernels per route); a bundle of the table's choices holds
only what this table can answer with:

- per group of the selected routes and head dims: the winners of the table's entries (every bucket: the runtime's
  nearest-bucket lookup can answer with any of them), or, for a group the table holds no entry of, the default it
  would answer with (the table's own `defaults`, else the plan's analytic one);
- the forwards and quantizers the chosen backwards' op paths need (`plan.op_support.backward_support`).

Plan-level only: no torch, no DSL."""

from __future__ import annotations

from ..plan.op_support import backward_support
from .defaults import DET_SUFFIX, plan_groups


def _routes_of(v) -> set[str]:
    """The routes a variant serves (an attention variant's `uses` are route names, a quantizer's route.operand)."""
    return {u.split(".")[0] for u in v.uses}


def table_served_variants(specs, arch: str, table: dict, plan, routes=(), head_dims=()) -> tuple[list, list[str]]:
    """(the variants `plan` must build for `table` to be served from one bundle, in plan order; notes on winners the
    plan no longer offers). `routes` / `head_dims` narrow the groups (empty: all); a deterministic group
    (`fp8_token_det`) belongs to its route."""
    routes, head_dims = set(routes), set(head_dims)
    by_name = {v.name: v for v in plan.variants}
    winners: dict[str, set[str]] = {}
    for e in table["entries"].values():
        winners.setdefault(e["group"], set()).add(e["winner"]["variant"])
    defaults = table.get("defaults") or {}
    names: set[str] = set()
    notes: list[str] = []
    for key, g in plan_groups(plan, specs).items():
        if head_dims and g.head_dim not in head_dims:
            continue
        if routes:
            served = (set().union(*(_routes_of(by_name[n]) for n in g.candidates)) if g.kind == "quant"
                      else {g.route.removesuffix(DET_SUFFIX)})
            if not served & routes:
                continue
        want = winners.get(key, set())
        keep = want & set(g.candidates)
        for gone in sorted(want - keep):
            notes.append(f"{key}: the table's winner {gone} is not a variant of the installed specs (the runtime "
                         "falls back to the group's default, bundled instead)")
        if keep:
            names |= keep
        if not keep or want - keep:
            d = defaults.get(key)
            names.add(d if d in g.candidates else g.default)
    bwd = [by_name[n] for n in sorted(names) if by_name[n].kind.value == "attn_bwd"]
    names |= {v.name for v in backward_support(specs, arch, bwd)}
    return [v for v in plan.variants if v.name in names], notes


__all__ = ["table_served_variants"]
