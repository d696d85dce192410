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


# Chunks of a prompt, or decode tokens, the forecast takes one by one; past them, runs of
# 1/RUN_SHARE of those before, each taken at its middle one: by then a chunk's reads and a
# decode token's residency move slowly, and 16 M of them take ~1,650 steps, not 16 M.
EXACT_STEPS = 1024
RUN_SHARE = 64


def runs(count: int) -> list[tuple[int, int]]:
    """(first, how many) covering 0 .. count - 1: one by one up to EXACT_STEPS, then runs of
    1/RUN_SHARE of those before them."""
    out, i = [], 0
    while i < count:
        n = 1 if i < EXACT_STEPS else min(i // RUN_SHARE, count - i)
        out.append((i, n))
        i += n
    return out


def prefill_reads(
    p: np.ndarray, slots: int, prompt: int, step: int
) -> list[tuple[int, int, int, float]]:
    """[(first chunk, chunks, tokens a chunk, experts a chunk reads)] of a cold prompt: its
    whole chunks in runs (runs(): a run's reads are its middle chunk's), then a short last
    one."""
    q_full = hit_probability(p, step)  # (an expert's chance to be picked in a chunk)
    gap = reuse_gap(q_full, slots, max(prompt // step, 1))

    def reads(c: int, tokens: int) -> float:
        q = hit_probability(p, tokens)
        hit = hit_probability(q_full, min(gap, c)) if c else np.zeros_like(q)
        return float(np.sum(q * (1 - hit)))

    whole, rest = divmod(prompt, step)
    out = [(c, n, step, reads(c + (n - 1) // 2, step)) for c, n in runs(whole)]
    if rest:
        out.append((whole, 1, rest, reads(whole, rest)))
    return out


def decode_hits(
    p: np.ndarray,
    layers: int,
    slots: int,
    prompt: int,
    step: int,
    gen: int,
    tokens: list[int] | None = None,
) -> np.ndarray:
    """[gen] share of each decode token's lookups resident, decoding right after a cold
    prompt: the arena starts with what the prefill's layer sweep left and turns over to
    decode's own working set. `tokens`: the decode tokens (each < gen) to give the share of,
    in place of every one.

    What the sweep left: its (chunk, layer) positions walked from the newest back, each adding
    the experts it touched that no newer position had, until `slots` are accounted for (LRU
    keeps the most recent). An expert is resident at decode token t if decode used it within
    its last min(t, g*) tokens (g*: decode's LRU reuse gap), or if the prefill left it and it
    has not been pushed out: once decode has brought in more items than the arena had free,
    the prefill's items go, oldest first (taken as evenly spread)."""
    left = _prefill_leftovers(p.reshape(layers, -1), slots, prompt, step).reshape(-1)
    held = float(left.sum())
    free = max(slots - held, 0.0)
    g_star = reuse_gap(p, slots, max(gen, 1))
    tokens = range(gen) if tokens is None else tokens
    out = np.empty(len(tokens))
    for i, t in enumerate(tokens):
        own = hit_probability(p, min(t, g_star))
        new = float(np.sum(hit_probability(p, t) * (1 - left)))
        kept = min(max(1 - max(new - free, 0.0) / held, 0.0), 1.0) if held > 0 else 0.0
        hit = 1 - (1 - own) * (1 - left * kept)
        out[i] = float(np.sum(p * hit) / np.sum(p))
    return out


def _prefill_leftovers(p_layers: np.ndarray, slots: int, prompt: int, step: int) -> np.ndarray:
    """[layers, experts] chance the cold prefill's sweep left each expert resident: its
    (chunk, layer) positions from the newest back, as decode_hits says. While the room lasts,
    the newest m chunks together leave what their tokens touched (1 - (1 - p)^tokens): the
    largest m that fits is found by bisection, and only the chunk before them is walked layer
    by layer (it fills the room), so that the cost does not grow with the prompt's chunks."""
    chunks = -(-max(prompt, 0) // step)
    last = prompt - (chunks - 1) * step  # the last chunk's tokens, short or whole

    def newest(m: int) -> np.ndarray:  # what the newest m chunks touched
        return hit_probability(p_layers, 0 if m == 0 else last + (m - 1) * step)

    lo, hi = 0, chunks  # the most chunks whose experts all fit
    if newest(hi).sum() <= slots:
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if newest(mid).sum() <= slots else (lo, mid)
    left = newest(lo)
    room = slots - float(left.sum())
    tokens = last if lo == 0 else step  # the chunk before them
    for l in reversed(range(p_layers.shape[0]) if lo < chunks else ()):
        add = hit_probability(p_layers[l], tokens) * (1 - left[l])
        total = float(add.sum())
        if total <= 0:
            continue
        f = min(1.0, room / total)
        left[l] += f * add
        room -= f * total
        if room <= 1e-9:
            break
    return left
