"""Flag-gated performance experiments of the sm90 attention forward (one GPU session).

Build here (CPU, needs the DSL), one bundle holding the default fp8_token variants and, per
experiment, the same variants rendered with that experiment's template flags (name suffix
`_x<tag>`, so a single runtime copy travels):

    python -m flamia_gen.bench.fwd_experiments build -o .dev/bundle-exp [--jobs 2] [--only kvs3,relk] \
        [--variants 'attn_fwd_sm90_fp8_token_d128_m192n128_*']

On the GPU host (no DSL; torch + tvm-ffi): verify every variant (Gaussian + tiny documents,
O cosine vs the BF16-rounded emulator, leakage probe on causal ones) and time it kernel-only on
[16384] and [4096]*4, then print one table:

    python -m flamia_gen.bench.fwd_experiments run .dev/bundle-exp [--json out.json]

Flags (templates/sm90/attn_fwd.py.j2, docs/kernels/attn_fwd.md "Next H200 session", "Round 12"): every flag
has a template default and a render-context override of the same name; the bundle's manifest
params carry the overrides. This module imports without the DSL (and without torch until `run`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

def _e4m3_qk(p) -> bool:
    """The template's E4M3-QKᵀ mode (`fp8`): where k_row_perm and, without overlap, ex2_ring are the defaults."""
    return p["q_fmt"] == "e4m3" and not p.get("scores_bf16")


def _ring_default(p) -> bool:
    """Where the template turns ex2_ring on by default (without overlap): the E4M3-QKᵀ mode, and the BF16-QKᵀ mode
    at D = 64 and for nvfp4_mixed (2026-12-03, docs/kernels/attn_fwd.md "The ex2 turns for the BF16-QKᵀ mode")."""
    qk_bf16 = p["q_fmt"] == "e2m1" or bool(p.get("scores_bf16"))
    mode = _e4m3_qk(p) or (qk_bf16 and (p["head_dim"] == 64 or p["q_fmt"] == "e2m1"))
    return mode and not p["intra_wg_overlap"]


def _wg_skip_default(p) -> bool:
    """Where the template turns fwd_wg_skip on by default: causal, 3 or more consumer warpgroups, no overlap, not
    nvfp4_mixed at D = 64 (2026-12-04, docs/kernels/attn_fwd.md "Dead warpgroup tiles")."""
    nvfp4_d64 = p["q_fmt"] == "e2m1" and p["head_dim"] == 64
    return p["causal"] and p["compute_warpgroups"] >= 3 and not p["intra_wg_overlap"] and not nvfp4_d64


def _uniform_kv_applies(p) -> bool:
    """Where the template takes fwd_uniform_kv: the E4M3-QKᵀ mode with tensor-scaled K and V (fp8_tensor), no
    diagonal tiles."""
    return _e4m3_qk(p) and p["k_gran"] == "tensor" and p["v_gran"] == "tensor" \
        and not p.get("diag_k") and not p.get("diag_v")


def _fused_exp_applies(p) -> bool:
    """Where the template takes fwd_fused_exp: keys without per-key offsets (bf16; fp8_tensor with fwd_uniform_kv)."""
    return (p["q_fmt"] == "bf16" and not p.get("scores_bf16")) or _uniform_kv_applies(p)


def _fused_exp_default(p) -> bool:
    """Where the template turns fwd_fused_exp on by default: everywhere it applies but bf16 D = 128 non-causal
    without intra_wg_overlap."""
    return _fused_exp_applies(p) and (p["q_fmt"] != "bf16" or p["causal"] or p["head_dim"] == 64
                                      or bool(p.get("intra_wg_overlap")))


def _per_key_one_tile(p) -> bool:
    """Where fwd_kf_early applies: E4M3 QKᵀ with per-key factors (not fp8_tensor's uniform ones), no overlap."""
    return _e4m3_qk(p) and not _uniform_kv_applies(p) and not p["intra_wg_overlap"]


# tag → (render-context / params overrides, which default variants it applies to, why restricted)
EXPERIMENTS: dict[str, dict] = {
    "kvs3": dict(over={"kv_stages": 3}, when=lambda p: True,
                 note="3 K/V stages (smem: n128 ~158 KB, n192 ~212 KB)"),
    "relk": dict(over={"release_k_early": True}, when=lambda p: True,
                 note="K released right after QKᵀ; factors in 2·stages slots"),
    "kvs3relk": dict(over={"kv_stages": 3, "release_k_early": True}, when=lambda p: True,
                     note="both"),
    "poly25": dict(over={"exp_poly_frac": 0.25}, when=lambda p: True, note="25 % polynomial exp2"),
    "poly50": dict(over={"exp_poly_frac": 0.5}, when=lambda p: True, note="50 % polynomial exp2"),
    # the overlap variant without the FA3 ping-pong of the two warpgroups' GEMM issue phases:
    # does FP8 lose its overlap gain to the barrier protocol? (profile 2026-11-29, perf-notes)
    "nopp": dict(over={"ovl_pingpong": False}, when=lambda p: p["intra_wg_overlap"] and p["compute_warpgroups"] == 2,
                 note="intra-warpgroup overlap, no inter-warpgroup ping-pong"),
    # fwd_window_pass (on since 2026-12-01): the per-row-limit windows of 2026-11-29, for a same-process A/B
    "nowpass": dict(over={"fwd_window_pass": False}, when=lambda p: True,
                    note="windows by per-row limits live across the tile loops (the kernel of 2026-11-29)"),
    # round 12 (2026-12-02, docs/kernels/attn_fwd.md "Round 12"): the ex2 turn handed on mid-pass (measured 0.96×);
    # pv_defer (−17 %, spills), max_tree (−1 %) and, in round 13, fk_prefetch (−1 %) were measured and their flags removed
    "ring8": dict(over={"ex2_ring": 8}, when=lambda p: _e4m3_qk(p) and not p["intra_wg_overlap"] and p["tile_n"] == 128,
                  note="the ex2 turn handed on after half of pass 2 (8 of 16 column groups)"),
    # adopted in round 12 for the E4M3-QKᵀ mode (k_row_perm everywhere, ex2_ring without overlap), and on 2026-12-03
    # for the BF16-QKᵀ mode at D = 64 and nvfp4_mixed (ex2_ring): the A/B against the kernel without them
    "noring": dict(over={"ex2_ring": False}, when=_ring_default,
                   note="without the ex2 turns of the consumer warpgroups"),
    "ringon": dict(over={"ex2_ring": True}, when=lambda p: not _ring_default(p) and not p["intra_wg_overlap"],
                   note="the ex2 turns where they are off by default (BF16 QKᵀ at D = 128: fp8_pv, fp8_token_bf16qk)"),
    "nokperm": dict(over={"k_row_perm": False}, when=_e4m3_qk,
                    note="the P permutation by shuffles instead of the K-row-permuting TMA"),
    "r11": dict(over={"ex2_ring": False, "k_row_perm": False}, when=_e4m3_qk,
                note="the kernel before round 12 (neither)"),
    # one CTA per unit (2026-12-02, thirteenth session; not yet run): the backward gained −3 … −14 % so (docs/kernels/
    # attn_bwd.md "One CTA per unit"); a model of the forward's causal 1×16384 m192 units gives 91.7 % of the ideal
    # makespan for the persistent round-robin and 99.6 % for first-free-SM dispatch
    "np": dict(over={"scheduler": "static"}, when=lambda p: True,
               note="one CTA per unit (the GPU hands out the longest-first units as SMs free up)"),
    # fwd_dynamic (default since 2026-12-02, fourteenth session; H200: fp8_token m192n128 1.07× / 0.98×, np 1.08× /
    # 0.96× at 1×16384 / 4×4096 causal): the round-robin kernel before it, as an A/B copy
    "nodyn": dict(over={"fwd_dynamic": False}, when=lambda p: p.get("scheduler") != "static",
                  note="persistent CTAs, units b, b + grid, … (the kernel before the atomic-counter scheduler)"),
    # fwd_wg_skip (2026-12-03, eighteenth session; docs/kernels/attn_fwd.md "Dead warpgroup tiles"): a warpgroup skips
    # the key tiles none of its rows sees (8.3 % of m192n128's warpgroup tiles at 4×4096 causal, 2.3 % at 1×16384)
    # (third form) on by default since 2026-12-04 for causal kernels of 3+ warpgroups: "wgskip" turns it on where it
    # is off (non-causal, 2 warpgroups), "nowgskip" is the A/B copy without it
    "wgskip": dict(over={"fwd_wg_skip": True}, when=lambda p: not p["intra_wg_overlap"] and not _wg_skip_default(p),
                   note="a warpgroup skips the key tiles none of its 64 rows can see (where it is off by default)"),
    # fwd_uniform_kv (2026-12-04; docs/kernels/attn_fwd.md "Uniform K and V factors"): tensor-scaled K and V
    # read their one factor per unit instead of per column pair in both softmax passes; on by default since the
    # twentieth session (H200: bitwise equal, 1.00 … 1.21× on all 18 fp8_tensor variants): "noukv" is the A/B copy
    "noukv": dict(over={"fwd_uniform_kv": False}, when=_uniform_kv_applies,
                  note="the K and V factors per key from shared memory (the kernel before fwd_uniform_kv)"),
    # fwd_fused_exp (2026-12-04; docs/kernels/attn_fwd.md "One FFMA for the exp argument"): y − m as one FFMA where
    # no key carries its own offset (the bf16 route, fp8_tensor; last-bit numerics); on by default since the twentieth
    # session except bf16 D = 128 non-causal (4×4096 0.88 … 0.92×): "fexp" turns it on there, "nofexp" is the A/B copy
    "fexp": dict(over={"fwd_fused_exp": True}, when=lambda p: _fused_exp_applies(p) and not _fused_exp_default(p),
                 note="the exp argument as one FFMA (where it is off by default: bf16 D = 128 non-causal without the overlap)"),
    "nofexp": dict(over={"fwd_fused_exp": False}, when=_fused_exp_default,
                   note="the exp argument as FMUL + FADD (the kernel before fwd_fused_exp)"),
    # round 24 (2026-12-04): the kernel before fwd_ukv_bare_k (fp8_tensor's producer still loading and writing per-key
    # factors nobody reads, K held until after the softmax) for the A/B against today's default
    "ukvfac": dict(over={"fwd_ukv_bare_k": False}, when=_uniform_kv_applies,
                   note="fp8_tensor's producer writing per-key factors again (the kernel before fwd_ukv_bare_k)"),
    # round 25 (measured round 26, off: 0.90–1.05×): causal query tiles end at the document's end (the partial tile first)
    "qend": dict(over={"fwd_q_align_end": True},
                 when=lambda p: p["causal"] and not p.get("diag_k") and not p.get("diag_v"),
                 note="query tiles aligned to the document's end: the partial tile first, where it sees 1 key tile"),
    # thirty-sixth session (round 37, built, not run): pass 1's first per-key factor loads issued while QKᵀ runs
    **{f"kfe{n}": dict(over={"fwd_kf_early": n}, when=_per_key_one_tile,
                       note=f"the first {n} column group(s)' (2^ek, ev) loaded between the QKᵀ issue and its wait")
       for n in (1, 2, 4)},
    # timing-only diagnostic (O is wrong: run with --no-verify): pass 2 without MUFU.EX2. If the MUFU phase overlaps
    # the tensor pipe the kernel barely speeds up; if the two are serialised it loses about the MUFU's own time.
    "noex2": dict(over={"diag_no_ex2": True}, when=lambda p: True, diagnostic=True,
                  note="DIAGNOSTIC: no ex2 in pass 2 (wrong O)"),
    "nowgskip": dict(over={"fwd_wg_skip": False}, when=_wg_skip_default,
                     note="without the skipped dead warpgroup tiles (the kernel before 2026-12-04)"),
}
# diagnostics (wrong output by design) are built only when named in --only
DEFAULT_EXPERIMENTS = tuple(t for t, ex in EXPERIMENTS.items() if not ex.get("diagnostic"))
ROUTE = "fp8_token"


def experiment_variants(flags=DEFAULT_EXPERIMENTS, route: str = ROUTE, base_variants=None, experiments=None):
    """[(tag, variant)]: the route's default sm90 forward variants (tag "") and, per flag, the
    overridden copies named `<name>_x<tag>`. Needs only the planner (no DSL). `experiments`
    (default: this module's EXPERIMENTS) lets the backward's experiments reuse it."""
    experiments = EXPERIMENTS if experiments is None else experiments
    if base_variants is None:
        from ..plan import make_plan
        from ..spec import KernelKind, load_specs

        plan = make_plan(load_specs(), arch="sm90", kinds=[KernelKind.attn_fwd], routes=[route])
        base_variants = plan.variants
    out = [("", v) for v in base_variants]
    for tag in flags:
        if tag not in experiments:
            raise KeyError(f"unknown experiment {tag!r}; known: {sorted(experiments)}")
        ex = experiments[tag]
        for v in base_variants:
            p = dict(v.params)
            if not ex["when"](p):
                continue
            p.update(ex["over"])
            ok, reason = _feasible(v, p)
            if not ok:  # e.g. a second staging tile past the shared memory an SM gives one CTA (found at launch once)
                print(f"experiment {tag}: {v.name} left out: {reason}", file=sys.stderr)
                continue
            out.append((tag, replace(v, name=f"{v.name}_x{tag}", params=tuple(sorted(p.items())))))
    return out


def _feasible(v, params: dict) -> tuple[bool, str]:
    """The planner's feasibility check (registers, shared memory, tile rules) on an experiment copy's params."""
    from ..plan.feasibility import check_attn, check_attn_bwd

    check = check_attn_bwd if v.kind.value == "attn_bwd" else check_attn
    elem_bytes = 1 if params.get("v_fmt") == "e4m3" else 2  # as the planner: V, P (and dO) on the 8-bit side
    return check(v.arch, elem_bytes, params)


def build_variants_bundle(out_dir, vs, *, jobs: int = 2) -> dict:
    """Build variants `vs` into ONE bundle at `out_dir` (one runtime copy), printing one line per
    variant. Needs the DSL (imported lazily through the builder)."""
    from ..build.builder import build_all
    from ..build.bundle import write_bundle
    from ..build.cache import BuildCache

    cache = BuildCache()
    t0 = time.perf_counter()
    res = build_all(vs, jobs=jobs, cache=cache, use_generated=False)
    for r in res:
        print(f"{r.name:90s} {r.status:7s} {r.seconds:6.1f}s {r.message[:160]}", flush=True)
    failed = [r.name for r in res if r.status == "failed"]
    m = write_bundle(Path(out_dir), "sm90", vs, res, cache)
    print(f"{len(m['variants'])} variants in {out_dir} ({len(failed)} failed) in {time.perf_counter() - t0:.0f}s")
    return m


def build_experiment_bundles(out_dir, flags=DEFAULT_EXPERIMENTS, *, jobs: int = 2, routes=(ROUTE,),
                             variant_globs=()) -> dict:
    """Build the default variants of `routes` and every experiment's overridden variants into ONE bundle
    at `out_dir` (one runtime copy), narrowed to the base variants whose names match one of `variant_globs`
    (none: all). Needs the DSL (imported lazily through the builder)."""
    routes = (routes,) if isinstance(routes, str) else tuple(routes)
    pairs = [pair for route in routes for pair in experiment_variants(flags, route)]
    if variant_globs:
        pairs = [(t, v) for t, v in pairs if matches_any(split_name(v.name)[0], variant_globs)]
        if not pairs:
            raise SystemExit(f"no {'/'.join(routes)} forward variant matches {list(variant_globs)}")
    return build_variants_bundle(out_dir, [v for _, v in pairs], jobs=jobs)


def matches_any(name: str, globs) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, g) for g in globs)


def split_name(name: str, experiments=None) -> tuple[str, str]:
    """(base variant name, experiment tag or "")."""
    for tag in sorted(EXPERIMENTS if experiments is None else experiments, key=len, reverse=True):
        if name.endswith(f"_x{tag}"):
            return name[: -len(tag) - 2], tag
    return name, ""


def select_entries(b, kind: str, only, causal_only: bool, experiments=None, variant_globs=()) -> list[dict]:
    """The bundle's `kind` variants, narrowed to the experiment tags in `only` ("" = defaults), to those whose base
    name matches one of `variant_globs` (none: all) and, with `causal_only`, to causal ones."""
    entries = [e for _, e in sorted(b.variants.items()) if e["kind"] == kind]
    if variant_globs:
        entries = [e for e in entries if matches_any(split_name(e["name"], experiments)[0], variant_globs)]
    if only:
        keep = set(only)
        entries = [e for e in entries if split_name(e["name"], experiments)[1] in keep]
    return [e for e in entries if e["params"]["causal"]] if causal_only else entries


ENTRY_TIMEOUT_S = 120.0  # one variant's verify + timing takes ~5-20 s on the H200; a hung kernel never returns
HUNG_EXIT_CODE = 3


def run_entries(entries, measure, fmt_row, table_fn, workloads, json_out, experiments=None,
                entry_timeout: float | None = ENTRY_TIMEOUT_S, resume: bool = False) -> list[dict]:
    """One row per entry: `measure(entry, base_name, tag, row)` fills it; an exception becomes the row's
    `error` (one broken experiment must not stop the table) and a lost CUDA context stops the run; each
    row is printed as it comes and the JSON (when asked) is rewritten after every row, so a call cut off by
    its time limit keeps what it measured; then the table.

    `resume` (needs `json_out`): the rows already in that file without an `error` are kept and their entries
    skipped, so a second call goes on where a cut-off one stopped. Each row carries the `run` it was measured
    in (the process's start time): an A/B pair timed in two runs is two processes, which the table's ratios do
    not say — rerun the pair together (`--only`) when its ratio matters.

    An entry still running after `entry_timeout` seconds is a hung kernel (a launch that never completes
    cannot be cancelled from the host): a watchdog gives it an `error` row, prints the table and writes the
    JSON of every row so far, and ends the process with exit code HUNG_EXIT_CODE, so a hang costs one
    timeout of device time instead of the caller's whole limit (a GPU session lost 7 minutes so, 2026-12-01)."""
    rows = _resumed_rows(json_out) if resume else []
    t_start = time.perf_counter()
    done = {(r["variant"], r["tag"]) for r in rows}
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")
    if done:
        print(f"resuming {json_out}: {len(done)} rows kept, their entries skipped", flush=True)
    for e in entries:
        base, tag = split_name(e["name"], experiments)
        if (base, tag or "default") in done:
            continue
        row = dict(variant=base, tag=tag or "default", causal=e["params"]["causal"], run=run_id)
        watchdog = None
        if entry_timeout:
            watchdog = threading.Timer(entry_timeout, _abandon_hung_run,
                                       (rows, row, entry_timeout, fmt_row, table_fn, workloads, json_out))
            watchdog.daemon = True
            watchdog.start()
        try:
            measure(e, base, tag, row)
        except Exception as ex:  # noqa: BLE001
            row["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
        finally:
            if watchdog is not None:
                watchdog.cancel()
        rows.append(row)
        print(fmt_row(row, workloads), f"[{time.perf_counter() - t_start:.0f}s]", flush=True)
        write_rows(rows, json_out)
        if "error" in row and cuda_context_lost(e, tag):
            break
    return finish(rows, table_fn(rows, workloads), json_out)


def _resumed_rows(json_out) -> list[dict]:
    """The error-free rows of an earlier run's JSON (none when the file is missing); a file that is not such a
    list is an error, never silently replaced."""
    if not json_out:
        raise SystemExit("--resume needs --json (the file of the run to go on from)")
    p = Path(json_out)
    if not p.exists():
        return []
    try:
        rows = json.loads(p.read_text())
    except json.JSONDecodeError as ex:
        raise SystemExit(f"--resume: {p} is not JSON ({ex}); move it away or drop --resume") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "variant" in r and "tag" in r for r in rows):
        raise SystemExit(f"--resume: {p} is not a list of experiment rows")
    return [r for r in rows if "error" not in r]


def write_rows(rows: list[dict], json_out) -> None:
    """The rows so far as JSON, replaced atomically (a kill mid-write leaves the previous file)."""
    if not json_out:
        return
    p = Path(json_out)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    os.replace(tmp, p)


def run(bundle_dir, *, only=None, workloads=((16384,), (4096,) * 4), verify=True, probe=True, iters=20,
        json_out=None, causal_only=False, entry_timeout: float | None = ENTRY_TIMEOUT_S, resume=False) -> list[dict]:
    """GPU host: verify and time every attn_fwd variant of the bundle; print one table."""
    from ..runtime.bundle import load_bundle
    from ..verify.attn_gpu import time_attn_entry, verify_attn_entry

    b = load_bundle(bundle_dir)
    inputs_cache: dict = {}

    def measure(e, base, tag, row):
        if verify:
            vr = verify_attn_entry(b, e, kinds=("gauss", "tiny_docs"), probe=probe)
            row["ok"] = all(r["ok"] for r in vr)
            row["cos_emu"] = min(r["cos_emulator"] for r in vr)
            pr = [r.get("probe_max_rel_change") for r in vr if "probe_max_rel_change" in r]
            row["probe"] = max(pr) if pr else None
            if tag and base in b.variants:
                row.update(compare_to_base(b, b.variants[base], e))
        for docs in workloads:
            t = time_attn_entry(b, e, list(docs), iters=iters, inputs_cache=inputs_cache)
            row[wl_key(docs)] = t["tflops"]

    return run_entries(select_entries(b, "attn_fwd", only, causal_only), measure, _fmt_row, table, workloads,
                       json_out, entry_timeout=entry_timeout, resume=resume)


BITWISE_ROWS = ([300, 1000, 1, 129, 2048, 77], [1, 2, 3, 1, 5, 130, 1, 64, 127, 129], [4096, 4096])


def compare_to_base(bundle, base_entry: dict, entry: dict, rows=BITWISE_ROWS, hq: int = 4, hkv: int = 2) -> dict:
    """An experiment copy against its base variant on fresh Gaussian inputs (documents ending mid-tile, one-token
    documents, two long ones): `bitwise` (O and LSE bit for bit), and, for a copy that changes numerics on purpose
    (e.g. fwd_fused_exp), `cos_base` (the smallest O cosine over the rows) and `lse_max_abs` (LSE's largest
    difference). Outputs are poisoned before each run, so a NaN or an element left unwritten fails `bitwise` and
    shows as a NaN cosine."""
    import torch

    from ..spec import get_route
    from ..verify.attn_gpu import make_qkv, run_kernel
    from ..numerics.metrics import cosine

    route = get_route(entry["uses"][0])
    gen = torch.Generator().manual_seed(7)
    bitwise, cos_min, lse_abs = True, 1.0, 0.0
    for docs in rows:
        q, k, v, cu = make_qkv(docs, hq, hkv, entry["params"]["head_dim"], "gauss", gen, "cuda")
        o0, l0 = run_kernel(bundle.get(base_entry["name"]), base_entry, route, q, k, v, cu)
        o1, l1 = run_kernel(bundle.get(entry["name"]), entry, route, q, k, v, cu)
        bitwise = bitwise and bool(torch.equal(o0, o1) and torch.equal(l0, l1))
        c = float(cosine(o1.float(), o0.float()))
        cos_min = c if c != c else min(cos_min, c)  # NaN sticks
        fin = torch.isfinite(l0)
        d = (l1.float() - l0.float()).abs()
        lse_abs = max(lse_abs, float(d[fin].max()) if bool(fin.any()) else 0.0)
        if not bool(torch.equal(torch.isfinite(l0), torch.isfinite(l1))):
            lse_abs = float("inf")
    return {"bitwise": bitwise, "cos_base": cos_min, "lse_max_abs": lse_abs}


def _abandon_hung_run(rows, row, timeout, fmt_row, table_fn, workloads, json_out) -> None:
    """The watchdog of `run_entries`: the entry has run past its timeout; keep what was measured and exit."""
    row["error"] = f"timeout: still running after {timeout:.0f} s (a hung kernel?); the run stops here"
    done = rows + [row]
    print(fmt_row(row, workloads), flush=True)
    finish(done, table_fn(done, workloads), json_out)
    sys.stdout.flush()
    os._exit(HUNG_EXIT_CODE)


def cuda_context_lost(entry: dict, tag: str) -> bool:
    """After a failed variant: whether the CUDA context is gone (a sticky error such as an illegal
    instruction poisons every later launch), said in one line; the caller then stops."""
    import torch

    try:
        torch.cuda.synchronize()
        return False
    except Exception as ex:  # noqa: BLE001
        print(f"CUDA context lost after {entry['name']} ({type(ex).__name__}); rerun with --only "
              f"without tag {tag or 'default'!r}", flush=True)
        return True


def finish(rows: list[dict], table_text: str, json_out) -> list[dict]:
    """Print the table and write the rows as JSON (when asked): the end of every experiment run."""
    print()
    print(table_text)
    write_rows(rows, json_out)
    return rows


def wl_key(docs) -> str:
    """A row's documents as the bench names them: "4x4096" (equal lengths), "8192+224x256" (one, then equal ones)."""
    d = list(docs)
    if len(set(d)) == 1:
        return f"{len(d)}x{d[0]}"
    if len(set(d[1:])) == 1:
        return f"{d[0]}+{len(d) - 1}x{d[1]}"
    return "+".join(map(str, d))


def _wl_keys(workloads):
    return [wl_key(d) for d in workloads]


def _fmt_row(row, workloads) -> str:
    short = row["variant"].replace("attn_fwd_sm90_", "").replace("_wg2_preg", "").replace("_longest_first", "")
    cells = [f"{short:38s}", f"{row['tag']:9s}"]
    if "ok" in row:
        cells.append(f"{'ok ' if row['ok'] else 'BAD'} cos {row['cos_emu']:.6f}")
        cells.append(f"probe {row['probe']:.1e}" if row.get("probe") is not None else "probe  -     ")
    if "bitwise" in row:
        cells.append("bitwise" if row["bitwise"] else
                     f"DIFFERS (cos {row.get('cos_base', float('nan')):.7f}, lse ±{row.get('lse_max_abs', float('nan')):.1e})")
    for k in _wl_keys(workloads):
        cells.append(f"{k} {row[k]:6.0f}" if k in row else f"{k}      -")
    if "error" in row:
        cells.append("ERROR " + row["error"])
    return "  ".join(cells)


def experiment_table(rows, keys, head: list[str], first_cells, unit: str, fmt: str, ratio_fmt: str) -> str:
    """Markdown table, one line per variant × experiment (defaults first): `first_cells(row)` gives the
    leading cells under `head`, then one cell per workload key: the value (`fmt`) and, for an experiment,
    its ratio to the default variant's (`ratio_fmt`). Shared by the forward and backward experiments."""
    base = {r["variant"]: r for r in rows if r["tag"] == "default"}
    lines = [" | ".join(head + [f"{k} {unit} (×default)" for k in keys]), "---|" * (len(head) + len(keys))]
    for r in sorted(rows, key=lambda r: (r["variant"], r["tag"] != "default", r["tag"])):
        cells = list(first_cells(r))
        for k in keys:
            if k not in r:
                cells.append("ERROR" if "error" in r else "-")
                continue
            d = base.get(r["variant"], {}).get(k)
            cells.append(format(r[k], fmt) + (f" ({format(r[k] / d, ratio_fmt)}×)" if d and r["tag"] != "default" else ""))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def table(rows, workloads) -> str:
    """One line per variant × experiment, plus the speed-up over the default per workload."""
    return experiment_table(
        rows, _wl_keys(workloads), ["variant", "experiment", "verify", "cos_emu", "vs default"],
        lambda r: [r["variant"].replace("attn_fwd_sm90_", ""), r["tag"],
                   ("ok" if r.get("ok") else "FAIL") if "ok" in r else "-",
                   f"{r['cos_emu']:.6f}" if "cos_emu" in r else "-", _vs_default(r)], "TFLOP/s", ".0f", ".2f")


def _vs_default(r: dict) -> str:
    if "bitwise" not in r:
        return "-"
    return "bitwise" if r["bitwise"] else f"cos {r.get('cos_base', float('nan')):.7f}"


def experiment_cli(prog: str, doc: str, default_out: str, default_flags, run_help: str):
    """(parser, build subparser, run subparser) with the arguments every experiment module shares
    (`build`: -o, --only, --jobs; `run`: bundle, --only, --no-verify, --causal-only, --iters, --json;
    `list`); the caller adds its own."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    bp = sub.add_parser("build", help="CPU: build the experiment bundle (needs the DSL)")
    bp.add_argument("-o", "--out", default=default_out)
    bp.add_argument("--only", default=",".join(default_flags), help="comma-separated experiment tags")
    bp.add_argument("--jobs", type=int, default=2)
    bp.add_argument("--variants", default="", help="comma-separated name globs of the base variants to build")
    rp = sub.add_parser("run", help=run_help)
    rp.add_argument("bundle")
    rp.add_argument("--only", default="", help="comma-separated tags; 'default' for the unflagged variants")
    rp.add_argument("--no-verify", action="store_true")
    rp.add_argument("--causal-only", action="store_true")
    rp.add_argument("--iters", type=int, default=20)
    rp.add_argument("--json", default=None, help="rows as JSON, rewritten after every variant")
    rp.add_argument("--resume", action="store_true",
                    help="keep the error-free rows of --json and run only the variants it lacks (a call cut off by "
                         "its time limit, continued)")
    rp.add_argument("--entry-timeout", type=float, default=ENTRY_TIMEOUT_S,
                    help="seconds one variant may take before the run is abandoned as hung (exit 3; 0: no limit)")
    sub.add_parser("list", help="print the experiments")
    return ap, bp, rp


def print_experiments(experiments) -> int:
    for tag, ex in experiments.items():
        print(f"{tag:9s} {ex['over']}  {ex['note']}")
    return 0


def split_tags(text: str, run: bool = False):
    """Comma-separated tags; for `run`, 'default' names the unflagged variants ("") and none means all."""
    tags = [t for t in text.split(",") if t]
    return ([t if t != "default" else "" for t in tags] or None) if run else tags


def doc_rows(text: str) -> tuple[tuple[int, ...], ...]:
    """--workloads ("4x4096,1x16384,8192+224x256") as the rows of document lengths `run` takes: the tuner's parser."""
    from ..tune.space import parse_workloads

    try:
        return tuple(w.doc_lens for w in parse_workloads(text))
    except ValueError as e:
        raise SystemExit(f"--workloads: {e}") from None


def run_exit_code(rows) -> int:
    return 0 if all(r.get("ok", True) and "error" not in r for r in rows) else 1


def main(argv=None) -> int:
    ap, bp, rp = experiment_cli("python -m flamia_gen.bench.fwd_experiments", __doc__, ".dev/bundle-exp",
                               DEFAULT_EXPERIMENTS, "GPU: verify and time every variant of the bundle")
    bp.add_argument("--routes", default=ROUTE, help="comma-separated routes whose forward variants are copied")
    rp.add_argument("--no-probe", action="store_true")
    rp.add_argument("--workloads", default="1x16384,4x4096",
                    help="comma-separated rows of documents, e.g. 1x16384,4x4096,8192+224x256 (the skewed row is where "
                         "fwd_wg_skip pays)")
    a = ap.parse_args(argv)
    if a.cmd == "list":
        return print_experiments(EXPERIMENTS)
    if a.cmd == "build":
        m = build_experiment_bundles(a.out, split_tags(a.only), jobs=a.jobs, routes=split_tags(a.routes),
                                     variant_globs=split_tags(a.variants))
        return 0 if m["variants"] else 1
    rows = run(a.bundle, only=split_tags(a.only, run=True), verify=not a.no_verify, probe=not a.no_probe,
               iters=a.iters, json_out=a.json, causal_only=a.causal_only, entry_timeout=a.entry_timeout or None,
               workloads=doc_rows(a.workloads), resume=a.resume)
    return run_exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
