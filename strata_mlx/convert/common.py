"""What every converter shares: output checks, the calibration pass, tokenizer copying.

A converter writes into a StoreWriter (a temporary directory), runs calibration on the
finished temporary store, and only then renames it into place.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..store import MANIFEST, StoreError, StoreWriter, save_profile
from ..tokenizer import TOKENIZER_FILES

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


def check_output(out: str | Path) -> Path:
    """Refuse to replace a directory that is not a strata-mlx store."""
    out = Path(out)
    if out.exists() and (
        not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file())
    ):
        raise StoreError(f"{out}: exists and is not a strata-mlx store; refusing to overwrite it")
    return out


def copy_tokenizer(src: Path, dst: Path) -> bool:
    copied = False
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied = True
    return copied and (dst / "tokenizer.json").is_file()


def calibrate(
    writer: StoreWriter, tokens: int, seed: int = 0, arena_gb: float | None = None
) -> None:
    """Run the finished temporary store over `tokens` calibration tokens; save per-layer counts."""
    if tokens <= 0 or not writer.manifest.moe_layers:
        return
    from ..experts import RoutingTrace
    from ..loader import load

    path = writer.finalize()
    model, tok = load(path, arena_gb=arena_gb, read_ahead="demand")
    try:
        if tok is not None:
            ids = tok.encode(CALIBRATION_TEXT)
            while len(ids) < tokens:
                ids = ids + ids
            ids = ids[:tokens]
            source = "calibration text"
        else:
            vocab = model.args.vocab_size
            ids = np.random.default_rng(seed).integers(0, vocab, size=tokens).tolist()
            source = f"random token ids (seed {seed}); the store has no tokenizer"
        cache = model.expert_cache
        cache.trace = RoutingTrace()
        kv = model.make_cache()
        step = 256
        for i in range(0, len(ids), step):
            mx.eval(model(mx.array([ids[i : i + step]]), cache=kv))
        m = writer.manifest
        counts = np.zeros((len(m.moe_layers), m.num_experts), dtype=np.int64)
        for layer, calls in cache.trace.ids.items():
            pos = m.layer_position(layer)
            for ids_np in calls:
                counts[pos] += np.bincount(ids_np.reshape(-1), minlength=m.num_experts)
        save_profile(path, counts, len(ids), source)
    finally:
        model.expert_cache.close()


def to_float_dtype(name: str):
    try:
        return {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[name]
    except KeyError:
        raise StoreError(f"--dtype {name}: expected float32, float16 or bfloat16") from None
