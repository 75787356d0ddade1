"""``flamia-gen bench``: the click command (attached to the main group elsewhere
with ``main.add_command(bench_command, "bench")``)."""

from __future__ import annotations

import sys

import click

from .adapter import MODES
from .timing import DEFAULT_REPEATS, DEFAULT_WARMUP, MIN_REPEATS_DESIGN
from .workloads import DEFAULT_WORKLOADS

NO_CUDA_MESSAGE = "no CUDA device: flamia-gen bench needs a GPU"


def _parse_workloads(ctx, param, value):
    from .workloads import parse_workloads

    try:
        return parse_workloads(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _parse_impls(ctx, param, value):
    from .peers import resolve_impls

    try:
        return resolve_impls(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workloads", "workloads", default=",".join(DEFAULT_WORKLOADS),
              show_default=True, callback=_parse_workloads,
              help="Comma-separated workload names ('paper' = the paper's seven; "
                   "patterns eq<N>x<L>, skew<B>+<N>x<L>, long<T>, lognormal:<T>:<seed>).")
@click.option("--impls", "impls", default="all", show_default=True, callback=_parse_impls,
              help="Comma-separated implementations, or 'all', 'peers', 'ours'.")
@click.option("--mode", type=click.Choice(list(MODES)), default="fwd", show_default=True,
              help="fwd: forward only; bwd: the backward call alone (each input set's forward runs "
                   "once, untimed); train: quantization + forward + backward.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, writable=True),
              default="bench_out", show_default=True, help="Folder for JSON, table and PNG.")
@click.option("--repeats", type=click.IntRange(min=1), default=DEFAULT_REPEATS,
              show_default=True, help=f"Timed calls per row (median reported; "
                                      f"DESIGN asks for >= {MIN_REPEATS_DESIGN}).")
@click.option("--warmup", type=click.IntRange(min=0), default=DEFAULT_WARMUP,
              show_default=True, help="Untimed calls first (compilation, caches).")
@click.option("--accuracy/--no-accuracy", default=True, show_default=True,
              help="O and dQ cosine vs an fp32 reference on eq4x4096.")
@click.option("--outliers", is_flag=True, help="Accuracy inputs with a few tokens x100.")
@click.option("--rotations", type=click.IntRange(min=1), default=None,
              help="Input sets rotated through (default: enough to exceed L2 3x).")
@click.option("--seed", type=int, default=0, show_default=True)
def bench_command(workloads, impls, mode, out_dir, repeats, warmup, accuracy, outliers,
                  rotations, seed):
    """Time our kernels and the peers side by side on packed-document workloads."""
    from .adapter import no_cuda_reason

    if no_cuda_reason():
        click.echo(NO_CUDA_MESSAGE, err=True)
        sys.exit(2)
    from .runner import NoCudaError, run_bench

    adapters, notes = impls
    if repeats < MIN_REPEATS_DESIGN:
        click.echo(f"warning: {repeats} repeats is below the {MIN_REPEATS_DESIGN} DESIGN §5 "
                   f"asks for; rows will say so", err=True)
    try:
        result = run_bench(workloads, adapters, mode=mode, out_dir=out_dir, repeats=repeats,
                           warmup=warmup, accuracy=accuracy, seed=seed, n_rotations=rotations,
                           outliers=outliers, notes=notes)
    except NoCudaError:
        click.echo(NO_CUDA_MESSAGE, err=True)
        sys.exit(2)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if result.json_path:
        click.echo(f"wrote {result.json_path}")
    if result.chart_path:
        click.echo(f"wrote {result.chart_path}")
