"""Workload buckets: how one table serves any packed row.

A table entry is keyed by a *group* (kind, route, head dim and, for attention, causal:
these must match exactly) and a *bucket* over the lengths of the row. Each kernel kind
declares which length fields it is bucketed by (`BUCKET_FIELDS`):

| kind | fields | meaning |
| --- | --- | --- |
| `quant` | `tokens` | T, the total tokens of the packed row (documents do not matter to a quantizer) |
| `attn_fwd`, `attn_bwd` | `max_len`, `doc_len` | the longest document, and the mean tokens per (non-empty) document |

Every field is a power of two from 1 to 131072 (`LENGTHS`), mapped as follows:

- `tokens` and `max_len` map **up** (ceil): T = 3000 → 4096. The winner of a bucket was timed
  on a row at least as long as anything mapped into it.
- `doc_len` maps **down** (floor): a mean of 291 tokens per document → 256. A row of many
  short documents is never treated as one of longer documents.
- Values below 1 map to 1; values above 131072 map to 131072 (the largest bucket).

Pure Python, no torch, no optuna: the runtime imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

MIN_LEN = 1
MAX_LEN = 131072
LENGTHS: tuple[int, ...] = tuple(1 << i for i in range(18))  # 1 … 131072

BUCKET_FIELDS: dict[str, tuple[str, ...]] = {
    "quant": ("tokens",),
    "attn_fwd": ("max_len", "doc_len"),
    "attn_bwd": ("max_len", "doc_len"),
}
ROUNDING = {"tokens": "ceil", "max_len": "ceil", "doc_len": "floor"}
FIELD_ORDER = ("tokens", "max_len", "doc_len")  # labels list fields in this order, whatever the dict order


def ceil_pow2(x: float) -> int:
    """Smallest power of two ≥ x, clamped to [1, 131072]."""
    if x <= MIN_LEN:
        return MIN_LEN
    if x >= MAX_LEN:
        return MAX_LEN
    n = int(x)
    if n < x:
        n += 1
    return 1 << (n - 1).bit_length()


def floor_pow2(x: float) -> int:
    """Largest power of two ≤ x, clamped to [1, 131072]."""
    if x < 2:
        return MIN_LEN
    if x >= MAX_LEN:
        return MAX_LEN
    return 1 << (int(x).bit_length() - 1)


@dataclass(frozen=True)
class DocProfile:
    """The lengths that matter for dispatch, from a packed row's document lengths."""

    tokens: int  # T
    num_docs: int  # non-empty documents
    max_len: int

    @property
    def mean_doc_len(self) -> float:
        return self.tokens / self.num_docs if self.num_docs else 0.0

    @classmethod
    def from_lengths(cls, lengths: Iterable[int]) -> "DocProfile":
        lens = [int(n) for n in lengths]
        if any(n < 0 for n in lens):
            raise ValueError(f"document lengths must be ≥ 0, got {min(lens)}")
        nz = [n for n in lens if n > 0]
        return cls(tokens=sum(lens), num_docs=len(nz), max_len=max(nz, default=0))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens) -> "DocProfile":
        """`cu_seqlens`: a list or a 1-D tensor (a device tensor is read back: a host sync,
        so precompute the profile outside captured regions)."""
        cu = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
        if len(cu) < 2:
            raise ValueError(f"cu_seqlens needs at least 2 entries, got {len(cu)}")
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        if any(n < 0 for n in lens):
            raise ValueError("cu_seqlens must be non-decreasing")
        return cls.from_lengths(lens)


def bucket_of(kind: str, profile: DocProfile) -> dict[str, int]:
    """The bucket (field → power of two) of a row for a kernel kind."""
    fields = fields_of(kind)
    raw = {"tokens": profile.tokens, "max_len": profile.max_len, "doc_len": profile.mean_doc_len}
    out = {}
    for f in fields:
        out[f] = ceil_pow2(raw[f]) if ROUNDING[f] == "ceil" else floor_pow2(raw[f])
    return out


def fields_of(kind: str) -> tuple[str, ...]:
    try:
        return BUCKET_FIELDS[str(getattr(kind, "value", kind))]
    except KeyError:
        raise ValueError(f"unknown kernel kind {kind!r}; allowed values: {sorted(BUCKET_FIELDS)}") from None


def bucket_label(bucket: dict[str, int]) -> str:
    """`tokens=65536` / `max_len=8192,doc_len=256` (fields in `FIELD_ORDER`)."""
    unknown = [k for k in bucket if k not in FIELD_ORDER]
    if unknown:
        raise ValueError(f"unknown bucket field(s) {unknown}; allowed values: {list(FIELD_ORDER)}")
    return ",".join(f"{k}={bucket[k]}" for k in FIELD_ORDER if k in bucket)


def parse_bucket_label(label: str) -> dict[str, int]:
    out = {}
    for part in label.split(","):
        k, _, v = part.partition("=")
        if k not in ROUNDING or not v.isdigit() or int(v) not in LENGTHS:
            raise ValueError(f"bad bucket {label!r}: expected field=power-of-two with fields "
                             f"{sorted(ROUNDING)}")
        out[k] = int(v)
    return out


def bucket_distance(a: dict[str, int], b: dict[str, int]) -> float:
    """Distance in log2 space, summed over fields (both buckets of one kind)."""
    return float(sum(abs(a[f].bit_length() - b[f].bit_length()) for f in a))


def nearest_bucket(want: dict[str, int], have: Sequence[dict[str, int]]) -> dict[str, int] | None:
    """The tuned bucket closest to `want` (log2 distance); ties go to the larger bucket
    (its winner was timed on at least as much work)."""
    if not have:
        return None
    return min(have, key=lambda b: (bucket_distance(want, b), tuple(-b[f] for f in want)))


__all__ = ["LENGTHS", "MIN_LEN", "MAX_LEN", "BUCKET_FIELDS", "ROUNDING", "FIELD_ORDER", "ceil_pow2", "floor_pow2",
           "DocProfile",
           "bucket_of", "fields_of", "bucket_label", "parse_bucket_label", "bucket_distance", "nearest_bucket"]
