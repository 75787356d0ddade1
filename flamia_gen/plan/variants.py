"""Spec × tunables → concrete variants. Every point is checked analytically
(`feasibility`) before anything compiles; pruned points keep their reason."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field, replace

from .. import __version__
from ..spec import Arch, Format, Granularity, KernelFamily, KernelKind, Operand, Route, SpecSet
from ..spec.route import operand_quant
from .feasibility import check_attn, check_attn_bwd, check_quant
from .naming import procedural_name


@dataclass(frozen=True)
class Variant:
    """One concrete kernel: everything a template needs, as validated plain values."""

    name: str
    family: str
    arch: Arch
    kind: KernelKind
    template: str
    route: str
    spec_hash: str
    params: tuple  # sorted (key, value) pairs: enums as their string value, ints, bools
    uses: tuple = ()  # "route.operand" pairs served by this variant

    @property
    def context(self) -> dict:
        ctx = dict(self.params)
        ctx.update(name=self.name, arch=self.arch.value, cute_arch=self.arch.cute_arch,
                   kind=self.kind.value, route=self.route, spec_hash=self.spec_hash,
                   flamia_version=__version__, uses=list(self.uses))
        return ctx

    def param(self, key: str):
        return dict(self.params)[key]


@dataclass(frozen=True)
class Pruned:
    name: str
    family: str
    reason: str


@dataclass
class Plan:
    variants: list[Variant] = field(default_factory=list)
    pruned: list[Pruned] = field(default_factory=list)

    def by_name(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"no variant named {name!r}")


def _quant_points(fam: KernelFamily, route: Route):
    t = fam.tunables
    for op in fam.operands:
        oq = operand_quant(route, op)
        if not oq.quantized:
            if op is Operand.do and oq.format is Format.bf16:
                # nothing to quantize, but the backward's dO launch remains: D = rowsum(dO∘O) and the
                # zeroed dQ accumulator (templates/common/do_delta_body.py.j2)
                for d, tpc, hpc in itertools.product(fam.head_dims, t.tokens_per_cta, t.heads_per_cta):
                    yield op, oq, dict(quant=oq.short_str(), fmt=oq.format.value, granularity=oq.granularity.value,
                                       exponent_rule=oq.exponent_rule.value, hadamard=False, head_dim=d,
                                       tokens_per_cta=tpc, heads_per_cta=hpc, write_transposed=False,
                                       with_delta=True, sm_count=fam.sm_count)
            continue  # nothing to quantize (bf16 operand)
        for d, tpc, hpc in itertools.product(fam.head_dims, t.tokens_per_cta, t.heads_per_cta):
            params = dict(
                quant=oq.short_str(),
                fmt=oq.format.value,
                granularity=oq.granularity.value,
                exponent_rule=oq.exponent_rule.value,
                hadamard=oq.hadamard,
                head_dim=d,
                tokens_per_cta=tpc,
                heads_per_cta=hpc,
                write_transposed=oq.format is not Format.e2m1,
                with_delta=False,
                sm_count=fam.sm_count,
            )
            yield op, oq, params
            if op is Operand.do:
                # the dO launch: also D = rowsum(dÔ∘O) and the zeroed dQ accumulator
                yield op, oq, dict(params, with_delta=True)


def _delta_supported(oq) -> tuple[bool, str]:
    """The dO launch computes D from the dequantized dO in the original basis (8-bit codes)."""
    if oq.format is Format.e2m1:
        return False, "with_delta needs an 8-bit dO format (E4M3/E5M2), not E2M1"
    if oq.hadamard:
        return False, "with_delta needs dO without a Hadamard rotation (D is taken in the original basis)"
    return True, ""


def _attn_points(fam: KernelFamily, route: Route):
    """Attention variants carry the route's operand representations as flat values."""
    t = fam.tunables
    ops = {op.value: oq for op, oq in route.operands.items()}
    base = {}
    for o, oq in ops.items():
        base[f"{o}_fmt"] = oq.format.value
        base[f"{o}_gran"] = oq.granularity.value
    base.update(p_static_exponent=ops["p"].static_exponent, diagonal=route.diagonal.value,
                k_fold=route.k_fold, causal_dq_scale=route.causal_dq_scale, exp_approx=route.exp_approx.value,
                sm_count=fam.sm_count)
    # route fields added later: only routes that set them carry the keys (the others' names, params and
    # renders are unchanged)
    if route.bf16_scores:
        base["scores_bf16"] = True
    if route.p_reference.value != "ceil":
        base["p_reference"] = route.p_reference.value
    for d, m, n, st, wg, preg, ovl, sch, causal, det in itertools.product(
            fam.head_dims, t.tile_m, t.tile_n, t.stages, t.compute_warpgroups, t.p_in_registers,
            t.intra_wg_overlap, t.scheduler, t.causal, t.deterministic):
        sg = route.forward_safeguards(causal)
        point = dict(base, head_dim=d, tile_m=m, tile_n=n, stages=st, compute_warpgroups=wg, p_in_registers=preg,
                     intra_wg_overlap=ovl, scheduler=sch.value, causal=causal,
                     diag_k=sg.per_key_k, diag_v=sg.per_key_v, rows_q=sg.rows_q)
        if det:  # only deterministic variants carry the key (names and hashes of the others unchanged)
            point["deterministic"] = True
        yield point


def _hash(obj) -> str:
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def expand_family(fam: KernelFamily, specs: SpecSet, routes: list[str] | None = None) -> Plan:
    """Quantizer variants are keyed by the operand's representation, not by route: the
    q of mxfp8 and the k of mxfp8_exact are one kernel. `uses` lists route.operand.

    dO gets a second variant per point, `with_delta=True` (`..._delta_d128_...`, tag
    `<repr>_delta`): the backward's dO launch, which also writes D = rowsum(dÔ∘O) and zeroes
    the fp32 dQ accumulator (docs/quantizer-contract.md). Its `uses` are the route.do pairs;
    the plain variant keeps them too (same codes, scales and codes_t, bit for bit)."""
    plan = Plan()
    uses: dict[str, list[str]] = {}
    found: dict[str, Variant] = {}
    pruned: set[str] = set()
    check_attn_kind = check_attn_bwd if fam.kind is KernelKind.attn_bwd else check_attn
    for rname in fam.routes:
        if routes and rname not in routes:
            continue
        route = specs.route(rname)
        if fam.kind is not KernelKind.quant:
            elem_bytes = 2 if route.operands.v.format is Format.bf16 else 1  # V, P (and dO): the 8-bit side
            spec_hash = route.spec_hash()
            for params in _attn_points(fam, route):
                name = procedural_name(fam.kind, fam.arch, route.name, params)
                if not params["causal"]:
                    name += "_noncausal"
                ok, reason = check_attn_kind(fam.arch, elem_bytes, params)
                if not ok:
                    plan.pruned.append(Pruned(name, fam.name, reason))
                    continue
                found[name] = Variant(name=name, family=fam.name, arch=fam.arch, kind=fam.kind,
                                      template=fam.template, route=route.name, spec_hash=spec_hash,
                                      params=tuple(sorted(params.items())))
                uses.setdefault(name, []).append(route.name)
            continue
        for op, oq, params in _quant_points(fam, route):
            name = procedural_name(fam.kind, fam.arch, params["quant"], params)
            uses.setdefault(name, []).append(f"{route.name}.{op.value}")
            if name in found or name in pruned:
                continue
            ok, reason = check_quant(fam.arch, oq, params)
            if ok and params["with_delta"]:
                ok, reason = _delta_supported(oq)
            if not ok:
                pruned.add(name)
                plan.pruned.append(Pruned(name, fam.name, reason))
                continue
            tag, rep = params["quant"], oq.model_dump(mode="json")
            if params["with_delta"]:
                # its own representation tag (and tuning group): it takes o and writes delta, dq_accum
                tag, rep = tag + "_delta", dict(rep, with_delta=True)
            found[name] = Variant(
                name=name, family=fam.name, arch=fam.arch, kind=fam.kind, template=fam.template,
                route=tag, spec_hash=_hash(rep), params=tuple(sorted(params.items())))
    plan.variants = [replace(v, uses=tuple(sorted(uses[name]))) for name, v in found.items()]
    return plan


def _token_copy_reps(specs: SpecSet, routes: list[str]) -> set[tuple[str, str]]:
    """(format, exponent rule) of every operand whose per-token copy a route's kernels read: K, V on the causal
    forward's diagonal tiles (Route.forward_safeguards), Q and dO rows of an exact token-block route."""
    reps = set()
    for r in routes:
        route = specs.route(r)
        ops, sg = route.operands, route.forward_safeguards(True)
        tb = Granularity.token_block
        for oq, need in ((ops.k, sg.per_key_k), (ops.v, sg.per_key_v), (ops.q, sg.rows_q),
                         (ops.do, route.exact and ops.do.granularity is tb)):
            if need:
                reps.add((oq.format.value, oq.exponent_rule.value))
    return reps


def make_plan(specs: SpecSet, *, arch: Arch | str | None = None, routes: list[str] | None = None,
              kinds: list[KernelKind] | None = None) -> Plan:
    """All variants of all families (optionally filtered), names unique."""
    if routes:
        for r in routes:
            specs.route(r)  # unknown route → SpecError naming the allowed ones
    arch = Arch(arch) if arch else None
    plan = Plan()
    for fam in specs.families.values():
        if arch and fam.arch is not arch:
            continue
        if kinds and fam.kind not in kinds:
            continue
        sub = expand_family(fam, specs, routes)
        plan.variants += sub.variants
        plan.pruned += sub.pruned
        if routes and fam.kind is KernelKind.quant:
            # the per-token copies the routes' kernels read (diagonal tiles, exact rows) are other routes'
            # quantizers: a plan (bundle) of these routes must hold them too
            have = {v.name for v in sub.variants}
            reps = _token_copy_reps(specs, routes)
            plan.variants += [v for v in expand_family(fam, specs).variants if v.name not in have and
                              (v.param("fmt"), v.param("exponent_rule")) in reps and v.param("granularity") == "token"
                              and not v.param("hadamard")]
    seen: set[str] = set()
    for v in plan.variants:
        if v.name in seen:
            raise ValueError(f"two variants are named {v.name!r}: the procedural name must spell every "
                             "parameter that differs")
        seen.add(v.name)
    plan.variants.sort(key=lambda v: v.name)
    plan.pruned.sort(key=lambda p: p.name)
    return plan


__all__ = ["Variant", "Pruned", "Plan", "expand_family", "make_plan"]
