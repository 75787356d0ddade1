"""Results: rows, speed-ups, a rich table, a JSON file and a PNG chart.

Speed-up is over the fastest *peer* on the same workload (never over one of
our own routes, never over a row marked suspect), so ours > 1.0 means faster
than everything else we could have used.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import platform
import subprocess
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Sequence

SCHEMA = "flamia-gen-bench/1"
STATUSES = ("ok", "skipped", "not installed", "unavailable", "error")


@dataclass
class BenchRow:
    impl: str
    workload: str
    mode: str
    precision: str
    status: str = "ok"
    note: str = ""
    is_peer: bool = True
    median_ms: float | None = None
    min_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    repeats: int | None = None
    timer: str | None = None
    flops: int | None = None
    tflops: float | None = None
    peak_mib: float | None = None
    host_ms: float | None = None  # host time to issue one call (timing.host_issue_ms): near median_ms, host-bound
    speedup: float | None = None
    suspect: bool = False
    o_cos: float | None = None
    dq_cos: float | None = None
    memory_note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchRow":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def _is_baseline(r: BenchRow) -> bool:
    """A row a speed-up may be measured against: a peer's trusted measurement."""
    return r.status == "ok" and r.is_peer and not r.suspect and bool(r.median_ms)


def compute_speedups(rows: Sequence[BenchRow]) -> dict[str, float]:
    """Set ``row.speedup`` = fastest peer's median / row's median, per (workload, mode).

    Returns {workload: fastest peer ms} for the workloads that had one.
    """
    best: dict[tuple[str, str], float] = {}
    for r in rows:
        if _is_baseline(r):
            key = (r.workload, r.mode)
            best[key] = min(best.get(key, float("inf")), r.median_ms)
    for r in rows:
        ref = best.get((r.workload, r.mode))
        ok = ref and r.status == "ok" and r.median_ms and not r.suspect
        r.speedup = (ref / r.median_ms) if ok else None  # a suspect rate gets no ratio
    return {w: ms for (w, _m), ms in best.items()}


def fastest_peer(rows: Sequence[BenchRow], workload: str, mode: str) -> BenchRow | None:
    cands = [r for r in rows if r.workload == workload and r.mode == mode and _is_baseline(r)]
    return min(cands, key=lambda r: r.median_ms) if cands else None


# ----------------------------------------------------------------- metadata

def _git_commit(where: Path | None = None) -> str | None:
    """HEAD's short hash, with "-dirty" when tracked files differ from it: a GPU host's copy of the
    tree can sit on an older commit with newer files laid over it, and the bare hash would name code
    that did not run."""
    cwd = where or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=cwd)
        head = out.stdout.strip()
        if not head:
            return None
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                            text=True, timeout=10, cwd=cwd)
        return head + ("-dirty" if st.returncode == 0 and st.stdout.strip() else "")
    except Exception:
        return None


def collect_metadata(adapters: Iterable[Any] = (), extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """GPU, library versions, date and what each implementation reported."""
    import torch

    import flamia_gen

    meta: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "flamia_gen": getattr(flamia_gen, "__version__", "unknown"),
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": None,
        "compute_capability": None,
    }
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
        meta["compute_capability"] = "sm%d%d" % torch.cuda.get_device_capability()
        meta["gpu_count"] = torch.cuda.device_count()
        try:
            meta["cudnn"] = torch.backends.cudnn.version()
        except Exception:
            pass
    impls: dict[str, Any] = {}
    for a in adapters:
        try:
            ok, reason = a.available()
        except Exception as exc:  # an adapter must not break the report
            ok, reason = False, f"available() raised {type(exc).__name__}: {exc}"
        try:
            versions = a.versions() if ok or not reason.startswith("not installed") else {}
        except Exception:
            versions = {}
        impls[a.name] = {"available": ok, "reason": reason, "precision": a.precision,
                         "is_peer": getattr(a, "is_peer", True), "versions": versions,
                         "memory_note": getattr(a, "memory_note", "")}
    meta["impls"] = impls
    meta["peer_versions"] = {n: v["versions"] for n, v in impls.items()
                             if v["is_peer"] and v["versions"]}
    if extra:
        meta.update(extra)
    return meta


# ----------------------------------------------------------------- JSON

def write_json(path: str | Path, rows: Sequence[BenchRow], metadata: dict[str, Any],
               accuracy: Sequence[Any] = ()) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": SCHEMA,
        "metadata": metadata,
        "rows": [r.to_dict() for r in rows],
        "accuracy": [a.to_dict() if hasattr(a, "to_dict") else dict(a) for a in accuracy],
    }
    path.write_text(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    return path


def read_json(path: str | Path) -> dict[str, Any]:
    """The written document, with ``rows`` turned back into :class:`BenchRow`."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} file (schema={doc.get('schema')!r})")
    doc["rows"] = [BenchRow.from_dict(r) for r in doc.get("rows", [])]
    return doc


# ----------------------------------------------------------------- table

def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


UNTUNED = "untuned (not in the bundle)"  # a row of ours timed on another kernel than the dispatch table's choice


def _status_note(status: str, note: str) -> str:
    """A note's full text: the status first (once), then the reason."""
    if status == "ok":
        return note
    if note.startswith(status):
        note = note[len(status):].lstrip(": ")
    return f"{status}: {note}" if note else status


class _Footnotes:
    """Long notes go under the table, numbered once each, so the table stays
    narrow enough to read (the full text is also in the JSON)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def cell(self, status: str, note: str) -> str:
        from rich.markup import escape

        if status == "ok" and not note:
            return ""
        full = _status_note(status, note)
        if full not in self.texts:
            self.texts.append(full)
        n = self.texts.index(full) + 1
        label = status if status != "ok" else ("suspect" if note.startswith("suspect")
                                               else "untuned" if UNTUNED in note else "note")
        color = "red" if label in ("suspect", "untuned") else "yellow"
        return f"[{color}]{escape(label)}[/] {escape(f'[{n}]')}"

    def lines(self) -> list[str]:
        return [f"[{i}] {t}" for i, t in enumerate(self.texts, 1)]


def build_table(rows: Sequence[BenchRow], title: str | None = None):
    """(rich Table with one line per (workload, impl), footnote lines)."""
    from rich.table import Table

    with_cos = any(r.o_cos is not None or r.dq_cos is not None for r in rows)
    with_host = any(r.host_ms is not None for r in rows)
    t = Table(title=title, show_lines=False, header_style="bold")
    # Numbers never wrap or get cut ("26…" is no measurement).
    t.add_column("workload", style="cyan", no_wrap=True)
    t.add_column("impl", no_wrap=True)
    t.add_column("prec", no_wrap=True, min_width=4)
    nums = [("ms", 7)] + [("host ms", 7)] * with_host + [("TFLOP/s", 7), ("peak MiB", 8), ("vs peer", 7)]
    for c, w in nums:
        t.add_column(c, justify="right", no_wrap=True, min_width=w)
    if with_cos:
        t.add_column("O cos", justify="right", no_wrap=True, min_width=6)
        t.add_column("dQ cos", justify="right", no_wrap=True, min_width=6)
    t.add_column("notes", no_wrap=True, min_width=8)
    notes = _Footnotes()
    last_wl = None
    for r in rows:
        wl = r.workload if r.workload != last_wl else ""
        if r.workload != last_wl and last_wl is not None:
            t.add_section()
        last_wl = r.workload
        name = r.impl if r.is_peer else f"[bold green]{r.impl}[/]"
        if r.status == "ok":
            sp = "-" if r.speedup is None else f"{r.speedup:.2f}x"
            tf = _fmt(r.tflops, ".0f")
            if r.suspect:
                tf = f"[red]{tf}?[/]"
            cells = [wl, name, r.precision, _fmt(r.median_ms, ".3f")] + [_host_cell(r)] * with_host
            cells += [tf, _fmt(r.peak_mib, ".0f"), sp]
        else:
            cells = [wl, name, r.precision] + ["-"] * len(nums)
        if with_cos:
            cells += [_fmt(r.o_cos, ".4f"), _fmt(r.dq_cos, ".4f")]
        cells.append(notes.cell(r.status, r.note))
        t.add_row(*cells)
    return t, notes.lines()


HOST_BOUND = 0.9  # host ms ≥ this share of the event-timed ms: the row is host-bound (marked "*")


def host_bound(r: BenchRow) -> bool:
    """Whether issuing the call takes (nearly) as long as the call: the GPU waited for the host."""
    return r.host_ms is not None and r.median_ms is not None and r.host_ms >= HOST_BOUND * r.median_ms


def _host_cell(r: BenchRow) -> str:
    cell = _fmt(r.host_ms, ".3f")
    return f"[yellow]{cell}*[/]" if host_bound(r) else cell


def build_accuracy_table(results: Sequence[Any], title: str | None = None):
    from rich.table import Table

    t = Table(title=title, header_style="bold")
    for c in ("impl", "workload", "O cos", "dQ cos", "O rel err", "dQ rel err"):
        t.add_column(c, justify="right" if ("cos" in c or "err" in c) else "left", no_wrap=True)
    t.add_column("notes", no_wrap=True)
    notes = _Footnotes()
    for a in results:
        t.add_row(a.impl, a.workload, _fmt(a.o_cos, ".4f"), _fmt(a.dq_cos, ".4f"),
                  _fmt(a.o_rel, ".2e"), _fmt(a.dq_rel, ".2e"), notes.cell(a.status, a.note))
    return t, notes.lines()


def render_tables(rows: Sequence[BenchRow], accuracy: Sequence[Any] = (), console=None,
                  title: str | None = None) -> None:
    from rich.console import Console

    console = console or Console()
    table, notes = build_table(rows, title=title)
    console.print(table)
    if any(r.host_ms is not None for r in rows):
        console.print("host ms: host time to issue one call (calls issued back to back); * host-bound (≥ "
                      f"{HOST_BOUND:.0%} of ms): the GPU waited for the launches", markup=False, highlight=False,
                      soft_wrap=True)
    for line in notes:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if accuracy:
        ref = next((a.reference for a in accuracy if getattr(a, "reference", "")), "")
        table, notes = build_accuracy_table(
            accuracy, title=f"accuracy vs {ref}" if ref else "accuracy")
        console.print(table)
        for line in notes:
            console.print(line, markup=False, highlight=False, soft_wrap=True)


def table_text(rows: Sequence[BenchRow], accuracy: Sequence[Any] = (), width: int = 160,
               title: str | None = None) -> str:
    """The tables as plain text (for files and tests)."""
    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    render_tables(rows, accuracy, console=console, title=title)
    return console.export_text()


# ----------------------------------------------------------------- chart

def write_chart(path: str | Path, rows: Sequence[BenchRow], title: str | None = None) -> Path | None:
    """Bar chart of speed-up over the fastest peer per workload; None without matplotlib
    or without any row to draw."""
    try:  # the Agg canvas directly: no pyplot, no global backend switch
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except Exception:
        return None
    ok = [r for r in rows if r.status == "ok" and r.speedup is not None]
    if not ok:
        return None
    workloads = list(dict.fromkeys(r.workload for r in ok))
    impls = list(dict.fromkeys(r.impl for r in ok))
    val = {(r.workload, r.impl): r.speedup for r in ok}
    fig = Figure(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(111)
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(workloads))]
        ys = [val.get((w, impl), 0.0) for w in workloads]
        ax.bar(xs, ys, width=width * 0.95, label=impl)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=20, ha="right")
    ax.set_ylabel("speed-up over fastest peer (x)")
    ax.set_title(title or "speed-up over the fastest peer")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
