"""Measurement tools: logits KLD, routing parity between runtime configurations, MoE dumps.

- load_logits / kld_report: compare teacher-forced logits [T, vocab] (e.g. `generate
  --logits-out` of two builds or settings): KLD(ref || test) in nats and top-1 agreement.
- route_parity: two RoutingTrace objects, token by token and layer by layer: the same set
  of top-k experts?
- MoeDumper / dumps_equal: per-layer MoE state (input, ids, scores, output) as .npy files,
  and a byte comparison of two dump folders.

User errors are ValueErrors with one line that names the file; the CLI makes them exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import OptionError

# ---- logits and KLD ------------------------------------------------------------------------


def load_logits(path: str | Path) -> np.ndarray:
    """A .npy of finite float logits [T, vocab]; a one-line OptionError naming the file
    otherwise."""
    path = Path(path)
    if path.is_dir():
        raise OptionError(f"{path}: is a directory; name a .npy file")
    if not path.is_file():
        raise OptionError(f"{path}: no such file")
    try:
        a = np.load(path, allow_pickle=False)
    except Exception as e:  # numpy's own wording: bad magic, truncated, pickled object...
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OptionError(f"{path}: not a .npy array ({first})") from None
    if not isinstance(a, np.ndarray):
        raise OptionError(f"{path}: not a .npy array (an archive of several?)")
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 2:
        raise OptionError(f"{path}: expected logits of shape [T, vocab], got {list(a.shape)}")
    if not np.issubdtype(a.dtype, np.floating):
        raise OptionError(f"{path}: expected float logits, got dtype {a.dtype}")
    check_finite_logits(a, str(path))
    return a


def check_finite_logits(a: np.ndarray, what: str) -> None:
    """NaN or inf logits make every KLD term NaN ("mean nan", exit 0): refused, naming the
    first position and token that holds one."""
    bad = ~np.isfinite(a)
    if bad.any():
        t, v = np.argwhere(bad)[0]
        raise OptionError(
            f"{what}: logits hold {int(bad.sum())} non-finite values (first {a[t, v]} at "
            f"position {t}, token {v})"
        )


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    s = x - m
    return s - np.log(np.sum(np.exp(s), axis=-1, keepdims=True))


@dataclass
class KLDReport:
    """KLD(ref || test) per position, in nats, and top-1 agreement."""

    per_position: np.ndarray  # [T] float64
    top1: float  # fraction of positions where argmax(ref) == argmax(test)
    top1_matches: int

    @property
    def positions(self) -> int:
        return int(self.per_position.shape[0])

    @property
    def mean(self) -> float:
        return float(self.per_position.mean())

    @property
    def max(self) -> float:
        return float(self.per_position.max())

    @property
    def argmax(self) -> int:
        return int(self.per_position.argmax())

    def line(self) -> str:
        return (
            f"KLD(ref||test) mean {self.mean:.6g} nats, max {self.max:.6g} (position "
            f"{self.argmax}), top-1 agreement {100 * self.top1:.2f}% "
            f"({self.top1_matches}/{self.positions}) over {self.positions} positions"
        )


def kld_report(ref, test) -> KLDReport:
    """KLD(ref || test) of two logits arrays [T, vocab] (or .npy paths), in float64."""
    ref = load_logits(ref) if isinstance(ref, (str, Path)) else np.asarray(ref)
    test = load_logits(test) if isinstance(test, (str, Path)) else np.asarray(test)
    if ref.shape != test.shape or ref.ndim != 2:
        raise OptionError(
            f"logits shapes differ: ref {list(ref.shape)} vs test {list(test.shape)} "
            "(both must be [T, vocab])"
        )
    check_finite_logits(ref, "ref")
    check_finite_logits(test, "test")
    lr, lt = log_softmax(ref), log_softmax(test)
    p = np.exp(lr)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (lr - lt), 0.0)
    per_position = terms.sum(axis=-1)
    matches = int((ref.argmax(axis=-1) == test.argmax(axis=-1)).sum())
    return KLDReport(per_position, matches / ref.shape[0], matches)


# ---- routing parity ------------------------------------------------------------------------


@dataclass
class ParityReport:
    """Per MoE layer: tokens compared and tokens whose top-k expert sets differ."""

    tokens: dict[int, int] = field(default_factory=dict)
    mismatches: dict[int, int] = field(default_factory=dict)
    notes: dict[int, str] = field(default_factory=dict)  # e.g. token counts differ

    @property
    def total_mismatches(self) -> int:
        return sum(self.mismatches.values())

    @property
    def ok(self) -> bool:
        return self.total_mismatches == 0

    def layer_lines(self) -> list[str]:
        out = []
        for layer in sorted(self.tokens):
            line = f"layer {layer:3d}: {self.mismatches[layer]}/{self.tokens[layer]} tokens differ"
            if layer in self.notes:
                line += f" ({self.notes[layer]})"
            out.append(line)
        return out

    def line(self) -> str:
        n = len(self.tokens)
        tokens = sum(self.tokens.values())
        if self.ok:
            return f"routing parity: identical top-k sets in {n} layers ({tokens} token-layers)"
        bad = [layer for layer in sorted(self.tokens) if self.mismatches[layer]]
        return (
            f"routing parity: {self.total_mismatches} of {tokens} token-layers differ, in "
            f"{len(bad)} of {n} layers (first: layer {bad[0]})"
        )


def _trace_rows(calls: list[np.ndarray]) -> np.ndarray:
    if not calls:
        return np.zeros((0, 0), dtype=np.int64)
    rows = np.concatenate([np.asarray(c).reshape(-1, np.asarray(c).shape[-1]) for c in calls])
    return np.sort(rows.astype(np.int64), axis=-1)


def route_parity(trace_a, trace_b) -> ParityReport:
    """Compare two RoutingTrace objects: per layer and token, the same set of top-k ids?

    Calls of a layer are concatenated along tokens, so runs chunked differently compare
    token by token. Tokens one trace has and the other lacks count as mismatches."""
    rep = ParityReport()
    for layer in sorted(set(trace_a.ids) | set(trace_b.ids)):
        a = _trace_rows(trace_a.ids.get(layer, []))
        b = _trace_rows(trace_b.ids.get(layer, []))
        n = min(len(a), len(b))
        extra = abs(len(a) - len(b))
        if len(a) != len(b):
            rep.notes[layer] = f"token counts differ: {len(a)} vs {len(b)}"
        if n and a.shape[1] != b.shape[1]:
            rep.notes[layer] = f"top-k differs: {a.shape[1]} vs {b.shape[1]}"
            diff = n
        else:
            diff = int((a[:n] != b[:n]).any(axis=-1).sum()) if n else 0
        rep.tokens[layer] = max(len(a), len(b))
        rep.mismatches[layer] = diff + extra
    return rep


# ---- MoE dumps -----------------------------------------------------------------------------


class MoeDumper:
    """The expert cache's dump hook: writes `layer{L:03d}_call{N:04d}_{x|ids|scores|y}.npy`.

    N counts the calls of layer L. ids are sorted along the last axis, and scores permuted
    with them, so argpartition's order does not matter; x, scores and y are float32."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise OptionError(f"{self.directory}: exists and is not a directory")
        if next(self.directory.glob("layer*_call*.npy"), None) is not None:
            # (a shorter run's dump over a longer one's leaves the longer one's last calls,
            # which dumps_equal would compare as if this run had written them)
            raise OptionError(f"{self.directory}: holds an earlier dump; give a new directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.calls: dict[int, int] = {}
        self.files = 0
        self.closed = False

    def __call__(self, layer, x, inds, scores, y) -> None:
        import mlx.core as mx

        if self.closed:
            raise RuntimeError("MoeDumper: write after close()")
        n = self.calls.get(layer, 0)
        self.calls[layer] = n + 1

        def f32(a) -> np.ndarray:
            return (
                np.array(a.astype(mx.float32))
                if isinstance(a, mx.array)
                else np.asarray(a, dtype=np.float32)
            )

        ids = np.array(inds).astype(np.int32)
        sc = f32(scores)
        order = np.argsort(ids, axis=-1, kind="stable")
        arrays = {
            "x": f32(x),
            "ids": np.take_along_axis(ids, order, axis=-1),
            "scores": np.take_along_axis(sc, order, axis=-1),
            "y": f32(y),
        }
        for name, a in arrays.items():
            np.save(self.directory / f"layer{layer:03d}_call{n:04d}_{name}.npy", a)
            self.files += 1

    def close(self) -> None:
        self.closed = True


def dumps_equal(dir_a: str | Path, dir_b: str | Path) -> list[str]:
    """Names of the .npy files that differ byte for byte (or exist on one side only)."""
    dirs = [Path(dir_a), Path(dir_b)]
    for d in dirs:
        if not d.is_dir():
            raise OptionError(f"{d}: no such dump directory")
    a, b = ({p.name: p for p in d.glob("*.npy")} for d in dirs)
    return sorted(
        name
        for name in set(a) | set(b)
        if name not in a or name not in b or a[name].read_bytes() != b[name].read_bytes()
    )


# ---- a traced run --------------------------------------------------------------------------


def traced_run(model_path: str | Path, ids: list[int], config, on_progress=None):
    """Load the store with `config`, trace routing over teacher-forced `ids`:
    (RoutingTrace, logits [T, vocab]). `on_progress(done)`: the positions done, a chunk at a
    time."""
    from ..runtime.loader import load_model
    from ..stream.stats import RoutingTrace
    from .generate import teacher_forced_logits

    trace = RoutingTrace()
    model = load_model(model_path, config=config.replace(trace=trace))
    vocab = model.args.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        model.expert_cache.close()
        raise OptionError(f"--prompt-tokens: token ids must lie in [0, {vocab})")
    try:
        logits = teacher_forced_logits(model, ids, config.prefill_step_size, on_progress)
    finally:
        model.expert_cache.close()
    return trace, logits
