"""The host's time to build one resident decode token, strata-mlx's "token" mode beside mlx-lm's
model on the same store, with the experts' own work left out of both.

    python benchmarks/token_build.py STORE [--rounds 5] [--reps 80] [--prompt 16]

Both models hold every expert (strata-mlx's arena warmed). Each expert computation is replaced by
one op (zeros of its output's shape): mlx-lm's SwitchGLU and strata-mlx's kernels' `pairs`, so
what is timed is everything else a token's graph costs the host: the layers' own ops and, for
strata-mlx, the pipelined decoder and the expert cache's handshake (the residency row's gather,
the deferred records). Per round each model prefills the same prompt, then builds `reps` decode
tokens of the prompt's last id one at a time, each timed with the thread's CPU time
(`time.thread_time`, building only: strata-mlx's `mx.async_eval` is held back for the clock,
then the token is evaluated and verified as decode would) and evaluated before the next. Rounds
alternate the two; medians of the tokens, per round, and their ratio. Python's collector is off
while timing. On a GPU the host's share of a resident token is this plus MLX's evaluation
(kernel launches), which `decode.py --interleave` includes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import mlx.core as mx
import numpy as np

import strata_mlx
from strata_mlx.apps.baseline import load_mlx_lm
from strata_mlx.format.store import StoreError, load_manifest
from strata_mlx.generation.generate import make_prompt_cache


def stub(x: mx.array, k: int) -> mx.array:
    """One op standing for the experts of x [..., D] routed to k of them -> [..., k, D]."""
    return mx.zeros((*x.shape[:-1], k, x.shape[-1]), x.dtype)


def mlx_lm_round(lm, ids: mx.array, reps: int) -> list[float]:
    from mlx_lm.models.cache import make_prompt_cache as lm_cache

    cache = lm_cache(lm)
    mx.eval(lm(ids[None], cache=cache))
    tok, times = ids[-1:][None], []
    for _ in range(reps):
        t = time.thread_time()
        out = lm(tok, cache=cache)
        times.append(time.thread_time() - t)
        mx.eval(out)
    return times


def strata_round(model, decoder, ids: mx.array, reps: int) -> list[float]:
    cache = make_prompt_cache(model)
    mx.eval(model(ids[None], cache=cache))
    tok, times, submit = ids[-1:][None], [], mx.async_eval
    with decoder.thresholds(1.0, 1.0), model.expert_cache.phase(decoding=True):
        for _ in range(reps):
            mx.async_eval = lambda *a: None
            try:
                t = time.thread_time()
                step = decoder.start(tok, cache)
                times.append(time.thread_time() - t)
            finally:
                mx.async_eval = submit
            mx.eval(step.logits)
            decoder.finish(step)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=80, help="tokens built a round")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens prefilled a round")
    a = ap.parse_args()

    try:
        m = load_manifest(a.store)
    except StoreError as e:
        raise SystemExit(f"error: {e}") from None
    k = int(m.config["num_experts_per_tok"])
    ids = mx.array(np.random.default_rng(0).integers(0, m.config["vocab_size"], a.prompt))
    import mlx_lm.models.switch_layers as switch_layers

    print("loading mlx-lm's model and strata-mlx's (every expert resident)", flush=True)
    lm = load_mlx_lm(a.store)
    switch_layers.SwitchGLU.__call__ = lambda self, x, indices: stub(x, indices.shape[-1])
    model, _ = strata_mlx.load(a.store, arena_gb=m.expert_bytes / 1024**3 * 1.01 + 0.01)
    model.expert_cache.warm()
    compute = model.expert_cache.compute
    for layer in compute.pairs:
        compute.pairs[layer] = lambda x, arena, pair_slot: stub(x, k)
    decoder = model.decoding()
    gc.collect()
    gc.disable()
    ratios = []
    for r in range(a.rounds):
        runs = [("mlx-lm", lambda: mlx_lm_round(lm, ids, a.reps))]
        runs.append(("strata", lambda: strata_round(model, decoder, ids, a.reps)))
        med = {}
        for name, run in runs if r % 2 == 0 else runs[::-1]:
            med[name] = statistics.median(run()) * 1e3
        ratios.append(med["strata"] / med["mlx-lm"])
        print(
            f"round {r}: ms a token, mlx-lm {med['mlx-lm']:.2f}, strata-mlx token mode "
            f"{med['strata']:.2f} (x{ratios[-1]:.2f})",
            flush=True,
        )
    gc.enable()
    print(f"strata-mlx / mlx-lm, median of the rounds' ratios: x{statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
