"""What the commands of `strata-mlx` share: one-line user errors, the runtime flags declared
once (RuntimeConfig's fields, same names), the runtime config built from them, the built-in
model, and checks of output files and chat template variables. Never runs a model."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

from ...config import OptionError
from ...format.store import StoreError


def fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _user_error_types() -> tuple[type[BaseException], ...]:
    from ...generation.prompt_cache import PromptCacheError
    from ...generation.tokenizer import ChatTemplateError
    from ...runtime.distributed import PipelineError

    # StoreError covers ExpertReadError and MemoryGuardError; the OS errors name a user's path
    return (StoreError, OptionError, PromptCacheError, ChatTemplateError, PipelineError,
            FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)  # fmt: skip


def user_errors(fn):
    """Turn the errors a user can cause, our own types, into one line and exit code 2;
    anything else (a plain ValueError included, ours or a library's) is a bug and keeps its
    traceback."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except Exception as e:
            if not isinstance(e, _user_error_types()):
                raise
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

    return wrapper


# ---- options declared once -----------------------------------------------------------------
# The runtime flags (RuntimeConfig's fields, same names) default to None, "not given": the
# config is RuntimeConfig's defaults, then --preset's values, then the flags given.

Model = Annotated[
    Path | None, typer.Option("--model", help="A strata-mlx store (default: the built-in model).")
]
ArenaGB = Annotated[
    float | None, typer.Option("--arena-gb", help="Arena size in GB (default: from memory).")
]
IOWorkers = Annotated[int | None, typer.Option("--io-workers", help="Reader threads (default 8).")]
ReadAhead = Annotated[
    str | None,
    typer.Option("--read-ahead", help="demand | static | lookahead (default lookahead)."),
]
StaticCap = Annotated[
    int | None, typer.Option("--static-cap", help="static: experts read ahead per layer (256).")
]
LookaheadMinTokens = Annotated[
    int | None,
    typer.Option("--lookahead-min-tokens", help="lookahead: predict in chunks of at least this."),
]
LookaheadDecodeMinMiss = Annotated[
    float | None,
    typer.Option(
        "--lookahead-decode-min-miss",
        help="Decode predicts while its miss rate is above this (default 0.02).",
    ),
]
LookaheadDepth = Annotated[
    int | None,
    typer.Option(
        "--lookahead-depth", help="Layers predicted ahead from each layer's input (default 2)."
    ),
]
Scheduler = Annotated[
    str | None,
    typer.Option(
        "--scheduler",
        help="loop (an asyncio loop keeps the drive busy between handshakes, the default) | "
        "sync (reads scheduled inside the handshake only).",
    ),
]
Eviction = Annotated[
    str | None,
    typer.Option(
        "--eviction",
        help="lru | lfu | profile | layer (default lru), a candidate of strata_mlx.stream.policies, "
        "or module:Class (a plug-in).",
    ),
]
Verify = Annotated[
    bool | None,
    typer.Option(
        "--verify/--no-verify",
        help="Checksums of the dense weights (once) and of every expert record as it is read "
        "(default on).",
    ),
]
PrefillStepSize = Annotated[
    int | None,
    typer.Option("--prefill-step-size", help="Prompt tokens per chunk (default: from memory)."),
]
FakeStream = Annotated[
    bool | None,
    typer.Option("--fake-stream", help="Every expert counts as resident: times compute alone."),
]
Decode = Annotated[
    str | None,
    typer.Option(
        "--decode",
        help="pipelined (routing checked a layer late, no per-layer sync; the default) | sync",
    ),
]
DecodeLag = Annotated[
    int | None, typer.Option("--decode-lag", help="Pipelined: layers of lag (default 1).")
]
TraceFile = Annotated[
    Path | None,
    typer.Option(
        "--trace",
        help="Write the routing trace (.npz, strata_mlx.stream.trace) for strata-mlx cache-sim; "
        "bench: each cold run's.",
    ),
]
Preset = Annotated[
    str | None,
    typer.Option("--preset", help="A runtime preset from configs/runtime/ (e.g. laptop-24gb)."),
]
Pipeline = Annotated[
    bool,
    typer.Option(
        "--pipeline", help="Layers pipelined over the ranks of mlx.launch (mx.distributed)."
    ),
]
PipelineSplit = Annotated[
    str | None,
    typer.Option("--pipeline-split", help="Layers per rank, e.g. 20,28 (default: by memory)."),
]
PipelineTimeout = Annotated[
    float,
    typer.Option("--pipeline-timeout", help="Seconds a pipeline step may wait on another rank."),
]


def runtime_config(options: dict, preset: str | None = None):
    """A checked RuntimeConfig: its defaults, then `preset`'s values, then the entries of
    `options` (a command's arguments, by RuntimeConfig's field names) that were given."""
    from ...config import check_runtime
    from ...runtime.loader import RuntimeConfig, apply_preset

    cfg = RuntimeConfig()
    if preset is not None:
        cfg = apply_preset(cfg, preset)
    names = cfg.options()
    cfg = cfg.replace(**{k: v for k, v in options.items() if k in names and v is not None})
    check_runtime(cfg, cli=True)
    return cfg


def builtin_model(model: Path | None, arena_gb: float | None) -> tuple[Path, float | None]:
    """--model and --arena-gb, the built-in model's store and arena when not given."""
    if model is not None:
        return model, arena_gb
    from ..default_model import default_arena_gb, default_store

    store = default_store()
    return store, default_arena_gb(store) if arena_gb is None else arena_gb


KV_FLAGS = {  # mlx-lm's KV cache flags, shared by generate and cache-prompt
    "max_kv_size": typer.Option(
        None, "--max-kv-size", help="Keep at most this many positions (a rotating KV cache)."
    ),
    "kv_bits": typer.Option(
        None, "--kv-bits", help="Bits of the quantized KV cache (default: not quantized)."
    ),
    "kv_group_size": typer.Option(
        64, "--kv-group-size", help="Group size of the KV cache's quantization."
    ),
    "quantized_kv_start": typer.Option(
        5000,
        "--quantized-kv-start",
        help="With --kv-bits: quantize a layer's cache once it holds this many positions.",
    ),
}


def template_config(text: str | None) -> dict:
    """--chat-template-config: a JSON object of template variables (mlx-lm's flag)."""
    if text is None:
        return {}
    import json

    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionError(f"--chat-template-config: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise OptionError("--chat-template-config: expected a JSON object of template variables")
    taken = sorted({"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(config))
    if taken:
        raise OptionError(f"--chat-template-config: {', '.join(taken)} are set by strata-mlx")
    return config


def save_npy(path: Path, array) -> None:
    import numpy as np

    from ...format.store import write_atomic

    write_atomic(path, lambda tmp: np.save(tmp, array), tmp_suffix=".tmp.npy")  # np.save adds .npy


def check_output_file(path: Path | None, flag: str, suffix: str | None = None) -> None:
    """Before anything is loaded or run: an output file `flag` names can be written where it
    says (its directory exists and is writable, it is not a directory itself)."""
    import os

    if path is None:
        return
    where = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OptionError(f"{flag} {path}: is a directory; name a file")
    if not where.is_dir():
        raise OptionError(f"{flag} {path}: no directory {where}")
    if not os.access(where, os.W_OK | os.X_OK):
        raise OptionError(f"{flag} {path}: cannot write in {where}")
    if suffix is not None and path.suffix.lower() != suffix:
        raise OptionError(
            f"{flag} {path}: writes {suffix[1:].upper()}; give a name ending in {suffix}"
        )


def kv_options(args: dict):
    """mlx-lm's KV cache flags (KV_FLAGS, in a command's `args` by name) as checked KVOptions."""
    from ...generation.prompt_cache import KVOptions

    names = ("max_kv_size", "kv_bits", "kv_group_size", "quantized_kv_start")
    kv = KVOptions(*(args[n] for n in names))
    kv.check(cli=True)
    return kv


def chat_flag(
    chat: bool | None, system_prompt: str | None, chat_template_config: str | None
) -> bool:
    """--chat/--no-chat: on when given, else when --system-prompt or --chat-template-config
    is (which --no-chat refuses)."""
    wants_chat = system_prompt is not None or chat_template_config is not None
    if chat is False and wants_chat:
        raise OptionError("--system-prompt and --chat-template-config need the chat template")
    return wants_chat if chat is None else chat
