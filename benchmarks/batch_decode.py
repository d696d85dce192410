"""Does batching decodes share reads? The serve engine's batch (generation/batch.py) stepped
in-process, without HTTP, at 1, 2, 4, 8 concurrent greedy requests.

    python benchmarks/batch_decode.py STORE --arena-gb G [--levels 1,2,4,8]
        [--prompt-tokens 64] [--max-tokens 32] [--rounds 2] [--seed 0]

One model is loaded; a warm-up level fills the arena; then each round runs every level in
turn (the order reversed on odd rounds, so that neither end always finds the arena as the
other left it). A level inserts its requests at once, each with its own random prompt of
token ids, and steps the batch until all have answered --max-tokens tokens. Figures per
level: aggregate tok/s (generated tokens over the level's wall time, prefills included), the
decode steps' tok/s (steps where every request decodes), mean request latency, and expert
records read per generated token (prefill reads included). Prints a markdown table of the
medians over the rounds. serve_concurrency.py measures the same through the real server.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def run_level(model, tokenizer, n: int, args, rng) -> dict:
    import mlx.core as mx

    from strata_mlx.generation.batch import BatchGenerator

    vocab = args.vocab or model.args.vocab_size
    gen = BatchGenerator(model, tokenizer, decode_concurrency=n)
    before = model.expert_cache.stats.copy()
    t0 = time.perf_counter()
    seqs = []
    for _ in range(n):
        ids = rng.integers(0, vocab, args.prompt_tokens).tolist()
        seqs.append(gen.insert(ids, max_tokens=args.max_tokens))
    done, tokens, full_tokens, full_s = {}, 0, 0, 0.0
    shown = time.perf_counter()
    while gen.sequences:
        if time.perf_counter() - shown > 2.0:  # progress on a slow machine
            print(f"  x{n}: {tokens}/{n * args.max_tokens} tokens", file=sys.stderr, flush=True)
            shown = time.perf_counter()
        full = all(s.decoding for s in gen.sequences) and len(gen.sequences) == n
        ts = time.perf_counter()
        out = gen.step()
        if full:
            full_s += time.perf_counter() - ts
            full_tokens += len(out)
        tokens += len(out)
        for seq, r in out:
            if r.finish_reason is not None:
                done[id(seq)] = time.perf_counter() - t0
    mx.eval(mx.zeros(1))
    wall = time.perf_counter() - t0
    read = model.expert_cache.stats.minus(before)
    return {
        "tok_s": tokens / wall,
        "decode_tok_s": full_tokens / full_s if full_s else float("nan"),
        "latency_s": float(np.mean(list(done.values()))),
        "records_per_token": read.experts_read / tokens,
        "wait_ms_per_step": 1e3 * read.exposed_wait_s / max(1, gen.steps),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store")
    p.add_argument("--arena-gb", type=float, required=True)
    p.add_argument("--levels", default="1,2,4,8")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vocab", type=int, default=0, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default=None, help="--eviction for the expert cache")
    args = p.parse_args()

    import strata_mlx

    levels = [int(x) for x in args.levels.split(",")]
    extra = {"eviction": args.policy} if args.policy else {}
    t = time.perf_counter()
    model, tokenizer = strata_mlx.load(args.store, arena_gb=args.arena_gb, **extra)
    print(f"loaded in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    rng = np.random.default_rng(args.seed)
    with model:
        run_level(model, tokenizer, max(levels), args, rng)  # warm-up: fill the arena
        results: dict[int, list[dict]] = {n: [] for n in levels}
        for r in range(args.rounds):
            for n in levels if r % 2 == 0 else levels[::-1]:
                res = run_level(model, tokenizer, n, args, rng)
                results[n].append(res)
                print(
                    f"round {r} x{n}: {res['tok_s']:.2f} tok/s, decode {res['decode_tok_s']:.2f},"
                    f" {res['records_per_token']:.1f} records/token,"
                    f" latency {res['latency_s']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    base = np.median([r["tok_s"] for r in results[levels[0]]])
    keys = ("tok_s", "decode_tok_s", "latency_s", "records_per_token", "wait_ms_per_step")
    print("| requests | " + " | ".join(keys) + f" | x{levels[0]} tok/s |")
    print("|---" * (len(keys) + 2) + "|")
    for n in levels:
        med = {k: float(np.median([r[k] for r in results[n]])) for k in keys}
        cells = " | ".join(f"{med[k]:.2f}" for k in keys)
        print(f"| {n} | {cells} | {med['tok_s'] / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
