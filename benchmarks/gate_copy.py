"""Does a record's device copy land while a decode gate waits on the device, and which of
MLX's calls on the building thread holds it? CUDA only.

    python3 benchmarks/gate_copy.py [--spin-ms 400] [--reserve-gb 2]
    python3 benchmarks/gate_copy.py --reserve-gb 2 --bench --model STORE --policies lookahead:gt1 ...

Gated decode's layers wait in the gate kernel (custom_kernels/gate.py) for the records their
checks read; a reader thread copies each record into its slot with the copy engine, then
stores its ready word. On the full-size store such words landed only when the gate waiting
for them gave up (docs/benchmarks.md, "Gated decode"), while a CPU copy (`:dc0`) landed in
time. Here a gate waits on a word that never lands (--spin-ms), and while it waits the
building thread does one thing of MLX's, and 5 ms into it a reader thread reads a 1 MB record
from a tmpfs file into a slot of an arena in device memory, its ready word a second word of
the same mapped table. Printed: the time from that read's submission to its word, and how long
the building thread's call took. The calls, each in its own round:
  nothing;
  a GPU op whose output has a size MLX's buffer cache has not held (a device allocation:
  cudaMallocAsync from the device's default memory pool);
  the same op again (MLX's cache serves it);
  a matmul of a shape not seen before (cuBLAS may pick a kernel not loaded yet);
  an array from host memory of a size not held (CUDA managed memory, cudaMallocManaged);
  mx.clear_cache(), a buffer of a new size evaluated and freed before the gate (MLX's cache
  hands it back to the pool);
  a kernel this process has not launched yet (MLX compiles it and CUDA loads its module:
  CUDA's documentation says loading a module may synchronize the context).
Each call but the last runs once before the rounds with no gate waiting, so that its kernels
are loaded (CUDA loads a module at its first launch) and a round times the call alone.
A word held for the whole spin by one of them says which call holds the device's other users;
with --py-spy PATH (py-spy's binary), a word still out 50 ms into a round has the building
thread's native stack dumped (`py-spy dump --native`): where in MLX, and in CUDA, it waits.
With --reserve-gb G the rounds run again after the default memory pool is told to keep what it
reserves (its release threshold at the maximum: by default it hands its free memory back at
every synchronization) and grown by G GB, so that a new allocation is carved from reserved
memory instead of mapping new memory.

With --workers N, then N reader threads (each its own copy stream) read a record each while a
gate waits: CUDA runs a context's streams on CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by
default), and a copy stream sharing MLX's queue waits behind the gate. Run it under each value.
With --behind too, then the same as read-ahead whose copies the threads leave running, their
words stored by the driver's host functions: the driver may run every stream's host functions
on one thread in turn, MLX's own among them.

With --driver, only the CUDA driver calls a reader thread makes (a copy stream made, a bounce
buffer pinned and let go of), each timed while a gate waits.

--bench ARGS...: then `strata-mlx bench ARGS` in this process, after the reserve if any (bench
prints the gates given up). Everything after --bench goes to bench.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

# (first: importing the package asks CUDA for its hardware queues, before MLX starts CUDA)
import strata_mlx  # noqa: F401

# isort: split
import mlx.core as mx
import numpy as np

RECORD = 1 << 20
CALLS = (
    "nothing",
    "new-device-size",
    "same-device-size",
    "new-matmul-shape",
    "new-host-size",
    "clear-cache",
    "first-kernel",
)
# Ops no other call launches, one a round: each "first-kernel" call's kernel is compiled and
# its module loaded by that call, behind the waiting gate (never warmed up).
FIRST_KERNELS = ("erfinv", "arctanh", "expm1", "log1p", "arcsinh", "sinh", "cosh", "erf")


class TableShape:
    """A gate table of one layer of 64 experts (strata_mlx.stream.gate.GateTable's manifest)."""

    num_experts = 64
    moe_layers = [0]

    def layer_position(self, layer: int) -> int:
        return 0


def reserve_pool(gb: float) -> None:
    """The device's default memory pool keeps what it reserves, grown by `gb` GB now."""
    cu = ctypes.CDLL("libcuda.so.1")
    dev, pool = ctypes.c_int(), ctypes.c_void_p()
    threshold = ctypes.c_uint64(2**64 - 1)
    for call in (
        lambda: cu.cuDeviceGet(ctypes.byref(dev), 0),
        lambda: cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev),
        lambda: cu.cuMemPoolSetAttribute(pool, 4, ctypes.byref(threshold)),  # RELEASE_THRESHOLD
    ):
        if rc := call():
            sys.exit(f"gate_copy.py: the CUDA driver refused the pool's setting (CUresult {rc})")
    if gb > 0:
        a = mx.zeros((int(gb * 2**30) // 4,), dtype=mx.float32) + 1  # a GPU op: the pool's memory
        mx.eval(a)
        del a
        mx.clear_cache()  # back to the pool, which now keeps it
        mx.synchronize()


class Sizes:
    """Element counts no earlier round used (each a different page-rounded size)."""

    def __init__(self):
        self.n = 3 << 18
        self.first = 0  # first-kernel's ops used

    def new(self) -> int:
        self.n += 5 << 12
        return self.n


def building_call(kind: str, sizes: Sizes, same: list, prepare: bool = False) -> None:
    """One thing of MLX's on the building thread while the gate waits; `prepare`: what must
    happen before the gate is launched (clear-cache's buffer, evaluated and freed into MLX's
    cache, so that the call returns it to the pool)."""
    if kind == "clear-cache":
        if prepare:
            a = mx.zeros((sizes.new(),), dtype=mx.float32) + 3
            mx.eval(a)
            del a
        else:
            mx.clear_cache()
    elif prepare:
        return
    elif kind == "new-device-size":
        a = mx.zeros((sizes.new(),), dtype=mx.float32) + 1
        same[:] = [a.size]
        mx.async_eval(a)
    elif kind == "same-device-size":
        n = same[0] if same else sizes.new()
        mx.async_eval(mx.zeros((n,), dtype=mx.float32) + 2)
    elif kind == "new-matmul-shape":
        n = sizes.new() // 4096
        w = mx.ones((64, n), dtype=mx.bfloat16)
        mx.async_eval(w @ w.T)
    elif kind == "new-host-size":
        mx.async_eval(mx.array(np.ones(sizes.new(), dtype=np.float32)))
    elif kind == "first-kernel":
        op = getattr(mx, FIRST_KERNELS[sizes.first % len(FIRST_KERNELS)])
        sizes.first += 1
        mx.async_eval(op(mx.full((4096,), 0.25, dtype=mx.float16)))


def warm_up(sizes: Sizes) -> None:
    """Each call once with no gate waiting: the kernels it launches loaded (CUDA loads a
    module at its first launch), so that a round times the call, not a first load."""
    same: list = []
    for kind in CALLS:
        if kind == "first-kernel":  # (its point: a kernel not loaded yet)
            continue
        building_call(kind, sizes, same, prepare=True)
        building_call(kind, sizes, same)
        mx.synchronize()


def main_stack(py_spy: str) -> str:
    """The building (main) thread's native stack, from py-spy's dump of this process."""
    r = subprocess.run(
        [py_spy, "dump", "--native", "--nonblocking", "--pid", str(os.getpid())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    text = r.stdout if r.returncode == 0 else f"py-spy failed: {r.stderr.strip()[:300]}"
    block = text.split('"MainThread"', 1)[-1].split("\nThread ", 1)[0]
    return "\n".join("      " + line.strip() for line in block.splitlines()[1:30])


def one_round(
    kind: str,
    reader,
    f,
    arena,
    table,
    spin_ms: int,
    sizes: Sizes,
    same: list,
    py_spy: str | None = None,
):
    """(ms from the read's submission to its ready word, ms the building thread's call took,
    the building thread's stack if it was dumped). A failed read exits with its error."""
    building_call(kind, sizes, same, prepare=True)
    table.table[0, 5] = -1
    late = spin_gate(table, spin_ms)
    landed: dict = {}

    def dump():  # on its own thread, the process not paused: the read's timing untouched
        landed["stack"] = main_stack(py_spy)

    def read():
        time.sleep(0.005)  # into the building thread's call
        t0 = time.perf_counter()
        reader.submit([(1, f, 0, RECORD, arena.address(0), None, table.ready((0, 5), 0))], True)
        while table.table[0, 5] < 0 and time.perf_counter() - t0 < 5:
            if py_spy and "dumper" not in landed and time.perf_counter() - t0 > 0.05:
                landed["dumper"] = threading.Thread(target=dump)
                landed["dumper"].start()
            time.sleep(0.0002)
        landed["word"] = time.perf_counter() - t0
        ((_, landed["err"], _),) = reader.wait([1])

    th = threading.Thread(target=read)
    th.start()
    t0 = time.perf_counter()
    building_call(kind, sizes, same)
    call = time.perf_counter() - t0
    th.join()
    if "dumper" in landed:
        landed["dumper"].join()
    mx.eval(late)
    if landed["err"]:
        from strata_mlx.stream.reader import error_message

        sys.exit(f"gate_copy.py: the record's read failed: {error_message(landed['err'])}")
    return 1e3 * landed["word"], 1e3 * call, landed.get("stack")


def spin_gate(table, spin_ms: int) -> mx.array:
    """A gate queued on the device, waiting out `spin_ms` for a word that never lands (row
    0's last); its `late` (give-up flag, longest wait), to evaluate once done."""
    from custom_kernels.gate import gate

    table.table[0, 63] = -1
    ids = mx.array([63], dtype=mx.uint32)
    row = table.gate_at(table.row_address(0))
    _, late = gate(ids, row, spin_ms)
    mx.async_eval(late)
    time.sleep(0.02)  # the gate is waiting
    return late


@contextmanager
def record_reader(args, slots: int, workers: int, **reader_options):
    """(reader, the record file's index, arena, gate table): a 1 MB record in a temporary
    file, read through `workers` device-copy threads into an arena of `slots` slots in
    device memory, each read's ready word in one row of a mapped gate table; the reader's
    `reader_options` (copy_behind)."""
    from strata_mlx.stream.arena import Arena
    from strata_mlx.stream.gate import GateTable
    from strata_mlx.stream.reader import Reader

    table = GateTable(TableShape(), device=True)
    arena = Arena(slots, RECORD, on_device=True, device_memory=True)
    try:
        with tempfile.NamedTemporaryFile(dir=args.dir, suffix=".bin") as tmp:
            data = np.random.default_rng(0).integers(0, 255, RECORD, dtype=np.uint8)
            tmp.write(data.tobytes())
            tmp.flush()
            with Reader(workers, bounce=True, device_copy=True, **reader_options) as reader:
                yield reader, reader.open(tmp.name), arena, table
    finally:
        table.close()


def rounds(args, label: str) -> None:
    sizes, same = Sizes(), []
    with record_reader(args, 2, 2) as (reader, f, arena, table):
        # the gate kernel (its timeout is a template value: one build each) and every
        # call's kernels built before the rounds
        one_round("nothing", reader, f, arena, table, args.spin_ms, sizes, same)
        warm_up(sizes)
        print(f"{label}: the gate waits {args.spin_ms} ms; a 1 MB record read meanwhile")
        for kind in CALLS:
            word, call, stack = one_round(
                kind, reader, f, arena, table, args.spin_ms, sizes, same, args.py_spy
            )
            held = "  <- held" if word > args.spin_ms / 2 else ""
            print(f"  {kind:18s} word after {word:7.1f} ms, the call {call:7.1f} ms{held}")
            if stack:
                print("    the building thread 50 ms in:\n" + stack)


def streams_round(args, behind: bool = False) -> None:
    """--workers N reader threads (each its own copy stream) read a record each while a gate
    waits: how many words landed only near the gate's end. CUDA runs a context's streams on
    CUDA_DEVICE_MAX_CONNECTIONS hardware queues; a stream sharing MLX's queues its copies
    behind the gate. With `behind`, read-ahead whose copies the threads leave running
    (copy_behind), each word stored by a host function the driver runs once the copy is done
    (cuLaunchHostFunc), while MLX has one of its own queued behind the gate (each evaluation's
    batch ends with one)."""
    n = args.workers
    urgent = not behind
    with record_reader(args, n, n, copy_behind=behind) as (reader, f, arena, table):
        reqs = [(i, f, 0, RECORD, arena.address(i), None, table.ready((0, i), i))
                for i in range(n)]  # fmt: skip
        reader.submit(reqs, urgent)  # the record's pages and the threads warmed up
        reader.wait(list(range(n)))
        late = spin_gate(table, args.spin_ms)
        t0 = time.perf_counter()
        reader.submit(reqs, urgent)
        landed = [None] * n
        while None in landed and time.perf_counter() - t0 < 5:
            now = time.perf_counter() - t0
            for i in range(n):
                if landed[i] is None and table.table[0, i] >= 0:
                    landed[i] = 1e3 * now
            time.sleep(0.0002)
        errs = [err for _, err, _ in reader.wait(list(range(n)))]
        mx.eval(late)
    if any(errs):
        sys.exit(f"gate_copy.py: {sum(map(bool, errs))} of the records' reads failed")
    ms = sorted(x if x is not None else 5e3 for x in landed)
    held = sum(x > args.spin_ms / 2 for x in ms)
    what = "read-ahead copied behind" if behind else "a record each"
    print(
        f"{n} reader threads, {what} while the gate waits {args.spin_ms} ms "
        f"(CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')})"
        f": {held} held; words after {ms[0]:.1f} / {ms[n // 2]:.1f} / {ms[-1]:.1f} ms "
        "(first / median / last)"
    )


def driver_round(args) -> None:
    """The CUDA driver calls a reader thread makes (its copy stream made, a bounce buffer
    pinned and let go of), each timed on a thread of its own while a gate waits: CUDA lists
    page-locking host memory among the operations that may synchronize the device, and a
    call that waits for the device to go idle waits out the gate."""
    from strata_mlx.stream.gate import GateTable

    cu = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    buf = ctypes.create_string_buffer(4 << 20)
    stream = ctypes.c_void_p()
    calls = {
        "cuStreamCreate": lambda: cu.cuStreamCreate(ctypes.byref(stream), 1),
        "cuMemHostRegister 4 MB": lambda: cu.cuMemHostRegister_v2(buf, 4 << 20, 0),
        "cuMemHostUnregister": lambda: cu.cuMemHostUnregister(buf),
        "cuStreamDestroy": lambda: cu.cuStreamDestroy_v2(stream),
    }
    table = GateTable(TableShape(), device=True)
    try:
        for name, call in calls.items():
            late = spin_gate(table, args.spin_ms)
            out: dict = {}

            def run(call=call, out=out):
                cu.cuCtxSetCurrent(ctx)
                t0 = time.perf_counter()
                out["rc"] = call()
                out["ms"] = 1e3 * (time.perf_counter() - t0)

            th = threading.Thread(target=run)
            th.start()
            th.join()
            mx.eval(late)
            held = "  <- held" if out["ms"] > args.spin_ms / 2 else ""
            print(f"  {name:24s} {out['ms']:7.1f} ms (CUresult {out['rc']}){held}")
    finally:
        table.close()


def split_bench(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(this script's arguments, bench's: those after --bench, or None without it)."""
    if "--bench" not in argv:
        return argv, None
    i = argv.index("--bench")
    return argv[:i], argv[i + 1 :]


def run_bench(bench: list[str]) -> None:
    """`strata-mlx bench BENCH` in this process (its zero exit is no error)."""
    from strata_mlx.apps.cli import app

    try:
        app(["bench", *bench], prog_name="strata-mlx")
    except SystemExit as e:
        if e.code:
            raise


def main(argv: list[str]) -> None:
    argv, bench = split_bench(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spin-ms", type=int, default=400, help="how long the gate waits")
    p.add_argument(
        "--reserve-gb", type=float, default=0.0, help="then keep the pool, grown by G GB"
    )
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--no-rounds", action="store_true", help="only the bench (after the reserve)")
    p.add_argument("--workers", type=int, default=0, help="then N threads' copies at once")
    p.add_argument(
        "--behind",
        action="store_true",
        help="with --workers: then read-ahead copied behind (words by the driver's host functions)",
    )
    p.add_argument(
        "--driver", action="store_true", help="only the reader's driver calls under a gate"
    )
    p.add_argument("--py-spy", default=None, help="py-spy's binary: a held call's native stack")
    args = p.parse_args(argv)
    if not 0 <= args.workers <= 32:
        p.error(f"--workers {args.workers}: 0 to 32 (a word each in a 64-word table row)")
    from strata_mlx.runtime.experts import device_gate_available

    if not device_gate_available():
        sys.exit("gate_copy.py: needs MLX's CUDA device (the gate kernel is CUDA only)")
    if args.driver:
        print(f"the reader's driver calls while the gate waits {args.spin_ms} ms:")
        return driver_round(args)
    if not args.no_rounds:
        rounds(args, "the default memory pool")
        if args.workers:
            streams_round(args)
        if args.workers and args.behind:
            streams_round(args, behind=True)
    if args.reserve_gb > 0:
        reserve_pool(args.reserve_gb)
        if not args.no_rounds:
            rounds(args, f"the pool kept, {args.reserve_gb:g} GB reserved")
    if bench is not None:
        print(
            f"strata-mlx bench {' '.join(bench)} (pool {'kept' if args.reserve_gb else 'default'})"
        )
        run_bench(bench)


if __name__ == "__main__":
    main(sys.argv[1:])
