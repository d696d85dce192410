"""The expert cache: the per-layer handshake behind every MoE layer's seam.

A family's `SwitchGLU(layer)` (strata_mlx.models.switch) asks the ExpertCache, its expert
source, "make these experts resident, give me their slots"; the cache computes the layer's
experts from the slots; nothing indexes a stacked tensor of every expert.

The handshake, per MoE layer:
  1. one host sync reads the routing ids (and, with lookahead, layer l+1's predicted ids,
     computed inside the same graph);
  2. queued read-ahead of this layer that it turns out not to need is dropped;
  3. non-resident ids become urgent misses (read-ahead already in flight is promoted);
  4. lookahead submits every predicted, non-resident expert of layer l+1 as read-ahead;
  5. the computation waits only for this layer's experts; that wait is the exposed wait;
  6. the slots are pinned until the next handshake, whose sync proves this layer's compute done.

A forward's output must be evaluated before the next forward starts (as every generation loop
does): the last layer's slots are released at the next forward's first handshake, or when a
generation or its decode starts (`idle`).

Results never depend on which slot holds an expert: the records of the layer's distinct
experts are gathered in expert-id order and computed as one batch, so every arena size,
policy and slot placement gives bit-identical outputs. When a layer needs more experts than
the arena has slots, it runs in expert-major groups, each the same batch computation with
only the group's rows kept.

The cache is the only thing that talks to the disk during generation.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import OptionError
from ..format.store import Manifest
from ..models.switch import SwitchGLU
from ..stream.arena import Arena
from ..stream.gate import GateTable
from ..stream.prediction import Predictor, ReadAhead
from ..stream.scheduler import CLOSED, ExpertReadError, make_scheduler
from ..stream.stats import ExpertStats, RoutingTrace
from .compute import LayerCompute
from .deferred import (
    Deferred,
    DeferredHandshake,
    as_ints,
    distinct,
    host_ids,
    ints_as_host,
    joint_ids,
    token_ids,
)
from .threads import last_on_thread

WARM_BATCH = 256  # warm()'s reads between progress updates
WARM_BAR_DELAY_S = 2.0  # warm() shows its bar only past this

__all__ = ["ExpertCache", "ExpertReadError", "ExpertStats", "RoutingTrace", "SwitchGLU"]


def device_gate_available() -> bool:
    """Whether gated decode's gate can wait on the device: MLX computes on a CUDA GPU
    (custom_kernels/gate.py); STRATA_MLX_GATE=host keeps it on the host there too."""
    if os.environ.get("STRATA_MLX_GATE", "device") == "host":
        return False
    if not (mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()):
        return False
    from custom_kernels.gate import timeout_ms

    try:
        timeout_ms()  # its environment variable checked before a decode needs it
    except ValueError as e:
        raise OptionError(str(e)) from None
    return True


def _close_dropped(sched) -> None:
    """Close the scheduler of a cache collected without close() (a script loading models in a
    loop), which would otherwise keep the loop's thread, the reader's threads and files and,
    through them, the arena. On a thread of its own: the collection may run on the loop's
    thread, which cannot join itself, or inside the scheduler's lock."""
    threading.Thread(
        target=last_on_thread, args=(sched.close,), name="strata-mlx-close", daemon=True
    ).start()


def closed_when_dropped(cache) -> weakref.finalize:
    """`cache`'s scheduler closed on a thread of its own once the cache is collected without
    close() (_close_dropped); close() detaches it: such a thread still running at exit races
    MLX's teardown ("terminate called without an active exception")."""
    dropped = weakref.finalize(cache, _close_dropped, cache.sched)
    dropped.atexit = False
    return dropped


def _ranked(
    predictor: Predictor, targets, preds, nxt, trace, pred_ids=None
) -> list[tuple[int, list[int]]]:
    """(target, its predicted experts ranked) of each lookahead router's ids in `preds`;
    decode's single token ranked from ints (`pred_ids`: those ints, read with the layer's
    own). `trace` records the prediction for `nxt`."""
    if pred_ids is not None:
        for target, ids, pred in zip(targets, pred_ids, preds):
            if trace is not None and target == nxt:
                trace.record_prediction(nxt, ints_as_host(ids, pred))
        return [(t, predictor.rank(ids)) for t, ids in zip(targets, pred_ids)]
    ranked = []
    for target, pred in zip(targets, preds):
        if trace is not None and target == nxt:
            trace.record_prediction(nxt, host_ids(pred))
        one = token_ids(pred)
        ranked.append((target, predictor.rank(host_ids(pred) if one is None else one)))
    return ranked


def tell_words(sched, decoding: bool) -> None:
    """With a gate table: whether the driver stores read-ahead's ready words as their copies
    land (Reader.words_by_driver): inside decode steps, where a gate may wait for one; in
    prefill's phase only with the table's `prefill_by_driver` (otherwise the reader's thread
    does, after waiting for the copy: the prompt's last token, in prefill's phase and maybe
    gated, may wait a read longer for one); and how long a held copy waits before it gives
    its gate up (Reader.copy_held_us): the table's `copy_held_us` inside decode steps, never
    in prefill, whose long kernels may hold a copy for a while without any gate waiting."""
    gate = sched.residency.gate
    if gate is None:
        return
    try:
        reader = sched.reader
    except RuntimeError:  # closed (on another thread, maybe): nothing reads any more
        return
    if reader is not None:
        reader.words_by_driver = decoding or gate.prefill_by_driver
        reader.copy_held_us = gate.copy_held_us if decoding else 0


def warm_arena(sched, layers: list[int], num_experts: int) -> None:
    """ExpertCache.warm: `layers`' experts read into `sched`'s free arena slots, in order,
    until none is left; the statistics start afresh after them."""
    arena = sched.arena
    free = arena.n_slots - len(arena.slot_of)
    keys = [
        (layer, e)
        for layer in layers
        for e in range(num_experts)
        if (layer, e) not in arena.slot_of
    ][: max(free, 0)]
    from tqdm import tqdm

    # A bar on stderr, shown only when the reads outlast WARM_BAR_DELAY_S (a whole store on a
    # slow drive takes minutes). Batches keep the queue full between updates.
    with tqdm(
        total=len(keys), desc="warm", unit="expert", delay=WARM_BAR_DELAY_S, leave=False
    ) as bar:
        for i in range(0, len(keys), WARM_BATCH):
            batch = keys[i : i + WARM_BATCH]
            sched.ensure(batch)
            # Completions are collected as they come (a wait on all 24 K tags at once rescans
            # every tag at each completion: minutes for a whole 24 GB store on the H200).
            sched.drain()
            bar.update(len(batch))
    with sched.lock:
        sched.stats = ExpertStats()
        sched.prefetched.clear()


def _route_sync(inds: mx.array, x: mx.array, preds: list[mx.array], join: bool):
    """Evaluate a layer's ids, its input and lookahead's predicted ids (the route sync).
    With `join`, decode's one token's ids and predicted ids are evaluated as one array
    (`joint_ids`), returned for `_as_ints`; else None. x is evaluated with the ids: the ids
    alone need not depend on the previous layer's expert output (a router can ignore x),
    and only x proves that computation done."""
    joint = joint_ids(inds, preds) if join else None
    mx.eval(*((inds, x, *preds) if joint is None else (joint, x)))
    return joint


class PrefillStopped(Exception):
    """A prefill forward stopped at a MoE layer by its `stoppable` check: the KV caches it
    was extending hold part of a chunk, to be dropped."""


@contextmanager
def stoppable(cache: ExpertCache, check: Callable[[], bool] | None):
    """Within: a prefill forward through `cache` raises PrefillStopped at its next MoE layer
    once `check()` is true (a server's client gone: one prompt chunk can take seconds on a
    GPU, minutes on a CPU). Decode steps are never stopped here: they end between tokens."""
    before, cache.stop_check = cache.stop_check, check
    try:
        yield
    finally:
        cache.stop_check = before


class ExpertCache:
    """The handshake of every MoE layer of one model, over its scheduler (reads, residency,
    statistics: strata_mlx.stream.scheduler) and its predictor (strata_mlx.stream.prediction)."""

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
        scheduler: str = "loop",
        loop: dict | None = None,
        route_bonus: float = 0.0,
        dump: Callable | None = None,
        trace: RoutingTrace | None = None,
        gate: bool = False,
    ):
        """`loop`: the loop scheduler's options (scheduler.LoopScheduler). `route_bonus`:
        cache-aware routing, a bonus on resident experts' router logits in decode (0:
        exact). `dump(layer, x, ids, scores, y)` gets every MoE layer's state (--dump-moe);
        `trace` records routing and lookahead's predictions. `gate`: a gate table for gated
        decode (DeferredHandshake.run_gated; device_gate_available)."""
        self.store = Path(store)
        self.manifest = manifest
        self.layout = manifest.layout
        self.arena = arena
        self.read_ahead = read_ahead or ReadAhead()
        self.verify = verify
        self.fake_stream = fake_stream  # every expert counts as resident: times compute alone
        self.layers = list(manifest.moe_layers)
        self._next = dict(zip(self.layers, self.layers[1:]))  # the last layer has none
        self.predictor = Predictor(self.read_ahead, manifest, profile)
        if reader is None:
            scheduler = "sync"  # nothing to read: no loop to run
        gate = gate and reader is not None and not fake_stream
        device_gate = gate and device_gate_available()
        self.sched = make_scheduler(
            scheduler,
            store,
            manifest,
            arena,
            reader,
            verify,
            loop=loop,
        )
        if gate:
            self.sched.residency.gate = GateTable(manifest, device=device_gate, reader=reader)
        self._dropped = closed_when_dropped(self)
        self.trace, self.route_bonus, self.dump = trace, route_bonus, dump
        # inside `phase(decoding=True)`: generation's decode steps (`gating`: a gate may wait)
        self.decoding = self.gating = False
        self.compute = LayerCompute(manifest, arena, self.sched, fake_stream)
        # Every expert fits at once: eviction never happens, so uses need not be recorded.
        all_fit = arena.n_slots >= manifest.num_experts * len(self.layers)
        self.pipelined = DeferredHandshake(
            self.sched, self.predictor, self.compute, self.layers, all_fit, weakref.ref(self)
        )
        # A batched token step (strata_mlx.generation.batch) sets this (`gathering`): each
        # sequence's MoE layer is handed to it, which runs the layer once for every sequence.
        self.gather: Callable[[int, mx.array, mx.array], mx.array] | None = None
        self.stop_check: Callable[[], bool] | None = None  # (see `stoppable`)

    # ---- public ----------------------------------------------------------------------

    @contextmanager
    def gathering(self, gather: Callable[[int, mx.array, mx.array], mx.array] | None):
        """Within: run_layer hands each MoE layer to `gather` (None: runs it here), and
        restores the one before on the way out."""
        before, self.gather = self.gather, gather
        try:
            yield
        finally:
            self.gather = before

    @property
    def stats(self) -> ExpertStats:
        return self.sched.stats

    @stats.setter
    def stats(self, value: ExpertStats) -> None:
        self.sched.stats = value

    @property
    def reader(self):
        return self.sched.reader

    @reader.setter
    def reader(self, value) -> None:
        self.sched.reader = value

    @property
    def decode_layer_miss_rate(self) -> float:
        return self.predictor.decode_layer_miss_rate

    @property
    def routers(self) -> dict:
        return self.predictor.routers

    def register_router(self, layer: int, route: Callable[[mx.array], mx.array]) -> None:
        """`route(x) -> top-k ids` of `layer`, used to predict that layer from those before."""
        self.predictor.register_router(layer, route)

    def resident_mask(self, layer: int) -> mx.array:
        """[num_experts] float: 1 where the expert of `layer` is resident (cache-aware routing)."""
        return mx.array((self.sched.row(layer) >= 0).astype(np.float32))

    def warm(self) -> None:
        """Read every expert that fits, layer by layer (a fully resident run when it all fits)."""
        warm_arena(self.sched, self.layers, self.manifest.num_experts)

    @contextmanager
    def phase(self, decoding: bool, gating: bool | None = None):
        """The block run as decode steps (prediction rule, miss rates, cache-aware routing) or
        prefill, then the phase before; `gating` (default `decoding`): a gate may wait inside
        (`tell_words`). The gate table stays mapped; an error leaving it abandons queued gates."""
        before, self.decoding = self.decoding, decoding
        gated_before, self.gating = self.gating, decoding if gating is None else gating
        with self.sched.lock:  # the eviction policy is told (its optional `phase` hook)
            self.arena.set_phase(decoding)
        tell_words(self.sched, self.gating)
        gate = self.sched.residency.gate
        try:
            with gate.in_use() if gate is not None else nullcontext():
                yield
        except GeneratorExit:
            raise
        except BaseException:
            if gate is not None:
                self.pipelined.checks.cancel()  # none may submit a read after it
                self.sched.drop_watches()  # nor the reader's own
                gate.abandon()
            raise
        finally:
            self.decoding, self.gating = before, gated_before
            with self.sched.lock:
                self.arena.set_phase(before)
            tell_words(self.sched, gated_before)

    async def prefetch(self, layer: int, experts) -> None:
        """Read `experts` of `layer` as read-ahead and return once they are resident (for
        research scripts: `await cache.prefetch(3, [0, 5])`)."""
        tags = self.sched.read_ahead(layer, [int(e) for e in experts])
        await asyncio.to_thread(self.sched.wait, tags)

    @contextmanager
    def dumping(self, dump: Callable) -> Iterator[None]:
        """Hand every MoE layer's state to `dump` inside the block (research scripts that
        look at one forward), then to the hook the cache was built with again."""
        kept, self.dump = self.dump, dump
        try:
            yield
        finally:
            self.dump = kept

    def stop_trace(self) -> None:
        """Record no more routing (a bench keeps the cold run's trace only)."""
        self.trace = None

    def close(self) -> None:
        """Stop the scheduler and its reader. Idempotent; a layer run after it (a generation
        abandoned mid-stream and resumed, or one running on another thread) raises
        RuntimeError("expert cache is closed"), even where every expert it needs is resident."""
        self._dropped.detach()  # (no closing thread once collected: closed_when_dropped)
        self.pipelined.checks.close()
        self.sched.close()

    def idle(self) -> None:
        """Nothing is computing on the device and nothing built awaits a check (a generation
        starts, or its decode does): what earlier forwards left goes. Busy layers and pinned
        slots would only narrow eviction and read-ahead; read-ahead tags kept for a layer not
        built yet would make it wait for another token's prediction."""
        self.settle()
        self.pipelined.ahead_tags.clear()
        self.sched.release_reserve()  # (prefill gets every slot)
        if self.sched.residency.gate is not None:
            self.pipelined.checks.reset()  # a failed check's error, never raised, goes
            self.sched.residency.gate.reset()  # words a token abandoned by an error left

    # ---- the handshake -----------------------------------------------------------------

    def run_layer(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        """Experts of `layer` for x [..., D] routed to inds [..., k] -> [..., k, D]."""
        if self.gather is not None:
            return self.gather(layer, x, inds)
        if self.stop_check is not None and not self.decoding and self.stop_check():
            raise PrefillStopped(f"prefill stopped at layer {layer}")
        if self.sched.closed:
            raise RuntimeError(CLOSED)
        if self.pipelined.records is not None:
            return self.pipelined.run(layer, x, inds)
        st, sched, pr = self.stats, self.sched, self.predictor
        observed, self.pipelined.observed = self.pipelined.observed, None
        nxt = self._next.get(layer)
        # Lookahead predicts the next `depth` layers, each through its own router on this
        # layer's input; the nearest first.
        targets = [] if self.fake_stream else pr.targets(layer, self.decoding)
        t0 = time.perf_counter()
        preds = [pr.routers[t](x) for t in targets]
        joint = _route_sync(inds, x, preds, self.trace is None)
        t1 = time.perf_counter()
        st.route_sync_s += t1 - t0
        one, pred_ids = as_ints(joint, inds, preds)  # decode's one token: pair by pair below
        slow = one is None or self.trace is not None or self.fake_stream
        ids = host_ids(inds) if slow else None
        if self.trace is not None:
            self.trace.record(layer, ids)
        needed = distinct(ids) if one is None else sorted(set(one))
        # The sync above evaluated everything up to this router, so the last layer's compute
        # (which read its pinned slots) is done: its slots may be reused from here on.
        with sched.lock:
            self.arena.unpin_all()
            self.arena.set_layer(layer)
        st.lookups += len(needed)

        if self.fake_stream:
            return self.compute.fake(layer, x, inds, ids, needed)

        sched.collect(block=False)
        sched.drop_unneeded(layer, needed)
        if len(needed) > self.arena.n_slots:
            st.host_s += time.perf_counter() - t1
            return self.compute.groups(layer, x, inds, host_ids(inds), needed)

        waits = self.claim(layer, needed, observe=observed != layer)
        late = bool(targets) and self.read_ahead.after_experts
        if not late:
            self.predict(targets, preds, nxt, layer, needed, pred_ids)
        t2 = time.perf_counter()
        sched.wait(waits)
        t3 = time.perf_counter()
        st.exposed_wait_s += t3 - t2
        if not late and (after := pr.after_wait(layer, nxt, len(needed))) is not None:
            sched.read_ahead(*after)
        row = sched.row(layer)
        if one is not None:
            y = self.compute.one_token(layer, x, inds, [row.item(e) for e in one])
        else:
            y = self.compute.by_expert(layer, x, ids, inds.shape, needed, row[needed])
        if late:  # the device computes them while the host predicts (their slots are pinned)
            mx.async_eval(y)
            self.predict(targets, preds, nxt, layer, needed, pred_ids)
            if (after := pr.after_wait(layer, nxt, len(needed))) is not None:
                sched.read_ahead(*after)
        st.host_s += (t2 - t1) + (time.perf_counter() - t3)
        return y

    def claim(self, layer: int, needed: list[int], observe: bool = True) -> list[int]:
        """`layer`'s `needed` experts claimed (Scheduler.claim: hits counted, misses
        submitted, all pinned); in decode, with `observe`, the share that missed feeds the
        mode rule. The tags their computation waits for."""
        st = self.stats
        before = st.misses
        waits = self.sched.claim(layer, needed)
        if self.decoding and observe:
            self.predictor.observe_decode_layer((st.misses - before) / len(needed))
        return waits

    def predict(
        self, targets: list[int], preds: list[mx.array], nxt: int | None, layer, needed, pred_ids
    ) -> None:
        """Submit the next layer's predicted experts (`preds`, or as ints `pred_ids`);
        reserve those of the layers after it."""
        self.predictor.observe_use(layer, needed, self.decoding)
        if not targets:
            return
        ranked = _ranked(self.predictor, targets, preds, nxt, self.trace, pred_ids)
        (first, experts), later = ranked[0], ranked[1:]
        keys = [(t, e) for t, es in later for e in es]
        predicted = set(keys)  # the same tuples, not built again (~1000 a prefill layer)
        predicted.update([(first, e) for e in experts])
        with self.arena.scored(self.predictor.ahead_bar(first, experts, self.decoding)):
            self.sched.predicted(first, experts, keys, predicted)

    # ---- the deferred handshake (pipelined decode: strata_mlx.runtime.deferred) --------

    def plan_pipelined_lookahead(self, distance: int) -> None:
        """Pipelined decode checks layer l while `distance - 1` later layers are already
        built: a prediction made from l's input can only help layer l + distance."""
        self.pipelined.plan_lookahead(distance)

    def predicts_in_decode(self) -> bool:
        """Whether decode lookahead predicts for the next token."""
        return self.pipelined.predicts_in_decode()

    def check_deferred(self, d: Deferred, alone: bool = True) -> bool:
        """Wait for layer `d.layer`'s routing (only it: later layers keep computing) and say
        whether every expert it chose was resident when its computation was built. `alone`:
        nothing is in flight beyond this token's own later layers (no token built on top)."""
        return self.pipelined.check(d, alone, self.trace)

    def settle(self, keep: int | None = None) -> None:
        """The device finished everything built so far (the decoder drained or the token
        is evaluated): no slot is in use, neither a handshake's pins nor a pipelined layer's
        (but `keep`'s, about to be recomputed)."""
        self.pipelined.checks.drain()  # (none of them pins a slot after this)
        self.sched.settle(keep)
