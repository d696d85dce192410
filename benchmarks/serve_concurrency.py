"""Does batching decodes share reads? `strata-mlx serve` under 1, 2, 4, 8 concurrent greedy
requests, through the real server and the official `openai` client.

    python benchmarks/serve_concurrency.py STORE --arena-gb G [--levels 1,2,4,8]
        [--decode-concurrency 8,1] [--max-tokens 32] [--prompt-tokens 16] [--rounds 1]

For each --decode-concurrency the server is started once (a subprocess on a free loopback
port, prompt caches off), then each level sends that many requests at once, each with its own
random prompt of token ids. Figures per level: aggregate tok/s (completion tokens of the level
over its wall time), mean and worst request latency, and expert records read per generated
token (the server's /v1/stats: experts_read over completion tokens, the prefill's reads
included). Prints a markdown table of the medians over --rounds.
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


def start_server(store: str, arena_gb: float, concurrency: int, extra: list[str]):
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
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=os.environ.copy())
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
    ap.add_argument("--decode-concurrency", default="8,1", help="servers to compare")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1024, help="prompt ids are drawn below this")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-arg", action="append", default=[], help="passed to serve")
    args = ap.parse_args()
    levels = [int(v) for v in args.levels.split(",")]
    rows = []
    for conc in (int(v) for v in args.decode_concurrency.split(",")):
        proc, base = start_server(args.store, args.arena_gb, conc, args.server_arg)
        http = httpx.Client(trust_env=False, timeout=3600)
        client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, http_client=http)
        try:
            rng = np.random.default_rng(args.seed)  # every server gets the same prompts
            warm = rng.integers(0, args.vocab, (1, args.prompt_tokens)).tolist()
            level(client, base, 1, warm, 4)  # first-request costs (kernel self-check, imports)
            for _ in range(args.rounds):
                for n in levels:
                    prompts = rng.integers(0, args.vocab, (n, args.prompt_tokens)).tolist()
                    r = level(client, base, n, prompts, args.max_tokens)
                    r["decode_concurrency"] = conc
                    rows.append(r)
                    print(r, flush=True)
        finally:
            http.close()
            proc.terminate()
            proc.wait(timeout=60)
    print()
    print(
        "| --decode-concurrency | requests | tok/s (all) | latency mean / max (s) | "
        "records read / token |"
    )
    print("|---|---|---|---|---|")
    keys = sorted(
        {(r["decode_concurrency"], r["requests"]) for r in rows}, key=lambda k: (-k[0], k[1])
    )
    for conc, n in keys:  # the median over rounds
        rs = [r for r in rows if (r["decode_concurrency"], r["requests"]) == (conc, n)]
        med = {k: float(np.median([r[k] for r in rs])) for k in rs[0]}
        print(
            f"| {conc} | {n} | {med['tok_s']:.1f} | {med['latency_mean_s']:.2f} / "
            f"{med['latency_max_s']:.2f} | {med['read_per_token']:.2f} |"
        )


if __name__ == "__main__":
    main()
