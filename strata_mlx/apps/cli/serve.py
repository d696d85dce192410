"""`strata-mlx serve`: a store behind the OpenAI-compatible HTTP API."""

from __future__ import annotations

from pathlib import Path

import typer

from ...config import (
    DEFAULT_DECODE_CONCURRENCY,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPT_CONCURRENCY,
    DEFAULT_SHUTDOWN_TIMEOUT,
    OptionError,
)
from .common import (
    KV_FLAGS,
    Model,
    Pipeline,
    PipelineSplit,
    PipelineTimeout,
    builtin_model,
    check_pipeline_flags,
    kv_options,
    runtime_command,
)

# uvicorn's (uvicorn.config.LOG_LEVELS), named here so that a wrong one is refused before the
# model loads: uvicorn itself fails on it only once the model is up
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@runtime_command
def serve(
    model: Model = None,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port"),
    model_name: str | None = typer.Option(
        None, "--model-name", help="The name clients ask for (default: the store's folder name)."
    ),
    max_tokens: int = typer.Option(
        DEFAULT_MAX_TOKENS, "--max-tokens", "-m", help="max_tokens of a request that gives none."
    ),
    max_tokens_limit: int | None = typer.Option(
        None,
        "--max-tokens-limit",
        help="The largest max_tokens a request may ask (default: the model's context).",
    ),
    max_prompt_tokens: int | None = typer.Option(
        None,
        "--max-prompt-tokens",
        help="The longest prompt accepted, in tokens (default: the model's context).",
    ),
    max_queue: int = typer.Option(
        DEFAULT_MAX_QUEUE,
        "--max-queue",
        help="Requests that may wait behind the running one; more are answered 429.",
    ),
    decode_concurrency: int | None = typer.Option(
        None,
        "--decode-concurrency",
        help="Requests that decode together, one token each per step, their experts read "
        f"once for all (1: one request at a time; --pipeline runs one at a time). Default "
        f"{DEFAULT_DECODE_CONCURRENCY}, halved until their KV caches fit beside the model.",
        show_default=False,
    ),
    prompt_concurrency: int = typer.Option(
        DEFAULT_PROMPT_CONCURRENCY,
        "--prompt-concurrency",
        help="Requests that prefill a prompt chunk between two decode steps.",
    ),
    shutdown_timeout: float = typer.Option(
        DEFAULT_SHUTDOWN_TIMEOUT,
        "--shutdown-timeout",
        help="Seconds requests in flight get to finish after SIGTERM before they are cancelled.",
    ),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="STRATA_MLX_API_KEY",
        help="Require 'Authorization: Bearer KEY' on every request (or set STRATA_MLX_API_KEY).",
    ),
    allowed_origins: str | None = typer.Option(
        None,
        "--allowed-origins",
        help="Comma-separated origins browsers may call from (CORS), or '*'.",
    ),
    allowed_hosts: str | None = typer.Option(
        None,
        "--allowed-hosts",
        help="Comma-separated host names requests may be addressed to besides localhost, "
        "127.0.0.1, [::1] and --host (checked on a loopback --host, or whenever given).",
    ),
    max_body_bytes: int = typer.Option(
        DEFAULT_MAX_BODY_BYTES, "--max-body-bytes", help="The largest request body; more is a 413."
    ),
    log_level: str = typer.Option(
        "info", "--log-level", help=f"The server's log: {', '.join(LOG_LEVELS)}."
    ),
    prompt_cache_size: int = typer.Option(
        10, "--prompt-cache-size", help="Conversations whose KV cache is kept for reuse (0: off)."
    ),
    prompt_cache_bytes: int = typer.Option(
        1 << 30, "--prompt-cache-bytes", help="Bytes those kept caches may hold together."
    ),
    prompt_cache_dir: Path | None = typer.Option(
        None,
        "--prompt-cache-dir",
        help="Also keep conversations' KV caches in this directory: what memory evicts, and "
        "all at shutdown; a restarted server resumes them from there.",
    ),
    prompt_cache_dir_bytes: int = typer.Option(
        16 << 30, "--prompt-cache-dir-bytes", help="Bytes the directory's caches may hold."
    ),
    max_kv_size: int | None = KV_FLAGS["max_kv_size"],
    kv_bits: int | None = KV_FLAGS["kv_bits"],
    kv_group_size: int = KV_FLAGS["kv_group_size"],
    quantized_kv_start: int = KV_FLAGS["quantized_kv_start"],
    pipeline: Pipeline = False,
    pipeline_split: PipelineSplit = None,
    pipeline_timeout: PipelineTimeout = 300.0,
    runtime=None,
):
    """Serve a store over HTTP: OpenAI's chat and text completions and Responses API, and
    Anthropic's Messages API."""
    args = dict(locals())
    from ...config import check_int, check_number

    try:
        from ..server import serve as run_server
    except ImportError as e:  # a machine without the server stack still runs everything else
        raise OptionError(f"serve needs {e.name}: pip install -e . installs it") from None
    _check_sizes(args)
    if pipeline and prompt_cache_dir is not None:  # the other ranks hold the state
        raise OptionError("--pipeline: --prompt-cache-dir is not pipelined yet")
    if prompt_cache_dir is not None and prompt_cache_dir.exists() and not prompt_cache_dir.is_dir():
        raise OptionError(f"--prompt-cache-dir {prompt_cache_dir}: not a directory")
    check_number("shutdown_timeout", shutdown_timeout, 0, cli=True)
    if log_level.lower() not in LOG_LEVELS:
        raise OptionError(f"--log-level {log_level!r}: one of {', '.join(LOG_LEVELS)}")
    check_pipeline_flags(pipeline, pipeline_split, pipeline_timeout)
    kv = kv_options(args)
    if pipeline and (kv.max_kv_size or kv.kv_bits):  # each rank has its own cache
        raise OptionError("--pipeline: --max-kv-size and --kv-bits are not pipelined yet")
    if api_key is not None and not api_key.strip():
        raise OptionError("--api-key: empty", "api_key")
    from ..server.guard import check_host_names, check_origins

    origins = check_origins(allowed_origins) if allowed_origins is not None else None
    hosts = check_host_names(allowed_hosts) if allowed_hosts is not None else None
    check_int("max_body_bytes", max_body_bytes, 1, cli=True)
    if model is None:
        model_name = model_name or "smollm2-135m-instruct-split"
    model, arena_gb = builtin_model(model, runtime.arena_gb)
    cfg = runtime.replace(arena_gb=arena_gb)
    run_server(
        model,
        host=host,
        port=port,
        model_name=model_name,
        log_level=log_level,
        max_tokens=max_tokens,
        max_tokens_limit=max_tokens_limit,
        max_prompt_tokens=max_prompt_tokens,
        max_queue=max_queue,
        decode_concurrency=decode_concurrency,
        prompt_concurrency=prompt_concurrency,
        api_key=api_key,
        allowed_origins=origins,
        allowed_hosts=hosts,
        max_body_bytes=max_body_bytes,
        shutdown_timeout=shutdown_timeout,
        prompt_cache_size=prompt_cache_size,
        prompt_cache_bytes=prompt_cache_bytes,
        prompt_cache_dir=prompt_cache_dir,
        prompt_cache_dir_bytes=prompt_cache_dir_bytes,
        pipeline=pipeline,
        pipeline_split=pipeline_split,
        pipeline_timeout=pipeline_timeout,
        kv=kv,
        config=cfg,
    )


def _check_sizes(args: dict) -> None:
    """serve's integer flags (`args`, by name) each in its range: the port, the token and
    queue limits, the concurrencies, the prompt caches' sizes."""
    from ...config import check_int

    check_int("port", args["port"], 1, 65535, cli=True)
    check_int("max_tokens", args["max_tokens"], 1, cli=True)
    for name in ("max_tokens_limit", "max_prompt_tokens"):
        if args[name] is not None:
            check_int(name, args[name], 1, cli=True)
    check_int("max_queue", args["max_queue"], 0, cli=True)
    if args["decode_concurrency"] is not None:
        check_int("decode_concurrency", args["decode_concurrency"], 1, cli=True)
    check_int("prompt_concurrency", args["prompt_concurrency"], 1, cli=True)
    check_int("prompt_cache_size", args["prompt_cache_size"], 0, cli=True)
    check_int("prompt_cache_bytes", args["prompt_cache_bytes"], 0, cli=True)
    check_int("prompt_cache_dir_bytes", args["prompt_cache_dir_bytes"], 1, cli=True)
