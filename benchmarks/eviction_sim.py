"""Eviction policies replayed on a recorded routing trace: decode miss rates at a given arena,
against Belady's optimum (evict what is next used farthest in the future), so a policy's
distance from the best any policy could do is measured, not guessed.

    python benchmarks/eviction_sim.py TRACE.npz --slots 7000 [--policies lru,lfu,belady]

TRACE.npz is a trace file (strata_mlx.stream.trace: `strata-mlx bench --trace`, `generate --trace`,
`load(trace=...)`, or `benchmarks/decode.py --trace DIR`). The replay is strata_mlx.apps.cache_sim's
(`strata-mlx cache-sim` prints more: MB/token, the prefill, the gap closed): the calls in order,
the MoE layers in order within a call, a layer's distinct experts looked up together and
pinned while it runs, the arena's own policy classes driven as the handshake drives them.
Only decode lookups are counted (from the second one-token call, as benchmarks/decode.py
counts); the prefill is replayed so the arena enters decode holding what it would. Read-ahead
is not modelled: these are demand misses.
"""

from __future__ import annotations

import argparse

from strata_mlx.apps import cache_sim
from strata_mlx.stream import trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--slots", type=int, required=True, help="arena slots (records)")
    ap.add_argument("--policies", default="lru,lfu,layer,belady")
    a = ap.parse_args()
    t = trace.read(a.trace)
    print(
        f"{a.trace}: {t.prompt_calls} prompt calls, {t.decode_tokens} decode tokens, {a.slots} slots"
    )
    for r in cache_sim.compare(t, a.slots, a.policies.split(",")):
        print(
            f"  {r.policy:>7}: decode misses {r.decode_misses} of {r.decode_lookups} lookups "
            f"({r.miss_pct:.1f} %)"
        )


if __name__ == "__main__":
    main()
