"""Decode's host time per MoE layer: the handshake's Python, outside the route sync and the wait.

    python benchmarks/decode_host.py STORE [--arena-gb 0.1] [-p 64] [-g 32]
        [--policies lookahead,demand] [--rounds 3] [--parts] [--full] [--general] [--python-rule]
    python benchmarks/decode_host.py --tiny /tmp/strata-tiny48 ...

`--tiny DIR` builds (once) and uses a store of the full-size model's routing shape
(qwen3-next-80b-a3b: 48 MoE layers, 512 experts, top-10) with tiny experts and dense weights
(hidden 128, expert width 64, 4-bit: 16 KB records, ~400 MB), so that every handshake does
the work the full-size model's does; an arena of 0.1 GB holds about a quarter of it, and
decode misses.

Replay (the default): one decode of `g` greedy tokens after a random prompt of `p` tokens
records every MoE layer's input and routing ids (the per-layer handshake, `--decode sync`);
then, per policy and round, the model is loaded afresh, the same prompt prefilled, and the
recorded layers handed to the expert cache's handshake in order, as decode would, with their
expert outputs built but never evaluated. The device then computes nothing but the lookahead
routers, as on a GPU, where the host's time is its own: on a CPU, decode's compute runs on the
same cores and inflates every host figure several times over. Reads, misses, read-ahead,
eviction and the kernel call's graph building are all real. `--full` times real decode
instead (`--decode sync|pipelined`).

Per handshake (a decode layer through the cache: tokens x MoE layers, plus the layers pipelined
decode recomputed), in microseconds, the median over rounds: cpu (replay: the calling thread's
CPU time in the handshake, `time.thread_time`, outside the route sync's mx.eval: its Python,
the wait's collection of completions included, but not the time other threads and processes
take its core: the figure to compare on a shared machine), host (the cache's `host_s`, wall time: the handshake's Python outside
the route sync and the wait; the figure to compare on a GPU, where a spinning sync would count
as CPU time), route sync, exposed wait, and the scheduler loop thread's time holding the GIL.
A policy with `:gt1` (gated decode) replays each layer as gated decode builds and checks it (on
this CPU the host's gate: the check before the experts, its reads waited for; on CUDA the
device gate, whose outputs the replay never evaluates, so nothing waits on the device).
`--parts` (replay) splits cpu by the scheduler and kernel calls the handshake makes (each
wrapped with thread_time_ns; rest: the handshake's own lines and the wait), from the last
round.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np

import strata_mlx
from strata_mlx.apps.bench import policy_options
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import generate_step
from strata_mlx.runtime import experts
from strata_mlx.runtime.compute import LayerCompute
from strata_mlx.runtime.experts import ExpertCache
from strata_mlx.stream.arena import Arena
from strata_mlx.stream.scheduler import LoopScheduler, Scheduler
from strata_mlx.stream.stats import ExpertStats

# The full-size model's routing shape, everything else tiny.
TINY = dict(
    hidden_size=128,
    moe_intermediate_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=512,
    expert_bits=4,
    expert_group_size=32,
)

# What --parts times inside the handshake, by owner.
PARTS = {
    Scheduler: (
        "claim",
        "collect",
        "drop_unneeded",
        "read_ahead",
        "reserve",
        "predicted",
        "row",
        "device_row",
        "count_resident",
        "start_misses",
        "wait",
    ),
    ExpertCache: ("predict",),
    LayerCompute: ("by_expert", "one_token", "by_pair"),
}


def build_tiny(path: Path) -> Path:
    """The tiny store of the full-size routing shape at `path` (built once)."""
    if (path / "manifest.json").exists():
        return path
    from strata_mlx.convert.synthetic import convert_synthetic, synthetic_config

    cfg = synthetic_config("qwen3-next-80b-a3b")
    cfg.update(TINY)
    return convert_synthetic("qwen3-next-80b-a3b", path, config=cfg, progress=False)


class Parts:
    """thread_time_ns around the methods in PARTS (class attributes patched, then restored)."""

    def __init__(self):
        self.ns: dict[str, int] = defaultdict(int)
        self.depth = 0
        self._kept = []

    def __enter__(self):
        for owner, names in PARTS.items():
            for cls in (owner, LoopScheduler) if owner is Scheduler else (owner,):
                for name in names:
                    fn = cls.__dict__.get(name)
                    if fn is not None:  # where it is defined (a subclass may override it)
                        self._kept.append((cls, name, fn))
                        setattr(cls, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def timed(*args, **kw):
            if self.depth:  # nested inside another part: counted there
                return fn(*args, **kw)
            self.depth += 1
            t = time.thread_time_ns()
            try:
                return fn(*args, **kw)
            finally:
                self.ns[name] += time.thread_time_ns() - t
                self.depth -= 1

        return timed

    def __exit__(self, *exc):
        for cls, name, fn in reversed(self._kept):
            setattr(cls, name, fn)
        self._kept = []


class SyncTime:
    """The calling thread's CPU time inside mx.eval (patched for the block): the route sync,
    whose CPU time on a CPU is the lookahead routers' compute, left out of `cpu`."""

    def __enter__(self):
        self.ns, self._eval = 0, mx.eval

        def timed(*args):
            t = time.thread_time_ns()
            try:
                return self._eval(*args)
            finally:
                self.ns += time.thread_time_ns() - t

        mx.eval = timed
        return self

    def __exit__(self, *exc):
        mx.eval = self._eval


@contextlib.contextmanager
def general_path():
    """Within: every handshake takes the general path (a single token's ids are not told
    apart), as before the one-token path existed."""
    kept = experts.token_ids, experts.joint_ids
    experts.token_ids = lambda ids: None
    experts.joint_ids = lambda inds, preds: None
    try:
        yield
    finally:
        experts.token_ids, experts.joint_ids = kept


@contextlib.contextmanager
def python_rule():
    """Within: the arena's victim rule is a Python callable, as before the C one
    (strata_mlx._nextuse.Evictable): the native policies call it for every candidate."""
    kept = Arena._evictable

    def rule(self, protect, keep):
        slot_of, pinned, loading = self.slot_of, self.pinned, self.loading
        protect, keep = protect or (), keep or ()

        def evictable(k):
            if k[0] in protect or k in keep:
                return False
            s = slot_of[k]
            return s not in pinned and s not in loading

        return evictable

    Arena._evictable = rule
    try:
        yield
    finally:
        Arena._evictable = kept


VARIANTS = {"general": general_path, "python-rule": python_rule}


@contextlib.contextmanager
def emulated_device_gate():
    """Gated policies through the device gate's path on this CPU (`--device-gate`): the
    gate table mapped at its host address, the gate kernel a call that returns slot 0 for
    every pair at once (a replay never evaluates its outputs), each check on the checks'
    thread as on CUDA; the routing board's kernel (`:bd1`) writes its row at the host address.
    The decoding thread's build then costs what it would there, less MLX's launches; the
    checks' CPU is theirs (`checks`), and `claim` their wall time from a layer's routing read
    to its misses' reads submitted: the check's own part of the chain a miss waits on."""
    from strata_mlx.runtime import deferred
    from strata_mlx.stream import reader

    def gate(ids, row_at, timeout=None):
        return mx.zeros((ids.size,), dtype=mx.uint32), mx.zeros((2,), dtype=mx.int32)

    def board(ids, board_at, seq):  # (the board's row at its host address: ids, then seq)
        mx.eval(ids)  # (the routing's wait, counted as the route sync: not on a device)
        row = np.ctypeslib.as_array(
            ctypes.cast(board_at.item(), ctypes.POINTER(ctypes.c_int32)), (1 + ids.size,)
        )
        row[1:] = np.asarray(ids).astype(np.int32)
        row[0] = seq.item()
        return ids

    names = ("device_gate_available", "map_host", "unmap_host", "gate", "board")
    owners = (experts, reader, reader, deferred, deferred)
    kept = [getattr(o, n) for o, n in zip(owners, names)]
    stand_ins = (lambda: True, lambda address, nbytes: address, lambda a: None, gate, board)
    for o, n, f in zip(owners, names, stand_ins):
        setattr(o, n, f)
    try:
        yield
    finally:
        for o, n, f in zip(owners, names, kept):
            setattr(o, n, f)


def load(store: str, a, policy: str):
    opts = policy_options(policy)
    # (a gated policy's layers are replayed as gated decode builds them: a pipelined decoder's)
    opts.setdefault("decode", "pipelined" if opts.get("decode_gate") else a.decode)
    model, _ = strata_mlx.load(store, arena_gb=a.arena_gb, **opts)
    return model


def prompt(store: str, a) -> mx.array:
    vocab = load_manifest(store).config["vocab_size"]
    return mx.array(np.random.default_rng(0).integers(0, vocab, a.prompt_tokens).tolist())


def record(store: str, a, policy: str) -> list[tuple[int, mx.array, mx.array]]:
    """(layer, MoE input, routing ids) of every MoE layer of `g` decode steps, in order."""
    model = load(store, a, policy)
    ec = model.expert_cache
    layers: list[tuple[int, mx.array, mx.array]] = []
    try:
        steps = generate_step(model, prompt(store, a), max_tokens=a.gen_tokens + 1)
        next(steps)
        with ec.dumping(lambda layer, x, inds, scores, y: layers.append((layer, x, inds))):
            for _ in steps:
                pass
    finally:
        ec.close()
    mx.eval([a for _, x, inds in layers for a in (x, inds)])
    return layers


def run(store: str, a, policy: str, parts: Parts | None, layers=None) -> dict:
    """One round: the recorded `layers` replayed after the prompt's prefill (None: decode)."""
    model = load(store, a, policy)
    ec = model.expert_cache
    try:
        steps = generate_step(model, prompt(store, a), max_tokens=a.gen_tokens + 1)
        next(steps)  # the prompt and its first token: not counted
        if layers is not None:
            steps.close()
        ec.stats = ExpertStats()
        with parts or contextlib.nullcontext():
            t, cpu = time.perf_counter(), 0
            if layers is None:
                n = sum(1 for _ in steps)
            else:
                gated = ec.pipelined.gated
                with ec.phase(decoding=True), SyncTime() as sync:
                    for layer, x, inds in layers:
                        c = time.thread_time_ns()
                        if not gated:
                            ec.run_layer(layer, x, inds)
                        else:  # gated decode's build and check of the layer (bench's :gt1)
                            if layer == ec.layers[0]:
                                ec.settle()  # a token starts: as the decoder does
                            with ec.pipelined.building(True, gated=True) as built:
                                ec.run_layer(layer, x, inds)
                            for d in built:
                                ec.check_deferred(d)
                        cpu += time.thread_time_ns() - c
                cpu -= sync.ns
                n = a.gen_tokens
            wall = time.perf_counter() - t
        st = ec.stats
    finally:
        ec.close()
    count = len(layers) if layers is not None else n * len(ec.layers) + st.recomputed_layers
    us = 1e6 / count
    return dict(
        tokens=n,
        layers=count,
        ms_token=wall / n * 1e3,
        host=st.host_s * us,
        cpu=cpu / 1e3 / count,
        sync=st.route_sync_s * us,
        wait=st.exposed_wait_s * us,
        loop=st.loop_s * us,
        checks=st.check_cpu_s * us,
        claim=st.check_claim_s * us,
        miss=st.miss_pct,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="?")
    ap.add_argument("--tiny", help="build (once) and use the tiny full-shape store here")
    ap.add_argument("--arena-gb", type=float, default=0.1)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=64)
    ap.add_argument("-g", "--gen-tokens", type=int, default=32)
    ap.add_argument("--policies", default="lookahead,demand")
    ap.add_argument("--decode", default="sync", choices=("sync", "pipelined"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--full", action="store_true", help="time real decode, not a replay")
    ap.add_argument(
        "--device-gate",
        action="store_true",
        help="replay: gated policies through the device gate's path, emulated (checks on "
        "their own thread, whose CPU is the `checks` column and whose time from a routing "
        "read to its misses submitted is the `claim` column)",
    )
    ap.add_argument(
        "--general",
        action="store_true",
        help="replay: also run each policy through the general handshake path (numpy ids, "
        "by_expert), alternating: the one-token path's gain in one process",
    )
    ap.add_argument(
        "--python-rule",
        action="store_true",
        help="replay: also run each policy with the arena's victim rule in Python (before its "
        "C object), alternating",
    )
    a = ap.parse_args()
    if (a.store is None) == (a.tiny is None):
        ap.error("give a STORE or --tiny DIR")
    store = str(build_tiny(Path(a.tiny)) if a.tiny else a.store)
    policies = a.policies.split(",")
    results = defaultdict(list)
    parts = {p: Parts() for p in policies} if a.parts and not a.full else {}
    if not a.full:
        a.decode = "sync"  # recorded by the per-layer handshake, which the replay runs
    recorded = None if a.full else {p: record(store, a, p) for p in policies}
    extra = ["general"] * a.general + ["python-rule"] * a.python_rule
    variants = [(p, v) for p in policies for v in ["", *extra]]
    for r in range(a.rounds):
        for policy, v in variants:  # interleaved: drift on a shared machine hits all alike
            last = r == a.rounds - 1
            part = parts.get(policy) if last and not v else None
            emulate = a.device_gate and ":gt1" in policy and not a.full
            with VARIANTS[v]() if v else contextlib.nullcontext():
                with emulated_device_gate() if emulate else contextlib.nullcontext():
                    out = run(store, a, policy, part, recorded and recorded[policy])
            results[policy + (":" + v if v else "")].append(out)
    what = "decode " + a.decode if a.full else "replayed decode"
    print(
        f"{what}, arena {a.arena_gb} GB, p {a.prompt_tokens}, g {a.gen_tokens}, "
        f"median of {a.rounds}; us a layer"
    )
    print(
        f"{'policy':28} {'ms/token':>9} {'cpu':>6} {'host':>7} {'sync':>8} {'wait':>7} "
        f"{'loop':>6} {'checks':>6} {'claim':>6} miss %"
    )
    for policy, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"{policy:28} {med['ms_token']:9.1f} {'-' if a.full else round(med['cpu']):>6} "
            f"{med['host']:7.0f} "
            f"{med['sync']:8.0f} "
            f"{med['wait']:7.0f} {med['loop']:6.0f} {med['checks']:6.0f} {med['claim']:6.0f} "
            f"{med['miss']:6.1f}"
        )
        if policy in parts:
            layers = runs[-1]["layers"]
            split = {k: v / 1e3 / layers for k, v in sorted(parts[policy].ns.items())}
            own = runs[-1]["cpu"] - sum(split.values())
            print(
                "    " + ", ".join(f"{k} {v:.0f}" for k, v in split.items()) + f"; rest {own:.0f}"
            )


if __name__ == "__main__":
    main()
