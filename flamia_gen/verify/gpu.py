"""`flamia-gen verify --device cuda`: run built kernels on the local GPU and compare them
with the numerics emulator. Quantizers must be bitwise equal on every input kind.

Kernels come from a bundle (`--bundle` / `$FLAMIA_GEN_BUNDLE`), so this runs on a host
without the DSL compiler.
"""

from __future__ import annotations

import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.table import Table

from ..spec import get_route, operand_quant


def _operand_quant_of(entry: dict):
    """Every route.operand a variant serves has the same representation (the plan keyed
    it so); take the first and check the rest agree."""
    def rep(use: str):
        r, o = use.split(".")
        return operand_quant(get_route(r), o)

    uses = entry["uses"]
    first = rep(uses[0])
    for u in uses[1:]:
        if rep(u) != first:
            raise ValueError(f"variant {entry['name']} serves {u}, whose representation differs from {uses[0]}")
    return first


def verify_quant_bundle(bundle, routes=None, *, kinds=None, seed=0, names=None) -> list[dict]:
    from .quant_gpu import verify_quantizer

    rows = []
    for entry in bundle.manifest["variants"]:
        if entry["kind"] != "quant" or (names and entry["name"] not in names):
            continue
        if routes and not any(u.split(".")[0] in routes for u in entry["uses"]):
            continue
        oq = _operand_quant_of(entry)
        fn = bundle.get(entry["name"])
        t0 = time.perf_counter()
        kw = {"kinds": tuple(kinds)} if kinds else {}
        try:
            results = verify_quantizer(fn, entry["args"], oq, D=entry["params"]["head_dim"], seed=seed, **kw)
        except Exception as e:  # a broken kernel is a failed row, not a crashed run
            results = [{"kind": "all", "ok": False, "error": f"{type(e).__name__}: {e}"}]
        for r in results:
            rows.append(dict(variant=entry["name"], seconds=time.perf_counter() - t0, **r))
    return rows


def verify_attn_bundle(bundle, routes=None, *, names=None, seed=0, dump_dir=None) -> list[dict]:
    from .attn_gpu import verify_attn_entry

    rows = []
    for entry in bundle.manifest["variants"]:
        if entry["kind"] != "attn_fwd" or (names and entry["name"] not in names):
            continue
        if routes and entry["uses"][0] not in routes:
            continue
        try:
            rows += verify_attn_entry(bundle, entry, seed=seed, dump_dir=dump_dir)
        except Exception as e:  # a broken kernel is a failed row, not a crashed run
            rows.append(dict(variant=entry["name"], kind="all", ok=False, error=f"{type(e).__name__}: {e}"[:300]))
    return rows


def verify_bwd_bundle(bundle, routes=None, *, names=None, seed=0, dump_dir=None) -> list[dict]:
    from .attn_gpu import verify_bwd_entry

    rows = []
    for entry in bundle.manifest["variants"]:
        if entry["kind"] != "attn_bwd" or (names and entry["name"] not in names):
            continue
        if routes and entry["uses"][0] not in routes:
            continue
        try:
            rows += verify_bwd_entry(bundle, entry, seed=seed, dump_dir=dump_dir)
        except Exception as e:  # a broken kernel is a failed row, not a crashed run
            rows.append(dict(variant=entry["name"], kind="all", ok=False, error=f"{type(e).__name__}: {e}"[:300]))
    return rows


def render_bwd_table(rows: list[dict]) -> Table:
    t = Table(title="attention backward kernels vs emulator and fp32 (min over dQ, dK, dV)")
    for c in ("variant", "input", "ok", "cos emu", "cos fp32", "NaN", "dQ probe / noise", "detail"):
        t.add_column(c, overflow="fold")
    for r in rows:
        probe = "" if "probe_dq_max_rel_change" not in r else \
            f"{r['probe_dq_max_rel_change']:.1e} / {r['dq_run_to_run']:.1e}"
        t.add_row(r["variant"], str(r.get("kind")), "[green]yes[/]" if r.get("ok") else "[red]NO[/]",
                  f"{r.get('cos_emulator', float('nan')):.6f}", f"{r.get('cos_fp32', float('nan')):.6f}",
                  str(r.get("nan", "")), probe, str(r.get("error", ""))[:200])
    return t


def render_attn_table(rows: list[dict]) -> Table:
    t = Table(title="attention forward kernels vs emulator and fp32")
    for c in ("variant", "input", "ok", "cos emu", "cos fp32", "lse err", "NaN", "P̂ flip rows", "probe", "detail"):
        t.add_column(c, overflow="fold")
    for r in rows:
        probe = "" if "probe_max_rel_change" not in r else f"{r['probe_max_rel_change']:.2e}"
        t.add_row(r["variant"], str(r.get("kind")), "[green]yes[/]" if r.get("ok") else "[red]NO[/]",
                  f"{r.get('cos_emulator', float('nan')):.6f}", f"{r.get('cos_fp32', float('nan')):.6f}",
                  f"{r.get('lse_max_rel_err', float('nan')):.1e}", str(r.get("nan", "")), str(r.get("p_flip_rows", "")),
                  probe,
                  str(r.get("error", ""))[:200])
    return t


def render_quant_table(rows: list[dict]) -> Table:
    t = Table(title="quantizer kernels vs emulator (bitwise)")
    for c in ("variant", "input", "ok", "mismatches", "detail"):
        t.add_column(c, overflow="fold")
    for r in rows:
        mism = {k: v for k, v in r.items() if k.endswith("_mismatch") and v}
        detail = r.get("error") or r.get("first_mismatch") or ""
        t.add_row(r["variant"], str(r.get("kind")), "[green]yes[/]" if r.get("ok") else "[red]NO[/]",
                  ", ".join(f"{k}={v}" for k, v in mism.items()) or "0", str(detail)[:200])
    return t


KINDS = ("quant", "attn_fwd", "attn_bwd")


def select_names(bundle, kinds=None, patterns=None) -> tuple[set, set | None]:
    """(kinds to run, variant names or None = all) from `--kind` and `--variant` glob patterns.
    A pattern matching no variant of the bundle is a ValueError naming it (a typo must not
    verify nothing and pass)."""
    import fnmatch

    run = set(kinds or KINDS)
    bad = run - set(KINDS)
    if bad:
        raise ValueError(f"kind {sorted(bad)[0]!r}: allowed values {list(KINDS)}")
    if not patterns:
        return run, None
    all_names = [v["name"] for v in bundle.manifest["variants"]]
    names = set()
    for pat in patterns:
        hit = fnmatch.filter(all_names, pat)
        if not hit:
            raise ValueError(f"--variant {pat!r} matches no variant of bundle {bundle.root}")
        names.update(hit)
    return run, names


def verify_cuda(routes=None, *, bundle_dir=None, json_out=None, console=None, dump_dir=None, kinds=None,
                patterns=None) -> int:
    """`kinds` (subset of KINDS) and `patterns` (glob patterns of variant names) narrow the run:
    a GPU session's minutes go to what changed."""
    import torch

    from ..runtime.bundle import BundleError, load_bundle

    if not torch.cuda.is_available():
        if console:
            console.print("[red]no CUDA device: verify --device cuda needs a GPU[/red]")
        return 2
    try:
        bundle = load_bundle(bundle_dir)
    except BundleError as e:
        if console:
            console.print(f"[red]{e}[/red]")
        return 2
    try:
        run, names = select_names(bundle, kinds, patterns)
    except ValueError as e:
        if console:
            console.print(f"[red]{e}[/red]")
        return 2
    have = {v["kind"] for v in bundle.manifest["variants"]} & run
    rows = verify_quant_bundle(bundle, routes, names=names) if "quant" in have else []
    attn_rows = verify_attn_bundle(bundle, routes, names=names, dump_dir=dump_dir) if "attn_fwd" in have else []
    bwd_rows = verify_bwd_bundle(bundle, routes, names=names, dump_dir=dump_dir) if "attn_bwd" in have else []
    if console:
        if rows:
            console.print(render_quant_table(rows))
        if attn_rows:
            console.print(render_attn_table(attn_rows))
        if bwd_rows:
            console.print(render_bwd_table(bwd_rows))
    rows = rows + attn_rows + bwd_rows
    ok = all(r.get("ok") for r in rows) and bool(rows)
    if json_out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, host=platform.node(),
                    date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    bundle=str(bundle.root), arch=bundle.arch, dsl_version=bundle.manifest.get("dsl_version"))
        Path(json_out).write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1, default=str))
    return 0 if ok else 1
