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

The file is a numpy .npz (a zip of arrays, numpy's savez_compressed), version 1:

    format        str    "strata-mlx-trace"
    version       int    1
    num_experts   int    experts per MoE layer
    record_bytes  int    bytes one expert record reads from the drive
    layers        int32  [n_layers] the MoE layers in forward order
    decode_from   int    the first call that is a decode step (calls before it are the prompt)
    L{layer}      int16 (int32 past 32767 experts) [rows, k]: the layer's routing ids of
                  every call, calls concatenated in order
    L{layer}_T    int32  [calls] rows of each call (a prefill chunk's tokens, 1 in decode)
    P{layer}      lookahead's ids predicted for the layer from the layer before it, per call
    P{layer}_T    (present only when lookahead predicted; a call may have no prediction)
    profile       float64 [n_layers, num_experts] the store's routing profile (optional)

A call is one forward pass over some tokens: the prompt's chunks, then the prompt's last
token (generation runs it on its own: its logits give the first generated token), then one
call per generated token after the first. `decode_from` is the call after the first one-token
call, so decode figures per token count from the second generated token, as bench does.
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

from ..config import OptionError
from ..format.store import write_atomic
from .stats import RoutingTrace

FORMAT = "strata-mlx-trace"
VERSION = 1


@dataclass
class Trace:
    """One run's routing: per MoE layer, the [T, k] routing ids of every call."""

    layers: list[int]
    num_experts: int
    record_bytes: int
    ids: dict[int, list[np.ndarray]]
    predicted: dict[int, list[np.ndarray]] = field(default_factory=dict)
    decode_from: int | None = None  # None: by the rule in the module docstring
    profile: np.ndarray | None = None

    def __post_init__(self):
        if self.decode_from is None:
            self.decode_from = first_decode_call(self.ids, self.layers)

    @property
    def calls(self) -> int:
        """Model calls every MoE layer saw (a run cut short mid-call ends at the last whole one)."""
        return min((len(self.ids.get(l, ())) for l in self.layers), default=0)

    @property
    def decode_tokens(self) -> int:
        return max(self.calls - self.decode_from, 0)

    def lookups(self) -> Iterator[tuple[bool, int, np.ndarray]]:
        """(is decode, layer, the layer's distinct experts) for every call and MoE layer, in
        execution order: what the expert cache looks up, one handshake each."""
        for c in range(self.calls):
            decode = c >= self.decode_from
            for layer in self.layers:
                yield decode, layer, np.unique(self.ids[layer][c])


def first_decode_call(ids: dict[int, list[np.ndarray]], layers: list[int]) -> int:
    """The call after the first one-token call (the prompt's last token), or the number of
    calls when there is none (a prompt alone)."""
    if not layers or layers[0] not in ids:
        return 0
    calls = ids[layers[0]]
    first = next((c for c, rows in enumerate(calls) if len(rows) == 1), len(calls))
    return min(first + 1, len(calls))


def of_routing(routing: RoutingTrace, manifest, profile: np.ndarray | None = None) -> Trace:
    """A Trace of what `routing` recorded on the store described by `manifest`."""
    layers = list(manifest.moe_layers)
    return Trace(
        layers=layers,
        num_experts=int(manifest.num_experts),
        record_bytes=int(manifest.layout.record_bytes),
        ids={l: list(routing.ids.get(l, [])) for l in layers},
        predicted={l: list(v) for l, v in routing.predicted.items()},
        profile=profile,
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
    """Write `trace` to `path` (.npz) whole: a temporary file beside it, then one rename."""
    dtype = np.int16 if trace.num_experts <= np.iinfo(np.int16).max else np.int32
    arrays: dict[str, np.ndarray] = {
        "format": np.array(FORMAT),
        "version": np.array(VERSION),
        "num_experts": np.array(trace.num_experts),
        "record_bytes": np.array(trace.record_bytes),
        "layers": np.array(trace.layers, dtype=np.int32),
        "decode_from": np.array(trace.decode_from),
    }
    for prefix, table in (("L", trace.ids), ("P", trace.predicted)):
        for layer, calls in table.items():
            if not calls:
                continue
            k = calls[0].shape[-1]
            arrays[f"{prefix}{layer}"] = np.concatenate(
                [np.asarray(c).reshape(-1, k) for c in calls]
            ).astype(dtype)
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
            return _parse(z, path)
    except (KeyError, ValueError, IndexError, EOFError, zipfile.BadZipFile) as e:
        raise OptionError(f"{path}: not a trace file ({e})") from None
    except AttributeError:  # (a member that is no .npy array reads as bytes)
        raise OptionError(f"{path}: not a trace file (a member is no array)") from None


def _split(z, key: str) -> list[np.ndarray]:
    rows, counts = z[key], z[f"{key}_T"]
    if rows.ndim != 2 or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"{key}: {rows.dtype} {list(rows.shape)}, not integer ids [rows, k]")
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"{key}_T: {counts.dtype} {list(counts.shape)}, not integer counts")
    if counts.sum() != len(rows) or (counts < 0).any():
        raise ValueError(f"{key}_T does not add up to the rows of {key}")
    return (
        [a.astype(np.int64) for a in np.split(rows, np.cumsum(counts)[:-1])] if len(counts) else []
    )


def _parse(z, path: Path) -> Trace:
    files = set(z.files)
    if "format" in files and str(z["format"]) != FORMAT:
        raise ValueError(f"format {str(z['format'])!r}")
    if "version" in files and int(z["version"]) > VERSION:
        raise ValueError(f"version {int(z['version'])}; this strata-mlx reads {VERSION}")
    keyed = sorted(int(k[1:]) for k in files if k[0] == "L" and k[1:].isdigit())
    layers = [int(l) for l in z["layers"]] if "layers" in files else keyed
    if not layers:
        raise ValueError("no routing ids (L{layer} arrays)")
    ids = {l: _split(z, f"L{l}") for l in layers}
    predicted = {int(k[1:]): _split(z, k) for k in files if k[0] == "P" and k[1:].isdigit()}
    biggest = max((int(a.max()) for calls in ids.values() for a in calls if a.size), default=-1)
    num_experts = _scalar(z, "num_experts", biggest + 1)
    if (
        biggest >= num_experts
        or min((int(a.min()) for calls in ids.values() for a in calls if a.size), default=0) < 0
    ):
        raise ValueError(f"routing ids outside [0, {num_experts})")
    record_bytes = _scalar(z, "record_bytes", 0)
    if record_bytes < 0:
        raise ValueError(f"record_bytes {record_bytes}: negative")
    profile = z["profile"] if "profile" in files else None
    if profile is not None:
        if profile.shape != (len(layers), num_experts):
            raise ValueError(f"profile {list(profile.shape)}: expected [{len(layers)} layers, "
                             f"{num_experts} experts]")  # fmt: skip
        if not np.issubdtype(profile.dtype, np.number) or not np.isfinite(profile).all():
            raise ValueError("profile: not finite numbers")
    trace = Trace(
        layers=layers,
        num_experts=num_experts,
        record_bytes=record_bytes,
        ids=ids,
        predicted=predicted,
        decode_from=_scalar(z, "decode_from", None),  # (None: by the rule, always within)
        profile=profile,
    )
    if not 0 <= trace.decode_from <= trace.calls:
        raise ValueError(
            f"decode_from {trace.decode_from}: outside the trace's {trace.calls} calls"
        )
    return trace


def _scalar(z, key: str, default):
    """An integer scalar of the file, or `default` where the file has none."""
    if key not in z.files:
        return default
    a = z[key]
    if a.ndim != 0 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{key}: {a.dtype} {list(a.shape)}, not an integer")
    return int(a)
