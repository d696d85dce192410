"""Cache-aware routing (--moce-bonus): what it saves in reads and what it costs in quality.

    python benchmarks/moce_bonus.py [--model STORE] [--experts-per-token 8] [--bonuses 0.5,1,2,4]

Teacher-forced decode: the first 8 tokens of a fixed English text are prefilled, then every
later token is fed one at a time in decode mode (where the bonus applies), collecting the
logits. Each bonus is compared with exact routing (bonus 0) on the same store, arena and
tokens: mean KLD(exact || bonus) in nats, top-1 agreement, misses and experts read.
Default store: the built-in SmolLM2 split model, routed top-k of its 16 experts (at k = 16
every expert runs and a bonus changes nothing).
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

import strata_mlx
from strata_mlx.generation.tools import kld_report

TEXT = (
    "The old lighthouse stood at the end of the harbour wall, and every evening the keeper "
    "climbed its hundred and twelve steps to light the lamp. Ships coming home from the north "
    "looked for it long before they saw the town, and fishermen said that on clear nights it "
    "could be seen from the islands. When the keeper grew old, his daughter took over the work."
)


def decode_logits(model, ids: list[int], prefill: int = 8) -> tuple[np.ndarray, object]:
    cache = model.make_cache()
    ec = model.expert_cache
    model(mx.array([ids[:prefill]]), cache=cache)
    before = ec.stats.copy()
    ec.decoding = True
    out = []
    for t in ids[prefill:]:
        out.append(np.array(model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32)))
    ec.decoding = False
    return np.stack(out), ec.stats.minus(before)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--experts-per-token", type=int, default=8, help="0: the store's own top-k")
    ap.add_argument("--bonuses", default="0.5,1,2,4")
    ap.add_argument("--arena-gb", type=float, default=None)
    a = ap.parse_args()
    from strata_mlx.apps.default_model import default_arena_gb, default_store

    path = a.model or default_store()
    arena = a.arena_gb if a.arena_gb is not None else default_arena_gb(path)
    rows = []
    ref = None
    for bonus in [0.0] + [float(b) for b in a.bonuses.split(",")]:
        model, tok = strata_mlx.load(path, arena_gb=arena, read_ahead="demand")
        if a.experts_per_token:
            for block in model.moe_blocks().values():
                block.top_k = a.experts_per_token
        model.expert_cache.route_bonus = bonus
        if tok is not None:
            ids = tok.encode(TEXT)
        else:  # a store without a tokenizer: fixed random ids
            ids = np.random.default_rng(0).integers(0, model.args.vocab_size, 72).tolist()
        logits, stats = decode_logits(model, ids)
        if ref is None:
            ref = logits
        r = kld_report(ref, logits)
        rows.append((bonus, r.mean, r.top1, stats.misses, stats.lookups, stats.experts_read))
        model.expert_cache.close()
    print(
        f"store {path}, experts per token {a.experts_per_token}, arena {arena:.4f} GB, {len(ids) - 8} decode tokens"
    )
    print("| bonus | mean KLD (nats) | top-1 agreement | misses / lookups | experts read |")
    print("|---|---|---|---|---|")
    for b, k, t, m, lk, rd in rows:
        print(f"| {b:g} | {k:.3g} | {t:.3f} | {m} / {lk} ({100 * m / max(lk, 1):.1f} %) | {rd} |")


if __name__ == "__main__":
    main()
