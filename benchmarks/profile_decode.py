"""Where decode's (or prefill's) host time goes: cProfile over one generation's decode steps.

    python benchmarks/profile_decode.py STORE [--arena-gb 6.5] [-p 1024] [-g 48]
        [--policy lookahead] [--top 40] [--prefill] [--no-profile [--py-spy BINARY]]
        [--evals [--ops] [--skip N]] [--fake-stream]

Prefills a random prompt of `p` tokens (not profiled), then profiles `g` greedy decode steps
and prints the functions by their own time and by cumulative time, with the cache's
per-token wait / sync / host split beside them. `--prefill`: profiles the prompt's chunks
after the first instead (chunks of `--prefill-step-size`), with the split a chunk.
`--no-profile` times decode without cProfile and prints each thread's CPU time a token against
the wall; with `--py-spy BINARY` too, py-spy samples every thread's Python and native stacks
while decode runs (`record --native --threads`, active samples only, so about where each
thread spends its CPU) and the top frames by thread are printed, self and inclusive: what
cProfile cannot show, the time inside MLX's and CUDA's calls. `--evals` (no cProfile): the
decoding thread's time inside MLX's `async_eval` and `eval` a token, by the line that called
them, against its CPU outside them (the graph's building in Python and MLX's op calls),
and each group of threads' CPU a token by thread name (the reader's, CUDA's, the rest);
`--ops` adds the primitives a token's evaluations scheduled, by kind (each graph walked
before its evaluation, in a pass of its own after the timed one: the walk costs more than
the ops; arrays passed as positional arguments only). `--skip N`: the first N decode tokens
run before the timing starts (kernels first launched in a process's first tokens, ungated
tokens among them). `--fake-stream`: every expert counts as resident (bench's compute floor:
"token" mode, nothing read). `--isolate`: once those tokens have run, the decoding thread alone
on a physical core and every other thread on the rest (Linux). With `--evals`, the misses'
reads (the reader's urgent requests) a token and their time from submission to landing.
`--check-delay-ms X`: each gated check sleeps X ms (the GIL let go) before it claims its
layer's experts, i.e. before its misses' reads are submitted: how much a token grows with
the check's latency says how much of it lies on the chain through the gates.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

import strata_mlx
from strata_mlx.apps.bench import DECODE_MODES, policy_options
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import generate_step
from strata_mlx.stream.stats import ExpertStats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--arena-gb", type=float, default=None)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=1024)
    ap.add_argument("-g", "--gen-tokens", type=int, default=48)
    ap.add_argument("--policy", default="lookahead")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--prefill", action="store_true", help="profile prefill's chunks instead")
    ap.add_argument("--prefill-step-size", type=int, default=1024)
    ap.add_argument(
        "--no-profile",
        action="store_true",
        help="time decode without cProfile: each thread's CPU time a token against the wall",
    )
    ap.add_argument("--py-spy", default=None, help="with --no-profile: py-spy's binary")
    ap.add_argument(
        "--tokens",
        action="store_true",
        help="each token's wall time and decode mode, the prompt's first token's included",
    )
    ap.add_argument("--evals", action="store_true", help="time inside MLX's eval calls")
    ap.add_argument("--ops", action="store_true", help="with --evals: primitives a token")
    ap.add_argument("--skip", type=int, default=0, help="decode tokens run before timing")
    ap.add_argument("--fake-stream", action="store_true", help="every expert counts as resident")
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="after the skipped tokens: the decoding thread alone on one physical core (its "
        "SMT siblings idle), every other thread of the process on the other cores (Linux)",
    )
    ap.add_argument(
        "--check-delay-ms",
        type=float,
        default=0.0,
        help="each gated check sleeps this long before claiming its experts (the GIL let go)",
    )
    ap.add_argument(
        "--switch-us",
        type=float,
        default=None,
        help="Python's thread switch interval, us (sys.setswitchinterval; CPython's is 5000): "
        "how long a thread that wants the GIL may wait for one running Python",
    )
    a = ap.parse_args()
    if a.switch_us is not None:
        if not a.switch_us > 0:
            ap.error(f"--switch-us must be > 0, got {a.switch_us}")
        sys.setswitchinterval(a.switch_us / 1e6)
    if a.check_delay_ms > 0:
        delay_checks(a.check_delay_ms / 1e3)
    m = load_manifest(a.store)
    options = policy_options(a.policy) | ({"fake_stream": True} if a.fake_stream else {})
    model, _ = strata_mlx.load(a.store, arena_gb=a.arena_gb, **options)
    ids = np.random.default_rng(0).integers(0, m.config["vocab_size"], a.prompt_tokens).tolist()
    ec = model.expert_cache
    if a.prefill:
        return profile_prefill(model, ec, ids, a)
    extra = 1 + a.skip + (a.gen_tokens if a.evals and a.ops else 0)
    steps = generate_step(
        model, mx.array(ids), max_tokens=a.gen_tokens + extra, prefill_step_size=1024
    )
    if a.tokens:
        return each_token(steps, ec)
    for _ in range(1 + a.skip):  # the prompt and its first token (and `skip`): not profiled
        next(steps)
    if a.isolate:  # (every thread exists by now: the checks' starts at the first gated layer)
        print(isolate_decoding_thread())
    if a.evals:  # (timed without cProfile)
        return timed_evals(steps, ec, a)
    ec.stats = ExpertStats()
    prof = cProfile.Profile()
    spy = Spy(a.py_spy) if a.py_spy and a.no_profile else None
    t, cpu = time.perf_counter(), time.thread_time()
    if not a.no_profile:
        prof.enable()
    n = sum(1 for _ in steps)
    prof.disable()
    wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
    print(f"{a.policy}: {n} tokens, {wall / n * 1e3:.1f} ms/token; a token: {split(ec.stats, n)}")
    st = ec.stats
    # Python runs one thread at a time: where the threads' CPU time a token nears the wall,
    # the GIL, not the device, sets the pace (MLX's calls that let go of it aside)
    print(
        f"CPU ms a token: decoding thread {cpu / n * 1e3:.1f}, checks' thread "
        f"{st.check_cpu_s / n * 1e3:.1f}, scheduler loop {st.loop_cpu_s / n * 1e3:.1f}; "
        f"wall {wall / n * 1e3:.1f}"
    )
    if spy is not None:
        spy.report(a.top)
    if a.no_profile:
        return ec.close()
    finish(prof, ec, a.top)


class Spy:
    """py-spy recording this process (native frames, per thread) until `report`. Sampling
    pauses the process (200 times a second), so a spied run's timings are not an unspied
    one's: compare its shares, not its milliseconds."""

    def __init__(self, binary: str):
        with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as f:
            self.out = f.name
        self.err = tempfile.TemporaryFile()  # (a pipe left unread could fill and stall it)
        cmd = [binary, "record", "--native", "--threads", "--rate", "200", "--format", "raw"]
        cmd += ["--output", self.out, "--pid", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.err)
        time.sleep(1.0)  # (attached before decode starts)

    def report(self, top: int) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.err.seek(0)
        err = self.err.read()
        names = {t.native_id: t.name for t in threading.enumerate()}
        own: dict[str, Counter] = {}
        inclusive: dict[str, Counter] = {}
        with open(self.out) if os.path.exists(self.out) else open(os.devnull) as f:
            for line in f:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                if not stack or not count.isdigit():
                    continue
                frames = stack.split(";")
                tid = frames[0].removeprefix("thread (").split(")")[0]
                name = names.get(int(tid), tid) if tid.isdigit() else frames[0]
                own.setdefault(name, Counter())[frames[-1]] += int(count)
                inclusive.setdefault(name, Counter()).update(dict.fromkeys(frames[1:], int(count)))
        os.unlink(self.out)
        if not own:
            print("py-spy recorded nothing:", err.decode(errors="replace").strip()[-300:])
        print("(py-spy sampled the run above: its timings are slowed by the sampling)")
        for name, counts in sorted(own.items(), key=lambda kv: -kv[1].total()):
            total = counts.total()
            print(f"py-spy, thread {name}: {total} active samples")
            # (inclusive: the callers under 90 % of the samples, the common outer frames aside)
            under = Counter({f: c for f, c in inclusive[name].items() if c < 0.9 * total})
            for label, table in (("self", counts), ("inclusive", under)):
                for frame, c in table.most_common(top):
                    print(f"  {label:9s} {100 * c / total:5.1f}%  {frame[:150]}")


class EvalCalls:
    """mx.eval and mx.async_eval wrapped (every caller looks them up on `mx` at the call):
    wall and thread CPU time inside them by calling line, on the decoding thread; with `ops`,
    the primitives of each evaluated graph by kind instead (mx.export_to_dot before the call)."""

    def __init__(self, ops: bool):
        self.ops = ops
        self.wall: Counter = Counter()
        self.cpu: Counter = Counter()
        self.calls: Counter = Counter()
        self.kinds: Counter = Counter()
        self.thread = threading.get_ident()
        self.kept = mx.eval, mx.async_eval
        mx.eval, mx.async_eval = self._wrap(self.kept[0]), self._wrap(self.kept[1])

    def _wrap(self, fn):
        name = fn.__name__

        def call(*args, **kw):
            if threading.get_ident() != self.thread:
                return fn(*args, **kw)
            f = sys._getframe(1)
            site = (
                f"{name} {f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno} {f.f_code.co_name}"
            )
            self.calls[site] += 1
            if self.ops:
                arrays = [x for x in args if isinstance(x, mx.array)]
                if arrays:
                    dot = io.StringIO()
                    mx.export_to_dot(dot, *arrays)
                    self.kinds.update(
                        re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue())
                    )
                return fn(*args, **kw)
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                self.wall[site] += time.perf_counter() - t
                self.cpu[site] += time.thread_time() - c

        return call

    def close(self) -> None:
        mx.eval, mx.async_eval = self.kept


DELAYS: list[float] = []  # (--check-delay-ms: each delay as slept)


def delay_checks(seconds: float) -> None:
    """Every claim made on the gated checks' thread sleeps `seconds` first (ExpertCache.claim
    replaced on the class: a measurement's probe, never the package's way)."""
    from strata_mlx.runtime.experts import ExpertCache

    claim = ExpertCache.claim

    def delayed(self, *args, **kw):
        if threading.current_thread().name == "strata-mlx-gate-checks":
            t = time.perf_counter()
            time.sleep(seconds)
            DELAYS.append(time.perf_counter() - t)
        return claim(self, *args, **kw)

    ExpertCache.claim = delayed


def isolate_decoding_thread() -> str:
    """The calling thread alone on one physical core, its SMT siblings left idle, and every
    other thread of the process on the remaining cores (Linux: sched_setaffinity per thread,
    the cores' siblings from sysfs): whether the threads beside it slow the decoding thread."""
    cpus = sorted(os.sched_getaffinity(0))
    sys_cpu = Path("/sys/devices/system/cpu")

    def siblings(c: int) -> set[int]:
        f = sys_cpu / f"cpu{c}" / "topology" / "thread_siblings_list"
        out: set[int] = set()
        for part in f.read_text().strip().split(",") if f.exists() else [str(c)]:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
        return out

    own = {cpus[0]}
    rest = set(cpus) - siblings(cpus[0])
    if not rest:
        return "isolate: one core only, nothing moved"
    me = threading.get_native_id()
    moved = 0
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        try:
            os.sched_setaffinity(tid, own if tid == me else rest)
            moved += tid != me
        except OSError:  # (a thread that ended meanwhile)
            pass
    idle = sorted(siblings(cpus[0]) - own)
    return (
        f"isolate: the decoding thread on CPU {cpus[0]} (its SMT siblings {idle or 'none'} "
        f"idle), {moved} other threads on {len(rest)} CPUs"
    )


def threads_cpu() -> Counter:
    """CPU seconds each group of this process's threads has used, by thread name (Linux's
    /proc: the reader's threads are `strata-reader`, CUDA's driver threads `cuda...`); {}
    where there is no /proc."""
    out: Counter = Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").glob("*"):  # (none where there is no /proc)
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # (a thread that ended meanwhile)
            continue
        group = "cuda" if name.startswith("cuda") else name
        out[group] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def timed_evals(steps, ec, a) -> None:
    """`--evals`: the decoding thread's time inside MLX's evaluations a token, by caller, and
    (`--ops`) the primitives a token's graphs hold, in an untimed pass after the timed one;
    each group of threads' CPU a token (by name, from /proc), whose busy waits would show
    there."""
    calls = EvalCalls(ops=False)
    ec.stats = ExpertStats()
    groups = threads_cpu()
    reads, delays = ec.reader.stats(), len(DELAYS)
    t, cpu = time.perf_counter(), time.thread_time()
    n = sum(1 for _ in zip(range(a.gen_tokens), steps))
    wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
    groups = threads_cpu() - groups
    after = ec.reader.stats()  # (the urgent counters that add up; urgent_max_ns does not)
    counted = ("urgent_reads", "urgent_ns", "urgent_queued_ns", "spin_takes", "urgent_parts")
    counted += ("urgent_pread_ns", "urgent_verify_ns", "urgent_copy_ns")
    reads = {k: after[k] - reads[k] for k in counted}
    calls.close()
    inside_w, inside_c = sum(calls.wall.values()), sum(calls.cpu.values())
    per = 1e3 / n
    print(f"{a.policy}: {n} tokens, {wall * per:.2f} ms/token; a token: {split(ec.stats, n)}")
    print(
        f"decoding thread, ms a token: wall {wall * per:.2f}, CPU {cpu * per:.2f}; inside MLX's "
        f"evals: wall {inside_w * per:.2f}, CPU {inside_c * per:.2f}; CPU outside them "
        f"{(cpu - inside_c) * per:.2f}; checks' thread CPU {ec.stats.check_cpu_s * per:.2f}, "
        f"from its routing reads to the misses submitted {ec.stats.check_claim_s * per:.2f} "
        f"(--check-delay-ms's delays included), waiting for the GIL once a routing was on the "
        f"board {ec.stats.check_gil_s * per:.2f}"
    )
    if reads["urgent_reads"]:
        u = reads["urgent_reads"]
        print(
            f"misses' reads: {u / n:.1f} a token, {reads['urgent_ns'] / u / 1e3:.0f} us from "
            f"submission to landing ({reads['urgent_queued_ns'] / u / 1e3:.0f} us before a "
            f"thread took them up); reads or parts taken by a polling thread (read-ahead's "
            f"too) {reads['spin_takes'] / n:.1f} a token"
        )
        parts = max(1, reads["urgent_parts"])
        print(
            f"  {parts / u:.1f} parts a miss; a part's pread "
            f"{reads['urgent_pread_ns'] / parts / 1e3:.0f} us, checksum "
            f"{reads['urgent_verify_ns'] / parts / 1e3:.0f} us, copy into its slot "
            f"{reads['urgent_copy_ns'] / parts / 1e3:.0f} us"
        )
    if len(DELAYS) > delays:
        slept = DELAYS[delays:]
        each = sum(slept) / len(slept) * 1e3
        print(f"checks delayed: {len(slept) / n:.1f} a token, {each:.3f} ms each")
    if groups:  # (10 ms ticks: a group under a tick a token over the run reads 0)
        print(
            "threads' CPU, ms a token: "
            + ", ".join(f"{name} {c * per:.2f}" for name, c in groups.most_common(6))
        )
    for site, w in calls.wall.most_common(12):
        print(
            f"  {site:60s} {calls.calls[site] / n:6.1f} calls, wall {w * per:6.2f}, "
            f"CPU {calls.cpu[site] * per:6.2f} ms a token"
        )
    if a.ops:
        calls = EvalCalls(ops=True)
        n = sum(1 for _ in steps)
        calls.close()
        print(f"primitives a token ({n} tokens; views included): {calls.kinds.total() / n:.0f}")
        for kind, c in calls.kinds.most_common(40):
            print(f"  {kind:40s} {c / n:7.1f}")
    steps.close()  # (a token built ahead is rolled back while the cache is open)
    ec.close()


def each_token(steps, ec) -> None:
    """Each token's wall time (the first's: the prompt's prefill and its last token) and the
    mode its decode step ran in; gates given up so far."""
    t, st = time.perf_counter(), ec.stats
    before = {m: 0 for m in DECODE_MODES}
    for i, _ in enumerate(steps):
        now = time.perf_counter()
        counts = {m: getattr(st, f"{m}_mode_tokens") for m in DECODE_MODES}
        mode = ",".join(m for m in DECODE_MODES if counts[m] > before[m]) or "-"
        print(f"token {i}: {1e3 * (now - t):8.1f} ms, {mode}; gates given up {st.gate_timeouts}")
        before, t = counts, time.perf_counter()
    ec.close()


def split(st: ExpertStats, n: int) -> str:
    """The cache's wait / sync / host / loop split (ms) and reads, per `n` (tokens, or 1 chunk)."""
    return (
        f"wait {st.exposed_wait_s / n * 1e3:.1f}, sync {st.route_sync_s / n * 1e3:.1f}, host "
        f"{st.host_s / n * 1e3:.1f}, loop thread {st.loop_s / n * 1e3:.1f}; read "
        f"{st.experts_read / n:.0f}, miss {st.miss_pct:.1f}%; device at gates "
        f"{st.gate_wait_s / n * 1e3:.1f}"
    )


def finish(prof: cProfile.Profile, ec, top: int) -> None:
    for key in ("tottime", "cumtime"):
        pstats.Stats(prof).sort_stats(key).print_stats(top)
    ec.close()


def profile_prefill(model, ec, ids: list[int], a) -> None:
    """The first chunk unprofiled (kernels built), the rest profiled one by one."""
    step = a.prefill_step_size
    chunks = [ids[i : i + step] for i in range(0, len(ids), step)]
    cache = model.make_cache()
    mx.eval(model(mx.array([chunks[0]]), cache=cache))
    prof = cProfile.Profile()
    for chunk in chunks[1:]:
        ec.stats = ExpertStats()
        t = time.perf_counter()
        prof.enable()
        mx.eval(model(mx.array([chunk]), cache=cache))
        prof.disable()
        wall = time.perf_counter() - t
        print(
            f"{a.policy} prefill chunk of {len(chunk)}: {wall * 1e3:.0f} ms; {split(ec.stats, 1)}"
        )
    finish(prof, ec, a.top)


if __name__ == "__main__":
    main()
