"""What the expert cache counts: per chunk, per generation, per session, and what routing chose.

Nothing here reads, computes or decides; generation, the server, bench and the plots read
these without touching the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np


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
    # pipelined decode: tokens begun in each mode, and those begun while decode predicted
    token_mode_tokens: int = 0
    layers_mode_tokens: int = 0
    sync_mode_tokens: int = 0
    gated_mode_tokens: int = 0
    predicting_tokens: int = 0
    # gated decode: layers whose gate gave up waiting on the device (recomputed: a stuck read)
    gate_timeouts: int = 0
    # and the time the device stood at its gates, waiting for reads (each gate's longest
    # pair; the device's own clock): decode's wait for its misses, which the host does not see
    gate_wait_s: float = 0.0
    # gated decode on the device: time its checks' thread spent checking layers, their
    # routing's wait included (off the decoding thread: waits for it are in route_sync_s)
    check_s: float = 0.0
    # and its CPU time after each routing's wait (thread_time): against the decoding
    # thread's, what of a token's host work the GIL lets run side by side
    check_cpu_s: float = 0.0
    # and its time from each routing read to its claim's return (the misses' reads submitted):
    # the check's own part of the chain a gated miss waits on, before the read itself (checks
    # on that thread only: where the decoding thread checks, this span is in host_s)
    check_claim_s: float = 0.0
    # and its time from seeing each layer's routing on the board to holding the GIL again:
    # how long other threads' hold of the GIL (the decoding thread's, building layers) kept
    # the check from starting
    check_gil_s: float = 0.0
    # gated decode with quick misses (stream.quick): misses the reader's own thread read off
    # the routing board, before their layer's check (counted in `misses` too)
    quick_misses: int = 0
    # ... and lookahead's predictions it read ahead off the board (decode_quick_ahead)
    quick_ahead: int = 0
    topped_up: int = 0  # read-ahead the scheduler's loop added when the drive ran low
    loop_s: float = 0.0  # time the scheduler's loop thread held the GIL
    # its CPU time meanwhile (thread_time: what others' threads and processes take of its
    # core, and its waits for the GIL, not counted)
    loop_cpu_s: float = 0.0
    compute_s: float = 0.0  # wall time of chunks minus exposed wait (filled by generate)
    wall_s: float = 0.0
    tokens: int = 0

    def add(self, other: ExpertStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def copy(self) -> ExpertStats:
        return ExpertStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    # What a layer's handshake counts of its experts: a layer computed again (a gate given
    # up) must not count them twice.
    USES = ("lookups", "hits", "streamed_ahead", "misses")

    def uses(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.USES)

    def restore_uses(self, uses: tuple[int, ...]) -> None:
        for name, value in zip(self.USES, uses):
            setattr(self, name, value)

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
class RoutingTrace:
    """Routing decisions recorded for research: load(path, trace=RoutingTrace())."""

    ids: dict[int, list[np.ndarray]] = field(default_factory=dict)  # layer -> per call [T, k]
    # lookahead: layer -> per call, the ids predicted for it from the previous layer's input
    predicted: dict[int, list[np.ndarray]] = field(default_factory=dict)
    # (calls recorded by then, True where decode began): strata_mlx.stream.trace.spans_of
    decode_marks: list[tuple[int, bool]] = field(default_factory=list)

    def record(self, layer: int, ids: np.ndarray) -> None:
        self.ids.setdefault(layer, []).append(ids)

    def record_prediction(self, layer: int, ids: np.ndarray) -> None:
        self.predicted.setdefault(layer, []).append(ids)

    def begin_decode(self) -> None:
        """The calls recorded from here on are decode steps (told by the decoder)."""
        self._mark(True)

    def end_decode(self) -> None:
        """The calls recorded from here on are not (a next generation's prompt)."""
        self._mark(False)

    def _mark(self, begins: bool) -> None:
        self.decode_marks.append((max(map(len, self.ids.values()), default=0), begins))
