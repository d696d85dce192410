"""The range of every option a user sets: one definition for the CLI, the server and the API.

`load()` checks its RuntimeConfig here and `stream_generate()` its sampling arguments and
prompt length, so `generate`, `serve`, `bench` and a research script refuse the same values
the same way (`--arena-gb 0` used to run with one slot in `generate` while `serve` refused
it). The CLI also calls these before loading a model, so a bad flag fails at once. Each
failure is an OptionError: a ValueError whose message is one line naming the option (as a
flag with `cli=True`, else by its Python / JSON name). Nothing here touches the disk.
"""

from __future__ import annotations

import math
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
DEFAULT_MAX_QUEUE = 16  # serve: requests waiting behind the running one
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


def check_runtime(cfg, cli: bool = False) -> None:
    """Every field of a loader.RuntimeConfig."""
    from .runtime.decode import MODES
    from .stream.policies import check as check_policy
    from .stream.prediction import READ_AHEAD_POLICIES
    from .stream.scheduler import SCHEDULERS

    if cfg.arena_gb is not None:
        check_number("arena_gb", cfg.arena_gb, 0, lo_open=True, cli=cli)
    check_int("io_workers", cfg.io_workers, 1, MAX_IO_WORKERS, cli=cli)
    check_int("read_split_kb", cfg.read_split_kb, 0, 1 << 20, cli=cli)
    if cfg.read_split_kb % 4:
        raise OptionError(
            f"{_name('read_split_kb', cli)} {cfg.read_split_kb!r}: expected a multiple of 4 "
            "(direct I/O's 4 KB blocks)",
            param="read_split_kb",
        )
    ra = cfg.read_ahead  # a ReadAhead; its fields by their option names (loader.READ_AHEAD_OPTIONS)
    check_choice("read_ahead", ra.policy, READ_AHEAD_POLICIES, cli=cli)
    check_int("static_cap", ra.static_cap, 0, cli=cli)
    check_int("lookahead_min_tokens", ra.min_tokens, 1, cli=cli)
    check_number("lookahead_decode_min_miss", ra.decode_min_miss, 0, 1, cli=cli)
    check_int("lookahead_depth", ra.depth, 1, 1 << 10, cli=cli)
    check_policy(cfg.eviction, _name("eviction", cli))
    check_choice("scheduler", cfg.scheduler, SCHEDULERS, cli=cli)
    if cfg.scheduler_low_water is not None:
        check_int("scheduler_low_water", cfg.scheduler_low_water, 0, 1 << 20, cli=cli)
    if cfg.prefill_step_size is not None:
        check_int("prefill_step_size", cfg.prefill_step_size, 1, MAX_PREFILL_STEP, cli=cli)
    check_choice("decode", cfg.decode, MODES, cli=cli)
    check_int("decode_lag", cfg.decode_lag, 0, 1 << 10, cli=cli)
    check_number("decode_sync_above", cfg.decode_sync_above, 0, 1, cli=cli)
    check_number("decode_token_below", cfg.decode_token_below, 0, 1, cli=cli)
    check_int("decode_chunk", cfg.decode_chunk, 1, 1 << 10, cli=cli)
    check_int("decode_layers_chunk", cfg.decode_layers_chunk, 1, 1 << 10, cli=cli)
    if cfg.experts_per_token is not None:
        check_int("experts_per_token", cfg.experts_per_token, 1, 1 << 20, cli=cli)
    check_number("moce_bonus", cfg.moce_bonus, 0, cli=cli)
    for name in (
        "verify",
        "fake_stream",
        "decode_token_while_predicting",
        "read_overlap",
        "device_copy",
    ):
        if not isinstance(getattr(cfg, name), bool):
            raise OptionError(f"{_name(name, cli)} {getattr(cfg, name)!r}: expected true or false")


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


def check_prompt_length(n_tokens: int, context: int | None) -> None:
    """A prompt longer than the model's context is refused (a 9,200-token prompt to an
    8,192-context model used to run for 12 minutes past what the model was trained on)."""
    if context is not None and n_tokens > context:
        raise OptionError(
            f"prompt: {n_tokens} tokens, more than the model's context of {context} "
            "(max_position_embeddings)"
        )


def parse_tokens(text: str, flag: str) -> list[int]:
    """A flag's comma-separated integers: "1,2,3" (token ids, worker counts)."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise OptionError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise OptionError(f"{flag}: empty; expected comma-separated integers")
    return ids
