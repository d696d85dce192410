"""`strata-mlx plan`: will a model fit, with what arena and chunk, and how fast."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import (
    builtin_model,
    check_outputs,
)


def plan(
    model: Path | None = typer.Argument(
        None,
        help="A store, a Hugging Face checkpoint or a GGUF file (default: the built-in model).",
    ),
    arena_gb: float | None = typer.Option(None, "--arena-gb", help="Default: automatic."),
    prefill_step_size: int | None = typer.Option(None, "--prefill-step-size"),
    prompt_tokens: int = typer.Option(2048, "-p", "--prompt-tokens"),
    generation_tokens: int = typer.Option(
        128,
        "-g",
        "--generation-tokens",
        help="Decode tokens after the cold prompt (the first ones find the arena as the "
        "prefill left it): as bench's -g.",
    ),
    io_workers: int = typer.Option(8, "--io-workers"),
    target_memory: float | None = typer.Option(
        None, "--target-memory", help="GB, another machine."
    ),
    target_ssd_gbps: float | None = typer.Option(None, "--target-ssd-gbps"),
    target_tflops: float | None = typer.Option(None, "--target-tflops"),
    measure: bool = typer.Option(
        False,
        "--measure/--no-measure",
        help="Time this store's own chunk and decode (minutes on a CPU) instead of the cached "
        "calibration of its shape.",
        metavar="",
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the forecast as JSON."),
):
    """Will MODEL fit, with what arena and chunk, and how fast: prefill and decode tok/s."""
    from ...config import check_int, check_plan
    from ..plan import plan as run_plan
    from ..plan import save

    check_int("prompt_tokens", prompt_tokens, 1, 1 << 24, cli=True)
    check_int("generation_tokens", generation_tokens, 1, 1 << 24, cli=True)
    check_plan(
        target_memory,
        target_ssd_gbps,
        target_tflops,
        io_workers,
        prompt_tokens,
        generation_tokens,
        arena_gb=arena_gb,
        prefill_step_size=prefill_step_size,
        cli=True,
    )  # fmt: skip (the flags' names in the message)
    check_outputs(model, {"--json": json_out})
    builtin = model is None and arena_gb is None
    model, arena_gb = builtin_model(model, arena_gb)
    f = run_plan(model, arena_gb, prefill_step_size, prompt_tokens, generation_tokens, io_workers,
                 target_memory, target_ssd_gbps, target_tflops, measure, cli=True)  # fmt: skip
    typer.echo("\n".join(f.lines()))
    if builtin:  # (the forecast is of generate's arena; the recommendation of load()'s)
        typer.echo(
            f"note: the built-in model runs with a quarter of its experts resident "
            f"(--arena-gb {arena_gb:.3g}, as generate and serve give it) so that it streams; "
            "the recommended arena is load()'s automatic one, with room for the KV cache of "
            "-p + -g"
        )
    if json_out is not None:
        save(f, json_out)
