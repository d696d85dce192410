"""The `strata-mlx` command: a thin shell over the Python API, one module per command.

Flag names follow mlx-lm where one exists. Every user error ends as one line on stderr
naming the file and what is wrong, with exit code 2 (common.user_errors). This module only
builds the typer app from the commands.
"""

from __future__ import annotations

import typer

from . import bench, cache_prompt, cache_sim, convert, generate, kernels, plan, probe_ssd, serve
from .common import user_errors

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run Mixture-of-Experts models larger than memory, experts streamed from SSD.",
)
app.command()(user_errors(generate.generate))
app.command("cache-prompt")(user_errors(cache_prompt.cache_prompt))
app.command()(user_errors(convert.convert))
app.command()(user_errors(bench.bench))
app.command("cache-sim")(user_errors(cache_sim.cache_sim))
app.command()(user_errors(plan.plan))
app.command("probe-ssd")(user_errors(probe_ssd.probe_ssd))
app.add_typer(kernels.kernels_app, name="kernels")
app.command()(user_errors(serve.serve))


def _register_tools() -> None:
    from ...generation.tools import kld_command, route_parity_command

    app.command("kld", help="KLD and top-1 agreement between two logits files.")(
        user_errors(kld_command)
    )
    app.command("route-parity", help="Routing of two configurations, per layer and token.")(
        user_errors(route_parity_command)
    )


_register_tools()

__all__ = ["app"]
