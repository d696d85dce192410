"""The compute model plan uses by default: measured once on this machine for a model's shape and
cached, so that a later forecast answers in seconds.

Owns the calibration (a short fake-stream run and a short real decode, both far shorter than
plan --measure's) and its cache file under the per-user cache directory
($STRATA_MLX_HOME or ~/.cache/strata-mlx), one file per machine and MLX backend, an entry per
model shape (the same shape computes alike whatever its weights). Never measures when a
cached entry matches, and never writes the cache file except whole (temp path then rename).

Prefill time per chunk is fitted as a + b * tokens from two short chunks: a chunk of a few
tokens pays the per-layer dispatch that a long one spreads over its tokens, so a per-token rate
from a short chunk alone overstates a 1024-token chunk's cost.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .machine import Compute, measure_real
from .shapes import ModelShape

CALIBRATION_VERSION = 1  # bump when the measurement changes: older entries are measured again
SHORT_TOKENS, LONG_TOKENS = 8, 32  # the two prefill chunks the per-chunk time is fitted on
DECODE_TOKENS = 4
RECALL_TOKENS = 16


@dataclass
class Calibration:
    """What a model shape costs on this machine with every expert resident, and what its short
    real decode measured (the handshake's Python, lookahead's recall, an absent lookup)."""

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
        )

    @classmethod
    def from_json(cls, d: dict) -> Calibration:
        d = dict(d)
        d["recall"] = {int(k): v for k, v in d.get("recall", {}).items()}
        d["recall_union"] = {int(k): v for k, v in d.get("recall_union", {}).items()}
        return cls(**d)


def machine_key() -> str:
    """This machine and backend: host, CPU, core count, MLX version and default device."""
    import os

    import mlx.core as mx

    device = str(mx.default_device()).replace("Device(", "").rstrip(")").replace(", ", "")
    parts = [platform.node(), platform.machine(), str(os.cpu_count()), mx.__version__, device]
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


def cached(shape: ModelShape) -> Calibration | None:
    """The cached calibration of `shape` on this machine, or None."""
    try:
        entries = json.loads(cache_file().read_text())
        return Calibration.from_json(entries[shape_key(shape)])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(shape: ModelShape, cal: Calibration) -> None:
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
    entries[shape_key(shape)] = asdict(cal)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(entries, indent=1))
    except OSError:
        pass


def calibrate(
    path: Path, arena_gb: float, progress: Callable[[str], None] | None = None
) -> Calibration:
    """Measure a store's shape on this machine: fake-stream prefill chunks of SHORT_TOKENS and
    LONG_TOKENS tokens, DECODE_TOKENS decode tokens in each of the decoder's modes, then a short
    real decode (measure_real) for the handshake, recall and an absent lookup's cost.
    `progress(step name)` is called before each step."""
    from ...format.store import load_manifest
    from ...runtime.loader import RuntimeConfig, load
    from ..bench import run_policy

    say = progress or (lambda _name: None)
    vocab = load_manifest(path).config["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, size=LONG_TOKENS + 1).tolist()
    say("load (fake-stream)")
    cfg = RuntimeConfig(
        arena_gb=arena_gb, read_ahead="demand", fake_stream=True, prefill_step_size=LONG_TOKENS
    )
    model, _ = load(path, config=cfg)
    try:
        say("compile")
        run_policy(model, ids[:4], 1, LONG_TOKENS, "warmup", "-")
        say(f"prefill {SHORT_TOKENS} tokens")
        short = run_policy(model, ids[:SHORT_TOKENS], 1, LONG_TOKENS, "short", "-")
        say(f"prefill {LONG_TOKENS} tokens, decode {DECODE_TOKENS}")
        long = run_policy(model, ids[:LONG_TOKENS], DECODE_TOKENS, LONG_TOKENS, "long", "-")
        per_mode = {}
        dec = model.decoder
        if dec is not None:
            keep = dec.sync_above, dec.token_below
            for mode, (sync_above, token_below) in (("layers", (1.0, 0.0)), ("sync", (-1.0, 0))):
                say(f"decode {DECODE_TOKENS} tokens, {mode} mode")
                dec.sync_above, dec.token_below = sync_above, token_below
                r = run_policy(model, ids[:2], DECODE_TOKENS, LONG_TOKENS, mode, "-")
                per_mode[mode] = r.decode_s / DECODE_TOKENS
            dec.sync_above, dec.token_below = keep
    finally:
        model.expert_cache.close()
    del model
    # chunk wall times: the last prompt token runs outside the chunks, as in bench
    t_short = sum(c.wall_s for c in short.chunks)
    t_long = sum(c.wall_s for c in long.chunks)
    n_short = max(SHORT_TOKENS - 1, 1)
    n_long = max(LONG_TOKENS - 1, n_short + 1)
    slope = max((t_long - t_short) / (n_long - n_short), 0.0)
    if slope == 0.0:
        slope = t_long / n_long
    fixed = max(t_long - slope * n_long, 0.0)
    say("real decode (handshake, recall, misses)")
    real = measure_real(path, ids, RECALL_TOKENS, DECODE_TOKENS, arena_gb)
    token_s = long.decode_s / DECODE_TOKENS
    sync_s = per_mode.get("sync", token_s)
    return Calibration(
        fixed,
        slope,
        token_s,
        per_mode.get("layers", token_s),
        sync_s,
        real.handshake_s,
        real.recall,
        real.union,
        real.absent_s(sync_s),
        time.time(),
    )
