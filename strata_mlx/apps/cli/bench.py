"""`strata-mlx bench`: prefill and decode, cold and warm, read-ahead policies side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ...config import (
    OptionError,
)
from .common import (
    ArenaGB,
    Eviction,
    IOWorkers,
    LookaheadDepth,
    Pipeline,
    PipelineSplit,
    PipelineTimeout,
    PrefillStepSize,
    Scheduler,
    StaticCap,
    TraceFile,
    check_output_file,
    runtime_config,
)


def bench(
    model: Annotated[Path, typer.Option("--model", help="A strata-mlx store.")],
    prompt_tokens: int = typer.Option(2048, "-p", "--prompt-tokens"),
    generation_tokens: int = typer.Option(128, "-g", "--generation-tokens"),
    arena_gb: ArenaGB = None,
    prefill_step_size: PrefillStepSize = 1024,
    policies: str = typer.Option(
        "demand,static,lookahead",
        "--policies",
        help="Read-ahead policies, each with variants: lookahead:sync:d1 (see README).",
    ),
    repeats: int = typer.Option(1, "--repeats", help="A/B rounds; the order rotates each round."),
    io_workers: IOWorkers = 8,
    static_cap: StaticCap = 256,
    eviction: Eviction = "lru",
    scheduler: Scheduler = None,
    lookahead_depth: LookaheadDepth = None,
    json_out: Path | None = typer.Option(None, "--json", help="Write all figures as JSON."),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        help="mlx-lm: then mlx-lm's own model and ours on the same prompt, with ratios.",
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help='Write a PNG of the run (pip install "strata-mlx[plot]").'
    ),
    pipeline: Pipeline = False,
    pipeline_split: PipelineSplit = None,
    pipeline_timeout: PipelineTimeout = 300.0,
    trace_file: TraceFile = None,
):
    """Prefill and decode, cold and warm, read-ahead policies side by side.

    Caches: before each cold run the store's own files are evicted from the OS page cache
    (posix_fadvise DONTNEED on each file, Linux); nothing else on the machine is touched.
    """
    from ...config import check_int
    from ...stream.prediction import READ_AHEAD_POLICIES
    from ..bench import bench as run_bench
    from ..bench import markdown_table, policy_options, save

    check_int("prompt_tokens", prompt_tokens, 2, 1 << 24, cli=True)  # one chunk and a rest
    check_int("generation_tokens", generation_tokens, 1, 1 << 20, cli=True)
    check_int("repeats", repeats, 1, 1000, cli=True)
    check_output_file(json_out, "--json")
    check_output_file(plot, "--plot", suffix=".png")
    check_output_file(trace_file, "--trace")
    if trace_file is not None and pipeline:
        raise OptionError("--trace: a pipelined run's routing is not traced yet")
    runtime_config(dict(scheduler=scheduler, lookahead_depth=lookahead_depth))  # before :variants
    names = tuple(_with_variants(p, scheduler, lookahead_depth) for p in policies.split(",") if p)
    if not names:
        raise OptionError("--policies: name at least one (demand, static, lookahead)", "policies")
    for name in names:  # each policy's runtime, checked before anything is loaded
        given = dict(arena_gb=arena_gb, io_workers=io_workers, prefill_step_size=prefill_step_size,
                     static_cap=static_cap, eviction=eviction)  # fmt: skip
        try:
            runtime_config({**given, **policy_options(name)})
        except OptionError as e:
            if e.param != "read_ahead":
                raise
            known = ", ".join(READ_AHEAD_POLICIES)
            raise OptionError(
                f"--policies {name!r}: a policy is one of {known}", "policies"
            ) from None
    if plot is not None:
        from ..plots import require

        require()
    make_pipeline = None
    if pipeline:  # under mlx.launch: every rank loads each run; rank 0 drives and prints
        from ...runtime.distributed import Pipeline, init

        group = init()
        make_pipeline = lambda: Pipeline(group, pipeline_split, pipeline_timeout)  # noqa: E731
    result = run_bench(
        model,
        prompt_tokens,
        generation_tokens,
        arena_gb,
        prefill_step_size,
        names,
        repeats,
        io_workers,
        static_cap,
        eviction=eviction,
        log=typer.echo,
        baseline=baseline,
        plot=plot,
        pipeline=make_pipeline,
        trace=trace_file,
    )
    if not result:  # a rank other than 0: it served rank 0's runs
        return
    typer.echo(markdown_table(result))
    if json_out is not None:
        save(result, json_out)


def _with_variants(policy: str, scheduler: str | None, lookahead_depth: int | None) -> str:
    """--scheduler and --lookahead-depth as the policy-name variants bench's runs take
    (`:sync`, `:d3`), for each policy that does not name its own."""
    variants = policy.split(":")[1:]
    if scheduler is not None and not {"sync", "loop"} & set(variants):
        policy += f":{scheduler}"
    if lookahead_depth is not None and not any(v[:1] == "d" and v[1:].isdigit() for v in variants):
        policy += f":d{lookahead_depth}"
    return policy
