"""Packed-document workloads (DESIGN §4, §6) addressed by name.

A workload is a list of document lengths packed end to end into one row of
``T = sum(doc_lens)`` tokens, plus the head count and head dim. Every peer and
every one of our routes sees the same packed ``(T, H, D)`` tensors, so the
numbers are comparable.

Names:
  paper set    eq4x4096, eq8x8192, eq1x16384, eq1x65536, skew8192+224x256,
               tiny131072x1, long131072
  patterns     eq<N>x<L>          N equal documents of length L
               skew<B>+<N>x<L>    one document of B, then N of L
               tiny<N>x<L>        alias of eq<N>x<L> (many tiny documents)
               long<T>            one document of T tokens
               lognormal:<T>:<seed>  lognormal lengths filling T exactly
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: listing workloads needs no torch
    import torch

# DESIGN §6: the paper's workloads, in the order they are reported.
PAPER_WORKLOADS: tuple[str, ...] = (
    "eq4x4096",
    "eq8x8192",
    "eq1x16384",
    "eq1x65536",
    "skew8192+224x256",
    "tiny131072x1",
    "long131072",
)
# What `flamia-gen bench` runs when no --workloads is given: the paper set
# minus the two whose peers mostly skip (still selectable by name).
DEFAULT_WORKLOADS: tuple[str, ...] = (
    "eq4x4096",
    "eq8x8192",
    "eq1x16384",
    "eq1x65536",
    "skew8192+224x256",
)
PATTERNS: tuple[str, ...] = (
    "eq<N>x<L>",
    "skew<B>+<N>x<L>",
    "tiny<N>x<L>",
    "long<T>",
    "lognormal:<T>:<seed>",
)

# Lognormal mix: median document of 1024 tokens, sigma 1.0 (a heavy tail of
# long documents, like real pre-training packs). Fixed so a seed names a mix.
LOGNORMAL_MEDIAN = 1024
LOGNORMAL_SIGMA = 1.0

# Refuse absurd sizes early (a typo like eq4x40960000 should not allocate).
MAX_TOTAL_TOKENS = 1 << 24


@dataclass
class Workload:
    """Documents packed into one row; attention never crosses a document."""

    name: str
    doc_lens: list[int]
    heads: int = 16
    head_dim: int = 128
    causal: bool = True

    # Derived numbers are cheap; keep them as properties so a caller that
    # edits doc_lens (tests do) never sees stale values.
    @property
    def total_tokens(self) -> int:
        return sum(self.doc_lens)

    @property
    def max_seqlen(self) -> int:
        return max(self.doc_lens)

    @property
    def num_docs(self) -> int:
        return len(self.doc_lens)

    @property
    def equal_docs(self) -> bool:
        """True when every document has the same length (batched peers need it)."""
        return len(set(self.doc_lens)) == 1

    def cu_seqlens(self, device: Any = "cpu") -> "torch.Tensor":
        """int32 prefix sums of doc_lens, shape (num_docs + 1,), starting at 0."""
        import torch

        out = torch.zeros(self.num_docs + 1, dtype=torch.int32)
        out[1:] = torch.cumsum(torch.tensor(self.doc_lens, dtype=torch.int64), 0).to(torch.int32)
        return out.to(device)

    def doc_ids(self, device: Any = "cpu") -> "torch.Tensor":
        """Document index of every token, shape (T,), int32 (used by block masks)."""
        import torch

        lens = torch.tensor(self.doc_lens, dtype=torch.int64)
        ids = torch.repeat_interleave(torch.arange(self.num_docs, dtype=torch.int32), lens)
        return ids.to(device)

    def describe(self) -> str:
        if self.equal_docs:
            return f"{self.num_docs}x{self.doc_lens[0]} (T={self.total_tokens})"
        return f"{self.num_docs} docs, max {self.max_seqlen} (T={self.total_tokens})"

    def to_dict(self) -> dict[str, Any]:
        # doc_lens can be 131072 entries long: JSON gets a summary instead.
        return {
            "name": self.name,
            "num_docs": self.num_docs,
            "total_tokens": self.total_tokens,
            "max_seqlen": self.max_seqlen,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "causal": self.causal,
        }


def lognormal_lengths(total: int, seed: int, median: int = LOGNORMAL_MEDIAN,
                      sigma: float = LOGNORMAL_SIGMA) -> list[int]:
    """Draw lognormal document lengths until they fill ``total`` exactly.

    ``random.Random`` (not numpy/torch) so a (total, seed) pair gives the same
    mix on every machine and library version. The last document is cut to the
    space left, so the sum is exact.
    """
    if total < 1:
        raise ValueError(f"lognormal total must be >= 1, got {total}")
    rng = random.Random(seed)
    mu = math.log(median)
    lens: list[int] = []
    left = total
    while left > 0:
        n = max(1, int(round(rng.lognormvariate(mu, sigma))))
        n = min(n, left)
        lens.append(n)
        left -= n
    return lens


_EQ = re.compile(r"^(?:eq|tiny)(\d+)x(\d+)$")
_SKEW = re.compile(r"^skew(\d+)\+(\d+)x(\d+)$")
_LONG = re.compile(r"^long(\d+)$")
_LOGN = re.compile(r"^lognormal:(\d+):(\d+)$")


def _lens_for(name: str) -> list[int] | None:
    if m := _EQ.match(name):
        n, length = int(m.group(1)), int(m.group(2))
        return [length] * n if n > 0 and length > 0 else None
    if m := _SKEW.match(name):
        big, n, length = (int(g) for g in m.groups())
        return [big] + [length] * n if big > 0 and n > 0 and length > 0 else None
    if m := _LONG.match(name):
        t = int(m.group(1))
        return [t] if t > 0 else None
    if m := _LOGN.match(name):
        t, seed = int(m.group(1)), int(m.group(2))
        return lognormal_lengths(t, seed) if t > 0 else None
    return None


def known_workloads_text() -> str:
    return "known: " + ", ".join(PAPER_WORKLOADS) + "; patterns: " + ", ".join(PATTERNS)


def get_workload(name: str, heads: int = 16, head_dim: int = 128, causal: bool = True) -> Workload:
    """The workload called ``name``; ValueError naming it and the known ones if unknown."""
    key = name.strip()
    lens = _lens_for(key)
    if lens is None:
        raise ValueError(f"unknown workload {key!r} ({known_workloads_text()})")
    if sum(lens) > MAX_TOTAL_TOKENS:
        raise ValueError(f"workload {key!r} has {sum(lens)} tokens, more than the "
                         f"{MAX_TOTAL_TOKENS} this harness allows")
    return Workload(name=key, doc_lens=lens, heads=heads, head_dim=head_dim, causal=causal)


def parse_workloads(spec: str | list[str] | tuple[str, ...], heads: int = 16,
                    head_dim: int = 128) -> list[Workload]:
    """``"a,b,c"`` (or a list of names) to workloads; ``paper``/``default`` expand."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[Workload] = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name == "paper":
            out += [get_workload(n, heads, head_dim) for n in PAPER_WORKLOADS]
        elif name == "default":
            out += [get_workload(n, heads, head_dim) for n in DEFAULT_WORKLOADS]
        else:
            out.append(get_workload(name, heads, head_dim))
    if not out:
        raise ValueError(f"no workload given ({known_workloads_text()})")
    return out


# --------------------------------------------------------------------------- inputs

# H200 L2 is 60 MB (KINDS.md, measured); rotate through enough input sets that
# together they are several times that, so no call finds its inputs in L2.
L2_BYTES = 60 * 1024 * 1024
MIN_ROTATIONS = 2
MAX_ROTATIONS = 8


def default_rotations(workload: Workload, element_size: int = 2, l2_bytes: int = L2_BYTES) -> int:
    """Number of (q, k, v) sets so the sets together are >= 3x the L2."""
    set_bytes = 3 * workload.total_tokens * workload.heads * workload.head_dim * element_size
    need = math.ceil(3 * l2_bytes / max(set_bytes, 1))
    return max(MIN_ROTATIONS, min(MAX_ROTATIONS, need))


@dataclass
class InputSet:
    """One (q, k, v) triple plus the token rows that were made outliers."""

    q: "torch.Tensor"
    k: "torch.Tensor"
    v: "torch.Tensor"
    outlier_tokens: list[int] = field(default_factory=list)

    def __iter__(self):  # unpacks like a (q, k, v) tuple
        return iter((self.q, self.k, self.v))

    def __getitem__(self, i: int) -> "torch.Tensor":
        return (self.q, self.k, self.v)[i]

    def __len__(self) -> int:
        return 3


def make_inputs(workload: Workload, dtype: Any = None, device: Any = "cuda", seed: int = 0,
                n_rotations: int | None = None, outliers: bool = False,
                n_outliers: int = 4, outlier_scale: float = 100.0) -> list[InputSet]:
    """Random N(0,1) ``(T, H, D)`` q, k, v sets, several so L2 cannot hold them (DESIGN §5).

    With ``outliers=True`` a few random tokens (the same rows in q, k and v)
    are multiplied by ``outlier_scale``: the case that breaks per-tensor scales.
    Each set is a tuple-like ``InputSet``: ``q, k, v = inputs[i]`` works.
    """
    import torch

    dtype = dtype or torch.bfloat16
    n = n_rotations if n_rotations is not None else default_rotations(
        workload, torch.tensor([], dtype=dtype).element_size())
    if n < 1:
        raise ValueError(f"n_rotations must be >= 1, got {n}")
    shape = (workload.total_tokens, workload.heads, workload.head_dim)
    # Generate on the target device: a 131072-token set is 1.6 GB of bf16.
    gen = torch.Generator(device=device).manual_seed(seed)
    sets: list[InputSet] = []
    for _ in range(n):
        q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
                   for _ in range(3))
        rows: list[int] = []
        if outliers:
            count = min(n_outliers, workload.total_tokens)
            pick = torch.randperm(workload.total_tokens, generator=gen, device=device)[:count]
            rows = sorted(int(i) for i in pick.tolist())
            for t in (q, k, v):
                t[pick] *= outlier_scale
        sets.append(InputSet(q.to(dtype), k.to(dtype), v.to(dtype), rows))
        del q, k, v
    return sets
