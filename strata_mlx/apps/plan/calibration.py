"""The compute model plan uses by default: measured once on this machine for a model's shape and
cached, so that a later forecast answers in seconds.

Owns the calibration (a short fake-stream run and a short real decode, both far shorter than
plan --measure's) and its cache file under the per-user cache directory
($STRATA_MLX_HOME or ~/.cache/strata-mlx), one file per machine and MLX backend, an entry per
model shape (the same shape computes alike whatever its weights). Never measures when a
cached entry matches, and never writes the cache file except whole (temp path then rename).

What prefill is timed on depends on the backend (calibration_plan). On the CPU a chunk of n
tokens from position p is fitted as a + b * n + c * n * (p + n) through three chunks: one of 8
tokens, which pays the per-layer dispatch that a long one spreads over its tokens; one of the
forecast's own size up to LONG_CAP tokens; and one of POSITION_TOKENS after PREFIX_TOKENS
positions whose KV cache is filled with random keys and values rather than computed (the
attention costs the same whatever they hold), which gives c: the attention over every position
before a token and over its whole chunk (the causal half would be n * (p + n / 2): the
measured times follow n * (p + n), as an attention that computes the square and then masks
it would). The built-in model's fake-stream prefill took 22 ms a token in a 128-token
chunk at the prompt's start, 57 in one after 1920 positions, and 57 in a single chunk of 2048:
a line through chunks at the start alone forecast that chunk at 0.35 of its speed
(docs/benchmarks.md). Decode pays c for each position past the one its time was measured at.
LONG_CAP keeps a calibrating plan near 8 s on that model (a cap of 256 took it to 14-30 s
under load 4-6).

On a GPU a chunk's time is the weight traffic of the distinct experts it touches, which stops
growing once a chunk touches most of them: a line through two short chunks overstated a
1024-token chunk several fold on an H200. There one chunk of the
forecast's own size is timed (a warm-up and one timed run: under a second). An entry is cached
under what it timed, so a calibration of one kind never answers for the other.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .machine import Compute, measure_real
from .shapes import ModelShape

CALIBRATION_VERSION = 4  # bump when the measurement changes: older entries are measured again
# the CPU's per-chunk time is fitted on a chunk of SHORT_TOKENS and one of the forecast's chunk
# (at least LONG_TOKENS, at most LONG_CAP) at the prompt's start, and one of POSITION_TOKENS
# after a prefix of PREFIX_TOKENS whose KV cache is filled without computing it
SHORT_TOKENS, LONG_TOKENS, LONG_CAP = 8, 32, 128
POSITION_TOKENS, PREFIX_TOKENS = 32, 1024
DECODE_TOKENS = 4
RECALL_TOKENS = 16


@dataclass(frozen=True)
class CalibrationPlan:
    """What a calibration times for prefill: "slope" fits a + b * tokens on two chunks
    (the CPU); "chunk" times one chunk of the forecast's own size (a GPU). `sync_per_layer`:
    the real handshake's route sync beyond the device's compute is measured and charged to
    every synced decode layer (a GPU, where the host waits on the device at each sync; on the CPU
    the two syncs differ by less than the noise of a four-token decode, and a difference kept
    only when positive would add that noise as a cost)."""

    kind: str
    chunk_tokens: tuple[int, ...]
    sync_per_layer: bool = False
    prefix: int = 0  # "slope": a chunk of POSITION_TOKENS after this many positions (0: none)

    @property
    def key(self) -> str:
        """What was calibrated, as the cache keys it."""
        sync = "-sync" if self.sync_per_layer else ""
        at = f"-at{self.prefix}" if self.prefix else ""
        return f"{self.kind}-{'-'.join(map(str, self.chunk_tokens))}{at}{sync}"


def backend() -> str:
    """The backend calibration runs on: "gpu" where MLX's default device is a GPU (Metal or
    CUDA), else "cpu"."""
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def calibration_plan(backend: str, step: int, prompt_tokens: int) -> CalibrationPlan:
    """The prefill chunks a calibration times on `backend` ("cpu" or "gpu") for a forecast in
    chunks of `step` tokens of a `prompt_tokens` prompt (module docstring: why they differ)."""
    if backend == "gpu":
        return CalibrationPlan("chunk", (max(1, min(step, prompt_tokens)),), True)
    return CalibrationPlan(
        "slope", (SHORT_TOKENS, long_chunk(step, prompt_tokens)), prefix=PREFIX_TOKENS
    )


def long_chunk(step: int, prompt_tokens: int) -> int:
    """The CPU line's long chunk: the forecast's own chunk (a prompt shorter than `step` is
    one chunk of the prompt), within LONG_TOKENS..LONG_CAP."""
    return max(LONG_TOKENS, min(step, prompt_tokens, LONG_CAP))


@dataclass
class Calibration:
    """What a model shape costs on this machine with every expert resident, and what its short
    real decode measured (the handshake's Python and its route sync beyond the compute, per
    layer; lookahead's recall; an absent lookup)."""

    chunk_fixed_s: float  # a prefill chunk's cost beyond its tokens' (per-layer dispatch)
    prefill_token_s: float  # each token of a chunk
    decode_s: float  # per token, "token" mode
    decode_layers_s: float
    decode_sync_s: float
    handshake_s: float
    recall: dict[int, float] = field(default_factory=dict)
    recall_union: dict[int, float] = field(default_factory=dict)
    absent_s: float | None = None
    measured_at: float = 0.0
    calibrated: str = ""  # CalibrationPlan.key: what prefill was timed on
    sync_beyond_s: float = 0.0  # per decode layer: the real route sync beyond the compute
    position_s: float = 0.0  # per chunk token per position it attends over (Compute's)
    decode_at: int = 0  # the position decode_s was timed at

    def compute(self, step: int) -> Compute:
        """The forecast's Compute for prefill chunks of `step` tokens."""
        per_token = self.prefill_token_s + self.chunk_fixed_s / max(step, 1)
        return Compute(
            per_token,
            self.decode_s,
            self.decode_layers_s,
            self.decode_sync_s,
            handshake_s=self.handshake_s,
            recall=dict(self.recall),
            recall_union=dict(self.recall_union),
            absent_s=self.absent_s,
            sync_beyond_s=self.sync_beyond_s,
            position_s=self.position_s,
            decode_at=self.decode_at,
        )

    @classmethod
    def from_json(cls, d: dict) -> Calibration:
        """A cached calibration; ValueError where a figure could not have been measured (a
        time not finite or below 0, a token's time of 0, a recall outside [0, 1]), so
        that `cached` takes the entry for none and calibrates again: a cache holding NaN
        forecast "nan tok/s" and a compute floor of minus 2 million ms."""
        d = dict(d)
        d["recall"] = {int(k): float(v) for k, v in d.get("recall", {}).items()}
        d["recall_union"] = {int(k): float(v) for k, v in d.get("recall_union", {}).items()}
        cal = cls(**d)
        times = (cal.decode_layers_s, cal.decode_sync_s, cal.handshake_s, cal.sync_beyond_s,
                 cal.position_s, cal.absent_s or 0.0)  # fmt: skip
        per_token = (cal.prefill_token_s, cal.decode_s)
        shares = (*cal.recall.values(), *cal.recall_union.values())
        if not (
            math.isfinite(cal.chunk_fixed_s)
            and all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in per_token)
            and all(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 for t in times)
            and all(0.0 <= r <= 1.0 for r in shares)
        ):
            raise ValueError("a calibration figure out of its range")
        return cal


def machine_key() -> str:
    """This machine and backend: host, CPU, core count, MLX version and default device, and
    the emulated drive where one is set (an absent lookup's cost is the drive's)."""
    import os

    import mlx.core as mx

    from ...stream.reader import drive_from_env

    device = str(mx.default_device()).replace("Device(", "").rstrip(")").replace(", ", "")
    parts = [platform.node(), platform.machine(), str(os.cpu_count()), mx.__version__, device]
    if drive := drive_from_env():
        parts.append(f"drive{drive:g}")
    return "-".join(p.replace("/", "_").replace(" ", "_") for p in parts if p)


def shape_key(shape: ModelShape) -> str:
    """The same key for every store of one shape (a synthetic store computes like the model)."""
    fields = (
        shape.model_type,
        shape.record_bytes,
        shape.num_experts,
        shape.moe_layers,
        shape.top_k,
        shape.dense_bytes,
        shape.active_params,
        CALIBRATION_VERSION,
    )
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def cache_file() -> Path:
    from ..default_model import cache_dir

    return cache_dir() / "plan" / f"calibration-{machine_key()}.json"


def entry_key(shape: ModelShape, plan: CalibrationPlan) -> str:
    """A cache entry's key: the shape, and what its prefill was timed on."""
    return f"{shape_key(shape)}-{plan.key}"


def cached(shape: ModelShape, plan: CalibrationPlan) -> Calibration | None:
    """The cached calibration of `shape` by `plan` on this machine, or None."""
    try:
        entries = json.loads(cache_file().read_text())
        return Calibration.from_json(entries[entry_key(shape, plan)])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(shape: ModelShape, plan: CalibrationPlan, cal: Calibration) -> None:
    """Add `cal` to this machine's cache file (whole: temp path then rename). A cache that
    cannot be written costs the next plan a calibration, nothing else."""
    from ...format.store import write_text_atomic

    path = cache_file()
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[entry_key(shape, plan)] = asdict(cal)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(entries, indent=1))
    except OSError:
        pass


def calibrate(
    path: Path,
    arena_gb: float,
    progress: Callable[[str], None] | None = None,
    plan: CalibrationPlan = CalibrationPlan("slope", (SHORT_TOKENS, LONG_TOKENS)),
) -> Calibration:
    """Measure a store's shape on this machine: fake-stream prefill chunks as `plan` says,
    DECODE_TOKENS decode tokens in each of the decoder's modes, then a short real decode
    (measure_real) for the handshake, recall and an absent lookup's cost.
    `progress(step name)` is called before each step."""
    from ...format.store import load_manifest
    from ...runtime.loader import RuntimeConfig, load_model

    say = progress or (lambda _name: None)
    vocab = load_manifest(path).config["vocab_size"]
    longest = max(plan.chunk_tokens)
    ids = np.random.default_rng(0).integers(0, vocab, size=longest + 1).tolist()
    say("load (fake-stream)")
    cfg = RuntimeConfig(
        arena_gb=arena_gb, read_ahead="demand", fake_stream=True, prefill_step_size=longest
    )
    model = load_model(path, config=cfg)
    try:
        fixed, per_token, position, token_s = _time_prefill(model, ids, plan, say)
        per_mode = _time_decode_modes(model, ids, longest, say)
    finally:
        model.expert_cache.close()
    del model
    say("real decode (handshake, recall, misses)")
    real = measure_real(path, ids, RECALL_TOKENS, DECODE_TOKENS, arena_gb)
    sync_s = per_mode.get("sync", token_s)
    beyond = real.sync_beyond_s(per_mode.get("sync")) if plan.sync_per_layer else 0.0
    return Calibration(
        fixed,
        per_token,
        token_s,
        per_mode.get("layers", token_s),
        sync_s,
        real.handshake_s,
        real.recall,
        real.union,
        real.absent_s(sync_s, beyond),
        time.time(),
        calibrated=plan.key,
        sync_beyond_s=beyond,
        position_s=position,
        decode_at=longest if position else 0,
    )


def _time_prefill(
    model, ids: list[int], plan: CalibrationPlan, say: Callable[[str], None]
) -> tuple[float, float, float, float]:
    """(a chunk's fixed s, s per token, s per token and position, s per decode token in
    "token" mode) from fake-stream prefill as `plan` says: a chunk's time a + b * tokens +
    c * tokens * (start + tokens) through two chunks at the prompt's start and one after
    `plan.prefix` positions (c 0 without one), or one chunk of the forecast's size after a
    warm-up of the same size (its kernels built for that shape)."""
    from ..bench import run_policy

    step = max(plan.chunk_tokens)
    say("compile")
    warm = ids[: step + 1] if plan.kind == "chunk" else ids[:4]
    run_policy(model, warm, 1, step, "warmup", "-")
    if plan.kind == "chunk":
        say(f"prefill {step} tokens, decode {DECODE_TOKENS}")
        run = run_policy(model, ids[: step + 1], DECODE_TOKENS, step, "chunk", "-")
        tokens = sum(c.tokens for c in run.chunks)
        per_token = sum(c.wall_s for c in run.chunks) / max(tokens, 1)
        return 0.0, per_token, 0.0, run.decode_s / DECODE_TOKENS
    n_short, n_long = min(plan.chunk_tokens), max(plan.chunk_tokens)
    say(f"prefill {n_short} tokens")
    short = run_policy(model, ids[: n_short + 1], 1, step, "short", "-")
    say(f"prefill {n_long} tokens, decode {DECODE_TOKENS}")
    long = run_policy(model, ids[: n_long + 1], DECODE_TOKENS, step, "long", "-")
    # chunk wall times: the last prompt token runs outside the chunks, as in bench
    t_short = sum(c.wall_s for c in short.chunks)
    t_long = sum(c.wall_s for c in long.chunks)
    n_long = max(n_long, n_short + 1)
    position = 0.0
    if plan.prefix:
        say(f"prefill {POSITION_TOKENS} tokens after {plan.prefix}")
        t_at = _time_after_prefix(model, ids, plan.prefix, POSITION_TOKENS)
        # a + b * n + c * n * (start + n) through the three chunks (exact: three unknowns)
        rows = ((n_short, 0), (n_long, 0), (POSITION_TOKENS, plan.prefix))
        terms = np.array([[1.0, n, n * (start + n)] for n, start in rows])
        fit = np.linalg.solve(terms, np.array([t_short, t_long, t_at]))
        position = max(float(fit[2]), 0.0)
    # the line through the chunks at the start, once their attention is taken out
    t_short -= position * n_short * n_short
    t_long -= position * n_long * n_long
    slope = max((t_long - t_short) / (n_long - n_short), 0.0)
    if slope == 0.0:
        slope = t_long / n_long
    fixed = max(t_long - slope * n_long, 0.0)
    return fixed, slope, position, long.decode_s / DECODE_TOKENS


def _time_after_prefix(model, ids: list[int], prefix: int, tokens: int) -> float:
    """Wall s of a fake-stream prefill chunk of `tokens` tokens at position `prefix`: the
    cache holds one real position and `prefix` - 1 random keys and values (attention costs
    the same whatever they hold; recurrent state does not grow), so the prefix costs no
    compute."""
    import mlx.core as mx

    from ...generation.generate import generate_step
    from ...generation.prompt_cache import make_prompt_cache
    from ...generation.sampling import make_sampler

    cache = make_prompt_cache(model)
    first = generate_step(model, mx.array(ids[:1]), 1, make_sampler(0.0), 1, prompt_cache=cache)
    for _ in first:
        pass
    for c in cache:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if keys is None or values is None or not hasattr(c, "update_and_fetch"):
            continue
        rng = np.random.default_rng(1)
        fill = [
            mx.array(rng.standard_normal((*a.shape[:-2], prefix - 1, a.shape[-1]))).astype(a.dtype)
            for a in (keys, values)
        ]
        c.update_and_fetch(*fill)
    chunks = []
    prompt = [ids[i % len(ids)] for i in range(1, tokens + 2)]
    steps = generate_step(
        model,
        mx.array(prompt),
        1,
        make_sampler(0.0),
        tokens,
        on_chunk=chunks.append,
        prompt_cache=cache,
        cached_tokens=[ids[0]] * prefix,
    )
    next(steps)
    steps.close()
    return sum(c.wall_s for c in chunks)


def _time_decode_modes(
    model, ids: list[int], step: int, say: Callable[[str], None]
) -> dict[str, float]:
    """{mode: s per decode token} for "layers" and "sync", fake-stream; none without a
    pipelined decoder."""
    from ...runtime.decode import PipelinedDecoder
    from ..bench import run_policy

    per_mode = {}
    dec = model.decoder
    if isinstance(dec, PipelinedDecoder):
        for mode, (sync_above, token_below) in (("layers", (1.0, 0.0)), ("sync", (-1.0, 0))):
            say(f"decode {DECODE_TOKENS} tokens, {mode} mode")
            with dec.thresholds(sync_above, token_below):
                r = run_policy(model, ids[:2], DECODE_TOKENS, step, mode, "-")
            per_mode[mode] = r.decode_s / DECODE_TOKENS
    return per_mode
