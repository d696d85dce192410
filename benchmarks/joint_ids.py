"""Decode's route sync reading its ids: a read per array against one joined read.

    python benchmarks/joint_ids.py [--calls 300] [--rounds 7] [--depth 2]

One token's top-10 ids of `depth + 1` routers (512 experts, hidden 128, as lookahead's at
depth 2: the layer's ids and each predicted layer's), evaluated, then brought to the host a
`tolist` per array (`deferred.token_ids`) or joined on the device and read once
(`deferred.joint_ids` / `split_ids`, which the runtime uses on CUDA alone). Prints the calling
thread's CPU time outside the eval (the join's graph building counted), in microseconds a
layer: the median over `rounds` of each round's median over `calls`, the two ways alternating.
On a GPU a read of an evaluated array waits for its transfer, which thread time may not count:
`--wall` times the wall clock instead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from strata_mlx.runtime import deferred
from strata_mlx.runtime.deferred import joint_ids, split_ids, token_ids

HIDDEN, EXPERTS, K = 128, 512, 10


def route(x: mx.array, w: mx.array) -> mx.array:
    probs = mx.softmax(x @ w.T, axis=-1, precise=True)
    return mx.stop_gradient(mx.argpartition(probs, kth=-K, axis=-1)[..., -K:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--wall", action="store_true", help="wall time instead of thread time")
    a = ap.parse_args()
    clock = time.perf_counter_ns if a.wall else time.thread_time_ns
    deferred.JOIN_IDS = True  # the join measured wherever this runs (its default: CUDA only)
    ws = [mx.random.normal((EXPERTS, HIDDEN)) for _ in range(a.depth + 1)]
    mx.eval(ws)

    def separate(x: mx.array) -> int:
        inds, *preds = [route(x, w) for w in ws]
        mx.eval(inds, x, *preds)
        t = clock()
        token_ids(inds), [token_ids(p) for p in preds]
        return clock() - t

    def joined(x: mx.array) -> int:
        inds, *preds = [route(x, w) for w in ws]
        t = clock()
        joint = joint_ids(inds, preds)
        built = clock() - t
        mx.eval(joint, x)
        t = clock()
        split_ids(joint, inds, preds)
        return built + clock() - t

    out: dict[str, list[float]] = {"a read per array": [], "joined, one read": []}
    for _ in range(a.rounds):
        for name, fn in zip(out, (separate, joined)):
            ns = [fn(mx.random.normal((1, 1, HIDDEN))) for _ in range(a.calls)]
            out[name].append(statistics.median(ns) / 1e3)
    print(f"{mx.default_device()}, depth {a.depth}, us a layer ({'wall' if a.wall else 'cpu'})")
    for name, us in out.items():
        print(
            f"{name:18} {statistics.median(us):7.1f}  rounds: {', '.join(f'{u:.1f}' for u in us)}"
        )


if __name__ == "__main__":
    main()
