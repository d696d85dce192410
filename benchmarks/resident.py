"""Every expert resident, beside mlx-lm's own model of the same store, in interleaved rounds:
prefill tok/s and decode ms/token, each variant against mlx-lm in the same round.

    python benchmarks/resident.py STORE [-p 2048] [-g 64] [--steps 1024,2048] [--rounds 3]

Both models are held at once (two copies of the experts), so each round sees the machine as
the other does. Prints per-round ratios (prefill: strata / mlx-lm tok/s;
decode: strata / mlx-lm ms/token), their medians, and the first token's max |logprob
difference| against mlx-lm (the same prompt, the same chunks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import strata_mlx
from strata_mlx.apps.baseline import load_mlx_lm, run_mlx_lm, run_strata
from strata_mlx.format.store import load_manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=2048)
    ap.add_argument("-g", "--gen-tokens", type=int, default=64)
    ap.add_argument("--steps", default="1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    m = load_manifest(a.store)
    ids = np.random.default_rng(0).integers(0, m.config["vocab_size"], a.prompt_tokens).tolist()
    steps = [int(s) for s in a.steps.split(",")]
    t = time.perf_counter()
    lm = load_mlx_lm(a.store)
    print(f"mlx-lm model built in {time.perf_counter() - t:.1f} s", flush=True)
    ours, _ = strata_mlx.load(a.store, arena_gb=m.expert_bytes / 1024**3 * 1.01 + 0.01)
    t = time.perf_counter()
    ours.expert_cache.warm()
    print(f"strata-mlx: every expert resident in {time.perf_counter() - t:.1f} s", flush=True)
    for step in steps:  # warm-up: kernels compile (MLX CUDA JITs them) in every shape timed
        run_mlx_lm(lm, ids[: step + 1], 2, step)
        run_strata(ours, ids[: step + 1], 2, step)
    rows = []
    for r in range(a.rounds):
        for step in steps:
            ref = run_mlx_lm(lm, ids, a.gen_tokens, step)
            row = {"round": r, "step": step, "mlx_lm_prefill_tps": ref.prefill_tps,
                   "mlx_lm_decode_ms": ref.decode_ms_per_token}  # fmt: skip
            res = run_strata(ours, ids, a.gen_tokens, step)
            row["prefill_tps"] = res.prefill_tps
            row["decode_ms"] = res.decode_ms_per_token
            row["prefill_ratio"] = res.prefill_tps / ref.prefill_tps
            row["decode_ratio"] = res.decode_ms_per_token / ref.decode_ms_per_token
            row["max_logprob_diff"] = float(np.max(np.abs(res.logprobs - ref.logprobs)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    for step in steps:
        mine = [row for row in rows if row["step"] == step]
        pre = statistics.median(row["prefill_ratio"] for row in mine)
        dec = statistics.median(row["decode_ratio"] for row in mine)
        print(
            f"chunk {step}: prefill x{pre:.2f} mlx-lm's tok/s, decode "
            f"x{dec:.2f} mlx-lm's ms/token (medians of {len(mine)} rounds)"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"store": a.store, "rows": rows}, f, indent=1)
    ours.expert_cache.close()


if __name__ == "__main__":
    main()
