"""Time to first token of a long conversation resumed from `serve --prompt-cache-dir` after a
restart, against a cold prefill of the same conversation.

    python benchmarks/resume_ttft.py STORE [--arena-gb G] [--prompt-tokens 16384]
        [--turn-tokens 64] [--rounds 2] [--in-process] [--json FILE]

The conversation is --prompt-tokens random token ids (below --vocab); its next turn adds
--turn-tokens more. First a server started with a fresh --prompt-cache-dir answers the first
turn (one token, so that its KV and recurrent state cover exactly the first turn's prompt) and
is stopped with SIGTERM, which writes that state to the directory. Then, round by round, in
alternating order, two freshly started servers answer the next turn, streamed through the
official `openai` client: one started with a copy of that directory (as after a restart), one
without it (a cold prefill). TTFT is the time from sending the request to its first streamed
chunk; before it each server answers a warm-up request of a few other tokens (first-request
costs: kernel builds). One line per variant and round with TTFT and what the server's
/v1/stats say was prefilled, reused from disk and read from the store; then the medians.

--in-process runs the same steps without HTTP (for a machine without serve's packages): the
model is loaded afresh for every variant, the state goes through the server's own
PromptCacheDir, and TTFT is the time to the first token stream_generate yields.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

NAME = "bench"
WARM_TOKENS = 8


@contextlib.contextmanager
def ticking(label: str, every: float):
    """Print `label` and the seconds elapsed every `every` seconds until the block ends."""
    done = threading.Event()
    t0 = time.monotonic()

    def tick():
        while not done.wait(every):
            print(f"  ... {label}: {time.monotonic() - t0:.0f} s", flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def conversation(args) -> tuple[list[int], list[int], list[int]]:
    """(the first turn's prompt, the next turn's prompt, a warm-up prompt): random ids; the
    warm-up shares no first token with the conversation, so no cache of one serves the other."""
    rng = np.random.default_rng(args.seed)
    first = rng.integers(1, args.vocab, args.prompt_tokens).tolist()
    turn = rng.integers(1, args.vocab, args.turn_tokens).tolist()
    warm = [0] + rng.integers(1, args.vocab, WARM_TOKENS - 1).tolist()
    return first, first + turn, warm


def fresh_copy(pristine: Path, into: Path) -> Path:
    """A directory holding the files of `pristine` (hard links where the file system allows):
    the server resumes from it and may rewrite it; `pristine` stays as built."""
    into.mkdir(parents=True)
    for f in pristine.iterdir():
        try:
            os.link(f, into / f.name)
        except OSError:
            shutil.copy2(f, into / f.name)
    return into


# ---- through the server ---------------------------------------------------------------------


class Server:
    """`strata-mlx serve` on a free loopback port, its output in `log`."""

    def __init__(self, args, log: Path, cache_dir: Path | None):
        import httpx2 as httpx  # the HTTP client the openai package is built on

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        longest = args.prompt_tokens + args.turn_tokens + WARM_TOKENS
        cmd = [sys.executable, "-m", "strata_mlx", "serve", "--model", args.store]
        cmd += ["--port", str(port), "--model-name", NAME, "--log-level", "warning"]
        # the guard counts KV caches as long as a request may grow: this benchmark's own
        cmd += ["--max-prompt-tokens", str(longest), "--max-tokens-limit", "16"]
        if args.arena_gb is not None:
            cmd += ["--arena-gb", str(args.arena_gb)]
        if cache_dir is not None:
            cmd += ["--prompt-cache-dir", str(cache_dir)]
        cmd += args.server_arg
        self.out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(trust_env=False, timeout=3600)
        t0 = time.monotonic()
        with ticking("starting the server", args.progress_s):
            while True:
                if self.proc.poll() is not None:
                    self.stop()
                    raise SystemExit(
                        f"the server exited ({self.proc.returncode}):\n{log.read_text()[-3000:]}"
                    )
                try:
                    if self.http.get(self.base + "/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > args.start_timeout:
                    self.stop()
                    raise SystemExit(f"the server did not start in {args.start_timeout:.0f} s")
                time.sleep(0.2)
        import openai

        self.client = openai.OpenAI(
            base_url=self.base + "/v1", api_key="-", max_retries=0, http_client=self.http
        )

    def stats(self) -> dict:
        s = self.http.get(self.base + "/v1/stats").json()
        disk = s["server"]["prompt_cache"]["disk"] or {}
        return {
            "prefilled": s["server"]["prefilled_tokens"],
            "disk_hits": disk.get("hits", 0),
            "reused": s["server"]["prompt_cache"]["reused_tokens"],
            "read": (s.get("expert_cache") or {}).get("experts_read", 0),
        }

    def ttft(self, ids: list[int]) -> float:
        """Seconds to the first streamed chunk of a one-token completion of `ids`."""
        t0 = time.perf_counter()
        first = None
        stream = self.client.completions.create(
            model=NAME, prompt=ids, max_tokens=1, temperature=0, stream=True
        )
        for _ in stream:
            if first is None:
                first = time.perf_counter() - t0
        return first

    def stop(self, timeout: float = 600) -> None:
        """SIGTERM, as a user stops it: the server writes what it keeps to its directory."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


def over_http(args, work: Path) -> list[dict]:
    first, full, warm = conversation(args)
    pristine = work / "pristine"
    print(f"building the conversation's cache: {len(first)} tokens", flush=True)
    server = Server(args, work / "build.log", pristine)
    try:
        with ticking("first turn", args.progress_s):
            t = server.ttft(first)
        print(f"  first turn (cold, the server just started): {t:.2f} s", flush=True)
    finally:
        server.stop()
    files = list(pristine.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"the server wrote no prompt cache file to {pristine}")
    size = sum(f.stat().st_size for f in files)
    print(f"  {len(files)} file(s), {size / 2**20:.1f} MiB, in {pristine}", flush=True)
    rows = []
    for r in range(args.rounds):
        order = ("resumed", "cold") if r % 2 == 0 else ("cold", "resumed")
        for variant in order:
            d = fresh_copy(pristine, work / f"round{r}") if variant == "resumed" else None
            server = Server(args, work / f"{variant}{r}.log", d)
            try:
                server.ttft(warm)
                before = server.stats()
                with ticking(f"{variant}, round {r}", args.progress_s):
                    t = server.ttft(full)
                after = server.stats()
            finally:
                server.stop()
            if d is not None:
                shutil.rmtree(d)
            rows.append(row(variant, r, t, len(full), before, after))
    return rows


def row(variant: str, r: int, ttft: float, prompt: int, before: dict, after: dict) -> dict:
    out = {"variant": variant, "round": r, "ttft_s": ttft, "prompt_tokens": prompt}
    out.update({k: after[k] - before[k] for k in ("prefilled", "disk_hits", "reused", "read")})
    print(
        f"{variant:8s} round {r}: TTFT {ttft:7.2f} s   prefilled {out['prefilled']} of "
        f"{prompt} prompt tokens, {out['reused']} resumed from disk ({out['disk_hits']} "
        f"file), {out['read']} expert records read",
        flush=True,
    )
    return out


# ---- in this process ------------------------------------------------------------------------


def in_process(args, work: Path) -> list[dict]:
    import strata_mlx
    from strata_mlx.apps.prompt_cache_dir import PromptCacheDir
    from strata_mlx.generation.prompt_cache import make_prompt_cache

    first, full, warm = conversation(args)

    def loaded():
        with ticking("loading the model", args.progress_s):
            model, tok = strata_mlx.load(args.store, arena_gb=args.arena_gb)
        # first-request costs (kernel builds), as the server's warm-up request pays them
        for _ in strata_mlx.stream_generate(model, tok, warm, max_tokens=1):
            pass
        return model, tok

    def first_token(model, tok, cache, n: int, t0: float) -> float:
        """Seconds from `t0` to the first token of the next turn, `n` tokens of it cached."""
        gen = strata_mlx.stream_generate(
            model, tok, full[n:], max_tokens=1, prompt_cache=cache, cached_tokens=full[:n]
        )
        with contextlib.closing(gen):
            next(gen)
        return time.perf_counter() - t0

    pristine = work / "pristine"
    print(f"building the conversation's cache: {len(first)} tokens", flush=True)
    model, tok = loaded()
    try:
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        with ticking("first turn", args.progress_s):
            for _ in strata_mlx.stream_generate(
                model, tok, first, max_tokens=1, prompt_cache=cache
            ):
                pass
        print(f"  first turn (cold): {time.perf_counter() - t0:.2f} s", flush=True)
        disk = PromptCacheDir(pristine, model)
        disk.put(first, cache)  # one token answered: the state covers the prompt exactly
        if disk.written != 1:
            raise SystemExit(f"the first turn's state was not written to {pristine}")
    finally:
        model.expert_cache.close()
    rows = []
    for r in range(args.rounds):
        order = ("resumed", "cold") if r % 2 == 0 else ("cold", "resumed")
        for variant in order:
            model, tok = loaded()  # a new model, as a restarted server's: nothing resident
            try:
                before = {"read": model.expert_cache.stats.experts_read}
                with ticking(f"{variant}, round {r}", args.progress_s):
                    if variant == "resumed":
                        d = PromptCacheDir(fresh_copy(pristine, work / f"round{r}"), model)
                        t0 = time.perf_counter()  # reading the file counts
                        cache, n = d.take(full)
                    else:
                        t0 = time.perf_counter()
                        cache, n = make_prompt_cache(model), 0
                    t = first_token(model, tok, cache, n, t0)
                    if variant == "resumed":
                        shutil.rmtree(d.path)
                after = {"read": model.expert_cache.stats.experts_read}
            finally:
                model.expert_cache.close()
            before.update(prefilled=0, disk_hits=0, reused=0)
            after.update(prefilled=len(full) - n, disk_hits=int(n > 0), reused=n)
            rows.append(row(variant, r, t, len(full), before, after))
    return rows


def summary(rows: list[dict]) -> None:
    med = {}
    for variant in ("resumed", "cold"):
        ts = [r["ttft_s"] for r in rows if r["variant"] == variant]
        if ts:
            med[variant] = float(np.median(ts))
            print(
                f"{variant:8s} median TTFT {med[variant]:.2f} s over {len(ts)} round(s) "
                f"({min(ts):.2f}-{max(ts):.2f})"
            )
    if len(med) == 2 and med["resumed"] > 0:
        print(f"resumed from disk: {med['cold'] / med['resumed']:.1f}x faster to the first token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--arena-gb", type=float, default=None, help="default: serve's automatic")
    ap.add_argument("--prompt-tokens", type=int, default=16384, help="the conversation so far")
    ap.add_argument("--turn-tokens", type=int, default=64, help="the next turn's new tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024, help="prompt ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-process", action="store_true", help="no HTTP: load() and generate")
    ap.add_argument("--server-arg", action="append", default=[], help="passed to serve")
    ap.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--progress-s", type=float, default=10, help="seconds between progress lines")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()
    for flag in ("prompt_tokens", "turn_tokens", "rounds", "vocab"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: at least 1")
    if not Path(args.store, "manifest.json").is_file():
        ap.error(f"{args.store}: not a strata-mlx store (no manifest.json)")
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="resume_ttft-")))
        else:
            work = args.work_dir
            if work.exists() and any(work.iterdir()):
                ap.error(f"--work-dir {work}: not empty")
            work.mkdir(parents=True, exist_ok=True)
        rows = (in_process if args.in_process else over_http)(args, work)
    summary(rows)
    if args.json is not None:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
