"""Where decode's host time goes: cProfile over the decode steps of one generation.

    python benchmarks/profile_decode.py STORE [--arena-gb 6.5] [-p 1024] [-g 48]
        [--policy lookahead] [--top 40]

Prefills a random prompt of `p` tokens (not profiled), then profiles `g` greedy decode steps
and prints the functions by their own time and by cumulative time, with the cache's
per-token wait / sync / host split beside them.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import mlx.core as mx
import numpy as np

import strata_mlx
from strata_mlx.apps.bench import policy_options
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import generate_step
from strata_mlx.stream.stats import ExpertStats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--arena-gb", type=float, default=None)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=1024)
    ap.add_argument("-g", "--gen-tokens", type=int, default=48)
    ap.add_argument("--policy", default="lookahead")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    m = load_manifest(a.store)
    model, _ = strata_mlx.load(a.store, arena_gb=a.arena_gb, **policy_options(a.policy))
    ids = np.random.default_rng(0).integers(0, m.config["vocab_size"], a.prompt_tokens).tolist()
    steps = generate_step(model, mx.array(ids), max_tokens=a.gen_tokens + 1, prefill_step_size=1024)
    next(steps)  # the prompt and its first token: not profiled
    ec = model.expert_cache
    ec.stats = ExpertStats()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    n = sum(1 for _ in steps)
    prof.disable()
    wall = time.perf_counter() - t
    st = ec.stats
    print(
        f"{a.policy}: {n} tokens, {wall / n * 1e3:.1f} ms/token; wait "
        f"{st.exposed_wait_s / n * 1e3:.1f}, sync {st.route_sync_s / n * 1e3:.1f}, host "
        f"{st.host_s / n * 1e3:.1f} ms/token; miss {st.miss_pct:.1f}%"
    )
    for key in ("tottime", "cumtime"):
        pstats.Stats(prof).sort_stats(key).print_stats(a.top)
    ec.close()


if __name__ == "__main__":
    main()
