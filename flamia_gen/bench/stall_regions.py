"""Where a kernel's warps wait, by stretch of SASS: the stall samples of an Nsight Compute source page summed between
anchor instructions (wgmma, barriers, branches, MUFU.EX2, TMA), so that each line of the output is one stretch of the
tile's code (a GEMM issue, a softmax pass, the code after a barrier).

    ncu --section SourceCounters ... -o rep python3 -m flamia_gen.bench.one_call --variant ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python -m flamia_gen.bench.stall_regions rep.csv [--min-executed 1000000] [--min-share 0.4]

Columns: offset of the stretch's first instruction from the kernel's first, instructions in it, warp instructions
executed, share of all warp samples, the first instruction, the three largest stall reasons (percent of all samples).
Stretches below both thresholds are left out. Needs no GPU and no torch (docs/perf-notes.md rounds 12–13 used it).
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from dataclasses import dataclass, field

ANCHOR = re.compile(r"QGMMA|HGMMA|WARPGROUP|BAR\.|SYNCS|MUFU\.EX2|BRA|UTMALDG|EXIT|WARPSYNC")


@dataclass
class Region:
    start: int
    first: str
    key: str | None
    n: int = 0
    samples: int = 0
    executed: int = 0
    stalls: dict = field(default_factory=dict)


def read_source_csv(text: str) -> list[dict]:
    """Rows of `ncu --page source --csv --print-source sass`: address, source, samples, executed, stall columns."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    except StopIteration:
        raise ValueError("not an ncu source-page CSV (no \"Address\" header row)") from None
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    hdr = {name: i for i, name in enumerate(rows[0])}
    for need in ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"):
        if need not in hdr:
            raise ValueError(f"source-page CSV lacks the column {need!r}")
    stall_cols = [h for h in hdr if h.startswith("stall_") and "(Not" not in h]

    def num(x: str) -> int:
        try:
            return int(float(x.replace(",", "")))
        except ValueError:
            return 0

    out = []
    for r in rows[1:]:
        if len(r) < len(hdr):
            continue
        out.append(dict(addr=int(r[hdr["Address"]], 16), src=r[hdr["Source"]].strip(),
                        samples=num(r[hdr["Warp Stall Sampling (All Samples)"]]),
                        executed=num(r[hdr["Instructions Executed"]]),
                        stalls={h: num(r[hdr[h]]) for h in stall_cols}))
    return out


def _opcode(src: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", src).split()[0] if src else ""


def regions(rows: list[dict]) -> list[Region]:
    """Consecutive instructions grouped: a run of anchors of one opcode (e.g. the QGMMAs of one GEMM, the MUFU.EX2s of
    a pass) is one region, every barrier, wgmma wait and branch starts its own, and the plain instructions between
    anchors form one region."""
    out: list[Region] = []
    cur: Region | None = None
    for r in rows:
        is_anchor = bool(ANCHOR.search(r["src"]))
        key = _opcode(r["src"]) if is_anchor else None
        new = (cur is None or (is_anchor and (cur.key != key or "BAR" in key or "BRA" in key))
               or (not is_anchor and cur.key is not None))
        if new:
            cur = Region(start=r["addr"], first=r["src"], key=key)
            out.append(cur)
        cur.n += 1
        cur.samples += r["samples"]
        cur.executed += r["executed"]
        for k, v in r["stalls"].items():
            cur.stalls[k] = cur.stalls.get(k, 0) + v
    return out


def report(rows: list[dict], *, min_executed: int = 0, min_share: float = 0.4) -> str:
    total = sum(r["samples"] for r in rows) or 1
    base = rows[0]["addr"] if rows else 0
    lines = [f"total samples {total}"]
    for g in regions(rows):
        share = 100.0 * g.samples / total
        if share < min_share and not (min_executed and g.executed >= min_executed):
            continue
        top = sorted(g.stalls.items(), key=lambda kv: -kv[1])[:3]
        why = " ".join(f"{k[6:]}={100.0 * v / total:.1f}" for k, v in top if v)
        lines.append(f"{g.start - base:6x} n={g.n:4d} ex={g.executed / 1e6:7.2f}M {share:5.1f}%  {g.first[:48]:48s} {why}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--min-executed", type=int, default=0, help="also list regions executed at least this often")
    ap.add_argument("--min-share", type=float, default=0.4, help="list regions with at least this %% of the samples")
    a = ap.parse_args(argv)
    with open(a.csv, encoding="utf-8", errors="replace") as f:
        print(report(read_source_csv(f.read()), min_executed=a.min_executed, min_share=a.min_share))
    return 0


if __name__ == "__main__":
    sys.exit(main())
