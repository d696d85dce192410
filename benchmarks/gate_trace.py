"""Why a decode gate gives up: each gated layer's check, its experts' gate-table words
watched from the moment the check ends, and the reader's state while a word is late.
CUDA only (the device gate).

    python3 benchmarks/gate_trace.py STORE [--arena-gb 1.6] [-p 256] [-g 6]
        [--policy lookahead:gt1:gg0] [--after-floor] [--detail 2]
    python3 benchmarks/gate_trace.py [--detail 2] --bench BENCH_ARGS...

With --bench, `strata-mlx bench BENCH_ARGS` runs in this process, traced (its fake-stream
floor and probes first, as always: a trace of the same process bench's figures come from).

Gated decode (strata_mlx.runtime.deferred.run_gated) builds a token's layers ahead of their
checks; each layer's experts wait on the device, in the gate kernel, until the gate table
shows every expert the layer chose landed. A gate that waits past its timeout
(STRATA_MLX_GATE_TIMEOUT_MS; set it short here, e.g. 100) gives up and its token is
recomputed. For each token, recorded: when each gated layer was built, when its check (on the
checks' thread) began and ended, and, for each expert the layer chose, the host's residency
slot and the gate-table word as the check ended; a thread of this script then polls those
words (a sweep every ~0.1 ms plus its own time, for 2 s) and records when a word not landed
lands and when a landed one is cleared (its expert evicted), and, for a word still out 20
and 60 ms after its check, the reader's queues, reads in flight, reads done and device
copies made (copies that stop counting while reads are in flight: held in the driver), and
the system call each of the process's threads waits in, by thread name. Once
the token is done, its gates' give-up flags name the layers that gave up (a give-up
rebuilds the layers after it, checked again: each build's records are matched to its own
flags). Printed: the first tokens with give-ups in detail, then every given-up layer
classed by what its words did:
  late landing  a word landed only after the check ended, at least half a timeout later;
  never landed  a word not landed within the watch;
  cleared       a word landed at the check's end and cleared before a later layer's check
                had its routing (by then the layer had finished);
  all landed    every word in place at the check's end and none cleared: the gate should
                have passed (what it read differs from what the host sees);
  landed in time  every missing word landed within half a timeout of the check's end: the
                gate did not see it (or waited on another word);
  no check      the layer's check had not run by the token's end.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

# (first: importing the package asks CUDA for its hardware queues, before MLX starts CUDA)
import strata_mlx

# isort: split
import mlx.core as mx
import numpy as np
from gate_copy import run_bench, split_bench  # (benchmarks/ on sys.path)

from strata_mlx.apps.bench import policy_options
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import generate_step
from strata_mlx.runtime import decode, deferred, gate_checks

WATCH_S = 2.0


class Trace:
    def __init__(self):
        self.lock = threading.Lock()
        self.token, self.t_start = -1, time.perf_counter()
        self.built: dict[tuple[int, int], float] = {}  # (token, layer) -> last build time
        self.checks: list[dict] = []
        self.watch: list[dict] = []
        # token -> (build, layer) of each gate that gave up; a build: the layers built since
        # the token's gates' flags were last read (a give-up rebuilds the layers after it)
        self.gave_up: dict[int, list[tuple[int, int]]] = {}
        self.gen = 0
        self.stop = False
        self.build_s: dict[tuple[int, int], float] = {}  # (token, layer) -> run_gated's ms
        self.submitted: dict[tuple[int, int], float] = {}  # -> its check handed to the thread
        self.gcs: list[tuple[float, float, int]] = []  # (start, end ms, generation) of each GC
        self._gc_start = 0.0
        self.stacks = None  # the file faulthandler dumps a stalled build's stacks into
        self.stack_dumps = 0  # dumps taken (a stall armed and not disarmed in time)
        self.stack_size = 0
        self.py_spy: tuple[str, str] | None = None  # (py-spy's binary, the file its dumps go to)
        self.spied = 0
        # (token, MLX's active + cached bytes as it starts): a token whose memory grows
        # allocated new device memory, a call that may synchronize with the device
        self.memory: list[tuple[int, int]] = []

    def spy(self, r: dict) -> None:
        """A late word: every thread's native stack (py-spy's dump, the process paused while
        it reads them) appended to the --py-spy file, on a thread of its own; SPY_DUMPS at most."""
        if self.py_spy is None or self.spied >= SPY_DUMPS:
            return
        self.spied += 1
        head = f"=== token {r['token']} layer {r['layer']}, {SNAPS_MS[0]} ms after its check\n"

        def dump():
            out = subprocess.run(
                [self.py_spy[0], "dump", "--native", "--pid", str(os.getpid())],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            with open(self.py_spy[1], "a") as f:
                f.write(head + out.stdout + out.stderr)

        threading.Thread(target=dump, daemon=True).start()

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = self.now()
        else:
            self.gcs.append((self._gc_start, self.now(), info.get("generation", -1)))

    def arm(self) -> None:
        """A build step began: if the building thread is still on it STALL_S from now,
        faulthandler (a C thread of its own, no GIL needed) dumps every thread's stack."""
        if self.stacks is None:
            return
        size = os.fstat(self.stacks.fileno()).st_size
        if size > self.stack_size:
            self.stack_dumps += 1
            self.stack_size = size
        if self.stack_dumps < STACK_DUMPS:
            faulthandler.dump_traceback_later(STALL_S, file=self.stacks)
        else:
            faulthandler.cancel_dump_traceback_later()

    def now(self) -> float:
        return 1e3 * (time.perf_counter() - self.t_start)

    def poll(self) -> None:
        while not self.stop:
            t = time.perf_counter()
            with self.lock:
                self.watch = [r for r in self.watch if t - r["wall"] < WATCH_S]
                recs = list(self.watch)
            for r in recs:
                t = time.perf_counter()
                row = r["table"].row(r["layer"])
                for e, w0 in zip(r["ids"], r["words"]):
                    w = int(row[e])
                    if w0 < 0 and w >= 0 and e not in r["landed"]:
                        r["landed"][e] = 1e3 * (t - r["wall"])
                    if w0 >= 0 and w < 0 and e not in r["cleared"]:
                        r["cleared"][e] = 1e3 * (t - r["wall"])
                late = any(w < 0 and e not in r["landed"] for e, w in zip(r["ids"], r["words"]))
                for at in SNAPS_MS:
                    if late and at not in r["snaps"] and 1e3 * (t - r["wall"]) >= at:
                        r["snaps"][at] = f"{reader_state(r['reader'])}; {threads_state()}"
                        if at == SNAPS_MS[0]:
                            self.spy(r)
            time.sleep(0.0001)


T = Trace()
SPY_DUMPS = 3
STALL_S, STACK_DUMPS = 0.06, 6  # a build step this long has its stacks dumped, this many at most
SNAPS_MS = (20, 60)  # a word still out this long after its check: the reader's state taken


# x86-64 Linux system call numbers a waiting thread shows in /proc/PID/task/TID/syscall
SYSCALLS = {"0": "read", "1": "write", "7": "poll", "16": "ioctl", "17": "pread",
            "35": "nanosleep", "202": "futex", "230": "clock_nanosleep", "232": "epoll_wait",
            "271": "ppoll", "281": "epoll_pwait"}  # fmt: skip


def threads_state() -> str:
    """This process's threads, by name, counted by the system call each waits in (Linux's
    /proc; "running" where none): a reader thread (strata-reader) in ioctl waits inside the
    CUDA driver, in futex on a lock or its queue, in pread on the drive."""
    groups: Counter = Counter()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return "(no /proc)"
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/syscall") as f:
                call = f.read().split()[0]
        except (OSError, IndexError):
            continue
        what = call if call == "running" else SYSCALLS.get(call, f"syscall {call}")
        if tid == str(os.getpid()):
            name = "main"  # the building thread
        groups[(name, what)] += 1
    return ", ".join(f"{n} {w} x{c}" for (n, w), c in sorted(groups.items()))


def reader_state(reader) -> str:
    """What the reader's threads hold and have done, in one line."""
    try:
        st = reader.stats()
    except Exception as e:  # (closed meanwhile)
        return f"({e})"
    return (
        f"urgent {st['queued_urgent']} ahead {st['queued_ahead']} in flight {st['in_flight']} "
        f"done {st['requests_done']} copies {st['device_copies']} completions {st['completions']}"
        f" buffers regrown {st['bounce_regrown']}"
    )


def install() -> None:
    run_gated = deferred.DeferredHandshake.run_gated
    check_gated = deferred.DeferredHandshake.check_gated
    start = decode.PipelinedDecoder.start
    late = decode.PipelinedDecoder._late
    submit = gate_checks.GateChecks.submit
    finish = decode.PipelinedDecoder.finish

    def traced_run_gated(self, layer, x, inds):
        key, t = (T.token, layer), T.now()
        T.built.setdefault(key, t)  # (its first build, not a recompute)
        T.arm()
        out = run_gated(self, layer, x, inds)
        T.build_s.setdefault(key, T.now() - t)
        return out

    def traced_submit(self, d):
        T.submitted.setdefault((T.token, d.layer), T.now())
        return submit(self, d)

    def traced_check_gated(self, d, trace, aside=False):
        t0 = T.now()
        with self.sched.lock:  # in flight as the check began (read-ahead, or an earlier miss)
            flying = {k[1] for k in self.sched.tag_of if k[0] == d.layer}
        tags = check_gated(self, d, trace, aside)
        t1 = T.now()
        wall = time.perf_counter()
        with T.lock:  # this layer's routing is known: the layers before it have finished
            for r in T.watch:
                earlier = r["token"] < T.token or r["layer"] < d.layer
                if earlier and "done" not in r:
                    r["done"] = 1e3 * (wall - r["wall"])
        ids = d.gated.needed  # (the check's ints: this thread reads no array of the layer's)
        gate = self.sched.residency.gate
        r = {
            "token": T.token,
            "gen": T.gen,
            "layer": d.layer,
            "t0": t0,
            "t1": t1,
            "ids": ids,
            "words": gate.row(d.layer)[ids].tolist(),
            "res": self.sched.residency.row(d.layer)[ids].tolist(),
            "tags": len(tags),
            "flying": flying,
            "table": gate,
            "reader": self.sched._reader,
            "snaps": {},
            "landed": {},
            "cleared": {},
            "wall": time.perf_counter(),
        }
        with T.lock:
            T.checks.append(r)
            T.watch.append(r)
        return tags

    def traced_start(self, tokens, cache, gate=True):
        T.token += 1
        T.memory.append((T.token, mx.get_active_memory() + mx.get_cache_memory()))
        return start(self, tokens, cache, gate)

    def traced_finish(self, step, later=None):
        if T.stacks is not None:  # the token's checks wait for the device: not a stalled build
            faulthandler.cancel_dump_traceback_later()
        return finish(self, step, later)

    def traced_late(self, step):
        if step.late:
            flags = mx.concatenate([f for _, f in step.late]).tolist()
            gone = [(T.gen, j) for (j, _), f in zip(step.late, flags[0::2]) if f]
            if gone:
                T.gave_up.setdefault(T.token, []).extend(gone)
            T.gen += 1  # the layers rebuilt after a give-up are a build of their own
        return late(self, step)

    deferred.DeferredHandshake.run_gated = traced_run_gated
    deferred.DeferredHandshake.check_gated = traced_check_gated
    decode.PipelinedDecoder.start = traced_start
    decode.PipelinedDecoder._late = traced_late
    gate_checks.GateChecks.submit = traced_submit
    decode.PipelinedDecoder.finish = traced_finish
    gc.callbacks.append(T.on_gc)


def classify(r: dict | None, half_timeout_ms: float) -> str:
    if r is None:
        return "no check"
    out = [w for w in r["words"] if w < 0]
    if any(t < r.get("done", WATCH_S * 1e3) for t in r["cleared"].values()):
        return "cleared"
    if not out:
        return "all landed"
    missing = [e for e, w in zip(r["ids"], r["words"]) if w < 0]
    if any(e not in r["landed"] for e in missing):
        return "never landed"
    if max(r["landed"][e] for e in missing) >= half_timeout_ms:
        return "late landing"
    return "landed in time"


def describe(r: dict, built: float | None) -> str:
    key = (r["token"], r["layer"])
    b = f"built {built:8.1f}" if built is not None else "built      ?"
    if key in T.build_s and key in T.submitted:
        b += f" (+{T.build_s[key]:.1f} ms, submitted {T.submitted[key]:8.1f})"
    parts = []
    for e, s, w in zip(r["ids"], r["res"], r["words"]):
        p = f"{e}:{s}/{w}" + ("^" if e in r["flying"] else "")
        if e in r["landed"]:
            p += f"+{r['landed'][e]:.1f}"
        if e in r["cleared"]:
            p += f"x{r['cleared'][e]:.1f}"
        parts.append(p)
    snaps = "".join(f"\n      {at} ms after: {st}" for at, st in sorted(r["snaps"].items()))
    return (
        f"    layer {r['layer']:3d} {b}, check {r['t0']:8.1f}-{r['t1']:8.1f} ms, "
        f"{r['tags']} waits; expert:slot/word(^ in flight at the check's start, +landed ms, "
        f"xcleared ms) {' '.join(parts)}{snaps}"
    )


def main(argv: list[str]) -> None:
    argv, bench = split_bench(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="?", help="(not with --bench)")
    ap.add_argument("--arena-gb", type=float, default=None)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=256)
    ap.add_argument("-g", "--gen-tokens", type=int, default=6)
    ap.add_argument("--policy", default="lookahead:gt1:gg0")
    ap.add_argument("--detail", type=int, default=2, help="tokens with give-ups in detail")
    ap.add_argument(
        "--after-floor",
        action="store_true",
        help="first load, run and close a fake-stream model, as bench's compute floor does",
    )
    ap.add_argument(
        "--probes",
        action="store_true",
        help="first run bench's probes (probe-ssd, the data path's readers into an arena)",
    )
    ap.add_argument("--prefill-step-size", type=int, default=None)
    ap.add_argument("--no-gc", action="store_true", help="Python's cyclic GC off for the run")
    ap.add_argument(
        "--stacks",
        default=None,
        help=f"where every thread's stack goes when a build step takes {STALL_S * 1e3:.0f} ms "
        f"or more (faulthandler; the first {STACK_DUMPS})",
    )
    ap.add_argument(
        "--py-spy",
        nargs=2,
        metavar=("BINARY", "FILE"),
        default=None,
        help=f"py-spy's binary, and where each thread's native stack goes while a word is "
        f"late (the first {SPY_DUMPS})",
    )
    ap.add_argument(
        "--host-ok",
        action="store_true",
        help="run with the host's gate (never gives up: a smoke run)",
    )
    a = ap.parse_args(argv)
    from strata_mlx.runtime.experts import device_gate_available

    if not device_gate_available() and not a.host_ok:
        raise SystemExit("gate_trace.py: needs MLX's CUDA device (the device gate)")
    if (bench is None) == (a.store is None):
        ap.error("a STORE, or --bench and bench's arguments")
    install()
    if a.stacks:
        T.stacks = open(a.stacks, "w")
    if a.py_spy:
        T.py_spy = tuple(a.py_spy)
    if a.no_gc:
        gc.collect()
        gc.disable()
    poller = threading.Thread(target=T.poll, daemon=True)
    poller.start()
    t = time.perf_counter()
    if bench is not None:
        label = f"strata-mlx bench {' '.join(bench)}"
        run_bench(bench)
    else:
        m = load_manifest(a.store)
        if a.probes:
            from strata_mlx.apps.bench import _probes
            from strata_mlx.runtime.loader import RuntimeConfig

            _probes(Path(a.store), m, RuntimeConfig(), 8, 2.0, print)
        if a.after_floor:
            print("a fake-stream model: load, prefill, decode, close", flush=True)
            fake, _ = strata_mlx.load(a.store, arena_gb=a.arena_gb, fake_stream=True)
            ids = np.random.default_rng(1).integers(0, m.config["vocab_size"], a.prompt_tokens)
            for _ in generate_step(fake, mx.array(ids.tolist()), max_tokens=a.gen_tokens):
                pass
            fake.expert_cache.close()
            del fake
        print(f"{a.policy}: load, prefill {a.prompt_tokens}, decode {a.gen_tokens}", flush=True)
        model, _ = strata_mlx.load(a.store, arena_gb=a.arena_gb, **policy_options(a.policy))
        ids = np.random.default_rng(0).integers(0, m.config["vocab_size"], a.prompt_tokens)
        steps = generate_step(
            model, mx.array(ids.tolist()), max_tokens=a.gen_tokens,
            prefill_step_size=a.prefill_step_size,
        )  # fmt: skip
        n = 0
        for _ in steps:
            n += 1
            print(f"  decoded {n}", flush=True)
        label = (
            f"{a.policy}: {n} tokens"
            + (" (after a fake-stream model)" if a.after_floor else "")
            + (" (after the probes)" if a.probes else "")
        )
        model.expert_cache.close()
    wall = time.perf_counter() - t
    faulthandler.cancel_dump_traceback_later()
    gc.enable()
    time.sleep(WATCH_S)
    T.stop = True
    poller.join()
    report(f"{label}: {wall:.1f} s (prefill included)", a.detail)
    if T.stacks is not None:
        T.stacks.close()
        print(f"stacks of stalled build steps: {a.stacks}")


def report(label: str, detail: int) -> None:
    from custom_kernels.gate import timeout_ms

    half = timeout_ms() / 2
    print(
        f"{label}, gate timeout {timeout_ms()} ms, "
        f"{sum(map(len, T.gave_up.values()))} gates gave up"
    )
    kinds: Counter = Counter()
    delays = []
    shown = 0
    for token, gone in sorted(T.gave_up.items()):
        recs = [r for r in T.checks if r["token"] == token]
        if shown < detail:
            print(f"  token {token}: gave up at layers {[layer for _, layer in gone]}")
            for r in recs:
                print(describe(r, T.built.get((token, r["layer"]))))
            for g0, g1, gen in T.gcs:  # collections during this token's checks
                if recs and recs[0]["t0"] - 200 <= g0 <= recs[-1]["t1"]:
                    print(f"    GC generation {gen}: {g0:8.1f}-{g1:8.1f} ms")
            shown += 1
        for gen, layer in gone:
            mine = [r for r in recs if r["layer"] == layer and r["gen"] == gen]
            kinds[classify(mine[-1] if mine else None, half)] += 1
            if mine and (token, layer) in T.built:
                delays.append(mine[0]["t0"] - T.built[(token, layer)])
    if not T.gave_up and T.checks:  # a sample: the last token's checks
        last = T.checks[-1]["token"]
        print(f"  token {last} (no gate gave up):")
        for r in (r for r in T.checks if r["token"] == last):
            print(describe(r, T.built.get((last, r["layer"]))))
    lands = sorted(v for r in T.checks for v in r["landed"].values())
    waited = sum(w < 0 for r in T.checks for w in r["words"])
    if waited:
        print(
            f"words not landed at their check's end: {waited}, landed within the watch "
            f"{len(lands)}"
            + (
                f" (ms after: median {lands[len(lands) // 2]:.1f}, max {lands[-1]:.1f})"
                if lands
                else ""
            )
            + f"; landed words cleared {sum(len(r['cleared']) for r in T.checks)}"
        )
    print(
        "given-up layers by what their words did: "
        + ", ".join(f"{k} {v}" for k, v in kinds.items())
    )
    grew = {t0: b1 - b0 for (t0, b0), (_, b1) in zip(T.memory, T.memory[1:])}
    if grew:
        gone = [t for t in T.gave_up if t in grew]
        rest = sorted(v for t, v in grew.items() if t not in T.gave_up)
        print(
            "MLX's memory (active + cached) grown during a token, MB: "
            + (f"tokens that gave gates up {[round(grew[t] / 2**20, 1) for t in gone]}; "
               if gone else "")
            + (f"the others median {rest[len(rest) // 2] / 2**20:.1f}, max "
               f"{rest[-1] / 2**20:.1f}, {sum(v > 0 for v in rest)} of {len(rest)} grew"
               if rest else "")
        )  # fmt: skip
    long = sorted(((g1 - g0), g0, gen) for g0, g1, gen in T.gcs if g1 - g0 >= 1.0)
    print(
        f"garbage collections: {len(T.gcs)}, {len(long)} of 1 ms or more"
        + (f" (longest {long[-1][0]:.1f} ms, generation {long[-1][2]}, at {long[-1][1]:.1f})"
           if long else "")
    )  # fmt: skip
    if delays:
        d = sorted(delays)
        print(
            f"check start after the layer's build (ms): min {d[0]:.1f}, median "
            f"{d[len(d) // 2]:.1f}, max {d[-1]:.1f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
