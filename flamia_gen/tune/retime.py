"""Re-timing a table's untrusted entries: `flamia-gen bundle --retime TABLE` and `flamia-gen tune --retime TABLE`.

A table entry's time describes the build it was measured on. After a template change the installed templates render
some winners differently (`dispatch.table.stale_builds`), and entries frozen before builds were recorded carry no
build at all: the table still dispatches them (same spec hashes), but their times, and perhaps the choice between
candidates, describe another kernel. Re-timing measures exactly those winners again, one study per untrusted
(group, bucket) with the group's winners as its only candidates, so a GPU session spends seconds per bucket instead
of a full search; `flamia-gen freeze --carry TABLE` then keeps every trusted entry and takes the new times.
"""

from __future__ import annotations

from dataclasses import replace


def untrusted_entries(table: dict, plan, *, arch: str | None = None) -> dict[str, str]:
    """entry key → winner of the entries whose time describes another build of the winner (a template change since
    tuning) or no recorded build (frozen before builds were recorded)."""
    from ..dispatch.table import stale_builds

    out = {k: w for k, w in stale_builds(table, arch, plan=plan)}
    for k, e in table["entries"].items():
        if not e["winner"].get("source_sha256"):
            out[k] = e["winner"]["variant"]
    return dict(sorted(out.items()))


def retime_groups(groups, table: dict, untrusted: dict[str, str]) -> tuple[list, list[str]]:
    """(the `groups` that hold `untrusted` entries (`untrusted_entries` of `table`), each with the winners of those
    entries as its only candidates, in the group's own order; notes on untrusted winners the group no longer offers,
    which cannot be re-timed)."""
    by_group: dict[str, set[str]] = {}
    for key, winner in untrusted.items():
        by_group.setdefault(table["entries"][key]["group"], set()).add(winner)
    out, notes = [], []
    for g in groups:
        want = by_group.get(g.key)
        if not want:
            continue
        keep = tuple(n for n in g.candidates if n in want)
        gone = sorted(want - set(keep))
        if gone:
            notes.append(f"{g.key}: {', '.join(gone)} no longer among the group's candidates (tune the group in full)")
        if keep:
            out.append(replace(g, candidates=keep))
    return out, notes


def retime_workloads(table: dict, keys) -> str:
    """The workloads the entries `keys` were timed on (each entry records its own), comma-separated in first-seen
    order: the rows a re-time measures them on again."""
    seen = []
    for k in keys:
        w = table["entries"][k].get("workload")
        if w and w not in seen:
            seen.append(w)
    return ",".join(seen)


def retime_variants(specs, arch: str, table: dict, plan) -> tuple[list, list[str]]:
    """(every variant a re-time of `table` needs in its bundle: the untrusted winners and what the backward ones'
    op paths need (`plan.op_support.backward_support`), in plan order; notes as `retime_groups`)."""
    from ..dispatch.defaults import plan_groups
    from ..plan.op_support import backward_support

    groups, notes = retime_groups(list(plan_groups(plan, specs).values()), table,
                                  untrusted_entries(table, plan, arch=arch))
    names = {n for g in groups for n in g.candidates}
    winners = [v for v in plan.variants if v.name in names]
    support = backward_support(specs, arch, [v for v in winners if v.kind.value == "attn_bwd"])
    names |= {v.name for v in support}
    return [v for v in plan.variants if v.name in names], notes


__all__ = ["untrusted_entries", "retime_groups", "retime_workloads", "retime_variants"]
