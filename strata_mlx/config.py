"""The range of every option a user sets: one definition for the CLI, the server and the API.

Runtime options are declared once, as dataclass fields with `opt(...)` metadata
(runtime.options.RuntimeConfig and its groups); check_runtime() holds each to its declaration,
and the CLI, presets and bench's policy variants are derived from the same fields. Sampling,
plan and prompt options have their check functions here. `generate`, `serve`, `bench` and a
research script therefore refuse the same values the same way, before a model is loaded. Each
failure is an OptionError: a ValueError whose message is one line naming the option (as a flag
with `cli=True`, else by its Python / JSON name). Nothing here touches the disk or imports a
layer above format/.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

MAX_IO_WORKERS = 256
MAX_PREFILL_STEP = 1 << 20
MAX_SEED = (1 << 64) - 1  # mx.random.seed takes an unsigned 64-bit integer
MAX_INDEX = (1 << 31) - 1  # MLX slices and partitions with 32-bit integers
# The largest magnitude a number option takes where it has no bound of its own: MLX refuses
# an integer past int64 (`--temp 9223372036854775808` was a RuntimeError "std::bad_cast")
# and `--arena-gb 1e308` overflowed converting to bytes.
MAX_NUMBER = 1e9
MAX_TARGET_MEMORY_GB = 1 << 20  # plan --target-memory: a petabyte
MAX_PLAN_TOKENS = 1 << 24
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: -100 bans a token, 100 forces it
XTC_MAX_THRESHOLD = 0.5  # above it more than one token could exceed it: mlx-lm's bound
DEFAULT_MAX_TOKENS = 512  # serve: a request's max_tokens when it gives none
DEFAULT_MAX_QUEUE = 16  # serve: requests waiting behind the running ones
# serve: requests decoding together. Each step must hold the union of the batch's experts in
# the arena at once (up to rows x top-k per layer): mlx-lm's 32 rows of top-8 would ask for
# 256 experts a layer, every expert of most models, more than a laptop's arena holds.
DEFAULT_DECODE_CONCURRENCY = 8
DEFAULT_PROMPT_CONCURRENCY = 1  # serve: requests that prefill a chunk between two steps
DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # serve: seconds in-flight requests get after SIGTERM
# serve: the largest request body; a 262 K-token context's text is about 1 MB, JSON-escaped
# at most a few times that, while a 4 MB prompt already takes seconds of a core to tokenize
DEFAULT_MAX_BODY_BYTES = 4 << 20


class OptionError(ValueError):
    """A value a user gave that cannot be used: an option outside its range, a flag's bad
    text, a file a flag names that holds the wrong thing. The message is one line naming the
    option (or the file); `param` its Python / JSON name (the server's error body names it).
    The CLI reports these (and the other error types of ours) as one line; a plain ValueError
    is a bug and keeps its traceback."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def one_line(message: str, limit: int = 400) -> str:
    """An error's message on one line: its lines joined (a library's first line may end in a
    colon, the names it lists on the next), cut at `limit` characters."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name(name: str, cli: bool) -> str:
    return "--" + name.replace("_", "-") if cli else name


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(name: str, v: Any, lo: int, hi: int | None = None, cli: bool = False) -> int:
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        upper = f", {hi}]" if hi is not None else ", ...)"
        raise OptionError(
            f"{_name(name, cli)} {v!r}: expected an integer in [{lo}{upper}", param=name
        )
    return v


def check_number(
    name: str,
    v: Any,
    lo: float,
    hi: float | None = None,
    lo_open: bool = False,
    cli: bool = False,
) -> float:
    """A finite number in [lo, hi] ((lo, hi] with `lo_open`); no `hi` is MAX_NUMBER and a lo
    of -inf is -MAX_NUMBER."""
    hi = MAX_NUMBER if hi is None else hi
    lo = max(lo, -MAX_NUMBER)
    ok = _is_number(v) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        low = f"({lo:g}" if lo_open else f"[{lo:g}"
        high = f", {hi:g}]"
        raise OptionError(
            f"{_name(name, cli)} {v!r}: expected a finite number in {low}{high}", param=name
        )
    return v


def check_choice(name: str, v: Any, choices, cli: bool = False) -> str:
    if v not in choices:
        raise OptionError(
            f"{_name(name, cli)} {v!r}: one of {', '.join(map(str, choices))}", param=name
        )
    return v


# ---- runtime options declared once -----------------------------------------------------------
# A runtime option is one dataclass field (runtime.options.RuntimeConfig's, or a group of them
# such as prediction.ReadAhead) whose metadata is `opt(...)`: its help, range or choices, help panel,
# and bench's policy variant. The CLI flag (--name-with-dashes), the preset key and load()'s
# keyword are its name; check_runtime() holds every field to its range.

PANEL_MEMORY = "Memory and streaming"
PANEL_RESEARCH = "Research"
_OPTION = "strata_option"
_GROUP = "strata_group"


@dataclass(frozen=True)
class Option:
    """What a runtime option's field declares besides its default (see opt())."""

    help: str
    range: tuple | None = None
    lo_open: bool = False
    choices: tuple | None = None
    check: Callable[[Any, str], None] | None = None
    panel: str = PANEL_RESEARCH
    name: str | None = None
    variant: str | None = None
    shown: str | None = None
    switch: bool = False


def opt(
    help: str,
    range: tuple | None = None,
    *,
    lo_open: bool = False,
    choices: tuple | None = None,
    check: Callable[[Any, str], None] | None = None,
    panel: str = PANEL_RESEARCH,
    name: str | None = None,
    variant: str | None = None,
    shown: str | None = None,
    switch: bool = False,
) -> dict:
    """A runtime option's field metadata: `field(default=2, metadata=opt(...))`.

    `range` (lo, hi): an integer option when lo is an int, a finite number when a float
    (hi None: no bound of its own; `lo_open`: lo itself refused). `choices`: the values a
    text option takes. `check(value, flag)`: a further check that raises OptionError. A field
    whose default is None also takes None ("automatic"; `shown` says so in the help). `name`:
    the option's name where it differs from the field's (a group's field). `variant`: bench's
    policy-name variant, `:<variant>N` (a number) or `:<variant>0` / `:<variant>1` (a switch);
    an option with choices takes each choice as a variant when `variant` is "choices".
    `switch`: a yes-or-no option whose default is None (decided when the model loads)."""
    return {
        _OPTION: Option(help, range, lo_open, choices, check, panel, name, variant, shown, switch)
    }


def group() -> dict:
    """Metadata of a field that holds a dataclass of options (its own fields are options)."""
    return {_GROUP: True}


@dataclass(frozen=True)
class RuntimeOption:
    """One declared option as the CLI, presets and bench see it: `path` the attribute names
    from the config down to the field."""

    name: str
    path: tuple[str, ...]
    default: Any
    option: Option

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        return isinstance(self.default, bool) or self.option.switch


def _default(f) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def runtime_options(cls: type, path: tuple[str, ...] = ()) -> list[RuntimeOption]:
    """Every option `cls` (a dataclass) declares, its groups' included, in field order."""
    out = []
    for f in fields(cls):
        if f.metadata.get(_GROUP):
            out += runtime_options(type(_default(f)), (*path, f.name))
        elif _OPTION in f.metadata:
            o = f.metadata[_OPTION]
            out.append(RuntimeOption(o.name or f.name, (*path, f.name), _default(f), o))
    return out


def check_option(o: RuntimeOption, v: Any, cli: bool = False) -> None:
    """`v` for option `o`, or an OptionError naming it (as a flag with `cli`)."""
    if v is None and o.default is None:
        return
    flag = _name(o.name, cli)
    spec = o.option
    if o.is_switch:
        if not isinstance(v, bool):
            raise OptionError(f"{flag} {v!r}: expected true or false", param=o.name)
    elif spec.choices is not None:
        check_choice(o.name, v, spec.choices, cli=cli)
    elif spec.range is not None:
        lo, hi = spec.range
        if isinstance(lo, float):
            check_number(o.name, v, lo, hi, lo_open=spec.lo_open, cli=cli)
        else:
            check_int(o.name, v, lo, hi, cli=cli)
    if spec.check is not None:
        spec.check(v, flag)


def check_runtime(cfg, cli: bool = False) -> None:
    """Every option of a runtime.options.RuntimeConfig, by its declaration, and its research
    hooks: `dump` a callable, `trace` a RoutingTrace (strata_mlx.stream.stats), each or None
    (a file name given as `trace` loaded, then failed at the first layer)."""
    for o in runtime_options(type(cfg)):
        value = cfg
        for attr in o.path:
            value = getattr(value, attr)
        check_option(o, value, cli)
    dump, trace = getattr(cfg, "dump", None), getattr(cfg, "trace", None)
    if dump is not None and not callable(dump):
        raise OptionError(
            f"dump={dump!r}: a callable (layer, x, ids, scores, y), such as "
            "strata_mlx.generation.tools.MoeDumper(dir)",
            "dump",
        )
    if trace is not None and not callable(getattr(trace, "record", None)):
        raise OptionError(
            f"trace={trace!r}: a strata_mlx.stream.stats.RoutingTrace (write it to a file "
            "afterwards with strata_mlx.stream.trace.write)",
            "trace",
        )


def multiple_of_4kb(v: int, flag: str) -> None:
    if v % 4:
        raise OptionError(
            f"{flag} {v!r}: expected a multiple of 4 (direct I/O's 4 KB blocks)",
            param=flag.lstrip("-").replace("-", "_"),
        )


def check_context(
    prompt_tokens: int, max_tokens: int, context: Any, rotating: bool, cli: bool = False
) -> None:
    """The prompt and the tokens to generate fit the model's context (max_position_embeddings),
    unless a rotating KV cache (--max-kv-size) was chosen: past it the model reads positions it
    was never trained on and answers wrong without a word."""
    if not _is_int(context) or context <= 0:
        return
    check_prompt_length(prompt_tokens, context)  # the prompt alone, whatever the cache
    if not rotating and prompt_tokens + max_tokens > context:
        flag = _name("max_tokens", cli)
        raise OptionError(
            f"the prompt's {prompt_tokens} tokens + {flag} {max_tokens} are past the model's "
            f"context of {context} tokens: shorten them, or choose a rotating cache "
            f"({_name('max_kv_size', cli)})",
            "max_tokens",
        )


def check_plan(
    target_memory_gb: Any = None,
    target_ssd_gbps: Any = None,
    target_tflops: Any = None,
    io_workers: Any = 8,
    prompt_tokens: Any = 2048,
    gen_tokens: Any = 128,
    probe_seconds: Any = 1.0,
    arena_gb: Any = None,
    prefill_step_size: Any = None,
    cli: bool = False,
) -> None:
    """strata_mlx.plan's arguments: a target machine's memory, drive and compute are finite
    and > 0 (a target memory of nan or inf was a ValueError converting it to bytes, a drive of
    0 GB/s a ZeroDivisionError), worker and token counts in range (--io-workers 0 reached the
    native reader's own ValueError)."""
    if target_memory_gb is not None:
        check_number("target_memory", target_memory_gb, 0, MAX_TARGET_MEMORY_GB, True, cli)
    if target_ssd_gbps is not None:
        check_number("target_ssd_gbps", target_ssd_gbps, 0, lo_open=True, cli=cli)
    if target_tflops is not None:
        check_number("target_tflops", target_tflops, 0, lo_open=True, cli=cli)
    check_int("io_workers", io_workers, 1, MAX_IO_WORKERS, cli=cli)
    check_int("prompt_tokens", prompt_tokens, 1, MAX_PLAN_TOKENS, cli=cli)
    check_int("generation_tokens", gen_tokens, 0, MAX_PLAN_TOKENS, cli=cli)
    check_number("probe_seconds", probe_seconds, 0, 3600, lo_open=True, cli=cli)
    if arena_gb is not None:
        check_number("arena_gb", arena_gb, 0, lo_open=True, cli=cli)
    if prefill_step_size is not None:
        check_int("prefill_step_size", prefill_step_size, 1, MAX_PREFILL_STEP, cli=cli)


def check_sampling(
    max_tokens: Any, temp: Any, top_p: Any, seed: Any = None, cli: bool = False
) -> None:
    """Sampling arguments. top_p 0 is the limit of a shrinking nucleus: the most likely token
    (greedy), as the server has always read it; 1 is no filter."""
    check_int("max_tokens", max_tokens, 1, int(MAX_NUMBER), cli=cli)
    check_number("temp", temp, 0, cli=cli)
    check_number("top_p", top_p, 0, 1, cli=cli)
    if seed is not None:
        check_int("seed", seed, 0, MAX_SEED, cli=cli)


def check_sampler(
    temp: Any,
    top_p: Any,
    min_p: Any,
    min_tokens_to_keep: Any,
    top_k: Any,
    xtc_probability: Any,
    xtc_threshold: Any,
    cli: bool = False,
) -> None:
    """sampling.make_sampler's arguments, in its order. top_k 0 and min_p 0 are off."""
    check_number("temp", temp, 0, cli=cli)
    check_number("top_p", top_p, 0, 1, cli=cli)
    check_number("min_p", min_p, 0, 1, cli=cli)
    check_int("min_tokens_to_keep", min_tokens_to_keep, 1, MAX_INDEX, cli=cli)
    check_int("top_k", top_k, 0, MAX_INDEX, cli=cli)
    check_number("xtc_probability", xtc_probability, 0, 1, cli=cli)
    check_number("xtc_threshold", xtc_threshold, 0, XTC_MAX_THRESHOLD, cli=cli)


def check_logits_processors(
    logit_bias: Any,
    repetition_penalty: Any,
    repetition_context_size: Any,
    presence_penalty: Any = None,
    presence_context_size: Any = 20,
    frequency_penalty: Any = None,
    frequency_context_size: Any = 20,
    vocab_size: int | None = None,
    cli: bool = False,
) -> None:
    """sampling.make_logits_processors' arguments. A penalty of None is off (0 too). A context
    size is at least 1: mlx-lm takes 0, where tokens[-0:] silently means every token so far."""
    if repetition_penalty is not None:
        check_number("repetition_penalty", repetition_penalty, 0, cli=cli)
    check_int("repetition_context_size", repetition_context_size, 1, MAX_INDEX, cli=cli)
    for name, penalty, size in (
        ("presence", presence_penalty, presence_context_size),
        ("frequency", frequency_penalty, frequency_context_size),
    ):
        if penalty is not None:
            check_number(f"{name}_penalty", penalty, -math.inf, cli=cli)
        check_int(f"{name}_context_size", size, 1, MAX_INDEX, cli=cli)
    if logit_bias is None:
        return
    if not isinstance(logit_bias, dict):
        raise OptionError(
            f"logit_bias {logit_bias!r}: expected a map of token ids to biases", param="logit_bias"
        )
    for token, bias in logit_bias.items():
        if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            within = f"[0, {vocab_size})" if vocab_size is not None else "[0, ...)"
            raise OptionError(
                f"logit_bias: token id {token!r} outside {within}", param="logit_bias"
            )
        if not (_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise OptionError(
                f"logit_bias[{token}] {bias!r}: expected a number in "
                f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                param="logit_bias",
            )


def check_prompt_length(n_tokens: int, context: int | None, what: str = "prompt") -> None:
    """A prompt (`what`: the flag that gives it) longer than the model's context is refused (a
    9,200-token prompt to an 8,192-context model used to run for 12 minutes past what the
    model was trained on)."""
    if context is not None and n_tokens > context:
        raise OptionError(
            f"{what}: {n_tokens} tokens, more than the model's context of {context} "
            "(max_position_embeddings)"
        )


def parse_tokens(text: str, flag: str, what: str = "integers", example: str = "1,2,3") -> list[int]:
    """A flag's comma-separated integers: "1,2,3" (token ids, worker counts, slot counts:
    `what`, as the errors name them); an empty entry ("1,,2": a token lost to a typo) is
    refused, not dropped."""
    parts = [p.strip() for p in text.split(",")]  # ("1 2" is no "12": refused below)
    if any(parts) and not all(parts):
        raise OptionError(f"{flag} {text!r}: an empty entry; expected e.g. {example}")
    try:
        ids = [int(t) for t in parts if t]
    except ValueError:
        raise OptionError(
            f"{flag} {text!r}: expected comma-separated {what}, e.g. {example}"
        ) from None
    if not ids:
        raise OptionError(f"{flag}: empty; expected comma-separated {what}")
    return ids
