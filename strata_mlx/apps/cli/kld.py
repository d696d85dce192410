"""`strata-mlx kld`: KLD(ref || test) and top-1 agreement of two teacher-forced logits files
(`generate --logits-out` of two builds or settings)."""

from __future__ import annotations

from pathlib import Path

import typer


def kld(
    ref: Path = typer.Option(..., "--ref", help="Reference logits .npy [T, vocab]."),
    test: Path = typer.Option(..., "--test", help="Logits to test, same shape."),
):
    """KLD(ref || test) and top-1 agreement of two teacher-forced logits files."""
    from ...generation.tools import kld_report, load_logits

    typer.echo(kld_report(load_logits(ref), load_logits(test)).line())
