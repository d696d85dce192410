"""The residency model: expert popularity from the routing profile (with Good-Turing's share
for experts calibration never saw), reuse gaps in the arena's LRU sweep, hit rates in
prefill and decode. Pure arithmetic: never loads a model."""

from __future__ import annotations

import numpy as np

from .shapes import ModelShape

# ---- residency and reads --------------------------------------------------------------


def pick_probabilities(shape: ModelShape) -> np.ndarray:
    """[layers * experts] chance that one token picks each expert (sums to k a layer)."""
    k, E, L = shape.top_k, shape.num_experts, shape.moe_layers
    prof = shape.profile
    if prof is None or prof.sum() == 0:
        return np.full(L * E, k / max(E, 1))
    return np.clip(smoothed_shares(prof) * k, 0.0, 1.0).reshape(-1)


def smoothed_shares(counts: np.ndarray) -> np.ndarray:
    """[layers, experts] share of a layer's picks each expert gets, from calibration counts.
    The experts calibration never saw are not absent, only rarer than it could tell: Good and
    Turing's estimate gives them, together, the share of picks that went to experts seen once
    (n1 / n), split evenly but none above what an expert seen once gets, and scales the seen
    ones' shares down by as much; a layer calibration never reached is uniform. Without it a
    chunk longer than the calibration run was forecast to need only the experts calibration
    saw (on an H200: 365 of 512 a layer from 256 tokens, against 453 read). Spreading that
    share evenly over every unseen expert overshoots where popularity has a long tail: on the
    qwen3-next synthetic shape's own routing (benchmarks/synthetic_routing.py, 4 layers), a
    1024-token chunk needs 419 a layer; from a 256-token profile this gives 470 (+12 %), what
    calibration saw 326 (-22 %), Chao's estimate of the unseen count 380 (-9 %); from 512
    tokens 455 / 382 / 417. The forecast errs toward reading more."""
    c = counts.astype(np.float64)
    n = c.sum(axis=1, keepdims=True)
    unseen = c == 0
    n_unseen = unseen.sum(axis=1, keepdims=True)
    singles = (c == 1).sum(axis=1, keepdims=True)
    safe_n = np.maximum(n, 1)
    # no unseen expert above what one seen once would get; none seen once: rare, not absent
    each = np.minimum(singles / safe_n / np.maximum(n_unseen, 1), 1 / (safe_n + n_unseen))
    each = np.where(n_unseen > 0, np.maximum(each, 1e-3 / safe_n), 0.0)
    share = np.where(unseen, each, c / safe_n * (1 - each * n_unseen))
    share = share / share.sum(axis=1, keepdims=True)
    return np.where(n > 0, share, 1.0 / c.shape[1])  # a layer calibration never reached


def reuse_gap(q: np.ndarray, slots: int, limit: int) -> int:
    """The largest g <= limit with sum_i 1 - (1 - q_i)^g <= slots: an item needed again
    after g steps is still resident (LRU)."""
    if len(q) <= slots:
        return limit
    lq = np.log1p(-np.minimum(q, 1 - 1e-12))

    def distinct(g: int) -> float:
        return float(np.sum(-np.expm1(lq * g)))

    if distinct(1) > slots:
        return 0
    lo, hi = 1, 1
    while hi < limit and distinct(hi) <= slots:
        lo, hi = hi, min(hi * 2, limit)
    if distinct(hi) <= slots:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if distinct(mid) <= slots else (lo, mid)
    return lo


def hit_probability(q: np.ndarray, gap: int) -> np.ndarray:
    return -np.expm1(np.log1p(-np.minimum(q, 1 - 1e-12)) * gap)


def prefill_reads(p: np.ndarray, slots: int, prompt: int, step: int) -> list[tuple[int, float]]:
    """[(tokens, experts read)] for each chunk of a cold prompt."""
    out = []
    done = 0
    q_full = -np.expm1(np.log1p(-np.minimum(p, 1 - 1e-12)) * step)
    gap = reuse_gap(q_full, slots, max(prompt // step, 1))
    c = 0
    while done < prompt:
        t = min(step, prompt - done)
        q = -np.expm1(np.log1p(-np.minimum(p, 1 - 1e-12)) * t)
        hit = hit_probability(q_full, min(gap, c)) if c else np.zeros_like(q)
        out.append((t, float(np.sum(q * (1 - hit)))))
        done += t
        c += 1
    return out


def decode_hits(
    p: np.ndarray, layers: int, slots: int, prompt: int, step: int, gen: int
) -> np.ndarray:
    """[gen] share of each decode token's lookups resident, decoding right after a cold
    prompt: the arena starts with what the prefill's layer sweep left and turns over to
    decode's own working set.

    What the sweep left: its (chunk, layer) positions walked from the newest back, each adding
    the experts it touched that no newer position had, until `slots` are accounted for (LRU
    keeps the most recent). An expert is resident at decode token t if decode used it within
    its last min(t, g*) tokens (g*: decode's LRU reuse gap), or if the prefill left it and it
    has not been pushed out: once decode has brought in more items than the arena had free,
    the prefill's items go, oldest first (taken as evenly spread)."""
    p_layers = p.reshape(layers, -1)
    left = np.zeros_like(p_layers)
    room = float(slots)
    sizes = [min(step, prompt - c) for c in range(0, max(prompt, 0), step)]
    newest_first = ((tokens, l) for tokens in reversed(sizes) for l in reversed(range(layers)))
    for tokens, l in newest_first:
        add = hit_probability(p_layers[l], tokens) * (1 - left[l])
        total = float(add.sum())
        if total <= 0:
            continue
        f = min(1.0, room / total)
        left[l] += f * add
        room -= f * total
        if room <= 1e-9:
            break
    left = left.reshape(-1)
    held = float(left.sum())
    free = max(slots - held, 0.0)
    g_star = reuse_gap(p, slots, max(gen, 1))
    out = np.empty(gen)
    for t in range(gen):
        own = hit_probability(p, min(t, g_star))
        new = float(np.sum(hit_probability(p, t) * (1 - left)))
        kept = min(max(1 - max(new - free, 0.0) / held, 0.0), 1.0) if held > 0 else 0.0
        hit = 1 - (1 - own) * (1 - left * kept)
        out[t] = float(np.sum(p * hit) / np.sum(p))
    return out
