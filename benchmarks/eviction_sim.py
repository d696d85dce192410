"""Eviction policies replayed on a recorded routing trace: decode miss rates at a given arena,
against Belady's optimum (evict what is next used farthest in the future), so a policy's
distance from the best any policy could do is measured, not guessed.

    python benchmarks/eviction_sim.py TRACE.npz --slots 7000 [--policies lru,lfu,belady]

TRACE.npz comes from `benchmarks/decode.py --trace DIR` (per layer, the routing ids of every
call: the prompt's chunks, then one row per decode token). The replay walks the calls in order
and the MoE layers in order within a call; a layer's distinct experts are looked up together
(pinned while it runs, as the arena does). Only decode lookups are counted (from the second
one-token call, as benchmarks/decode.py counts); the prefill is
replayed so the arena enters decode holding what it would. Misses are per (layer, expert)
lookup. Read-ahead is not modelled: these are demand misses.
"""

from __future__ import annotations

import argparse
import heapq
from collections import OrderedDict, defaultdict

import numpy as np


def accesses(path: str) -> tuple[list[tuple[bool, int, np.ndarray]], int]:
    """[(is_decode, layer, distinct experts)] in execution order, and the number of prompt
    calls (prefill chunks)."""
    z = np.load(path)
    layers = sorted(int(k[1:]) for k in z.files if k[0] == "L" and not k.endswith("_T"))
    rows = {l: np.split(z[f"L{l}"], np.cumsum(z[f"L{l}_T"])[:-1]) for l in layers}
    n_calls = min(len(r) for r in rows.values())
    seq = []
    prompt_calls = 0
    first = next((c for c in range(n_calls) if len(rows[layers[0]][c]) == 1), n_calls)
    for c in range(n_calls):
        # The first one-token call is the prompt's last token (generate_step's first step):
        # benchmarks/decode.py counts decode from the token after it.
        decode = c > first
        prompt_calls += not decode
        for l in layers:
            seq.append((decode, l, np.unique(rows[l][c])))
    return seq, prompt_calls


def replay_layer(seq, slots: int) -> tuple[int, int]:
    """The arena's "layer" policy (LayerDistance): evict from the layer running now (the
    one whose experts come back last in the cycle), then the one before it..., LRU within."""
    layers = sorted({l for _, l, _ in seq})
    pos = {l: i for i, l in enumerate(layers)}
    by_layer = {l: OrderedDict() for l in layers}
    n_res = misses = lookups = 0
    for decode, layer, es in seq:
        od = by_layer[layer]
        pinned = {int(e) for e in es}
        for e in pinned:
            if e in od:
                od.move_to_end(e)
                continue
            misses += decode
            if n_res >= slots:
                for i in range(len(layers)):
                    victims = by_layer[layers[(pos[layer] - i) % len(layers)]]
                    v = next((k for k in victims if i or k not in pinned), None)
                    if v is not None:
                        del victims[v]
                        n_res -= 1
                        break
            od[e] = None
            n_res += 1
        lookups += decode * len(es)
    return misses, lookups


def replay(seq, slots: int, policy: str) -> tuple[int, int]:
    """(decode misses, decode lookups) under `policy`: lru | lfu | layer | belady."""
    if policy == "layer":
        return replay_layer(seq, slots)
    keys = [[(l, int(e)) for e in es] for _, l, es in seq]
    nxt: list[list[int]] = []
    if policy == "belady":
        last: dict = {}
        inf = len(keys)
        nxt = [[0] * len(k) for k in keys]
        for i in range(len(keys) - 1, -1, -1):
            for j, key in enumerate(keys[i]):
                nxt[i][j] = last.get(key, inf)
                last[key] = i
    resident: OrderedDict = OrderedDict()  # key -> None, LRU order
    freq: dict = defaultdict(int)
    heap: list = []  # belady: (-next use, key), lazily invalidated
    next_use: dict = {}
    misses = lookups = 0
    for i, ((decode, _, _), ks) in enumerate(zip(seq, keys)):
        pinned = set(ks)
        for j, key in enumerate(ks):
            freq[key] += 1
            if key in resident:
                resident.move_to_end(key)
            else:
                misses += decode
                if len(resident) >= slots:
                    victim = _victim(policy, resident, freq, heap, next_use, pinned)
                    del resident[victim]
                resident[key] = None
            if policy == "belady":
                next_use[key] = nxt[i][j]
                heapq.heappush(heap, (-nxt[i][j], key))
        lookups += decode * len(ks)
    return misses, lookups


def _victim(policy, resident, freq, heap, next_use, pinned):
    if policy == "lru":
        return next(k for k in resident if k not in pinned)
    if policy == "lfu":  # least used so far, the least recent among equals
        return min((k for k in resident if k not in pinned), key=lambda k: freq[k])
    skipped = []
    while True:  # belady: the resident key whose next use is farthest
        neg, key = heapq.heappop(heap)
        if key in resident and next_use.get(key) == -neg and key not in pinned:
            for item in skipped:
                heapq.heappush(heap, item)
            return key
        if key in resident and next_use.get(key) == -neg:
            skipped.append((neg, key))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--slots", type=int, required=True, help="arena slots (records)")
    ap.add_argument("--policies", default="lru,lfu,layer,belady")
    a = ap.parse_args()
    seq, prompt_calls = accesses(a.trace)
    tokens = sum(d for d, _, _ in seq) // max(len({l for _, l, _ in seq}), 1)
    print(f"{a.trace}: {prompt_calls} prompt calls, {tokens} decode tokens, {a.slots} slots")
    for policy in a.policies.split(","):
        m, n = replay(seq, a.slots, policy)
        print(f"  {policy:>7}: decode misses {m} of {n} lookups ({100 * m / max(n, 1):.1f} %)")


if __name__ == "__main__":
    main()
