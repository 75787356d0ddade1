"""Packed low-precision attention forward from a bundle: fused quantizer launches for
Q, K, V, then the forward kernel. Kernels are picked by the dispatch table of this
GPU (analytic defaults when there is none or it is stale).

This is the forward half of the training op (issue #9 adds the backward and the
`torch.library` registration). A route, arch or head dim with no kernel raises a clear
error; there is no silent fallback to another route.
"""

from __future__ import annotations

import math
import os
import weakref
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from ..dispatch import DocProfile, Dispatcher
from .attn_fwd import _is_fp8_spec, fwd_schedule, kernel_key_align, run_attn_fwd
from .bundle import Bundle, load_bundle
from .nvfp4 import mixed_qk_inputs
from .quant import run_quantizer

ARCH = "sm90"


class NoKernelError(RuntimeError):
    pass


@lru_cache(maxsize=4)
def _bundle(path: str) -> Bundle:
    return load_bundle(path)


@lru_cache(maxsize=8)
def _resolved(path: str, cwd: str | None) -> str:
    """`path` made absolute and canonical (`cwd` keys a relative path to the directory it was
    resolved from); cached: `Path.resolve` costs tens of µs, paid on every call otherwise."""
    return str(Path(path).resolve())


_JIT_ROOTS: dict[str, str] = {}  # route → its JIT bundle's root, for the life of the process


def _current_bundle(route: str | None = None) -> Bundle:
    """The bundle in $FLAMIA_GEN_BUNDLE; without one, JIT through the DSL when it is
    installed (the route's kernels are built, cached and packed once; later calls reuse the
    bundle without re-planning or re-rendering the route)."""
    path = os.environ.get("FLAMIA_GEN_BUNDLE")
    if path:
        return _bundle(_resolved(path, None if os.path.isabs(path) else os.getcwd()))
    root = _JIT_ROOTS.get(route) if route is not None else None
    if root is None:
        from ..build.toolchain import dsl_available

        dsl = dsl_available()
        if route is None or not dsl:
            raise NoKernelError("no kernels: set FLAMIA_GEN_BUNDLE to a bundle made by `flamia-gen bundle --arch sm90`"
                                + ("" if dsl else " (nvidia-cutlass-dsl is not installed, so no JIT either)"))
        from .jit import jit_bundle

        root = _JIT_ROOTS[route] = str(jit_bundle(route, ARCH).root.resolve())
    return _bundle(root)


@lru_cache(maxsize=2)
def _dispatcher(gpu: str) -> Dispatcher:
    return Dispatcher(ARCH, gpu)


def available_routes() -> list[str]:
    """Routes with forward kernels: those in the bundle, or (JIT) those the specs build."""
    if not os.environ.get("FLAMIA_GEN_BUNDLE"):
        from ..build.toolchain import dsl_available

        if dsl_available():
            from ..plan import make_plan
            from ..spec import KernelKind, load_specs

            plan = make_plan(load_specs(), arch=ARCH, kinds=[KernelKind.attn_fwd])
            return sorted({v.route for v in plan.variants})
    b = _current_bundle()
    return sorted({v["uses"][0] for v in b.manifest["variants"] if v["kind"] == "attn_fwd"})


@lru_cache(maxsize=256)
def _pick_cached(root: str, kind: str, route: str, d: int, causal, profile, operand=None, det: bool = False) -> dict:
    return _pick(_bundle(root), kind, route, d, causal, profile, operand, det)


def _local_dispatcher() -> Dispatcher:
    """The dispatcher of this host's GPU ("cpu" without one)."""
    return _dispatcher(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")


def _pick(b: Bundle, kind: str, route: str, d: int, causal, profile, operand=None, det: bool = False) -> dict:
    """`det`: the deterministic backward variants (their own dispatch groups, `group_route`)."""
    from ..dispatch.defaults import group_route

    disp = _local_dispatcher()
    try:
        if kind == "quant":
            dec = disp.quantizer(route, operand, d, profile=profile)
        else:
            dec = disp.decide(kind, group_route(route, det), d, causal, profile=profile)
    except KeyError:
        dec = None
    name = dec.variant if dec else None
    if name and name in b.variants and bool(b.variants[name]["params"].get("deterministic")) == det:
        return b.variants[name]
    # the chosen variant is not in this bundle: the group's default if bundled, else any bundled variant of the group
    if kind == "quant":
        cands = b.for_use(route, operand, "quant", head_dim=d)
    else:
        cands = [v for v in b.manifest["variants"] if v["kind"] == kind and v["uses"][0] == route
                 and v["params"]["head_dim"] == d and v["params"]["causal"] == causal
                 and bool(v["params"].get("deterministic")) == det]
    if not cands:
        raise NoKernelError(f"no {kind} kernel for route={route!r} operand={operand} head_dim={d} causal={causal} "
                            f"on {ARCH} in bundle {b.root}")
    default = disp.defaults.get(dec.group) if dec else None
    pick = next((v for v in cands if v["name"] == default), None) or sorted(cands, key=lambda v: v["name"])[0]
    if name:
        for rec in _RECORDERS:
            rec.append((name, pick["name"]))
    if name and (name, str(b.root)) not in _WARNED_MISSING:
        _WARNED_MISSING.add((name, str(b.root)))
        import warnings

        chose = ("the group's analytic default (no table entry)" if dec.source == "default"
                 else "the dispatch table's choice")
        warnings.warn(f"flamia-gen: {chose} {name} is not in bundle {b.root}; running {pick['name']} instead "
                      "(build the bundle with `flamia-gen bundle --table` for this GPU's table)",
                      RuntimeWarning, stacklevel=3)
    return pick


_WARNED_MISSING: set = set()  # (variant, bundle root) pairs already warned about: once per process
_RECORDERS: list[list] = []  # open `substitutions()` blocks


@contextmanager
def substitutions():
    """Within the block, kernel choices are made afresh (the choice cache and the once-per-process warnings are
    cleared on entry) and every kernel run in place of the one the dispatch table (or the group's analytic default)
    chose — a bundle without it — is appended to the yielded list as (chosen, ran). `flamia-gen bench` wraps each row of
    ours in one, so that a row timed on an untuned kernel says so."""
    _pick_cached.cache_clear()
    _WARNED_MISSING.clear()
    rec: list = []
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)


_WORK_CACHE: dict = {}


def _cached_work(cu: torch.Tensor, key: tuple, build):
    """`build()` (a work list, schedule or offsets of `cu`), reused while the same `cu_seqlens` tensor object is
    unmodified (every attention layer of a step shares it): ~20 small launches saved per
    call. Keyed on the live object and its version counter, never on a data pointer
    (freed memory is reused); `key` holds the rest of what the list depends on."""
    key = (id(cu), cu._version) + key
    hit = _WORK_CACHE.get(key)
    if hit is not None and hit[0]() is cu:
        return hit[1]
    work = build()
    if len(_WORK_CACHE) > 64:
        _WORK_CACHE.clear()
    _WORK_CACHE[key] = (weakref.ref(cu), work)
    return work


def _fwd_schedule(cu: torch.Tensor, T: int, params: dict):
    """The forward's schedule (documents and windows, work list, per-token document bounds:
    runtime.attn_fwd.fwd_schedule), cached like the work lists (`_cached_work`)."""
    tile_m, tile_n, causal = params["tile_m"], params.get("tile_n"), params["causal"]
    return _cached_work(cu, ("fwd", T, tile_m, tile_n, causal),
                        lambda: fwd_schedule(cu, tile_m, causal, T=T, tile_n=tile_n))


def per_token_scales(scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The forward reads one UE8M0 exponent per (token, head): `token` and `token_block`
    quantizers already write that layout; a `tensor` scale is broadcast (a tiny copy)."""
    T, H = x.shape[0], x.shape[1]
    if scales.shape == (T, H):
        return scales.contiguous()
    if scales.numel() == 1:
        return scales.reshape(1, 1).expand(T, H).contiguous()
    raise ValueError(f"scales of shape {tuple(scales.shape)}: the sm90 forward takes per-token or tensor scales")


def _quantize(b: Bundle, entry: dict, x: torch.Tensor, cu: torch.Tensor, o: torch.Tensor | None = None,
              skip_transposed: bool = False, skip_codes: bool = False) -> dict:
    """One quantizer launch of the bundle (the dO launch takes `o`); inputs were validated by
    the caller (no host sync here). `skip_transposed` / `skip_codes`: the caller reads no codes_t / no
    row-major codes (run_quantizer)."""
    return run_quantizer(b.get(entry["name"]), entry["args"], x, cu, check=False, o=o,
                         skip_transposed=skip_transposed, skip_codes=skip_codes, params=entry["params"])


def packed_attention(q, k, v, cu_seqlens, max_seqlen: int, *, route: str = "fp8_token", causal: bool = True,
                     softmax_scale: float | None = None, return_lse: bool = False, keep_codes: bool = False,
                     inputs_checked: bool = False):
    """O (T, HQ, D) BF16 for packed BF16 q (T, HQ, D), k, v (T, HKV, D); with `return_lse`, (O, LSE).
    `keep_codes` (routes where `saves_codes`): returns (O, LSE, codes) whatever `return_lse` says, codes
    the flat tuple of the forward's Q, K, V quantizer outputs the backward reads (SAVED_FIELDS[op] for
    op in SAVED_OPERANDS: the op keeps them for the backward). `inputs_checked`: the caller validated q, k, v,
    cu_seqlens (the op's `check_inputs`), so the forward kernel's wrapper skips its own checks of them and of the
    quantizers' outputs (host time, not GPU time)."""
    if not q.is_cuda:
        raise ValueError("q: must be a CUDA tensor (the kernels run on sm90)")
    T, HQ, D = q.shape
    if D not in (64, 128):
        raise ValueError(f"head dim {D}: unsupported on sm90 (64 or 128)")
    b = _current_bundle(route)
    profile = doc_profile(T, cu_seqlens, max_seqlen)
    root = str(b.root)
    fwd = _pick_cached(root, "attn_fwd", route, D, causal, profile)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    launched: dict = {}
    if not _is_fp8_spec(fwd["args"]):
        o, lse = run_attn_fwd(b.get(fwd["name"]), fwd["args"], q.contiguous(), k.contiguous(), v.contiguous(),
                              cu_seqlens=cu_seqlens, params=fwd["params"], softmax_scale=scale,
                              schedule=_fwd_schedule(cu_seqlens, T, fwd["params"]), check=not inputs_checked)
    else:
        # without keep_codes nothing reads Q's and K's transposed codes after the forward (its Vᵀ is V's codes_t),
        # nor V's row-major codes: their launches skip them (a quarter of Q's and K's bytes, a fifth of V's)
        ins = fp8_forward_inputs(b, fwd, route, q, k, v, cu_seqlens, profile, launched=launched,
                                 skip_transposed=() if keep_codes else ("q", "k"),
                                 skip_codes=() if keep_codes else ("v",))
        o, lse = run_attn_fwd(b.get(fwd["name"]), fwd["args"], **ins, cu_seqlens=cu_seqlens, params=fwd["params"],
                              softmax_scale=scale, schedule=_fwd_schedule(cu_seqlens, T, fwd["params"]),
                              check=not inputs_checked)
    if keep_codes:
        # the backward's own quantizer choice for each operand (ops.backward_with): the same entry, so the
        # same codes bit for bit; the forward launched it already (saves_codes routes)
        saved = []
        for op in SAVED_OPERANDS:
            outs = launched.get((op, _pick_cached(root, "quant", route, D, None, profile, op)["name"]))
            if outs is None:
                raise ValueError(f"keep_codes: route {route!r} keeps no codes (attention.saves_codes is False: "
                                 f"its forward does not run the {op} quantizer its backward reads)")
            saved += [outs[f] for f in SAVED_FIELDS[op]]
        return o, lse, tuple(saved)
    return (o, lse) if return_lse else o


SAVED_OPERANDS = ("q", "k", "v")
# per operand, what the FP8 backward reads (its ARGS: q, q_t, q_scale, k, k_t, k_scale, v, v_scale): no Vᵀ
SAVED_FIELDS = {"q": ("codes", "codes_t", "scales"), "k": ("codes", "codes_t", "scales"), "v": ("codes", "scales")}


@lru_cache(maxsize=32)
def saves_codes(route: str) -> bool:
    """Whether the op keeps the forward's Q, K, V quantizer outputs for the backward instead of
    recomputing them (three launches fewer per step; the backward then reads the forward's very
    codes). For the sm90 backward's 8-bit routes whose q, k, v are per-token E4M3 (codes (T, H, D),
    codes_t (H, D, T_PAD), scales (T, H): shapes the op's fake implementation can state)."""
    try:
        from ..spec import load_specs

        specs = load_specs()
        r = specs.route(route)
    except Exception:  # no specs on this host, or an unknown route (refused elsewhere): recompute
        return False
    bwd_routes = {x for f in specs.families.values() if f.kind.value == "attn_bwd" and f.arch.value == ARCH
                  for x in f.routes}
    ops = [r.operands.q, r.operands.k, r.operands.v]
    # scores_bf16: the forward quantizes only V (QKᵀ takes the BF16 q, k), so there are no Q, K codes to keep
    return route in bwd_routes and not r.bf16_scores and all(o.format.value == "e4m3" and o.granularity.value == "token"
                                                             and not o.hadamard for o in ops)


# The representation of an NVFP4 (E2M1) operand's copies: E4M3, ceil exponent rule. On the backward's dK = dSᵀ·Q and
# dQ = dS·K an NVFP4 Q, K is read as its E4M3 token-block (ceil) copy (numerics.reference_route._product_spec,
# `_E4M3_TB`: "NVFP4 is QKᵀ-only"); only Sᵀ = K·Qᵀ reads the NVFP4 codes.
NVFP4_COPY_REP = {"fmt": "e4m3", "exponent_rule": "ceil"}
COPY_GRANULARITIES = ("token", "token_block")


def copy_rep(own: dict) -> dict:
    """Format and exponent rule of the copies of an operand whose own quantizer has PARAMS `own`: its own, except
    for an NVFP4 operand (fmt e2m1), whose copies are E4M3 with the ceil rule (`NVFP4_COPY_REP`)."""
    if own.get("fmt") == "e2m1":
        return dict(NVFP4_COPY_REP)
    return {"fmt": own["fmt"], "exponent_rule": own["exponent_rule"]}


@lru_cache(maxsize=64)
def token_copy_use(root: str, route: str, operand: str, d: int, granularity: str = "token") -> tuple[str, str]:
    """(route, operand) served by a bundled quantizer that writes `operand` of `route` at `granularity`: the same
    format and exponent rule (`copy_rep`: E4M3, ceil for an NVFP4 operand), no rotation, not a dO launch.
    `granularity="token"` (default): the per-token copies the token-block routes' safeguards read
    (Route.forward_safeguards); `"token_block"`: the E4M3 token-block copies an NVFP4 route's backward reads in
    dK = dSᵀ·Q and dQ = dS·K (route nvfp4_mixed: the emulator's `_product_spec`). The first such quantizer by name
    answers, with the first (route, operand) it serves. NoKernelError when the bundle has none (or no quantizer of
    route.operand itself)."""
    if granularity not in COPY_GRANULARITIES:
        raise ValueError(f"granularity: {granularity!r}, expected one of {COPY_GRANULARITIES}")
    b = _bundle(root)
    own = b.for_use(route, operand, "quant", head_dim=d, with_delta=False)
    if not own:
        raise NoKernelError(f"no quantizer for {route}.{operand} (head_dim={d}) on {ARCH} in bundle {root}")
    p = copy_rep(own[0]["params"])
    for v in sorted(b.manifest["variants"], key=lambda e: e["name"]):
        vp = v["params"]
        if v["kind"] == "quant" and _is_copy(vp, p, d, granularity) and not vp.get("with_delta") and v["uses"]:
            r, op = v["uses"][0].split(".")
            return r, op
    if granularity == "token":
        raise NoKernelError(f"no per-token {p['fmt']} quantizer (the diagonal-tile copy of {route}.{operand}, "
                            f"head_dim={d}) on {ARCH} in bundle {root}")
    raise NoKernelError(f"no token-block {p['fmt']} ({p['exponent_rule']}) quantizer (the copy of {route}.{operand} "
                        f"that dK = dSᵀ·Q and dQ = dS·K read, head_dim={d}) on {ARCH} in bundle {root}: bundle a "
                        f"route whose operands are token-block {p['fmt']} {p['exponent_rule']} (mxfp8) too")


def assemble_forward_inputs(params: dict, q, k, v, quant) -> dict:
    """run_attn_fwd keyword arguments of an 8-bit forward variant (PARAMS `params`), the one place
    that says which quantizations it reads: Q, K, Vᵀ codes and per-token exponents of the route; Q
    per token where the route keeps O_i causal (`rows_q`); the per-token K / Vᵀ copies its diagonal
    tiles read (`diag_k`, `diag_v`); NVFP4 Q, K (q_fmt e2m1) dequantized to BF16 with their tensor
    scales as `qk_tensor_scale` (runtime.nvfp4); the BF16 q, k themselves and a unit `qk_tensor_scale`
    for a route with `scores_bf16`. `quant(x, operand, per_token)` quantizes x with the
    route's spec of `operand` (or its per-token copy) and returns a mapping with `codes`, `scales`,
    `codes_t`, `tensor_scale`: the bundle's quantizer launches here (`fp8_forward_inputs`), the
    emulator's quantizer in verify (`verify.attn_gpu.kernel_inputs`)."""
    if params.get("scores_bf16"):
        # QKᵀ on the BF16 inputs (the route's q, k codes serve only the backward's dK, dQ products)
        ins = dict(q=q.contiguous(), k=k.contiguous(), qk_tensor_scale=torch.ones(1, dtype=torch.float32,
                                                                                   device=q.device))
    elif params.get("q_fmt") == "e2m1":
        ins = mixed_qk_inputs(quant(q, "q", False), quant(k, "k", False))
    else:
        qq, kq = quant(q, "q", bool(params.get("rows_q"))), quant(k, "k", False)
        ins = dict(q=qq["codes"], k=kq["codes"], q_scale=per_token_scales(qq["scales"], q),
                   k_scale=per_token_scales(kq["scales"], k))
    vq = quant(v, "v", False)
    ins.update(v=vq["codes_t"], v_scale=per_token_scales(vq["scales"], v))
    diag = {}
    if params.get("diag_k"):
        kt = quant(k, "k", True)
        diag.update(k_diag=kt["codes"], k_diag_scale=per_token_scales(kt["scales"], k))
    if params.get("diag_v"):
        vt = quant(v, "v", True)
        diag.update(v_t_diag=vt["codes_t"], v_diag_scale=per_token_scales(vt["scales"], v))
    if diag:
        ins["diag"] = diag
    return ins


def fp8_forward_inputs(b: Bundle, fwd: dict, route: str, q, k, v, cu, profile, launched: dict | None = None,
                       skip_transposed: tuple[str, ...] = (), skip_codes: tuple[str, ...] = ()) -> dict:
    """`assemble_forward_inputs` with the bundle's fused quantizer launches (per-token copies through
    `token_copy_use`). `launched`, when given, receives {(operand, quantizer entry name): its outputs}.
    `skip_transposed`: operands ("q", "k") whose codes_t no one reads (the forward reads Q, K codes and V's codes_t):
    their launches get a 16-token codes_t stub; `skip_codes`: ("v",) when no one reads V's row-major codes: a
    16-token codes stub, where the bundle's quantizer supports it (PARAMS["codes_stub"]; an older one writes them
    all) (run_quantizer)."""
    root, D = str(b.root), q.shape[2]
    bad = set(skip_transposed) - {"q", "k"}
    if bad:
        raise ValueError(f"skip_transposed: {sorted(bad)}: the forward reads V's transposed codes (only q, k)")
    bad = set(skip_codes) - {"v"}
    if bad:
        raise ValueError(f"skip_codes: {sorted(bad)}: the forward reads Q's and K's codes (only v)")

    def launch(x, op, per_token):
        r, o = token_copy_use(root, route, op, D) if per_token else (route, op)
        entry = _pick_cached(root, "quant", r, D, None, profile, o)
        outs = _quantize(b, entry, x, cu, skip_transposed=op in skip_transposed,
                         skip_codes=op in skip_codes and bool(entry.get("params", {}).get("codes_stub")))
        if launched is not None:
            launched[(op, entry["name"])] = outs
        return outs

    return assemble_forward_inputs(fwd["params"], q, k, v, launch)


# ---------------------------------------------------------------- backward helpers (issue #9)
# Used by `flamia_gen.runtime.ops` (the torch.library op); additive, `packed_attention` is unchanged.


def doc_profile(T: int, cu_seqlens: torch.Tensor, max_seqlen: int) -> DocProfile:
    """The dispatch profile of a call without a host sync: static sizes and the caller's max_seqlen."""
    return DocProfile(tokens=int(T), num_docs=max(1, cu_seqlens.numel() - 1), max_len=int(max_seqlen))


def bwd_candidates(b: Bundle, route: str, d: int, causal: bool) -> list[dict]:
    """The bundle's `attn_bwd` variants for (route, head dim, causal)."""
    return [v for v in b.manifest["variants"] if v["kind"] == "attn_bwd" and v["uses"][0] == route
            and v["params"].get("head_dim") == d and v["params"].get("causal") == causal]


def pick_bwd(b: Bundle, route: str, d: int, causal: bool, profile, deterministic: bool = False) -> dict:
    """The backward kernel for this call, or NoKernelError (never another route, never the emulator,
    never a non-deterministic kernel when `deterministic`)."""
    cands = bwd_candidates(b, route, d, causal)
    if not cands:
        raise NoKernelError(
            f"no backward kernel for route {route!r} (head_dim={d}, causal={causal}) on {ARCH} yet: bundle "
            f"{b.root} has no attn_bwd variant for it (rebuild it with `flamia-gen bundle --arch {ARCH}`; the "
            f"{ARCH} backward exists for the routes of specs/kernels/attn_bwd_sm90.yaml)")
    if deterministic and not any(c["params"].get("deterministic") for c in cands):
        raise NoKernelError(
            f"no deterministic backward kernel for route {route!r} (head_dim={d}, causal={causal}) on {ARCH}: "
            f"bundle {b.root} has only variants whose dQ partials are reduce-added in a varying order "
            f"(specs/kernels/attn_bwd_sm90.yaml tunables.deterministic must list true)")
    return _pick_cached(str(b.root), "attn_bwd", route, d, bool(causal), profile, None, bool(deterministic))


def _delta_quant_tag(route: str, d: int) -> str | None:
    """The representation tag (tuning group route) of the installed with_delta dO quantizer."""
    try:
        from ..dispatch.table import _installed_plan

        plan = _installed_plan(ARCH)[1]
    except Exception:  # no specs on this host: the bundle alone decides
        return None
    use = f"{route}.do"
    for v in plan.variants:
        if (v.kind.value == "quant" and use in v.uses and v.param("head_dim") == d
                and v.param("with_delta")):
            return v.route
    return None


@lru_cache(maxsize=64)
def pick_do_delta(root: str, route: str, d: int, profile) -> dict:
    """The dO launch (`with_delta` quantizer of route.do: codes, scales, codes_t, delta, zeroed dq_accum;
    the bf16 route's writes only delta and dq_accum) for this call: the dispatch table's choice when
    bundled, else the first bundled one."""
    b = _bundle(root)
    cands = b.for_use(route, "do", "quant", with_delta=True, head_dim=d)
    if not cands:
        raise NoKernelError(f"no dO launch (a with_delta quantizer-family kernel: D = rowsum(dO∘O) and the zeroed "
                            f"dQ accumulator) for route={route!r} head_dim={d} on {ARCH} in bundle {b.root}; "
                            f"bundles built before 2026-11-29 lack the bf16 one: rebuild with "
                            f"`flamia-gen bundle --arch {ARCH}`")
    names = {c["name"] for c in cands}
    tag = _delta_quant_tag(route, d)
    if tag is not None:
        try:
            name = _local_dispatcher().decide("quant", tag, d, None, profile=profile).variant
        except KeyError:
            name = None
        if name in names:
            return b.variants[name]
    return sorted(cands, key=lambda v: v["name"])[0]


def _is_copy(vp: dict, own: dict, d: int, granularity: str) -> bool:
    """Quantizer PARAMS `vp` write the copy at `granularity` of the representation `own` (its `fmt` and
    `exponent_rule`; no rotation, head dim d): what `token_copy_use` looks for."""
    return (vp.get("granularity") == granularity and vp.get("fmt") == own["fmt"]
            and vp.get("exponent_rule") == own["exponent_rule"] and not vp.get("hadamard") and vp.get("head_dim") == d)


def _is_token_copy(vp: dict, own: dict, d: int) -> bool:
    """Quantizer PARAMS `vp` write the per-token copy of the representation PARAMS `own` (same format and exponent
    rule, granularity `token`, no rotation, head dim d): what `token_copy_use` looks for."""
    return _is_copy(vp, own, d, "token")


@lru_cache(maxsize=64)
def token_copy_do_delta(root: str, route: str, d: int, profile) -> dict:
    """The dO launch (`with_delta`: codes, scales, codes_t, delta = rowsum(dÔ∘O), the zeroed dq_accum) of the
    PER-TOKEN copy of route.do, for an exact token-block route whose dP = dO·Vᵀ and D read that copy
    (`Route.forward_safeguards`, the emulator's `causal_rows_do`: D must come from the dO representation dP
    uses). The route of `token_copy_use(route, "do")` (a bundled per-token plain quantizer of the same format and
    exponent rule) answers first, then every other route a bundled per-token with_delta quantizer of that
    representation serves; each through `pick_do_delta` (the dispatch table's choice for this call), accepted only
    when the launch it picks is such a per-token with_delta quantizer. NoKernelError when the bundle has none."""
    b = _bundle(root)
    own = b.for_use(route, "do", "quant", head_dim=d, with_delta=False)
    if not own:
        raise NoKernelError(f"no quantizer for {route}.do (head_dim={d}) on {ARCH} in bundle {root}")
    p = own[0]["params"]

    def fits(vp: dict) -> bool:
        return bool(vp.get("with_delta")) and _is_token_copy(vp, p, d)

    try:
        first = [token_copy_use(root, route, "do", d)[0]]
    except NoKernelError:  # no plain per-token copy bundled: a with_delta one may still be
        first = []
    others = sorted({u.split(".")[0] for v in b.manifest["variants"] if v["kind"] == "quant" and fits(v["params"])
                     for u in v["uses"] if u.endswith(".do")} - set(first))
    for r in first + others:
        try:
            e = pick_do_delta(root, r, d, profile)
        except NoKernelError:
            continue
        if fits(e["params"]):
            return e
    raise NoKernelError(f"no per-token {p['fmt']} ({p['exponent_rule']}) dO launch (a with_delta quantizer of "
                        f"granularity token: D = rowsum(dO∘O) and the zeroed dQ accumulator) for head_dim={d} on "
                        f"{ARCH} in bundle {root}: route {route!r}'s backward reads dO per token in dP and D (exact "
                        f"route, token-block dO); bundle a route whose dO is per-token {p['fmt']} (fp8_token) too")


def bwd_schedule_cached(cu: torch.Tensor, T: int, params: dict, fp8: bool, hkv: int = 1):
    """The backward's schedule (documents and windows, longest-first key-tile work list, per-token
    document bounds, dQ tile offsets: runtime.attn_bwd.bwd_schedule), cached (`_cached_work`).
    No windows for a square_32 dS kernel built without `bwd_sq32_windows` (`attn_bwd.bwd_windows`); a
    `bwd_head_section` variant's unit list carries the KV heads (`hkv`)."""
    from .attn_bwd import bwd_schedule, bwd_windows

    tile_m, tile_n, causal = params["tile_m"], params["tile_n"], params["causal"]
    align = kernel_key_align(fp8)
    win = bwd_windows(params)
    hsec = int(params.get("bwd_head_section", 0))
    hkv = hkv if hsec else 1
    return _cached_work(cu, ("bwd", T, tile_m, tile_n, causal, align, win, hkv, hsec),
                        lambda: bwd_schedule(cu, tile_m, tile_n, causal, key_align=align, T=T, windows=win,
                                             hkv=hkv, head_section=hsec))
