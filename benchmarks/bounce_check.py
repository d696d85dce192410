"""Lookahead prefill with every record verified, reads landing directly or through the bounce
buffer (STRATA_MLX_BOUNCE=0/1): how many records fail their checksum on this machine.

    python benchmarks/bounce_check.py STORE [--arena-gb 1] [-p 2048] [--chunk 512]
"""

from __future__ import annotations

import argparse
import os

import mlx.core as mx
import numpy as np

import strata_mlx
from strata_mlx.format.store import load_manifest
from strata_mlx.runtime.experts import ExpertReadError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--arena-gb", type=float, default=1.0)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--passes", type=int, default=3)
    a = ap.parse_args()
    m = load_manifest(a.store)
    ids = np.random.default_rng(0).integers(0, m.config["vocab_size"], a.prompt_tokens)
    for bounce in ("0", "1"):
        os.environ["STRATA_MLX_BOUNCE"] = bounce
        failed = 0
        for _ in range(a.passes):
            model, _ = strata_mlx.load(a.store, arena_gb=a.arena_gb, read_ahead="lookahead")
            cache = model.make_cache()
            try:
                for s in range(0, len(ids), a.chunk):
                    mx.eval(model(mx.array([ids[s : s + a.chunk].tolist()]), cache=cache))
            except ExpertReadError as e:
                failed += 1
                print(f"bounce={bounce}: {e}", flush=True)
            st = model.expert_cache.stats
            model.expert_cache.close()
        print(
            f"bounce={bounce}: {failed} of {a.passes} passes hit a checksum error "
            f"(last pass read {st.experts_read} records)",
            flush=True,
        )


if __name__ == "__main__":
    main()
