"""`strata-mlx cache-sim`: replay a routing trace through eviction policies (apps.cache_sim)."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import check_output_file


def cache_sim(
    trace_file: Path = typer.Argument(..., help="A trace file (bench/generate --trace)."),
    slots: str = typer.Option(
        ..., "--slots", help="Arena slots (expert records); a comma list sweeps sizes."
    ),
    policy: str = typer.Option(
        "lru,lfu,belady",
        "--policy",
        help="Comma-separated: eviction policies (names, module:Class plug-ins) and belady.",
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write a PNG of MB/token against the arena's slots."
    ),
    read_ahead: str = typer.Option(
        "none",
        "--read-ahead",
        help="none | lookahead | scored: also replay decode read-ahead from the trace's "
        "predictions, beside each policy.",
    ),
):
    """Replay a routing trace through eviction policies and Belady's optimum: decode miss %
    and MB/token for each (strata_mlx.apps.cache_sim)."""
    from ..cache_sim import report

    check_output_file(plot, "--plot", suffix=".png")
    for line in report(trace_file, slots, policy, plot, read_ahead):
        typer.echo(line)
