"""The search space: which studies exist and what each may try.

One optuna study per (arch, GPU, kind, route, head dim [, causal], workload bucket). Its
candidates are the *feasible* variants of the group, from the plan after analytic
pruning (`flamia_gen.plan.feasibility`): a pruned point is never offered. Candidates are
in spec order (`flamia_gen.dispatch.defaults`), the analytic default first, so a budget
smaller than the group measures the same first variants whoever runs it.

Workloads are packed rows written as document lengths: `4x4096` (four documents of
4096), `8192+224x256` (one of 8192 then 224 of 256), `131072x1`, `4096` (one document).
`paper` is the DESIGN.md §6 set. Each workload maps to one bucket per kind; the first
workload (in the order given) that lands in a bucket is the one that bucket is timed on.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

from ..dispatch.buckets import DocProfile, bucket_label, bucket_of
from ..dispatch.defaults import Group, plan_groups
from ..dispatch.table import gpu_slug

PAPER_WORKLOADS = "4x4096,8x8192,1x16384,1x65536,8192+224x256,1x131072,131072x1"
PRESETS = {"paper": PAPER_WORKLOADS, "small": "4x1024,64x64"}
DEFAULT_HEADS = 16
MAX_DOC_LEN = 1 << 20
MAX_TOKENS = 1 << 21
_TERM = re.compile(r"^(?:(\d+)x)?(\d+)$")


@dataclass(frozen=True)
class Workload:
    label: str
    doc_lens: tuple[int, ...]
    heads: int = DEFAULT_HEADS

    @property
    def profile(self) -> DocProfile:
        return DocProfile.from_lengths(self.doc_lens)

    @property
    def tokens(self) -> int:
        return sum(self.doc_lens)

    def cu_seqlens(self) -> list[int]:
        cu = [0]
        for n in self.doc_lens:
            cu.append(cu[-1] + n)
        return cu


def parse_workload(text: str, heads: int = DEFAULT_HEADS) -> Workload:
    label = text.strip().replace(" ", "")
    if not label:
        raise ValueError("empty workload")
    lens: list[int] = []
    for term in label.split("+"):
        m = _TERM.match(term)
        if not m:
            raise ValueError(f"workload {text!r}: {term!r} is not N or COUNTxLEN (e.g. 4x4096, 8192+224x256)")
        count, n = int(m.group(1) or 1), int(m.group(2))
        if count < 1 or not 1 <= n <= MAX_DOC_LEN:
            raise ValueError(f"workload {text!r}: documents need 1 ≤ length ≤ {MAX_DOC_LEN} and a count ≥ 1")
        lens += [n] * count
        if sum(lens) > MAX_TOKENS:
            raise ValueError(f"workload {text!r}: more than {MAX_TOKENS} tokens in one row")
    if heads < 1:
        raise ValueError(f"heads={heads} must be ≥ 1")
    return Workload(label, tuple(lens), heads)


def parse_workloads(text: str | None, heads: int = DEFAULT_HEADS) -> list[Workload]:
    """Comma-separated workloads and/or preset names (`paper`, `small`)."""
    items = []
    for part in (text or "paper").split(","):
        part = part.strip()
        if not part:
            continue
        items += PRESETS[part].split(",") if part in PRESETS else [part]
    out, seen = [], set()
    for it in items:
        w = parse_workload(it, heads)
        if w.label not in seen:
            seen.add(w.label)
            out.append(w)
    if not out:
        raise ValueError("no workload given")
    return out


@dataclass(frozen=True)
class StudySpec:
    """Everything a worker needs to run one study (plain values: it travels as JSON)."""

    name: str
    arch: str
    gpu: str
    group: Group
    bucket: dict
    workload: Workload
    budget: int  # measured trials wanted (≤ number of candidates)
    extra: dict = field(default_factory=dict)

    @property
    def candidates(self) -> tuple[str, ...]:
        return self.group.candidates

    @property
    def key(self) -> str:
        """The table entry this study produces."""
        return f"{self.group.key}/{bucket_label(self.bucket)}"

    def attrs(self) -> dict:
        """Stored in the study's user attributes: freeze reads them, never the name. `retime` (extra): the candidates
        are the winners of a table's untrusted entries, a subset of the group's (`tune.retime`)."""
        return {"flamia_gen_study": 1, "arch": self.arch, "gpu": self.gpu, "group": self.group.key,
                "kind": self.group.kind, "route": self.group.route, "head_dim": self.group.head_dim,
                "causal": self.group.causal, "bucket": self.bucket, "workload": self.workload.label,
                "heads": self.workload.heads, "candidates": list(self.candidates),
                **({"retime": True} if self.extra.get("retime") else {})}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["group"]["candidates"] = list(self.group.candidates)
        d["workload"]["doc_lens"] = list(self.workload.doc_lens)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "StudySpec":
        g = dict(d["group"])
        g["candidates"] = tuple(g["candidates"])
        w = dict(d["workload"])
        w["doc_lens"] = tuple(w["doc_lens"])
        return cls(d["name"], d["arch"], d["gpu"], Group(**g), dict(d["bucket"]), Workload(**w), int(d["budget"]),
                   dict(d.get("extra") or {}))


def space_hash(group: Group, workload: Workload) -> str:
    blob = json.dumps([list(group.candidates), workload.label, workload.heads]).encode()
    return hashlib.sha256(blob).hexdigest()[:8]


def study_name(arch: str, gpu: str, group: Group, bucket: dict, workload: Workload) -> str:
    """`flamia-gen/sm90/h200/quant/e4m3_tb32_ceil/d128/tokens=65536/<space hash>`. The hash
    covers the candidates and the workload, so a changed space starts a new study instead
    of mixing trials of two spaces."""
    return f"flamia-gen/{arch}/{gpu_slug(gpu)}/{group.key}/{bucket_label(bucket)}/{space_hash(group, workload)}"


def select_groups(plan, specs, *, kinds=None, routes=None, head_dims=None) -> list[Group]:
    """Groups of the plan, filtered. `routes` takes route names (`mxfp8`: every quantizer
    representation it uses) or representation tags (`e4m3_tb32_ceil`)."""
    groups = list(plan_groups(plan, specs).values())
    if kinds:
        kinds = {str(getattr(k, "value", k)) for k in kinds}
        groups = [g for g in groups if g.kind in kinds]
    if head_dims:
        groups = [g for g in groups if g.head_dim in set(head_dims)]
    if routes:
        by_name = {v.name: v for v in plan.variants}

        def serves(g: Group, r: str) -> bool:
            if g.route == r:
                return True
            return any(u.split(".")[0] == r for n in g.candidates for u in by_name[n].uses)

        unknown = [r for r in routes if not any(serves(g, r) for g in groups)]
        if unknown:
            tags = sorted({g.route for g in groups})
            raise ValueError(f"route(s) {unknown} match no variant of this selection; allowed: route names "
                             f"{sorted(specs.routes)} or tags {tags}")
        groups = [g for g in groups if any(serves(g, r) for r in routes)]
    return groups


def make_study_specs(groups: list[Group], workloads: list[Workload], *, gpu: str,
                     trials: int | None = None) -> list[StudySpec]:
    """One study per (group, bucket); `trials` is the per-study budget (default: every
    candidate)."""
    out = []
    for g in groups:
        seen = set()
        for w in workloads:
            b = bucket_of(g.kind, w.profile)
            label = bucket_label(b)
            if label in seen:
                continue
            seen.add(label)
            budget = len(g.candidates) if trials is None else max(1, min(int(trials), len(g.candidates)))
            out.append(StudySpec(study_name(g.arch, gpu, g, b, w), g.arch, gpu, g, b, w, budget))
    return out


__all__ = ["PAPER_WORKLOADS", "PRESETS", "DEFAULT_HEADS", "Workload", "parse_workload", "parse_workloads", "StudySpec",
           "space_hash", "study_name", "select_groups", "make_study_specs"]
