"""Routing traces on disk: what a run's routers chose, written and read by this module alone.

A trace is what `stats.RoutingTrace` records during a run (every MoE layer's top-k ids of
every model call, and lookahead's predictions), plus what a replay needs to know about the
store: its experts per layer, the bytes of one expert record and the MoE layers in forward
order. `strata-mlx cache-sim` and benchmarks/eviction_sim.py replay it (strata_mlx.apps.cache_sim).

Record one:

    rt = RoutingTrace()
    model, tok = strata_mlx.load(store, trace=rt)    # or: generate/bench --trace FILE
    ... generate ...
    strata_mlx.stream.trace.write("run.npz", strata_mlx.stream.trace.of_model(model))

The file is a numpy .npz (a zip of arrays, numpy's savez_compressed), version 2:

    format        str    "strata-mlx-trace"
    version       int    2 (1: `decode_from` instead of `decode_spans`, still read)
    num_experts   int    experts per MoE layer
    record_bytes  int    bytes one expert record reads from the drive
    layers        int32  [n_layers] the MoE layers in forward order
    decode_spans  int64  [generations, 2]: each generation's decode calls, [first, end)
    L{layer}      int16 (int32 past 32767 experts) [rows, k]: the layer's routing ids of
                  every call, calls concatenated in order ([0, 0] before any call)
    L{layer}_T    int32  [calls] rows of each call (a prefill chunk's tokens, 1 in decode)
    P{layer}      lookahead's ids predicted for the layer from the layer before it, per call
    P{layer}_T    (present only when lookahead predicted; a call may have no prediction)
    profile       float64 [n_layers, num_experts] the store's routing profile (optional)

A call is one forward pass over some tokens: the prompt's chunks, then the prompt's last
token (generation runs it on its own: its logits give the first generated token), then one
call per generated token after the first. The decoder marks where its decode steps begin
(once the prompt's last token is final) and end (RoutingTrace.begin_decode / end_decode), so
decode figures per token count from each generation's second generated token, as bench does,
and a model that ran several generations has one span a generation. A recorder that keeps
no marks (no `decode_marks`: an older runtime's) and a version 1 file without `decode_from`
get one span guessed: from the call after the first one-token call to the end (wrong for
several generations, and a call early for a prompt two tokens past a whole number of
chunks, whose last chunk is one token).
Files written by benchmarks/decode.py (the L/P arrays alone) are read too: their store
fields are unknown (record_bytes 0, num_experts from the largest id, layers from the keys).

Nothing here runs a model, reads expert records or touches the arena.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import MAX_INDEX, OptionError
from ..format.store import write_atomic
from .stats import RoutingTrace

FORMAT = "strata-mlx-trace"
VERSION = 2
MAX_EXPERTS = 1 << 20  # a store's manifest holds at most as many experts a layer


@dataclass
class Trace:
    """One run's routing: per MoE layer, the [T, k] routing ids of every call."""

    layers: list[int]
    num_experts: int
    record_bytes: int
    ids: dict[int, list[np.ndarray]]
    predicted: dict[int, list[np.ndarray]] = field(default_factory=dict)
    decode_from: int | None = None  # one generation's first decode call (None: see spans)
    profile: np.ndarray | None = None
    # each generation's decode calls [first, end), as the decoder marked them; None: from
    # decode_from, or guessed by the rule in the module docstring
    decode_spans: list[tuple[int, int]] | None = None

    def __post_init__(self):
        if self.decode_spans is None:
            if self.decode_from is None:
                self.decode_from = first_decode_call(self.ids, self.layers)
            ends = [(self.decode_from, self.calls)] if self.decode_from < self.calls else []
            self.decode_spans = ends
        else:
            self.decode_spans = [(int(a), int(b)) for a, b in self.decode_spans]
            self.decode_from = self.decode_spans[0][0] if self.decode_spans else self.calls

    @property
    def calls(self) -> int:
        """Model calls every MoE layer saw (a run cut short mid-call ends at the last whole one)."""
        return min((len(self.ids.get(l, ())) for l in self.layers), default=0)

    def decoding(self) -> np.ndarray:
        """[calls] bool: which calls are decode steps."""
        out = np.zeros(self.calls, dtype=bool)
        for first, end in self.decode_spans:
            out[first:end] = True
        return out

    @property
    def decode_tokens(self) -> int:
        """Decode steps, every generation's."""
        return int(self.decoding().sum())

    @property
    def prompt_calls(self) -> int:
        return self.calls - self.decode_tokens

    def lookups(self) -> Iterator[tuple[bool, int, np.ndarray]]:
        """(is decode, layer, the layer's distinct experts) for every call and MoE layer, in
        execution order: what the expert cache looks up, one handshake each."""
        for c, decode in enumerate(self.decoding().tolist()):
            for layer in self.layers:
                yield decode, layer, np.unique(self.ids[layer][c])


def first_decode_call(ids: dict[int, list[np.ndarray]], layers: list[int]) -> int:
    """The guess for a trace whose decode steps were not marked: the call after the first
    one-token call (the prompt's last token), or the number of calls when there is none."""
    if not layers or layers[0] not in ids:
        return 0
    calls = ids[layers[0]]
    first = next((c for c, rows in enumerate(calls) if len(rows) == 1), len(calls))
    return min(first + 1, len(calls))


def spans_of(marks: list[tuple[int, bool]], calls: int) -> list[tuple[int, int]]:
    """Decode spans [first, end) from a recorder's marks, (calls recorded by then, True where
    decode began, False where it ended), within `calls`; an empty span is none."""
    spans, first = [], None
    for at, begins in [*marks, (calls, False)]:
        if begins and first is None:
            first = at
        elif not begins and first is not None:
            if min(at, calls) > first:
                spans.append((first, min(at, calls)))
            first = None
    return spans


def of_routing(routing: RoutingTrace, manifest, profile: np.ndarray | None = None) -> Trace:
    """A Trace of what `routing` recorded on the store described by `manifest`."""
    layers = list(manifest.moe_layers)
    ids = {l: list(routing.ids.get(l, [])) for l in layers}
    calls = min((len(v) for v in ids.values()), default=0)
    # (a recorder without decode marks, an older one or a script's own, or one no decoder
    # told, as batched decode's steps do not: the split is guessed)
    marks = getattr(routing, "decode_marks", None) or None
    return Trace(
        layers=layers,
        num_experts=int(manifest.num_experts),
        record_bytes=int(manifest.layout.record_bytes),
        ids=ids,
        predicted={l: list(v) for l, v in routing.predicted.items()},
        profile=profile,
        decode_spans=None if marks is None else spans_of(list(marks), calls),
    )


def of_model(model) -> Trace:
    """The trace a model loaded with `trace=RoutingTrace()` has recorded so far."""
    cache = model.expert_cache
    if cache.trace is None:
        raise ValueError("the model records no trace: load it with trace=RoutingTrace()")
    return of_routing(cache.trace, cache.manifest, cache.predictor.profile)


def run_path(path: str | Path, policy: str, round: int, several: bool) -> Path:
    """Where bench writes a run's trace: `path` itself for a lone run, else `path` with the
    run's policy (":" as "_") and round before the suffix: t.npz -> t-lookahead_sync-r0.npz."""
    path = Path(path)
    if not several:
        return path
    return path.with_name(f"{path.stem}-{policy.replace(':', '_')}-r{round}{path.suffix}")


def write(path: str | Path, trace: Trace) -> None:
    """Write `trace` to `path` (.npz) whole: a temporary file beside it, then one rename. A
    trace of no call yet is written too (its layers' arrays empty)."""
    if not trace.layers:
        raise OptionError(f"{path}: a trace of no MoE layers; nothing to write")
    dtype = np.int16 if trace.num_experts <= np.iinfo(np.int16).max else np.int32
    arrays: dict[str, np.ndarray] = {
        "format": np.array(FORMAT),
        "version": np.array(VERSION),
        "num_experts": np.array(trace.num_experts),
        "record_bytes": np.array(trace.record_bytes),
        "layers": np.array(trace.layers, dtype=np.int32),
        "decode_spans": np.array(trace.decode_spans, dtype=np.int64).reshape(-1, 2),
    }
    for prefix, table in (("L", trace.ids), ("P", trace.predicted)):
        for layer, calls in table.items():
            if not calls and prefix == "P":
                continue
            k = calls[0].shape[-1] if calls else 0
            rows = [np.asarray(c).reshape(-1, k) for c in calls] or [np.zeros((0, 0))]
            arrays[f"{prefix}{layer}"] = np.concatenate(rows).astype(dtype)
            arrays[f"{prefix}{layer}_T"] = np.array([len(c) for c in calls], dtype=np.int32)
    if trace.profile is not None:
        arrays["profile"] = np.asarray(trace.profile, dtype=np.float64)

    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)

    write_atomic(path, save)


def read(path: str | Path) -> Trace:
    """The trace in `path`; an OptionError naming the file if it holds something else."""
    path = Path(path)
    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise OptionError(f"{path}: no such trace file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # (EOFError: empty)
        detail = str(e).splitlines()[0] if str(e) else "empty"
        raise OptionError(f"{path}: not a trace file ({detail})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise OptionError(f"{path}: not a trace file (one array, not an .npz)")
    try:
        with z:
            return _parse(z)
    except (KeyError, ValueError, IndexError, EOFError, zipfile.BadZipFile) as e:
        raise OptionError(f"{path}: not a trace file ({e})") from None
    except AttributeError:  # (a member that is no .npy array reads as bytes)
        raise OptionError(f"{path}: not a trace file (a member is no array)") from None


def _split(z, key: str, num_experts: int | None = None) -> list[np.ndarray]:
    """The calls of `key` and `key`_T; each id within [0, num_experts) where given."""
    if key not in z.files or f"{key}_T" not in z.files:
        raise ValueError(f"{key}: missing (or {key}_T)")
    rows, counts = z[key], z[f"{key}_T"]
    if rows.ndim != 2 or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"{key}: {rows.dtype} {list(rows.shape)}, not integer ids [rows, k]")
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"{key}_T: {counts.dtype} {list(counts.shape)}, not integer counts")
    if counts.sum() != len(rows) or (counts < 0).any():
        raise ValueError(f"{key}_T does not add up to the rows of {key}")
    if num_experts is not None and rows.size and (rows.min() < 0 or rows.max() >= num_experts):
        raise ValueError(f"{key}: expert ids outside [0, {num_experts})")
    return (
        [a.astype(np.int64) for a in np.split(rows, np.cumsum(counts)[:-1])] if len(counts) else []
    )


def _parse(z) -> Trace:
    files = set(z.files)
    if "format" in files and str(z["format"]) != FORMAT:
        raise ValueError(f"format {str(z['format'])!r}")
    version = _scalar(z, "version", 1)
    if not 1 <= version <= VERSION:
        raise ValueError(f"version {version}; this strata-mlx reads 1 to {VERSION}")
    keyed = sorted(int(k[1:]) for k in files if k[0] == "L" and k[1:].isdigit())
    layers = _layers(z) if "layers" in files else keyed
    if not layers:
        raise ValueError("no routing ids (L{layer} arrays)")
    ids = {l: _split(z, f"L{l}") for l in layers}
    biggest = max((int(a.max()) for calls in ids.values() for a in calls if a.size), default=-1)
    num_experts = _scalar(z, "num_experts", biggest + 1)
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts {num_experts}: expected 1 to {MAX_EXPERTS}")
    if (
        biggest >= num_experts
        or min((int(a.min()) for calls in ids.values() for a in calls if a.size), default=0) < 0
    ):
        raise ValueError(f"routing ids outside [0, {num_experts})")
    predicted = {}
    for k in sorted(k for k in files if k[0] == "P" and k[1:].isdigit()):
        if int(k[1:]) not in layers:
            raise ValueError(f"{k}: predictions for layer {k[1:]}, not one of the trace's layers")
        predicted[int(k[1:])] = _split(z, k, num_experts)
    record_bytes = _scalar(z, "record_bytes", 0)
    if record_bytes < 0:
        raise ValueError(f"record_bytes {record_bytes}: negative")
    profile = _profile(z, len(layers), num_experts) if "profile" in files else None
    trace = Trace(
        layers=layers,
        num_experts=num_experts,
        record_bytes=record_bytes,
        ids=ids,
        predicted=predicted,
        decode_from=_scalar(z, "decode_from", None),  # (None: by the rule, always within)
        profile=profile,
        decode_spans=_spans(z) if "decode_spans" in files else None,
    )
    if not 0 <= trace.decode_from <= trace.calls:
        raise ValueError(
            f"decode_from {trace.decode_from}: outside the trace's {trace.calls} calls"
        )
    if trace.decode_spans and trace.decode_spans[-1][1] > trace.calls:
        raise ValueError(f"decode_spans: past the trace's {trace.calls} calls")
    return trace


def _layers(z) -> list[int]:
    """The file's `layers`: distinct layer numbers, one a MoE layer."""
    a = z["layers"]
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"layers: {a.dtype} {list(a.shape)}, not a list of layer numbers")
    if len(np.unique(a)) != len(a):
        raise ValueError(f"layers: a layer named twice ({a.tolist()})")
    if a.size and (a.min() < 0 or a.max() > MAX_INDEX):
        raise ValueError(f"layers: {a.tolist()}, expected numbers from 0 to {MAX_INDEX}")
    return [int(l) for l in a]


def _spans(z) -> list[tuple[int, int]]:
    """The file's `decode_spans`: [first, end) pairs, each after the one before."""
    a = z["decode_spans"]
    if a.ndim != 2 or a.shape[1] != 2 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"decode_spans: {a.dtype} {list(a.shape)}, not [generations, 2] calls")
    spans = [(int(first), int(end)) for first, end in a]
    edges = [x for span in spans for x in span]
    if any(x < 0 for x in edges) or any(x >= y for x, y in spans) or edges != sorted(edges):
        raise ValueError(f"decode_spans {a.tolist()}: not ordered [first, end) call spans")
    return spans


def _profile(z, layers: int, num_experts: int) -> np.ndarray:
    profile = z["profile"]
    if profile.shape != (layers, num_experts):
        raise ValueError(f"profile {list(profile.shape)}: expected [{layers} layers, "
                         f"{num_experts} experts]")  # fmt: skip
    if not np.issubdtype(profile.dtype, np.number) or not np.isfinite(profile).all():
        raise ValueError("profile: not finite numbers")
    if (profile < 0).any():
        raise ValueError("profile: negative counts")
    return profile


def _scalar(z, key: str, default):
    """An integer scalar of the file, or `default` where the file has none."""
    if key not in z.files:
        return default
    a = z[key]
    if a.ndim != 0 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{key}: {a.dtype} {list(a.shape)}, not an integer")
    return int(a)
