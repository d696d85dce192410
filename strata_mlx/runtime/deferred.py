"""The deferred handshake: MoE layers built without a host sync, their routing checked later.

Pipelined decode (strata_mlx.runtime.decode) builds a token's layers with each layer's expert
slots looked up on the device from its residency row as it stands, and checks each layer once
its routing is known: every chosen expert resident when the layer was built, or a miss whose
reads start at once. Owns the `Deferred` records, pipelined lookahead (a checked layer's
prediction for a later one) and the layers a read may not refill while they compute. A check
that passes is its layer's handshake: the eviction policy is told the layer runs, and the
read-ahead it predicts goes through the per-layer handshake's rule (Predictor.ahead_bar: the
policy told, the score's bar with --lookahead-score). Gated layers (`run_gated`,
`check_gated`) take their slots from the gate table instead, on the device where their
experts wait for their reads, and their check is the per-layer handshake without its wait.
Never recomputes a layer (the decoder does, through ExpertCache.run_layer) and never waits
for a miss (but the host's gate, where the device cannot).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from custom_kernels.gate import BOARD_IDS, LATE_WORDS, board, board_gate, gate, timeout_ms

from ..stream.gate import GateTable
from ..stream.prediction import Predictor
from ..stream.reader import wait_word
from ..stream.scheduler import CLOSED, Scheduler
from ..stream.stats import RoutingTrace
from .compute import LayerCompute
from .gate_checks import GateChecks


@dataclass
class Deferred:
    """A layer computed without a host sync, awaiting verification (strata_mlx.runtime.decode)."""

    layer: int
    inds: mx.array  # the routing ids, evaluated with the layer
    row: np.ndarray | None  # host copy of the residency row its slots were looked up in
    target: int | None = None  # lookahead: the layer predicted from this one's input
    pred: mx.array | None = None  # its predicted ids
    # gated (row None): its experts wait on the device for their reads (GATED below)
    gated: Gated | None = None
    # "token" mode: its ids as read from the token's joint routing (spread_routing), [T, k]
    # on the host; None: read from `inds` itself
    host: np.ndarray | None = None

    def outputs(self) -> list[mx.array]:
        g = self.gated
        if g is not None:
            return [g.joint] if g.joint is not None else [self.inds, *g.preds]
        return [self.inds] if self.pred is None else [self.inds, self.pred]


@dataclass
class Gated:
    """A gated layer's routing, evaluated ahead of its experts: what its check reads."""

    targets: list[int]  # the layers its lookahead routers predict, nearest first
    preds: list[mx.array]  # their predicted ids
    joint: mx.array | None  # the ids and the predictions as one array (joint_ids), or None
    # the device gate's give-up flag and its longest wait, us (None: the host's gate)
    late: mx.array | None = None
    checked: bool = False  # its check ran (the host's gate checks as the layer is built)
    done: bool = False  # its check ended (GateChecks: on the checks' thread)
    # (layer, sequence number, how many ids) of its routing on the board (stream.gate), or
    # None; `sent`: the decoder has submitted it to the device
    board: tuple[int, int, int] | None = None
    sent: bool = False
    needed: list[int] | None = None  # the distinct experts its check found, ascending
    watch: int = 0  # the reader's watch of its board row for quick misses (0: none)


def token_ids(a: mx.array) -> list[int] | None:
    """The ids of `a` [..., k] as ints where it holds a single token's (decode's), None for
    more: one `tolist`, a few times cheaper than numpy's conversions and their reshape."""
    if a.size != a.shape[-1]:
        return None
    ids = a.tolist()
    for _ in range(a.ndim - 1):
        ids = ids[0]
    return ids


# Where reading an evaluated array back is a transfer of its own (CUDA's managed memory: a
# few tens of us a read), decode's ids are joined on the device and read once; MLX's CPU (and
# Metal's unified memory) read them in place, ~1 us, less than the join's graph costs
# (benchmarks/joint_ids.py).
JOIN_IDS = hasattr(mx, "cuda") and mx.cuda.is_available()


def joint_ids(inds: mx.array, preds: list[mx.array]) -> mx.array | None:
    """Decode's one token: its routing ids and each lookahead router's predicted ids as one
    flat array, evaluated in their place and brought to the host with one `tolist`
    (`split_ids`): three reads a layer at lookahead depth 2 become one. None without
    JOIN_IDS, where there is nothing to join (no prediction), for more than one token, or
    for ids of another dtype."""
    if not JOIN_IDS or not preds:
        return None
    if any(p.size != p.shape[-1] or p.dtype != inds.dtype for p in [inds, *preds]):
        return None
    return own_ids(inds, preds)


def own_ids(inds: mx.array, preds: list[mx.array]) -> mx.array:
    """One token's routing ids, then each of `preds` (in the ids' dtype), as one flat array
    of its own: a buffer and an event that nothing the decoding thread builds next reads,
    so that the checks' thread may wait on it and read it while the decoding thread's evals
    walk `inds` (waiting on an array detaches its event, and reading it on CUDA moves its
    buffer: neither may race the other thread's)."""
    flat = [inds.reshape(-1), *(p.reshape(-1).astype(inds.dtype) for p in preds)]
    return mx.concatenate(flat) if preds else flat[0] + 0


def joint_routing(ds: list[Deferred]) -> mx.array | None:
    """ "token" mode: the routing ids of a whole token's layers `ds` (neither gated nor
    predicting: the token is checked too late for a prediction) as one flat array, evaluated
    with the token and read with one transfer when it is verified (spread_routing), instead
    of one a layer. None without JOIN_IDS, for a gated or predicting layer, or where the
    ids' dtypes differ."""
    if not JOIN_IDS or len(ds) < 2 or any(d.gated or d.pred is not None for d in ds):
        return None
    if any(d.inds.dtype != ds[0].inds.dtype for d in ds):
        return None
    return mx.concatenate([d.inds.reshape(-1) for d in ds])


def spread_routing(joint: mx.array, ds: list[Deferred]) -> None:
    """`joint_routing(ds)`'s array read once (a wait for the token, then one transfer) and
    handed out: each layer's ids to its `host`."""
    flat = np.array(joint)
    at = 0
    for d in ds:
        n = d.inds.size
        d.host = flat[at : at + n].reshape(-1, d.inds.shape[-1])
        at += n


def split_ids(
    joint: mx.array | list[int], inds: mx.array, preds: list[mx.array]
) -> tuple[list[int], list[list[int]]]:
    """`joint_ids`' array, evaluated (or its ints), back as (the token's ids, each router's
    ids) in ints."""
    flat = joint if isinstance(joint, list) else joint.tolist()
    k = inds.shape[-1]
    out = []
    for p in preds:
        n = p.shape[-1]
        out.append(flat[k : k + n])
        k += n
    return flat[: inds.shape[-1]], out


def as_ints(joint, inds: mx.array, preds: list[mx.array]):
    """(decode's one token's ids as ints or None, the predicted ids as ints where they were
    joined to them or None), once `joint` (joint_ids' array, its ints as the routing board
    holds them, or None) is evaluated or may be: reading it waits for it."""
    if joint is None:
        return token_ids(inds), None
    return split_ids(joint, inds, preds)


def host_ids(a: mx.array) -> np.ndarray:
    """The ids of `a` [..., k] on the host, [T, k]."""
    return np.array(a).reshape(-1, a.shape[-1])


def ints_as_host(ids: list[int], like: mx.array) -> np.ndarray:
    """One token's ids read as ints, as host_ids would give them from `like` ([1, k], its
    dtype), without reading `like`."""
    return np.array([ids], dtype=getattr(np, str(like.dtype).rpartition(".")[2]))


def distinct(ids: np.ndarray) -> list[int]:
    """The distinct expert ids of `ids` [T, k], ascending (np.unique's, which costs more than
    the whole lookup for decode's single row)."""
    if ids.shape[0] == 1:
        return sorted(set(ids[0].tolist()))
    return np.unique(ids).tolist()


class Building:
    """DeferredHandshake.building's block: a class, not a generator, as pipelined decode
    enters one at every layer (contextlib's costs a few microseconds each time)."""

    __slots__ = ("handshake", "lookahead", "gated")

    def __init__(self, handshake: DeferredHandshake, lookahead: bool, gated: bool):
        self.handshake, self.lookahead, self.gated = handshake, lookahead, gated

    def __enter__(self) -> list[Deferred]:
        records: list[Deferred] = []
        h = self.handshake
        h.records, h.lookahead, h.gating = records, self.lookahead, self.gated
        return records

    def __exit__(self, *exc) -> None:
        self.handshake.records, self.handshake.gating = None, False


class RoutingBoard:
    """Gated layers' routing on the board (stream.gate) with the table's `board_on`: written
    there by the device (custom_kernels.gate.board) and read there by the layer's check,
    rather than ending a command buffer of its own that the check waits for."""

    def __init__(self, sched: Scheduler, stopping: Callable[[], bool]):
        self.sched, self.stopping = sched, stopping
        self._at: dict[int, mx.array] = {}  # layer -> its board row's device address
        self._seq = 0  # the last sequence number a layer's routing went onto the board with
        self.reads = self.fallbacks = 0  # routings read from the board; read from MLX instead

    def put(self, layer: int, d: Deferred, untraced: bool) -> tuple | None:
        """`d`'s routing (and lookahead's predictions joined to it) made ready for the board:
        the arguments of the board's kernel (ids, row address, sequence number), whose
        routing ids the layer's gate then takes. None where the board does not apply (off, a
        trace recording routing, more ids than a row holds, or predictions of another shape
        or dtype than the routing's)."""
        g, table = d.gated, self.sched.residency.gate
        if not table.board_on or not untraced:
            return None
        # (joined here too where reads are not transfers: one write onto the board; an
        # array of its own, which the check's fallback reads: own_ids)
        src = g.joint if g.joint is not None else own_ids(d.inds, g.preds)
        if src.size > BOARD_IDS:
            return None
        g.joint = src
        at = self._at.get(layer)
        if at is None:
            at = self._at[layer] = mx.array([table.board_address(layer)], dtype=mx.uint64)
        self._seq = self._seq % (2**31 - 1) + 1  # (int32, never 0: a row not yet written)
        g.board = (layer, self._seq, src.size)
        if self.sched.quick is not None:  # its misses read by the reader as the ids land
            ahead = [(t, p.size) for t, p in zip(g.targets, g.preds)]
            g.watch = self.sched.quick.watch(layer, self._seq, d.inds.size, ahead)
        return src, at, mx.array([self._seq], dtype=mx.int32)

    def read(self, d: Deferred) -> list[int] | None:
        """The ints `put` had the device write for `d`, once written. None if they have not
        come twice the gate's timeout after the layer was submitted to the device (a board
        that does not work: the check reads the routing from MLX's arrays instead, which
        that submission scheduled); RuntimeError if the checks are stopping, or if the layer
        was not submitted within ten times the gate's timeout."""
        layer, seq, n = d.gated.board
        table = self.sched.residency.gate
        row = table.board_row(layer)
        t0, limit = time.monotonic(), 2e-3 * timeout_ms()
        while (gil := wait_word(row.ctypes.data, seq, 0.05)) is None:
            if self.stopping() or self.sched.closed or table.device_address is None:
                raise RuntimeError(CLOSED)
            waited = time.monotonic() - t0
            if d.gated.sent and waited > limit:
                self.fallbacks += 1
                if d.gated.watch:  # (the reader's watches wait for the same board)
                    self.sched.quick.drop()
                return None
            if waited > 5 * limit:
                raise RuntimeError(
                    f"gated decode: layer {layer}'s routing never reached the routing board "
                    f"in {waited:.1f} s (never submitted to the device)"
                )
        self.reads += 1
        self.sched.stats.check_gil_s += gil
        if d.gated.watch:  # the reader's own reads of its misses queued, in its log
            self.sched.quick.wait(d.gated.watch)
        return row[1 : 1 + n].tolist()


def gated_slots(put: tuple | None, inds: mx.array, row_at: mx.array, fused: bool):
    """A device-gated layer's (slots, the gate's flags): its routing `inds` gated alone (no
    board: `put` None), or after the board's kernel (`put`: RoutingBoard.put's arguments for
    it), or with the board in one kernel (`fused`)."""
    if put is None:
        return gate(inds.reshape(-1), row_at)
    if fused:
        ids, at, seq = put
        return board_gate(ids, inds.size, at, seq, row_at)
    return gate(board(*put)[: inds.size], row_at)


def load_gate(table: GateTable, k: int, depth: int, wide: int | None = None) -> None:
    """The device gate's kernels (and the board's, where `table.board_on`, alone or with the
    gate as one: `table.board_fused`) compiled and
    loaded before decode, for tokens of `k` routed experts (uint32 ids, as argpartition gives
    them; up to `depth` lookahead routers' `wide` ids, k by default, joined on the board: the
    board's kernel is compiled for each width), run once on the table's
    spare rows, which read every expert landed. Their first launch would otherwise fall in
    the first gated token: compiling the gate (NVRTC) takes about a second where MLX has no
    cached copy, and loading a module may synchronize the device."""
    row, board_address = table.spare_address()
    row_at, board_at = table.gate_at(row), mx.array([board_address], dtype=mx.uint64)
    outs = list(gate(mx.zeros((k,), dtype=mx.uint32), row_at))
    if table.board_on:
        for n in [k + j * (wide or k) for j in range(depth + 1)]:
            if n > BOARD_IDS:
                continue
            ids, seq = mx.zeros((n,), dtype=mx.uint32), mx.array([1], dtype=mx.int32)
            if table.board_fused:
                outs += board_gate(ids, k, board_at, seq, row_at)
            else:
                outs.append(board(ids, board_at, seq))
    mx.eval(*outs)


def load_device_gate(
    cache, k: int, depth: int, asked: bool | None, wide: int | None = None
) -> None:
    """`load_gate` for an ExpertCache whose decode gates on the device. Where its kernels
    cannot load (no NVRTC, a device before sm_70), a one-line warning and no device gate:
    with `decode_gate` left to its default (`asked` None), decode runs ungated, as where no
    device can wait; asked for, gated decode waits on the host instead."""
    table = cache.sched.residency.gate
    try:
        load_gate(table, k, depth, wide)
        return
    except (RuntimeError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    cache.pipelined.device_gate = False
    if asked is None:  # (no read has been submitted yet: nothing holds the table)
        cache.sched.residency.gate = None
        table.close()
        then = "decode runs ungated"
    else:
        then = "gated decode waits on the host instead"
    warnings.warn(
        f"the device gate's kernel did not load ({reason}); {then}", RuntimeWarning, stacklevel=4
    )


class DeferredHandshake:
    """The deferred handshake of every MoE layer of one model. `all_fit`: every expert fits
    in the arena at once, so uses need not be recorded for eviction."""

    def __init__(
        self,
        sched: Scheduler,
        predictor: Predictor,
        compute: LayerCompute,
        layers: list[int],
        all_fit: bool,
        owner: Callable | None = None,
    ):
        """`owner()`: the ExpertCache (a weak reference), whose per-layer handshake's claim and
        prediction (`claim`, `predict`) gated layers make as it does, and whose `trace` they record
        into. Gated layers wait on the device (custom_kernels/gate.py) where the scheduler's
        gate table is mapped for it, else on the host (the host's gate)."""
        self.sched = sched
        self.predictor = predictor
        self.compute = compute
        self.layers = layers
        self.all_fit = all_fit
        self.owner = owner
        table = sched.residency.gate
        self.device_gate = table is not None and table.device_address is not None
        # The device gate's checks run on a thread of their own (runtime/gate_checks.py),
        # started at the first; without it the checks stay idle.
        fail = table.fail_pending if table is not None else lambda: None
        self.checks = GateChecks(self._check_aside, fail)
        self._next = dict(zip(layers, layers[1:]))
        self._row_at: dict[int, mx.array] = {}  # layer -> its gate's row_at (GateTable.gate_at)
        self.board = RoutingBoard(sched, lambda: self.checks.stopping)
        self.records: list[Deferred] | None = None  # inside `building()`: where layers go
        self.lookahead = True  # whether those layers may predict
        self.gating = False  # inside `building(gated=True)`
        self.ahead: dict[int, int] = {}  # pipelined lookahead: layer -> layer it predicts
        self.ahead_tags: dict[int, list[int]] = {}  # read-ahead submitted for a layer
        self.ahead_distance = 1  # layers from a checked layer to the one it predicts
        # A failed check fed the miss rate for this layer: its recomputing handshake must not.
        self.observed: int | None = None
        self.warmed = False  # (the device gate's first layer: `_warm`)

    @property
    def gated(self) -> bool:
        """Whether gated decode can run (the scheduler keeps a gate table)."""
        return self.sched.residency.gate is not None and not self.compute.fake_stream

    def building(self, lookahead: bool, gated: bool = False) -> Building:
        """Layers run inside are built without a host sync, each recorded as a `Deferred`
        in the list this yields; with `lookahead` they may predict a later layer; `gated`:
        their experts wait for their reads (`run_gated`) instead of being checked later."""
        if gated and not self.gated:
            raise RuntimeError("gated decode needs the expert cache's gate table")
        return Building(self, lookahead, gated)

    def plan_lookahead(self, distance: int) -> None:
        """A prediction made from layer l's input can only help layer l + `distance`."""
        routers = self.predictor.routers
        self.ahead_distance = distance
        self.ahead = {
            l: self.layers[i + distance]
            for i, l in enumerate(self.layers)
            if i + distance < len(self.layers) and self.layers[i + distance] in routers
        }

    def predicts_in_decode(self) -> bool:
        """Whether decode lookahead predicts for the next token."""
        return not self.compute.fake_stream and self.predictor.predicts_in_decode()

    def run(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        """Experts computed with slots looked up on the device from this layer's residency
        row as it stands now; no host sync. The decoder verifies the layer later."""
        if self.gating:
            return self.run_gated(layer, x, inds)
        t = time.perf_counter()
        sched = self.sched
        tags = self.ahead_tags.pop(layer, None)
        if tags:
            # Predicted reads for this layer still in flight: wait for them here, where the
            # device still has the layers before it to compute, rather than miss.
            t1 = time.perf_counter()
            sched.wait(tags)
            sched.stats.exposed_wait_s += time.perf_counter() - t1
        if sched.reads:
            sched.collect(block=False)  # landed read-ahead becomes visible to this layer
        with sched.lock:
            # Slots of layers built on the device must not be refilled until they complete.
            sched.busy_layers.add(layer)
        row, row_mx = sched.device_row(layer, self.compute.fake_stream)
        y = self.compute.by_pair(layer, x, inds, row_mx[inds])
        d = Deferred(layer, inds, row)
        target = self.ahead.get(layer)
        if target is not None and self.lookahead and self.predicts_in_decode():
            d.target, d.pred = target, self.predictor.routers[target](x)
        self.records.append(d)
        sched.stats.host_s += time.perf_counter() - t
        return y

    def run_gated(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        """Experts that wait for their own reads: the routing ids (and lookahead's
        predictions) are submitted to the device first, so the check can read them while the
        device waits in the gate kernel for the experts the check finds missing; with the
        host's gate, the check runs now and its reads are waited for before the experts are
        queued. Either way the slots come from the gate table: landed records only."""
        t = time.perf_counter()
        sched, pr = self.sched, self.predictor
        if inds.size != inds.shape[-1]:
            raise ValueError("gated decode runs one token at a time")
        decoding = self.owner().decoding  # (the prompt's last token is prefill's)
        targets = (
            pr.targets(layer, decoding) if self.lookahead and self.predicts_in_decode() else []
        )
        preds = [pr.routers[target](x) for target in targets]
        g = Gated(targets, preds, joint_ids(inds, preds))
        d = Deferred(layer, inds, None, gated=g)
        with sched.lock:
            sched.busy_layers.add(layer)
        if self.device_gate:
            if not self.warmed:
                self._warm(inds, preds)
            put = self.board.put(layer, d, self.owner().trace is None)
            if put is None:
                if g.joint is None:  # (what the check reads: an array of its own)
                    g.joint = own_ids(inds, preds)
                mx.async_eval(*d.outputs())  # alone: the device reaches them before the gate
            self.checks.submit(d)  # (read while this thread builds on: GateChecks)
            fused = sched.residency.gate.board_fused
            slots, g.late = gated_slots(put, inds, self._row_address(layer), fused)
        else:
            sched.stats.host_s += time.perf_counter() - t
            tags = self.check_gated(d, self.owner().trace)
            t = time.perf_counter()
            sched.wait(tags)
            sched.stats.exposed_wait_s += time.perf_counter() - t
            t = time.perf_counter()
            slots = self._landed_slots(layer, inds)
        y = self.compute.by_pair(layer, x, inds, slots)
        self.records.append(d)
        sched.stats.host_s += time.perf_counter() - t
        return y

    def _warm(self, inds: mx.array, preds: list[mx.array]) -> None:
        """Before the first device gate: the array ops that gated layers and their token's
        end launch, evaluated once, so that none launches a kernel for the first time while
        a gate waits (loading a module may synchronize the device, and a read's copy then
        waits behind that gate until it gives up: docs/decisions.md, "Gated decode"). The
        layers near the end predict fewer layers ahead (the last one none: `own_ids`' copy),
        and the token's end joins the gates' flags. No gate waits here: a gated token is
        built only once the token before it is verified."""
        self.warmed = True
        flags = [mx.zeros((LATE_WORDS,), dtype=mx.int32) for _ in range(2)]  # (gates' `late`)
        mx.eval(*(own_ids(inds, preds[:j]) for j in range(len(preds) + 1)), mx.concatenate(flags))

    def _row_address(self, layer: int) -> mx.array:
        at = self._row_at.get(layer)
        if at is None:
            table = self.sched.residency.gate
            at = self._row_at[layer] = table.gate_at(table.row_address(layer))
        return at

    def _landed_slots(self, layer: int, inds: mx.array) -> mx.array:
        """The host's gate: the slots the gate table holds for the layer's ids, all landed."""
        row = self.sched.residency.gate.row(layer)
        slots = [row.item(e) for e in token_ids(inds)]
        if min(slots) < 0:
            raise RuntimeError(f"layer {layer}: a waited-for read is not in the gate table")
        return mx.array(slots, dtype=mx.uint32)

    def _check_aside(self, d: Deferred) -> None:
        """A device-gated layer's check, on the checks' thread (GateChecks)."""
        owner = self.owner()
        self.check_gated(d, owner.trace if owner is not None else None, aside=True)

    def check_gated(
        self, d: Deferred, trace: RoutingTrace | None, aside: bool = False
    ) -> list[int]:
        """A gated layer's handshake, as the per-layer one runs it without the wait: its
        routing read (the device has computed every layer before it), its hits counted,
        its misses' reads submitted urgently, lookahead's read-ahead; the tags its experts
        wait for. A miss's victim may be of any layer but for this one's experts (pinned)
        and reads in flight, as in the per-layer handshake: the layers before this one have
        finished, and the device cannot pass this layer's gate before the miss lands, so the
        gates of the layers built after it have not read the table yet and will see the
        victim gone. Read-ahead keeps off every layer built and not finished (it does not
        stop the device). `aside`: on the checks' thread, whose time (the routing's wait
        included) is `check_s`, off the decoding thread's."""
        st, sched, g = self.sched.stats, self.sched, d.gated
        g.checked = True
        t0 = time.perf_counter()
        flat = self.board.read(d) if g.board is not None else None
        if flat is None and not aside:
            mx.eval(*d.outputs())  # the routing and the predictions (a wait, then reads)
        # Aside, this thread reads only `g.joint` (or the board), submitted before the check
        # was (run_gated; the board's fallback only for a sent layer), which nothing built
        # after it reads: reading it waits for its event and nothing more. An mx.eval here
        # would encode work and detach arrays the decoding thread's evals walk (MLX's graph
        # is one thread's): on CUDA that crashed gated decode's process (SIGSEGV in it).
        # (the board holds g.joint's ints: put joins onto it what the joint holds)
        one, pred_ids = as_ints(g.joint if flat is None else flat, d.inds, g.preds)
        c1 = time.thread_time()  # (after the joint's wait, as after the board's)
        if one is None:
            ids = host_ids(d.inds)  # (not aside: the decoding thread's own check)
        elif trace is not None:
            ids = ints_as_host(one, d.inds)
        else:
            ids = None
        t1 = time.perf_counter()
        if not aside:
            st.route_sync_s += t1 - t0
        layer = d.layer
        with sched.lock:
            busy = sched.busy_layers
            busy.difference_update([l for l in busy if l < layer])
            sched.arena.unpin_all()  # the layer before has finished: its pins go
            sched.arena.set_layer(layer)
        if trace is not None:
            trace.record(layer, ids)
        needed = g.needed = sorted(set(one)) if one is not None else distinct(ids)
        st.lookups += len(needed)
        sched.collect(block=False)
        sched.drop_unneeded(layer, needed)
        owner = self.owner()
        tags = owner.claim(layer, needed)
        claimed = time.perf_counter()
        owner.predict(g.targets, g.preds, self._next.get(layer), layer, needed, pred_ids)
        if sched.quick is not None:  # the reserve made whole for the layers after this one
            with sched.lock:
                sched.quick.refill(sched.busy_layers)
        if aside:
            st.check_s += time.perf_counter() - t0
            st.check_cpu_s += time.thread_time() - c1
            st.check_claim_s += claimed - t1
        else:
            st.host_s += time.perf_counter() - t1
        return tags

    def check(self, d: Deferred, alone: bool, trace: RoutingTrace | None) -> bool:
        """ExpertCache.check_deferred: whether every expert layer `d.layer` chose was
        resident when it was built; a miss's reads start here when `alone`. A gated layer
        always passes (its experts wait for their reads): its check is its handshake."""
        if d.gated is not None:
            if self.device_gate:  # its check runs aside: waited for (a route sync)
                t = time.perf_counter()
                self.checks.wait(d)
                self.sched.stats.route_sync_s += time.perf_counter() - t
            elif not d.gated.checked:
                self.check_gated(d, trace)
            return True
        st, sched = self.sched.stats, self.sched
        t0 = time.perf_counter()
        ids = d.host if d.host is not None else np.array(d.inds).reshape(-1, d.inds.shape[-1])
        t1 = time.perf_counter()
        st.route_sync_s += t1 - t0
        if alone:
            # This layer's routing is known, so every layer before it has finished computing
            # (a token built on top would still be reading those layers' slots).
            with sched.lock:
                busy = sched.busy_layers
                busy.difference_update([l for l in busy if l < d.layer])
        absent_then = d.row[ids] < 0
        needed = distinct(ids)
        if absent_then.any():
            # The mode rule sees the layer as it was built (what it recomputes for), not the
            # recomputing handshake's share, which a read landed meanwhile would make 0.
            self.predictor.observe_decode_layer(len(set(ids[absent_then].tolist())) / len(needed))
            self.observed = d.layer
            if alone:
                # The misses' reads go in now, into slots of no layer still computing, so
                # they land while the device drains what was built after this layer.
                absent = sorted(set(ids[sched.row(d.layer)[ids] < 0].tolist()))
                sched.start_misses(d.layer, absent, sched.busy_layers)
            st.host_s += time.perf_counter() - t1
            return False
        st.lookups += len(needed)
        if sched.prefetched or not self.all_fit:
            with sched.lock:  # this check is the layer's handshake: its uses are this call's
                sched.arena.set_layer(d.layer)
                sched.count_resident(d.layer, needed)
        else:
            st.hits += len(needed)
        self.predictor.observe_decode_layer(0.0)
        decoding = bool(sched.arena.decoding)  # not the prompt's last token, which is prefill's
        self.predictor.observe_use(d.layer, needed, decoding)
        if trace is not None:
            trace.record(d.layer, ids)
        if d.pred is not None:
            pred = np.array(d.pred).reshape(-1, d.pred.shape[-1])
            if trace is not None:
                trace.record_prediction(d.target, pred)
            ranked = self.predictor.rank(pred)
            # As the per-layer handshake's read-ahead: told to the policy, scored with
            # --lookahead-score. Slots of layers still computing must not be refilled.
            ahead = self.predictor.ahead_bar(d.target, ranked, decoding, self.ahead_distance)
            with sched.lock, sched.arena.scored(ahead):
                tags = sched.read_ahead(d.target, ranked, protect=sched.busy_layers)
            if tags:
                self.ahead_tags[d.target] = tags
        st.host_s += time.perf_counter() - t1
        return True
