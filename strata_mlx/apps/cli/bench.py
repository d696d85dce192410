"""`strata-mlx bench`: prefill and decode, cold and warm, read-ahead policies side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ...config import OptionError, check_runtime
from ...progress import StatusLine
from .common import (
    Pipeline,
    PipelineSplit,
    PipelineTimeout,
    TraceFile,
    builtin_model,
    check_output_file,
    check_outputs,
    check_pipeline_flags,
    runtime_command,
)


@runtime_command(preset=False, defaults={"prefill_step_size": 1024})
def bench(
    model: Annotated[
        Path | None,
        typer.Option("--model", help="A strata-mlx store (default: the built-in model)."),
    ] = None,
    prompt_tokens: int = typer.Option(2048, "-p", "--prompt-tokens", help="Prompt tokens."),
    generation_tokens: int = typer.Option(128, "-g", "--generation-tokens", help="Tokens decoded."),
    policies: str = typer.Option(
        "demand,static,lookahead",
        "--policies",
        help="Read-ahead policies, each with variants that set a runtime option: "
        "lookahead:sync:d1 (docs/usage.md lists them).",
    ),
    repeats: int = typer.Option(1, "--repeats", help="A/B rounds; the order rotates each round."),
    json_out: Path | None = typer.Option(None, "--json", help="Write all figures as JSON."),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        help="mlx-lm: then mlx-lm's own model and ours on the same prompt, with ratios.",
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help='Write a PNG of the run (pip install "strata-mlx\\[plot]").'
    ),
    pipeline: Pipeline = False,
    pipeline_split: PipelineSplit = None,
    pipeline_timeout: PipelineTimeout = 300.0,
    trace_file: TraceFile = None,
    runtime=None,
):
    """Prefill and decode, cold and warm, read-ahead policies side by side.

    Caches: before each cold run the store's own files are evicted from the OS page cache
    (posix_fadvise DONTNEED on each file, Linux); nothing else on the machine is touched.
    The runtime flags set every policy's runtime; a policy's variants override them.
    """
    from ...config import check_int
    from ..bench import bench as run_bench
    from ..bench import markdown_table, policy_options, save, trace_paths

    check_int("prompt_tokens", prompt_tokens, 2, 1 << 24, cli=True)  # one chunk and a rest
    check_int("generation_tokens", generation_tokens, 1, 1 << 20, cli=True)
    check_int("repeats", repeats, 1, 1000, cli=True)
    check_pipeline_flags(pipeline, pipeline_split, pipeline_timeout)
    outputs = {"--json": json_out, "--plot": plot, "--trace": trace_file}
    check_outputs(model, outputs, suffixes={"--plot": ".png"})
    if trace_file is not None and pipeline:
        raise OptionError("--trace: a pipelined run's routing is not traced yet")
    names = tuple(p for p in policies.split(",") if p)
    if not names:
        raise OptionError("--policies: name at least one (demand, static, lookahead)", "policies")
    for name in names:  # each policy's runtime, checked before anything is loaded
        try:
            check_runtime(runtime.replace(**policy_options(name)), cli=True)
        except OptionError as e:
            if e.param == "policies":  # an unknown variant names the flag already
                raise
            raise OptionError(f"--policies {name!r}: {e}", "policies") from None
    if trace_file is not None:  # each run's own file, as the rounds' rotated orders name them
        for r in range(repeats):
            order = list(names[r % len(names) :] + names[: r % len(names)])
            for path in trace_paths(trace_file, order, r, repeats).values():
                check_output_file(path, "--trace")
    if plot is not None:
        from ..plots import require

        require()
    model, arena_gb = builtin_model(model, runtime.arena_gb)
    runtime = runtime.replace(arena_gb=arena_gb)
    from ...runtime.loader import store_args
    from ..plan import check_context

    check_context(store_args(model), prompt_tokens, generation_tokens, cli=True)  # as generate
    make_pipeline = None
    if pipeline:  # under mlx.launch: every rank loads each run; rank 0 drives and prints
        from ...runtime.distributed import Pipeline, init

        group = init()
        make_pipeline = lambda: Pipeline(group, pipeline_split, pipeline_timeout)  # noqa: E731
    status = StatusLine()
    try:
        result = run_bench(
            model,
            prompt_tokens,
            generation_tokens,
            arena_gb,
            runtime.prefill_step_size,
            names,
            repeats,
            runtime.io_workers,
            runtime.read_ahead.static_cap,
            eviction=runtime.eviction,
            config=runtime,
            log=status.echo,
            status=status.set,
            baseline=baseline,
            plot=plot,
            pipeline=make_pipeline,
            trace=trace_file,
        )
    finally:
        status.close()
    if not result:  # a rank other than 0: it served rank 0's runs
        return
    typer.echo(markdown_table(result))
    if json_out is not None:
        save(result, json_out)
