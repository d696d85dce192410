"""Where a resident decode token's device time goes, strata-mlx beside mlx-lm: every kernel
and copy each one's decode launches, timed by the device itself (CUPTI, through PyTorch's
profiler), grouped by kernel name.

    python benchmarks/kernel_profile.py STORE [-p 256] [-g 32] [--skip 8] [--rounds 2] [--top 25]

A CUDA machine with a CUDA build of PyTorch (only its profiler is used: CUPTI records the
kernels of every CUDA context in the process, MLX's included). Both models hold every
expert (strata-mlx's arena warmed) and decode the same prompt greedily with their own
`generate_step` (mlx-lm's, and strata-mlx's with its default decoder), `--skip` tokens
before the profiled `-g`; rounds alternate which model goes first. Per token: the kernels'
summed time, the device's busy time (their union), the span from the first kernel's start to
the last's end (busy plus the device's idle gaps, which the host's pace sets), and the
kernel count; then the kernels whose time a token differs most between the two, with the
grid each one's launches most often had (how much work a launch of that name was given).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import tempfile

import mlx.core as mx
import numpy as np

import strata_mlx
from strata_mlx.apps.baseline import load_mlx_lm
from strata_mlx.format.store import StoreError, load_manifest
from strata_mlx.generation.generate import generate_step, make_sampler

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def profiler():
    """PyTorch's profiler of CUDA activity, or SystemExit with why not."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError as e:
        raise SystemExit(f"error: PyTorch is needed for its CUDA profiler ({e})") from None
    if not torch.cuda.is_available():
        raise SystemExit("error: PyTorch sees no CUDA device (its profiler records none)")
    return profile(activities=[ProfilerActivity.CUDA])


def short(name: str) -> str:
    """A kernel's name without template arguments and its parameter list."""
    name = re.sub(r"<.*>", "<>", name.replace("(anonymous namespace)", "anon")).rstrip()
    if name.endswith(")"):  # the parameter list: back to its matching "("
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i].rstrip()
                break
    return name[:70]


def device_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    got = [e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e]
    if not got:
        raise SystemExit("error: the profiler recorded no CUDA kernel (MLX not on a CUDA GPU?)")
    return got


def summarize(events: list[dict], tokens: int) -> dict:
    """Per token: summed kernel time, busy time (union), span, count; time and count by name."""
    iv = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
    busy, end = 0.0, -1.0
    for s, t in iv:
        if t > end:
            busy += t - max(s, end)
            end = t
    by = collections.defaultdict(lambda: [0.0, 0])
    grids = collections.defaultdict(collections.Counter)  # name -> its launches' grid sizes
    for e in events:
        key = ("copy: " if e["cat"] != "kernel" else "") + short(e.get("name", "?"))
        by[key][0] += float(e["dur"])
        by[key][1] += 1
        grid = e.get("args", {}).get("grid")
        if grid is not None:
            grids[key][str(grid).replace(" ", "")] += 1
    span = (iv[-1][1] - iv[0][0]) if iv else 0.0
    return {
        "sum_ms": sum(float(e["dur"]) for e in events) / tokens / 1e3,
        "busy_ms": busy / tokens / 1e3,
        "span_ms": span / tokens / 1e3,
        "kernels": len(events) / tokens,
        "by_name": {k: (v[0] / tokens / 1e3, v[1] / tokens) for k, v in by.items()},
        "grid": {k: c.most_common(1)[0][0] for k, c in grids.items()},
    }


def profiled(steps, skip: int, gen: int) -> dict:
    """`gen` tokens of a (token, logprobs) generator profiled after `skip` unprofiled ones."""
    for _ in range(skip):
        next(steps)
    mx.synchronize()  # (the device idle at both ends: no kernel half in the window)
    with profiler() as prof:
        for _ in range(gen):
            next(steps)
        mx.synchronize()
    steps.close()
    return summarize(device_events(prof), gen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=256)
    ap.add_argument("-g", "--gen-tokens", type=int, default=32)
    ap.add_argument("--skip", type=int, default=8, help="tokens decoded before the profiled ones")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    for flag, v in (("-g", a.gen_tokens), ("--rounds", a.rounds), ("--skip", a.skip + 1)):
        if v < 1:
            raise SystemExit(f"error: {flag} must be at least {1 if flag != '--skip' else 0}")
    try:
        m = load_manifest(a.store)
    except StoreError as e:
        raise SystemExit(f"error: {e}") from None
    profiler()  # (fails early where it cannot run)
    ids = np.random.default_rng(0).integers(0, m.config["vocab_size"], a.prompt_tokens).tolist()
    n = a.skip + a.gen_tokens
    print("loading mlx-lm's model and strata-mlx's (every expert resident)", flush=True)
    lm = load_mlx_lm(a.store)
    model, _ = strata_mlx.load(a.store, arena_gb=m.expert_bytes / 1024**3 * 1.01 + 0.01)
    model.expert_cache.warm()

    def run_lm():
        from mlx_lm.generate import generate_step as lm_step

        return profiled(lm_step(mx.array(ids), lm, max_tokens=n), a.skip, a.gen_tokens)

    def run_strata():
        steps = generate_step(model, mx.array(ids), n, make_sampler(0.0), 1024)
        return profiled(steps, a.skip, a.gen_tokens)

    runs = [("mlx-lm", run_lm), ("strata", run_strata)]
    got = collections.defaultdict(list)
    for r in range(a.rounds):
        for name, run in runs if r % 2 == 0 else runs[::-1]:
            s = run()
            got[name].append(s)
            idle = s["span_ms"] - s["busy_ms"]
            print(
                f"round {r} {name}: ms a token: kernels {s['sum_ms']:.2f}, device busy "
                f"{s['busy_ms']:.2f}, span {s['span_ms']:.2f} (idle {idle:.2f});"
                f" {s['kernels']:.0f} kernels and copies a token",
                flush=True,
            )
    last = {name: got[name][-1]["by_name"] for name in got}
    names = set(last["mlx-lm"]) | set(last["strata"])
    zero = (0.0, 0.0)
    rows = sorted(
        names,
        key=lambda k: -abs(last["strata"].get(k, zero)[0] - last["mlx-lm"].get(k, zero)[0]),
    )
    grid = {name: got[name][-1]["grid"] for name in got}
    print("\nthe last round, by kernel (us a token / launches a token; the commonest grid of")
    print(f"each one's launches), the {a.top} largest gaps:")
    print(f"{'kernel':72} {'mlx-lm':>16} {'strata-mlx':>16}  grids")
    for k in rows[: a.top]:
        lt, lc = last["mlx-lm"].get(k, zero)
        st, sc = last["strata"].get(k, zero)
        g = f"{grid['mlx-lm'].get(k, '-')} {grid['strata'].get(k, '-')}"
        print(f"{k:72} {lt * 1e3:9.1f} /{lc:5.1f} {st * 1e3:9.1f} /{sc:5.1f}  {g}")


if __name__ == "__main__":
    main()
