"""What every converter shares: output checks, the calibration pass, tokenizer copying.

A converter writes into a StoreWriter (a temporary directory), runs calibration on the
finished temporary store, and only then renames it into place. It never writes over its
source, the directory it runs from, or an existing store without `overwrite`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..format.store import DENSE, EXPERTS, MANIFEST, PROFILE, VERIFIED, StoreError
from ..format.writer import OWNER, StoreWriter, remove_dead_temps, save_profile
from ..generation.tokenizer import TOKENIZER_FILES

# Plain English prose for the routing profile when the store has a tokenizer.
CALIBRATION_TEXT = (
    "The river leaves the mountains in a narrow gorge and spreads across the plain, where "
    "farmers have drawn water from it for three thousand years. In spring the snowmelt "
    "raises it by several metres; in late summer it shrinks to a chain of pools. The town "
    "grew up at the first bridge, and its market still fills the square on Thursdays. "
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n    return out + a + b\n"
    "Researchers measured the drive's bandwidth at one, four and eight readers, then "
    "repeated the run while the processor multiplied large matrices. The table below lists "
    "the results, in gigabytes per second, with the ratio to the drive alone. "
    "Question: what is the capital of France? Answer: Paris. Question: how many legs does a "
    "spider have? Answer: eight. 1, 2, 3, 5, 8, 13, 21, 34, 55, 89. "
)


CALIBRATION_STEP = 256  # calibration tokens a forward

# Whether a conversion may replace an existing store: converters take `overwrite=`; the CLI's
# --overwrite also reaches converters that do not (yet) take it, through this variable.
_OVERWRITE: contextvars.ContextVar[bool] = contextvars.ContextVar("overwrite", default=False)


@contextlib.contextmanager
def overwriting(allowed: bool = True):
    """Within this block, check_output() lets a conversion replace an existing store."""
    token = _OVERWRITE.set(allowed)
    try:
        yield
    finally:
        _OVERWRITE.reset(token)


def store_files() -> set[str]:
    """Names a store directory may hold; anything else is a user's and blocks replacing it."""
    return {MANIFEST, DENSE, EXPERTS, PROFILE, VERIFIED, OWNER, *TOKENIZER_FILES}


def check_output(out: str | Path, *sources: str | Path, overwrite: bool | None = None) -> Path:
    """Where a conversion may write, checked before it reads anything. Refused: the source
    itself, a directory holding the source or the current directory (replacing it would
    delete them), and anything that is not a strata-mlx store. An existing store is replaced
    only with `overwrite` (default: the `overwriting()` setting, off), and only if it holds
    nothing but store files. Temporary directories of dead conversions into `out` go first."""
    out = Path(out)
    if overwrite is None:
        overwrite = _OVERWRITE.get()
    remove_dead_temps(out)
    real = out.resolve()
    for src in sources:
        s = Path(src).resolve()
        if s == real:
            raise StoreError(f"{out}: is the source; write the store somewhere else")
        if real in s.parents:
            raise StoreError(f"{out}: holds the source {src}; write the store somewhere else")
    cwd = Path.cwd().resolve()
    if cwd == real or real in cwd.parents:
        raise StoreError(
            f"{out}: is the directory this command runs in (or holds it); "
            "run it from elsewhere or write the store somewhere else"
        )
    parent = next(p for p in [real, *real.parents] if p.exists())
    if not os.access(parent, os.W_OK):  # EROFS even for root, before any work is done
        raise StoreError(f"{out}: cannot write the store ({parent} is not writable)")
    if not out.exists() and not out.is_symlink():
        return out
    if not out.is_dir() or out.is_symlink():
        raise StoreError(f"{out}: exists and is not a directory; refusing to overwrite it")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return out
    if not (out / MANIFEST).is_file():
        raise StoreError(f"{out}: exists and is not a strata-mlx store; refusing to overwrite it")
    if not overwrite:
        raise StoreError(
            f"{out}: a store already exists; pass --overwrite to replace it "
            "(the old one is kept until the new one is complete)"
        )
    foreign = [n for n in entries if n not in store_files()]
    if foreign:
        raise StoreError(
            f"{out}: holds {foreign[0]!r}, which is not a store file; "
            "refusing to delete it with the old store (move it first)"
        )
    return out


def copy_tokenizer(src: Path, dst: Path) -> bool:
    copied = False
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied = True
    return copied and (dst / "tokenizer.json").is_file()


def calibrate(
    writer: StoreWriter,
    tokens: int,
    seed: int = 0,
    arena_gb: float | None = None,
    progress: bool = True,
) -> None:
    """Run the finished temporary store over `tokens` calibration tokens; save per-layer counts.
    `progress`: a bar over the layers' routing decisions (seconds to minutes on a CPU)."""
    if tokens <= 0 or not writer.manifest.moe_layers:
        return
    from ..generation.generate import forward_chunks, load
    from ..progress import StatusLine

    path = writer.finalize()
    total = -(-tokens // CALIBRATION_STEP) * len(writer.manifest.moe_layers)
    # redrawn each second: one layer's pass on a CPU can take minutes
    bar = StatusLine(enabled=progress, delay=0.0, leave=True, desc="calibration", total=total,
                     unit="layer", bar_format=None)  # fmt: skip
    trace = _TracedProgress(bar)
    try:
        model, tok = load(path, arena_gb=arena_gb, read_ahead="demand", trace=trace)
    except BaseException:
        bar.close()
        raise
    try:
        if tok is not None:
            ids = tok.encode(CALIBRATION_TEXT)
            if not ids or max(ids) >= model.args.vocab_size:
                raise StoreError(
                    f"{path / 'tokenizer.json'}: the calibration text encodes to "
                    f"{'no tokens' if not ids else f'id {max(ids)}'}, outside the model's "
                    f"vocabulary of {model.args.vocab_size}"
                )
            while len(ids) < tokens:
                ids = ids + ids
            ids = ids[:tokens]
            source = "calibration text"
        else:
            vocab = model.args.vocab_size
            ids = np.random.default_rng(seed).integers(0, vocab, size=tokens).tolist()
            source = f"random token ids (seed {seed}); the store has no tokenizer"
        # The routing is all the pass needs: the trace records it at each layer's handshake
        forward_chunks(model, mx.array(ids), model.make_cache(), CALIBRATION_STEP)
        m = writer.manifest
        counts = np.zeros((len(m.moe_layers), m.num_experts), dtype=np.int64)
        for layer, calls in trace.ids.items():
            pos = m.layer_position(layer)
            for ids_np in calls:
                counts[pos] += np.bincount(ids_np.reshape(-1), minlength=m.num_experts)
        save_profile(path, counts, len(ids), source)
    finally:
        bar.close()
        model.expert_cache.close()


class _TracedProgress:
    """A RoutingTrace that moves a progress bar at each layer's routing decision."""

    def __init__(self, bar):
        from ..stream.stats import RoutingTrace

        self.inner = RoutingTrace()
        self.ids = self.inner.ids
        self.predicted = self.inner.predicted
        self.bar, self.done = bar, 0

    def record(self, layer: int, ids: np.ndarray) -> None:
        self.inner.record(layer, ids)
        self.done += 1
        self.bar.count(self.done)

    def record_prediction(self, layer: int, ids: np.ndarray) -> None:
        self.inner.record_prediction(layer, ids)


FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def check_finite(
    tensors: dict[str, mx.array], where: str, allow: bool = False, cast: mx.Dtype | None = None
) -> None:
    """Refuse float tensors holding NaN or inf (the store would compute NaN: a checkpoint with
    NaN weights converted and generated "0 0 0"), after a cast to `cast` where the store keeps
    them in another dtype (1e38 in float16 is inf). Checked on the source floats: MLX's affine
    and MXFP4 quantizers drop a NaN from their scales, so the quantized record can look fine.
    One StoreError `{where}{name}: ...`; `allow` (--allow-non-finite) skips the check."""
    if allow:
        return
    floats = {k: v for k, v in tensors.items() if v.dtype in FLOAT_DTYPES}
    if not floats:
        return
    names = list(floats)
    counts = [
        mx.sum(~mx.isfinite(floats[k] if cast is None else floats[k].astype(cast))) for k in names
    ]
    mx.eval(counts)
    for k, n in zip(names, counts):
        if n.item():
            after = f" after the cast to {str(cast).split('.')[-1]}" if cast is not None else ""
            raise StoreError(
                f"{where}{k}: {n.item()} non-finite values (NaN or inf){after}; the model would "
                "compute NaN (pass --allow-non-finite to convert it anyway)"
            )


def to_float_dtype(name: str):
    try:
        return {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[name]
    except KeyError:
        raise StoreError(f"--dtype {name}: expected float32, float16 or bfloat16") from None
