"""`strata-mlx plan MODEL`: will this model run here (or on another machine), and how fast?

The package: shapes (a model's shape), machine (what this or another machine does),
calibration (the compute model measured once per machine and model shape, cached: what a
default forecast of a store uses, so that it answers in seconds), residency (the arena's hit
rates), forecasting (the forecast itself and the arena and chunk it recommends).

Owns the forecast: from a store, a Hugging Face checkpoint directory (config.json and the
safetensors headers only) or a GGUF file (its header only), plus a machine (this one: its
memory and a short probe of the drive; or `--target-memory` / `--target-ssd-gbps`; its compute
at `--target-tflops`), it says whether the model fits with the KV cache of the prompt and the
generated tokens (-p + -g positions, within the model's context), the arena and prefill chunk
load() would pick (loader.choose_arena, the same code, with room for that KV cache), the share
of experts resident, and the expected prefill and decode tok/s.
Never converts anything and never allocates an arena beyond the short runs that measure the
compute of a store on this machine (calibration's, once per shape, or --measure's).

The model (measured against `strata-mlx bench`: docs/benchmarks.md, "Forecasts"):
  - Popularity: the routing profile's per-layer counts give p_i, the chance that a token
    picks expert i (uniform k/E without a profile), with Good-Turing's share for the experts
    calibration never saw (smoothed_shares). A chunk of T tokens needs expert i with
    q_i = 1 - (1 - p_i)^T; its distinct experts are the sum of the q_i.
  - Residency: the arena is LRU over a layer-major sweep, so an expert needed again after g
    chunks (tokens, in decode) is still resident iff fewer than `slots` distinct experts were
    needed in between: U(g) = sum_i 1 - (1 - q_i)^g <= slots. g* is the largest such g, and
    an expert is a hit with probability 1 - (1 - q_i)^min(g*, history) (Che's approximation,
    with the deterministic gaps of a sweep). When one chunk needs more than the arena holds,
    g* = 0: every chunk reads all it needs (LRU on a cyclic sweep). The default eviction
    policy (nextuse-duel) usually keeps more of what decode reuses than LRU does (25-47 %
    fewer decode bytes on the full-size store on an H200; within 8 % of LRU's misses where the
    arena holds a forward pass's experts), so its hit rate is mostly above this one.
  - Prefill: each chunk takes max(read floor, compute floor): bytes it reads over the probe's
    GB/s at the I/O worker count, and the fake-stream chunk time (or FLOPs over a rate). The
    probe is the data path's (probe_data_path: the drive and every step into the arena) where
    the cache reads through a bounce buffer or the CUDA device copy, else probe-ssd's
    (machine.read_floor_source).
  - Decode: of a token's k lookups a layer, 1 - hit are not resident, hit taken token by
    token from what the cold prefill's sweep left in the arena as decode's own working set
    replaces it (decode_hits: the first tokens after a long prompt miss far more than the
    steady state); lookahead predicts a share `recall` of them from an earlier layer's
    input (measured with the experts' real outputs: each layer's input through the next
    layers' routers; the sync handshake's predictions of a layer from the `depth` layers
    before it, together, by their measured union: they miss alike; independent guesses for a
    target machine), which are streamed ahead, and the rest are misses. The decoder's mode
    follows its own rule (decode.choose_mode), simulated token by token: the running share
    of layers with a miss (0.02 a layer toward each observation, from 0) puts it in "sync"
    above decode_sync_above, else "layers" while lookahead predicts (unless
    decode_token_while_predicting), else "token". A token costs that mode's fake-stream
    decode time (its per-layer routing syncs included), plus in "sync" mode, on every
    layer, the handshake's Python and on a GPU its route sync beyond the device's compute (both
    measured in a short real decode: the sync waits on the lookahead routers and the device's
    work around landing reads, whether or not the layer missed), plus what its absent
    lookups cost, plus in "layers" mode one synced layer recomputed for each layer that
    missed. An absent lookup costs what one cost in that short real decode (the token's
    time beyond compute and handshake over its absent lookups: the drive at the queue depth
    decode keeps, the predictions read in vain, the device's work on fresh slots); for a
    target machine, or when that decode read too little, the misses' reads at the probe's
    bandwidth for that many in flight, and streamed-ahead reads only what the layers
    between prediction and use do not hide.
  - Cost: chunks and decode tokens one by one up to residency.EXACT_STEPS, then in runs
    (residency.runs), so that -p and -g in the millions take a second, not a step each.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ...config import OptionError, check_prompt_length
from ...format.store import StoreError
from ...stream.reader import drive_from_env, drive_note
from . import calibration
from .forecasting import Forecast, compare, decode_forecast, forecast, save
from .machine import (
    GB,
    MEASURE_MODES,
    MIN_ABSENT,
    REFERENCE_LAPTOP_MEMORY_GBPS,
    REFERENCE_LAPTOP_TFLOPS,
    Compute,
    Machine,
    RealDecode,
    estimate_compute,
    lookahead_recall,
    measure_compute,
    measure_real,
    measured_memory_gbps,
    measured_tflops,
    target_machine,
    this_machine,
)
from .residency import decode_hits, hit_probability, pick_probabilities, reuse_gap, smoothed_shares
from .shapes import ModelShape, from_store, model_shape


def plan(
    model: str | Path,
    arena_gb: float | None = None,
    prefill_step_size: int | None = None,
    prompt_tokens: int = 2048,
    gen_tokens: int = 128,
    io_workers: int = 8,
    target_memory_gb: float | None = None,
    target_ssd_gbps: float | None = None,
    target_tflops: float | None = None,
    measure: bool = False,
    measure_tokens: int | None = None,
    probe_seconds: float = 1.0,
    q_bits: int | None = None,
    split_experts: int | None = None,
    cli: bool = False,
) -> Forecast:
    """The forecast for `model` on this machine, or on a target machine where
    `target_memory_gb` / `target_ssd_gbps` are given (the other taken from this one);
    `target_tflops` alone: this machine's memory and drive, its compute estimated at that
    rate. Errors name the options as flags with `cli`."""
    from ...runtime.loader import default_prefill_step, physical_memory

    shape = model_shape(model, q_bits, split_experts)
    if shape.n_records == 0:
        raise StoreError(f"{model}: no experts (a dense model): nothing streams")
    check_context(shape.args, prompt_tokens, gen_tokens, cli)
    targeted = target_memory_gb is not None or target_ssd_gbps is not None
    if measure:
        _check_measure(shape, targeted or target_tflops is not None, cli)
    if targeted:
        here = None
        if target_memory_gb is None or target_ssd_gbps is None:
            here = this_machine(shape, io_workers, probe_seconds)
        machine = target_machine(
            target_memory_gb if target_memory_gb is not None else here.memory_bytes / GB,
            target_ssd_gbps if target_ssd_gbps is not None else here.ssd_gbps,
            io_workers,
            "given" if target_ssd_gbps is not None else here.read_source,
        )
    else:
        machine = this_machine(shape, io_workers, probe_seconds)
    step = prefill_step_size or default_prefill_step(
        machine.memory_bytes if targeted else physical_memory()
    )
    notes = []
    if targeted:
        tflops = target_tflops or REFERENCE_LAPTOP_TFLOPS
        compute = estimate_compute(shape, tflops, REFERENCE_LAPTOP_MEMORY_GBPS)
        source = f"estimate: {tflops:g} TFLOP/s"
        if target_tflops is None:
            notes.append(
                f"target compute taken as the reference 24 GB laptop's ({tflops:g} TFLOP/s "
                "effective; --target-tflops to change)"
            )
    elif measure:
        tokens = measure_tokens or min(step, prompt_tokens)
        fake_arena = min(arena_gb or 1.0, 1.0, shape.expert_bytes / GB)
        with _steps("plan --measure", 4 + len(MEASURE_MODES)) as say:
            on_gpu = calibration.backend() == "gpu"
            compute = measure_compute(Path(shape.path), step, tokens, 8, fake_arena, say, on_gpu)
        source = f"fake-stream, {tokens} tokens"
    elif shape.source == "store" and target_tflops is None:
        compute, source, note = _calibrated(shape, arena_gb, step, prompt_tokens)
        notes.append(note)
    else:
        tflops = target_tflops or measured_tflops()
        compute = estimate_compute(shape, tflops, measured_memory_gbps())
        source = f"estimate: {tflops:.3g} TFLOP/s"
        notes.append(
            "compute estimated from FLOPs at the given TFLOP/s (this machine's memory and drive)"
            if target_tflops is not None
            else "compute estimated from FLOPs (no store to time in fake-stream mode)"
        )
    notes += _machine_notes(machine, targeted)
    f = forecast(shape, machine, compute, source, arena_gb, step, prompt_tokens, gen_tokens)
    f.notes = notes + f.notes
    return f


def check_context(args, prompt_tokens: int, gen_tokens: int, cli: bool = False) -> None:
    """-p and -g within the context of the model whose ModelArgs are `args`, as generate
    refuses them (config.check_context, without its rotating cache): past it a forecast (or a
    bench run) is of a run generate does not make, and a KV cache the model never holds."""
    context = getattr(args, "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        return
    p, g = ("-p", "-g") if cli else ("prompt_tokens", "gen_tokens")
    check_prompt_length(prompt_tokens, context, p)
    if prompt_tokens + gen_tokens > context:
        raise OptionError(
            f"{p} {prompt_tokens} + {g} {gen_tokens} = {prompt_tokens + gen_tokens} tokens, past "
            f"the model's context of {context} (max_position_embeddings): shorten {p} or {g}",
            "gen_tokens",
        )


def _check_measure(shape: ModelShape, targeted: bool, cli: bool) -> None:
    """--measure times a store's own chunk on this machine: nothing to time for a checkpoint
    or a GGUF, and this machine's time is no target's."""
    flag = "--measure" if cli else "measure"
    if targeted:
        target = "--target-memory/--target-ssd-gbps/--target-tflops" if cli else "target_*"
        raise OptionError(
            f"{flag} times this machine: it cannot forecast a target machine ({target})",
            "measure",
        )
    if shape.source != "store":
        what = "a Hugging Face checkpoint" if shape.source == "hf" else "a GGUF file"
        raise OptionError(
            f"{flag} times a store's own chunk: {shape.path} is {what} (convert it first)",
            "measure",
        )


def _machine_notes(machine: Machine, targeted: bool) -> list[str]:
    """What the forecast's machine reads through, and how its decode differs from the
    forecast's."""
    from ...runtime.experts import device_gate_available

    notes = []
    if drive_from_env():
        notes.append(f"reads through {drive_note()}")
    if machine.read_source == "data path":
        notes.append(
            "reads here land through a bounce buffer or the device copy: the read floor is the "
            "data path's GB/s (the drive and every step into the arena), not probe-ssd's"
        )
    if not targeted and device_gate_available():
        notes.append(
            "decode is forecast through the per-layer handshake, as Metal decodes; this "
            "device gates decode by default (--no-decode-gate decodes as forecast), measured "
            "1.3-1.8x as fast on an H100 with misses"
        )
    return notes


def _calibrated(
    shape: ModelShape, arena_gb: float | None, step: int, prompt_tokens: int
) -> tuple[Compute, str, str]:
    """(compute, its source, a note) from this machine's cached calibration of `shape`, made
    now if there is none for what this backend times (calibration.calibration_plan)."""
    plan_ = calibration.calibration_plan(calibration.backend(), step, prompt_tokens)
    cal = calibration.cached(shape, plan_)
    if cal is None:
        fake_arena = min(arena_gb or shape.expert_bytes / 4 / GB, 1.0)
        # load, compile, each chunk, each decode mode, real decode
        steps = 3 + len(plan_.chunk_tokens) + bool(plan_.prefix) + len(MEASURE_MODES)
        with _steps("calibrating this machine (once per model shape)", steps) as say:
            cal = calibration.calibrate(Path(shape.path), fake_arena, say, plan_)
        calibration.store(shape, plan_, cal)
        source = "calibrated now, cached"
    else:
        source = "calibrated, cached"
    timed = (
        f"one chunk of {plan_.chunk_tokens[0]} tokens timed"
        if plan_.kind == "chunk"
        else "a line through chunks of "
        + " and ".join(map(str, plan_.chunk_tokens))
        + " tokens"
        + (
            f", and {calibration.POSITION_TOKENS} after {plan_.prefix} for the attention's growth"
            if plan_.prefix
            else ""
        )
    )
    note = (
        f"compute from this machine's calibration ({timed}; {calibration.cache_file()}); "
        "--measure times this store's own chunk"
    )
    return cal.compute(step), source, note


@contextmanager
def _steps(title: str, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar over named steps (on stderr): yields `say(name)`, called before each."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=title, unit="step", file=sys.stderr, leave=False)
    started = [False]

    def say(name: str) -> None:
        if started[0]:
            bar.update(1)
        started[0] = True
        bar.set_postfix_str(name)

    try:
        yield say
    finally:
        bar.close()


__all__ = [
    "GB", "MIN_ABSENT", "Compute", "Forecast", "Machine", "ModelShape", "RealDecode",
    "check_context", "compare", "decode_forecast", "decode_hits", "forecast", "from_store",
    "hit_probability", "lookahead_recall", "measure_real", "model_shape", "pick_probabilities",
    "plan", "reuse_gap", "save", "smoothed_shares",
]  # fmt: skip
