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


class OptionError(ValueError):
    """An option outside its range; the message is one line naming the option."""


def _name(name: str, cli: bool) -> str:
    return "--" + name.replace("_", "-") if cli else name


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(name: str, v: Any, lo: int, hi: int | None = None, cli: bool = False) -> int:
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        upper = f", {hi}]" if hi is not None else ", ...)"
        raise OptionError(f"{_name(name, cli)} {v!r}: expected an integer in [{lo}{upper}")
    return v


def check_number(
    name: str,
    v: Any,
    lo: float,
    hi: float | None = None,
    lo_open: bool = False,
    cli: bool = False,
) -> float:
    ok = _is_number(v) and math.isfinite(v) and (v > lo if lo_open else v >= lo)
    if ok and hi is not None:
        ok = v <= hi
    if not ok:
        low = f"({lo}" if lo_open else f"[{lo}"
        high = f", {hi}]" if hi is not None else ", inf)"
        raise OptionError(f"{_name(name, cli)} {v!r}: expected a finite number in {low}{high}")
    return v


def check_choice(name: str, v: Any, choices, cli: bool = False) -> str:
    if v not in choices:
        raise OptionError(f"{_name(name, cli)} {v!r}: one of {', '.join(map(str, choices))}")
    return v


def check_runtime(cfg, cli: bool = False) -> None:
    """Every field of a loader.RuntimeConfig."""
    from .arena import POLICIES
    from .decode import MODES
    from .prediction import READ_AHEAD_POLICIES

    if cfg.arena_gb is not None:
        check_number("arena_gb", cfg.arena_gb, 0, lo_open=True, cli=cli)
    check_int("io_workers", cfg.io_workers, 1, MAX_IO_WORKERS, cli=cli)
    check_choice("read_ahead", cfg.read_ahead, READ_AHEAD_POLICIES, cli=cli)
    check_int("static_cap", cfg.static_cap, 0, cli=cli)
    check_int("lookahead_min_tokens", cfg.lookahead_min_tokens, 1, cli=cli)
    check_number("lookahead_decode_min_miss", cfg.lookahead_decode_min_miss, 0, 1, cli=cli)
    check_choice("eviction", cfg.eviction, sorted(POLICIES), cli=cli)
    if cfg.prefill_step_size is not None:
        check_int("prefill_step_size", cfg.prefill_step_size, 1, MAX_PREFILL_STEP, cli=cli)
    check_choice("decode", cfg.decode, MODES, cli=cli)
    check_int("decode_lag", cfg.decode_lag, 0, 1 << 10, cli=cli)
    check_number("decode_sync_above", cfg.decode_sync_above, 0, 1, cli=cli)
    for name in ("verify", "fake_stream"):
        if not isinstance(getattr(cfg, name), bool):
            raise OptionError(f"{_name(name, cli)} {getattr(cfg, name)!r}: expected true or false")


def check_sampling(
    max_tokens: Any, temp: Any, top_p: Any, seed: Any = None, cli: bool = False
) -> None:
    """Sampling arguments. top_p 0 is the limit of a shrinking nucleus: the most likely token
    (greedy), as the server has always read it; 1 is no filter."""
    check_int("max_tokens", max_tokens, 1, cli=cli)
    check_number("temp", temp, 0, cli=cli)
    check_number("top_p", top_p, 0, 1, cli=cli)
    if seed is not None:
        check_int("seed", seed, 0, MAX_SEED, cli=cli)


def check_prompt_length(n_tokens: int, context: int | None) -> None:
    """A prompt longer than the model's context is refused (a 9,200-token prompt to an
    8,192-context model used to run for 12 minutes past what the model was trained on)."""
    if context is not None and n_tokens > context:
        raise OptionError(
            f"prompt: {n_tokens} tokens, more than the model's context of {context} "
            "(max_position_embeddings)"
        )
