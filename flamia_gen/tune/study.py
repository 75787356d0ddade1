"""Optuna studies: storage, creation, the trial objective and the worker loop.

Storage: an embedded SQLite file by default (`sqlite:///<cache>/tune.db`), or any
SQLAlchemy URL (`postgresql+psycopg2://user@host/db`) so that workers on many GPUs and
hosts share one study. Studies are created with `load_if_exists=True`: re-running a
tune continues where it stopped.

**One measurement per variant, however many workers.** A study's space is finite (the
feasible variants of its group), so instead of a random sampler each trial *claims* the
first unclaimed candidate in spec order:

1. optuna numbers trials uniquely inside a transaction (the study row is locked);
2. trial n waits until every lower-numbered running trial has recorded its claim
   (a user attribute `variant`, written a few milliseconds after the trial starts), then
   takes the first candidate that no other trial holds (running, complete or pruned);
3. a trial whose study has reached its budget, or has no free candidate, records
   `skip` and is pruned without measuring anything.

Claims are thus decided one trial at a time in trial-number order: two workers never
measure one variant, and any number of workers measures the same first `budget`
candidates as one worker. A trial that *fails* (Ctrl-C, a dead worker found by the
storage heartbeat) releases its claim, so a re-run measures that variant again. An embedded
SQLite file has no heartbeat (its writer thread and the trial's writes contend for the one file
lock: on the H200, 2026-11-29, a worker stalled >100 s after recording a measurement, and the next
run waited on the stale claim); instead `tune` fails the trials a dead run left RUNNING when it
starts (`fail_orphaned_trials`: one `tune` command owns a SQLite file).

`budget` counts trials already in the study: a study with 3 measured variants and
`--trials 5` measures 2 more. Failed verification → `pruned_reason` + `TrialPruned`: such
a variant is recorded and can never win.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna
from optuna.samplers import BaseSampler
from optuna.trial import TrialState

from .runner import Measurement, Runner, worker_id
from .space import StudySpec

CLAIM_WAIT_S = 60.0  # how long a trial waits for a lower-numbered trial to record its claim
HEARTBEAT_S = 30
HEARTBEAT_GRACE_S = 120
SQLITE_TIMEOUT_S = 120


def default_storage_url() -> str:
    from ..build.cache import cache_root

    return f"sqlite:///{cache_root() / 'tune.db'}"


class _SQLiteConnection(sqlite3.Connection):
    """WAL journal (readers never block the writer; many worker processes on one file) and
    `synchronous=NORMAL` (one disk sync per checkpoint, not per commit: safe against a
    crashed process, may lose the last trials on power loss). Local disks only (no NFS)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        try:
            self.execute("PRAGMA journal_mode=WAL")
            self.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.OperationalError:
            pass  # another process holds the lock while switching: the mode is persistent anyway


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def fail_orphaned_trials(specs: list["StudySpec"], storage) -> int:
    """Mark FAIL every trial of these studies still RUNNING: called by `tune` on a SQLite file
    before its workers start, when no live worker can hold one (one command owns the file), so a
    run killed mid-trial (timeout, Ctrl-C, a hung storage write) releases its claims at once
    instead of blocking the resume. Returns how many were failed."""
    n = 0
    for spec in specs:
        study = optuna.load_study(study_name=spec.name, storage=storage, sampler=ClaimSampler())
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            n += 1
    return n


def engine_kwargs(url: str) -> dict:
    """SQLAlchemy engine arguments for a storage URL (SQLite: lock timeout, WAL; its folder made)."""
    if not is_sqlite(url):
        return {}
    path = url.split("///", 1)[1] if "///" in url else ""
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    return {"connect_args": {"timeout": SQLITE_TIMEOUT_S, "factory": _SQLiteConnection}}


def open_storage(url: str | None = None) -> optuna.storages.RDBStorage:
    """An RDB storage; a server database gets a heartbeat (dead workers' trials are failed,
    releasing their claims), an embedded SQLite file does not (see the module note and
    `fail_orphaned_trials`). SQLite waits up to 2 minutes for a lock instead of failing at once."""
    url = url or default_storage_url()
    kwargs = engine_kwargs(url)
    beat = {} if is_sqlite(url) else dict(heartbeat_interval=HEARTBEAT_S, grace_period=HEARTBEAT_GRACE_S)
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **beat)
    except Exception as e:  # bad URL, missing driver, unreachable server
        first = (str(e).splitlines() or [""])[0]
        raise ValueError(f"cannot open storage {_redact(url)!r}: {type(e).__name__}: {first}") from None


def _redact(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]


class ClaimSampler(BaseSampler):
    """Returns the variant the objective claimed (user attribute `variant`) for the one
    categorical parameter `variant`; optuna's dashboards then show it as a parameter."""

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        if param_name != "variant" or "variant" not in trial.user_attrs:
            raise ValueError("ClaimSampler only samples the claimed 'variant'")
        return trial.user_attrs["variant"]


def create_studies(specs: list[StudySpec], storage) -> None:
    """Create (or find) every study and record what it is in its user attributes."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for s in specs:
        study = optuna.create_study(study_name=s.name, storage=storage, direction="minimize",
                                    load_if_exists=True, sampler=ClaimSampler())
        have = study.user_attrs
        want = s.attrs()
        if not have.get("flamia_gen_study"):
            for k, v in want.items():
                study.set_user_attr(k, v)
        elif have.get("candidates") != want["candidates"] or have.get("bucket") != want["bucket"]:
            raise ValueError(f"study {s.name!r} exists with another space: delete it or use another storage")


@dataclass
class Claims:
    by_variant: dict[str, int]  # variant → the trial number holding it
    measured: int  # complete or pruned (verification failed)

    @property
    def taken(self) -> int:
        return len(self.by_variant)


def _holds_claim(t) -> bool:
    ua = t.user_attrs
    if "variant" not in ua or ua.get("duplicate_of") is not None:
        return False
    return t.state in (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)


def read_claims(study, *, before: int | None = None, wait_s: float = 0.0) -> Claims:
    """Claims held in `study`. With `before` = n: first wait (up to `wait_s`) until every
    running trial numbered below n has recorded its claim or its skip."""
    deadline = time.monotonic() + wait_s
    while True:
        trials = study.get_trials(deepcopy=False)
        if before is None:
            break
        pending = [t for t in trials if t.number < before and t.state == TrialState.RUNNING
                   and "variant" not in t.user_attrs and "skip" not in t.user_attrs]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    by_variant: dict[str, int] = {}
    measured = 0
    for t in sorted(trials, key=lambda t: t.number):
        if t.number == before or not _holds_claim(t):
            continue
        v = t.user_attrs["variant"]
        if v in by_variant:
            continue
        by_variant[v] = t.number
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            measured += 1
    return Claims(by_variant, measured)


def has_work(study, spec: StudySpec) -> bool:
    c = read_claims(study)
    return c.taken < spec.budget and any(v not in c.by_variant for v in spec.candidates)


def make_objective(spec: StudySpec, runner: Runner, *, device: str = "") -> Callable:
    who = worker_id()

    def objective(trial: optuna.Trial) -> float:
        study = trial.study
        claims = read_claims(study, before=trial.number, wait_s=CLAIM_WAIT_S)
        free = [v for v in spec.candidates if v not in claims.by_variant]
        if claims.taken >= spec.budget or not free:
            trial.set_user_attr("skip", "budget reached" if free else "every candidate is claimed")
            raise optuna.TrialPruned("skip")
        variant = free[0]
        trial.set_user_attr("variant", variant)
        trial.suggest_categorical("variant", list(spec.candidates))
        # Safety net: a lower-numbered trial holding the same variant (only possible when a
        # claim wait timed out) keeps it; this one measures nothing.
        again = read_claims(study, before=trial.number)
        holder = again.by_variant.get(variant)
        if holder is not None and holder < trial.number:
            trial.set_user_attr("duplicate_of", holder)
            raise optuna.TrialPruned(f"duplicate of trial {holder}")
        try:
            info = runner.info()
            m = runner.measure(variant, spec.workload)
        except Exception as e:  # the runner failed on this variant: recorded, never wins
            info = {}
            m = Measurement(False, f"runner error: {type(e).__name__}: {e}"[:300])
        # two attributes, not one per field: every write is a storage round trip
        trial.set_user_attr("measurement", m.attrs())
        trial.set_user_attr("env", {**{k: v for k, v in info.items() if v is not None}, "worker": who,
                                    **({"device": device} if device else {})})
        if not m.ok:
            trial.set_user_attr("pruned_reason", m.reason)
            raise optuna.TrialPruned(m.reason)
        return float(m.median_ms)

    return objective


@dataclass
class WorkerReport:
    measured: int = 0
    pruned: int = 0
    skipped: int = 0
    studies: list[str] = field(default_factory=list)


def run_worker(specs: list[StudySpec], storage, runner: Runner, *, device: str = "", index: int = 0,
               n_workers: int = 1,
               on_trial: Callable[[StudySpec, optuna.trial.FrozenTrial], None] | None = None) -> WorkerReport:
    """Work through `specs`; in each study keep claiming trials until its budget is
    reached. Safe to run in many processes against one storage. Worker `index` of
    `n_workers` starts at its own share of the list and wraps around, so workers mostly
    fill different studies and meet (and help each other) only at the end."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if isinstance(storage, str) or storage is None:
        storage = open_storage(storage)
    rep = WorkerReport()
    gpu = None
    start = (index * len(specs)) // max(1, n_workers) if specs else 0
    for spec in specs[start:] + specs[:start]:
        study = optuna.load_study(study_name=spec.name, storage=storage, sampler=ClaimSampler())
        if gpu is None:
            gpu = runner.info().get("gpu")
        if gpu != spec.gpu:
            from ..dispatch.table import gpu_slug

            if gpu_slug(gpu) != gpu_slug(spec.gpu):
                raise RuntimeError(f"this worker's GPU is {gpu!r} but study {spec.name!r} is for {spec.gpu!r}")
        rep.studies.append(spec.name)
        _fail_stale(study)  # a killed worker's running trial would otherwise hold its claim
        objective = make_objective(spec, runner, device=device)
        while has_work(study, spec):
            finished: list = []
            study.optimize(objective, n_trials=1, gc_after_trial=False,
                           callbacks=[lambda _s, t: finished.append(t)])
            for t in finished:
                if "skip" in t.user_attrs or "duplicate_of" in t.user_attrs:
                    rep.skipped += 1
                elif t.state == TrialState.COMPLETE:
                    rep.measured += 1
                elif t.state == TrialState.PRUNED:
                    rep.pruned += 1
                if on_trial:
                    on_trial(spec, t)
    return rep


def _fail_stale(study) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            optuna.storages.fail_stale_trials(study)
        except Exception:  # a storage without heartbeat support: nothing to do
            pass


# ---------------------------------------------------------------- progress
@dataclass
class Snapshot:
    done: int
    total: int
    best: str  # the best so far of the study that last finished a trial


def measured_trials(study_or_trials) -> list:
    """Each variant's measuring trial (complete or pruned by verification), by trial number."""
    trials = study_or_trials.get_trials(deepcopy=False) if hasattr(study_or_trials, "get_trials") else study_or_trials
    seen, out = set(), []
    for t in sorted(trials, key=lambda t: t.number):
        if t.state not in (TrialState.COMPLETE, TrialState.PRUNED) or not _holds_claim(t):
            continue
        v = t.user_attrs["variant"]
        if v not in seen:
            seen.add(v)
            out.append(t)
    return out


def _best_text(spec: StudySpec, trials) -> str:
    ok = [t for t in trials if t.state == TrialState.COMPLETE]
    if not ok:
        return ""
    b = min(ok, key=lambda t: (t.value, t.user_attrs["variant"]))
    return f"{spec.key}: {b.user_attrs['variant']} {b.value:.4f} ms"


def study_best(spec: StudySpec, storage) -> str:
    """`entry: variant median ms` of the study's best trial so far ('' if none)."""
    study = optuna.load_study(study_name=spec.name, storage=storage, sampler=ClaimSampler())
    return _best_text(spec, measured_trials(study))


def snapshot(specs: list[StudySpec], storage) -> Snapshot:
    """Trials done over all studies, and the best so far of the study that finished a
    trial last (what the progress bar shows; works for workers in other processes)."""
    done = total = 0
    last, best = None, ""
    for s in specs:
        total += s.budget
        try:
            study = optuna.load_study(study_name=s.name, storage=storage, sampler=ClaimSampler())
        except KeyError:
            continue
        ms = measured_trials(study)
        done += min(s.budget, len(ms))
        if ms:
            t_last = max(ms, key=lambda t: t.datetime_complete or t.datetime_start)
            when = t_last.datetime_complete or t_last.datetime_start
            if last is None or (when and when > last):
                last = when
                best = _best_text(s, ms) or best
    return Snapshot(done, total, best)


__all__ = ["default_storage_url", "engine_kwargs", "open_storage", "is_sqlite", "fail_orphaned_trials",
           "ClaimSampler", "create_studies", "Claims", "read_claims", "has_work", "make_objective", "WorkerReport",
           "run_worker", "Snapshot", "measured_trials", "snapshot", "study_best"]
