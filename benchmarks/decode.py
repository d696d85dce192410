"""Decode side by side in one process: mlx-lm's own model on a store's weights, and strata-mlx's
decode paths (per-layer sync, pipelined at several lags) on the same store and prompt.

    python benchmarks/decode.py STORE -p 2048 -g 128 [--arena-gb G] [--policies demand,lookahead]
        [--modes sync,layers:1,token,token:4,adaptive] [--no-baseline] [--rounds 2]
        [--interleave]

Without --arena-gb every expert is made resident (warm()) and one loaded model per policy
serves every mode (only the decoder changes). With --arena-gb each (policy, mode) loads afresh, prefills
the prompt cold and decodes: the decode after a prefill that left the arena holding what it
holds. Rounds interleave the variants, rotating their order. Figures are ms/token between the
first and the last generated token (the first is the prefill's); logits of every decode step
are compared with mlx-lm's (max |difference| of log-probabilities) and greedy tokens counted.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import mlx.core as mx
import numpy as np

import strata_mlx
from strata_mlx.apps.bench import DECODE_MODES, policy_options
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import generate_step, make_sampler
from strata_mlx.runtime.decode import PipelinedDecoder
from strata_mlx.stream.stats import RoutingTrace


def timed(steps, on_first=None):
    """(ms/token of decode, tokens, [n, vocab] float32 log-probabilities) of a generator."""
    tokens, lps = [], []
    t_first = t_last = 0.0
    for n, (tok, lp) in enumerate(steps):
        tokens.append(int(tok))
        lps.append(np.array(lp.astype(mx.float32)).reshape(-1))
        if n == 0 and on_first is not None:
            on_first()
        t_last = time.perf_counter()
        if n == 0:
            t_first = t_last
    ms = (t_last - t_first) / max(len(tokens) - 1, 1) * 1e3
    return ms, tokens, np.stack(lps)


def save_trace(path: str, trace: RoutingTrace) -> None:
    """Routing ids of every call, per layer: `L{layer}` [calls * T, k] and `L{layer}_T` the
    rows of each call (prefill chunks, then decode tokens), for offline cache studies; with
    lookahead, `P{layer}` / `P{layer}_T` the ids predicted for the layer from the one before."""
    import os

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    arrays = {}
    for layer, calls in trace.ids.items():
        arrays[f"L{layer}"] = np.concatenate(calls).astype(np.int16)
        arrays[f"L{layer}_T"] = np.array([len(c) for c in calls], dtype=np.int32)
    for layer, calls in trace.predicted.items():  # lookahead: ids predicted for the layer
        arrays[f"P{layer}"] = np.concatenate(calls).astype(np.int16)
        arrays[f"P{layer}_T"] = np.array([len(c) for c in calls], dtype=np.int32)
    np.savez_compressed(path, **arrays)


def run_mlx_lm(model, ids, gen, step):
    from mlx_lm.generate import generate_step as lm_step

    return timed(lm_step(mx.array(ids), model, max_tokens=gen, prefill_step_size=step))


def mlx_lm_round(lm, ids, gen, step, r, out, ref):
    """One timed mlx-lm decode into `out`; its tokens and log-probabilities are the reference
    (the first round's)."""
    ms, toks, lps = run_mlx_lm(lm, ids, gen, step)
    out["runs"].append({"variant": "mlx-lm", "round": r, "ms_per_token": ms})
    print(f"mlx-lm round {r}: decode {ms:.2f} ms/token", flush=True)
    return ref or (toks, lps)


def run_strata(model, ids, gen, step, on_first=None):
    return timed(generate_step(model, mx.array(ids), gen, make_sampler(0.0), step), on_first)


def set_mode(model, mode: str) -> None:
    """sync | layers:LAG (each layer checked LAG layers late, never whole tokens) |
    token:CHUNK (whole tokens overlapped with the next one's build, CHUNK layers submitted at
    once, 0 or none the whole token, never the sync fallback) | adaptive (the runtime's
    defaults) | adaptive+token (the same, "token" mode allowed while decode lookahead
    predicts). A "+general" suffix: one
    token's layers call the expert kernels' general entry with an index of the pairs, as
    before they called `pairs` (LayerCompute.by_pair), for a side-by-side timing; "+perlayer":
    "token" mode reads each layer's routing back on its own, as before a token's was read in
    one transfer (PipelinedDecoder.join_routing)."""
    compute = model.expert_cache.compute
    if not hasattr(compute, "kept_pairs"):
        compute.kept_pairs = dict(compute.pairs)
    perlayer, mode = mode.endswith("+perlayer"), mode.removesuffix("+perlayer")
    mode, general = mode.removesuffix("+general"), mode.endswith("+general")
    compute.pairs = {l: None for l in compute.kept_pairs} if general else dict(compute.kept_pairs)
    name, _, n = mode.partition(":")
    if name == "sync":
        model.decoder = model.sync_decoder
    elif name == "layers":
        lag, _, chunk = (n or "1").partition(":")  # layers:LAG[:CHUNK]
        model.decoder = PipelinedDecoder(
            model, int(lag), token_below=0.0, layers_chunk=int(chunk or 1)
        )
    elif name == "token":
        model.decoder = PipelinedDecoder(model, sync_above=1.0, token_below=1.0, chunk=int(n or 0))
    elif name in ("adaptive", "adaptive+token"):
        rt = model.runtime  # (the loaded model's lag and chunk: 4 with the routing board)
        model.decoder = PipelinedDecoder(
            model,
            rt.decode_lag,
            layers_chunk=rt.decode_layers_chunk,
            token_while_predicting=name == "adaptive+token",  # token mode while predicting too
        )
    else:
        raise SystemExit(
            f"unknown mode {mode!r}: sync | layers:LAG[:CHUNK] | token:CHUNK | adaptive"
            " | adaptive+token, each optionally +general, then optionally +perlayer"
        )
    if perlayer and isinstance(model.decoder, PipelinedDecoder):
        model.decoder.join_routing = False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=2048)
    ap.add_argument("-g", "--gen-tokens", type=int, default=128)
    ap.add_argument("--prefill-step-size", type=int, default=1024)
    ap.add_argument("--arena-gb", type=float, default=None)
    ap.add_argument("--policies", default="demand")
    ap.add_argument("--modes", default="sync,layers:1,token,token:4,adaptive")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="keep mlx-lm's model loaded and run one mlx-lm round before each round of the "
        "variants (the machine's drift shows in both; needs memory for both models)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--eviction", default=None, help="the arena's eviction policy (lru, lfu, ...)")
    ap.add_argument("--trace", default=None, help="directory: each variant's routing ids (npz)")
    a = ap.parse_args()

    m = load_manifest(a.store)
    ids = np.random.default_rng(0).integers(0, m.config["vocab_size"], a.prompt_tokens).tolist()
    gen, step = a.gen_tokens, a.prefill_step_size
    out: dict = {"store": a.store, "prompt": a.prompt_tokens, "gen": gen, "runs": []}
    ref = None
    if not a.no_baseline:
        from strata_mlx.apps.baseline import load_mlx_lm

        t = time.perf_counter()
        lm = load_mlx_lm(a.store)
        print(f"mlx-lm model built in {time.perf_counter() - t:.1f} s", flush=True)
        run_mlx_lm(lm, ids[: step + 1], 4, step)  # warm-up: kernels compile
        for r in range(0 if a.interleave else a.rounds):
            ref = mlx_lm_round(lm, ids, gen, step, r, out, ref)
        if not a.interleave:
            del lm
            gc.collect()
            mx.clear_cache()

    policies = a.policies.split(",")
    modes = a.modes.split(",")
    variants = [(p, md) for p in policies for md in modes]
    residents = {}  # all resident: one model per policy, loaded and warmed once
    if a.arena_gb is None:
        gb = m.expert_bytes / 1024**3 * 1.01 + 0.01
        for policy in policies:
            opts = {"read_ahead": "demand", **policy_options(policy)}
            resident, _ = strata_mlx.load(a.store, arena_gb=gb, **opts)
            t = time.perf_counter()
            resident.expert_cache.warm()
            print(
                f"strata-mlx ({policy}): all {m.expert_bytes / 1e9:.1f} GB of experts resident "
                f"in {time.perf_counter() - t:.1f} s",
                flush=True,
            )
            set_mode(resident, "sync")
            run_strata(resident, ids[: step + 1], 4, step)
            set_mode(resident, "token")
            run_strata(resident, ids[: step + 1], 4, step)
            residents[policy] = resident
    for r in range(a.rounds):
        if a.interleave and not a.no_baseline:
            ref = mlx_lm_round(lm, ids, gen, step, r, out, ref)
        k = r % len(variants)
        for policy, mode in variants[k:] + variants[:k]:
            if residents:
                model = residents[policy]
            else:
                extra = {"eviction": a.eviction} if a.eviction else {}
                model, _ = strata_mlx.load(
                    a.store,
                    arena_gb=a.arena_gb,
                    prefill_step_size=step,
                    **extra,
                    **policy_options(policy),
                )
            set_mode(model, mode)
            ec = model.expert_cache
            if a.trace:
                ec.trace = RoutingTrace()
            before = []  # the statistics once the prefill is done: decode's alone
            ms, toks, lps = run_strata(
                model, ids, gen, step, on_first=lambda ec=ec, b=before: b.append(ec.stats.copy())
            )
            s = ec.stats.minus(before[0])
            row = {
                "variant": f"{policy}/{mode}",
                "round": r,
                "ms_per_token": ms,
                "misses": s.misses,
                "miss_pct": s.miss_pct,
                "readahead": s.readahead_submitted,
                "streamed_ahead": s.streamed_ahead,
                "recomputed_layers": s.recomputed_layers,
                # tokens begun in each decoder mode, and while decode lookahead predicted
                "modes": {m: getattr(s, f"{m}_mode_tokens") for m in DECODE_MODES},
                "predicting_tokens": s.predicting_tokens,
                "wait_ms": s.exposed_wait_s * 1e3,
                # per decode token: where the time went (the rest: the dense graph's Python,
                # the kernels' launch, the device work not waited on in a route sync)
                "route_sync_ms_tok": s.route_sync_s * 1e3 / max(gen - 1, 1),
                "host_ms_tok": s.host_s * 1e3 / max(gen - 1, 1),
                "wait_ms_tok": s.exposed_wait_s * 1e3 / max(gen - 1, 1),
                "reads_tok": s.experts_read / max(gen - 1, 1),
                "gb_s_in_decode": s.bytes_read / max(ms * (gen - 1) * 1e6, 1e-9),
            }
            if ref is not None:
                # Greedy runs diverge at the first near-tie; after it the inputs differ, so
                # log-probabilities are compared only over the steps both fed alike.
                same = 0
                while same < min(len(toks), len(ref[0])) and toks[same] == ref[0][same]:
                    same += 1
                n = max(same, 1)
                row["tokens_equal_mlx_lm"] = same
                row["max_abs_logprob_diff"] = float(np.max(np.abs(lps[:n] - ref[1][:n])))
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
            if a.trace:
                save_trace(f"{a.trace}/{policy}-{mode}-r{r}.npz".replace(":", "_"), ec.trace)
            if not residents:
                ec.close()
                del model, ec
                gc.collect()
                mx.clear_cache()
    summarize(out["runs"], paired=a.interleave)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


def summarize(runs: list[dict], paired: bool) -> None:
    """Each variant's median ms/token and its ratio to the baseline's median: mlx-lm's, or
    without it (--no-baseline) the first variant's (e.g. demand, for lookahead against it).
    With mlx-lm `paired` (--interleave: each round's mlx-lm run came right before it), and
    always between variants (a round runs each once, in rotated order), also the median of
    the per-round ratios."""
    by: dict[str, dict[int, float]] = {}
    for row in runs:
        by.setdefault(row["variant"], {})[row["round"]] = row["ms_per_token"]
    name = "mlx-lm" if "mlx-lm" in by else next(iter(by), None)
    base = by.get(name, {})
    paired = paired or name != "mlx-lm"
    for variant, ms in by.items():
        line = f"{variant}: median {np.median(list(ms.values())):.2f} ms/token"
        if base and variant != name:
            line += f", x{np.median(list(ms.values())) / np.median(list(base.values())):.2f} {name}"
            ratios = [ms[r] / base[r] for r in ms if r in base]
            if paired and ratios:
                line += f" (per round x{np.median(ratios):.2f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
