"""Does batching decodes share reads? `strata-mlx serve` under 1, 2, 4, 8 concurrent greedy
requests, through the real server and the official `openai` client.

    python benchmarks/serve_concurrency.py STORE --arena-gb G [--levels 1,2,4,8]
        [--decode-concurrency 8,1[,8:reference,...]] [--max-tokens 32] [--prompt-tokens 16]
        [--rounds 1]

One server per --decode-concurrency is started (subprocesses on free loopback ports, prompt
caches off), all of them before the first round; each round then runs every server in turn,
so that a busy spell of a shared machine falls on all of them alike. In a round each level
sends that many requests at once, each with its own random prompt of token ids (the same
prompts to every server). Figures per level: aggregate tok/s (completion tokens of the level
over its wall time), mean and worst request latency, and expert records read per generated
token (the server's /v1/stats: experts_read over completion tokens, the prefill's reads
included). Prints a markdown table of the medians over --rounds, tok/s with its spread.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import numpy as np
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    store: str, arena_gb: float, concurrency: int, extra: list[str], kernels: str | None = None
):
    port = free_port()
    cmd = [sys.executable, "-m", "strata_mlx", "serve", "--model", store, "--port", str(port)]
    cmd += ["--arena-gb", str(arena_gb), "--decode-concurrency", str(concurrency)]
    cmd += [
        "--prompt-cache-size",
        "0",
        "--model-name",
        "bench",
        "--max-queue",
        "64",
        "--log-level",
        "warning",
        *extra,
    ]
    env = os.environ.copy()
    if kernels:
        env["STRATA_MLX_KERNELS"] = kernels
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): {' '.join(cmd)}")
        try:
            if httpx.get(base + "/v1/models", timeout=2, trust_env=False).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not start within 300 s")
        time.sleep(0.5)


def served(base: str) -> dict:
    s = httpx.get(base + "/v1/stats", timeout=30, trust_env=False).json()
    return {"tokens": s["server"]["completion_tokens"], "read": s["expert_cache"]["experts_read"]}


def level(client, base: str, n: int, prompts: list[list[int]], max_tokens: int) -> dict:
    """`n` requests at once; the level's figures."""

    def one(ids):
        t = time.perf_counter()
        r = client.completions.create(
            model="bench", prompt=ids, max_tokens=max_tokens, temperature=0
        )
        return time.perf_counter() - t, r.usage.completion_tokens

    before = served(base)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        done = list(pool.map(one, prompts[:n]))
    wall = time.perf_counter() - t0
    after = served(base)
    tokens = after["tokens"] - before["tokens"]
    lat = [d for d, _ in done]
    return {
        "requests": n,
        "tok_s": tokens / wall,
        "latency_mean_s": float(np.mean(lat)),
        "latency_max_s": float(np.max(lat)),
        "read_per_token": (after["read"] - before["read"]) / max(tokens, 1),
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--arena-gb", type=float, required=True)
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument(
        "--decode-concurrency",
        default="8,1",
        help="servers to compare; N:KERNELS runs one with STRATA_MLX_KERNELS=KERNELS",
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1024, help="prompt ids are drawn below this")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-arg", action="append", default=[], help="passed to serve")
    args = ap.parse_args()
    levels = [int(v) for v in args.levels.split(",")]
    rows = []
    servers = []
    try:
        for spec in args.decode_concurrency.split(","):
            n, _, kernels = spec.partition(":")
            proc, base = start_server(args.store, args.arena_gb, int(n), args.server_arg, kernels)
            conc = spec
            http = httpx.Client(trust_env=False, timeout=3600)
            client = openai.OpenAI(
                base_url=base + "/v1", api_key="-", max_retries=0, http_client=http
            )
            servers.append((conc, proc, base, http, client))
        rng = np.random.default_rng(args.seed)
        warm = rng.integers(0, args.vocab, (1, args.prompt_tokens)).tolist()
        for _, _, base, _, client in servers:
            level(client, base, 1, warm, 4)  # first-request costs (kernel self-check, imports)
        for _ in range(args.rounds):
            prompts = {
                n: rng.integers(0, args.vocab, (n, args.prompt_tokens)).tolist() for n in levels
            }
            for conc, _, base, _, client in servers:  # every server gets the same prompts
                for n in levels:
                    r = level(client, base, n, prompts[n], args.max_tokens)
                    r["decode_concurrency"] = conc
                    rows.append(r)
                    print(r, flush=True)
    finally:
        for _, proc, _, http, _ in servers:
            http.close()
            proc.terminate()
            proc.wait(timeout=60)
    print()
    print(
        "| --decode-concurrency | requests | tok/s (all), median (min-max) | "
        "latency mean / max (s) | records read / token |"
    )
    print("|---|---|---|---|---|")
    order = args.decode_concurrency.split(",")
    keys = sorted(
        {(r["decode_concurrency"], r["requests"]) for r in rows},
        key=lambda k: (order.index(k[0]), k[1]),
    )
    for conc, n in keys:  # the median over rounds
        rs = [r for r in rows if (r["decode_concurrency"], r["requests"]) == (conc, n)]
        med = {k: float(np.median([r[k] for r in rs])) for k in rs[0] if k != "decode_concurrency"}
        lo, hi = min(r["tok_s"] for r in rs), max(r["tok_s"] for r in rs)
        print(
            f"| {conc} | {n} | {med['tok_s']:.1f} ({lo:.0f}-{hi:.0f}) | "
            f"{med['latency_mean_s']:.2f} / "
            f"{med['latency_max_s']:.2f} | {med['read_per_token']:.2f} |"
        )


if __name__ == "__main__":
    main()
