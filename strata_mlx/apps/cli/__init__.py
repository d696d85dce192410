"""The `strata-mlx` command: a thin shell over the Python API, one module per command.

Flag names follow mlx-lm where one exists. Every user error ends as one line on stderr
naming the file or flag and what is wrong, with exit code 2 (common.user_errors; typer's
usage errors through common.Group.main). This module only builds the typer app from the
commands.
"""

from __future__ import annotations

import typer

from ... import __version__
from . import (
    bench,
    cache_prompt,
    cache_sim,
    convert,
    generate,
    kernels,
    kld,
    plan,
    probe_ssd,
    route_parity,
    serve,
)
from .common import Command, Group, user_errors

app = typer.Typer(
    cls=Group,
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Run Mixture-of-Experts models larger than memory, experts streamed from SSD.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"strata-mlx {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", metavar="",
        callback=_version, is_eager=True,
    ),
) -> None:  # fmt: skip
    """Run Mixture-of-Experts models larger than memory, experts streamed from SSD."""


app.command(cls=Command)(user_errors(generate.generate))
app.command("cache-prompt", cls=Command)(user_errors(cache_prompt.cache_prompt))
app.command(cls=Command)(user_errors(convert.convert))
app.command(cls=Command)(user_errors(bench.bench))
app.command("cache-sim", cls=Command)(user_errors(cache_sim.cache_sim))
app.command(cls=Command)(user_errors(plan.plan))
app.command("probe-ssd", cls=Command)(user_errors(probe_ssd.probe_ssd))
app.add_typer(kernels.kernels_app, name="kernels")
app.command(cls=Command)(user_errors(serve.serve))

app.command(cls=Command)(user_errors(kld.kld))
app.command("route-parity", cls=Command)(user_errors(route_parity.route_parity))

__all__ = ["app"]
