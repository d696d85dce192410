"""`strata-mlx route-parity`: one prompt teacher-forced under two runtime configurations
(arena size, read-ahead), their routing compared layer by layer and token by token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import typer

from ...config import OptionError
from ...progress import StatusLine


def route_parity(
    model: Path | None = typer.Option(
        None, "--model", help="A strata-mlx store (default: the built-in model)."
    ),
    prompt_tokens: str | None = typer.Option(
        None, "--prompt-tokens", help="Prompt as token ids: 1,2,3."
    ),
    random_tokens: int = typer.Option(
        64, "--random-tokens", help="Without --prompt-tokens: this many seeded random ids."
    ),
    arena_gb_a: float | None = typer.Option(
        None, "--arena-gb-a", help="Configuration a's arena in GiB (default: load's choice)."
    ),
    arena_gb_b: float | None = typer.Option(None, "--arena-gb-b", help="Configuration b's."),
    read_ahead_a: str = typer.Option(
        "lookahead", "--read-ahead-a", help="Configuration a's read-ahead policy."
    ),
    read_ahead_b: str = typer.Option("demand", "--read-ahead-b", help="Configuration b's."),
    prefill_step_size: int = typer.Option(
        512, "--prefill-step-size", help="Positions a chunk, both configurations."
    ),
    io_workers: int = typer.Option(8, "--io-workers", help="Reader threads, both."),
):
    """Routing of one prompt under two runtime configurations, layer by layer and token by
    token.

    Each configuration loads the store and teacher-forces the prompt; the lines name each
    layer's tokens whose top-k expert set differs, then whether the logits are bit-identical.
    Exit code 1 if any token's expert set differs."""
    from ...config import check_prompt_length, check_runtime, parse_tokens
    from ...format.store import load_manifest
    from ...generation.tools import kld_report, route_parity, traced_run
    from ...runtime.loader import RuntimeConfig
    from .common import builtin_model

    if prefill_step_size < 1:
        raise OptionError(f"--prefill-step-size {prefill_step_size}: must be at least 1")
    if model is None:  # the built-in model, each arena its automatic one unless given
        model, auto = builtin_model(None, None)
        arena_gb_a = auto if arena_gb_a is None else arena_gb_a
        arena_gb_b = auto if arena_gb_b is None else arena_gb_b
    configs = {}
    for name, arena_gb, read_ahead in (
        ("a", arena_gb_a, read_ahead_a),
        ("b", arena_gb_b, read_ahead_b),
    ):
        cfg = RuntimeConfig(
            arena_gb=arena_gb,
            read_ahead=read_ahead,
            prefill_step_size=prefill_step_size,
            io_workers=io_workers,
        )
        try:
            check_runtime(cfg, cli=True)
        except OptionError as e:  # the flag of this configuration: --arena-gb-a, ...
            msg = str(e)
            for flag in ("--arena-gb", "--read-ahead"):
                if msg.startswith(flag + " "):
                    msg = f"{flag}-{name}{msg[len(flag) :]}"
            raise OptionError(msg) from None
        configs[name] = cfg
    config = load_manifest(model).config
    context = config.get("max_position_embeddings")
    if prompt_tokens is not None:
        ids = parse_tokens(prompt_tokens, "--prompt-tokens")
        check_prompt_length(len(ids), context, "--prompt-tokens")
    else:
        if random_tokens < 1:
            raise OptionError(f"--random-tokens {random_tokens}: must be at least 1")
        check_prompt_length(random_tokens, context, "--random-tokens")  # (before making them)
        vocab = config.get("vocab_size", 128)
        ids = np.random.default_rng(0).integers(0, vocab, size=random_tokens).tolist()
    runs = []
    status = StatusLine()  # (on a terminal: the output is read by scripts)
    try:
        for name, cfg in configs.items():
            read_ahead = cfg.read_ahead.policy
            status.set(f"run {name} ({read_ahead}): loading")
            runs.append(
                traced_run(
                    model,
                    ids,
                    cfg,
                    lambda done, name=name, ra=read_ahead: status.set(
                        f"run {name} ({ra}): {done}/{len(ids)} positions"
                    ),
                )
            )
    finally:
        status.close()
    (trace_a, logits_a), (trace_b, logits_b) = runs
    rep = route_parity(trace_a, trace_b)
    for line in rep.layer_lines():
        typer.echo(line)
    typer.echo(rep.line())
    same = np.array_equal(logits_a, logits_b)
    typer.echo(
        "logits: bit-identical"
        if same
        else f"logits: differ; {kld_report(logits_a, logits_b).line()}"
    )
    if not rep.ok:
        raise typer.Exit(1)
