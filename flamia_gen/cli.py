"""`flamia-gen`: the click front end. Bad input exits 2 with one clear line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.table import Table

from . import __version__
from .console import make_console
from .spec import Arch, SpecError, SpecSet, load_specs

console = make_console()
ARCHS = [a.value for a in Arch]


class Fail(click.ClickException):
    """One line on stderr, exit 2 (bad input), like click's usage errors."""

    exit_code = 2


def _specs(path: str | None):
    try:
        return load_specs(path)
    except SpecError as e:
        raise Fail(str(e)) from None


def _known_routes(routes, specs_dir=None) -> SpecSet:
    """The specs (of `specs_dir`, else the shipped ones), after checking that every route named exists (else exit 2)."""
    s = _specs(specs_dir)
    for r in routes:
        if r not in s.routes:
            raise Fail(f"unknown route {r!r}; allowed values: {sorted(s.routes)}")
    return s


def _plan(specs, arch=None, routes=None):
    from .plan import make_plan

    try:
        return make_plan(specs, arch=arch, routes=list(routes) if routes else None)
    except SpecError as e:
        raise Fail(str(e)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flamia-gen")
def main():
    """flamia-gen: low-precision attention kernels generated from specs, verified,
    autotuned per GPU and frozen into dispatch tables."""


# ---------------------------------------------------------------- specs
@main.group()
def specs():
    """List, validate and show route and kernel-family specs."""


_specs_opt = click.option("--specs", "specs_dir", type=click.Path(file_okay=False), default=None,
                          help="specs folder (default: the repository's specs/, or $FLAMIA_GEN_SPECS)")


@specs.command("list")
@_specs_opt
def specs_list(specs_dir):
    """Routes and kernel families, one line each."""
    s = _specs(specs_dir)
    t = Table(title="routes")
    for c in ("route", "q", "k", "v", "dO", "P", "dS", "safeguards", "exact"):
        t.add_column(c)
    for r in s.routes.values():
        ops = {o.value: oq.short_str() for o, oq in r.operands.items()}
        guards = ",".join(g for g, on in (("diag:" + r.diagonal.value, r.diagonal.value != "none"),
                                          ("k_fold", r.k_fold), ("causal_dq", r.causal_dq_scale),
                                          ("qk:bf16", r.scores_bf16), ("p_ref:" + r.p_reference.value,
                                                                        r.p_reference.value != "ceil")) if on) or "-"
        t.add_row(r.name, ops["q"], ops["k"], ops["v"], ops["do"], ops["p"], ops["ds"], guards,
                  "yes" if r.exact else "no")
    console.print(t)
    t = Table(title="kernel families")
    for c in ("family", "arch", "kind", "template", "routes", "status"):
        t.add_column(c)
    for f in s.families.values():
        t.add_row(f.name, f.arch.value, f.kind.value, f.template, str(len(f.routes)),
                  "runs on H200" if f.arch.executable_here else "compiled, not executed")
    console.print(t)


@specs.command("validate")
@_specs_opt
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
def specs_validate(specs_dir, files):
    """Validate every spec (or the FILES given). Exit 2 naming file, field and value."""
    from .spec.loader import load_family, load_route

    s = _specs(specs_dir)
    for f in files:
        p = Path(f)
        try:
            if p.parent.name == "kernels":
                load_family(p, s.routes)
            else:
                load_route(p)
        except SpecError as e:
            raise Fail(str(e)) from None
    n = len(files) if files else len(s.routes) + len(s.families)
    console.print(f"[green]ok[/green]: {n} spec(s) valid")


@specs.command("show")
@_specs_opt
@click.argument("name")
def specs_show(specs_dir, name):
    """Print one route or family, as parsed (defaults filled in), in JSON."""
    s = _specs(specs_dir)
    obj = s.routes.get(name) or s.families.get(name)
    if obj is None:
        raise Fail(f"no route or family named {name!r}; known: {sorted(s.routes) + sorted(s.families)}")
    d = obj.model_dump(mode="json")
    if name in s.routes:
        d["spec_hash"] = obj.spec_hash()
    click.echo(json.dumps(d, indent=2))


# ---------------------------------------------------------------- plan / render
@main.command()
@_specs_opt
@click.option("--arch", type=click.Choice(ARCHS), default=None)
@click.option("--route", "routes", multiple=True, help="only variants used by this route (repeatable)")
@click.option("--pruned/--no-pruned", default=False, help="also list pruned points with the reason")
def plan(specs_dir, arch, routes, pruned):
    """Expand the families into variants (analytic pruning, procedural names)."""
    p = _plan(_specs(specs_dir), arch, routes)
    t = Table(title=f"{len(p.variants)} variants, {len(p.pruned)} pruned")
    for c in ("variant", "arch", "used by"):
        t.add_column(c)
    for v in p.variants:
        t.add_row(v.name, v.arch.value, ", ".join(v.uses))
    if pruned:
        for x in p.pruned:
            t.add_row(f"[dim]{x.name}[/dim]", "", f"[yellow]pruned:[/yellow] {x.reason}")
    console.print(t)


@main.command()
@_specs_opt
@click.option("--check", is_flag=True, help="only check that generated/ matches the templates (exit 1 if stale)")
def render(specs_dir, check):
    """Render every variant into generated/<arch>/<name>.py (reproducible bytes)."""
    from .render import check_generated, render_all

    p = _plan(_specs(specs_dir))
    if check:
        problems = check_generated(p.variants)
        for pr in problems:
            click.echo(pr, err=True)
        if problems:
            raise click.ClickException(f"generated/ is stale ({len(problems)} problem(s)); run `flamia-gen render`")
        console.print(f"[green]ok[/green]: generated/ matches the templates ({len(p.variants)} files)")
        return
    res = render_all(p.variants, prune_stale=True)
    console.print(f"rendered {len(p.variants)} variants: {len(res.written)} written, "
                  f"{len(res.unchanged)} unchanged, {len(res.stale_removed)} stale removed")


# ---------------------------------------------------------------- build / bundle
def _status_table(results, title):
    t = Table(title=title)
    for c in ("variant", "arch", "status", "seconds", "message"):
        t.add_column(c, overflow="fold")
    style = {"built": "green", "cached": "cyan", "failed": "red"}
    for r in results:
        note = r.message or ("compiled, not executed" if r.arch == "sm100" else "")
        t.add_row(r.name, r.arch, f"[{style[r.status]}]{r.status}[/]", f"{r.seconds:.1f}", note)
    return t


def _build(specs_dir, arch, routes, jobs, force, names=None, plan=None):
    """Build the plan's variants (`names`: only those; `plan`: one the caller made already)."""
    from .build.builder import build_all

    p = plan if plan is not None else _plan(_specs(specs_dir), arch, routes)
    unknown = sorted(set(names or ()) - {v.name for v in p.variants})
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: no such variant for arch={arch}"
                                 + (f" routes={list(routes)}" if routes else "") + " (flamia-gen plan lists them)",
                                 param_hint="'--variant'")
    variants = [v for v in p.variants if not names or v.name in names]
    if not variants:
        raise Fail(f"no variant to build for arch={arch} routes={list(routes) or 'all'}")
    from rich.progress import Progress

    with Progress(console=console, transient=True) as prog:
        task = prog.add_task(f"building {len(variants)} variants for {arch}", total=len(variants))
        results = build_all(variants, jobs=jobs, force=force, progress=lambda r: prog.advance(task))
    return variants, results


@main.command()
@_specs_opt
@click.option("--arch", type=click.Choice(ARCHS), required=True, help="target: sm90 (Hopper) or sm100 (Blackwell)")
@click.option("--route", "routes", multiple=True, help="only variants used by this route (repeatable)")
@click.option("--variant", "names", multiple=True, help="only this variant (repeatable)")
@click.option("--jobs", "-j", type=click.IntRange(1, 64), default=1, show_default=True)
@click.option("--force", is_flag=True, help="ignore the cache")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
@click.option("--sass-check", is_flag=True,
              help="read every attention kernel's SASS (nvdisasm, cuobjdump: PATH, $FLAMIA_GEN_CUDA_BIN or the "
                   "nvidia-cuda-nvdisasm / -cuobjdump wheels) and fail if ptxas serialised a tile loop's wgmmas")
def build(specs_dir, arch, routes, names, jobs, force, json_out, sass_check):
    """Cross-compile variants ahead of time (CUTE_DSL_ARCH, fake tensors) into cached .so files."""
    _, results = _build(specs_dir, arch, routes, jobs, force, names)
    console.print(_status_table(results, f"build --arch {arch}"))
    failed = [r for r in results if r.status == "failed"]
    if arch == "sm100":
        console.print("[yellow]sm100: compiled, not executed (no Blackwell GPU here)[/yellow]")
    sass = _sass_check(results) if sass_check else {}
    if json_out:
        Path(json_out).write_text(json.dumps([dict({k: str(v) if isinstance(v, Path) else v
                                                    for k, v in r.__dict__.items() if k != "source"},
                                                   **({"sass": sass[r.name]} if r.name in sass else {}))
                                              for r in results], indent=1))
    if failed:
        raise click.ClickException(f"{len(failed)} of {len(results)} variants failed to compile")
    bad = sorted(n for n, d in sass.items() if d["serialised"])
    if bad:
        raise click.ClickException(f"{len(bad)} kernels have serialised wgmmas (ptxas C7512): {', '.join(bad)}")


def _sass_check(results) -> dict:
    """{variant: SASS summary} of the attention kernels built: registers, stack, and per tile loop the instructions,
    wgmmas, how many were waited for one by one, spills. A tile loop whose wgmmas are waited for one by one is what
    ptxas does when an in-flight wgmma's registers are touched or the consumers run out of them: a silent slowdown no
    test on the CPU would otherwise see."""
    from .bench.sass import describe, missing_tools, serialised

    why = missing_tools()
    if why:
        raise click.ClickException(why)
    out = {}
    for r in results:
        if r.so is None or not r.name.startswith("attn_"):
            continue
        d = describe(str(r.so))
        out[r.name] = dict(reg=d["reg"], stack=d["stack"], loops=d["loops"],
                           serialised=any(serialised(lp) for lp in d["loops"]))
    worst = sorted(out.items(), key=lambda kv: -max((lp["stl"] + lp["ldl"] for lp in kv[1]["loops"]), default=0))
    console.print(f"SASS: {len(out)} attention kernels, {sum(d['serialised'] for d in out.values())} with serialised "
                  f"wgmmas; most spill traffic in a tile loop: "
                  + ", ".join(f"{n} ({max(lp['stl'] + lp['ldl'] for lp in d['loops'])})" for n, d in worst[:3]
                              if d["loops"]))
    return out


@main.command()
@_specs_opt
@click.option("--arch", type=click.Choice(ARCHS), required=True)
@click.option("--route", "routes", multiple=True)
@click.option("--variant", "names", multiple=True)
@click.option("--retime", "retime_path", type=click.Path(dir_okay=False), default=None, metavar="TABLE",
              help="what `flamia-gen tune --retime TABLE` times: the winners of TABLE's entries timed on another "
                   "build or none recorded, and the forwards and quantizers the backward ones' op paths need")
@click.option("--table", "table_path_", type=click.Path(dir_okay=False, exists=True), default=None, metavar="TABLE",
              help="only what TABLE dispatches to (its winners, the defaults of groups it has no entry of, the "
                   "forwards and quantizers the backwards' op paths need): a deployment bundle; --route and "
                   "--head-dim narrow it")
@click.option("--head-dim", "head_dims", multiple=True, type=int, help="with --table: only these head dims")
@click.option("--jobs", "-j", type=click.IntRange(1, 64), default=1, show_default=True)
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), required=True)
def bundle(specs_dir, arch, routes, names, retime_path, table_path_, head_dims, jobs, out_dir):
    """Build and pack kernels + DSL runtime + manifest for a host without the DSL compiler."""
    from .build.bundle import write_bundle
    from .build.cache import BuildCache

    plan = None
    if head_dims and not table_path_:
        raise click.BadParameter("--head-dim narrows --table: give a table", param_hint="'--head-dim'")
    if table_path_:
        if retime_path or names:
            raise click.BadParameter("--table picks the variants itself: leave out --retime and --variant",
                                     param_hint="'--table'")
        plan, names = _table_bundle_names(specs_dir, arch, table_path_, routes, head_dims)
        routes = ()
    elif retime_path:
        if routes or names:
            raise click.BadParameter("--retime picks the variants itself: leave out --route and --variant",
                                     param_hint="'--retime'")
        from .tune.cli import _retime_table
        from .tune.retime import retime_variants

        specs = _specs(specs_dir)
        plan = _plan(specs, arch)
        vs, notes = retime_variants(specs, arch, _retime_table(retime_path, arch), plan)
        for n in notes:
            console.print(f"[yellow]not re-timed[/yellow] {n}")
        if not vs:
            raise Fail(f"nothing to re-time in {retime_path}: every entry was timed on the build the installed "
                       "templates render")
        names = tuple(v.name for v in vs)
    variants, results = _build(specs_dir, arch, routes, jobs, False, names, plan=plan)
    console.print(_status_table(results, f"bundle --arch {arch}"))
    m = write_bundle(Path(out_dir), arch, variants, results, BuildCache())
    console.print(f"bundle {out_dir}: {len(m['variants'])} variants, arch {arch}, DSL {m['dsl_version']}"
                  + ("" if arch == "sm90" else " (compiled, not executed)"))
    if any(r.status == "failed" for r in results):
        raise click.ClickException("some variants failed to compile and are not in the bundle")


def _table_bundle_names(specs_dir, arch, path, routes, head_dims):
    """(plan, variant names) of `bundle --table`: the table must be one the runtime would use with the installed
    specs (any GPU's), else its winners would never be asked for."""
    from .dispatch.serving import table_served_variants
    from .dispatch.table import installed_expectation, load_table

    specs = _known_routes(routes, specs_dir)
    plan = _plan(specs, arch)
    table, why = load_table(path, installed_expectation(arch, None, specs=specs, plan=plan))
    if table is None:
        raise click.BadParameter(f"the runtime would not use this table, so a bundle of its choices serves nothing: "
                                 f"{why}", param_hint="'--table'")
    dims = {int(v.param("head_dim")) for v in plan.variants}
    bad = sorted(set(head_dims) - dims)
    if bad:
        raise click.BadParameter(f"head dim {bad[0]} has no variant on {arch} (have {sorted(dims)})",
                                 param_hint="'--head-dim'")
    vs, notes = table_served_variants(specs, arch, table, plan, routes, head_dims)
    for n in notes:
        console.print(f"[yellow]not bundled[/yellow] {n}")
    from .dispatch.table import stale_builds

    chosen = {v.name for v in vs}
    stale = [k for k, w in stale_builds(table, arch, plan=plan) if w in chosen]
    if stale:  # still the table's choices (the runtime uses them), but their times describe another build
        console.print(f"[yellow]{len(stale)} of the bundled choices' entries were timed on another build[/yellow] "
                      f"(e.g. {stale[0]}): the choice may differ after `flamia-gen bundle --retime` + `tune --retime`")
    if not vs:
        raise Fail(f"{path}: nothing to bundle for routes={list(routes) or 'all'} head dims={list(head_dims) or 'all'}")
    console.print(f"{path}: {len(vs)} variants serve its {len(table['entries'])} entries"
                  + (f" (routes {', '.join(routes)})" if routes else ""))
    return plan, tuple(v.name for v in vs)


@main.command("bundle-merge")
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), required=True)
def bundle_merge(sources, out_dir):
    """Merge bundles built by the same toolchain into one (e.g. an A/B build and the table's kernels for one GPU call);
    every kernel is checked against its manifest first, a variant in two sources must be the same file."""
    from .build.bundle import merge_bundles
    from .runtime.bundle import BundleError

    try:
        m = merge_bundles(Path(out_dir), [Path(s) for s in sources])
    except BundleError as e:
        raise click.ClickException(str(e)) from None
    console.print(f"bundle {out_dir}: {len(m['variants'])} variants from {len(sources)} bundles, arch {m['arch']}, "
                  f"DSL {m['dsl_version']}")


@main.command("bundle-pack")
@click.argument("source", type=click.Path(file_okay=False, exists=True))
@click.option("-o", "--out", "out_file", type=click.Path(dir_okay=False), required=True,
              help="NAME.tar.xz: the loader, FLAMIA_GEN_BUNDLE and every --bundle option take it as they take a folder")
def bundle_pack(source, out_file):
    """Pack a bundle folder into one reproducible .tar.xz (≈ half the bytes: the kernels shrink ≈ 10× under xz); every
    file is checked against the manifest first, and again where it is unpacked."""
    from .runtime.bundle import BundleError
    from .runtime.bundle_archive import pack_bundle

    try:
        m = pack_bundle(Path(source), Path(out_file))
    except BundleError as e:
        raise click.ClickException(str(e)) from None
    console.print(f"packed {source} → {out_file}: {len(m['variants'])} variants, "
                  f"{Path(out_file).stat().st_size / 2**20:.1f} MiB")


# ---------------------------------------------------------------- verify
@main.command()
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--route", "routes", multiple=True, help="route(s) to verify (default: all)")
@click.option("--bundle", "bundle_dir", type=click.Path(), default=None,
              help="cuda: kernels from this bundle, a folder or a bundle-pack .tar.xz (else $FLAMIA_GEN_BUNDLE)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
@click.option("--docs", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--doc-len", type=click.IntRange(1, 65536), default=512, show_default=True)
@click.option("--heads", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--outliers", is_flag=True, help="inputs with outlier tokens")
@click.option("--dump", "dump_dir", type=click.Path(file_okay=False), default=None,
              help="cuda: save the inputs and kernel outputs of every failing attention case here "
                   "(torch.save, one file per variant and input) to analyse on any machine")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(["quant", "attn_fwd", "attn_bwd"]),
              help="cuda: only these kernel kinds (repeatable; default: all)")
@click.option("--variant", "patterns", multiple=True, metavar="GLOB",
              help="cuda: only variants whose name matches this glob (repeatable), e.g. 'attn_bwd_*_det*'")
def verify(device, routes, bundle_dir, json_out, docs, doc_len, heads, outliers, dump_dir, kinds, patterns):
    """cpu: emulated routes vs fp32 + leakage probe. cuda: kernels vs the emulator."""
    _known_routes(routes)
    if device == "cpu" and (kinds or patterns):
        raise click.BadParameter("--kind and --variant select bundle kernels: they need --device cuda",
                                 param_hint="'--kind' / '--variant'")
    if device == "cpu":
        from .verify.cpu import render_table, to_json, verify_cpu

        rows = verify_cpu(list(routes) or None, docs=docs, doc_len=doc_len, heads=heads, outliers=outliers)
        console.print(render_table(rows))
        if json_out:
            to_json(rows, json_out)
        return
    from .verify.gpu import verify_cuda

    code = verify_cuda(list(routes) or None, bundle_dir=bundle_dir, json_out=json_out, console=console,
                       dump_dir=dump_dir, kinds=list(kinds) or None, patterns=list(patterns) or None)
    sys.exit(code)


# ---------------------------------------------------------------- probe
@main.command()
@click.option("--route", "routes", multiple=True, help="route(s) to probe (default: all)")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu: the emulator (O and dQ); cuda: the forward kernel of a bundle (O)")
@click.option("--bundle", "bundle_dir", type=click.Path(), default=None)
@click.option("--factor", type=float, default=1e4, show_default=True, help="multiplier of the perturbed token")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def probe(routes, device, bundle_dir, factor, json_out):
    """Leakage probe (DESIGN §5): perturb a later token's q, k, v (and dO) and report the
    max relative change of every earlier O (and dQ) row. Exact routes must show 0."""
    import torch

    specs_set = _known_routes(routes)
    names = list(routes) or sorted(specs_set.routes)
    rows = []
    if device == "cpu":
        from .numerics import leakage_probe
        from .numerics.reference import attention

        g = torch.Generator().manual_seed(0)
        lens = [256, 200, 64]
        q, k, v = (torch.randn(sum(lens), 2, 128, generator=g).to(torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, 256, 456, 520], dtype=torch.int32)
        for r in names:
            res = leakage_probe(lambda q, k, v, cu, r=r: attention(q, k, v, cu, causal=True, route=r),
                                q, k, v, cu, factor=factor)
            rows.append(dict(route=r, o_leak=max(res.o_leak.values()), dq_leak=max(res.dq_leak.values()),
                             exact=res.exact, claims_exact=specs_set.routes[r].exact))
    else:
        if not torch.cuda.is_available():
            raise Fail("no CUDA device: probe --device cuda needs a GPU")
        from .runtime.bundle import load_bundle
        from .verify.attn_gpu import make_docs, make_qkv, probe_kernel

        b = load_bundle(bundle_dir)
        for r in names:
            ents = [e for e in b.manifest["variants"] if e["kind"] == "attn_fwd" and e["uses"][0] == r
                    and e["params"]["causal"]]
            if not ents:
                rows.append(dict(route=r, note="no causal forward kernel in the bundle"))
                continue
            g = torch.Generator().manual_seed(0)
            q, k, v, cu = make_qkv(make_docs("gauss", g), 4, 2, ents[0]["params"]["head_dim"], "gauss", g, "cuda")
            res = probe_kernel(b.get(ents[0]["name"]), ents[0], specs_set.routes[r], q, k, v, cu, factor=factor)
            rows.append(dict(route=r, variant=ents[0]["name"], o_leak=res["probe_max_rel_change"],
                             exact=res["probe_exact"], claims_exact=specs_set.routes[r].exact))
    t = Table(title=f"leakage probe ({device}, factor {factor:g})")
    for c in ("route", "O leak", "dQ leak", "exact", "route claims exact", "note"):
        t.add_column(c)
    bad = False
    for row in rows:
        broken = row.get("claims_exact") and not row.get("exact")
        bad |= bool(broken)
        t.add_row(row["route"], f"{row['o_leak']:.2e}" if "o_leak" in row else "-",
                  f"{row['dq_leak']:.2e}" if "dq_leak" in row else "-",
                  "[green]yes[/]" if row.get("exact") else "no", "yes" if row.get("claims_exact") else "no",
                  "[red]CLAIMS EXACT BUT LEAKS[/]" if broken else row.get("note", ""))
    console.print(t)
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))
    if bad:
        sys.exit(1)


def _attach_optional():
    # Commands that live with their stage; absent stages simply do not appear.
    try:
        from .bench.cli import bench_command

        main.add_command(bench_command, "bench")
    except ImportError:
        pass
    try:
        from .tune.cli import freeze_command, table_command, tune_command

        main.add_command(tune_command, "tune")
        main.add_command(freeze_command, "freeze")
        main.add_command(table_command, "table")
    except ImportError:
        pass


_attach_optional()

if __name__ == "__main__":
    main()
