"""Prefill's host time per MoE layer: the handshake's Python for a chunk of many tokens.

    python benchmarks/prefill_host.py STORE [--arena-gb 0.1] [--chunk 1024] [--chunks 3]
        [--policies lookahead,demand] [--rounds 3] [--parts]
    python benchmarks/prefill_host.py --tiny /tmp/strata-tiny48 ...

A replay, as benchmarks/decode_host.py's for decode: per policy and round, the model is loaded
afresh and `chunks` chunks of `chunk` tokens go through every MoE layer's handshake in order,
each layer's input a random [1, chunk, hidden] and its routing the layer's own router on it;
their expert outputs are built but never evaluated, so the device computes only the routers
(the lookahead's included), and the figures are the host's: on a CPU, a real prefill's expert
compute (minutes a chunk for the full routing shape) would drown them. Reads, read-ahead, the
reserve, eviction, the scheduler's loop thread and the kernel call's graph building are real.

Per chunk, in milliseconds, the median over rounds: cpu (the calling thread's CPU time in the
handshakes outside the route sync's mx.eval), host (the cache's `host_s`, wall time), route
sync, exposed wait, the loop thread's time holding the GIL (wall) and its CPU time meanwhile
(thread_time: the figure to compare on a shared machine), and reads a chunk. `--parts` splits
cpu by the scheduler and kernel calls the handshake makes (decode_host.Parts), last round.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
from decode_host import Parts, SyncTime, build_tiny  # noqa: E402 (benchmarks/ on sys.path)

import strata_mlx
from strata_mlx.apps.bench import policy_options
from strata_mlx.format.store import load_manifest
from strata_mlx.stream.stats import ExpertStats


def run(store: str, a, policy: str, parts: Parts | None) -> dict:
    """One round: the first chunk warms the arena and the kernels; the rest are counted."""
    model, _ = strata_mlx.load(store, arena_gb=a.arena_gb, **policy_options(policy))
    ec = model.expert_cache
    hidden = load_manifest(store).config["hidden_size"]
    key = mx.random.key(0)
    per = []
    try:
        for c in range(a.chunks + 1):
            counted = c > 0
            ec.stats = ExpertStats()
            cpu = 0
            t = time.perf_counter()
            with parts if counted and parts else contextlib.nullcontext(), SyncTime() as sync:
                with ec.phase(decoding=False):
                    for layer in ec.layers:
                        key, k = mx.random.split(key)
                        x = mx.random.normal((1, a.chunk, hidden), key=k)
                        inds = ec.routers[layer](x)
                        mx.eval(x, inds)
                        s = time.thread_time_ns()
                        ec.run_layer(layer, x, inds)
                        cpu += time.thread_time_ns() - s
            wall = time.perf_counter() - t
            ec.settle()
            st = ec.stats
            if counted:
                per.append(
                    dict(
                        wall=wall * 1e3,
                        cpu=(cpu - sync.ns) / 1e6,
                        host=st.host_s * 1e3,
                        sync=st.route_sync_s * 1e3,
                        wait=st.exposed_wait_s * 1e3,
                        loop=st.loop_s * 1e3,
                        loopcpu=st.loop_cpu_s * 1e3,
                        read=st.experts_read,
                    )
                )
    finally:
        ec.close()
    return {k: statistics.median(p[k] for p in per) for k in per[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="?")
    ap.add_argument("--tiny", help="build (once) and use the tiny full-shape store here")
    ap.add_argument("--arena-gb", type=float, default=0.1)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--policies", default="lookahead,demand")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", action="store_true")
    a = ap.parse_args()
    if (a.store is None) == (a.tiny is None):
        ap.error("give a STORE or --tiny DIR")
    store = str(build_tiny(Path(a.tiny)) if a.tiny else a.store)
    policies = a.policies.split(",")
    parts = {p: Parts() for p in policies} if a.parts else {}
    results = defaultdict(list)
    for r in range(a.rounds):
        for policy in policies:  # interleaved: drift on a shared machine hits all alike
            part = parts.get(policy) if r == a.rounds - 1 else None
            results[policy].append(run(store, a, policy, part))
            print(
                f"round {r} {policy}: "
                + ", ".join(f"{k} {v:.0f}" for k, v in results[policy][-1].items()),
                flush=True,
            )
    layers = len(load_manifest(store).moe_layers)
    print(
        f"replayed prefill, arena {a.arena_gb} GB, chunks of {a.chunk}, median of {a.rounds}; ms a chunk"
    )
    print(
        f"{'policy':28} {'wall':>7} {'cpu':>6} {'host':>6} {'sync':>6} {'wait':>6} {'loop':>6} {'loopcpu':>7} {'read':>6}"
    )
    for policy, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{policy:28} {med['wall']:7.0f} {med['cpu']:6.0f} {med['host']:6.0f} {med['sync']:6.0f} "
              f"{med['wait']:6.0f} {med['loop']:6.0f} {med['loopcpu']:7.0f} {med['read']:6.0f}")  # fmt: skip
        if policy in parts:
            n = a.chunks * layers
            split = {k: v / 1e3 / n for k, v in sorted(parts[policy].ns.items())}
            print("    us a layer: " + ", ".join(f"{k} {v:.0f}" for k, v in split.items()))


if __name__ == "__main__":
    main()
