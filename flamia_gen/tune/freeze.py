"""Freeze: the studies of one (arch, GPU) in a storage → a dispatch table.

Per study (one table entry): the winner is the complete trial with the smallest median
(ties: variant name), the runner-up the next one; variants pruned by verification are
listed with their reason and can never win. `trials` counts the distinct variants
measured. Studies whose candidates no longer match the installed plan (specs changed)
are skipped and reported, never frozen. The result depends only on which variants were
measured and their times, not on which worker measured them or in what order.

`carry`: a previous table of the same arch and GPU whose entries stand in for buckets the
storage has no study for, each only while what it was measured on is still installed (the
group exists with the same number of candidates, its winner and runner-up among them, and an
attention entry's route has the spec hash the old table recorded): a route added to a family
changes the family's hash but not the kernels of the routes already there, so their
measurements are kept and only the new groups need tuning. Carried entries say so (`carried`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import optuna
from optuna.trial import TrialState

from ..dispatch.buckets import bucket_label
from ..dispatch.defaults import DET_SUFFIX, plan_groups, spec_hashes
from ..dispatch.table import gpu_slug, make_metadata
from .study import measured_trials


class FreezeError(ValueError):
    pass


@dataclass
class FreezeReport:
    entries: int = 0
    skipped: list[str] = field(default_factory=list)  # "study: why"
    carried: int = 0  # entries taken over from the `carry` table
    gpus: list[str] = field(default_factory=list)


def _one(values: set) -> str | None:
    vals = sorted(str(v) for v in values if v is not None)
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else " | ".join(vals)


def carry_reason(entry: dict, groups: dict, old_routes: dict, installed_routes: dict) -> str | None:
    """None when a previous table's entry still describes the installed kernels, else why not."""
    g = groups.get(entry["group"])
    if g is None:
        return f"group {entry['group']} is not in the installed plan"
    cands = list(g.candidates)
    if entry.get("candidates") is not None and entry["candidates"] != len(cands):
        return f"{entry['candidates']} candidates then, {len(cands)} installed"
    for r in (entry["winner"], entry.get("runner_up")):
        if r and r["variant"] not in cands:
            return f"{r['variant']} is no longer a candidate"
    if entry["kind"] != "quant":
        base = g.route.removesuffix(DET_SUFFIX)
        if old_routes.get(base) is None or old_routes.get(base) != installed_routes.get(base):
            return f"route {base} changed since it was measured"
    return None


def freeze(storage, arch: str, gpu: str | None = None, *, specs=None, plan=None,
           carry: dict | None = None) -> tuple[dict, FreezeReport]:
    from ..plan import make_plan
    from ..spec import load_specs
    from .study import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if isinstance(storage, str) or storage is None:
        storage = open_storage(storage)
    specs = specs or load_specs()
    plan = plan or make_plan(specs, arch=arch)
    groups = plan_groups(plan, specs)
    rep = FreezeReport()
    summaries = [s for s in optuna.get_all_study_summaries(storage, include_best_trial=False)
                 if s.user_attrs.get("flamia_gen_study") and s.user_attrs.get("arch") == arch]
    gpus = sorted({s.user_attrs["gpu"] for s in summaries})
    rep.gpus = gpus
    if carry is not None:
        cm = carry["_metadata"]
        if cm["arch"] != arch or cm["untuned"] or not cm["gpu"]:
            raise FreezeError(f"--carry: a tuned {arch} table is needed (it is arch {cm['arch']}, "
                              f"{'untuned' if cm['untuned'] else 'GPU ' + str(cm['gpu'])})")
        gpu = gpu or cm["gpu"]
        if gpu_slug(cm["gpu"]) != gpu_slug(gpu):
            raise FreezeError(f"--carry: the table was tuned on {cm['gpu']!r}, these studies are for {gpu!r}")
    if not summaries and carry is None:
        raise FreezeError(f"no flamia-gen study for arch {arch} in this storage: "
                          f"run flamia-gen tune --arch {arch} first")
    if gpu is None:
        if len(gpus) > 1:
            raise FreezeError(f"studies for several GPUs in this storage: {gpus}; pick one with --gpu")
        gpu = gpus[0]
    chosen = [s for s in summaries if gpu_slug(s.user_attrs["gpu"]) == gpu_slug(gpu)]
    if not chosen and carry is None:
        raise FreezeError(f"no study for GPU {gpu!r} (arch {arch}); this storage has {gpus}")
    gpu = chosen[0].user_attrs["gpu"] if chosen else gpu

    by_key: dict[str, list] = {}
    for s in sorted(chosen, key=lambda s: s.study_name):
        a = s.user_attrs
        g = groups.get(a["group"])
        if g is None:
            rep.skipped.append(f"{s.study_name}: group {a['group']} is not in the installed plan")
            continue
        if a.get("retime"):
            # `tune --retime`: the group's winners of a table's untrusted entries, a subset of its candidates
            if not set(a["candidates"]) <= set(g.candidates):
                rep.skipped.append(f"{s.study_name}: its candidates are no longer the installed plan's (specs changed)")
                continue
        elif list(g.candidates) != list(a["candidates"]):
            rep.skipped.append(f"{s.study_name}: its candidates differ from the installed plan's (specs changed)")
            continue
        key = f"{a['group']}/{bucket_label(a['bucket'])}"
        trials = measured_trials(storage.get_all_trials(s._study_id, deepcopy=False))
        if not any(t.state == TrialState.COMPLETE for t in trials):
            rep.skipped.append(f"{s.study_name}: no variant passed verification and was timed yet")
            continue
        by_key.setdefault(key, []).append((s, trials))

    entries = {}
    env: dict[str, set] = {"torch": set(), "cuda_driver": set(), "dsl": set()}
    for key, cands in sorted(by_key.items()):
        # several studies for one bucket (other representative workloads): most measured wins
        s, trials = max(cands, key=lambda c: (len(c[1]), c[0].study_name))
        for other, _ in cands:
            if other is not s:
                rep.skipped.append(f"{other.study_name}: another study of bucket {key} has more trials")
        a = s.user_attrs
        ok = sorted((t for t in trials if t.state == TrialState.COMPLETE),
                    key=lambda t: (t.value, t.user_attrs["variant"]))
        pruned = {t.user_attrs["variant"]: t.user_attrs.get("pruned_reason", "pruned")
                  for t in trials if t.state == TrialState.PRUNED}
        for t in trials:
            for k in env:
                env[k].add((t.user_attrs.get("env") or {}).get(k))

        def row(t):
            r = {"variant": t.user_attrs["variant"], "median_ms": round(float(t.value), 6)}
            src = (t.user_attrs.get("measurement") or {}).get("x_source_sha256")
            if src:
                r["source_sha256"] = src  # the build that was timed (dispatch.table.stale_builds)
            return r

        entries[key] = {
            "group": a["group"], "kind": a["kind"], "route": a["route"], "head_dim": a["head_dim"],
            "causal": a["causal"], "bucket": dict(a["bucket"]),
            "winner": row(ok[0]), "runner_up": row(ok[1]) if len(ok) > 1 else None,
            "trials": len(trials), "candidates": len(groups[a["group"]].candidates), "pruned": pruned,
            "workload": a["workload"], "heads": a["heads"], "study": s.study_name,
            # a re-time measured only the group's earlier winners: the choice among the others is the earlier one's
            **({"retimed": len(a["candidates"])} if a.get("retime") else {}),
        }
    hashes = spec_hashes(specs, plan, arch)
    if carry is not None:
        old_routes = carry["_metadata"]["spec_hashes"]["routes"]
        for key, e in sorted(carry["entries"].items()):
            if key in entries:
                continue
            why = carry_reason(e, groups, old_routes, hashes["routes"])
            if why:
                rep.skipped.append(f"carried {key}: {why}")
                continue
            entries[key] = dict(e, carried=e.get("carried") or carry["_metadata"].get("frozen_at") or True)
            rep.carried += 1
    rep.entries = len(entries)
    meta = make_metadata(arch, gpu=gpu, spec_hashes=hashes, untuned=False,
                         dsl=_one(env["dsl"]), torch=_one(env["torch"]), cuda_driver=_one(env["cuda_driver"]),
                         extra={"trials_total": sum(e["trials"] for e in entries.values()),
                                "carried_entries": rep.carried})
    table = {"_metadata": meta, "entries": entries, "defaults": {k: g.default for k, g in groups.items()}}
    return table, rep


__all__ = ["freeze", "FreezeError", "FreezeReport"]
