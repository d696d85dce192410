"""Python time inside an eviction policy, prefill and decode apart, replaying a routing trace.

    python benchmarks/policy_cost.py TRACE --slots 7099 --policy lru,nextuse,nextuse-duel
        [--rounds 3] [--read-ahead none|lookahead|scored]

The trace is replayed as `strata-mlx cache-sim` replays it (strata_mlx.apps.cache_sim: the
arena's own policy classes, told the phase when decode starts), with every call into the
policy (touch, remove, victim, current, phase, predicted) timed with perf_counter. Prints,
per policy, the best of `rounds` replays: microseconds of policy time a miss in the prompt's
calls and in decode (each phase's policy time over its misses: hits' touches included), and
milliseconds a decode token. The replay's own work is not counted.
"""

from __future__ import annotations

import argparse
import time

from strata_mlx.apps import cache_sim
from strata_mlx.stream import policies
from strata_mlx.stream import trace as traces


class Timed:
    """`inner` with each call timed into the running phase's total."""

    def __init__(self, inner):
        self.inner = inner
        self.spent = {False: 0.0, True: 0.0}  # decoding -> seconds
        self.decoding = False
        for name in ("phase", "predicted", "distance", "victims"):
            if hasattr(inner, name):
                setattr(self, name, self._timed(getattr(inner, name), name == "phase"))

    def _timed(self, fn, is_phase: bool = False):
        def call(*args):
            if is_phase:
                self.decoding = args[0]
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.spent[self.decoding] += time.perf_counter() - t

        return call

    def touch(self, key):
        t = time.perf_counter()
        self.inner.touch(key)
        self.spent[self.decoding] += time.perf_counter() - t

    def remove(self, key):
        t = time.perf_counter()
        self.inner.remove(key)
        self.spent[self.decoding] += time.perf_counter() - t

    def victim(self, evictable):
        t = time.perf_counter()
        try:
            return self.inner.victim(evictable)
        finally:
            self.spent[self.decoding] += time.perf_counter() - t

    @property
    def current(self):
        return self.inner.current

    @current.setter
    def current(self, layer):
        t = time.perf_counter()
        self.inner.current = layer
        self.spent[self.decoding] += time.perf_counter() - t


def measure(trace: traces.Trace, slots: int, spec: str, read_ahead: str = "none") -> tuple:
    """(replay, prefill seconds, decode seconds) of one timed replay (`read_ahead`:
    cache_sim.replay's, decode's lookahead modelled from the trace's predictions)."""
    made = []

    def factory(layers=None, profile=None):
        made.append(Timed(policies.build(spec, profile, layers)))
        return made[-1]

    factory.name = spec
    calls = {"n": 0}
    decoding = trace.decoding()  # (every generation's decode steps)
    inner_set = Timed.current.fset

    def counting(self, layer):  # the phase by call, for policies without a phase hook
        calls["n"] += 1
        if not hasattr(self.inner, "phase"):
            call = (calls["n"] - 1) // len(trace.layers)
            self.decoding = call < len(decoding) and bool(decoding[call])
        inner_set(self, layer)

    Timed.current = Timed.current.setter(counting)
    try:
        r = cache_sim.replay(trace, slots, factory, read_ahead)
    finally:
        Timed.current = Timed.current.setter(inner_set)
    return r, made[0].spent[False], made[0].spent[True]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--policy", default="lru,nextuse,nextuse-duel")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--read-ahead", default="none", choices=cache_sim.READ_AHEAD)
    a = ap.parse_args()
    t = traces.read(a.trace)
    print(f"{a.trace}: {a.slots} slots, best of {a.rounds}; policy time")
    for spec in a.policy.split(","):
        runs = [measure(t, a.slots, spec, a.read_ahead) for _ in range(a.rounds)]
        r, pre, dec = min(runs, key=lambda x: x[1] + x[2])
        print(
            f"{spec:>18}: prefill {1e6 * pre / max(r.prefill_misses, 1):6.1f} us a miss "
            f"({r.prefill_misses} misses, {pre:.2f} s) | decode "
            f"{1e6 * dec / max(r.decode_misses, 1):6.1f} us a miss, "
            f"{1e3 * dec / max(t.decode_tokens, 1):6.2f} ms a token "
            f"({r.decode_misses / max(t.decode_tokens, 1):.0f} misses a token) | "
            f"decode miss {r.miss_pct:.1f} %",
            flush=True,
        )


if __name__ == "__main__":
    main()
