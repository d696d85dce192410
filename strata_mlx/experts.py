"""The seam between model modules and the expert cache, and the per-layer handshake.

Model files hold a `SwitchGLU(layer)` where mlx-lm holds a stacked all-experts SwitchGLU. It
asks the ExpertCache "make these experts resident, give me their slots" and computes from
the slots; nothing indexes a stacked tensor of every expert.

The handshake, per MoE layer (SPEC mechanisms 4 and 5):
  1. one host sync reads the routing ids (and, with lookahead, layer l+1's predicted ids,
     computed inside the same graph);
  2. queued read-ahead of this layer that it turns out not to need is dropped;
  3. non-resident ids become urgent misses (read-ahead already in flight is promoted);
  4. lookahead submits every predicted, non-resident expert of layer l+1 as read-ahead;
  5. the computation waits only for this layer's experts; that wait is the exposed wait;
  6. the slots are pinned until the next handshake, whose sync proves this layer's compute done.

A forward's output must be evaluated before the next forward starts (as every generation loop
does): the last layer's slots are released at the next forward's first handshake.

Results never depend on which slot holds an expert: the records of the layer's distinct
experts are gathered in expert-id order and computed as one batch, so every arena size,
policy and slot placement gives bit-identical outputs. When a layer needs more experts than
the arena has slots, it runs in expert-major groups, each the same batch computation with
only the group's rows kept.

The cache is the only thing that talks to the disk during generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import kernels
from .arena import Arena, Key
from .prediction import ReadAhead, profile_rank, rank_by_tokens
from .reader import CHECKSUM_MISMATCH, SHORT_READ, error_message
from .store import EXPERTS, Manifest, StoreError


class ExpertReadError(StoreError):
    """An expert record could not be read or failed its checksum."""


@dataclass
class ExpertStats:
    """Counters for one chunk, one generation, or a whole session (they add up)."""

    lookups: int = 0  # (layer, expert) pairs a layer needed
    hits: int = 0  # already resident, not brought in by read-ahead for this use
    streamed_ahead: int = 0  # brought in (or in flight) by read-ahead before the layer asked
    misses: int = 0  # urgent reads the computation waited for
    experts_read: int = 0  # completed reads, urgent and read-ahead
    readahead_submitted: int = 0
    readahead_dropped: int = 0  # queued read-ahead cancelled before it started
    wasted_readahead: int = 0  # read-ahead completed and evicted, or dropped later, unused
    bytes_read: int = 0
    exposed_wait_s: float = 0.0  # time the computation waited on reads
    route_sync_s: float = 0.0  # time spent in the per-layer host sync (includes compute)
    host_s: float = 0.0  # Python time in the handshake, outside syncs and waits
    groups: int = 0  # expert-major groups run (layers whose experts exceeded the arena)
    recomputed_layers: int = 0  # pipelined decode: layers run again after a miss
    compute_s: float = 0.0  # wall time of chunks minus exposed wait (filled by generate)
    wall_s: float = 0.0
    tokens: int = 0

    def add(self, other: ExpertStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def copy(self) -> ExpertStats:
        return ExpertStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def minus(self, other: ExpertStats) -> ExpertStats:
        return ExpertStats(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )

    @property
    def hit_rate(self) -> float:
        return (self.hits + self.streamed_ahead) / self.lookups if self.lookups else 1.0

    @property
    def miss_pct(self) -> float:
        return 100.0 * self.misses / self.lookups if self.lookups else 0.0

    @property
    def streamed_ahead_pct(self) -> float:
        return 100.0 * self.streamed_ahead / self.lookups if self.lookups else 0.0

    @property
    def gb_read(self) -> float:
        return self.bytes_read / 1e9

    @property
    def gb_per_s(self) -> float:
        return self.gb_read / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(
            hit_rate=self.hit_rate,
            miss_pct=self.miss_pct,
            streamed_ahead_pct=self.streamed_ahead_pct,
            gb_read=self.gb_read,
            gb_per_s=self.gb_per_s,
        )
        return d


@dataclass
class _Read:
    key: Key
    slot: int
    urgent: bool
    layer_wanted: bool = False  # a handshake asked for it while in flight


@dataclass
class Deferred:
    """A layer computed without a host sync, awaiting verification (strata_mlx.decode)."""

    layer: int
    inds: mx.array  # the routing ids, evaluated with the layer
    row: np.ndarray  # host copy of the residency row its slots were looked up in
    target: int | None = None  # lookahead: the layer predicted from this one's input
    pred: mx.array | None = None  # its predicted ids

    def outputs(self) -> list[mx.array]:
        return [self.inds] if self.pred is None else [self.inds, self.pred]


@dataclass
class RoutingTrace:
    """Routing decisions recorded for research: set `model.expert_cache.trace = RoutingTrace()`."""

    ids: dict[int, list[np.ndarray]] = field(default_factory=dict)  # layer -> per call [T, k]
    # lookahead: layer -> per call, the ids predicted for it from the previous layer's input
    predicted: dict[int, list[np.ndarray]] = field(default_factory=dict)

    def record(self, layer: int, ids: np.ndarray) -> None:
        self.ids.setdefault(layer, []).append(ids)

    def record_prediction(self, layer: int, ids: np.ndarray) -> None:
        self.predicted.setdefault(layer, []).append(ids)


class ExpertCache:
    """Residency, reads and statistics for every MoE layer of one model."""

    def __init__(
        self,
        store: str | Path,
        manifest: Manifest,
        arena: Arena,
        reader,
        read_ahead: ReadAhead | None = None,
        profile: np.ndarray | None = None,
        verify: bool = False,
        fake_stream: bool = False,
    ):
        self.store = Path(store)
        self.manifest = manifest
        self.layout = manifest.layout
        self.arena = arena
        self.reader = reader
        self.read_ahead = read_ahead or ReadAhead()
        self.profile = profile
        self.verify = verify
        self.fake_stream = fake_stream  # every expert counts as resident: times compute alone
        self.routers: dict[int, Callable[[mx.array], mx.array]] = {}
        self.layers = list(manifest.moe_layers)
        self._next = dict(zip(self.layers, self.layers[1:]))  # the last layer has none
        self._targets: dict[int, list[int]] = {}  # lookahead: layers predicted from each
        # With verify, the reader's threads check each record's checksum as it lands.
        checksum = manifest.checksum if verify else None
        path = str(self.store / EXPERTS)
        self._file = reader.open(path, checksum=checksum) if reader is not None else None
        self._reads: dict[int, _Read] = {}  # tag -> read in flight
        self._tag_of: dict[Key, int] = {}
        self._tags = 0
        self._prefetched: set[Key] = set()  # read-ahead landed, not used yet
        self.stats = ExpertStats()
        self.trace: RoutingTrace | None = None
        self.route_bonus = 0.0  # cache-aware routing (decode); 0 = exact
        self.decoding = False  # set by generation around decode steps
        self.decode_miss_rate = 1.0  # running average; starts high so decode predicts at first
        # Running fraction of decode layers that missed (pipelined decode's fallback rule)
        self.decode_layer_miss_rate = 0.0
        self._layer0_width = 0
        self.dump = None  # callable(layer, x, ids, scores, y) for --dump-moe
        # Kernels resolved once per layer: nothing on the hot path inspects a layout.
        self._kernel = {l: kernels.expert_kernel(manifest.layout_of(l)) for l in self.layers}
        # The residency map as the device sees it (pipelined decode, strata_mlx.decode):
        # per layer, expert -> slot, -1 where not resident. The host copy is kept current;
        # a layer's device row is rebuilt only when its residency changed.
        self._pos = {l: manifest.layer_position(l) for l in self.layers}
        self._table = np.full((len(self.layers), manifest.num_experts), -1, dtype=np.int32)
        self._rows: dict[int, tuple[np.ndarray, mx.array]] = {}
        self._dirty: set[int] = set(self.layers)
        # Every expert fits at once: eviction never happens, so uses need not be recorded.
        self._all_fit = arena.n_slots >= manifest.num_experts * len(self.layers)
        self.pipeline: list[Deferred] | None = None  # set by the pipelined decoder
        self.pipeline_lookahead = True  # whether its layers may predict (strata_mlx.decode)
        self._ahead: dict[int, int] = {}  # pipelined lookahead: layer -> layer it predicts
        self._ahead_tags: dict[int, list[int]] = {}  # read-ahead submitted for a layer
        self._in_flight: set[int] = set()  # layers built on the device, not yet complete
        self._pair_index: dict[tuple, mx.array] = {}

    # ---- public ----------------------------------------------------------------------

    def register_router(self, layer: int, route: Callable[[mx.array], mx.array]) -> None:
        """`route(x) -> top-k ids` of `layer`, used to predict that layer from those before."""
        self.routers[layer] = route
        depth = self.read_ahead.depth
        self._targets = {
            l: [t for t in self.layers[i + 1 : i + 1 + depth] if t in self.routers]
            for i, l in enumerate(self.layers)
        }

    def resident_mask(self, layer: int) -> mx.array:
        """[num_experts] float: 1 where the expert of `layer` is resident (cache-aware routing)."""
        return mx.array((self._table[self._pos[layer]] >= 0).astype(np.float32))

    def warm(self) -> None:
        """Read every expert that fits, layer by layer (a fully resident run when it all fits)."""
        free = self.arena.n_slots - len(self.arena.slot_of)
        keys = [
            (layer, e)
            for layer in self.layers
            for e in range(self.manifest.num_experts)
            if (layer, e) not in self.arena.slot_of
        ][: max(free, 0)]
        self._ensure(keys)
        # Completions are collected as they come (a wait on all 24 K tags at once rescans
        # every tag at each completion: minutes for a whole 24 GB store on the H200).
        while self._reads:
            self._collect(block=True)
        self.stats = ExpertStats()
        self._prefetched.clear()

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    # ---- the handshake -----------------------------------------------------------------

    def run_layer(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        """Experts of `layer` for x [..., D] routed to inds [..., k] -> [..., k, D]."""
        if self.pipeline is not None:
            return self._run_deferred(layer, x, inds)
        st = self.stats
        nxt = self._next.get(layer)
        predict = self.read_ahead.predicts and nxt in self.routers and not self.fake_stream
        if predict and self.decoding:
            predict = self.decode_miss_rate >= self.read_ahead.decode_min_miss
        # Lookahead predicts the next `depth` layers, each through its own router on this
        # layer's input; the nearest first.
        targets = self._targets[layer] if predict else []
        t0 = time.perf_counter()
        # x is evaluated with the ids: the ids alone need not depend on the previous layer's
        # expert output (a router can ignore x), and only x proves that computation done.
        preds = [self.routers[t](x) for t in targets]
        mx.eval(inds, x, *preds)
        t1 = time.perf_counter()
        st.route_sync_s += t1 - t0
        ids = np.array(inds).reshape(-1, inds.shape[-1])
        if self.trace is not None:
            self.trace.record(layer, ids)
        needed = np.unique(ids).tolist()
        # The sync above evaluated everything up to this router, so the last layer's compute
        # (which read its pinned slots) is done: its slots may be reused from here on.
        self.arena.unpin_all()
        self.arena.set_layer(layer)
        st.lookups += len(needed)

        if self.fake_stream:
            return self._compute_fake(layer, x, inds, ids, needed)

        self._collect(block=False)
        self._drop_unneeded(layer, set(needed))
        if len(needed) > self.arena.n_slots:
            st.host_s += time.perf_counter() - t1
            return self._run_groups(layer, x, inds, ids, needed)

        misses_before = st.misses
        waits = self._classify(layer, needed)
        if self.decoding:
            self._observe_decode_layer((st.misses - misses_before) / len(needed))
        for target, pred in zip(targets, preds):
            pred_ids = np.array(pred).reshape(-1, pred.shape[-1])
            if self.trace is not None and target == nxt:
                self.trace.record_prediction(nxt, pred_ids)
            self._submit_readahead(target, rank_by_tokens(pred_ids, self.read_ahead.min_tokens))
        t2 = time.perf_counter()
        self._wait(waits)
        t3 = time.perf_counter()
        st.exposed_wait_s += t3 - t2
        if self.read_ahead.policy == "static":
            target = self.layers[0] if nxt is None else nxt
            self._submit_readahead(target, self._profile_rank(target)[: self.read_ahead.static_cap])
        elif self.read_ahead.policy == "lookahead" and nxt is None:
            # The next forward's first layer has no router input yet: use the profile rank,
            # as wide as that layer was last time.
            first = self.layers[0]
            self._submit_readahead(first, self._profile_rank(first)[: max(self._layer0_width, 1)])
        if layer == self.layers[0]:
            self._layer0_width = len(needed)
        slots = self._table[self._pos[layer]][needed]
        y = self._compute(layer, x, ids, inds.shape, needed, slots)
        st.host_s += (t2 - t1) + (time.perf_counter() - t3)
        return y

    def _compute(self, layer, x, ids, shape, needed, slots) -> mx.array:
        local = np.searchsorted(np.asarray(needed), ids).astype(np.uint32).reshape(shape)
        slots = mx.array(np.asarray(slots, dtype=np.uint32))
        return self._kernel[layer](x, self.arena.rows, slots, mx.array(local))

    # ---- the deferred handshake (pipelined decode) -------------------------------------

    def _device_row(self, layer: int) -> tuple[np.ndarray, mx.array]:
        if layer in self._dirty:
            if self.fake_stream:  # every expert counts as resident, its bytes whatever is there
                row = np.arange(self.manifest.num_experts, dtype=np.int32) % self.arena.n_slots
                self._rows[layer] = (row, mx.array(row.astype(np.uint32)))
                self._dirty.discard(layer)
                return self._rows[layer]
            row = self._table[self._pos[layer]].copy()
            # Absent experts read slot 0: the result is discarded once the host sees the miss.
            self._rows[layer] = (row, mx.array(np.maximum(row, 0).astype(np.uint32)))
            self._dirty.discard(layer)
        return self._rows[layer]

    def plan_pipelined_lookahead(self, distance: int) -> None:
        """Pipelined decode checks layer l while `distance - 1` later layers are already
        built: a prediction made from l's input can only help layer l + distance."""
        self._ahead = {
            l: self.layers[i + distance]
            for i, l in enumerate(self.layers)
            if i + distance < len(self.layers) and self.layers[i + distance] in self.routers
        }

    def _run_deferred(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        """Experts computed with slots looked up on the device from this layer's residency
        row as it stands now; no host sync. The decoder verifies the layer later."""
        t = time.perf_counter()
        tags = self._ahead_tags.pop(layer, None)
        if tags:
            # Predicted reads for this layer still in flight: wait for them here, where the
            # device still has the layers before it to compute, rather than miss.
            t1 = time.perf_counter()
            self._wait(tags)
            self.stats.exposed_wait_s += time.perf_counter() - t1
        if self._reads:
            self._collect(block=False)  # landed read-ahead becomes visible to this layer
        row, row_mx = self._device_row(layer)
        slots = row_mx[inds.reshape(-1)]
        idx = self._pair_index.get(inds.shape)
        if idx is None:  # pair p reads slots[p]
            idx = mx.arange(inds.size, dtype=mx.uint32).reshape(inds.shape)
            self._pair_index[inds.shape] = idx
        y = self._kernel[layer](x, self.arena.rows, slots, idx)
        d = Deferred(layer, inds, row)
        target = self._ahead.get(layer)
        if target is not None and self.pipeline_lookahead and self._predicts_in_decode():
            d.target, d.pred = target, self.routers[target](x)
        self.pipeline.append(d)
        self._in_flight.add(layer)
        self.stats.host_s += time.perf_counter() - t
        return y

    def _observe_decode_layer(self, miss_rate: float) -> None:
        """Running averages over the last ~100 decode layers (the share of lookups that
        missed: whether decode predicts) and ~50 (the share of layers with a miss: whether
        pipelined decode falls back to the sync handshake)."""
        self.decode_miss_rate += 0.01 * (miss_rate - self.decode_miss_rate)
        missed = float(miss_rate > 0)
        self.decode_layer_miss_rate += 0.02 * (missed - self.decode_layer_miss_rate)

    def _predicts_in_decode(self) -> bool:
        return (
            self.read_ahead.predicts
            and not self.fake_stream
            and self.decode_miss_rate >= self.read_ahead.decode_min_miss
        )

    def settle(self) -> None:
        """The device finished everything built so far (the decoder drained or the token
        is evaluated): no layer's slots are in use."""
        self._in_flight.clear()

    def check_deferred(self, d: Deferred) -> bool:
        """Wait for layer `d.layer`'s routing (only it: later layers keep computing) and say
        whether every expert it chose was resident when its computation was built."""
        st = self.stats
        t0 = time.perf_counter()
        ids = np.array(d.inds).reshape(-1, d.inds.shape[-1])
        t1 = time.perf_counter()
        st.route_sync_s += t1 - t0
        # This layer's routing is known, so every layer before it has finished computing.
        self._in_flight = {l for l in self._in_flight if l >= d.layer}
        if (d.row[ids] < 0).any():
            return False
        needed = np.unique(ids)
        st.lookups += needed.size
        if self._prefetched or not self._all_fit:
            self._count_resident(d.layer, needed.tolist())
        else:
            st.hits += needed.size
        self._observe_decode_layer(0.0)
        if self.trace is not None:
            self.trace.record(d.layer, ids)
        if d.pred is not None:
            pred = np.array(d.pred).reshape(-1, d.pred.shape[-1])
            if self.trace is not None:
                self.trace.record_prediction(d.target, pred)
            ranked = rank_by_tokens(pred, self.read_ahead.min_tokens)
            # Slots of layers still computing on the device must not be refilled.
            tags = self._submit_readahead(d.target, ranked, protect=self._in_flight)
            if tags:
                self._ahead_tags[d.target] = tags
        st.host_s += time.perf_counter() - t1
        return True

    def _count_resident(self, layer: int, needed: list[int]) -> None:
        for e in needed:
            self._count_hit((layer, e))

    def _count_hit(self, key: Key) -> None:
        """A resident expert used: a hit, or read-ahead that paid off; recorded for eviction."""
        if key in self._prefetched:
            self._prefetched.discard(key)
            self.stats.streamed_ahead += 1
        else:
            self.stats.hits += 1
        self.arena.touch(key)

    def _compute_fake(self, layer, x, inds, ids, needed) -> mx.array:
        # Compute alone: the experts' bytes are whatever the first slots hold (zeros or stale
        # records), so outputs are meaningless but the work is the same.
        slots = [i % self.arena.n_slots for i in range(len(needed))]
        self.stats.hits += len(needed)
        return self._compute(layer, x, ids, inds.shape, needed, slots)

    def _run_groups(self, layer, x, inds, ids, needed) -> mx.array:
        """Expert-major groups: each group is made resident, computed with the full batch shape
        (absent experts' rows borrow a group member's record and are discarded), then evaluated
        so its slots can be reused. Each kept row is bit-identical to the one-pass result."""
        n = self.arena.n_slots
        y = None
        for g in range(0, len(needed), n):
            group = needed[g : g + n]
            self.stats.groups += 1
            waits = self._classify(layer, group)
            t = time.perf_counter()
            self._wait(waits)
            self.stats.exposed_wait_s += time.perf_counter() - t
            gslots = {e: self.arena.slot_of[(layer, e)] for e in group}
            self.arena.pin(gslots.values())
            filler = gslots[group[0]]
            slots = [gslots.get(e, filler) for e in needed]
            yg = self._compute(layer, x, ids, inds.shape, needed, slots)
            member = np.isin(ids, group).reshape(*inds.shape, 1)
            y = yg if y is None else mx.where(mx.array(member), yg, y)
            mx.eval(y)
            self.arena.unpin_all()
        return y

    # ---- residency and reads -----------------------------------------------------------

    def _classify(self, layer: int, needed: list[int]) -> list[int]:
        """Count hits / streamed-ahead / misses; submit misses urgently; tags to wait for."""
        st = self.stats
        waits, urgent = [], []
        for e in needed:
            key = (layer, e)
            tag = self._tag_of.get(key)
            if tag is not None:  # read-ahead in flight: promote it
                st.streamed_ahead += 1
                self._reads[tag].layer_wanted = True
                waits.append(tag)
                urgent.append(tag)
            elif self.arena.resident(key):
                self._count_hit(key)
            else:
                st.misses += 1
                waits.append(self._ensure([key], urgent=True)[0])
            # Pin as we go: a later miss of this same layer must not evict this one.
            self.arena.pin([self.arena.slot_of[key]])
        if urgent:
            self.reader.promote(urgent)
        return waits

    def _ensure(self, keys: list[Key], urgent: bool = True) -> list[int]:
        """Allocate slots and submit reads for keys; returns their tags."""
        reqs, tags = [], []
        for key in keys:
            slot = self.arena.allocate(key)
            while slot is None:
                # Every slot is pinned or mid-read: wait for a read to land, then retry.
                if not self._reads:
                    raise RuntimeError("arena exhausted: every slot is pinned")
                self._collect(block=True)
                slot = self.arena.allocate(key)
            self._evicted_check()
            reqs.append(self._start_read(key, slot, urgent))
            tags.append(reqs[-1][0])
        if reqs:
            self.reader.submit(reqs, urgent)
        return tags

    def _start_read(self, key: Key, slot: int, urgent: bool) -> tuple:
        """Record a read of `key` into `slot` as in flight; its request for the reader."""
        tag = self._tags = self._tags + 1
        off, expected = self.manifest.record(*key)
        self._reads[tag] = _Read(key, slot, urgent)
        self._tag_of[key] = tag
        expected = expected if self.verify else None
        return (tag, self._file, off, self.layout.record_bytes, self.arena.address(slot), expected)

    def _evicted_check(self) -> None:
        # A prefetched expert evicted before use was a wasted read.
        for key in self.arena.evicted:
            self._table[self._pos[key[0]], key[1]] = -1
            self._dirty.add(key[0])
            if key in self._prefetched:
                self._prefetched.discard(key)
                self.stats.wasted_readahead += 1
        self.arena.evicted.clear()

    def _submit_readahead(
        self, layer: int, ranked: list[int], protect: set[int] | None = None
    ) -> list[int]:
        """Read-ahead for `layer`'s experts in `ranked` order; no victim from a layer in
        `protect`. Returns the tags submitted."""
        keys = []
        for e in ranked:
            key = (layer, e)
            if key in self._tag_of or key in self.arena.slot_of:
                continue
            keys.append(key)
        reqs = []
        for key in keys:
            slot = self.arena.allocate(key, protect)
            if slot is None:
                break  # no slot that is not pinned or mid-read: the rest waits for demand
            reqs.append(self._start_read(key, slot, urgent=False))
        self._evicted_check()
        if reqs:
            self.stats.readahead_submitted += len(reqs)
            self.reader.submit(reqs, False)
        return [r[0] for r in reqs]

    def _drop_unneeded(self, layer: int, needed: set[int]) -> None:
        """Cancel this layer's queued read-ahead that its routing did not ask for."""
        stale = [
            t
            for t, r in self._reads.items()
            if not r.urgent and r.key[0] == layer and r.key[1] not in needed
        ]
        if not stale:
            return
        for tag in self.reader.cancel(stale):
            r = self._reads.pop(tag)
            del self._tag_of[r.key]
            self.arena.release(r.slot)
            self.stats.readahead_dropped += 1

    def _wait(self, tags: list[int]) -> None:
        pending = [t for t in tags if t in self._reads]
        if pending:
            self._finish(self.reader.wait(pending, None))

    def _collect(self, block: bool) -> None:
        if not self._reads:
            return
        self._finish(self.reader.wait(None, None) if block else self.reader.poll())

    def _finish(self, completions) -> None:
        errors = []
        for tag, err, nbytes in completions:
            r = self._reads.pop(tag, None)
            if r is None:
                continue
            del self._tag_of[r.key]
            if err or nbytes != self.layout.record_bytes:
                self.arena.release(r.slot)
                errors.append((r.key, err, nbytes))
                continue
            self.arena.loaded(r.slot)
            self._table[self._pos[r.key[0]], r.key[1]] = r.slot
            self._dirty.add(r.key[0])
            self.stats.experts_read += 1
            self.stats.bytes_read += nbytes
            if not r.urgent and not r.layer_wanted:
                self._prefetched.add(r.key)
        if errors:
            (layer, expert), err, nbytes = errors[0]
            path = self.store / EXPERTS
            if err == CHECKSUM_MISMATCH:  # verified by the reader's thread that read it
                why = f"checksum mismatch ({self.manifest.checksum}; corrupt record)"
            elif err == SHORT_READ or not err:
                why = f"short read ({nbytes} of {self.layout.record_bytes} bytes; truncated store?)"
            else:
                why = f"read failed: {error_message(err)} (errno {err})"
            raise ExpertReadError(f"{path}: layer {layer} expert {expert}: {why}")

    def _profile_rank(self, layer: int) -> list[int]:
        counts = None if self.profile is None else self.profile[self.manifest.layer_position(layer)]
        return profile_rank(counts, self.manifest.num_experts)


class SwitchGLU(nn.Module):
    """A layer's routed SwiGLU experts, held by the expert cache (the seam)."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer
        self.expert_cache: ExpertCache | None = None

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.expert_cache is None:
            raise RuntimeError("experts not attached: load the model with strata_mlx.load()")
        return self.expert_cache.run_layer(self.layer, x, indices)

    def route_bonus(self) -> mx.array | None:
        """Cache-aware routing: a bonus on resident experts' router logits, decode only."""
        c = self.expert_cache
        if c is None or not c.route_bonus or not c.decoding:
            return None
        return c.route_bonus * c.resident_mask(self.layer)

    def observe(self, x: mx.array, inds: mx.array, scores: mx.array, y: mx.array) -> None:
        """Hand the layer's MoE state to a dump hook (--dump-moe), if one is set."""
        c = self.expert_cache
        if c is not None and c.dump is not None:
            c.dump(self.layer, x, inds, scores, y)
