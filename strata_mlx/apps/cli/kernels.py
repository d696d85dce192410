"""`strata-mlx kernels show`: the source each expert kernel of a format compiles."""

from __future__ import annotations

import typer

from .common import Command, Group, fail

kernels_app = typer.Typer(cls=Group, no_args_is_help=True, help="The expert kernels' source.")


@kernels_app.command("show", cls=Command)
def kernels_show(
    fmt: str = typer.Argument(
        ..., metavar="FORMAT", help="Q4_K, Q2_K, IQ2_XS, IQ3_S or affine{bits}-g{group}."
    ),
    dialect: str = typer.Option("metal", "--dialect", help="metal | cuda | host"),
    down: str | None = typer.Option(None, "--down", help="down_proj's format (default FORMAT)."),
    hidden: int = typer.Option(2048, "--hidden", help="Model width D."),
    inter: int = typer.Option(512, "--inter", help="Expert width."),
    top_k: int = typer.Option(10, "--top-k", help="Experts per token."),
    tile: int = typer.Option(1, "--tile", help="Pairs per warp: 1 in decode, 8 in prefill."),
):
    """Print the exact source each expert kernel of FORMAT compiles on DIALECT."""
    from ...runtime.kernels import example_layout, kernel_source_text

    if dialect not in ("metal", "cuda", "host"):
        fail(f"--dialect {dialect!r}: one of metal, cuda, host")
    try:
        layout = example_layout(fmt, hidden, inter, down)
        typer.echo(kernel_source_text(layout, dialect, top_k, tile))
    except (KeyError, ValueError) as e:
        fail(str(e).strip("'\""))
