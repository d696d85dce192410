"""`strata-mlx convert`: one source (--hf-path, --gguf-path, --synthetic) into a store."""

from __future__ import annotations

from pathlib import Path

import typer

from ...config import (
    OptionError,
)

Q_MODES = ("affine", "mxfp4")  # convert_hf's q_mode


def convert(
    hf_path: Path | None = typer.Option(
        None, "--hf-path", help="Hugging Face checkpoint directory."
    ),
    gguf_path: Path | None = typer.Option(None, "--gguf-path", help="A GGUF file."),
    synthetic: str | None = typer.Option(
        None, "--synthetic", help="A named shape from configs/ (random weights)."
    ),
    mlx_path: Path = typer.Option(..., "--mlx-path", help="Output store directory."),
    quantize: bool = typer.Option(
        False, "--quantize", "-q", help="Quantize the experts.", metavar=""
    ),
    q_bits: int | None = typer.Option(None, "--q-bits", help="With -q: bits (default 4)."),
    q_group_size: int | None = typer.Option(
        None, "--q-group-size", help="With -q: inputs a scale (default 64)."
    ),
    q_mode: str | None = typer.Option(
        None,
        "--q-mode",
        help="With -q (--hf-path): affine (MLX affine, --q-bits/--q-group-size; the default) "
        "| mxfp4 (experts in OCP MXFP4, 4 bits in blocks of 32, as GPT-OSS ships; dense "
        "layers stay float).",
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="float16 | bfloat16 | float32"),
    calibration_tokens: int = typer.Option(
        256, "--calibration-tokens", help="Tokens for the routing profile (0: none)."
    ),
    split_experts: int | None = typer.Option(
        None, "--split-experts", help="Dense GGUF: split each MLP into E experts."
    ),
    router: str = typer.Option(
        "structured",
        "--router",
        help="Synthetic routing: structured (skewed, correlated) | uniform.",
    ),
    recipe: str = typer.Option(
        "default",
        "--recipe",
        help="Synthetic weights: default (outputs depend on the experts) | weak-experts "
        "(every residual update x0.02: experts hardly matter, routing drifts little between "
        "tokens).",
    ),
    set_: list[str] | None = typer.Option(
        None, "--set", help="Synthetic shape override, e.g. --set num_hidden_layers=8."
    ),
    seed: int = typer.Option(0, "--seed"),
    allow_non_finite: bool = typer.Option(
        False,
        "--allow-non-finite",
        metavar="",
        help="Convert weights holding NaN or inf (refused by default: they compute garbage).",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        metavar="",
        help="Replace an existing store at --mlx-path (kept until the new one is complete).",
    ),
):
    """Convert a checkpoint into a strata-mlx store."""
    flags = dict(locals())  # the arguments; _convert passes each converter the ones it takes
    sources = [s for s in (hf_path, gguf_path, synthetic) if s is not None]
    if len(sources) != 1:
        raise OptionError("give exactly one of --hf-path, --gguf-path, --synthetic")
    _check_source_flags(flags, "hf" if hf_path else "gguf" if gguf_path else "synthetic")
    if synthetic is not None:
        from ...convert.synthetic import Recipe

        flags["recipe"] = Recipe.named(recipe)  # a bad name: refused before any output
    from ...convert.common import check_output, overwriting

    check_output(mlx_path, *(s for s in (hf_path, gguf_path) if s), overwrite=overwrite)
    exit_on_signals()  # Ctrl-C and SIGTERM: the unfinished store removed, an exit at once
    if q_mode is not None and q_mode not in Q_MODES:
        raise OptionError(f"--q-mode {q_mode}: one of {', '.join(Q_MODES)}")
    if q_mode is not None and not quantize:
        raise OptionError(f"--q-mode {q_mode}: the mode of -q; add -q (--quantize)")
    for flag, value in (("--q-bits", q_bits), ("--q-group-size", q_group_size)):
        if value is not None and not quantize:  # (it wrote a float store without a word)
            raise OptionError(f"{flag} {value}: a setting of -q; add -q (--quantize)")
        if value is not None and q_mode == "mxfp4":  # (MXFP4's own: 4 bits, blocks of 32)
            raise OptionError(f"{flag} {value}: affine's; --q-mode mxfp4 has its own")
    q_bits = flags["q_bits"] = 4 if q_bits is None else q_bits
    q_group_size = flags["q_group_size"] = 64 if q_group_size is None else q_group_size
    if q_bits not in (2, 3, 4, 8):
        raise OptionError(f"--q-bits {q_bits}: one of 2, 3, 4, 8")
    if q_group_size not in (32, 64, 128):
        raise OptionError(f"--q-group-size {q_group_size}: one of 32, 64, 128")
    from ...config import MAX_SEED, check_int

    check_int("calibration_tokens", calibration_tokens, 0, 1 << 20, cli=True)
    check_int("seed", seed, 0, MAX_SEED, cli=True)
    with overwriting(overwrite):
        out = _convert(hf_path, gguf_path, synthetic, mlx_path, flags)
    typer.echo(f"wrote {out}")


# The flags only some sources take: (flag, its default, the sources that take it). A flag
# given to another source was ignored without a word (-q with --synthetic wrote a store of
# its shape's own format).
SOURCE_FLAGS = {
    "quantize": ("-q", False, ("hf",)),
    "q_bits": ("--q-bits", None, ("hf",)),
    "q_group_size": ("--q-group-size", None, ("hf",)),
    "q_mode": ("--q-mode", None, ("hf",)),
    "dtype": ("--dtype", None, ("hf", "synthetic")),
    "split_experts": ("--split-experts", None, ("gguf",)),
    "router": ("--router", "structured", ("synthetic",)),
    "recipe": ("--recipe", "default", ("synthetic",)),
    "set_": ("--set", None, ("synthetic",)),
    "seed": ("--seed", 0, ("synthetic",)),
    "allow_non_finite": ("--allow-non-finite", False, ("hf", "gguf")),
}
SOURCE_NAMES = {"hf": "--hf-path", "gguf": "--gguf-path", "synthetic": "--synthetic"}


def _check_source_flags(flags: dict, source: str) -> None:
    for name, (flag, default, takers) in SOURCE_FLAGS.items():
        if source not in takers and flags[name] not in (default, []):
            raise OptionError(
                f"{flag}: not taken by {SOURCE_NAMES[source]} "
                f"(only by {', '.join(SOURCE_NAMES[t] for t in takers)})"
            )


_WATCHING = False


def exit_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM end a conversion at once: its unfinished store is removed
    and the process exits 128 + the signal. Python runs a signal's handler only once the main
    thread is back in the interpreter, and one calibration layer of a large model inside MLX's
    evaluation took minutes on a CPU; the C-level handler writes the signal to a pipe, which a
    thread of its own reads whatever the main thread is doing."""
    import os
    import signal
    import sys
    import threading

    from ...format.writer import discard_unfinished, finish_committed

    global _WATCHING
    if _WATCHING or threading.current_thread() is not threading.main_thread():
        return
    _WATCHING = True
    read, write = os.pipe()
    os.set_blocking(write, False)

    # the watcher alone ends the process: a handler raising in the main thread would race it
    # (unwinding a commit's renames half-done, or exiting before its line is out)
    stops = (signal.SIGINT, signal.SIGTERM)
    for sig in stops:
        signal.signal(sig, lambda signum, frame: None)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch() -> None:
        signum = 0
        while signum not in stops:  # (the pipe carries every signal with a Python handler)
            signum = os.read(read, 1)[0]
        try:
            given_up, written = discard_unfinished(stop=True), finish_committed()
            what = f"; {', '.join(map(str, given_up))} not written" if given_up else ""
            what += f"; {', '.join(map(str, written))} written" if written else ""
            sys.stderr.write(f"\n{signal.Signals(signum).name}: stopped{what}\n")
            sys.stderr.flush()
        except BaseException:
            pass  # (stderr a pipe Ctrl-C closed: the exit below must come all the same)
        finally:
            os._exit(128 + signum)

    threading.Thread(target=watch, name="strata-signals", daemon=True).start()


def _set_value(item: str, was, value: str):
    """--set KEY=VALUE's value as the type the shape's KEY has (a bool from true / false:
    bool("false") is True)."""
    kind = type(was)
    if kind is bool:
        word = value.strip().lower()
        if word in ("true", "1", "yes"):
            return True
        if word in ("false", "0", "no"):
            return False
    else:
        try:
            return kind(value)
        except ValueError:
            pass
    raise OptionError(f"--set {item}: {value!r} is not a valid {kind.__name__}")


def _convert(hf_path, gguf_path, synthetic, mlx_path, flags: dict) -> Path:
    """The converter of the one source given, with the `convert` command's `flags` it takes."""
    if hf_path is not None:
        from ...convert.hf import convert_hf

        out = convert_hf(
            hf_path,
            mlx_path,
            flags["quantize"],
            q_bits=flags["q_bits"],
            q_group_size=flags["q_group_size"],
            q_mode=flags["q_mode"] or "affine",
            dtype=flags["dtype"],
            calibration_tokens=flags["calibration_tokens"],
            allow_non_finite=flags["allow_non_finite"],
        )
    elif gguf_path is not None:
        from ...convert.gguf import convert_gguf

        out = convert_gguf(
            gguf_path,
            mlx_path,
            split_experts=flags["split_experts"],
            calibration_tokens=flags["calibration_tokens"],
            allow_non_finite=flags["allow_non_finite"],
        )
    else:
        from ...convert.synthetic import convert_synthetic, synthetic_config

        config = synthetic_config(synthetic)
        for item in flags["set_"] or []:
            key, sep, value = item.partition("=")
            if not sep or key not in config:
                raise OptionError(
                    f"--set {item}: expected KEY=VALUE with KEY one of {sorted(config)}"
                )
            config[key] = _set_value(item, config[key], value)
        out = convert_synthetic(
            synthetic,
            mlx_path,
            config=config,
            router=flags["router"],
            seed=flags["seed"],
            calibration_tokens=flags["calibration_tokens"],
            dtype=flags["dtype"] or "float16",
            recipe=flags["recipe"],
        )
    return out
