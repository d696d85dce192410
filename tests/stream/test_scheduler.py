"""The scheduler's event loop: it tops the reader's queue up from the reserve when the next
layer's reads finish early, never at the cost of a pinned or predicted expert; it leaves no
thread or descriptor behind; a failed read reaches the caller; outputs equal the sync
scheduler's bit for bit."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import weakref

import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.format.store import EXPERTS, load_manifest
from strata_mlx.generation.generate import teacher_forced_logits
from strata_mlx.stream.arena import Arena
from strata_mlx.stream.reader import Reader
from strata_mlx.stream.scheduler import ExpertReadError, LoopScheduler

FAMILY = "qwen3_moe"


class ScriptedReader:
    """The native reader, started paused, recording every batch submitted and what was
    queued or done at that moment."""

    def __init__(self, workers=2):
        self._r = Reader(workers, start_paused=True)
        self.submits: list[tuple[bool, list[int], int]] = []  # (urgent, tags, reads done)
        self.done = 0

    def submit(self, reqs, urgent=False):
        self.submits.append((urgent, [r[0] for r in reqs], self.done))
        self._r.submit(reqs, urgent)

    def poll(self):
        out = self._r.poll()
        self.done += len(out)
        return out

    def wait(self, tags=None, timeout=None):
        out = self._r.wait(tags, timeout)
        self.done += len(out)
        return out

    def __getattr__(self, name):
        return getattr(self._r, name)


def until(cond, timeout=10.0):
    t = time.monotonic()
    while not cond():
        if time.monotonic() - t > timeout:
            raise AssertionError("timed out")
        time.sleep(0.005)


def test_a_handshake_hands_its_read_ahead_and_reserve_to_the_reader_at_once(store):
    """The next layer's predicted experts and the first of the reserve go out as one batch
    (each hand-over wakes the reader's threads), in the order two calls would queue them;
    an all-resident layer is claimed from the residency row, no expert looked up alone."""
    path = store("qwen3_next")  # four MoE layers
    m = load_manifest(path)
    l0, l1, l2 = m.moe_layers[:3]
    arena = Arena(8, m.layout.record_bytes)
    reader = ScriptedReader()
    sched = LoopScheduler(path, m, arena, reader, verify=True, low_water=4)
    try:
        reader.resume()
        sched.wait(sched.ensure([(l0, 0), (l0, 1)]))
        reader.pause()
        before = len(reader.submits)
        resident = arena.resident
        arena.resident = None  # claim must not look experts up one by one
        try:
            assert sched.claim(l0, [0, 1]) == []
        finally:
            arena.resident = resident
        assert sched.stats.hits == 2 and arena.pinned == {arena.slot_of[(l0, e)] for e in (0, 1)}
        predicted = {(l1, 2), (l1, 3), (l2, 4), (l2, 5), (l2, 6)}
        sched.predicted(l1, [2, 3], [(l2, 4), (l2, 5), (l2, 6)], predicted)
        (urgent, tags, _), *more = reader.submits[before:]
        assert not urgent and not more
        # l1's prediction first, then the reserve up to the low-water mark
        assert [sched.reads[t].key for t in tags] == [(l1, 2), (l1, 3), (l2, 4), (l2, 5)]
        assert sched.stats.topped_up == 2 and sched.stats.readahead_submitted == 4
        reader.resume()
        sched.drain()
    finally:
        sched.close()


def test_a_reserve_left_to_the_loop_is_read_once_reads_land_not_by_the_handshake(store):
    """With loop_top_up a handshake hands over only the next layer's prediction; the reserve
    goes out from the loop's thread as those reads land (it would not with no read in
    flight: then the handshake reads it itself)."""
    path = store("qwen3_next")  # four MoE layers
    m = load_manifest(path)
    l0, l1, l2 = m.moe_layers[:3]
    arena = Arena(8, m.layout.record_bytes)
    reader = ScriptedReader()
    sched = LoopScheduler(path, m, arena, reader, verify=True, low_water=4, loop_top_up=True)
    try:
        reader.pause()
        before = len(reader.submits)
        predicted = {(l1, 2), (l1, 3), (l2, 4), (l2, 5), (l2, 6)}
        sched.predicted(l1, [2, 3], [(l2, 4), (l2, 5), (l2, 6)], predicted)
        (urgent, tags, _), *more = reader.submits[before:]
        assert not urgent and not more
        assert [sched.reads[t].key for t in tags] == [(l1, 2), (l1, 3)]
        assert sched.stats.topped_up == 0
        with sched.lock:  # a handshake collects l1's reads itself: it tops nothing up
            reader.resume()
            sched.wait(tags)
            assert sched.stats.topped_up == 0
        until(lambda: sched.stats.topped_up == 3)  # the loop, woken by those completions
        sched.drain()
        with sched.lock:
            assert all(arena.resident(k) for k in predicted)
        # No read in flight nor about to be: the handshake reads the reserve itself.
        sched.predicted(l2, [], [(l0, 7)], {(l0, 7)})
        assert sched.stats.topped_up == 4
        sched.drain()
    finally:
        sched.close()


@pytest.mark.parametrize("wake_every", [True, False], ids=["every", "room"])
def test_scheduler_tops_up_from_the_reserve_without_evicting_pinned_or_predicted(store, wake_every):
    """The loop tops the queue up as reads land, whether the reader wakes it at every
    completion or only while the queue has room."""
    path = store("qwen3_next")  # four MoE layers
    m = load_manifest(path)
    l0, l1, l2, l3 = m.moe_layers[:4]
    arena = Arena(6, m.layout.record_bytes)
    reader = ScriptedReader()
    sched = LoopScheduler(path, m, arena, reader, verify=True, low_water=2, wake_every=wake_every)
    try:
        # Layer l3's expert 0 resident, used long ago: the only expert that may be evicted.
        reader.resume()
        sched.wait(sched.ensure([(l3, 0)]))
        reader.pause()
        # Layer l0 computes on experts 0 and 1 (pinned); l1's prediction is queued.
        waits = sched.claim(l0, [0, 1])
        first = sched.read_ahead(l1, [2, 3])
        predicted = {(l1, 2), (l1, 3), (l2, 4), (l2, 5), (l2, 6)}
        sched.reserve([(l2, 4), (l2, 5), (l2, 6)], predicted)
        # Four reads queued, above the low-water mark: nothing topped up yet.
        assert sched.stats.topped_up == 0 and reader.queued() == 4
        reader.resume()
        sched.wait(waits + first)
        until(lambda: sched.stats.topped_up == 2)  # by the loop, as the queue ran low
        # With the reserve spent the loop sleeps: the next handshake collects what lands.
        sched.drain()
        with sched.lock:
            # l2's experts 4 and 5 were submitted by the loop after l1's reads landed;
            # 4 took the one free slot, 5 evicted (l3, 0); nothing was left for 6.
            assert sched.stats.topped_up == 2
            assert arena.resident((l2, 4)) and arena.resident((l2, 5))
            assert (l2, 6) not in arena.slot_of
            assert (l3, 0) not in arena.slot_of
            for key in [(l0, 0), (l0, 1), (l1, 2), (l1, 3)]:
                assert arena.resident(key), key
            # The pinned and predicted experts' slots are exactly where they were.
            assert sched.row(l0)[[0, 1]].tolist() == [
                arena.slot_of[(l0, 0)],
                arena.slot_of[(l0, 1)],
            ]
        ahead = [s for s in reader.submits if not s[0]]
        assert ahead[0][1] == first  # l1's prediction, submitted by the handshake
        # The loop's top-up came once reads had landed (the reader was paused before).
        assert all(done > 0 for _, _, done in ahead[1:]) and len(ahead) >= 2
    finally:
        sched.close()


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_close_leaves_no_thread_or_descriptor(store):
    path = store(FAMILY)
    before_fds = _fds()
    before_threads = {t.ident for t in threading.enumerate()}
    model, _ = strata_mlx.load(path, arena_gb=0.01, scheduler="loop")
    teacher_forced_logits(model, prompt_ids(16, seed=1), 8)
    assert any(t.name == "strata-mlx-scheduler" for t in threading.enumerate())
    model.expert_cache.close()
    assert {t.ident for t in threading.enumerate()} <= before_threads
    assert _fds() <= before_fds


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_model_dropped_without_close_leaves_nothing_behind(store):
    """A script that loads models in a loop and never closes them gets its threads, files
    and arena memory back once a model is collected."""
    path = store(FAMILY)
    before_fds = _fds()
    before_threads = {t.ident for t in threading.enumerate()}
    model, _ = strata_mlx.load(path, arena_gb=0.01, scheduler="loop")
    teacher_forced_logits(model, prompt_ids(16, seed=1), 8)
    cache = weakref.ref(model.expert_cache)
    del model
    gc.collect()
    assert cache() is None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        {t.ident for t in threading.enumerate()} - before_threads or _fds() - before_fds
    ):
        time.sleep(0.05)
    assert {t.ident for t in threading.enumerate()} <= before_threads
    assert _fds() <= before_fds


@pytest.mark.parametrize("scheduler", ["sync", "loop"])
def test_a_request_after_close_is_one_line(store, scheduler):
    """A handshake still running when the cache closes (a generation on another thread, the
    server shutting down) gets one line from whichever request comes next, not a None's
    AttributeError; close() twice is once."""
    path = store(FAMILY)
    m = load_manifest(path)
    model, _ = strata_mlx.load(path, arena_gb=0.01, scheduler=scheduler)
    sched = model.expert_cache.sched
    sched.close()
    sched.close()
    layer = m.moe_layers[0]
    for request in (lambda: sched.claim(layer, [0, 1]), lambda: sched.read_ahead(layer, [2])):
        with pytest.raises(RuntimeError, match="^expert cache is closed$"):
            request()


def _corrupt(src, dst) -> None:
    import shutil

    shutil.copytree(src, dst)
    p = dst / EXPERTS
    with open(p, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_failed_read_in_the_loop_is_the_same_error_as_sync(store, tmp_path):
    bad = tmp_path / "bad"
    _corrupt(store(FAMILY), bad)
    messages = {}
    for scheduler in ("sync", "loop"):
        model, _ = strata_mlx.load(bad, arena_gb=0.01, scheduler=scheduler, read_ahead="demand")
        with pytest.raises(ExpertReadError) as e:
            teacher_forced_logits(model, prompt_ids(16, seed=2), 16)
        messages[scheduler] = str(e.value)
        model.expert_cache.close()
    assert messages["loop"] == messages["sync"]
    assert "checksum mismatch" in messages["loop"] and "\n" not in messages["loop"]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "deepseek_v3"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_loop_and_sync_are_bit_identical(store, family, depth):
    path = store(family)
    m = load_manifest(path)
    ids = prompt_ids(40, seed=6)
    total = m.num_experts * len(m.moe_layers) * m.layout.record_bytes
    for fraction in (0.05, 0.25, 0.6):
        outs = {}
        for scheduler in ("sync", "loop"):
            model, _ = strata_mlx.load(
                path,
                arena_gb=fraction * total / 1024**3,
                scheduler=scheduler,
                lookahead_depth=depth,
            )
            outs[scheduler] = teacher_forced_logits(model, ids, 7)
            if scheduler == "loop" and depth > 1 and fraction == 0.6 and len(m.moe_layers) > 2:
                assert model.expert_cache.stats.topped_up > 0  # the reserve was read
            model.expert_cache.close()
        assert np.array_equal(outs["loop"], outs["sync"]), fraction


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3"])
def test_a_reserve_read_from_the_loop_is_bit_identical(store, family):
    """loop_top_up moves the reserve's reads to the loop's thread: same logits as sync."""
    path = store(family)
    m = load_manifest(path)
    ids = prompt_ids(40, seed=6)
    total = m.num_experts * len(m.moe_layers) * m.layout.record_bytes
    outs = {}
    for name, opts in (("sync", dict(scheduler="sync")), ("lt", dict(scheduler_loop_top_up=True))):
        model, _ = strata_mlx.load(path, arena_gb=0.6 * total / 1024**3, lookahead_depth=3, **opts)
        outs[name] = teacher_forced_logits(model, ids, 7)
        if name == "lt":
            assert model.expert_cache.sched.loop_top_up
            if len(m.moe_layers) > 2:  # (a layer after the next to reserve for)
                assert model.expert_cache.stats.topped_up > 0  # the reserve was read
        model.expert_cache.close()
    assert np.array_equal(outs["lt"], outs["sync"])


def test_prefetch_is_awaitable(store):
    path = store(FAMILY)
    m = load_manifest(path)
    layer = m.moe_layers[1]
    model, _ = strata_mlx.load(path, arena_gb=0.01, read_ahead="demand")
    ec = model.expert_cache
    asyncio.run(ec.prefetch(layer, [3, 1]))
    assert ec.arena.resident((layer, 1)) and ec.arena.resident((layer, 3))
    assert ec.stats.readahead_submitted == 2 and ec.stats.experts_read == 2
    ec.close()


@pytest.mark.parametrize("scheduler", ["sync", "loop"])
def test_split_reads_are_bit_identical_and_split(store, scheduler):
    """Records read as parts by idle workers (read_split_kb) land exactly as whole ones."""
    path = store(FAMILY)
    m = load_manifest(path)
    assert m.layout.record_bytes >= 2 * 4096  # else nothing could split
    ids = prompt_ids(24, seed=8)
    total = m.num_experts * len(m.moe_layers) * m.layout.record_bytes
    outs = {}
    for split_kb in (0, 4):
        model, _ = strata_mlx.load(
            path,
            arena_gb=0.25 * total / 1024**3,
            scheduler=scheduler,
            read_split_kb=split_kb,
            io_workers=8,
        )
        outs[split_kb] = teacher_forced_logits(model, ids, 1)  # one token a step: few misses
        split = model.expert_cache.reader.stats()["split"]
        assert (split > 0) == (split_kb > 0)
        model.expert_cache.close()
    assert np.array_equal(outs[0], outs[4])
