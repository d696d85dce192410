"""Host time of one eviction under each of the arena's policies, at a given arena size.

    python benchmarks/eviction_cost.py [--slots 7104] [--layers 48] [--evictions 5000]

A full arena of `slots` experts over `layers` layers; each step evicts the policy's victim
and touches a new expert (profile: a random routing profile). Prints microseconds a step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from strata_mlx.stream.arena import POLICIES, make_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=7104)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--evictions", type=int, default=5000)
    a = ap.parse_args()
    per_layer = a.slots // a.layers
    profile = np.random.default_rng(1).integers(0, 100, (a.layers, 4 * per_layer))
    for name in sorted(POLICIES):
        policy = make_policy(name, profile, list(range(a.layers)))
        for layer in range(a.layers):
            for e in range(per_layer):
                policy.touch((layer, e))
        rng = np.random.default_rng(0)
        t = time.perf_counter()
        for _ in range(a.evictions):
            key = (int(rng.integers(a.layers)), int(rng.integers(4 * per_layer)))
            policy.current = key[0]
            policy.remove(policy.victim(lambda k: True))
            policy.touch(key)
        us = (time.perf_counter() - t) / a.evictions * 1e6
        print(f"{name:>8}: {us:.0f} us an eviction ({a.slots} slots, {a.layers} layers)")


if __name__ == "__main__":
    main()
