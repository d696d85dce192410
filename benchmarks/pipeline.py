"""What the layer pipeline over mx.distributed costs, on one machine.

  mlx.launch -n 2 -- python benchmarks/pipeline.py hop
      the hop: a hidden state sent rank 0 -> 1 -> 0 over the ring backend, per shape
      (one decode token, prefill chunks), as strata_mlx.runtime.distributed sends it (header + array).

  mlx.launch -n N -- python benchmarks/pipeline.py run STORE -p 64 -g 16 --prefill-step-size 64
      prefill tok/s and decode ms/token of `generate`, with N ranks (N = 1: one process, the
      per-layer sync decode the pipeline runs, and the default decode mode beside it).

  python benchmarks/pipeline.py store PATH
      the store these figures were taken on: a random Qwen3-MoE (hidden 512, 8 layers, 16
      experts, top-2, fp32 experts; transformers' own class), converted by strata-mlx.

Rank 0 prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx


def hop(args) -> None:
    from strata_mlx.runtime.distributed import FORWARD, Pipeline

    pipe = Pipeline()
    assert pipe.size == 2, "run under mlx.launch -n 2"
    for tokens in args.tokens:
        shape = (1, tokens, args.hidden)
        x = mx.zeros(shape, mx.bfloat16 if args.dtype == "bfloat16" else mx.float32)
        mx.eval(x)
        times = []
        for i in range(args.iters + 5):
            t = time.perf_counter()
            if pipe.rank == 0:
                pipe.send_header(FORWARD, shape[:2], x.dtype)
                pipe.send(x, 1)
                pipe.recv(shape, x.dtype, 1)
            else:
                pipe.recv((4,), mx.int32, 0)
                y = pipe.recv(shape, x.dtype, 0)
                pipe.send(y, 0)
            if i >= 5:
                times.append(time.perf_counter() - t)
        if pipe.rank == 0:
            rt = statistics.median(times)
            row = {
                "figure": "round trip",
                "tokens": tokens,
                "hidden": args.hidden,
                "dtype": args.dtype,
                "bytes": x.nbytes,
                "median_us": round(rt * 1e6, 1),
                "p10_us": round(sorted(times)[len(times) // 10] * 1e6, 1),
                "per_hop_us": round(rt * 1e6 / 2, 1),
            }
            print(json.dumps(row), flush=True)


def run(args) -> None:
    import strata_mlx
    from strata_mlx.generation.generate import stream_generate
    from strata_mlx.runtime.distributed import Pipeline, serve_stage

    pipe = Pipeline()
    ids = list(range(1, args.prompt_tokens + 1))
    modes = ["sync"] if pipe.size > 1 else ["sync", "pipelined"]
    for mode in modes:
        model, _ = strata_mlx.load(
            args.store,
            arena_gb=args.arena_gb,
            prefill_step_size=args.prefill_step_size,
            decode=mode,
            pipeline=pipe,
        )
        if pipe.size > 1 and pipe.rank != 0:
            serve_stage(model)
            continue
        if pipe.size > 1:
            model.wait_ready()
        prefill, decode = [], []
        for _ in range(args.rounds):
            last = None
            for r in stream_generate(
                model, None, ids, args.generation_tokens, prefill_step_size=args.prefill_step_size
            ):
                last = r
            prefill.append(last.prompt_tps)
            decode.append(1e3 / last.generation_tps if last.generation_tps else 0.0)
        row = {
            "figure": "generate",
            "ranks": pipe.size,
            "decode_mode": mode,
            "split": [[r.start, r.stop] for r in pipe.split] if pipe.size > 1 else None,
            "prefill_tok_s": [round(v, 1) for v in prefill],
            "decode_ms_per_token": [round(v, 1) for v in decode],
            "prefill_median": round(statistics.median(prefill), 1),
            "decode_median": round(statistics.median(decode), 1),
        }
        print(json.dumps(row), flush=True)
        if pipe.size > 1:
            model.close()
        model.expert_cache.close()


def store(args) -> None:
    from pathlib import Path

    import torch
    import transformers as T

    from strata_mlx.convert.hf import convert_hf

    torch.manual_seed(0)
    cfg = T.Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    )
    hf = Path(args.path + ".hf")
    T.Qwen3MoeForCausalLM(cfg).to(torch.float32).eval().save_pretrained(hf)
    convert_hf(hf, Path(args.path), progress=False, calibration_tokens=32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    h = sub.add_parser("hop")
    h.add_argument("--hidden", type=int, default=2048)
    h.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    h.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512])
    h.add_argument("--iters", type=int, default=200)
    r = sub.add_parser("run")
    r.add_argument("store")
    r.add_argument("-p", "--prompt-tokens", type=int, default=64)
    r.add_argument("-g", "--generation-tokens", type=int, default=16)
    r.add_argument("--prefill-step-size", type=int, default=64)
    r.add_argument("--arena-gb", type=float, default=None)
    r.add_argument("--rounds", type=int, default=3)
    sub.add_parser("store").add_argument("path")
    args = p.parse_args()
    {"hop": hop, "run": run, "store": store}[args.what](args)


if __name__ == "__main__":
    main()
