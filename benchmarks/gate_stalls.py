"""Gated decode's stalls, caught as they happen: bench's cold and warm runs of one policy,
repeated on fresh loads (`--runs` generations a load: cold, then warm ones), with a watchdog that dumps the reader's, the quick misses' and the
gate table's state (and every thread's stack) once nothing has moved for a while.

    python benchmarks/gate_stalls.py STORE [--policy demand] [--loads 4] [--runs 2] [-p 2048]
        [-g 64] [--arena-gb 6.5] [--stall-s 1.0] [--py-spy BINARY] [--out DIR]

A gate that waits out its timeout means a read its layer needs never landed in time: queued
and not taken up, taken up and held (in the driver, behind the device), or never queued. Run
with STRATA_MLX_GATE_TIMEOUT_MS set low (the default 5 s makes each stall long), and gating
never stops here (decode_gate_give_ups 0), so every stall of a run is seen. Each run's line
gives its gates given up; each stall writes DIR/stall-N.txt: the counters, the reader's stats,
the books' reads, and per layer still computing, every expert whose gate-table word is
pending, with whether a read of it is in flight (the reader's flight byte) and in the books.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np

from strata_mlx.apps.bench import _Runner, policy_options, run_policy
from strata_mlx.format.store import load_manifest
from strata_mlx.runtime.options import RuntimeConfig


def state(ec) -> str:
    """What the cache's reads look like now, as text."""
    sched = ec.sched
    out = [f"reader: {ec.reader.stats()}"]
    q = sched.quick
    if q is not None:
        out.append(f"quick: free {q._r.quick_free()} held {len(q.held)} of {q.size}")
    table = sched.residency.gate
    busy = sorted(sched.busy_layers)
    out.append(f"busy layers: {busy}; reads in the books: {len(sched.reads)}")
    urgent = [(t, r.key, r.slot) for t, r in sched.reads.items() if r.urgent]
    out.append(f"urgent reads in the books: {urgent[:40]}")
    if table is not None:
        for layer in busy:
            row = table.row(layer)
            pending = np.flatnonzero(row == -1).tolist()
            if len(pending) > 64:  # (a layer not yet checked: most words pending)
                out.append(f"layer {layer}: {len(pending)} words pending")
                continue
            rows = []
            for e in pending:
                flight = int(q.flight[table.pos[layer], e]) if q is not None else -1
                rows.append((e, flight, sched.tag_of.get((layer, e))))
            out.append(f"layer {layer}: pending (expert, flight, tag) {rows}")
    return "\n".join(out)


def dump(path: Path, ec, since: float, py_spy: str | None) -> None:
    with open(path, "w") as f:
        s = ec.stats
        f.write(
            f"stalled {time.monotonic() - since:.2f} s: tokens {s.tokens} lookups {s.lookups} "
            f"read {s.experts_read} gate timeouts {s.gate_timeouts}\n"
        )
        try:
            f.write(state(ec) + "\n")
        except Exception as e:  # (a diagnostic: what it could not read is part of it)
            f.write(f"state: {type(e).__name__}: {e}\n")
        if py_spy:  # (--nonblocking: the process is not paused, its reads go on)
            try:
                r = subprocess.run(
                    [py_spy, "dump", "--native", "--nonblocking", "--pid", str(os.getpid())],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                f.write(r.stdout + r.stderr)
            except (OSError, subprocess.SubprocessError) as e:
                f.write(f"py-spy: {e}\n")
        for tid in sorted(os.listdir("/proc/self/task")):
            parts = []
            for k in ("comm", "wchan", "syscall"):
                try:
                    parts.append(Path(f"/proc/self/task/{tid}/{k}").read_text().strip())
                except OSError as e:
                    parts.append(f"({k}: {e.strerror})")
            f.write(f"task {tid}: " + " | ".join(parts) + "\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)


def watchdog(ec, stop: threading.Event, a, dumps: list) -> None:
    s = ec.stats
    last, t_last = None, time.monotonic()
    while not stop.wait(0.1):
        now = (s.tokens, s.lookups, s.experts_read)
        if now != last:
            last, t_last = now, time.monotonic()
        elif time.monotonic() - t_last > a.stall_s and len(dumps) < a.max_dumps:
            path = Path(a.out) / f"stall-{len(dumps)}.txt"
            dump(path, ec, t_last, a.py_spy)
            dumps.append(path)
            print(f"  stall: {path}", flush=True)
            t_last = time.monotonic()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--policy", default="demand")
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--runs", type=int, default=2, help="generations a load")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=2048)
    ap.add_argument("-g", "--gen-tokens", type=int, default=64)
    ap.add_argument("--arena-gb", type=float, default=6.5)
    ap.add_argument("--prefill-step-size", type=int, default=1024)
    ap.add_argument("--stall-s", type=float, default=1.0)
    ap.add_argument("--max-dumps", type=int, default=2)
    ap.add_argument("--py-spy", default=None)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    path = Path(a.store)
    m = load_manifest(path)
    ids = np.random.default_rng(0).integers(0, m.config["vocab_size"], a.prompt_tokens).tolist()
    cfg = RuntimeConfig().replace(
        arena_gb=a.arena_gb, prefill_step_size=a.prefill_step_size, decode_gate_give_ups=0,
        **policy_options(a.policy),
    )  # fmt: skip
    runner = _Runner(path, a.gen_tokens, a.prefill_step_size)
    dumps: list = []
    total = 0
    for n in range(a.loads):
        model = runner.load(cfg)
        ec = model.expert_cache
        stop = threading.Event()
        w = threading.Thread(target=watchdog, args=(ec, stop, a, dumps), daemon=True)
        w.start()
        try:
            for phase in ["cold"] + [f"warm{i}" for i in range(1, a.runs)]:
                before = ec.stats.gate_timeouts
                t = time.perf_counter()
                run = run_policy(model, ids, a.gen_tokens, a.prefill_step_size, a.policy, phase)
                timeouts = ec.stats.gate_timeouts - before
                total += timeouts
                d = run.decode
                print(
                    f"load {n} {phase}: {time.perf_counter() - t:.1f} s, decode "
                    f"{run.decode_tokens / run.decode_s:.2f} tok/s, gates given up {timeouts} "
                    f"(in decode's window {d.gate_timeouts}), modes gated {d.gated_mode_tokens}",
                    flush=True,
                )
        finally:
            stop.set()
            w.join()
            runner.close(model)
            del model, ec
            runner.release()
    print(f"in all, {a.loads} loads: gates given up {total}, stalls dumped {len(dumps)}")


if __name__ == "__main__":
    main()
