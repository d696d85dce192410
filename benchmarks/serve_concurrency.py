"""Does batching decodes share reads? `strata-mlx serve` under 1, 2, 4, 8 concurrent greedy
requests, through the real server and the official `openai` client.

    python benchmarks/serve_concurrency.py STORE --arena-gb G [--levels 1,2,4,8]
        [--decode-concurrency 8,1[,8:reference,...]] [--max-tokens 32] [--prompt-tokens 16]
        [--rounds 1] [--progress-s 5] [--deadline-s S]

One server per --decode-concurrency is started (subprocesses on free loopback ports, prompt
caches off), all of them before the first round; each round then runs every server in turn,
so that a busy spell of a shared machine falls on all of them alike. In a round each level
sends that many requests at once, each with its own random prompt of token ids (the same
prompts to every server). Figures per level: aggregate tok/s (completion tokens of the level
over its wall time), mean and worst request latency, and expert records read per generated
token (the server's /v1/stats: experts_read over completion tokens, the prefill's reads
included). Prints a markdown table of the medians over --rounds, tok/s with its spread.

While servers start and levels run, a line every --progress-s seconds says what is under way
(the tokens a level has generated so far, from /v1/stats). Past --deadline-s seconds no new
level starts; the table holds the levels that ran. The servers' KV reserve is this
benchmark's own requests' (--max-prompt-tokens, --max-tokens-limit), so that several servers
fit beside each other on one machine.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
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
    args, concurrency: int, kernels: str | None = None
) -> tuple[subprocess.Popen, str]:
    """A `serve` process on a free loopback port (not waited for: wait_serving)."""
    port = free_port()
    cmd = [sys.executable, "-m", "strata_mlx", "serve", "--model", args.store]
    cmd += ["--port", str(port), "--decode-concurrency", str(concurrency)]
    cmd += ["--arena-gb", str(args.arena_gb), "--prompt-cache-size", "0"]
    cmd += ["--model-name", "bench", "--max-queue", "64", "--log-level", "warning"]
    cmd += ["--max-prompt-tokens", str(args.prompt_tokens)]
    cmd += ["--max-tokens-limit", str(max(args.max_tokens, 4)), *args.server_arg]  # warm-up: 4
    env = os.environ.copy()
    if kernels:
        env["STRATA_MLX_KERNELS"] = kernels
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
    return proc, f"http://127.0.0.1:{port}"


def wait_serving(proc: subprocess.Popen, base: str, timeout: float, every: float) -> None:
    """Until the server at `base` answers, a progress line every `every` seconds."""
    t0 = last = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): {' '.join(proc.args)}")
        try:
            if httpx.get(base + "/v1/models", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        now = time.monotonic()
        if now - t0 > timeout:
            proc.kill()
            raise SystemExit(f"the server did not start within {timeout:.0f} s")
        if now - last >= every:
            print(f"  ... starting {base}: {now - t0:.0f} s", flush=True)
            last = now
        time.sleep(0.5)


def served(base: str) -> dict:
    s = httpx.get(base + "/v1/stats", timeout=30, trust_env=False).json()
    return {"tokens": s["server"]["completion_tokens"], "read": s["expert_cache"]["experts_read"]}


def level(
    client, base: str, n: int, prompts: list[list[int]], max_tokens: int, every: float = 0
) -> dict:
    """`n` requests at once; the level's figures. `every` > 0: a progress line that often."""

    def one(ids):
        t = time.perf_counter()
        r = client.completions.create(
            model="bench", prompt=ids, max_tokens=max_tokens, temperature=0
        )
        return time.perf_counter() - t, r.usage.completion_tokens

    before = served(base)
    t0 = time.perf_counter()
    stop = threading.Event()

    def progress():
        while not stop.wait(every):
            made = served(base)["tokens"] - before["tokens"]
            print(
                f"  ... {n} request(s): {time.perf_counter() - t0:.0f} s, {made} of "
                f"{n * max_tokens} tokens",
                flush=True,
            )

    ticker = threading.Thread(target=progress, daemon=True)
    if every > 0:
        ticker.start()
    try:
        with ThreadPoolExecutor(n) as pool:
            done = list(pool.map(one, prompts[:n]))
    finally:
        stop.set()
        if every > 0:
            ticker.join()
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
    ap.add_argument("--progress-s", type=float, default=5, help="seconds between progress lines")
    ap.add_argument(
        "--deadline-s", type=float, default=None, help="start no level past this many seconds"
    )
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds a server may load")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.store, "manifest.json")):
        ap.error(f"{args.store}: not a strata-mlx store (no manifest.json)")
    levels = [int(v) for v in args.levels.split(",")]
    t_start = time.monotonic()
    rows = []
    servers = []
    try:
        for spec in args.decode_concurrency.split(","):  # all load at once
            n, _, kernels = spec.partition(":")
            proc, base = start_server(args, int(n), kernels)
            http = httpx.Client(trust_env=False, timeout=3600)
            client = openai.OpenAI(
                base_url=base + "/v1", api_key="-", max_retries=0, http_client=http
            )
            servers.append((spec, proc, base, http, client))
        for _, proc, base, _, _ in servers:
            wait_serving(proc, base, args.start_timeout, args.progress_s)
        print(f"servers up in {time.monotonic() - t_start:.0f} s", flush=True)
        rng = np.random.default_rng(args.seed)
        warm = rng.integers(0, args.vocab, (1, args.prompt_tokens)).tolist()
        for conc, _, base, _, client in servers:
            # first-request costs (kernel self-check, imports)
            print(f"warming up --decode-concurrency {conc}", flush=True)
            level(client, base, 1, warm, 4, args.progress_s)
        for _ in range(args.rounds):
            prompts = {
                n: rng.integers(0, args.vocab, (n, args.prompt_tokens)).tolist() for n in levels
            }
            for conc, _, base, _, client in servers:  # every server gets the same prompts
                for n in levels:
                    late = time.monotonic() - t_start
                    if args.deadline_s is not None and late > args.deadline_s:
                        print(f"past --deadline-s at {late:.0f} s: level {n} of {conc} skipped")
                        continue
                    r = level(client, base, n, prompts[n], args.max_tokens, args.progress_s)
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
