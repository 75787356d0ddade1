import optuna
import pytest
from tune_helpers import read_log, synth_spec

from flamia_gen.plan import make_plan
from flamia_gen.spec import load_specs
from flamia_gen.tune.freeze import FreezeError, freeze
from flamia_gen.tune.runner import FakeRunner, Measurement
from flamia_gen.tune.space import make_study_specs, parse_workloads, select_groups
from flamia_gen.tune.study import (ClaimSampler, create_studies, engine_kwargs, measured_trials, open_storage,
                                   run_worker, snapshot)


def _trials(st, spec):
    return optuna.load_study(study_name=spec.name, storage=st, sampler=ClaimSampler()).get_trials()


def test_every_candidate_measured_once_in_spec_order(storage_url, tmp_path):
    st = open_storage(storage_url)
    spec = synth_spec(n=4)
    create_studies([spec], st)
    log = tmp_path / "log"
    rep = run_worker([spec], st, FakeRunner(log=log))
    assert rep.measured == 4 and rep.skipped == 0
    assert [v for _, v, _ in read_log(log)] == ["v0", "v1", "v2", "v3"]
    trials = _trials(st, spec)
    assert [t.params["variant"] for t in trials] == ["v0", "v1", "v2", "v3"]  # a real optuna parameter
    assert all(t.user_attrs["env"]["gpu"] == "Fake GPU" for t in trials)


def test_resume_counts_finished_trials(storage_url, tmp_path):
    """Run 3 trials, then again with a budget of 5: exactly 2 new measurements."""
    st = open_storage(storage_url)
    log = tmp_path / "log"
    first = synth_spec(n=8, budget=3)
    create_studies([first], st)
    run_worker([first], st, FakeRunner(log=log))
    assert len(read_log(log)) == 3
    again = synth_spec(n=8, budget=5)
    assert again.name == first.name  # same study: the budget is not part of its name
    create_studies([again], open_storage(storage_url))
    rep = run_worker([again], open_storage(storage_url), FakeRunner(log=log))
    assert rep.measured == 2
    assert [v for _, v, _ in read_log(log)] == ["v0", "v1", "v2", "v3", "v4"]
    rep = run_worker([again], st, FakeRunner(log=log))  # nothing left to do
    assert rep.measured == 0 and len(read_log(log)) == 5
    assert snapshot([again], st).done == 5


def test_interrupted_trial_is_measured_again_on_resume(storage_url, tmp_path):
    class Interrupting(FakeRunner):
        def measure(self, variant, workload):
            if variant == "v1":
                raise KeyboardInterrupt
            return super().measure(variant, workload)

    st = open_storage(storage_url)
    spec = synth_spec(n=3)
    create_studies([spec], st)
    with pytest.raises(KeyboardInterrupt):
        run_worker([spec], st, Interrupting())
    states = [(t.user_attrs.get("variant"), t.state) for t in _trials(st, spec)]
    assert states == [("v0", optuna.trial.TrialState.COMPLETE), ("v1", optuna.trial.TrialState.FAIL)]
    log = tmp_path / "log"
    run_worker([spec], st, FakeRunner(log=log))
    assert [v for _, v, _ in read_log(log)] == ["v1", "v2"]  # the failed claim was released
    assert sorted(t.user_attrs["variant"] for t in measured_trials(_study(st, spec))) == ["v0", "v1", "v2"]


def _study(st, spec):
    return optuna.load_study(study_name=spec.name, storage=st, sampler=ClaimSampler())


def test_failed_verification_is_pruned_with_reason_and_runner_errors_too(storage_url):
    st = open_storage(storage_url)
    spec = synth_spec(n=3)
    create_studies([spec], st)
    rep = run_worker([spec], st, FakeRunner(fail=["v0"], crash=["v2"]))
    assert (rep.measured, rep.pruned) == (1, 2)
    by = {t.user_attrs["variant"]: t for t in _trials(st, spec)}
    assert by["v0"].state == optuna.trial.TrialState.PRUNED
    assert "verification failed" in by["v0"].user_attrs["pruned_reason"]
    assert by["v2"].user_attrs["pruned_reason"].startswith("runner error: RuntimeError: fake crash")


@pytest.fixture(scope="module")
def sm90():
    specs = load_specs()
    return specs, make_plan(specs, arch="sm90")


def _real_studies(sm90, gpu="Fake GPU", routes=("mxfp8", "fp8_token"), workloads="4x1024,1x65536"):
    specs, plan = sm90
    groups = select_groups(plan, specs, kinds=["quant"], routes=list(routes))
    return make_study_specs(groups, parse_workloads(workloads), gpu=gpu)


def test_freeze_picks_fastest_verified_winner_and_runner_up(storage_url, sm90):
    specs, plan = sm90
    studies = _real_studies(sm90, workloads="1x65536")  # one bucket per group: 'fail' is global
    st = open_storage(storage_url)
    create_studies(studies, st)
    fake = FakeRunner()
    # make the would-be winner of every study fail verification: it must never win
    fastest = {s.key: min(s.candidates, key=lambda v: fake.time_ms(v, s.workload)) for s in studies}
    runner = FakeRunner(fail=sorted(set(fastest.values())))
    run_worker(studies, st, runner)
    table, rep = freeze(st, "sm90", specs=specs, plan=plan)
    assert rep.entries == len(studies) == len(table["entries"]) and not rep.skipped
    for s in studies:
        e = table["entries"][s.key]
        ok = sorted((fake.time_ms(v, s.workload), v) for v in s.candidates if v != fastest[s.key])
        assert len(ok) >= 2
        assert e["winner"] == {"variant": ok[0][1], "median_ms": round(ok[0][0], 6)}
        assert e["runner_up"]["variant"] == ok[1][1]
        assert e["trials"] == len(s.candidates) and fastest[s.key] in e["pruned"]
        assert "verification failed" in e["pruned"][fastest[s.key]]
    assert table["_metadata"]["gpu"] == "Fake GPU" and table["_metadata"]["untuned"] is False


def test_freeze_reports_all_failed_and_stale_studies(storage_url, sm90):
    specs, plan = sm90
    studies = _real_studies(sm90, routes=("mxfp8",), workloads="4x1024")
    st = open_storage(storage_url)
    other = synth_spec()  # a study whose group is not in the plan
    create_studies(studies + [other], st)
    run_worker(studies, st, FakeRunner(fail=["*_d64_*"]))
    run_worker([other], st, FakeRunner())
    table, rep = freeze(st, "sm90", specs=specs, plan=plan)
    assert set(table["entries"]) == {s.key for s in studies if s.group.head_dim == 128}
    assert any("no variant passed verification" in x for x in rep.skipped)
    # the synthetic study's group 'quant/synthetic/d128' is unknown to the plan: never frozen
    assert any("not in the installed plan" in x for x in rep.skipped)


def test_freeze_needs_a_gpu_choice_when_ambiguous(storage_url, sm90):
    specs, plan = sm90
    st = open_storage(storage_url)
    a = _real_studies(sm90, gpu="GPU A", routes=("fp8_token",), workloads="4x1024")
    b = _real_studies(sm90, gpu="GPU B", routes=("fp8_token",), workloads="4x1024")
    create_studies(a + b, st)
    run_worker(a, st, FakeRunner(gpu="GPU A"))
    run_worker(b, st, FakeRunner(gpu="GPU B"))
    with pytest.raises(FreezeError, match="several GPUs"):
        freeze(st, "sm90", specs=specs, plan=plan)
    table, _ = freeze(st, "sm90", "gpu b", specs=specs, plan=plan)
    assert table["_metadata"]["gpu"] == "GPU B"
    with pytest.raises(FreezeError, match="no flamia-gen study for arch sm100"):
        freeze(st, "sm100", specs=specs)


def test_worker_refuses_a_study_of_another_gpu(storage_url):
    st = open_storage(storage_url)
    spec = synth_spec(gpu="NVIDIA H200")
    create_studies([spec], st)
    with pytest.raises(RuntimeError, match="this worker's GPU is 'Fake GPU'"):
        run_worker([spec], st, FakeRunner())


def test_measurement_attrs():
    m = Measurement(True, median_ms=1.0, repeats=20, extra={"timer": "x"})
    assert m.attrs() == {"ok": True, "reason": "", "median_ms": 1.0, "repeats": 20, "x_timer": "x"}


def test_bad_storage_url_is_one_clear_line():
    with pytest.raises(ValueError, match="cannot open storage 'nosuchdb://x'"):
        open_storage("nosuchdb://x")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::optuna.exceptions.ExperimentalWarning")
def test_dead_workers_claim_is_released_by_the_heartbeat(storage_url, tmp_path):
    """A worker killed mid-trial leaves a RUNNING trial holding a claim; once its heartbeat
    is stale, the next run fails it and measures that variant again."""
    import time

    st = optuna.storages.RDBStorage(storage_url, engine_kwargs=engine_kwargs(storage_url), heartbeat_interval=1,
                                    grace_period=1)
    spec = synth_spec(n=2)
    create_studies([spec], st)
    study = _study(st, spec)
    dead = study.ask()
    dead.set_user_attr("variant", "v0")
    st.record_heartbeat(dead._trial_id)  # ... and then the process died
    time.sleep(2.2)
    log = tmp_path / "log"
    rep = run_worker([spec], st, FakeRunner(log=log))
    assert rep.measured == 2 and [v for _, v, _ in read_log(log)] == ["v0", "v1"]
    assert _study(st, spec).get_trials()[0].state == optuna.trial.TrialState.FAIL


def test_sqlite_storage_has_no_heartbeat_and_orphans_are_failed_at_start(storage_url, tmp_path):
    """H200, 2026-11-29: a tuning run stalled after a trial had written its measurement, was
    killed, and the next run waited on the claim that RUNNING trial still held. On SQLite (no
    heartbeat) `fail_orphaned_trials` releases such claims before the workers start."""
    from flamia_gen.tune.study import fail_orphaned_trials, is_sqlite

    assert is_sqlite(storage_url)
    st = open_storage(storage_url)
    assert st.heartbeat_interval is None
    spec = synth_spec(n=2)
    create_studies([spec], st)
    dead = _study(st, spec).ask()
    dead.set_user_attr("variant", "v0")  # claimed, measured, then the process was killed
    dead.set_user_attr("measurement", {"ok": True, "median_ms": 1.0})
    assert fail_orphaned_trials([spec], st) == 1
    assert fail_orphaned_trials([spec], st) == 0
    log = tmp_path / "log"
    rep = run_worker([spec], st, FakeRunner(log=log))
    assert rep.measured == 2 and [v for _, v, _ in read_log(log)] == ["v0", "v1"]
    states = [t.state for t in _study(st, spec).get_trials()]
    assert states[0] == optuna.trial.TrialState.FAIL and states.count(optuna.trial.TrialState.COMPLETE) == 2


def _tuned(sm90, storage_url, routes, gpu="Fake GPU"):
    specs, plan = sm90
    st = open_storage(storage_url)
    groups = select_groups(plan, specs, kinds=["quant", "attn_fwd"], routes=list(routes))
    studies = make_study_specs(groups, parse_workloads("4x1024"), gpu=gpu)
    create_studies(studies, st)
    run_worker(studies, st, FakeRunner(gpu=gpu))
    return st, studies


def test_freeze_carries_a_previous_tables_entries_while_their_kernels_are_installed(storage_url, tmp_path, sm90):
    """Tune fp8_token, freeze; then a fresh storage that tuned only bf16, frozen with `carry`: the
    fp8_token entries come over unchanged (marked carried), bf16's are the new studies'; an entry
    whose winner is no longer a candidate, or whose route's spec hash moved, is dropped with its reason."""
    specs, plan = sm90
    st, old_studies = _tuned(sm90, storage_url, ("fp8_token",))
    old, _ = freeze(st, "sm90", specs=specs, plan=plan)
    st2, new_studies = _tuned(sm90, f"sqlite:///{tmp_path / 'two.db'}", ("bf16",))
    attn_old = sorted(k for k, e in old["entries"].items() if e["kind"] != "quant")
    key = attn_old[0]
    old["entries"][key]["winner"]["variant"] = "attn_fwd_sm90_gone"
    gone_route = old["entries"][attn_old[-1]]["route"].removesuffix("_det")
    moved = dict(old, _metadata=dict(old["_metadata"], spec_hashes={
        "routes": dict(old["_metadata"]["spec_hashes"]["routes"]), "families": {}}))
    table, rep = freeze(st2, "sm90", specs=specs, plan=plan, carry=old)
    new_keys = {s.key for s in new_studies}
    assert new_keys <= set(table["entries"])
    for k, e in old["entries"].items():
        if k in new_keys:
            assert "carried" not in table["entries"][k]
        elif k == key:
            assert k not in table["entries"]
            assert any(s.startswith(f"carried {k}: ") and "no longer a candidate" in s for s in rep.skipped)
        else:
            assert table["entries"][k] == dict(e, carried=old["_metadata"]["frozen_at"])
    assert rep.carried == len(set(old["entries"]) - new_keys) - 1
    assert table["_metadata"]["carried_entries"] == rep.carried
    # a route whose spec hash differs from what the old table recorded: none of its entries is kept
    moved["_metadata"]["spec_hashes"]["routes"][gone_route] = "0" * 16
    table2, rep2 = freeze(st2, "sm90", specs=specs, plan=plan, carry=moved)
    assert not any(e.get("carried") and e["kind"] != "quant" and e["route"].removesuffix("_det") == gone_route
                   for e in table2["entries"].values())
    assert any("changed since it was measured" in s for s in rep2.skipped)


def test_freeze_with_carry_only_and_its_refusals(storage_url, tmp_path, sm90):
    specs, plan = sm90
    st, _ = _tuned(sm90, storage_url, ("fp8_token",))
    old, _ = freeze(st, "sm90", specs=specs, plan=plan)
    empty = open_storage(f"sqlite:///{tmp_path / 'empty.db'}")
    table, rep = freeze(empty, "sm90", specs=specs, plan=plan, carry=old)
    assert table["entries"] == {k: dict(e, carried=old["_metadata"]["frozen_at"]) for k, e in old["entries"].items()}
    assert table["_metadata"]["gpu"] == "Fake GPU" and rep.carried == len(old["entries"])
    with pytest.raises(FreezeError, match="tuned on 'Fake GPU'"):
        freeze(empty, "sm90", "Other GPU", specs=specs, plan=plan, carry=old)
    untuned = dict(old, _metadata=dict(old["_metadata"], untuned=True, gpu=None))
    with pytest.raises(FreezeError, match="a tuned sm90 table is needed"):
        freeze(empty, "sm90", specs=specs, plan=plan, carry=untuned)


def test_freeze_records_the_timed_build_and_stale_builds_finds_template_changes(storage_url, sm90, monkeypatch):
    """A measurement carries the sha256 of the source it timed (a bundle entry's `source_sha256`); freeze keeps it
    on winner and runner-up; `stale_builds` lists the entries whose winner the installed templates now render
    differently (a template change since tuning), and none while they render the same."""
    import hashlib

    from flamia_gen.dispatch import table as table_mod
    from flamia_gen.dispatch.table import installed_source_sha256, stale_builds, validate_structure

    specs, plan = sm90
    studies = _real_studies(sm90, routes=("fp8_tensor",), workloads="1x65536")
    names = sorted({v for s in studies for v in s.candidates})
    now = installed_source_sha256("sm90", names, plan=plan)
    assert set(now) == set(names)
    st = open_storage(storage_url)
    create_studies(studies, st)
    run_worker(studies, st, FakeRunner(sources=now))
    table, _ = freeze(st, "sm90", specs=specs, plan=plan)
    assert validate_structure(table) is None and table["entries"]
    for e in table["entries"].values():
        assert e["winner"]["source_sha256"] == now[e["winner"]["variant"]]
        if e["runner_up"]:
            assert e["runner_up"]["source_sha256"] == now[e["runner_up"]["variant"]]
    assert stale_builds(table, plan=plan) == []
    # one winner's template output changes: exactly its entries are reported
    key, e = sorted(table["entries"].items())[0]
    changed = e["winner"]["variant"]
    real = table_mod.installed_source_sha256

    def edited(arch, names, plan=None):
        out = real(arch, names, plan=plan)
        if changed in out:
            out[changed] = hashlib.sha256(b"another build").hexdigest()
        return out

    monkeypatch.setattr(table_mod, "installed_source_sha256", edited)
    stale = stale_builds(table, plan=plan)
    assert (key, changed) in stale and all(v == changed for _, v in stale)
    # entries frozen without a recorded build are not judged
    for e in table["entries"].values():
        e["winner"].pop("source_sha256")
    assert stale_builds(table, plan=plan) == []
