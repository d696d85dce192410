"""Quick misses (strata_mlx.stream.quick, _native/quick.c): the reader's own thread reads a
gated layer's misses off the routing board into a reserve of slots.

The reader alone: a watched board row's ids not landed and not in flight read into reserve
slots (their ready words the gate table's, their checksums verified), logged for the
scheduler; a record in flight never read twice (the reader skips the scheduler's request for
it); a reserve run dry leaves the rest; a dropped watch ends the wait for a board that never
came. The scheduler: a request the reader skipped is undone and the quick read taken in its
place. Gated decode through the emulated device gate (tests/runtime/test_gate.py) with quick
misses equals the per-layer handshake bit for bit, and the reserve goes back to the arena
when a generation starts; on the GPU (`-m gpu`) through the device gate and its board."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import prompt_ids
from test_gate import (
    UNGATED_FIRST,
    arena_gb,
    cuda_ready,
    decode,
    given_up_only_for_held_copies,
    load_emulated,
)

import strata_mlx
from strata_mlx.format.checksums import checksum
from strata_mlx.stream.reader import ALIGNMENT, READY_FAILED, Reader

RB = 8192  # a record's bytes
NPOS, NEXP = 2, 8


class Board:
    """A reader armed for quick misses over a file of NPOS x NEXP random records: the gate
    table, flight bytes, a board row per layer position, an arena of `slots` slots."""

    def __init__(
        self, tmp_path, slots: int = 6, verify: bool = True, corrupt: int = -1, floor: int = -1
    ):
        rng = np.random.default_rng(3)
        self.data = rng.integers(0, 256, NPOS * NEXP * RB, dtype=np.uint8)
        path = tmp_path / "experts.bin"
        path.write_bytes(self.data.tobytes())
        self.table = np.full((NPOS, NEXP), -1, dtype=np.int32)
        self.board = np.zeros((NPOS, 17), dtype=np.int32)
        raw = np.zeros((slots + 1) * RB, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGNMENT
        self.arena = raw[start : start + slots * RB].reshape(slots, RB)
        self.reader = Reader(2)
        self.f = self.reader.open(str(path), direct=False, checksum="crc32c" if verify else None)
        offsets = np.arange(NPOS * NEXP, dtype=np.int64).reshape(NPOS, NEXP) * RB
        sums = np.array(
            [checksum("crc32c", self.record(i)) for i in range(NPOS * NEXP)], dtype=np.uint32
        ).reshape(NPOS, NEXP)
        if corrupt >= 0:
            sums.reshape(-1)[corrupt] ^= 1
        self.q = self.reader.native
        flight = self.q.quick_arm(
            self.table.ctypes.data, NPOS, NEXP, self.f, RB, offsets, sums if verify else None,
            floor,
        )  # fmt: skip
        self.flight = np.frombuffer(flight, dtype=np.uint8).reshape(NPOS, NEXP)

    def record(self, i: int) -> np.ndarray:
        return self.data[i * RB : (i + 1) * RB]

    def give(self, slots) -> None:
        self.q.quick_give([(s, self.arena[s].ctypes.data) for s in slots])

    def post(self, pos: int, seq: int, ids: list[int], ahead=None) -> int:
        return self.q.quick_watch(self.board[pos].ctypes.data, seq, len(ids), pos, ahead)

    def write(self, pos: int, seq: int, ids: list[int]) -> None:
        """What the device's board kernel does: the ids, then their sequence number."""
        self.board[pos, 1 : 1 + len(ids)] = ids
        self.board[pos, 0] = seq

    def landed(self, claims) -> None:
        """Every claimed read waited for: each record in its slot, its word its slot."""
        done = self.reader.wait([c[3] for c in claims], 5.0)
        assert len(done) == len(claims) and not any(err for _, err, _ in done)
        for pos, e, slot, *_ in claims:
            assert self.table[pos, e] == slot
            assert np.array_equal(self.arena[slot], self.record(pos * NEXP + e))


def test_a_watched_layers_misses_are_read_into_the_reserve_as_its_ids_land(tmp_path):
    b = Board(tmp_path)
    b.table[1, 2] = 5  # landed: not read
    b.flight[1, 4] = 1  # another read is for it: not read twice
    b.give([0, 1, 2])
    n = b.post(1, 7, [2, 3, 4, 6])
    assert not b.q.quick_wait(n, 0.05)  # nothing on the board yet: nothing read
    assert b.q.quick_claims() == [] and b.q.quick_free() == 3
    b.write(1, 7, [2, 3, 4, 6])
    assert b.q.quick_wait(n, 5.0)
    claims = b.q.quick_claims()
    assert [(p, e, urgent) for p, e, _, _, urgent in claims] == [(1, 3, True), (1, 6, True)]
    assert sorted(c[2] for c in claims) == [1, 2]  # from the reserve's top
    assert all(c[3] < 0 for c in claims)  # (the scheduler's tags are positive)
    assert b.flight[1, 3] == b.flight[1, 6] == 1 and b.q.quick_free() == 1
    b.landed(claims)
    st = b.reader.stats()
    assert st["quick_reads"] == 2 and st["quick_boards"] == 1 and st["quick_dry"] == 0
    assert st["urgent_reads"] == 2  # (read as misses: urgent, their latency counted)
    assert b.q.quick_claims() == []  # taken once
    b.reader.close()


def test_the_reader_skips_a_request_for_a_record_in_flight_and_marks_the_others(tmp_path):
    b = Board(tmp_path)
    b.give([0])
    b.write(0, 3, [5])
    assert b.q.quick_wait(b.post(0, 3, [5]), 5.0)
    (claim,) = b.q.quick_claims()
    word = b.table.ctypes.data
    reqs = [
        (1, b.f, 5 * RB, RB, b.arena[3].ctypes.data, None, (word + 4 * 5, 3)),  # quick's
        (2, b.f, 1 * RB, RB, b.arena[4].ctypes.data, None, (word + 4 * 1, 4)),
        (3, b.f, 0, RB, b.arena[5].ctypes.data),  # no ready word: never skipped
    ]
    assert b.reader.submit(reqs) == [1]
    assert b.flight[0, 1] == 1  # the scheduler clears it once the read is in its books
    done = {t: err for t, err, _ in b.reader.wait([claim[3], 2, 3], 5.0)}
    assert done == {claim[3]: 0, 2: 0, 3: 0}
    assert b.table[0, 5] == claim[2] and b.table[0, 1] == 4  # read once, into quick's slot
    b.reader.close()


def test_predictions_are_read_ahead_while_the_reserve_lasts_and_promoted_when_needed(tmp_path):
    """With `ahead` (lookahead's predictions for later layers after the layer's own ids on
    the board), the predictions not landed are read as read-ahead while more than the floor
    of the reserve is left; when a later layer's own ids name one still queued, it moves to
    the urgent queue, and it is read once."""
    b = Board(tmp_path, floor=2)
    b.give([0, 1, 2, 3, 4])
    b.reader.pause()  # (nothing starts: the read-ahead stays queued)
    ids = [1, 5, 6, 7]  # layer 0's own id 1, then 3 predictions for layer 1
    b.write(0, 4, ids)
    assert b.q.quick_wait(b.post(0, 4, ids[:1], [(1, 3)]), 5.0)
    claims = b.q.quick_claims()
    assert [(p, e, urgent) for p, e, _, _, urgent in claims] == [
        (0, 1, True), (1, 5, False), (1, 6, False)
    ]  # fmt: skip
    assert b.q.quick_free() == 2 and b.reader.stats()["quick_ahead_reads"] == 2
    assert b.reader.stats()["queued_ahead"] == 2 and b.reader.stats()["quick_dry"] == 0
    b.write(1, 5, [6, 3])  # layer 1's own ids: 6 is queued read-ahead, 3 a miss
    assert b.q.quick_wait(b.post(1, 5, [6, 3]), 5.0)
    (miss,) = b.q.quick_claims()
    st = b.reader.stats()
    assert miss[:2] == (1, 3) and miss[4] and st["quick_promoted"] == 1
    assert st["queued_ahead"] == 1 and st["queued_urgent"] == 3  # (the promoted one behind)
    b.reader.resume()
    b.landed(claims + [miss])
    b.reader.close()


def test_a_dry_reserve_leaves_the_rest_and_a_corrupt_record_fails_its_word(tmp_path):
    b = Board(tmp_path, corrupt=0 * NEXP + 2)
    b.give([0, 1])
    b.write(0, 1, [2, 4, 6])
    assert b.q.quick_wait(b.post(0, 1, [2, 4, 6]), 5.0)
    claims = b.q.quick_claims()
    assert [e for _, e, *_ in claims] == [2, 4]
    assert b.reader.stats()["quick_dry"] == 1 and b.table[0, 6] == -1 and b.flight[0, 6] == 0
    done = {t: err for t, err, _ in b.reader.wait([c[3] for c in claims], 5.0)}
    assert done[claims[0][3]] != 0 and done[claims[1][3]] == 0  # its checksum is checked
    assert b.table[0, 2] == READY_FAILED and b.table[0, 4] == claims[1][2]
    b.reader.close()


def test_dropped_watches_end_their_wait_and_later_ones_are_watched(tmp_path):
    b = Board(tmp_path)
    b.give([0, 1])
    stuck = b.post(0, 9, [1])  # a board that never comes
    later = b.post(1, 10, [2])
    b.write(1, 10, [2])
    waited = []
    t = threading.Thread(target=lambda: waited.append(b.q.quick_wait(later, 5.0)))
    t.start()
    time.sleep(0.05)
    assert t.is_alive() and b.q.quick_claims() == []  # behind the stuck one, in order
    b.q.quick_drop()
    t.join(5.0)
    assert waited == [True] and b.q.quick_claims() == []  # dropped: left to the checks
    n = b.post(1, 11, [3])
    b.write(1, 11, [3])
    assert stuck < later < n and b.q.quick_wait(n, 5.0)
    assert [e for _, e, *_ in b.q.quick_claims()] == [3]
    assert sorted(b.q.quick_take()) == [0]  # the reserve back; none left
    assert b.q.quick_free() == 0
    b.reader.close()


def test_quick_misses_refuse_bad_arguments_and_a_reader_not_armed(tmp_path):
    with Reader(1) as r:
        with pytest.raises(RuntimeError, match="not armed"):
            r.native.quick_watch(4096, 1, 1, 0)
    b = Board(tmp_path)
    with pytest.raises(RuntimeError, match="already armed"):
        b.q.quick_arm(b.table.ctypes.data, NPOS, NEXP, b.f, RB,
                      np.zeros(NPOS * NEXP, dtype=np.int64), None)  # fmt: skip
    with pytest.raises(ValueError, match="k outside"):
        b.q.quick_watch(b.board.ctypes.data, 1, 0, 0)
    with pytest.raises(ValueError, match="position outside"):
        b.q.quick_watch(b.board.ctypes.data, 1, 1, NPOS)
    with pytest.raises(TypeError, match="not \\(slot, address\\)"):
        b.q.quick_give([3])
    b.give([0])
    b.reader.close()  # its watcher stopped: what looks or gives back answers, nothing more
    b.q.quick_drop()
    assert b.q.quick_claims() == [] and b.q.quick_wait(99, 0.0) and b.q.quick_take() == [0]
    with pytest.raises(ValueError, match="closed"):
        b.post(0, 1, [1])
    with Reader(1) as r:
        f = r.open(str(tmp_path / "experts.bin"), direct=False)
        with pytest.raises(ValueError, match="holds 8 bytes"):
            r.native.quick_arm(b.table.ctypes.data, NPOS, NEXP, f, RB,
                               np.zeros(1, dtype=np.int64), None)  # fmt: skip
        with pytest.raises(ValueError, match="without a checksum"):
            r.native.quick_arm(b.table.ctypes.data, NPOS, NEXP, f, RB,
                               np.zeros(NPOS * NEXP, dtype=np.int64),
                               np.zeros(NPOS * NEXP, dtype=np.uint32))  # fmt: skip


LOADED: list = []  # models quick_model loaded, closed after their test


@pytest.fixture(autouse=True)
def _close_loaded(monkeypatch):
    """Each test's models closed at its end, while the emulated gate's stand-ins are still in
    place (their gate table is unmapped by the stand-in, not by a CUDA call that fails here)."""
    yield
    while LOADED:
        LOADED.pop().expert_cache.close()


def quick_model(monkeypatch, path, fraction: float, reserve: int, **opts):
    model, seen = load_emulated(
        monkeypatch, path, fraction, decode_gate_board=True, decode_quick_misses=reserve, **opts
    )
    LOADED.append(model)
    assert model.expert_cache.sched.quick is not None
    return model, seen


def books_whole(sched) -> None:
    """Every slot is a key's, free, or the reserve's; no read is in flight in the reader's
    flight bytes that the scheduler's books do not hold."""
    arena, quick = sched.arena, sched.quick
    held = set(arena.slot_of.values()) | set(arena._free) | quick.held
    assert len(held) == arena.n_slots == len(arena.slot_of) + len(arena._free) + len(quick.held)
    flying = {(quick.layer_at[p], e) for p, e in zip(*np.nonzero(quick.flight))}
    assert flying <= set(sched.tag_of)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("policy", ["lookahead", "lookahead:qa1", "demand", "demand:sp1"])
def test_gated_decode_with_quick_misses_equals_sync(store, family, policy, monkeypatch):
    """(`:sp1`: a layer's misses spread over every idle reader thread, read_spread)"""
    path = store(family)
    ids = prompt_ids(24, seed=11)
    gb = arena_gb(path, 0.5)
    read_ahead, ahead = policy.split(":")[0], policy.endswith(":qa1")
    spread = {"read_spread": True, "read_split_kb": 4} if policy.endswith(":sp1") else {}
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead=read_ahead)
    ref = decode(sync, ids, 10)
    model, _ = quick_model(
        monkeypatch, path, 0.5, 4, read_ahead=read_ahead, decode_quick_ahead=ahead, **spread
    )
    ec = model.expert_cache
    got = decode(model, ids, 10)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    s, sched = ec.stats, ec.sched
    assert s.gate_timeouts == 0 and s.gated_mode_tokens > 0
    assert 0 < s.quick_misses <= s.misses and sched.quick.timeouts == 0
    assert (s.quick_ahead > 0) == ahead
    assert (sched.reader.stats()["spread_wakes"] > 0) == bool(spread)
    sched.drain()
    books_whole(sched)
    ec.idle()  # a generation starts: the reserve goes back
    assert not sched.quick.held and sched.reader.native.quick_free() == 0
    books_whole(sched)
    got = decode(model, ids, 10)  # ... and a second generation is exact too
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    for m in (model, sync):
        m.expert_cache.close()


def test_a_request_the_reader_skips_is_undone_and_the_quick_read_taken(store, monkeypatch):
    path = store("qwen3_moe")
    model, _ = quick_model(monkeypatch, path, 0.5, 2)
    ec = model.expert_cache
    sched, quick = ec.sched, ec.sched.quick
    layer = ec.layers[0]
    e = int(np.nonzero(sched.row(layer) < 0)[0][0])  # an expert not resident
    with sched.lock:
        quick.refill(None)
    gate = sched.residency.gate
    gate.board_row(layer)[1] = e
    gate.board_row(layer)[0] = 77  # (the device's board kernel)
    assert quick.wait(quick.watch(layer, 77, 1, []))
    with sched.lock:
        sched.quick = None  # the scheduler's view before the reader's read: not absorbed
        reqs = sched._requests([(layer, e)], None, None)
        (mine,) = reqs
        sched.quick = quick
        free = len(sched.arena._free)
        (tag,) = sched._send(reqs, False)
    assert tag < 0 and tag != mine[0] and mine[0] not in sched.reads
    assert sched.tag_of[(layer, e)] == tag and sched.reads[tag].urgent
    assert len(sched.arena._free) == free + 1  # the scheduler's slot given back
    assert (layer, e) in sched.early and ec.stats.quick_misses == 1
    sched.drain()
    assert sched.row(layer)[e] == sched.arena.slot_of[(layer, e)]
    books_whole(sched)
    ec.close()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("policy", ["lookahead", "demand"])
@pytest.mark.parametrize(
    "lag,fused", [(None, False), (48, False), (48, True)], ids=["lag-default", "lag48", "fused"]
)
def test_quick_misses_through_the_device_gate_equal_sync(store, family, policy, lag, fused):
    """(`fused`: the board's write and the gate in one kernel, decode_gate_fused)"""
    assert cuda_ready()
    path = store(family)
    # (half the experts: a reserve of 4 fits, at most half the arena's slots; a fifth's 3
    # slots would refuse it)
    ids, gb = prompt_ids(24, seed=7), arena_gb(path, 0.5)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead=policy)
    ref = decode(sync, ids, 12)
    model, _ = strata_mlx.load(
        path, arena_gb=gb, read_ahead=policy, decode_gate=True, decode_token_below=0.0,
        decode_quick_misses=4, decode_lag=lag, decode_layers_chunk=8 if lag else None,
        decode_gate_fused=fused,
    )  # fmt: skip
    ec = model.expert_cache
    try:
        assert ec.pipelined.device_gate and ec.sched.residency.gate.board_on
        assert ec.sched.residency.gate.board_fused == fused
        got = decode(model, ids, 12)
        assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
        s = ec.stats
        given_up_only_for_held_copies(s, ec.sched.reader.stats())
        assert s.gated_mode_tokens == 12 - UNGATED_FIRST and 0 < s.quick_misses <= s.misses
        assert ec.sched.quick.timeouts == 0 and ec.pipelined.board.fallbacks == 0
    finally:
        for m in (model, sync):
            m.expert_cache.close()


def test_a_request_the_quick_reads_superseded_in_its_batch_is_never_sent(store, monkeypatch):
    """A batch of the scheduler's (read-ahead for one layer, then the reserve's reads) records
    a read of an expert, the reader's quick misses read it, and the batch's next requests
    take that read into the books before the batch is sent: the recorded request is undone
    then, never sent, and the batch answers with the quick read's tag."""
    path = store("qwen3_moe")
    model, _ = quick_model(monkeypatch, path, 0.5, 2)
    ec = model.expert_cache
    sched, quick = ec.sched, ec.sched.quick
    layer = ec.layers[0]
    e, other = (int(x) for x in np.nonzero(sched.row(layer) < 0)[0][:2])  # two not resident
    with sched.lock:
        quick.refill(None)
        sched.quick = None
        first = sched._requests([(layer, e)], None, None)  # recorded, not sent
        sched.quick = quick
    gate = sched.residency.gate
    gate.board_row(layer)[1] = e
    gate.board_row(layer)[0] = 78
    assert quick.wait(quick.watch(layer, 78, 1, []))  # the reader reads it meanwhile
    requests = sched.reader.stats()["requests_done"] + sched.reader.stats()["in_flight"]
    with sched.lock:
        second = sched._requests([(layer, other)], None, None)  # (takes the quick read in)
        tags = sched._send(first + second, False)
    assert tags[0] < 0 and tags[0] == sched.tag_of[(layer, e)] and tags[1] == second[0][0]
    assert not sched.superseded and first[0][0] not in sched.reads
    sched.drain()
    st = sched.reader.stats()
    assert st["requests_done"] + st["in_flight"] <= requests + 2  # the quick read's, other's
    assert sched.row(layer)[e] == sched.arena.slot_of[(layer, e)] >= 0
    assert sched.row(layer)[other] == sched.arena.slot_of[(layer, other)] >= 0
    books_whole(sched)
    assert not quick.flight.any()
    ec.close()


def test_a_reserve_past_half_the_arena_is_refused_in_one_line(store, monkeypatch):
    from strata_mlx.config import OptionError

    with pytest.raises(OptionError, match=r"^decode_quick_misses 999: the arena has \d+ slots"):
        quick_model(monkeypatch, store("qwen3_moe"), 0.5, 999)
