"""Freeze: the studies of one (arch, GPU) in a storage → a dispatch table.

Per study (one table entry): the winner is the complete trial with the smallest median
(ties: variant name), the runner-up the next one; variants pruned by verification are
listed with their reason and can never win. `trials` counts the distinct variants
measured. Studies whose candidates no longer match the installed plan (specs changed)
are skipped and reported, never frozen. The result depends only on which variants were
measured and their times, not on which worker measured them or in what order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import optuna
from optuna.trial import TrialState

from ..dispatch.buckets import bucket_label
from ..dispatch.defaults import plan_groups, spec_hashes
from ..dispatch.table import gpu_slug, make_metadata
from .study import measured_trials


class FreezeError(ValueError):
    pass


@dataclass
class FreezeReport:
    entries: int = 0
    skipped: list[str] = field(default_factory=list)  # "study: why"
    gpus: list[str] = field(default_factory=list)


def _one(values: set) -> str | None:
    vals = sorted(str(v) for v in values if v is not None)
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else " | ".join(vals)


def freeze(storage, arch: str, gpu: str | None = None, *, specs=None, plan=None) -> tuple[dict, FreezeReport]:
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
    if not summaries:
        raise FreezeError(f"no flamia-gen study for arch {arch} in this storage: "
                          f"run flamia-gen tune --arch {arch} first")
    if gpu is None:
        if len(gpus) > 1:
            raise FreezeError(f"studies for several GPUs in this storage: {gpus}; pick one with --gpu")
        gpu = gpus[0]
    chosen = [s for s in summaries if gpu_slug(s.user_attrs["gpu"]) == gpu_slug(gpu)]
    if not chosen:
        raise FreezeError(f"no study for GPU {gpu!r} (arch {arch}); this storage has {gpus}")
    gpu = chosen[0].user_attrs["gpu"]

    by_key: dict[str, list] = {}
    for s in sorted(chosen, key=lambda s: s.study_name):
        a = s.user_attrs
        g = groups.get(a["group"])
        if g is None:
            rep.skipped.append(f"{s.study_name}: group {a['group']} is not in the installed plan")
            continue
        if list(g.candidates) != list(a["candidates"]):
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
            return {"variant": t.user_attrs["variant"], "median_ms": round(float(t.value), 6)}

        entries[key] = {
            "group": a["group"], "kind": a["kind"], "route": a["route"], "head_dim": a["head_dim"],
            "causal": a["causal"], "bucket": dict(a["bucket"]),
            "winner": row(ok[0]), "runner_up": row(ok[1]) if len(ok) > 1 else None,
            "trials": len(trials), "candidates": len(a["candidates"]), "pruned": pruned,
            "workload": a["workload"], "heads": a["heads"], "study": s.study_name,
        }
    rep.entries = len(entries)
    meta = make_metadata(arch, gpu=gpu, spec_hashes=spec_hashes(specs, plan, arch), untuned=False,
                         dsl=_one(env["dsl"]), torch=_one(env["torch"]), cuda_driver=_one(env["cuda_driver"]),
                         extra={"trials_total": sum(e["trials"] for e in entries.values())})
    table = {"_metadata": meta, "entries": entries, "defaults": {k: g.default for k, g in groups.items()}}
    return table, rep


__all__ = ["freeze", "FreezeError", "FreezeReport"]
