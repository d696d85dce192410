"""Synthetic routing traces: a router model with knobs for what caching depends on, written
as trace files (strata_mlx.stream.trace) that cache-sim replays at any size in seconds.

A synthetic store's routing comes from its weights (strata_mlx.convert.synthetic), so it
can only be measured by running the model; these traces come from a small latent model of
routing instead, which names each property a cache sees as one knob:

  reuse       reuse across tokens: each token's routing input is a context that drifts
              (an AR(1) walk, correlation `reuse` from one token to the next) plus a part of
              its own (share 1 - `context`); consecutive tokens then pick overlapping experts
  skew        popularity skew: each expert's router logit gets a fixed term from 0 (most
              popular) down to -`skew` nats by log rank: a static hot set grows with it
  layer_corr  layer-to-layer correlation: every layer's router rows share this much of
              their variance with one set of rows, so consecutive layers pick alike
  drift       how far each layer's input moves from the layer before's: lookahead's
              prediction (layer l+1's router on layer l's input) misses by as much

For MoE layer l and token t the input is x[l, t] = (x[l-1, t] + drift * p[l, t]) rescaled to
unit variance, with x[0, t] = p[0, t], where each layer's part p[l, t] = sqrt(context) *
c[l, t] + sqrt(1 - context) * u[l, t] (c a context drifting across tokens, u fresh, both unit
Gaussian in `dim` dimensions), and the top-k of R[l] x[l, t] / sqrt(dim) + z is
routed (R[l] x / sqrt(dim) has unit spread, so `skew` is in units of it). The trace records what a run records: the prompt in chunks, the last prompt token,
then one call per decode token, and lookahead's prediction for every layer after the first.

PRESETS["published"] is matched to what published traces of real MoE models show and our
random-weight stores do not: a per-layer LRU of 128 of 512 experts hits ~81 % of decode
lookups (strong short-term reuse), no large static hot set, and ~410 distinct experts a
layer in a 1024-token prompt chunk (docs/decisions.md, "Synthetic routing traces", gives the
sources and the fit). PRESETS["store"] imitates today's synthetic store (little reuse, a
skewed popularity, recall ~0.7).

Nothing here touches a store, the arena or a model.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import MAX_NUMBER, OptionError
from ..format.store import StoreError
from . import trace as traces


@dataclass
class RoutingKnobs:
    """The latent router's settings (module docstring)."""

    num_experts: int = 512
    top_k: int = 10
    layers: int = 48
    reuse: float = 0.0  # token-to-token correlation of the context
    context: float = 0.0  # share of a token's input that is the context
    skew: float = 2.0  # nats from the most to the least popular expert
    layer_corr: float = 0.95
    drift: float = 0.5
    dim: int = 64


PRESETS = {
    "store": RoutingKnobs(reuse=0.0, context=0.0, skew=2.5, layer_corr=0.95, drift=0.3),
    "published": RoutingKnobs(reuse=0.945, context=0.9, skew=1.0, layer_corr=0.95, drift=0.3),
}


def check(knobs: RoutingKnobs) -> None:
    """An OptionError naming the first knob outside its range (NaN and infinity too: their
    logits are NaN, and every token's top-k is then the same few experts)."""
    for name in ("reuse", "context", "layer_corr"):
        v = getattr(knobs, name)
        if not 0.0 <= v <= 1.0:
            raise OptionError(f"{name} {v!r}: expected a number in [0, 1]")
    for name in ("skew", "drift"):
        v = getattr(knobs, name)
        if not (math.isfinite(v) and 0 <= v <= MAX_NUMBER):
            raise OptionError(f"{name} {v!r}: expected a number from 0 to {MAX_NUMBER:g}")
    if not 1 <= knobs.num_experts <= traces.MAX_EXPERTS:
        raise OptionError(
            f"num_experts {knobs.num_experts}: expected 1 to {traces.MAX_EXPERTS} (a trace's most)"
        )
    if not 1 <= knobs.top_k <= knobs.num_experts:
        raise OptionError(f"top_k {knobs.top_k}: expected 1 to num_experts ({knobs.num_experts})")
    if knobs.layers < 1 or knobs.dim < 1:
        raise OptionError("layers and dim: expected at least 1")


def _topk(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argpartition(-logits, k - 1, axis=-1)[..., :k]


def routing(
    knobs: RoutingKnobs, tokens: int, seed: int = 0, stream: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(ids [layers, tokens, k], predicted [layers, tokens, k]: layer l's ids predicted from
    layer l-1's input; row 0 is layer 0's own). `seed` draws the routers, `stream` the
    tokens: another stream is other text through the same model (a calibration profile)."""
    check(knobs)
    rng = np.random.default_rng(seed)
    E, k, L, d = knobs.num_experts, knobs.top_k, knobs.layers, knobs.dim
    r0 = rng.standard_normal((E, d))
    z = -knobs.skew * np.log1p(np.arange(E)) / np.log1p(E - 1)
    z = z[rng.permutation(E)]
    routers = [
        np.sqrt(knobs.layer_corr) * r0 + np.sqrt(1 - knobs.layer_corr) * rng.standard_normal((E, d))
        for _ in range(L)
    ]
    rng = np.random.default_rng([seed, stream + 1])
    # Each layer's input moves from the one before by an increment that has the same
    # structure as the first input (a drifting context and a fresh part), so deep layers
    # keep the reuse across tokens while consecutive layers differ by `drift`.
    a = knobs.reuse
    c = np.empty((L, tokens, d))
    c[:, 0] = rng.standard_normal((L, d))
    for t in range(1, tokens):
        c[:, t] = a * c[:, t - 1] + np.sqrt(1 - a * a) * rng.standard_normal((L, d))
    parts = np.sqrt(knobs.context) * c + np.sqrt(1 - knobs.context) * rng.standard_normal(
        (L, tokens, d)
    )
    scale = 1 / np.sqrt(d)
    ids = np.empty((L, tokens, k), dtype=np.int64)
    pred = np.empty_like(ids)
    x = prev_x = None
    for l, r in enumerate(routers):
        x = parts[0] if x is None else (x + knobs.drift * parts[l]) / np.sqrt(1 + knobs.drift**2)
        ids[l] = _topk(scale * x @ r.T + z, k)
        pred[l] = _topk(scale * (x if prev_x is None else prev_x) @ r.T + z, k)
        prev_x = x
    return ids, pred


def make_trace(
    knobs: RoutingKnobs,
    prompt_tokens: int = 2048,
    decode_tokens: int = 128,
    prefill_step_size: int = 1024,
    record_bytes: int = 0,
    seed: int = 0,
    calibration_tokens: int = 512,
) -> traces.Trace:
    """A trace as generation would record it: the prompt but its last token in chunks of
    `prefill_step_size`, the last prompt token, then `decode_tokens` one-token calls; its
    profile counts `calibration_tokens` of other text through the same routers (a store's
    calibration)."""
    if prompt_tokens < 1 or decode_tokens < 0 or prefill_step_size < 1:
        raise OptionError("prompt_tokens and prefill_step_size >= 1, decode_tokens >= 0")
    if record_bytes < 0:
        raise OptionError(f"record_bytes {record_bytes}: expected a number of bytes >= 0")
    total = prompt_tokens + decode_tokens
    ids, pred = routing(knobs, total, seed)
    calibration, _ = routing(knobs, calibration_tokens, seed, stream=1)
    profile = np.stack(
        [np.bincount(row.ravel(), minlength=knobs.num_experts) for row in calibration]
    )
    bounds = list(range(0, prompt_tokens - 1, prefill_step_size)) + list(
        range(prompt_tokens - 1, total + 1)
    )
    bounds = sorted(set(bounds))
    calls = list(zip(bounds, bounds[1:]))
    prompt_calls = sum(b < prompt_tokens for a, b in calls) + 1  # chunks, the last token
    layers = list(range(knobs.layers))
    return traces.Trace(
        layers=layers,
        num_experts=knobs.num_experts,
        record_bytes=record_bytes,
        ids={l: [ids[l, a:b] for a, b in calls] for l in layers},
        predicted={l: [pred[l, a:b] for a, b in calls] for l in layers[1:]},
        decode_from=prompt_calls,
        profile=profile.astype(np.float64),
    )


def layer_lru_hit_rate(trace: traces.Trace, slots: int) -> float:
    """Decode lookups hit by a separate LRU of `slots` experts in each layer (the published
    statistic's measure), over every layer."""
    hits = lookups = 0
    decoding = trace.decoding()
    for layer in trace.layers:
        lru: OrderedDict[int, None] = OrderedDict()
        for c, rows in enumerate(trace.ids[layer][: trace.calls]):
            for e in np.unique(rows).tolist():
                if decoding[c]:
                    lookups += 1
                    hits += e in lru
                lru[e] = None
                lru.move_to_end(e)
                if len(lru) > slots:
                    lru.popitem(last=False)
    return hits / lookups if lookups else 0.0


def summary(trace: traces.Trace, knobs: RoutingKnobs) -> dict:
    """The statistics the presets are matched to."""
    first = trace.ids[trace.layers[0]][0]
    distinct = np.mean([len(np.unique(trace.ids[l][0])) for l in trace.layers])
    recall = []
    for l in trace.layers[1:]:
        for c in np.flatnonzero(trace.decoding()):
            p, q = trace.predicted[l][c][0], trace.ids[l][c][0]
            recall.append(len(set(p.tolist()) & set(q.tolist())) / knobs.top_k)
    counts = np.bincount(np.concatenate([np.concatenate(trace.ids[l]).ravel() for l in trace.layers]),
                         minlength=knobs.num_experts)  # fmt: skip
    top = np.sort(counts)[::-1]
    return {
        "lru128_hit": layer_lru_hit_rate(trace, 128),
        "distinct_first_chunk": float(distinct),
        "first_chunk_tokens": len(first),
        "lookahead_recall": float(np.mean(recall)) if recall else 0.0,
        "top64_share": float(top[:64].sum() / counts.sum()),
    }


def main(argv: list[str] | None = None) -> None:
    """`python -m strata_mlx.stream.synthetic_trace OUT ...`: a bad flag or an output that
    cannot be written exits with one line; Ctrl-C exits 130 quietly, leaving no file (the
    trace is written whole or not at all)."""
    try:
        _main(argv)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def _main(argv: list[str] | None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the trace file to write (.npz)")
    ap.add_argument("--preset", default="published", choices=sorted(PRESETS))
    ap.add_argument("--set", action="append", default=[], help="a knob, e.g. reuse=0.9")
    ap.add_argument("--prompt-tokens", type=int, default=2048)  # bench's defaults
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-step-size", type=int, default=1024)
    ap.add_argument("--record-bytes", type=int, default=0, help="one record's bytes (MB/token)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.record_bytes < 0:
        raise SystemExit(f"error: --record-bytes {a.record_bytes}: expected a number of bytes >= 0")
    _check_out(a.out)
    knobs = PRESETS[a.preset]
    for item in a.set:
        name, _, value = item.partition("=")
        if name not in {f.name for f in dataclasses.fields(RoutingKnobs)}:
            raise SystemExit(f"error: --set {item}: no such knob")
        try:
            knobs = dataclasses.replace(knobs, **{name: type(getattr(knobs, name))(value)})
        except ValueError:
            raise SystemExit(f"error: --set {item}: not a number") from None
    try:
        t = make_trace(
            knobs, a.prompt_tokens, a.decode_tokens, a.prefill_step_size, a.record_bytes, a.seed
        )
    except OptionError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        traces.write(a.out, t)
    except StoreError as e:  # (an OutputError: a full disk, no permission)
        raise SystemExit(f"error: {e}") from None
    stats = summary(t, knobs)
    print(f"{a.out}: {knobs}")
    print("  " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in stats.items()))  # fmt: skip


def _check_out(out: Path) -> None:
    """Before the trace is drawn: `out` can be a file (not a directory, in one that exists)."""
    where = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise SystemExit(f"error: {out}: is a directory; name a file")
    if not where.is_dir():
        raise SystemExit(f"error: {out}: no directory {where}")


if __name__ == "__main__":
    main()
