"""Pipeline parallel over `mx.distributed`: each rank owns a contiguous range of layers.

Run under `mlx.launch` (the ring backend on Ethernet / Thunderbolt, or any backend MLX
initialises). Rank r holds only its layers: their dense weights, their KV cache and state, and
an arena and reader over only those layers' expert records (its manifest is cut down to them,
so it cannot ask for another rank's expert). Rank 0 also holds the embedding, the final norm
and the head: it tokenizes, runs its layers, and sends the hidden state on; each rank runs its
layers and sends the result to the next; the last rank sends it back to rank 0, which applies
the norm and the head and samples. The hidden state, not the logits, comes back: it is
hidden/vocab of their size (32/151936 for a Qwen3 model).

Rank 0 drives and the other ranks serve (`serve_stage`): every message starts with a header
[op, batch, length, dtype], passed down the ring, so the same loop serves `generate`, `serve`
and teacher-forced logits. Every hop is a point-to-point send/recv between ring neighbours
(r -> r+1, last -> 0), which the ring backend requires.

Outputs are bit-identical to one process: each layer computes the same arithmetic on the
same input; nothing is reduced across ranks (tests/runtime/test_distributed.py).

Failure: a lost peer surfaces in MLX as "[ring] connection to a peer was lost" (within
~0.5 s on localhost); a rank that stays silent mid-step is caught by a deadline. Either way
the rank prints one line and exits, so the others exit too rather than hang.

This module never reads expert records (each rank's expert cache does) and never samples.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import OptionError, check_number
from .decode import SyncDecoder

FORWARD, RESET, STATS, STOP = 1, 2, 3, 4
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


class PipelineError(ConnectionError):
    """A rank of the pipeline was lost or did not answer in time."""


# ---- the split -------------------------------------------------------------------------------


def split_layers(costs: list[int], ranks: int, first_extra: int = 0) -> list[range]:
    """Contiguous layer ranges, one per rank, that minimise the largest rank's bytes
    (`costs` per layer; rank 0 also carries `first_extra`). Each rank gets >= 1 layer."""
    n = len(costs)
    if ranks < 1:
        raise OptionError(f"pipeline: {ranks} ranks")
    if ranks > n:
        raise OptionError(f"pipeline: {ranks} ranks for {n} layers; at most one rank a layer")

    def pack(cap: int) -> list[int]:
        """Layers per rank, each rank filled while it stays within `cap`."""
        counts, load = [0], first_extra
        for c in costs:
            if counts[-1] and load + c > cap:
                counts.append(0)
                load = 0
            counts[-1] += 1
            load += c
        return counts

    # The smallest cap that `ranks` ranks can hold (every single layer fits any cap tried).
    lo, hi = max([first_extra + costs[0]] + costs), first_extra + sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(pack(mid)) <= ranks:
            hi = mid
        else:
            lo = mid + 1
    counts = pack(lo)
    # Fewer ranks than asked: split the rank with the most layers (a split never raises a
    # rank's bytes) until every rank has some.
    while len(counts) < ranks:
        j = max(range(len(counts)), key=lambda k: counts[k])
        half = counts[j] // 2
        counts[j : j + 1] = [counts[j] - half, half]
    return _ranges(counts)


def split_counts(text: str, ranks: int) -> list[int]:
    """--pipeline-split's layer counts, one positive integer per rank."""
    try:
        counts = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise OptionError(
            f"--pipeline-split: expected layer counts like 10,14, got {text!r}"
        ) from None
    if len(counts) != ranks:
        raise OptionError(f"--pipeline-split: {len(counts)} entries for {ranks} ranks")
    if any(c < 1 for c in counts):
        raise OptionError(f"--pipeline-split: {text} must be positive layer counts")
    return counts


def parse_split(text: str, n_layers: int, ranks: int) -> list[range]:
    """--pipeline-split "10,14": layers per rank, in rank order (rank 0 the first layers)."""
    try:
        counts = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise OptionError(
            f"--pipeline-split: expected layer counts like 10,14, got {text!r}"
        ) from None
    if len(counts) != ranks:
        raise OptionError(f"--pipeline-split: {len(counts)} entries for {ranks} ranks")
    if any(c < 1 for c in counts) or sum(counts) != n_layers:
        raise OptionError(
            f"--pipeline-split: {text} must be positive and add up to the model's {n_layers} layers"
        )
    return _ranges(counts)


def _ranges(counts: list[int]) -> list[range]:
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def layer_costs(weights: dict, manifest, args, tokens: int) -> tuple[list[int], int]:
    """(bytes per layer, bytes only rank 0 holds): a layer's dense weights, its share of the
    KV cache of `tokens` positions and its expert records (so that equal machines get equal
    arenas relative to their experts); the embedding, final norm and head go to rank 0."""
    from ..stream import memory

    n = args.num_hidden_layers
    costs = [0] * n
    extra = 0
    for name, w in weights.items():
        m = LAYER_KEY.match(name)
        if m and int(m.group(1)) < n:
            costs[int(m.group(1))] += w.nbytes
        else:
            extra += w.nbytes
    itemsize = memory.activation_itemsize(manifest.config.get("torch_dtype"))
    kv = memory.kv_cache_bytes(args, tokens, itemsize) // max(n, 1)
    record = manifest.layout.record_bytes * manifest.num_experts
    moe = set(manifest.moe_layers)
    return [c + kv + (record if i in moe else 0) for i, c in enumerate(costs)], extra


# ---- one rank's model --------------------------------------------------------------------------


class Elsewhere(nn.Module):
    """Stands in for a layer another rank computes: no weights; passes its input through.
    Its cache entry holds no state, but its offset advances as the sequence does: a
    family's mask reads cache[0]'s offset (and its kind), on every rank."""

    mlp = None  # what the families' moe_blocks() look at
    block_sparse_moe = None

    def __init__(self, layer: nn.Module):
        super().__init__()
        # The layer's plain attributes (its kind, e.g. qwen3_next's is_linear): make_cache()
        # builds each layer's cache from them.
        for k, v in vars(layer).items():
            if not k.startswith("_"):
                setattr(self, k, v)

    def __call__(self, x, mask=None, cache=None):
        if cache is not None:
            cache.offset += x.shape[1]
        return x


class Passthrough(nn.Module):
    """Stands in for the embedding (ranks after the first receive the hidden state instead)
    and for the final norm (rank 0 applies it once the hidden state has come back)."""

    def __call__(self, x):
        return x


@dataclass
class Stage:
    """What `load()` cut out for this rank (strata_mlx.runtime.loader)."""

    layers: range
    manifest: object  # this rank's: only its MoE layers' records
    full_manifest: object
    weights: dict
    blocks: dict  # layer -> MoE block, the ones this rank computes

    def profile(self, counts: np.ndarray | None) -> np.ndarray | None:
        """The routing profile's rows of this rank's MoE layers."""
        if counts is None:
            return None
        rows = [self.full_manifest.layer_position(l) for l in self.manifest.moe_layers]
        return counts[rows]


class Pipeline:
    """This process's place in the pipeline: the group, the split, the deadline."""

    def __init__(
        self,
        group=None,
        split: str | None = None,
        timeout_s: float = 300.0,
        load_timeout_s: float = 1800.0,
    ):
        # Checked where the flags are given, on one process too (where neither is used):
        # `--pipeline-split a,b` and `--pipeline-timeout nan` ran without a word.
        check_number("pipeline_timeout", timeout_s, 0, lo_open=True, cli=True)
        check_number("pipeline_load_timeout", load_timeout_s, 0, lo_open=True, cli=True)
        self.group = group if group is not None else init()
        self.rank = self.group.rank()
        self.size = self.group.size()
        if split is not None:
            split_counts(split, self.size)
        self.split_text = split
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
        self.split: list[range] = []
        self.hidden_size = 0
        self.prev = (self.rank - 1) % self.size
        self.stage_s = 0.0  # time in this rank's layers (compute and exposed waits), not hops
        self.next = (self.rank + 1) % self.size

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    # -- at load time (strata_mlx.runtime.loader) --

    def take(self, model, manifest, weights: dict, args, tokens: int) -> Stage:
        """Choose the split, cut `model` down to this rank's layers and `manifest` and
        `weights` down to theirs. `model` is built but not evaluated (its unowned layers'
        parameters are never allocated)."""
        n = len(model.layers)
        if self.split_text:
            self.split = parse_split(self.split_text, n, self.size)
        else:
            costs, extra = layer_costs(weights, manifest, args, tokens)
            self.split = split_layers(costs, self.size, extra)
        own = self.split[self.rank]
        self.hidden_size = args.hidden_size
        blocks = model.moe_blocks()
        inner = model.model
        for i in range(n):
            if i not in own:
                inner.layers[i] = Elsewhere(inner.layers[i])
        if not self.first:
            inner.embed_tokens = Passthrough()
            inner.norm = Passthrough()
            if "lm_head" in model:
                del model["lm_head"]
        # The model object runs these (the family's moe_blocks() would list the stand-ins).
        owned = {i: b for i, b in blocks.items() if i in own and b is not None}
        kept = {}
        for name, w in weights.items():
            m = LAYER_KEY.match(name)
            if (int(m.group(1)) in own) if m else self.first:
                kept[name] = w
        return Stage(own, restrict_manifest(manifest, sorted(owned)), manifest, kept, owned)

    def wrap(self, model):
        """The loaded model as this rank uses it: rank 0 gets a PipelineModel (the whole
        model to its callers); the other ranks their stage, to `serve_stage`."""
        if self.first:
            return PipelineModel(model, self)
        return model

    # -- messages --

    def send(self, x: mx.array, dst: int) -> None:
        mx.eval(mx.distributed.send(x, dst, group=self.group))

    def recv(self, shape, dtype, src: int) -> mx.array:
        y = mx.distributed.recv(shape, dtype, src, group=self.group)
        mx.eval(y)
        return y

    def send_header(self, op: int, shape=(0, 0), dtype=mx.float32) -> None:
        self.send(mx.array([op, shape[0], shape[1], DTYPES.index(dtype)], mx.int32), self.next)

    def send_text(self, text: str, dst: int) -> None:
        data = np.frombuffer(text.encode(), dtype=np.uint8)
        self.send(mx.array([data.size], mx.int32), dst)
        if data.size:
            self.send(mx.array(data), dst)

    def recv_text(self, src: int) -> str:
        (n,) = self.recv((1,), mx.int32, src).tolist()
        return bytes(np.array(self.recv((n,), mx.uint8, src))).decode() if n else ""

    @contextmanager
    def deadline(self, what: str, seconds: float | None = None):
        """Exit this process with one line if `what` takes longer than the deadline: a rank
        blocked on a peer that is alive but silent would otherwise wait forever."""
        seconds = self.timeout_s if seconds is None else seconds

        def expire():
            sys.stderr.write(
                f"error: pipeline rank {self.rank}: {what}: no answer in {seconds:g} s\n"
            )
            sys.stderr.flush()
            os._exit(3)

        timer = threading.Timer(seconds, expire)
        timer.daemon = True
        timer.start()
        try:
            yield
        except RuntimeError as e:  # MLX's "[ring] connection to a peer was lost"
            raise PipelineError(f"pipeline rank {self.rank}: {what}: {_first_line(e)}") from None
        finally:
            timer.cancel()


def init(backend: str = "any"):
    """The distributed group of this process (a group of one outside mlx.launch)."""
    if not mx.distributed.is_available():
        raise PipelineError("this MLX build has no distributed backend")
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.isfile(hostfile) and not open(hostfile).read().strip():
        # `mlx.launch -n 1` writes an empty hostfile, which the ring backend cannot parse
        del os.environ["MLX_HOSTFILE"]
    try:
        return mx.distributed.init(backend=backend)
    except RuntimeError as e:
        raise PipelineError(f"pipeline: mx.distributed.init: {_first_line(e)}") from None


def restrict_manifest(manifest, moe_layers: list[int]):
    """The manifest of only `moe_layers`' records (same file and offsets)."""
    pos = [manifest.layer_position(l) for l in moe_layers]
    return dataclasses.replace(
        manifest,
        moe_layers=list(moe_layers),
        offsets=[manifest.offsets[p] for p in pos],
        checksums=[manifest.checksums[p] for p in pos],
        layer_layouts=(
            None if manifest.layer_layouts is None else [manifest.layer_layouts[p] for p in pos]
        ),
    )


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _run_stage(model, h: mx.array, cache) -> mx.array:
    """This rank's layers on `h` (token ids on rank 0, the hidden state elsewhere)."""
    return model.model(h, cache)


# ---- rank 0 ------------------------------------------------------------------------------------


class PipelineModel:
    """Rank 0's view of the pipelined model: called like the model (tokens, cache -> logits),
    it runs rank 0's layers, sends the hidden state round the ring and applies the head to
    what comes back. Everything else (args, expert_cache, runtime, ...) is rank 0's model's."""

    def __init__(self, model, pipe: Pipeline):
        self.__dict__["model"] = model
        self.__dict__["pipe"] = pipe
        inner = model.model
        self.__dict__["final_norm"] = inner.norm
        inner.norm = Passthrough()
        tied = getattr(model.args, "tie_word_embeddings", False)
        self.__dict__["head"] = inner.embed_tokens.as_linear if tied else model.lm_head
        # each rank runs the per-layer handshake; rank 0's tokens go round the ring
        self.__dict__["decoder"] = SyncDecoder(self, model.expert_cache)
        self.__dict__["closed"] = False

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __setattr__(self, name, value):
        setattr(self.__dict__["model"], name, value)

    def decoding(self) -> SyncDecoder:
        """The decoder for the next generation (strata_mlx.runtime.model)."""
        return self.decoder

    def make_cache(self) -> list:
        pipe = self.pipe
        if pipe.size > 1:
            with pipe.deadline("starting a sequence"):
                pipe.send_header(RESET)
        return self.model.make_cache()

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        pipe = self.pipe
        if cache is None:
            cache = self.make_cache()
        t = time.perf_counter()
        h = _run_stage(self.model, inputs, cache)
        if pipe.size > 1:
            with pipe.deadline(f"a {inputs.shape[1]}-token step"):
                mx.eval(h)
                pipe.stage_s += time.perf_counter() - t
                pipe.send_header(FORWARD, h.shape[:2], h.dtype)
                pipe.send(h, pipe.next)
                h = pipe.recv(h.shape, h.dtype, pipe.prev)
        return self.head(self.final_norm(h))

    def rank_stats(self) -> list[dict]:
        """Every rank's layers and expert-cache totals, rank 0's first."""
        pipe = self.pipe
        rows = [stage_report(self.model, pipe)]
        if pipe.size > 1:
            with pipe.deadline("gathering statistics"):
                pipe.send_header(STATS)
                pipe.send_text(json.dumps(rows), pipe.next)
                rows = json.loads(pipe.recv_text(pipe.prev))
        return rows

    def close(self) -> None:
        """Tell the other ranks to exit, and wait until the last one has."""
        pipe = self.pipe
        if self.closed:
            return
        self.__dict__["closed"] = True
        if pipe.size > 1:
            with pipe.deadline("stopping"):
                pipe.send_header(STOP)
                pipe.recv((1,), mx.int32, pipe.prev)

    def wait_ready(self) -> list[dict]:
        """Block until every rank has loaded (their statistics prove it)."""
        pipe = self.pipe
        with pipe.deadline("waiting for the other ranks to load", pipe.load_timeout_s):
            if pipe.size > 1:
                pipe.send_header(STATS)
                pipe.send_text(json.dumps([stage_report(self.model, pipe)]), pipe.next)
                return json.loads(pipe.recv_text(pipe.prev))
        return [stage_report(self.model, pipe)]


def stage_report(model, pipe: Pipeline) -> dict:
    """One rank's line of the closing statistics, as plain JSON values."""
    cache = model.expert_cache
    own = pipe.split[pipe.rank]
    resident = sorted({layer for layer, _ in cache.arena.slot_of})
    return {
        "rank": pipe.rank,
        "layers": [own.start, own.stop],
        "moe_layers": list(cache.layers),
        "resident_layers": resident,  # the layers whose experts this rank's arena holds
        "arena_slots": cache.arena.n_slots,
        "stats": dataclasses.asdict(cache.stats),
        "stage_s": pipe.stage_s,
    }


def rank_lines(rows: list[dict]) -> list[str]:
    """The closing lines, one per rank."""
    from .experts import ExpertStats

    out = []
    for row in rows:
        s = ExpertStats(**row["stats"])
        a, b = row["layers"]
        out.append(
            f"Rank {row['rank']}: layers {a}-{b - 1}, {row['arena_slots']} slots, hit rate "
            f"{100 * s.hit_rate:.1f}% (misses {s.miss_pct:.1f}%), {s.experts_read} read, "
            f"{s.gb_read:.3f} GB, exposed wait {s.exposed_wait_s * 1e3:.0f} ms"
        )
    return out


def rank_figures(before: list[dict], after: list[dict], wall_s: float) -> list[dict]:
    """`bench --pipeline`: each rank's share of one run, from `rank_stats()` taken before
    and after it; GB/s is the rank's bytes over the run's wall time."""
    from .experts import ExpertStats

    out = []
    for b, a in zip(before, after):
        s = ExpertStats(**a["stats"]).minus(ExpertStats(**b["stats"]))
        out.append(
            {
                "rank": a["rank"],
                "layers": a["layers"],
                "moe_layers": a["moe_layers"],
                "lookups": s.lookups,
                "hits": s.hits,
                "streamed_ahead": s.streamed_ahead,
                "misses": s.misses,
                "experts_read": s.experts_read,
                "gb_read": s.gb_read,
                "gb_per_s": s.gb_read / wall_s if wall_s > 0 else 0.0,
                "exposed_wait_ms": s.exposed_wait_s * 1e3,
                "stage_ms": (a["stage_s"] - b["stage_s"]) * 1e3,
            }
        )
    return out


def rank_figure_line(f: dict) -> str:
    a, b = f["layers"]
    return (
        f"    rank {f['rank']}: layers {a}-{b - 1}, lookups {f['lookups']} (hits {f['hits']}, "
        f"ahead {f['streamed_ahead']}, misses {f['misses']}), read {f['experts_read']} "
        f"{f['gb_read']:.3f} GB {f['gb_per_s']:.2f} GB/s, wait {f['exposed_wait_ms']:.0f} ms, "
        f"in its layers {f['stage_ms']:.0f} ms"
    )


def serve_loads(path, configs: list, make_pipeline, before_load=None) -> None:
    """A rank other than 0 under `bench --pipeline`: load the store once for each of
    `configs`, in rank 0's order, and serve each model until rank 0 closes it."""
    from .loader import load_model

    for cfg in configs:
        if before_load is not None and not cfg.fake_stream:
            before_load()
        model = load_model(path, config=cfg, pipeline=make_pipeline())
        serve_stage(model)


# ---- the other ranks ---------------------------------------------------------------------------


def serve_stage(model) -> None:
    """Serve rank 0's requests until it says stop: run this rank's layers on each hidden
    state that arrives and pass it on. Idle waits have no deadline (rank 0 may sit in a
    server); a step that has begun does."""
    pipe: Pipeline = model.pipeline
    cache = model.make_cache()
    while True:
        try:
            header = pipe.recv((4,), mx.int32, pipe.prev)
        except RuntimeError as e:
            raise PipelineError(
                f"pipeline rank {pipe.rank}: waiting for rank {pipe.prev}: {_first_line(e)}"
            ) from None
        op, b, length, dt = header.tolist()
        with pipe.deadline(f"op {op} from rank {pipe.prev}"):
            if not pipe.last:
                pipe.send(header, pipe.next)
            if op == FORWARD:
                h = pipe.recv((b, length, pipe.hidden_size), DTYPES[dt], pipe.prev)
                t = time.perf_counter()
                h = _run_stage(model, h, cache)
                mx.eval(h)
                pipe.stage_s += time.perf_counter() - t
                pipe.send(h, pipe.next)
            elif op == RESET:
                cache = model.make_cache()
            elif op == STATS:
                rows = json.loads(pipe.recv_text(pipe.prev))
                rows.append(stage_report(model, pipe))
                pipe.send_text(json.dumps(rows), pipe.next)
            elif op == STOP:
                if pipe.last:
                    pipe.send(mx.array([0], mx.int32), pipe.next)
                break
            else:
                raise PipelineError(f"pipeline rank {pipe.rank}: unknown op {op}")
    model.expert_cache.close()
