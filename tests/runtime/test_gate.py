"""Gated decode (strata_mlx.stream.gate, custom_kernels/gate.py): the gate table each read
announces its landing in, and the gate kernel that waits on it.

Dev machine: the reader's ready words (stored after a record lands, never for a failed
read), the table the scheduler keeps against the arena's residency after a decode, gated
decode against the per-layer handshake on this CPU (the host's gate: tests/runtime/
test_decode.py's VARIANTS run every family). GPU (`-m gpu`): the kernel waits for a word a
host thread stores, gives up past its timeout, and a gated decode through the device gate
equals the per-layer handshake bit for bit."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import warnings

import mlx.core as mx
import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import stream_generate
from strata_mlx.stream.gate import CLOSED, FAILED, GateTable
from strata_mlx.stream.prediction import Predictor
from strata_mlx.stream.reader import ALIGNMENT, READY_FAILED, Reader
from strata_mlx.stream.stats import ExpertStats

# With the device gate the decoder's first token runs ungated (PipelinedDecoder._loads_code:
# no token ran with its cache's shapes yet), so that its kernels are loaded before a gate waits.
UNGATED_FIRST = 1


def decode(model, ids, n=10):
    out = [(r.token, np.array(r.logprobs)) for r in stream_generate(model, None, ids, n)]
    return [t for t, _ in out], np.stack([lp for _, lp in out])


def arena_gb(path, fraction: float) -> float:
    m = load_manifest(path)
    slots = max(1, round(fraction * m.num_experts * len(m.moe_layers)))
    return slots * m.layout.record_bytes / 1024**3


def aligned(n: int) -> np.ndarray:
    raw = np.zeros(n + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + n]


def file_words_dest(tmp_path, records: int, words: int, seed: int):
    """A file of `records` random 8 KB records, `words` ready words (-1), and room for 3
    records to land in."""
    data = np.random.default_rng(seed).integers(0, 256, records * 8192, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    return data, str(path), np.full(words, -1, dtype=np.int32), aligned(3 * 8192)


@pytest.mark.parametrize("split", [0, 4096])
def test_a_read_stores_its_ready_word_only_once_landed_and_failed_when_short(tmp_path, split):
    data, path, words, dest = file_words_dest(tmp_path, 3, 4, seed=0)
    with Reader(2, split=split) as r:
        f = r.open(path, direct=False)
        at = words.ctypes.data
        reqs = [(i, f, i * 8192, 8192, dest.ctypes.data + i * 8192, None, (at + 4 * i, 10 + i))
                for i in range(3)]  # fmt: skip
        # the last one reads past the end of the file: a short read stores READY_FAILED
        reqs.append((3, f, 3 * 8192, 8192, dest.ctypes.data, None, (at + 12, 13)))
        r.submit(reqs, True)
        done = {t: err for t, err, _ in r.wait([0, 1, 2, 3], None)}
    assert done[3] != 0 and not any(done[t] for t in range(3))
    assert words.tolist() == [10, 11, 12, READY_FAILED]
    assert np.array_equal(dest, data)


@pytest.mark.parametrize("split", [0, 4096])
def test_a_submitted_read_is_pending_a_corrupt_one_failed_a_cancelled_one_still_pending(
    tmp_path, split
):
    from strata_mlx.format.checksums import checksum

    data, path, words, dest = file_words_dest(tmp_path, 2, 3, seed=1)
    words[:] = READY_FAILED  # earlier reads of these records failed
    at, good = words.ctypes.data, checksum("crc32c", data[:8192])
    with Reader(2, split=split, start_paused=True) as r:
        f = r.open(path, direct=False, checksum="crc32c")
        r.submit(
            [
                (0, f, 0, 8192, dest.ctypes.data, good, (at, 5)),
                (1, f, 8192, 8192, dest.ctypes.data + 8192, good ^ 1, (at + 4, 6)),
            ],
            True,
        )
        r.submit([(2, f, 0, 8192, dest.ctypes.data + 16384, good, (at + 8, 7))])
        assert words.tolist() == [-1, -1, -1]  # pending from their submission
        assert r.cancel([2]) == [2]
        r.resume()
        done = {t: err for t, err, _ in r.wait([0, 1], None)}
    assert done[0] == 0 and done[1] != 0
    assert words.tolist() == [5, READY_FAILED, -1]


def test_a_request_with_a_bad_ready_word_is_refused(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(4096))
    dest = aligned(4096)
    with Reader(1) as r:
        f = r.open(str(path), direct=False)
        for ready, what in (((0, 1), "NULL"), ((dest.ctypes.data + 2, 1), "aligned"), (5, "ready")):
            with pytest.raises((ValueError, TypeError), match=what):
                r.submit([(0, f, 0, 4096, dest.ctypes.data, None, ready)], True)


def test_the_gate_table_matches_residency_after_a_decode(store):
    """Every expert the arena holds landed is in the table at its slot; nothing else is."""
    path = store("qwen3_moe")
    model, _ = strata_mlx.load(
        path, arena_gb=arena_gb(path, 0.25), read_ahead="lookahead", decode_gate=True,
        decode_token_below=0.0,
    )  # fmt: skip
    ec = model.expert_cache
    decode(model, prompt_ids(24, seed=3), 8)
    ec.sched.drain()
    table = ec.sched.residency.gate.table
    want = np.full_like(table, -1)
    for key, slot in ec.arena.slot_of.items():
        want[ec.sched.residency.gate.pos[key[0]], key[1]] = slot
    assert ec.stats.gated_mode_tokens > 0 and ec.stats.misses > 0
    assert np.array_equal(table, want)
    ec.close()


def gated_and_sync(path, fraction: float, ids, n: int):
    """(gated model, per-layer handshake model), each having decoded `n` tokens after `ids`
    with lookahead in an arena of `fraction` of the experts: their tokens and log-probabilities
    asserted equal."""
    gb = arena_gb(path, fraction)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead="lookahead")
    ref = decode(sync, ids, n)
    model, _ = strata_mlx.load(
        path, arena_gb=gb, read_ahead="lookahead", decode_gate=True, decode_token_below=0.0
    )
    got = decode(model, ids, n)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    return model, sync


def test_gated_decode_recomputes_nothing_and_counts_every_lookup(store):
    model, sync = gated_and_sync(store("qwen3_next"), 0.25, prompt_ids(24, seed=21), 10)
    s, r = model.expert_cache.stats, sync.expert_cache.stats
    assert s.recomputed_layers == 0 and s.gate_timeouts == 0
    assert s.gated_mode_tokens == 10 and s.lookups == r.lookups
    assert s.misses > 0 and s.streamed_ahead > 0
    for m in (model, sync):
        m.expert_cache.close()


def test_a_gate_table_without_a_device_has_no_device_address():
    g = GateTable(TableShape(layers=[1, 3]))
    assert g.table.shape == (2, 8) and (g.table == -1).all()
    assert (g.spare_row() == 0).all()  # (landed in slot 0: a gate on it passes at once)
    address, value = g.ready((3, 2), 7)
    assert address == g.table.ctypes.data + 4 * (8 + 2) and value == 7
    g.clear((3, 2))
    with pytest.raises(RuntimeError, match="not mapped"):
        g.row_address(1)


def test_closing_a_mapped_table_opens_every_gate_and_waits_for_the_device(monkeypatch):
    """A gate still polling as its table closes (a token abandoned mid-way: a read error,
    or close() from another thread) gives up at once instead of reading an unmapped page,
    which would fault the device's context for good: every word not landed reads CLOSED,
    and the device is waited for before the mapping goes."""
    from strata_mlx.stream import reader

    seen = []
    monkeypatch.setattr(reader, "map_host", lambda address, nbytes: address)
    monkeypatch.setattr(mx, "synchronize", lambda *a: seen.append(("synchronize", None)))
    monkeypatch.setattr(reader, "unmap_host", lambda a: seen.append(("unmap", g.table.copy())))
    g = GateTable(TableShape(layers=[1, 3]), device=True)
    g.table[1, 2] = 7  # landed
    g.close()
    assert [what for what, _ in seen] == ["synchronize", "unmap"]
    want = np.full((2, 8), CLOSED, dtype=np.int32)
    want[1, 2] = 7
    assert np.array_equal(seen[1][1], want) and g.device_address is None
    g.close()  # once only
    assert len(seen) == 2


def mapped_table(monkeypatch) -> tuple[GateTable, list[str]]:
    """A table as if mapped for a device (map_host, unmap_host and mx.synchronize stood in
    for, in the order called)."""
    from strata_mlx.stream import reader

    seen: list[str] = []
    monkeypatch.setattr(reader, "map_host", lambda address, nbytes: address)
    monkeypatch.setattr(mx, "synchronize", lambda *a: seen.append("synchronize"))
    monkeypatch.setattr(reader, "unmap_host", lambda a: seen.append("unmap"))
    return GateTable(TableShape(layers=[1, 3]), device=True), seen


def test_a_table_closed_while_a_decode_runs_stays_mapped_until_it_ends(monkeypatch):
    """close() on another thread while a decode may still launch gates: those gates see
    CLOSED and give up, but they must not read an unmapped page, so the mapping outlives
    the decode."""
    g, seen = mapped_table(monkeypatch)
    with g.in_use():
        with g.in_use():  # (nested phases)
            g.fail_pending()
            assert (g.table == FAILED).all() and (g.spare_row() == 0).all()
            g.close()
            assert seen == [] and (g.table == CLOSED).all() and g.device_address is not None
            assert (g.spare_row() == 0).all()
        assert seen == []
    assert seen == ["synchronize", "unmap"] and g.device_address is None


def decoding_worker(model, on_leave=None):
    """A thread named "worker" decoding up to 400 tokens, its MLX streams ended after it, and
    `on_leave()` once its decode has left the expert cache: (the thread, an Event set at its
    first token, the RuntimeErrors it stopped with)."""
    from strata_mlx.runtime.threads import last_on_thread

    started, errors = threading.Event(), []

    def worker():
        try:
            for _ in stream_generate(model, None, prompt_ids(24, seed=9), 400):
                started.set()
                time.sleep(0.005)
        except RuntimeError as e:
            errors.append(str(e))
        if on_leave is not None:
            on_leave()

    t = threading.Thread(target=last_on_thread, args=(worker,), name="worker")
    t.start()
    return t, started, errors


def test_a_cache_closed_under_a_decode_on_another_thread_unmaps_after_it(store, monkeypatch):
    """The server's shutdown closes the expert cache while its worker may be decoding: the
    worker stops with the cache's one-line error, and the table is unmapped only once its
    decode has left the expert cache's phase (the unmapping runs on the worker's thread)."""
    from strata_mlx.runtime import deferred, experts
    from strata_mlx.stream import reader

    path = store("qwen3_moe")
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(reader, "map_host", lambda address, nbytes: address)
    monkeypatch.setattr(reader, "unmap_host", lambda a: seen.append(("unmap", thread())))
    # The table mapped as on CUDA; the decode's gate stays the host's (no device here, so
    # no gate kernel to load either).
    monkeypatch.setattr(experts, "GateTable", lambda m, device, reader: GateTable(m, True, reader))
    monkeypatch.setattr(deferred, "load_gate", lambda table, k, depth, wide=None: None)
    model, _ = strata_mlx.load(
        path, arena_gb=arena_gb(path, 0.25), decode_gate=True, decode_token_below=0.0
    )
    ec = model.expert_cache
    assert ec.sched.residency.gate.device_address is not None
    ec.pipelined.device_gate = False  # (no device here: the host's gate)

    def thread() -> str:
        return threading.current_thread().name

    t, started, errors = decoding_worker(model, lambda: seen.append(("decode left", thread())))
    assert started.wait(60)
    ec.close()
    seen.append(("closed", thread()))
    t.join(60)
    assert errors == ["expert cache is closed"]
    assert ("unmap", "worker") in seen and ("unmap", "MainThread") not in seen
    assert seen.index(("closed", "MainThread")) < seen.index(("unmap", "worker"))


def test_an_abandoned_token_fails_its_words_until_the_device_is_idle(monkeypatch):
    g, seen = mapped_table(monkeypatch)
    g.table[1, 2] = 7  # landed
    g.abandon()
    # the abandoning thread waits for its own gates (another thread's synchronize would not)
    assert seen == ["synchronize"]
    want = np.full((2, 8), FAILED, dtype=np.int32)
    want[1, 2] = 7
    assert np.array_equal(g.table, want)
    g.reset()
    assert seen == ["synchronize"] * 2  # a gate may still be queued behind the abandoned token
    want[want == FAILED] = -1
    assert np.array_equal(g.table, want)
    g.reset()  # nothing failed: no wait for the device
    assert seen == ["synchronize"] * 2


def test_a_read_landing_while_reset_waits_for_the_device_stays_landed(monkeypatch):
    """reset() waits for the device, and reads of the abandoned token (read-ahead, a
    prefill's) may land meanwhile: a word they store is a landed slot and must not be reset
    to -1 (its expert resident, the gates that need it would each wait out their timeout;
    the host's gate would fail the layer)."""
    import ctypes

    g, seen = mapped_table(monkeypatch)
    g.abandon()  # every word FAILED; the read of (3, 4) is still in flight
    at, slot = g.ready((3, 4), 6)

    def synchronize(*a):
        seen.append("synchronize")
        ctypes.c_int32.from_address(at).value = slot  # the reader's thread stores it meanwhile

    monkeypatch.setattr(mx, "synchronize", synchronize)
    g.reset()
    assert seen == ["synchronize"] * 2  # abandon's, then reset's
    assert g.table[1, 4] == 6 and (g.table[0] == -1).all() and (g.table[1, :4] == -1).all()


def test_replace_words_replaces_only_the_words_holding_the_value():
    from strata_mlx.stream.reader import replace_words

    words = np.array([-1, 5, -1, READY_FAILED, 0], dtype=np.int32)
    assert replace_words(words.ctypes.data, 4, -1, READY_FAILED) == 2
    assert words.tolist() == [READY_FAILED, 5, READY_FAILED, READY_FAILED, 0]
    assert replace_words(words.ctypes.data, 0, 0, 1) == 0
    with pytest.raises(ValueError):
        replace_words(words.ctypes.data + 2, 1, 0, 1)


def test_abandon_and_reset_never_overwrite_a_word_a_reader_thread_lands(tmp_path):
    """The reader's threads store landed slots while abandon() and reset() run on the
    decoding thread: a word replaced only where it still holds the value looked for (one
    atomic step a word), so every read that landed reads its slot in the end."""
    layers, words = 64, 64 * 8
    data = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    dest = aligned(4096)
    for _ in range(20):
        g = GateTable(TableShape(layers=range(layers)))
        with Reader(2) as r:
            f = r.open(str(path), direct=False)
            ready = [(g.address + 4 * i, i % 7) for i in range(words)]
            r.submit([(i, f, 0, 4096, dest.ctypes.data, None, ready[i]) for i in range(words)])
            while r.stats()["requests_done"] < words:
                g.abandon()
                g.reset()
            r.wait(list(range(words)), None)
        assert np.array_equal(g.table.reshape(-1), np.arange(words) % 7)


def fail_third_tokens_last_claim(monkeypatch):
    """ExpertCache.claim raising a stand-in read error at the third token's last MoE layer
    (patched); the original, to patch back."""
    from strata_mlx.runtime.experts import ExpertCache

    claim, calls = ExpertCache.claim, []

    def failing(self, layer, needed, observe=True):
        calls.append(layer)
        if len(calls) == 3 * len(self.layers):
            raise OSError("a stand-in read error")
        return claim(self, layer, needed, observe)

    monkeypatch.setattr(ExpertCache, "claim", failing)
    return claim


def test_an_error_mid_token_abandons_its_gates_and_the_next_generation_is_exact(store, monkeypatch):
    """A gated decode stopped by an error leaves no word to wait for: every word not landed
    reads FAILED (queued gates give up at once); the next generation starts with them -1
    again and decodes as the per-layer handshake does."""
    from strata_mlx.runtime.experts import ExpertCache

    path = store("qwen3_moe")
    ids = prompt_ids(24, seed=5)
    sync, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.25), decode="sync")
    ref = decode(sync, ids, 6)
    model, _ = strata_mlx.load(
        path, arena_gb=arena_gb(path, 0.25), decode_gate=True, decode_token_below=0.0
    )
    ec = model.expert_cache
    claim = fail_third_tokens_last_claim(monkeypatch)
    with pytest.raises(OSError, match="stand-in"):
        decode(model, ids, 6)
    table = ec.sched.residency.gate.table
    assert (table == FAILED).any() and not (table == -1).any()
    ec.idle()  # as the next generation starts
    assert not (table == FAILED).any()
    monkeypatch.setattr(ExpertCache, "claim", claim)
    got = decode(model, ids, 6)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    assert ec.stats.gated_mode_tokens > 0
    for m in (model, sync):
        m.expert_cache.close()


def emulated_device_gate(monkeypatch, seconds: float = 5.0) -> dict:
    """The device gate on this CPU, at its worst: the gate call holds the thread building
    the token (as a CUDA allocation that synchronizes the device would hold it) until every
    record the layer reads has landed, then hands over their slots; past `seconds` it gives
    up (late); with the flag it returns the microseconds it held, as the kernel does. The
    table's "device address" is its host address. Fill the returned dict's
    "rows" (device address -> host row) once the model is loaded."""
    import strata_mlx.runtime.deferred as deferred
    import strata_mlx.runtime.experts as experts
    import strata_mlx.stream.reader as reader

    monkeypatch.setattr(experts, "device_gate_available", lambda: True)
    monkeypatch.setattr(reader, "map_host", lambda address, nbytes: address)
    monkeypatch.setattr(reader, "unmap_host", lambda address: None)
    seen = {"rows": {}, "held": 0, "waited_us": 0, "unknown": []}

    def gate(ids, row_at):
        at, stop_at = row_at.tolist()
        row, wanted, held = seen["rows"].get(at), ids.tolist(), seen["held"]
        if row is None:  # (a row not among the layers': the table's spare, run at load)
            seen["unknown"].append((at, len(wanted)))
            row = np.ctypeslib.as_array((ctypes.c_int32 * (max(wanted) + 1)).from_address(at))
        stop = ctypes.c_int32.from_address(stop_at)
        t0 = time.monotonic()
        deadline = t0 + seconds
        # (as the kernel: waits while a word is -1 and the stop word is 0, gives up at once on
        # CLOSED or FAILED)
        while -1 in (words := [int(row[e]) for e in wanted]) and time.monotonic() < deadline:
            if min(words) < -1 or stop.value:
                break
            seen["held"] += 1
            time.sleep(0.0005)
        waited_us = int((time.monotonic() - t0) * 1e6) if seen["held"] > held else 0
        seen["waited_us"] += waited_us
        words = [int(row[e]) for e in wanted]
        slots, late = [max(w, 0) for w in words], int(min(words) < 0)
        return mx.array(slots, dtype=mx.uint32), mx.array([late, waited_us], dtype=mx.int32)

    def board(ids, board_at, seq):
        """The board's kernel (where asked for: decode_gate_board): the ids, then the
        sequence number, into the board row at `board_at` as the layer is built (the gate
        holds the building thread until its records land: a board written only once the
        layer was submitted would never be read). emulated_board counts its calls."""
        vals = ids.tolist()
        row = np.ctypeslib.as_array(
            (ctypes.c_int32 * (1 + len(vals))).from_address(board_at.item())
        )
        row[1:] = vals
        row[0] = seq.item()
        return ids

    def board_gate(ids, k, board_at, seq, row_at):
        """The board and the gate's one kernel (decode_gate_fused): the two above, looked up
        when called (a test that replaces either replaces it here too)."""
        return deferred.gate(deferred.board(ids, board_at, seq)[:k], row_at)

    monkeypatch.setattr(deferred, "gate", gate)
    monkeypatch.setattr(deferred, "board", board)
    monkeypatch.setattr(deferred, "board_gate", board_gate)
    return seen


def spy_calls(monkeypatch) -> dict[str, list]:
    """The threads that call MLX's evals and the checks' ways of reading routing ids, by
    name, from here on: an eval on the checks' thread, or a read there of an array the
    decoding thread builds on (`token_ids`, `host_ids` of a layer's routing ids: only
    `split_ids` of its own joined array is safe), races the decoding thread's graph."""
    import strata_mlx.runtime.deferred as deferred
    import strata_mlx.runtime.experts as experts

    calls: dict[str, list] = {}
    for owner, name in [(mx, "eval"), (mx, "async_eval")] + [
        (m, f) for m in (deferred, experts) for f in ("split_ids", "token_ids", "host_ids")
    ]:
        if not hasattr(owner, name):
            continue
        real, seen = getattr(owner, name), calls.setdefault(name, [])

        def wrapped(*a, real=real, seen=seen, **kw):
            seen.append(threading.current_thread())
            return real(*a, **kw)

        monkeypatch.setattr(owner, name, wrapped)
    return calls


def load_emulated(monkeypatch, path, fraction: float, **opts):
    """(a gated model of `path` in an arena of `fraction` of its experts, through the
    emulated device gate; that gate's `seen`)."""
    seen = emulated_device_gate(monkeypatch)
    model, _ = strata_mlx.load(
        path, arena_gb=arena_gb(path, fraction), decode_gate=True, decode_token_below=0.0, **opts
    )
    table = model.expert_cache.sched.residency.gate
    seen["rows"] = {table.row_address(l): table.row(l) for l in model.expert_cache.layers}
    return model, seen


@pytest.mark.parametrize("fused", [False, True])
def test_the_board_kernel_is_loaded_for_every_width_its_layers_join(monkeypatch, fused):
    """load_gate: the board's kernel (compiled per width; with `board_fused`, the board and
    gate's one kernel, gating the k first) runs at load for a token's k ids joined with up to
    `depth` routers' ids, k each or `wide` each (lookahead_extra), widths past a board row's
    BOARD_IDS left out (such layers skip the board)."""
    import strata_mlx.runtime.deferred as deferred
    from custom_kernels.gate import BOARD_IDS

    widths, gated = [], []
    monkeypatch.setattr(deferred, "gate", lambda ids, at: (ids, ids))
    monkeypatch.setattr(deferred, "board", lambda ids, at, seq: widths.append(ids.size) or ids)

    def board_gate(ids, k, board_at, seq, row_at):
        widths.append(ids.size)
        gated.append(k)
        return ids[:k], ids[:2]

    monkeypatch.setattr(deferred, "board_gate", board_gate)

    class Table:
        board_on = True
        board_fused = fused

        def spare_address(self):
            return 1, 2

        def gate_at(self, row):
            return mx.array([row, 3], dtype=mx.uint64)

    for depth, wide, want in (
        (2, None, [10, 20, 30]),
        (2, 13, [10, 23, 36]),
        (3, 20, [10, 30, 50]),
    ):
        widths.clear()
        gated.clear()
        deferred.load_gate(Table(), 10, depth, wide)
        assert widths == want and max(widths) <= BOARD_IDS
        assert gated == ([10] * len(want) if fused else [])


def test_loading_a_device_gated_model_runs_its_gate_once_on_the_spare_row(store, monkeypatch):
    """With the device gate, loading runs the gate's kernel once, on the table's spare row
    (every word slot 0, landed: it passes at once), for a token's k routed ids: its first
    launch (a compile, and a module's load) comes before the first gated token, not in it.
    Decode's gates read the layers' rows only."""
    path = store("qwen3_moe")
    model, seen = load_emulated(monkeypatch, path, 0.2)
    table = model.expert_cache.sched.residency.gate
    k = load_manifest(path).config["num_experts_per_tok"]
    assert seen["unknown"] == [(table.spare_address()[0], k)] and seen["held"] == 0
    decode(model, prompt_ids(24, seed=5), 4)
    assert model.expert_cache.stats.gated_mode_tokens > 0 and len(seen["unknown"]) == 1
    model.expert_cache.close()


@pytest.mark.parametrize("asked", [True, None], ids=["asked", "default"])
def test_a_gate_kernel_that_fails_to_load_warns_and_decodes_exactly(store, asked, monkeypatch):
    """Where the gate's kernel cannot load (no NVRTC, a device before sm_70), loading the model
    warns once in one line and decodes the per-layer handshake's tokens and log-probabilities:
    with `decode_gate` asked for, gated on the host's gate (every decode token gated: that
    gate loads no code, so none runs ungated); left to its default, ungated, the table
    closed, as where no device can wait. No device gate is called after the load."""
    import strata_mlx.runtime.deferred as deferred
    import strata_mlx.runtime.loader as loader

    path = store("qwen3_moe")
    ids = prompt_ids(24, seed=7)
    gb = arena_gb(path, 0.2)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync")
    ref = decode(sync, ids, 6)
    emulated_device_gate(monkeypatch)
    monkeypatch.setattr(loader, "device_gate_available", lambda: True)  # (the default's test)
    calls = []

    def broken(ids, row_at):
        calls.append(row_at.tolist())
        raise RuntimeError("[cuda_kernel] NVRTC compilation failed.\nstrata_gate: long log")

    monkeypatch.setattr(deferred, "gate", broken)
    with pytest.warns(RuntimeWarning) as caught:
        model, _ = strata_mlx.load(path, arena_gb=gb, decode_gate=asked, decode_token_below=0.0)
    (w,) = [w for w in caught if "device gate" in str(w.message)]
    assert "NVRTC compilation failed." in str(w.message) and "\n" not in str(w.message)
    ec = model.expert_cache
    assert not ec.pipelined.device_gate and len(calls) == 1
    assert ec.pipelined.gated == bool(asked)
    assert (ec.sched.residency.gate is None) == (asked is None)
    got = decode(model, ids, 6)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    assert ec.stats.gated_mode_tokens == (6 if asked else 0) and ec.stats.misses > 0
    assert len(calls) == 1  # (the load's only)
    for m in (model, sync):
        m.expert_cache.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_device_gate_holding_the_building_thread_gets_its_reads_from_the_checks(
    store, family, monkeypatch
):
    """Gated decode's checks run on a thread of their own: a layer's reads go out even while
    the thread building the token is held until they land (before, its check waited for
    that thread to build the next layer: every such gate waited out its timeout). Tokens
    and log-probabilities equal the per-layer handshake's, no gate gives up."""
    path = store(family)
    ids = prompt_ids(24, seed=11)
    gb = arena_gb(path, 0.2)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead="lookahead")
    ref = decode(sync, ids, 8)
    model, seen = load_emulated(monkeypatch, path, 0.2, read_ahead="lookahead")
    ec = model.expert_cache
    assert ec.pipelined.device_gate and ec.pipelined.checks is not None
    calls = spy_calls(monkeypatch)
    got = decode(model, ids, 8)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    # The checks' thread evaluates nothing and reads only each layer's own array (spy_calls)
    checks = ec.pipelined.checks._thread
    assert calls["eval"] and checks not in calls["eval"] + calls["async_eval"]
    assert checks in calls["split_ids"] and checks not in calls["token_ids"] + calls["host_ids"]
    s = ec.stats
    assert s.gate_timeouts == 0 and s.gated_mode_tokens == 8 - UNGATED_FIRST and s.misses > 0
    assert seen["held"] > 0 and s.check_s > 0  # gates did hold the building thread
    # ... and the time they stood is read back with their flags, once a token
    assert s.gate_wait_s == pytest.approx(seen["waited_us"] * 1e-6) and s.gate_wait_s > 0
    assert 0 < s.check_cpu_s <= s.check_s  # (CPU time after the routing's waits, inside them)
    assert 0 < s.check_claim_s < s.check_s  # (from the routing read to the reads submitted)
    for m in (model, sync):
        m.expert_cache.close()
    assert not ec.pipelined.checks._thread.is_alive()


def test_a_token_that_may_load_kernels_runs_ungated_and_the_rest_stay_gated(store, monkeypatch):
    """With the device gate, a token runs ungated where it may launch kernels the process has
    not loaded (CUDA may synchronize the context to load one, which a gate waiting for a
    read's copy would hold until it gave up): the first token (no token ran with its cache's
    shapes yet), the token whose keys reach 256 (MLX's attention moves to cuDNN there) and
    the token that grows the KV cache's buffer (cuDNN's attention plans are keyed by its
    shape). The prompt's last token (a generation's first) never gates: a second generation
    of the same length runs ungated the same three. Tokens equal the per-layer handshake's."""
    path = store("qwen3_moe")
    ids = prompt_ids(250, seed=3)  # (256 keys at the 7th token; the buffer grows at the 8th)
    gb = arena_gb(path, 0.2)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync")
    ref = decode(sync, ids, 12)
    model, _ = load_emulated(monkeypatch, path, 0.2)
    s = model.expert_cache.stats
    for gated in (9, 9):  # 12 tokens: the first, the 256th key and the growth ungated
        before = s.gated_mode_tokens
        got = decode(model, ids, 12)
        assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
        assert s.gated_mode_tokens - before == gated and s.gate_timeouts == 0
    for m in (model, sync):
        m.expert_cache.close()


def test_the_keys_reaching_an_attention_step_or_a_growing_buffer_load_code():
    """The caches' side of PipelinedDecoder._loads_code: the next token grows a buffer, or its
    keys reach 256 or 1025, where MLX's CUDA attention for one token changes kernels (a
    window's keys stop at its size)."""
    from strata_mlx.models.base import KVCache, RotatingKVCache
    from strata_mlx.runtime.decode import _reaches_step

    def kv(offset: int, buffer: int) -> KVCache:
        c = KVCache()
        c.keys = c.values = mx.zeros((1, 1, buffer, 8))
        c.offset = offset
        return c

    assert _reaches_step(kv(255, 256)) and not kv(255, 256).grows(1)
    assert _reaches_step(kv(1024, 1280)) and not _reaches_step(kv(300, 512))
    assert kv(256, 256).grows(1) and not _reaches_step(kv(256, 256))
    assert KVCache().grows(1) and not _reaches_step(KVCache())
    window = RotatingKVCache(128)
    window.keys = window.values = mx.zeros((1, 1, 128, 8))
    window.offset = window._idx = 1024
    assert not _reaches_step(window) and not window.grows(1)


def test_the_gated_layers_array_ops_are_evaluated_once_before_the_first_gate(store, monkeypatch):
    """The device gate's first layer evaluates, before its gate, the ops the gated layers and
    their token's end launch (`DeferredHandshake._warm`: the joined ids with as many
    predictions as the layer makes and with fewer, down to none, and the flags' join), so
    that none is a first launch while a gate waits; once a model."""
    import strata_mlx.runtime.deferred as deferred
    from strata_mlx.runtime.deferred import DeferredHandshake

    path = store("qwen3_next")
    ids = prompt_ids(24, seed=11)
    model, _ = load_emulated(monkeypatch, path, 0.2, read_ahead="lookahead")
    gates, warmed, emulated, warm = [0], [], deferred.gate, DeferredHandshake._warm

    def gate(*args):
        gates[0] += 1
        return emulated(*args)

    def spy(self, inds, preds):
        warmed.append((gates[0], len(preds)))
        warm(self, inds, preds)

    monkeypatch.setattr(deferred, "gate", gate)
    monkeypatch.setattr(DeferredHandshake, "_warm", spy)
    for _ in range(2):
        decode(model, ids, 6)
    depth = model.expert_cache.read_ahead.depth
    assert warmed == [(0, depth)] and gates[0] > 0
    model.expert_cache.close()


def test_checks_aside_trace_the_routing_and_predictions_of_the_per_layer_handshake(
    store, monkeypatch
):
    """A routing trace of gated decode, whose checks read each layer's ids as ints from an
    array of its own, holds the same ids and lookahead predictions, dtypes included, as the
    per-layer handshake's trace of the same decode."""
    from strata_mlx.stream.stats import RoutingTrace

    path = store("qwen3_moe")
    ids = prompt_ids(24, seed=13)
    sync, _ = strata_mlx.load(
        path, arena_gb=arena_gb(path, 0.2), decode="sync", read_ahead="lookahead"
    )
    model, _ = load_emulated(monkeypatch, path, 0.2, read_ahead="lookahead")
    traces = []
    for m in (sync, model):
        trace = m.expert_cache.trace = RoutingTrace()
        decode(m, ids, 6)
        traces.append(trace)
        m.expert_cache.close()
    assert model.expert_cache.stats.gated_mode_tokens == 6 - UNGATED_FIRST
    want, got = traces
    assert want.predicted and sorted(got.ids) == sorted(want.ids)
    for field in ("ids", "predicted"):
        a, b = getattr(want, field), getattr(got, field)
        assert sorted(a) == sorted(b), field
        for layer in a:
            x, y = np.concatenate(a[layer]), np.concatenate(b[layer])
            assert x.dtype == y.dtype and np.array_equal(x, y), (field, layer)


def test_a_check_failing_aside_is_raised_and_the_next_generation_is_exact(store, monkeypatch):
    """A check that raises on the checks' thread: the gates behind it give up at once (no
    5 s waits), the error reaches the decoding thread, and the next generation decodes as
    the per-layer handshake does."""
    from strata_mlx.runtime.experts import ExpertCache

    path = store("qwen3_moe")
    ids = prompt_ids(24, seed=5)
    sync, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.25), decode="sync")
    ref = decode(sync, ids, 6)
    model, _ = load_emulated(monkeypatch, path, 0.25)
    ec = model.expert_cache
    table = ec.sched.residency.gate
    claim = fail_third_tokens_last_claim(monkeypatch)
    t = time.monotonic()
    with pytest.raises(OSError, match="stand-in"):
        decode(model, ids, 6)
    assert time.monotonic() - t < 4  # no gate waited out its 5 s
    assert (table.table == FAILED).any() and not (table.table == -1).any()
    monkeypatch.setattr(ExpertCache, "claim", claim)
    got = decode(model, ids, 6)  # (its start: ExpertCache.idle)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    for m in (model, sync):
        m.expert_cache.close()


def test_a_cache_closed_while_its_decode_waits_for_a_check_aside_stops_it(store, monkeypatch):
    """close() from another thread (a server shutting down) while gated decode's checks run
    aside: the decode stops with the cache's one-line error, and the checks' thread ends."""
    path = store("qwen3_moe")
    model, _ = load_emulated(monkeypatch, path, 0.25)
    ec = model.expert_cache
    t, started, errors = decoding_worker(model)
    assert started.wait(60)
    deadline = time.monotonic() + 60  # (the first token runs ungated: no check aside yet)
    while ec.pipelined.checks._thread is None and time.monotonic() < deadline:
        time.sleep(0.01)
    ec.close()
    t.join(60)
    assert not t.is_alive() and errors == ["expert cache is closed"]
    assert not ec.pipelined.checks._thread.is_alive()


def cuda_ready() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


def run_gate(g: GateTable, ids: list[int], timeout: int | None = None):
    """The gate kernel over `ids` of `g`'s first row: (slots, its give-up flag, seconds to
    evaluate, the microseconds its longest pair waited by the device's clock)."""
    from custom_kernels.gate import gate

    row_at = g.gate_at(g.row_address(0))
    t0 = time.perf_counter()
    slots, late = gate(mx.array(ids, dtype=mx.uint32), row_at, timeout)
    mx.eval(slots, late)
    seconds = time.perf_counter() - t0
    flag, waited_us = late.tolist()
    return slots.tolist(), flag, seconds, waited_us


@pytest.mark.gpu
def test_the_gate_kernel_waits_for_a_word_a_host_thread_stores():
    assert cuda_ready()
    g = GateTable(TableShape(), device=True)
    g.table[0, 1] = 4  # resident already

    def land():
        time.sleep(0.05)
        g.table[0, 6] = 9
        time.sleep(0.05)
        g.table[0, 2] = 3

    # (compiled first for three pairs, on the landed word: the timed run's wait is the device's)
    assert run_gate(g, [1, 1, 1])[:2] == ([4, 4, 4], 0)
    t = threading.Thread(target=land)
    t.start()
    slots, late, waited, device_us = run_gate(g, [1, 6, 2])
    t.join()
    assert slots == [4, 9, 3] and late == 0 and waited >= 0.09
    # (the device's own count of its wait: from its launch to the last word, ~0.1 s)
    assert 50_000 <= device_us <= waited * 1e6
    g.close()


HELD_COPY = """
import ctypes, json, sys, threading, time
import mlx.core as mx
import numpy as np
from custom_kernels.gate import gate
from strata_mlx.stream.arena import Arena
from strata_mlx.stream.gate import GateTable
from strata_mlx.stream.reader import Reader

class Shape:
    num_experts, moe_layers = 8, [0]
    def layer_position(self, layer):
        return 0

path, held_us, unsubmitted, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
waits_on = 3 if unsubmitted else 2  # (the gate's word: the held read's own, or one never read)
cu = ctypes.CDLL("libcuda.so.1")
rb = 1 << 20
g = GateTable(Shape(), device=True)
row_at = g.gate_at(g.row_address(0))
g.table[0, 1] = 0  # (landed: the gate compiled and run once, passing at once)
mx.eval(*gate(mx.array([1], dtype=mx.uint32), row_at, 3000))
arena = Arena(1, rb, on_device=True, device_memory=True)
mx.eval(arena.rows.astype(mx.uint32).sum())
ctx, freed = ctypes.c_void_p(), ctypes.c_uint64()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cu.cuMemAlloc_v2(ctypes.byref(freed), 1 << 20) == 0

def free():  # waits in the driver for the device to go idle: past the gate
    cu.cuCtxSetCurrent(ctx)
    cu.cuMemFree_v2(freed)

with Reader(1, bounce=True, device_copy=True, record_bytes=rb) as r:
    r.copy_held_us = held_us
    if stop:
        r.native.stop_word = g.stop_address
    f = r.open(path, direct=False)
    slots, late = gate(mx.array([waits_on], dtype=mx.uint32) + 0, row_at, 3000)
    mx.async_eval(slots, late)
    time.sleep(0.2)  # the gate waits on the device for its word
    holder = threading.Thread(target=free)
    holder.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    r.submit([(1, f, 0, rb, arena.address(0), None, g.ready((0, 2), 0))], True)
    flag = late.tolist()[0]
    seconds = time.monotonic() - t0
    (done,) = r.wait([1])
    holder.join()
    held, stopped = r.stats()["copies_held"], r.stats()["gates_stopped"]
    r.native.stop_word = 0
ok = bool(np.array_equal(np.array(arena.rows[0] + 0), np.fromfile(path, np.uint8, rb)))
print(json.dumps(dict(seconds=seconds, late=flag, held=held, err=done[1], word=int(g.table[0, 2]),
                      bytes_ok=ok, stopped=stopped)))
g.close()
"""


@pytest.mark.gpu
def test_a_copy_held_behind_its_gate_gives_the_gate_up_at_once(tmp_path):
    """A record's device copy held behind the gate that waits for it (here: another thread
    frees device memory while the gate spins, which waits in the driver for the device to go
    idle and holds the copy queued meanwhile): with copy_held_us, the copy's ready word goes
    FAILED once it has waited that long, the gate gives up at once, the copy then lands and
    its word reads its slot; without it, the gate waits out its whole timeout (3 s here).
    A gate waiting on a word no read was submitted for (its check's thread may wait on the
    thread held in the driver) gives up at once too, for the table's stop word, which the
    watcher sets (the native reader's stop_word); without it the gate waits out its timeout."""
    import json
    import subprocess
    import sys

    assert cuda_ready()
    path = tmp_path / "record.bin"
    path.write_bytes(np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    runs = {}
    for case in ((50_000, 0, 1), (0, 0, 1), (50_000, 1, 1), (50_000, 1, 0)):
        args = [str(path)] + [str(a) for a in case]
        out = subprocess.run([sys.executable, "-c", HELD_COPY, *args],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        runs[case] = json.loads(out.stdout.strip().splitlines()[-1])
    for run in runs.values():
        assert run["late"] == 1 and run["err"] == 0 and run["word"] == 0 and run["bytes_ok"]
    released, waited = runs[50_000, 0, 1], runs[0, 0, 1]
    assert released["held"] == 1 and released["seconds"] < 1.0
    assert waited["held"] == 0 and waited["seconds"] >= 2.5 and waited["stopped"] == 0
    stopped, unstopped = runs[50_000, 1, 1], runs[50_000, 1, 0]
    assert stopped["held"] == 1 and stopped["stopped"] == 1 and stopped["seconds"] < 1.0
    assert unstopped["held"] == 1 and unstopped["seconds"] >= 2.5


def land_on_board(g: GateTable, row: np.ndarray, seq: int, seen: dict) -> threading.Thread:
    """A host thread, started, that stores expert 3's gate word (slot 8) only once the board
    row `row` holds `seq`, and keeps the five ids it then holds in `seen["ids"]`."""
    from strata_mlx.stream.reader import wait_word

    def land():
        if wait_word(row.ctypes.data, seq, 5.0) is not None:
            seen["ids"] = row[1:6].tolist()  # (in place before their sequence number)
            g.table[0, 3] = 8

    t = threading.Thread(target=land)
    t.start()
    return t


@pytest.mark.gpu
def test_the_board_kernel_writes_ids_then_their_sequence_number_and_orders_the_gate():
    """custom_kernels.gate.board on the device: a layer's joined ids land in its board row
    with the sequence number after them, the ids come out unchanged, and a gate fed its
    output runs after it (a host thread that sees the board's word stores the gate's word)."""
    from custom_kernels.gate import board, gate

    assert cuda_ready()
    g = GateTable(TableShape(), device=True)
    ids = mx.array([3, 1, 7, 2, 6], dtype=mx.uint32) + 0  # (computed on the device)
    at = mx.array([g.board_address(0)], dtype=mx.uint64)
    row = g.board_row(0)
    # Both kernels compiled first (NVRTC, ~1.2 s each on the H200; more on a slower host),
    # so that the host thread's 5 s wait below times the device, not the compiler.
    g.table[0, 1] = 1  # (resident: the warm gate passes at once)
    warm = board(ids, at, mx.array([10], dtype=mx.int32))
    mx.eval(warm, gate(warm[1:2], g.gate_at(g.row_address(0)), 2000)[0])
    assert row[0] == 10

    seen = {}
    t = land_on_board(g, row, 11, seen)
    out = board(ids, at, mx.array([11], dtype=mx.int32))
    slots, late = gate(out[:1], g.gate_at(g.row_address(0)), 2000)
    mx.eval(out, slots, late)
    t.join()
    assert row[0] == 11 and seen["ids"] == [3, 1, 7, 2, 6]
    assert out.tolist() == [3, 1, 7, 2, 6] and slots.tolist() == [8] and late.tolist()[0] == 0
    g.close()


@pytest.mark.gpu
def test_the_board_and_gate_kernel_writes_the_board_before_its_gate_waits():
    """custom_kernels.gate.board_gate on the device: the joined ids land in the board row with
    the sequence number after them before the first k wait at the gate (a host thread that
    sees the board's word stores the gate's word), and the gate's slots and flags are the
    two kernels' (the lone gate's on the board's output)."""
    from custom_kernels.gate import board, board_gate, gate

    assert cuda_ready()
    g = GateTable(TableShape(), device=True)
    ids = mx.array([3, 1, 7, 2, 6], dtype=mx.uint32) + 0  # (computed on the device)
    at = mx.array([g.board_address(0)], dtype=mx.uint64)
    row_at = g.gate_at(g.row_address(0))
    row = g.board_row(0)
    g.table[0, [3, 1]] = [4, 5]  # (resident: the warm kernels pass at once)
    warm = board_gate(ids, 2, at, mx.array([10], dtype=mx.int32), row_at, 2000)
    mx.eval(*warm)  # (compiled before the timed wait below: NVRTC, ~1.2 s)
    assert row[0] == 10 and warm[0].tolist() == [4, 5] and warm[1].tolist() == [0, 0]
    two = gate(board(ids, at, mx.array([10], dtype=mx.int32))[:2], row_at, 2000)
    mx.eval(*two)
    assert [a.tolist() for a in two] == [a.tolist() for a in warm]

    seen = {}
    g.table[0, 3] = -1  # (its read not landed: the gate waits for it)
    t = land_on_board(g, row, 11, seen)
    slots, late = board_gate(ids, 2, at, mx.array([11], dtype=mx.int32), row_at, 2000)
    mx.eval(slots, late)
    t.join()
    assert row[0] == 11 and seen["ids"] == [3, 1, 7, 2, 6]
    assert slots.tolist() == [8, 5] and late.tolist()[0] == 0
    g.close()


@pytest.mark.gpu
def test_the_gate_kernel_gives_up_past_its_timeout():
    assert cuda_ready()
    g = GateTable(TableShape(), device=True)
    slots, late, waited, device_us = run_gate(g, [5], timeout=50)
    # (the device's own count of its wait: the timeout, and no more than the host saw)
    assert late == 1 and waited >= 0.045 and 50_000 <= device_us <= waited * 1e6
    g.close()


@pytest.mark.gpu
@pytest.mark.parametrize("word", [CLOSED, FAILED])
def test_the_gate_kernel_gives_up_at_once_on_a_closed_or_failed_word(word):
    assert cuda_ready()
    g = GateTable(TableShape(), device=True)
    g.table[0, 1], g.table[0, 5] = 4, 2
    run_gate(g, [1, 5], timeout=5000)  # (compiled first: ~1.2 s on the H200, not a wait)
    g.table[0, 5] = word
    slots, late, waited, device_us = run_gate(g, [1, 5], timeout=5000)
    assert late == 1 and slots == [4, 0] and waited < 1 and device_us == 0  # (never polled)
    # ... and a gate after it, on landed words, reads no flag: the kernel zeroes its own
    # `late`, which may be a buffer the one before set (MLX reuses freed buffers)
    g.table[0, 5] = 2
    slots, late, waited, device_us = run_gate(g, [1, 5], timeout=5000)
    assert late == 0 and slots == [4, 2] and device_us == 0
    g.close()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_gated_decode_through_the_device_gate_equals_sync(store, family, monkeypatch):
    assert cuda_ready() and os.environ.get("STRATA_MLX_GATE", "device") == "device"
    calls = spy_calls(monkeypatch)
    model, sync = gated_and_sync(store(family), 0.1, prompt_ids(24, seed=7), 12)
    assert model.expert_cache.pipelined.device_gate
    s = model.expert_cache.stats
    # A gate may be given up for a copy held behind it (another thread's free while it spins:
    # test_fresh_gated_models_in_one_process_give_up_no_gate), its token recomputed; none
    # waits out its timeout.
    given_up_only_for_held_copies(s, model.expert_cache.sched.reader.stats())
    assert model.decoder.given_up == 0
    assert s.misses > 0 and s.gated_mode_tokens == 12 - UNGATED_FIRST
    checks = model.expert_cache.pipelined.checks._thread  # (reads only: spy_calls)
    assert checks not in calls["eval"] + calls["async_eval"] + calls["token_ids"]
    assert checks in calls["split_ids"] and checks not in calls["host_ids"]
    for m in (model, sync):
        m.expert_cache.close()


@pytest.mark.gpu
@pytest.mark.parametrize("board", [False, True])
def test_fresh_gated_models_in_one_process_give_up_no_gate(store, board):
    """Gated decode on the device in three fresh models of one process, the routing board off
    and on: no gate waits out its timeout (one given up for a held copy is), tokens and
    log-probabilities equal the per-layer handshake's.
    A thread freeing device or pinned memory while a gate spins holds every copy queued
    meanwhile until the gate gives up (its 5 s timeout): with the board on, the first models
    of a process gave up gates this way before decode_copy_held_ms (50 ms by default) gave
    such a gate up at once."""
    assert cuda_ready()
    path, ids = store("qwen3_next"), prompt_ids(24, seed=7)
    gb = arena_gb(path, 0.1)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead="lookahead")
    ref = decode(sync, ids, 12)
    sync.expert_cache.close()
    for model_number in range(3):
        model, _ = strata_mlx.load(
            path, arena_gb=gb, read_ahead="lookahead", decode_gate=True,
            decode_token_below=0.0, decode_gate_board=board,
        )  # fmt: skip
        got = decode(model, ids, 12)
        s, r = model.expert_cache.stats, model.expert_cache.sched.reader.stats()
        assert model.decoder.given_up == 0, model_number  # (none waited out its timeout)
        model.expert_cache.close()
        assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
        given_up_only_for_held_copies(s, r, model_number)
        assert s.misses > 0, model_number


def given_up_only_for_held_copies(s, r: dict, *context) -> None:
    """Of a gated decode's stats `s` and its reader's `r`: gates were given up only where a
    copy was held (its word, a queued read's, or any through the stop word, given up), and
    the hold ended: the reader's longest miss well under the gates' 5 s timeout."""
    names = ("urgent_max_ns", "copies_held", "words_given_up", "gates_stopped")
    seen = {k: r[k] for k in names}
    assert s.gate_timeouts == 0 or r["copies_held"] > 0, (*context, seen)
    if not r["gates_stopped"]:
        assert s.gate_timeouts <= r["copies_held"] + r["words_given_up"], (*context, seen)
    assert r["urgent_max_ns"] < 1e9, (*context, seen)


class TableShape:
    """The part of a manifest a gate table reads."""

    num_experts = 8

    def __init__(self, layers=(0,)):
        self.moe_layers = list(layers)

    def layer_position(self, layer):
        return self.moe_layers.index(layer)


def test_the_gate_kernel_type_checks_as_cxx(tmp_path):
    """The body MLX compiles, in the signature MLX writes for it, with the device's clock and
    pause stood in for: the host compiler checks its types (no CUDA compiler here)."""
    import shutil
    import subprocess

    from custom_kernels import gate

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = "\n".join(
        [
            "#include <cstdint>",
            "struct sk_dim3 { uint32_t x, y, z; };",
            "static sk_dim3 threadIdx;",
            "static unsigned long long sk_now_ns() { return 0; }",
            "static void sk_pause() {}",
            "static int atomicMax(int* a, int v) { int o = *a; if (v > o) *a = v; return o; }",
            "static void __syncthreads() {}",
            "template <int K, int TIMEOUT_US>",
            "void strata_gate(const uint32_t* ids, const uint64_t* row_at, uint32_t* slots,"
            " int32_t* late) {",
            gate.BODY,
            "}",
            "template void strata_gate<10, 5000000>(const uint32_t*, const uint64_t*, uint32_t*,"
            " int32_t*);",
        ]
    )
    (tmp_path / "gate.cpp").write_text(src)
    r = subprocess.run(
        [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", str(tmp_path / "gate.cpp")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr


def late_at(monkeypatch, layer: int, times: int = 1, waited_us: int | None = None) -> list[int]:
    """The host's gate, with the gate of `layer` reported as given up (its flag set) the
    first `times` times it is built, as a device gate past its timeout reports it (or one
    given up at once after `waited_us`); the layers it was set for."""
    from custom_kernels.gate import timeout_ms
    from strata_mlx.runtime.deferred import DeferredHandshake

    waited = timeout_ms() * 1000 if waited_us is None else waited_us

    run_gated, flagged = DeferredHandshake.run_gated, []

    def flagging(self, l, x, inds):
        y = run_gated(self, l, x, inds)
        if l == layer and len(flagged) < times:
            self.records[-1].gated.late = mx.array([1, waited], dtype=mx.int32)
            flagged.append(l)
        return y

    monkeypatch.setattr(DeferredHandshake, "run_gated", flagging)
    return flagged


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_gate_given_up_under_a_token_built_ahead_recomputes_exactly(store, family, monkeypatch):
    """A gated token whose gate gave up is recomputed from that layer; the token built on
    it meanwhile ("token" mode, chosen as the gated one ended) is rolled back whole, the
    layers before the late one too."""
    path = store(family)
    ids = prompt_ids(24, seed=5)
    gb = arena_gb(path, 0.25)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync")
    ref = decode(sync, ids, 6)
    model, _ = strata_mlx.load(path, arena_gb=gb, decode_gate=True)
    last = max(model.expert_cache.layers)
    flagged = late_at(monkeypatch, last)
    modes = iter(["gated"])  # the first token gated, every one after it "token" mode
    monkeypatch.setattr(model.decoder, "mode", lambda: next(modes, "token"))
    got = decode(model, ids, 6)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    assert flagged == [last] and model.expert_cache.stats.gate_timeouts == 1
    for m in (model, sync):
        m.expert_cache.close()


def test_every_gate_given_up_is_counted_and_the_token_recomputed_from_the_first(store, monkeypatch):
    """Two gates given up in one token, one of them again in its recompute: each counted, the
    token recomputed from the first, its outputs exact, and its layers counted once: the
    per-layer handshake's lookups, the miss rates without the recomputes' observations."""
    path = store("qwen3_next")
    ids = prompt_ids(24, seed=5)
    gb = arena_gb(path, 0.25)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync")
    ref = decode(sync, ids, 4)
    monkeypatch.setenv("STRATA_MLX_GATE", "host")  # (checks as layers are built: see below)
    model, _ = strata_mlx.load(path, arena_gb=gb, decode_gate=True, decode_token_below=0.0)
    first, *_, last = model.expert_cache.layers
    late_at(monkeypatch, first)
    late_at(monkeypatch, last, times=2)  # given up again in the recompute
    # The miss rates' observations, and whether each came from inside `finish`: with the
    # host's gate every check runs as its layer is built, so those are the recompute's.
    pr, dec, seen, inside = model.expert_cache.predictor, model.decoder, [], [False]
    start, observe, finish = (
        (pr.decode_miss_rate, pr.decode_layer_miss_rate),
        pr.observe_decode_layer,
        dec.finish,
    )

    def finishing(step, later=None):
        inside[0] = True
        try:
            return finish(step, later)
        finally:
            inside[0] = False

    monkeypatch.setattr(
        pr, "observe_decode_layer", lambda r: seen.append((r, inside[0])) or observe(r)
    )
    monkeypatch.setattr(dec, "finish", finishing)
    got = decode(model, ids, 4)
    s = model.expert_cache.stats
    assert s.gate_timeouts == 3 and s.recomputed_layers == last - first + 2
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    # the recomputed layers counted once, by their checks: the per-layer handshake's lookups,
    # and the miss rates of the observations outside the recompute alone
    assert s.lookups == sync.expert_cache.stats.lookups
    assert s.hits + s.streamed_ahead + s.misses == s.lookups
    assert sum(recomputed for _, recomputed in seen) == last - first + 2
    again = Predictor.__new__(Predictor)
    again.decode_miss_rate, again.decode_layer_miss_rate = start
    for r, recomputed in seen:
        if not recomputed:
            again.observe_decode_layer(r)
    assert (pr.decode_miss_rate, pr.decode_layer_miss_rate) == (
        again.decode_miss_rate,
        again.decode_layer_miss_rate,
    )
    for m in (model, sync):
        m.expert_cache.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("fraction", [0.25, 0.15])
def test_gated_and_token_mode_tokens_in_turn_equal_sync(store, family, fraction, monkeypatch):
    """Gated tokens with whole tokens ("token" mode: each built on the last before it is
    verified, a miss recomputing it) between them: a token built ahead of a gated one, and
    a gated one after a recomputed one, equal the per-layer handshake."""
    path = store(family)
    ids = prompt_ids(24, seed=9)
    gb = arena_gb(path, fraction)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync")
    ref = decode(sync, ids, 12)
    model, _ = strata_mlx.load(path, arena_gb=gb, decode_gate=True)
    calls = iter(range(1 << 20))
    monkeypatch.setattr(model.decoder, "mode", lambda: ("gated", "token")[next(calls) // 2 % 2])
    finished, finish = [], model.decoder.finish
    monkeypatch.setattr(
        model.decoder,
        "finish",
        lambda step, later=None: finished.append((step.mode, later)) or finish(step, later),
    )
    got = decode(model, ids, 12)
    s = model.expert_cache.stats
    assert s.gated_mode_tokens > 0 and s.token_mode_tokens > 0 and s.recomputed_layers > 0
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    # Never a token built on a gated one: its last checks may give a miss a slot that a token
    # built on top would read (PipelinedDecoder.builds_on); on top of a token-mode one, yes.
    assert all(later is None for mode, later in finished if mode == "gated")
    assert any(later is not None for mode, later in finished if mode == "token")
    for m in (model, sync):
        m.expert_cache.close()


def test_a_negative_sync_threshold_forces_sync_on_a_gated_cache():
    """PipelinedDecoder.thresholds(-1, 0), which times the per-layer handshake alone (plan),
    gets "sync" whether or not the cache keeps a gate table."""
    from strata_mlx.runtime.decode import choose_mode

    for gated in (False, True):
        assert choose_mode(0.5, True, -1.0, 0.0, gated=gated) == "sync"
    assert choose_mode(0.5, True, 0.3, 0.02, gated=True) == "gated"
    assert choose_mode(0.0, False, 0.3, 0.02, gated=True) == "token"


def host_gated_after_sync(store, monkeypatch):
    """(prompt ids, the per-layer handshake's 6 tokens and log-probabilities, its model, a
    model gated through the host's gate that stops gating after 2 gates waited out their
    timeout) on the qwen3_next store, an arena of a quarter of its experts."""
    path = store("qwen3_next")
    ids = prompt_ids(24, seed=5)
    gb = arena_gb(path, 0.25)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync")
    ref = decode(sync, ids, 6)
    monkeypatch.setenv("STRATA_MLX_GATE", "host")
    model, _ = strata_mlx.load(
        path, arena_gb=gb, decode_gate=True, decode_token_below=0.0, decode_gate_give_ups=2,
    )  # fmt: skip
    return ids, ref, sync, model


def test_a_decoder_whose_gates_keep_giving_up_stops_gating_and_stays_exact(store, monkeypatch):
    """Once `decode_gate_give_ups` gates have waited out their timeout, the decoder runs as
    without the gate ("layers" / "sync"), the rest of that token's recompute included,
    warning once; gates given up at once (a held copy's, a failed read's) are counted and
    recomputed but do not stop it. The tokens equal the per-layer handshake's."""
    ids, ref, sync, model = host_gated_after_sync(store, monkeypatch)
    first, second, *_ = model.expert_cache.layers
    # every gate of these two layers gives up: both in the first token, which reaches the
    # limit; its recompute from `first` then rebuilds `second` ungated (no third flag)
    flagged = late_at(monkeypatch, first, times=100), late_at(monkeypatch, second, times=100)
    stuck = r"2 gates waited out their \d+ ms timeout"
    with pytest.warns(RuntimeWarning, match=stuck) as caught:
        got = decode(model, ids, 6)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    s = model.expert_cache.stats
    assert flagged == ([first], [second]) and s.gate_timeouts == 2 and s.gated_mode_tokens == 1
    assert model.decoder.gave_up
    assert s.layers_mode_tokens + s.sync_mode_tokens + s.token_mode_tokens == 5
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    for m in (model, sync):
        m.expert_cache.close()


def test_gates_given_up_at_once_are_recomputed_but_never_stop_gating(store, monkeypatch):
    """A gate given up at once (its word FAILED: a copy held past decode_copy_held_ms, a
    failed read), every token's first layer: each counted and its token recomputed exactly,
    and gating never stops, the limit of 2 notwithstanding (no warning)."""
    ids, ref, sync, model = host_gated_after_sync(store, monkeypatch)
    first = min(model.expert_cache.layers)
    flagged = late_at(monkeypatch, first, times=100, waited_us=60_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = decode(model, ids, 6)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    s = model.expert_cache.stats
    assert len(flagged) >= 3 and s.gate_timeouts == len(flagged)
    assert not model.decoder.gave_up and model.decoder.given_up == 0
    for m in (model, sync):
        m.expert_cache.close()


def test_gates_stopped_by_the_stop_word_are_recomputed_and_the_decoder_clears_it(
    store, monkeypatch
):
    """The table's stop word set (the reader's watcher sets it while a device copy is held:
    a gate may wait on a read nothing can submit meanwhile): every gate of the next gated
    token whose words are not all landed gives up at once, whatever it waits on, the token is
    recomputed exactly, and the decoder clears the word once that token's gates have run;
    gating goes on (none waited out its timeout)."""
    from strata_mlx.runtime.deferred import DeferredHandshake

    path, ids = store("qwen3_next"), prompt_ids(24, seed=7)
    gb = arena_gb(path, 0.25)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync")
    ref = decode(sync, ids, 6)
    sync.expert_cache.close()
    check_gated, checks = DeferredHandshake.check_gated, [0]

    def stopping(self, d, trace, aside=False):
        checks[0] += 1
        table = self.sched.residency.gate
        if checks[0] == 10:
            table.stop_word[0] = 1
        if table.stopped():  # (reads submitted late: their gates see their words -1)
            time.sleep(0.05)
        return check_gated(self, d, trace, aside)

    monkeypatch.setattr(DeferredHandshake, "check_gated", stopping)
    # (no board, no prediction: the checks alone submit reads, each for its own layer)
    model, _ = load_emulated(monkeypatch, path, 0.25, decode_gate_board=False, read_ahead="demand")
    table = model.expert_cache.sched.residency.gate
    got = decode(model, ids, 6)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    s = model.expert_cache.stats
    assert checks[0] > 10 and s.gate_timeouts >= 1 and not table.stopped()
    assert model.decoder.given_up == 0 and not model.decoder.gave_up
    assert s.gated_mode_tokens == 6 - UNGATED_FIRST
    model.expert_cache.close()


def test_bench_names_the_gates_given_up_for_a_held_copy_and_refuses_a_negative_hold():
    """bench's gated line: the gates given up, and the words given up for a copy held past
    decode_copy_held_ms (its own and the queued reads') where any, with the times every gate
    was stopped for it; the option's range held with a one-line error."""
    from strata_mlx.apps.bench import _modes
    from strata_mlx.config import OptionError, check_runtime
    from strata_mlx.runtime.loader import RuntimeConfig

    s = {"decode_modes": {"token": 0, "layers": 0, "sync": 1, "gated": 63},
         "decode_check_ms_per_token": 0.0, "decode_gate_timeouts": 3, "decode_copies_held": 2}  # fmt: skip
    assert "gates given up 3 (2 words for a held copy)]" in _modes(s)
    s["decode_gates_stopped"] = 1
    assert "gates given up 3 (2 words for a held copy, every gate stopped 1x)]" in _modes(s)
    s["decode_copies_held"] = 0
    assert "gates given up 3]" in _modes(s)
    with pytest.raises(OptionError, match=r"^--decode-copy-held-ms -1.0: expected a finite"):
        check_runtime(RuntimeConfig().replace(decode_copy_held_ms=-1.0), cli=True)


def test_no_limit_on_gates_given_up_never_stops_gating():
    from strata_mlx.runtime.decode import PipelinedDecoder

    d = PipelinedDecoder.__new__(PipelinedDecoder)
    d.gate_give_ups, d.given_up = 0, 10**6
    assert not d.gave_up
    d.gate_give_ups = 3
    assert [d.gave_up for d.given_up in (2, 3, 4)] == [False, True, True]


@pytest.mark.parametrize("in_prefill", [False, True], ids=["worker", "driver"])
def test_the_driver_stores_read_ahead_words_while_decoding_and_in_prefill_only_when_asked(
    store, in_prefill
):
    """With a gate table, the reader's read-ahead ready words are the driver's to store (as
    their copies land: a gate may be waiting) inside decode steps, and the worker's in prefill,
    where no gate waits and a host function queued behind each copy holds the stream's next
    one back, unless `prefill_words_by_driver`; each phase is restored after it."""
    path = store("qwen3_moe")
    model, _ = strata_mlx.load(
        path, arena_gb=arena_gb(path, 0.25), decode_gate=True, prefill_words_by_driver=in_prefill
    )
    ec = model.expert_cache
    reader = ec.sched.reader
    assert reader.words_by_driver is in_prefill
    with ec.phase(decoding=True):
        assert reader.words_by_driver is True
        with ec.phase(decoding=False):  # (a phase inside another: the outer one's comes back)
            assert reader.words_by_driver is in_prefill
        assert reader.words_by_driver is True
    assert reader.words_by_driver is in_prefill
    with ec.phase(decoding=True, gating=False):  # (a batch of sequences: no gate waits)
        assert reader.words_by_driver is in_prefill
        with ec.phase(decoding=False):
            assert reader.words_by_driver is in_prefill
        assert reader.words_by_driver is in_prefill
        with ec.phase(decoding=True):
            assert reader.words_by_driver is True
        assert reader.words_by_driver is in_prefill
    ungated, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.25))
    with ungated.expert_cache.phase(decoding=False):  # no table: the reader's default stays
        assert ungated.expert_cache.sched.reader.words_by_driver is True
    ungated.expert_cache.close()
    ec.close()
    with ec.phase(decoding=True):  # closed: nothing to tell
        pass


@pytest.mark.parametrize(
    "opts",
    [
        {"decode_layers_chunk": 4, "decode_lag": 1, "decode_gate_board": False},
        {"decode_lag": 3, "decode_layers_chunk": 1, "decode_gate_board": False},
    ],
    ids=["chunk4", "lag3"],
)
def test_the_device_gate_stays_exact_with_layers_in_chunks_or_checks_further_behind(
    store, opts, monkeypatch
):
    """Without the routing board (bench's `:bd0:lc4:lag1`, `:bd0:lc1:lag3`): the decoder's
    commit every 4 layers (each gated layer's routing is committed on its own anyway), or
    the decoding thread 3 layers ahead of the checks: tokens and log-probabilities equal the
    per-layer handshake's, no gate gives up, every token gated."""
    path = store("qwen3_next")
    ids = prompt_ids(24, seed=11)
    sync, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.2), decode="sync")
    ref = decode(sync, ids, 6)
    model, seen = load_emulated(monkeypatch, path, 0.2, read_ahead="lookahead", **opts)
    got = decode(model, ids, 6)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    s = model.expert_cache.stats
    assert s.gate_timeouts == 0 and s.gated_mode_tokens == 6 - UNGATED_FIRST and s.misses > 0
    for m in (model, sync):
        m.expert_cache.close()


def emulated_board(monkeypatch, model, write: bool = True) -> dict:
    """The routing board's kernel on this CPU (with the emulated device gate, whose device
    addresses are host ones): the ids, then the sequence number, written into the layer's
    board row as it is built (the emulated gate holds the building thread until the layer's
    records land: a board written only once submitted would never be read), unless not
    `write` (a device that never gets there). Counts its calls and the submissions, and
    records any wait of the decoding thread for a check that reads the board of a layer not
    yet submitted (on a device that check could never end)."""
    import strata_mlx.runtime.deferred as deferred
    from strata_mlx.runtime.gate_checks import GateChecks

    table = model.expert_cache.sched.residency.gate
    rows = {table.board_address(l): table.board_row(l) for l in model.expert_cache.layers}
    seen = {"calls": 0, "commits": 0, "unsent waits": 0}

    def board(ids, board_at, seq):
        seen["calls"] += 1
        if write:
            row, vals = rows[board_at.item()], ids.tolist()
            row[1 : 1 + len(vals)] = vals
            row[0] = seq.item()
        return ids

    submit, wait = mx.async_eval, GateChecks.wait

    def async_eval(*arrays):
        seen["commits"] += 1
        submit(*arrays)

    def checked_wait(self, d):
        if d.gated.board is not None and not d.gated.sent:
            seen["unsent waits"] += 1
        return wait(self, d)

    monkeypatch.setattr(deferred, "board", board)
    monkeypatch.setattr(mx, "async_eval", async_eval)
    monkeypatch.setattr(GateChecks, "wait", checked_wait)
    return seen


@pytest.mark.parametrize(
    "opts,commits",
    [
        ({"decode_layers_chunk": 1, "decode_lag": 1}, 1.0),
        ({}, 0.25),
        ({"decode_gate_fused": True}, 0.25),
    ],
    ids=["each", "chunk4-lag4", "fused"],
)
def test_gated_checks_reading_the_routing_board_stay_exact(store, opts, commits, monkeypatch):
    """`decode_gate_board`: each gated layer's routing (its predictions joined) goes onto the
    board, where its check reads it, with no command buffer of its own: the decoder's
    commits alone, every layer or (chunks of 4, checks 4 behind) every 4 layers, and never a
    wait for a check whose layer is not on the device. Tokens and log-probabilities equal
    the per-layer handshake's, no gate gives up, every check read the board; with
    `decode_gate_fused`, every board went with its gate in one call."""
    import strata_mlx.runtime.deferred as deferred

    path = store("qwen3_next")
    ids = prompt_ids(24, seed=11)
    sync, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.2), decode="sync")
    ref = decode(sync, ids, 6)
    model, _ = load_emulated(
        monkeypatch, path, 0.2, read_ahead="lookahead", decode_gate_board=True, **opts
    )
    seen = emulated_board(monkeypatch, model)
    fused, one = [], deferred.board_gate
    monkeypatch.setattr(deferred, "board_gate", lambda *a: fused.append(a[1]) or one(*a))
    out, first = [], None
    for r in stream_generate(model, None, ids, 6):
        out.append((r.token, np.array(r.logprobs)))
        first = seen["commits"] if first is None else first  # (the first token's, ungated)
    assert [t for t, _ in out] == ref[0] and np.array_equal(np.stack([p for _, p in out]), ref[1])
    ec = model.expert_cache
    s, board = ec.stats, ec.pipelined.board
    layers = len(ec.layers)
    assert s.gate_timeouts == 0 and s.gated_mode_tokens == 6 - UNGATED_FIRST and s.misses > 0
    assert (
        seen["calls"] >= (6 - UNGATED_FIRST) * layers
        and board.reads == seen["calls"]
        and board.fallbacks == 0
    )
    assert seen["unsent waits"] == 0
    want = opts.get("decode_gate_fused", False)
    assert ec.sched.residency.gate.board_fused == want
    k = load_manifest(path).config["num_experts_per_tok"]
    assert len(fused) == (seen["calls"] if want else 0) and set(fused) <= {k}
    # a gated token's commits: a commit a layer (the head's among them), or one every 4
    # layers: here the head's alone
    assert seen["commits"] - first <= (6 - UNGATED_FIRST) * max(commits * layers, 1)
    for m in (model, sync):
        m.expert_cache.close()


def test_a_gated_decoder_holds_copies_to_the_option_in_decode_steps_only(store, monkeypatch):
    """decode_copy_held_ms: the reader's copy_held_us is the option's (in us) inside gated
    decode steps (50 ms by default), and 0 in prefill and once the generation is over; 0
    throughout where the option is 0. Tokens equal the per-layer handshake's either way."""
    from strata_mlx.stream.reader import Reader

    seen, prop = [], Reader.copy_held_us

    def setter(self, us):
        seen.append(int(us))
        prop.fset(self, us)

    monkeypatch.setattr(Reader, "copy_held_us", property(prop.fget, setter))
    path, ids = store("qwen3_moe"), prompt_ids(24, seed=3)
    sync, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.25), decode="sync")
    ref = decode(sync, ids, 4)
    sync.expert_cache.close()
    for ms in (None, 20, 0):
        seen.clear()
        opts = {} if ms is None else {"decode_copy_held_ms": ms}
        ms = 50 if ms is None else ms
        model, _ = load_emulated(monkeypatch, path, 0.25, read_ahead="lookahead", **opts)
        got = decode(model, ids, 4)
        assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
        assert model.expert_cache.sched.reader.copy_held_us == 0 and seen[-1] == 0
        assert set(seen) == ({0, ms * 1000} if ms else {0})
        model.expert_cache.close()


@pytest.mark.skipif(
    not os.environ.get("STRATA_MLX_FAKE_DRIVER"),
    reason="run by tests/stream/test_fake_driver.py, under its stand-in CUDA driver",
)
@pytest.mark.parametrize("read_ahead", ["demand", "lookahead"])
def test_a_held_copy_under_the_stand_in_driver_is_recomputed(store, monkeypatch, read_ahead):
    """(Under tests/stream/test_fake_driver.py's stand-in driver, the device copy on.) Gated
    decode through the emulated device gate; from the 10th gated check the next copy waited
    for is held 1.5 s: the watcher gives its word up past decode_copy_held_ms (50 ms) where it
    is still pending, that gate gives up (not counted toward stopping the gate), the token is
    recomputed, and tokens and log-probabilities equal the per-layer handshake's. With demand every copy in decode is a
    miss a gate waits on: the held one gives a gate up for sure; with lookahead it may be a
    read-ahead's whose word the driver already stored."""
    from strata_mlx.runtime.deferred import DeferredHandshake

    stub = ctypes.CDLL(os.environ["STRATA_MLX_FAKE_DRIVER"])
    path, ids = store("qwen3_next"), prompt_ids(24, seed=7)
    monkeypatch.setenv("STRATA_MLX_DEVICE_COPY", "1")  # (the store built: now through the driver)
    opts = {"arena_gb": arena_gb(path, 0.25), "read_ahead": read_ahead, "device_arena": False}
    sync, _ = strata_mlx.load(path, decode="sync", **opts)
    ref = decode(sync, ids, 8)
    sync.expert_cache.close()
    checks, check_gated = [0], DeferredHandshake.check_gated

    def held(self, d, trace, aside=False):
        checks[0] += 1
        if checks[0] == 10:
            stub.stub_hold_next(1500)
        return check_gated(self, d, trace, aside)

    monkeypatch.setattr(DeferredHandshake, "check_gated", held)
    opts.pop("arena_gb")
    model, _ = load_emulated(monkeypatch, path, 0.25, decode_copy_held_ms=50, **opts)
    got = decode(model, ids, 8)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    reader, s = model.expert_cache.sched.reader, model.expert_cache.stats
    assert reader.stats()["device_copies"] > 0 and checks[0] > 10
    if read_ahead == "demand":
        assert reader.stats()["copies_held"] == 1 and s.gate_timeouts >= 1
        assert model.decoder.given_up == 0  # (given up at once: not toward the stop)
    else:
        assert reader.stats()["copies_held"] <= 1 and s.streamed_ahead > 0
        assert reader.stats()["words_by_driver"] > 0  # (read-ahead's words by host functions)
    model.expert_cache.close()


def test_the_routing_board_and_quick_misses_are_on_by_default_with_their_chunks_and_lags(
    store, monkeypatch
):
    """Left to their defaults, a model whose decode gates on the device has the routing board
    and quick misses on (a reserve of 32 slots, an eighth of the arena at most: none in a
    tiny arena), a gated token submitted 8 layers at a time and checked at its end (its
    ungated tokens 4 and 4 behind), its checks read the board (no fallback), and tokens and
    log-probabilities equal the per-layer handshake's; quick misses asked off, 4 at a time
    and 4 behind; the board asked off, each layer committed
    alone and checked 1 behind. Where no device gate runs (this CPU, unemulated), the board
    stays off even asked for; each default given its own value keeps it."""
    from strata_mlx.runtime.decode import WHOLE_TOKEN

    path = store("qwen3_next")
    ids = prompt_ids(24, seed=13)
    gb = arena_gb(path, 0.2)
    plain, _ = strata_mlx.load(path, arena_gb=gb, decode_gate_board=True)
    assert plain.expert_cache.pipelined.device_gate is False
    assert plain.runtime.decode_gate_board is False and plain.runtime.decode_quick_misses == 0
    assert (plain.runtime.decode_lag, plain.runtime.decode_layers_chunk) == (1, 1)
    plain.expert_cache.close()
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync")
    ref = decode(sync, ids, 6)
    off, _ = load_emulated(monkeypatch, path, 0.2, read_ahead="lookahead", decode_gate_board=False)
    assert not off.expert_cache.sched.residency.gate.board_on
    assert off.runtime.decode_gate_board is False and off.expert_cache.sched.quick is None
    assert (off.runtime.decode_lag, off.runtime.decode_layers_chunk) == (1, 1)
    got = decode(off, ids, 6)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    assert off.expert_cache.pipelined.board.reads == 0
    assert off.expert_cache.stats.misses > 0
    off.expert_cache.close()
    # (the default reserve is an eighth of the arena at most: 2 of the 16 slots of half)
    for quick, gated, fraction in (((None, (WHOLE_TOKEN, 8), 0.5)), (0, (4, 4), 0.2)):
        model, _ = load_emulated(
            monkeypatch, path, fraction, read_ahead="lookahead", decode_quick_misses=quick
        )
        ec = model.expert_cache
        assert ec.sched.residency.gate.board_on and model.runtime.decode_gate_board is True
        assert (model.runtime.decode_lag, model.runtime.decode_layers_chunk) == (4, 4)
        assert (model.decoder.lag, model.decoder.layers_chunk) == (4, 4)  # (ungated tokens')
        assert (model.decoder.gated_lag, model.decoder.gated_chunk) == gated
        assert model.runtime.decode_quick_misses == (2 if quick is None else 0)
        got = decode(model, ids, 6)  # (outputs are the same at every arena size)
        assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
        assert ec.pipelined.board.reads > 0 and ec.pipelined.board.fallbacks == 0
        assert ec.stats.gate_timeouts == 0 and ec.stats.misses > 0
        assert (ec.stats.quick_misses > 0) == (quick is None)
        ec.close()
    # the board with a lag of its own: the chunks keep their defaults, gated tokens that lag
    asked, _ = load_emulated(monkeypatch, path, 0.5, read_ahead="lookahead", decode_lag=1)
    assert asked.expert_cache.sched.residency.gate.board_on
    assert (asked.runtime.decode_lag, asked.runtime.decode_layers_chunk) == (1, 4)
    assert (asked.decoder.gated_lag, asked.decoder.gated_chunk) == (1, 8)
    got = decode(asked, ids, 6)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    assert asked.expert_cache.pipelined.board.reads > 0
    for m in (asked, sync):
        m.expert_cache.close()


def test_a_board_read_waits_for_its_word_falls_back_once_submitted_and_stops_when_asked(
    monkeypatch,
):
    """RoutingBoard.read: the row's ids once its sequence number is in; a word that does not
    come twice the gate's timeout after the layer was submitted: None (the check reads MLX's
    arrays); a layer never submitted: a one-line error after ten times that; the checks
    stopping: CLOSED at once."""
    from strata_mlx.runtime.deferred import Deferred, Gated, RoutingBoard

    monkeypatch.setenv("STRATA_MLX_GATE_TIMEOUT_MS", "20")
    g = GateTable(TableShape(layers=(0, 1)))

    class Sched:
        closed = False
        residency = type("Residency", (), {"gate": g})
        stats = ExpertStats()

    stop = {"now": False}
    board = RoutingBoard(Sched(), lambda: stop["now"])
    g.device_address = g.address  # (as mapped)

    def layer(seq, sent):
        d = Deferred(1, mx.array([[4, 2, 6]]), None, gated=Gated([], [], None))
        d.gated.board, d.gated.sent = (1, seq, 3), sent
        return d

    row = g.board_row(1)
    row[1:4], row[0] = [4, 2, 6], 7
    # (the word in already: wait_word keeps the GIL and returns 0.0, falsy, seen all the same)
    assert board.read(layer(7, False)) == [4, 2, 6] and board.reads == 1
    assert board.fallbacks == 0 and Sched.stats.check_gil_s == 0.0
    assert board.read(layer(8, True)) is None and board.fallbacks == 1  # after ~40 ms
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="layer 1's routing never reached the routing board"):
        board.read(layer(9, False))
    assert time.monotonic() - t0 >= 0.2
    stop["now"] = True
    with pytest.raises(RuntimeError, match="closed"):
        board.read(layer(10, False))
    g.device_address = None


def test_wait_word_sees_a_store_from_another_thread_and_times_out_without_one():
    from strata_mlx.stream.reader import wait_word

    words = np.zeros(2, dtype=np.int32)
    assert wait_word(words.ctypes.data, 7, 0.02) is None
    threading.Timer(0.05, lambda: words.__setitem__(1, 7)).start()
    t0 = time.monotonic()
    gil = wait_word(words.ctypes.data + 4, 7, 5.0)
    assert gil is not None and 0 <= gil < 2.0 and time.monotonic() - t0 < 2.0
    assert wait_word(words.ctypes.data + 4, 7, 5.0) == 0.0  # (in already: the GIL kept)
    with pytest.raises(ValueError, match="wait_word"):
        wait_word(words.ctypes.data + 2, 7, 0.01)


def test_wait_word_reports_how_long_another_thread_held_the_gil_after_the_word():
    """What a check's wait for its routing cannot see from Python: the decoding thread
    holding the GIL (as MLX's graph building does) once the word is in. A thread stores the
    word, then runs Python for 0.15 s without a switch: wait_word saw the word at once and
    says it held the GIL again only ~0.15 s later."""
    from strata_mlx.stream.reader import wait_word

    words = np.zeros(1, dtype=np.int32)

    def store_then_hold():
        words[0] = 7
        end = time.monotonic() + 0.15
        while time.monotonic() < end:  # (pure Python: the GIL held throughout)
            pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    holder = threading.Timer(0.5, store_then_hold)  # (a figure from the wait's start: >= 0.5)
    try:
        holder.start()
        gil = wait_word(words.ctypes.data, 7, 5.0)
    finally:
        sys.setswitchinterval(interval)
        holder.join()
    assert gil is not None and 0.1 < gil < 0.4, gil


def test_the_gate_is_on_by_default_only_where_the_device_can_wait(store, monkeypatch):
    """`decode_gate` None (the default): a gate table where the device gate is available
    (CUDA), none elsewhere (the host's gate only when asked for); False turns it off there
    too, and `decode="sync"` never keeps one."""
    import strata_mlx.runtime.loader as loader

    path = store("qwen3_moe")
    gb = arena_gb(path, 0.25)

    def table(**opts):
        model, _ = strata_mlx.load(path, arena_gb=gb, **opts)
        kept = model.expert_cache.sched.residency.gate
        model.expert_cache.close()
        return kept is not None

    assert not table() and table(decode_gate=True)
    monkeypatch.setattr(loader, "device_gate_available", lambda: False)
    assert not table()
    calls = []
    monkeypatch.setattr(loader, "device_gate_available", lambda: calls.append(1) or True)
    monkeypatch.setenv("STRATA_MLX_GATE", "host")  # (no device here: the table's host gate)
    assert table() and not table(decode_gate=False) and not table(decode="sync")
    assert len(calls) == 1  # (asked only where the default decides)
