"""Click commands of the tuning stage: `tune`, `freeze`, `table show|check|untuned`.

Attached to the main group by `flamia_gen.cli` (`main.add_command(tune_command, "tune")`…).
Bad input exits 2 with one clear line.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import click
from rich.table import Table

from ..console import make_console
from ..spec import Arch, KernelKind, SpecError

console = make_console()
ARCHS = [a.value for a in Arch]
KINDS = [k.value for k in KernelKind]


class Fail(click.ClickException):
    """One line on stderr, exit 2 (bad input)."""

    exit_code = 2


def _specs(path):
    from ..spec import load_specs

    try:
        return load_specs(path)
    except SpecError as e:
        raise Fail(str(e)) from None


def _plan(specs, arch):
    from ..plan import make_plan

    return make_plan(specs, arch=arch)


_specs_opt = click.option("--specs", "specs_dir", type=click.Path(file_okay=False), default=None,
                          help="specs folder (default: the repository's specs/, or $FLAMIA_GEN_SPECS)")
_storage_opt = click.option("--storage", default=None, metavar="URL",
                            help="optuna storage, any SQLAlchemy URL (default: sqlite:///<cache>/tune.db; "
                                 "postgresql://user@host/db to share studies between hosts)")


def _device_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ids = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated GPU ids such as 0,1",
                                 param_hint="'--device-ids'") from None
    if not ids or any(i < 0 for i in ids):
        raise click.BadParameter(f"{text!r}: expected comma-separated GPU ids ≥ 0 such as 0,1",
                                 param_hint="'--device-ids'")
    return ids


def _gpu_runner(arch, bundle_dir, jobs, repeats, candidates, device_ids, workers, plan, specs=None):
    """Runner config, GPU name and the GPU ids to use, for real timing; builds a local
    bundle when none is given (the candidates and what the backward ones' op paths need)."""
    try:
        import torch
    except ImportError:
        raise Fail("torch is not installed: timing needs torch with CUDA (or --runner fake)") from None
    if not torch.cuda.is_available():
        raise Fail("no CUDA device here: tune times kernels on a GPU. Build a bundle on a CPU host with "
                   f"`flamia-gen bundle --arch {arch} -o DIR`, then run `flamia-gen tune --arch {arch} --bundle DIR` "
                   "on the GPU host (or use --runner fake for a dry run)")
    n = torch.cuda.device_count()
    ids = device_ids or list(range(min(workers, n)))
    bad = [i for i in ids if i >= n]
    if bad:
        raise click.BadParameter(f"GPU ids {bad} do not exist here ({n} visible)", param_hint="'--device-ids'")
    names = sorted({torch.cuda.get_device_name(i) for i in ids})
    if len(names) > 1:
        raise click.BadParameter(f"these GPUs differ ({names}): one tune covers one GPU model",
                                 param_hint="'--device-ids'")
    cap = torch.cuda.get_device_capability(ids[0])
    want = {"sm90": (9, 0), "sm100": (10, 0)}[arch]
    if cap != want:
        raise Fail(f"{names[0]} is sm{cap[0]}{cap[1]}, not {arch}: tune on a GPU of the arch "
                   + ("(sm100 ships untuned: flamia-gen table untuned --arch sm100)" if arch == "sm100" else ""))
    missing = {}
    if bundle_dir is None:
        from ..build.toolchain import dsl_available

        if not dsl_available():
            raise Fail(f"this host has no DSL compiler: build a bundle elsewhere (flamia-gen bundle --arch {arch} "
                       "-o DIR) and pass --bundle DIR")
        from ..build.builder import build_all
        from ..build.bundle import write_bundle
        from ..build.cache import BuildCache, cache_root

        variants = [plan.by_name(n) for n in sorted(candidates)]
        bwd = [v for v in variants if v.kind.value == "attn_bwd"]
        if bwd and specs is not None:
            from ..plan.op_support import backward_support

            # a backward is verified and timed with O and LSE from a forward, through its route's quantizers
            variants += [v for v in backward_support(specs, arch, bwd) if v.name not in candidates]
        with console.status(f"building {len(variants)} variants (cached, --jobs {jobs})"):
            results = build_all(variants, jobs=jobs)
        missing = {r.name: r.message for r in results if r.status == "failed"}
        bundle_dir = cache_root() / "tune-bundles" / arch
        write_bundle(bundle_dir, arch, variants, results, BuildCache())
        console.print(f"built {len(variants) - len(missing)} of {len(variants)} variants into {bundle_dir}")
    else:
        from ..runtime.bundle import BundleError, read_manifest

        try:
            m = read_manifest(bundle_dir)
        except BundleError as e:
            raise click.BadParameter(str(e), param_hint="'--bundle'") from None
        if m.get("arch") != arch:
            raise click.BadParameter(f"{bundle_dir} holds {m.get('arch')} kernels, not {arch}", param_hint="'--bundle'")
    cfg = {"type": "bundle", "bundle": str(bundle_dir), "repeats": repeats, "missing": missing}
    return cfg, names[0], ids


def _retime_table(path, arch) -> dict:
    """The table `--retime` names: a valid table of `arch` (structure checked; its GPU and specs may differ from
    this host's, which is what a re-time is for)."""
    from ..dispatch.table import load_table

    table, why = load_table(path)
    if table is None:
        raise click.BadParameter(why, param_hint="'--retime'")
    if table["_metadata"]["arch"] != arch:
        raise click.BadParameter(f"{path} is a table of {table['_metadata']['arch']}, not {arch}",
                                 param_hint="'--retime'")
    return table


def _studies_table(specs, title):
    t = Table(title=title)
    for c in ("entry", "candidates", "budget", "workload"):
        t.add_column(c, overflow="fold")
    for s in specs:
        t.add_row(s.key, str(len(s.candidates)), str(s.budget), f"{s.workload.label} × {s.workload.heads} heads")
    return t


def _summary_table(specs, storage):
    import optuna

    from .study import ClaimSampler, measured_trials

    t = Table(title="tuning results")
    for c in ("entry", "measured", "best", "median ms", "failed verification"):
        t.add_column(c, overflow="fold")
    for s in specs:
        study = optuna.load_study(study_name=s.name, storage=storage, sampler=ClaimSampler())
        ms = measured_trials(study)
        ok = sorted((x for x in ms if x.value is not None), key=lambda x: (x.value, x.user_attrs["variant"]))
        bad = [x.user_attrs["variant"] for x in ms if x.value is None]
        t.add_row(s.key, f"{len(ms)}/{s.budget}", ok[0].user_attrs["variant"] if ok else "-",
                  f"{ok[0].value:.4f}" if ok else "-", ", ".join(bad) or "-")
    return t


def _progress():
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("trials"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    TextColumn("[cyan]{task.fields[best]}"), console=console, transient=False)


@click.command("tune")
@_specs_opt
@click.option("--arch", type=click.Choice(ARCHS), required=True)
@click.option("--trials", type=click.IntRange(1, 100000), default=None,
              help="measured variants per study, counting those already in it (default: every candidate)")
@_storage_opt
@click.option("--workloads", default=None,
              help="packed rows, comma-separated: 4x4096, 8192+224x256, 131072x1, or a preset (paper, small); "
                   "default: paper (with --retime: the rows the table's entries were timed on)")
@click.option("--heads", type=click.IntRange(1, 256), default=16, show_default=True, help="heads of every workload")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(KINDS), help="only this kernel kind (repeatable)")
@click.option("--route", "routes", multiple=True,
              help="only groups serving this route name, or this quantizer tag such as e4m3_tb32_ceil (repeatable)")
@click.option("--head-dim", "head_dims", multiple=True, type=click.Choice(["64", "128"]), help="only this head dim")
@click.option("--bundle", "bundle_dir", type=click.Path(), default=None,
              help="time the kernels of this bundle (built elsewhere with flamia-gen bundle; a folder or a "
                   "bundle-pack .tar.xz) instead of building here")
@click.option("--jobs", "-j", type=click.IntRange(1, 64), default=1, show_default=True,
              help="parallel compiles when building here")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="worker processes sharing the studies (one per GPU for real timings)")
@click.option("--device-ids", default=None, metavar="IDS",
              help="GPU ids, e.g. 0,1: worker i is pinned to IDS[i mod len] via CUDA_VISIBLE_DEVICES")
@click.option("--runner", "runner_type", type=click.Choice(["gpu", "fake"]), default="gpu", show_default=True,
              help="fake: deterministic synthetic times, no GPU (plumbing checks and dry runs)")
@click.option("--repeats", type=click.IntRange(20, 10000), default=30, show_default=True,
              help="timed calls per measurement (median reported)")
@click.option("--retime", "retime_path", type=click.Path(dir_okay=False), default=None, metavar="TABLE",
              help="only the buckets of TABLE whose times describe another build of their winner (a template change "
                   "since tuning) or none recorded, each with its group's winners as the only candidates; then "
                   "`freeze --carry TABLE` (its bundle: `flamia-gen bundle --retime TABLE`)")
@click.option("--dry-run", is_flag=True, help="list the studies and exit")
@click.option("--fake-gpu", default="Fake GPU", hidden=True)
@click.option("--fake-fail", multiple=True, hidden=True, help="fake runner: variants (globs) that fail verification")
@click.option("--fake-delay", type=float, default=0.0, hidden=True)
@click.option("--fake-log", default=None, hidden=True)
def tune_command(specs_dir, arch, trials, storage, workloads, heads, kinds, routes, head_dims, bundle_dir, jobs,
                 workers, device_ids, runner_type, repeats, retime_path, dry_run, fake_gpu, fake_fail, fake_delay,
                 fake_log):
    """Autotune variants per workload bucket (optuna; resumable; many workers share a study)."""
    from .space import make_study_specs, parse_workloads, select_groups

    ids = _device_ids(device_ids)
    retime = _retime_table(retime_path, arch) if retime_path else None
    specs = _specs(specs_dir)
    plan = _plan(specs, arch)
    untrusted = {}
    if retime is not None:
        from .retime import retime_workloads, untrusted_entries

        untrusted = untrusted_entries(retime, plan, arch=arch)  # renders every winner once: the one call
        if workloads is None:
            workloads = retime_workloads(retime, untrusted) or None
    try:
        wl = parse_workloads(workloads, heads)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--workloads'") from None
    if runner_type == "gpu":
        from .gpu import KIND_HOOKS

        nohook = [k for k in kinds if k not in KIND_HOOKS]
        if nohook:
            raise click.BadParameter(f"no GPU timing hook for {nohook} yet; allowed values: {list(KIND_HOOKS)}",
                                     param_hint="'--kind'")
        kinds = kinds or tuple(KIND_HOOKS)
    try:
        groups = select_groups(plan, specs, kinds=kinds, routes=routes, head_dims=[int(d) for d in head_dims])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--route'") from None
    if not groups:
        raise Fail(f"nothing to tune for arch={arch} kinds={list(kinds) or 'all'} routes={list(routes) or 'all'}")
    if retime is not None:
        from .retime import retime_groups

        groups, notes = retime_groups(groups, retime, untrusted)
        for n in notes:
            console.print(f"[yellow]not re-timed[/yellow] {n}")
        if not groups:
            raise Fail(f"nothing to re-time in {retime_path} for kinds={list(kinds) or 'all'} "
                       f"routes={list(routes) or 'all'}: every selected entry was timed on the build the installed "
                       "templates render")
    candidates = sorted({n for g in groups for n in g.candidates})

    if runner_type == "fake":
        runner_cfg = {"type": "fake", "gpu": fake_gpu, "fail": list(fake_fail), "delay_s": fake_delay,
                      "log": fake_log}
        gpu = fake_gpu
    elif dry_run:
        runner_cfg, gpu = {}, "<this GPU>"
    else:
        runner_cfg, gpu, ids = _gpu_runner(arch, bundle_dir, jobs, repeats, candidates, ids, workers, plan, specs)
    studies = make_study_specs(groups, wl, gpu=gpu, trials=trials)
    if retime is not None:
        want = untrusted
        missed = sorted(k for k in want if retime["entries"][k]["group"] in {g.key for g in groups}
                        and k not in {s.key for s in studies})
        for k in missed:
            console.print(f"[yellow]not re-timed[/yellow] {k}: no workload given lands in its bucket (the table timed "
                          f"it on {retime['entries'][k].get('workload')})")
        studies = [replace(s, extra={"retime": True}) for s in studies if s.key in want]
        if not studies:
            raise Fail(f"nothing to re-time in {retime_path}: no workload given lands in an untrusted bucket")
    if dry_run:
        console.print(_studies_table(studies, f"{len(studies)} studies, {sum(s.budget for s in studies)} trials "
                                              f"({arch}, {gpu})"))
        return

    from .study import create_studies, default_storage_url, fail_orphaned_trials, is_sqlite, open_storage, snapshot

    url = storage or default_storage_url()
    try:
        st = open_storage(url)
        create_studies(studies, st)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--storage'") from None
    if is_sqlite(url):
        orphans = fail_orphaned_trials(studies, st)
        if orphans:
            console.print(f"{orphans} trial(s) left running by an earlier run marked failed (their variants are "
                          "measured again)")

    snap = snapshot(studies, st)
    console.print(f"tuning {len(studies)} studies on {gpu} ({arch}): {snap.done}/{snap.total} trials already done; "
                  f"{workers} worker(s)")
    t0 = time.monotonic()
    with _progress() as prog:
        task = prog.add_task(f"tune {arch}", total=snap.total, completed=snap.done, best=snap.best)
        if workers == 1 and (ids is None or len(ids) == 1):
            from .runner import make_runner
            from .study import run_worker, study_best

            cfg = dict(runner_cfg)
            if cfg.get("type") == "bundle":
                cfg["device"] = ids[0] if ids else 0
            runner = make_runner(cfg)

            def on_trial(spec, t):
                if "variant" in t.user_attrs and "duplicate_of" not in t.user_attrs:
                    prog.advance(task)
                prog.update(task, best=study_best(spec, st))

            run_worker(studies, st, runner, device=f"cuda:{cfg.get('device', '')}" if cfg.get("type") == "bundle"
                       else "", on_trial=on_trial)
        else:
            from .worker import launch, tail, write_config

            with tempfile.TemporaryDirectory(prefix="flamia-tune-") as tmp:
                cfg_path = write_config(Path(tmp) / "config.json", url, studies, runner_cfg)
                procs = launch(cfg_path, workers, ids, Path(tmp))
                try:
                    while any(p.poll() is None for p, _, _ in procs):
                        time.sleep(0.5)
                        s = snapshot(studies, st)
                        prog.update(task, completed=s.done, best=s.best)
                except KeyboardInterrupt:
                    for p, _, _ in procs:
                        p.terminate()
                    raise
                s = snapshot(studies, st)
                prog.update(task, completed=s.done, best=s.best)
                failed = [(i, p.returncode, log) for i, (p, log, _) in enumerate(procs) if p.returncode != 0]
                for i, rc, log in failed:
                    console.print(f"[red]worker {i} exited with {rc}[/red]\n{tail(log)}")
                if failed:
                    raise click.ClickException(f"{len(failed)} of {workers} workers failed; re-run to resume")
    console.print(_summary_table(studies, st))
    console.print(f"done in {time.monotonic() - t0:.1f}s; freeze with: flamia-gen freeze --arch {arch}"
                  + (f" --storage {storage}" if storage else ""))


@click.command("freeze")
@_specs_opt
@click.option("--arch", type=click.Choice(ARCHS), required=True)
@_storage_opt
@click.option("--gpu", default=None, help="GPU name of the studies to freeze (needed when the storage has several)")
@click.option("-o", "--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="table file (default: tuning_db/<arch>-<gpu>.json)")
@click.option("--carry", "carry_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="a previous table of this arch and GPU: its entries fill the buckets the storage has no "
                   "study for, each only while its group's candidates and route are unchanged (e.g. after a "
                   "route was added to a family, tune only the new route)")
def freeze_command(specs_dir, arch, storage, gpu, out_path, carry_path):
    """Freeze the tuned studies of one GPU into a dispatch table (written atomically)."""
    from ..dispatch.table import table_filename, tuning_db_dir, write_table
    from .freeze import FreezeError, freeze
    from .study import open_storage

    specs = _specs(specs_dir)
    carry = None
    if carry_path:
        from ..dispatch.table import load_table

        carry, why = load_table(carry_path)  # structure only: its staleness is judged entry by entry
        if carry is None:
            raise click.BadParameter(why, param_hint="'--carry'")
    try:
        st = open_storage(storage)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--storage'") from None
    try:
        table, rep = freeze(st, arch, gpu, specs=specs, carry=carry)
    except FreezeError as e:
        raise Fail(str(e)) from None
    path = Path(out_path) if out_path else tuning_db_dir() / table_filename(arch, table["_metadata"]["gpu"])
    write_table(path, table)
    for s in rep.skipped:
        console.print(f"[yellow]skipped[/yellow] {s}")
    carried = f" ({rep.carried} carried)" if carry is not None else ""
    console.print(f"wrote {path}: {rep.entries} entries{carried}, {table['_metadata']['trials_total']} trials, "
                  f"GPU {table['_metadata']['gpu']}")


# ---------------------------------------------------------------- table
@click.group("table")
def table_command():
    """Show, check and generate dispatch tables (tuning_db/)."""


def _resolve(path, arch, gpu):
    from ..dispatch.table import table_path

    if path:
        return Path(path)
    if not arch:
        raise click.UsageError("give a table file or --arch (and --gpu)")
    return table_path(arch, gpu)


def _check(path: Path, gpu, specs_dir):
    """(raw table or None, problem or None) against the installed specs (and GPU if given)."""
    from ..dispatch.table import check_against, installed_expectation, load_table

    table, why = load_table(path)  # structure only
    if table is None:
        return None, why
    arch = table["_metadata"]["arch"]
    specs = _specs(specs_dir)
    stale = check_against(table, installed_expectation(arch, gpu, specs=specs))
    return table, (f"{path}: stale: {stale}; ignored at runtime" if stale else None)


@table_command.command("show")
@_specs_opt
@click.argument("path", required=False, type=click.Path(dir_okay=False))
@click.option("--arch", type=click.Choice(ARCHS), default=None)
@click.option("--gpu", default=None, help="also check the table against this GPU name")
@click.option("--json", "as_json", is_flag=True, help="print the table as JSON")
def table_show(specs_dir, path, arch, gpu, as_json):
    """Print a dispatch table: header, staleness, per-bucket winners, defaults. Exit 1 when
    the table is corrupt or stale."""
    from ..dispatch.buckets import bucket_label

    p = _resolve(path, arch, gpu)
    table, problem = _check(p, gpu, specs_dir)
    if table is None:
        console.print(f"[red]refused[/red]: {problem}")
        raise SystemExit(1)
    if as_json:
        click.echo(json.dumps(table, indent=1, sort_keys=True))
        raise SystemExit(1 if problem else 0)
    m = table["_metadata"]
    console.print(f"[bold]{p}[/bold]  arch {m['arch']}  GPU {m['gpu'] or '-'}  format {m['format']}")
    console.print(f"flamia-gen {m['flamia_gen']}  DSL {m['dsl']}  torch {m['torch']}  CUDA driver {m['cuda_driver']}"
                  + (f"  frozen {m['frozen_at']}" if m.get("frozen_at") else ""))
    if m["untuned"]:
        console.print("[yellow bold]UNTUNED[/yellow bold]: every lookup answers the analytic default of its group "
                      "(first feasible variant in spec order)"
                      + ("; compiled, not executed (no GPU of this arch available)" if m["arch"] == "sm100" else ""))
    else:
        console.print(f"status: {m['status']}")
    console.print("[red bold]STALE[/red bold]: " + problem if problem else "[green]current[/green]: matches the "
                  "installed specs" + (f" and GPU {gpu}" if gpu else ""))
    _report_stale_builds(table)
    if table["entries"]:
        t = Table(title=f"{len(table['entries'])} tuned buckets")
        for c in ("group", "bucket", "winner", "ms", "runner-up", "ms ", "trials", "failed", "workload"):
            t.add_column(c, overflow="fold")
        for key, e in sorted(table["entries"].items()):
            ru = e.get("runner_up") or {}
            t.add_row(e["group"], bucket_label(e["bucket"]), e["winner"]["variant"],
                      f"{e['winner']['median_ms']:.4f}", ru.get("variant", "-"),
                      f"{ru['median_ms']:.4f}" if ru else "-", str(e["trials"]), str(len(e.get("pruned") or {})),
                      str(e.get("workload", "")))
        console.print(t)
    t = Table(title="defaults (buckets without an entry, and stale or missing tables)")
    t.add_column("group")
    t.add_column("default variant")
    for g, v in sorted(table["defaults"].items()):
        t.add_row(g, v)
    console.print(t)
    if problem:
        raise SystemExit(1)


@table_command.command("check")
@_specs_opt
@click.argument("paths", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--gpu", default=None, help="also check against this GPU name")
def table_check(specs_dir, paths, gpu):
    """Exit 1 unless every table is valid and matches the installed specs (and GPU)."""
    bad = 0
    for path in paths:
        table, problem = _check(Path(path), gpu, specs_dir)
        if problem:
            bad += 1
            console.print(f"[red]refused[/red]: {problem}")
        else:
            console.print(f"[green]ok[/green]: {path}")
            _report_stale_builds(table)
    if bad:
        raise SystemExit(1)


def _report_stale_builds(table: dict) -> None:
    """Warn about entries timed on another build of their winner (dispatch.table.stale_builds): still used (same
    specs, same variant), but their numbers describe a kernel the templates no longer render."""
    from ..dispatch.table import stale_builds

    stale = stale_builds(table)
    if not stale:
        return
    groups = sorted({table["entries"][k]["group"] for k, _ in stale})
    console.print(f"[yellow]timed on another build[/yellow]: {len(stale)} entries' winners render differently now "
                  f"(templates changed since tuning); re-tune their groups: {', '.join(groups)}")


@table_command.command("untuned")
@_specs_opt
@click.option("--arch", type=click.Choice(ARCHS), required=True)
@click.option("-o", "--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="default: tuning_db/<arch>-untuned.json")
def table_untuned(specs_dir, arch, out_path):
    """Write the untuned table of an arch: the plan's analytic defaults, no measurement."""
    from ..dispatch.table import table_filename, tuning_db_dir, untuned_table, write_table

    specs = _specs(specs_dir)
    table = untuned_table(arch, specs=specs)
    path = Path(out_path) if out_path else tuning_db_dir() / table_filename(arch, None)
    write_table(path, table)
    console.print(f"wrote {path}: untuned, {len(table['defaults'])} groups"
                  + (" (compiled, not executed)" if arch == "sm100" else ""))


__all__ = ["tune_command", "freeze_command", "table_command"]
