"""What the commands of `strata-mlx` share: one-line user errors, the runtime flags declared
from RuntimeConfig's declarations (runtime_command), the runtime config built from them, the built-in
model, and checks of output files and chat template variables. Never runs a model."""

from __future__ import annotations

import errno
import functools
import inspect
import typing
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from ...config import (
    PANEL_MEMORY,
    PANEL_RESEARCH,
    OptionError,
    RuntimeOption,
    check_number,
    check_runtime,
    one_line,
    runtime_options,
)
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


# What a file system says of a user's output (full, read-only, over a quota or a size limit,
# a path through a file): a one-line error naming the file, not a bug.
_USER_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.ENOTDIR)


class _HelpFlag:
    """-h / --help shown as the switch it is (typer labels every flag `<bool>`)."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class Command(_HelpFlag, TyperCommand):
    """A command listed under `strata-mlx --help` by its docstring's first paragraph on one
    line (typer's rich listing keeps the docstring's line breaks)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.short_help is None and self.help:
            self.short_help = " ".join(inspect.cleandoc(self.help).split("\n\n")[0].split())


class Group(_HelpFlag, TyperGroup):
    def main(self, *args, standalone_mode: bool = True, **kwargs):
        """typer's main, but a usage error (an unknown command or option, a value of the
        wrong type) ends as every user error here does, one line on stderr and its exit code
        (2), not typer's boxed panel. Typer's click is vendored and its exceptions are not
        exported: they are told by click's public interface (`format_message`,
        `exit_code`)."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except typer.Abort:  # (EOF at a prompt)
            typer.echo("Aborted.", err=True)
            raise SystemExit(1) from None
        except Exception as e:
            show, code = getattr(e, "format_message", None), getattr(e, "exit_code", None)
            if not callable(show) or not isinstance(code, int):
                raise
            if type(e).__name__ != "NoArgsIsHelpError":  # (typer printed the help for it)
                ctx = getattr(e, "ctx", None)
                hint = f" ({ctx.command_path} -h for help)" if ctx is not None else ""
                typer.echo(f"error: {one_line(show())}{hint}", err=True)
            raise SystemExit(code) from None
        raise SystemExit(code if isinstance(code, int) else 0)


def user_errors(fn):
    """Turn the errors a user can cause, our own types, into one line and exit code 2;
    anything else (a plain ValueError included, ours or a library's) is a bug and keeps its
    traceback."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except Exception as e:
            if isinstance(e, OSError) and e.errno in _USER_ERRNOS and e.filename:
                fail(f"{e.filename}: {e.strerror}")
            if not isinstance(e, _user_error_types()):
                raise
            fail(one_line(str(e)) or type(e).__name__)

    return wrapper


# ---- options declared once -----------------------------------------------------------------
# Help panels, in the order `--help` shows them: the basics (typer's first panel) and sampling,
# then the runtime options' panels (strata_mlx.config: memory and streaming, research).
PANEL_SAMPLING = "Sampling"


def switch(names: str, help: str, panel: str | None = None, default: bool | None = False):
    """A typer flag that takes no value (`--verbose`, `--x/--no-x`)."""
    return typer.Option(default, names, help=help, metavar="", rich_help_panel=panel)


Model = Annotated[
    Path | None, typer.Option("--model", help="A strata-mlx store (default: the built-in model).")
]
TraceFile = Annotated[
    Path | None,
    typer.Option(
        "--trace",
        help="Write the routing trace (.npz, strata_mlx.stream.trace) for strata-mlx cache-sim; "
        "bench: each cold run's.",
        rich_help_panel=PANEL_RESEARCH,
    ),
]
Pipeline = Annotated[
    bool,
    typer.Option(
        "--pipeline",
        help="Layers pipelined over the ranks of mlx.launch (mx.distributed).",
        metavar="",
        rich_help_panel=PANEL_RESEARCH,
    ),
]
PipelineSplit = Annotated[
    str | None,
    typer.Option(
        "--pipeline-split",
        help="Layers per rank, e.g. 20,28 (default: by memory).",
        rich_help_panel=PANEL_RESEARCH,
    ),
]
PipelineTimeout = Annotated[
    float,
    typer.Option(
        "--pipeline-timeout",
        help="Seconds a pipeline step may wait on another rank.",
        rich_help_panel=PANEL_RESEARCH,
    ),
]


def check_pipeline_flags(pipeline: bool, split: str | None, timeout: float) -> None:
    """--pipeline-timeout is a positive number; --pipeline-split only comes with --pipeline
    (alone it would do nothing, without a word)."""
    check_number("pipeline_timeout", timeout, 0, lo_open=True, cli=True)
    if split is not None and not pipeline:
        raise OptionError(f"--pipeline-split {split}: only with --pipeline (under mlx.launch)")


def _flag(o: RuntimeOption, defaults: dict) -> inspect.Parameter:
    """The typer parameter of runtime option `o`: None when not given, its default shown
    from the declaration (or the command's `defaults`)."""
    spec = o.option
    if o.is_switch:  # the flag alone turns it on (--no-... too where it may be on by default)
        names = f"{o.flag}/--no-{o.flag[2:]}" if o.default is not False else o.flag
        kind, default = bool, spec.shown or ("on" if o.default else "off")
    else:
        lo = spec.range[0] if spec.range else None
        kind = float if isinstance(lo, float) else int if isinstance(lo, int) else str
        names, default = o.flag, spec.shown if spec.shown is not None else o.default
        default = defaults.get(o.name, default)
    info = typer.Option(
        None,
        names,
        help=escape(f"{spec.help} [default: {default}]"),
        metavar="" if o.is_switch else None,
        show_default=False,
        rich_help_panel=spec.panel,
    )
    return inspect.Parameter(o.name, KEYWORD, default=info, annotation=kind | None)


KEYWORD = inspect.Parameter.KEYWORD_ONLY
PANELS = (None, PANEL_SAMPLING, PANEL_MEMORY, PANEL_RESEARCH)  # --help shows them in this order


def _panel_rank(p: inspect.Parameter) -> int:
    infos = [p.default, *getattr(p.annotation, "__metadata__", ())]
    panels = [i.rich_help_panel for i in infos if hasattr(i, "rich_help_panel")]
    return PANELS.index(panels[0]) if panels and panels[0] in PANELS else 0


def runtime_command(fn=None, *, preset: bool = True, defaults: dict | None = None):
    """`fn`, a command taking `runtime` (a checked RuntimeConfig), as a typer command with a
    flag per runtime option (RuntimeConfig's declarations) and `--preset`. The config is
    RuntimeConfig's defaults (then the command's `defaults`), then the preset's values, then
    the flags given; it is checked here, once, before the command runs."""
    if fn is None:
        return functools.partial(runtime_command, preset=preset, defaults=defaults)
    from ...runtime.loader import RuntimeConfig

    options = runtime_options(RuntimeConfig)
    hints = typing.get_type_hints(fn, include_extras=True)
    params = [
        p.replace(annotation=hints.get(p.name, p.annotation))
        for p in inspect.signature(fn).parameters.values()
        if p.name != "runtime"
    ]
    params += [_flag(o, defaults or {}) for o in options]
    if preset:
        params.append(inspect.Parameter("preset", KEYWORD, default=None, annotation=Preset))
    params = sorted((p.replace(kind=KEYWORD) for p in params), key=_panel_rank)

    @functools.wraps(fn)
    def command(**kw):
        given = {o.name: kw.pop(o.name) for o in options}
        name = kw.pop("preset", None)
        given = {k: v for k, v in given.items() if v is not None}
        return fn(**kw, runtime=runtime_config(given, name, defaults))

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    del command.__wrapped__  # typer reads the signature above, not fn's
    return command


Preset = Annotated[
    str | None,
    typer.Option(
        "--preset",
        help="A runtime preset from configs/runtime/ (e.g. laptop-24gb).",
        rich_help_panel=PANEL_MEMORY,
    ),
]


def runtime_config(options: dict, preset: str | None = None, defaults: dict | None = None):
    """A checked RuntimeConfig: its defaults (then `defaults`), then `preset`'s values, then
    `options` (runtime options by name)."""
    from ...runtime.loader import RuntimeConfig, apply_preset

    cfg = RuntimeConfig().replace(**(defaults or {}))
    if preset is not None:
        cfg = apply_preset(cfg, preset)
    cfg = cfg.replace(**options)
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
        None,
        "--max-kv-size",
        help="Keep at most this many positions (a rotating KV cache).",
        rich_help_panel=PANEL_MEMORY,
    ),
    "kv_bits": typer.Option(
        None,
        "--kv-bits",
        help="Bits of the quantized KV cache (default: not quantized).",
        rich_help_panel=PANEL_MEMORY,
    ),
    "kv_group_size": typer.Option(
        64,
        "--kv-group-size",
        help="Group size of the KV cache's quantization.",
        rich_help_panel=PANEL_MEMORY,
    ),
    "quantized_kv_start": typer.Option(
        5000,
        "--quantized-kv-start",
        help="With --kv-bits: quantize a layer's cache once it holds this many positions.",
        rich_help_panel=PANEL_MEMORY,
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
    if path.exists() and not path.is_file():  # (a write would replace /dev/null with a file)
        raise OptionError(f"{flag} {path}: not a regular file (a device, a pipe); name a file")
    if not where.is_dir():
        raise OptionError(f"{flag} {path}: no directory {where}")
    if not os.access(where, os.W_OK | os.X_OK):
        raise OptionError(f"{flag} {path}: cannot write in {where}")
    if suffix is not None and path.suffix.lower() != suffix:
        raise OptionError(
            f"{flag} {path}: writes {suffix[1:].upper()}; give a name ending in {suffix}"
        )


def check_outputs(
    model,
    outputs: dict[str, Path | None],
    suffixes: dict[str, str] | None = None,
    inputs: dict[str, Path | None] | None = None,
) -> None:
    """Before anything runs: each output file a flag names can be written
    (check_output_file, with its flag's suffix in `suffixes`), no two flags name one file
    (the second write replaced the first's), none names a file one of `inputs` reads (a
    prompt cache overwritten by the logits), and none names a file inside the model's store
    (a trace written over its manifest.json left the store unreadable); `model`: the
    --model given, or None."""
    seen = {Path(p).resolve(): f"{flag} reads it" for flag, p in (inputs or {}).items() if p}
    store = Path(model).resolve() if model is not None and Path(model).is_dir() else None
    home = None
    if model is None:  # the built-in model's stores, in strata-mlx's cache directory
        from ..default_model import cache_dir

        home = cache_dir().resolve()
    for flag, path in outputs.items():
        if path is None:
            continue
        check_output_file(path, flag, (suffixes or {}).get(flag))
        where = Path(path).resolve()
        if where in seen:
            raise OptionError(f"{flag} {path}: {seen[where]}; give each its own file")
        seen[where] = f"{flag} writes there too"
        if store is not None and store in where.parents:
            raise OptionError(f"{flag} {path}: inside the store {model}; write it elsewhere")
        if home is not None and (builtin := _store_above(where, home)) is not None:
            raise OptionError(
                f"{flag} {path}: inside the built-in model's store {builtin}; write it elsewhere"
            )


def _store_above(where: Path, home: Path) -> Path | None:
    """The store directory (one holding a manifest) below `home` that `where` lies in."""
    return next(
        (d for d in where.parents if home in d.parents and (d / "manifest.json").is_file()), None
    )


def kv_options(args: dict):
    """mlx-lm's KV cache flags (KV_FLAGS, in a command's `args` by name) as checked KVOptions."""
    from ...generation.prompt_cache import KVOptions

    names = ("max_kv_size", "kv_bits", "kv_group_size", "quantized_kv_start")
    kv = KVOptions(*(args[n] for n in names))
    kv.check(cli=True)
    return kv


def check_prompt_flags(
    prompt, prompt_tokens, system_prompt, chat_template_config, chat: bool | None = None
) -> None:
    """--prompt-tokens are the model's input as it is: a text prompt, a system prompt, the
    chat template's variables or --chat beside them would be dropped without a word."""
    if prompt_tokens is None:
        return
    for value, flag in (
        (prompt, "--prompt"),
        (system_prompt, "--system-prompt"),
        (chat_template_config, "--chat-template-config"),
        (True if chat else None, "--chat"),
    ):
        if value is not None:
            raise OptionError(
                f"--prompt-tokens and {flag}: token ids are the model's input as they are "
                "(no text, no chat template); give one or the other"
            )


def chat_flag(
    chat: bool | None, system_prompt: str | None, chat_template_config: str | None
) -> bool:
    """--chat/--no-chat: on when given, else when --system-prompt or --chat-template-config
    is (which --no-chat refuses)."""
    wants_chat = system_prompt is not None or chat_template_config is not None
    if chat is False and wants_chat:
        raise OptionError("--system-prompt and --chat-template-config need the chat template")
    return wants_chat if chat is None else chat
