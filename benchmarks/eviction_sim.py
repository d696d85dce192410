"""Eviction policies replayed on a recorded routing trace: decode miss rates at a given arena,
against Belady's optimum (evict what is next used farthest in the future), so a policy's
distance from the best any policy could do is measured, not guessed.

    python benchmarks/eviction_sim.py TRACE.npz --slots 7000 [--policies lru,lfu,belady]

TRACE.npz is a trace file (strata_mlx.trace: `strata-mlx bench --trace`, `generate --trace`,
`load(trace=...)`, or `benchmarks/decode.py --trace DIR`). The replay walks the calls in order
and the MoE layers in order within a call; a layer's distinct experts are looked up together
(pinned while it runs, as the arena does). Only decode lookups are counted (from the second
one-token call, as benchmarks/decode.py counts); the prefill is
replayed so the arena enters decode holding what it would. Misses are per (layer, expert)
lookup. Read-ahead is not modelled: these are demand misses. The online policies are the
arena's own classes, so what is replayed is what the runtime would do.
"""

from __future__ import annotations

import argparse
import heapq

import numpy as np

from strata_mlx import trace
from strata_mlx.arena import make_policy


def accesses(path: str) -> tuple[list[tuple[bool, int, np.ndarray]], int]:
    """[(is_decode, layer, distinct experts)] in execution order, and the number of prompt
    calls (prefill chunks and the prompt's last token): strata_mlx.trace reads the file."""
    t = trace.read(path)
    return list(t.lookups()), t.decode_from


def replay(seq, slots: int, policy: str) -> tuple[int, int]:
    """(decode misses, decode lookups) under `policy`: one of the arena's own eviction
    policies (strata_mlx.arena: lru, lfu, profile without a profile = lru, layer), driven as
    the handshake drives them (a layer's hits touched and pinned, then its misses given
    slots), or "belady"."""
    if policy == "belady":
        return _belady(seq, slots)
    layers = sorted({l for _, l, _ in seq})
    pol = make_policy(policy, None, layers)
    resident: set = set()
    misses = lookups = 0
    for decode, layer, es in seq:
        pol.current = layer
        keys = [(layer, int(e)) for e in es]
        pinned = set(keys)
        missed = [k for k in keys if k not in resident]
        for k in keys:
            if k in resident:
                pol.touch(k)
        for k in missed:
            if len(resident) >= slots:
                victim = pol.victim(lambda v, p=pinned: v not in p)
                pol.remove(victim)
                resident.discard(victim)
            resident.add(k)
            pol.touch(k)
        misses += decode * len(missed)
        lookups += decode * len(keys)
    return misses, lookups


def _belady(seq, slots: int) -> tuple[int, int]:
    """Evict the resident expert whose next use is farthest in the future (lazy heap)."""
    keys = [[(l, int(e)) for e in es] for _, l, es in seq]
    inf = len(keys)
    nxt = [[0] * len(k) for k in keys]
    last: dict = {}
    for i in range(len(keys) - 1, -1, -1):
        for j, key in enumerate(keys[i]):
            nxt[i][j] = last.get(key, inf)
            last[key] = i
    resident: set = set()
    heap: list = []  # (-next use, key), an entry live while it is the key's next use
    next_use: dict = {}
    misses = lookups = 0
    for i, ((decode, _, _), ks) in enumerate(zip(seq, keys)):
        pinned = set(ks)
        for j, key in enumerate(ks):
            if key not in resident:
                misses += decode
                if len(resident) >= slots:
                    skipped = []
                    while True:
                        neg, v = heapq.heappop(heap)
                        if v not in resident or next_use.get(v) != -neg:
                            continue
                        if v not in pinned:
                            break
                        skipped.append((neg, v))
                    for item in skipped:
                        heapq.heappush(heap, item)
                    resident.discard(v)
                resident.add(key)
            next_use[key] = nxt[i][j]
            heapq.heappush(heap, (-nxt[i][j], key))
        lookups += decode * len(ks)
    return misses, lookups


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
