"""The arena: arenas past the old size limits (2^31 bytes of one flat uint8 array, 2^31
words of one flat uint64 array) keep their contract — `rows` is one [n_slots, record_bytes]
uint8 MLX array aliasing the slots, slots start page aligned, writes through `view()` are what
MLX reads, the expert kernels find records beyond 2 and 4 GiB — and each eviction policy picks
the victim it documents, never a pinned or loading slot."""

from __future__ import annotations

import gc
import inspect
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_kernels import _compare, cpu_reference, gguf_experts, needs_cxx

from custom_kernels import dispatch
from strata_mlx.format.store import ALIGNMENT
from strata_mlx.stream.arena import (
    LRU,
    POLICIES,
    Arena,
    LayerDistance,
    LFUAging,
    buffer_shape,
    slot_rows,
)

GiB = 1024**3

# ---------------------------------------------------------------------------------------------
# Big arenas. MLX zero-fills the buffer, so these cost real memory: 2.3 GB by default (past a
# flat uint8 array's 2^31 elements), 4.4 GB with -m slow (past 32-bit byte offsets too).


def _q4k_experts():
    # D = inter = 256, Q4_K everywhere: the records the host kernel decodes
    types = {"gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q4_K"}
    return gguf_experts(3, 256, 256, types, seed=11)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(2.3e9, id="2.3GB"),
        pytest.param(4.4e9, id="4.4GB", marks=pytest.mark.slow),
    ],
)
def big(request):
    layout, recs = _q4k_experts()
    n_slots = int(request.param) // layout.record_bytes + 1
    t = time.perf_counter()
    arena = Arena(n_slots, layout.record_bytes)
    seconds = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"\narena {arena.nbytes / 1e9:.2f} GB ({n_slots} slots of {layout.record_bytes} B): "
        f"allocated in {seconds:.2f} s, MLX peak {mx.get_peak_memory() / 1e9:.2f} GB, "
        f"process peak RSS {rss / 1e9:.2f} GB"
    )
    yield arena, layout, recs
    del arena
    gc.collect()
    mx.clear_cache()  # hand the buffer back to the OS, not to MLX's cache


def test_big_arena_is_past_the_flat_limits(big):
    arena, _, _ = big
    assert arena.nbytes > 2**31
    assert arena.rows.shape == (arena.n_slots, arena.record_bytes)
    assert arena.rows.dtype == mx.uint8
    assert arena.rows.size > 2**31  # more elements than one flat MLX dim can hold


def test_big_arena_rows_alias_page_aligned_slots(big):
    arena, _, _ = big
    last = arena.n_slots - 1
    # `rows` is the slot memory itself (no copy), starting at slot 0's address
    assert np.asarray(arena.rows).ctypes.data == arena.address(0)
    for s in (0, 1, 2**31 // arena.record_bytes, last // 2, last):
        assert arena.address(s) % ALIGNMENT == 0, s
        assert arena.address(s) - arena.address(0) == s * arena.record_bytes
        v = arena.view(s)
        assert v.ctypes.data == arena.address(s) and v.size == arena.record_bytes
        assert v.flags.writeable
    # the last slot ends inside the buffer MLX allocated
    end = arena.address(last) + arena.record_bytes
    assert end <= np.asarray(arena.buffer).ctypes.data + arena.buffer.nbytes


def test_big_arena_write_through_view_of_last_slot_is_seen_by_mlx(big):
    arena, _, _ = big
    last = arena.n_slots - 1
    rng = np.random.default_rng(0)
    pattern = rng.integers(1, 256, arena.record_bytes, dtype=np.uint8)
    arena.view(last)[:] = pattern
    try:
        got = np.array(arena.rows[mx.array([last])])
        np.testing.assert_array_equal(got[0], pattern)
        np.testing.assert_array_equal(np.array(arena.rows[last]), pattern)
        assert arena.rows[last].astype(mx.uint32).sum().item() == int(pattern.sum())
        assert not np.array(arena.rows[last - 1]).any()  # the neighbour is untouched
    finally:
        arena.view(last)[:] = 0


def test_big_arena_rows_past_2gib_are_read_correctly(big):
    arena, _, _ = big
    rb = arena.record_bytes
    straddle = 2**31 // rb  # the slot whose bytes cross the 2 GiB boundary
    past = [straddle, straddle + 1, (arena.n_slots + straddle) // 2, arena.n_slots - 1]
    if arena.nbytes > 4 * GiB:
        past.append(4 * GiB // rb + 1)  # and past 4 GiB
    past = sorted(set(past))
    assert (straddle + 1) * rb > 2**31
    rng = np.random.default_rng(1)
    patterns = {s: rng.integers(0, 256, rb, dtype=np.uint8) for s in past}
    for s, p in patterns.items():
        arena.view(s)[:] = p
    try:
        got = np.array(arena.rows[mx.array(past, dtype=mx.uint32)])
        for i, s in enumerate(past):
            np.testing.assert_array_equal(got[i], patterns[s], err_msg=f"slot {s}")
        sums = arena.rows[mx.array(past)].astype(mx.uint32).sum(axis=1)
        assert sums.tolist() == [int(patterns[s].sum()) for s in past]
    finally:
        for s in past:
            arena.view(s)[:] = 0


def _routing(n_slots_used: int, n_tokens: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(n_slots_used, k, replace=False) for _ in range(n_tokens)])
    x = mx.array(rng.standard_normal((n_tokens, 256)).astype(np.float32))
    return x, mx.array(ids.astype(np.uint32))


@needs_cxx
def test_big_arena_expert_kernels_read_far_slots(big):
    """The reference path and the host dialect of the custom kernels (the very algorithm the
    CUDA and Metal dialects run) compute from slots past 2 GiB (and 4 GiB with -m slow) what
    they compute from the same records in a small arena."""
    arena, layout, recs = big
    rb = layout.record_bytes
    far = [2**31 // rb + 1, arena.n_slots - 1]  # the last slot: past 4 GiB in the slow case
    if arena.nbytes > 4 * GiB:
        far.insert(1, 4 * GiB // rb + 1)
    for s, rec in zip(far, recs):
        arena.view(s)[: rec.size] = rec
    try:
        small = mx.array(np.stack(recs[: len(far)]))  # record i in slot i
        x, idx = _routing(len(far), n_tokens=3, k=2, seed=5)
        slots = mx.array(far, dtype=mx.uint32)
        ref = cpu_reference(x, small, layout, idx)  # float32 on the CPU, as the host kernel
        got_ref = cpu_reference(x, arena.rows[slots], layout, idx)
        np.testing.assert_array_equal(np.array(got_ref), np.array(ref))
        fn = dispatch.kernel_for("host", layout)
        y = fn(x, arena.rows, slots, idx, layout)
        _compare(y, ref, "host kernel on far slots", max_tol=1e-5, frob_tol=1e-6)
        w = fn.dequantize(arena.rows, slots)
        w_small = fn.dequantize(small, mx.arange(len(far), dtype=mx.uint32))
        for p in w:
            np.testing.assert_array_equal(np.array(w[p]), np.array(w_small[p]), err_msg=p)
    finally:
        for s in far:
            arena.view(s)[:] = 0


def test_a_25gb_arena_builds_its_buffer_and_rows_view():
    """Built lazily (never evaluated: no memory), so every shape check MLX makes when an op is
    built runs: a 25 GB buffer has 3.1e9 words, more than one flat dim holds."""
    rb = 27 * ALIGNMENT
    n_slots = 25 * 10**9 // rb
    nbytes = n_slots * rb
    with pytest.raises(OverflowError):  # the old layout: one flat dim of 8-byte words
        mx.zeros((nbytes // 8 + ALIGNMENT // 8,), dtype=mx.uint64)
    shape = buffer_shape(nbytes)
    assert all(d < 2**31 for d in shape)
    lazy = mx.zeros(shape, dtype=mx.uint64)
    assert lazy.nbytes == nbytes + ALIGNMENT  # one page of slack for aligning slot 0
    with pytest.raises(OverflowError):  # as_strided flattens its input: not the whole buffer
        mx.as_strided(lazy, (n_slots, rb // 8), (rb // 8, 1), 509)
    rows = slot_rows(lazy, n_slots, rb, ALIGNMENT - 24)  # MLX CPU buffers sat at 24 mod 4096
    assert rows.shape == (n_slots, rb) and rows.dtype == mx.uint8
    with pytest.raises(ValueError):
        buffer_shape(nbytes + 1)
    with pytest.raises(ValueError):  # a view past the buffer's end
        slot_rows(lazy, n_slots + 1, rb, 0)


def test_small_arena_rows_alias_slots():
    arena = Arena(3, 2 * ALIGNMENT)
    assert np.asarray(arena.rows).ctypes.data == arena.address(0)
    arena.view(1)[5] = 7
    assert arena.rows[1, 5].item() == 7 and arena.rows[mx.array([0, 2])].max().item() == 0
    with pytest.raises(ValueError):
        Arena(2, ALIGNMENT + 8)
    with pytest.raises(ValueError):
        Arena(0, ALIGNMENT)


# ---------------------------------------------------------------------------------------------
# Eviction policies


def full_arena(n_slots: int, keys, eviction: str = "lru", **kw) -> Arena:
    """An arena of `n_slots` whose slots hold `keys`, loaded, allocated in this order."""
    arena = Arena(n_slots, ALIGNMENT, eviction, **kw)
    for key in keys:
        arena.loaded(arena.allocate(key)[0])
    return arena


def evict(arena: Arena, newcomer) -> tuple:
    """Allocate `newcomer` (loaded at once) and return the key it evicted."""
    got = arena.allocate(newcomer)
    assert got is not None, "every slot is busy"
    slot, victim = got
    arena.loaded(slot)
    assert victim is not None, "nothing was evicted"
    return victim


def test_lru_evicts_least_recently_used():
    arena = full_arena(3, [(0, 0), (0, 1), (0, 2)])
    arena.touch((0, 0))  # a hit: (0, 1) is now the oldest
    assert evict(arena, (0, 3)) == (0, 1)
    assert (0, 1) not in arena.slot_of and arena.resident((0, 3))
    assert evict(arena, (0, 4)) == (0, 2)
    assert evict(arena, (0, 5)) == (0, 0)


@pytest.mark.parametrize("eviction", sorted(POLICIES))
def test_touch_all_leaves_the_eviction_order_of_one_touch_at_a_time(eviction):
    keys = [(0, e) for e in range(6)]
    uses = [(0, 4), (0, 1), (0, 4), (0, 0), (0, 5)]
    orders = []
    for batch in (False, True):
        arena = full_arena(6, keys, eviction)
        if batch:
            arena.touch_all(uses)
        else:
            for key in uses:
                arena.touch(key)
        orders.append([evict(arena, (1, e)) for e in range(6)])
    assert orders[0] == orders[1]


class _CountingLRU(LRU):
    def __init__(self):
        super().__init__()
        self.seen = []

    def touch(self, key):
        self.seen.append(key)
        super().touch(key)


def test_touch_all_calls_an_overridden_touch_for_each_key():
    policy = _CountingLRU()
    policy.touch_all([(0, 2), (0, 1)])
    assert policy.seen == [(0, 2), (0, 1)]


def test_lfu_evicts_least_used_and_old_fame_fades():
    arena = full_arena(3, [(0, 0), (0, 1), (0, 2)], "lfu")
    for _ in range(3):
        arena.touch((0, 0))
    arena.touch((0, 2))
    arena.touch((0, 1))  # counts: (0,0) 4, (0,1) 2, (0,2) 2; LRU order (0,0), (0,2), (0,1)
    assert evict(arena, (0, 3)) == (0, 2)  # least used; the tie with (0,1) goes by LRU
    # counts halve every `period` uses: an old favourite A loses to a newer B even though
    # A was used last (LRU would evict B) and was used more in all (plain LFU would evict B)
    a, b = (1, 0), (1, 1)
    uses = [a] * 8 + [b] * 6 + [a]
    for period, victim in ((2, a), (10**9, b)):
        lfu = LFUAging(period=period)
        for key in uses:
            lfu.touch(key)
        assert lfu.victim(lambda k: True) == victim, period
    lru = LRU()
    for key in uses:
        lru.touch(key)
    assert lru.victim(lambda k: True) == b


class _ScanLFU(LRU):
    """The scan the heap policies replaced, as the reference: the lowest score, scanning
    the LRU order oldest first (so ties go to the least recently used)."""

    def __init__(self, score):
        super().__init__()
        self.score = score

    def victim(self, evictable):
        best, best_score = None, None
        for key in self._order:
            if evictable(key):
                s = self.score(key)
                if best is None or s < best_score:
                    best, best_score = key, s
        return best


@pytest.mark.parametrize("name", ["lfu", "profile"])
def test_heap_policies_pick_the_scan_s_victims(name):
    """LFUAging and ProfileAware keep a lazy heap; on a random run of touches, evictions and
    filters (pinned / protected keys) they pick exactly what a scan of every key picks."""
    rng = random.Random(3)
    layers = [0, 1, 2]
    profile = np.array([[rng.randint(0, 4) for _ in range(6)] for _ in layers])
    if name == "lfu":
        period, counts, uses = 5, {}, [0]

        def touch_ref(key):  # counts halve every `period` uses (the original rule)
            counts[key] = counts.get(key, 0.0) + 1.0
            uses[0] += 1
            if uses[0] % period == 0:
                for k in counts:
                    counts[k] *= 0.5

        policy = LFUAging(period=period)
        ref = _ScanLFU(lambda k: counts.get(k, 0.0))
    else:
        pop = {l: profile[i] / profile[i].sum() for i, l in enumerate(layers)}
        policy = POLICIES["profile"](profile, layers)
        ref = _ScanLFU(lambda k: float(pop[k[0]][k[1]]))
    resident: set = set()
    for step in range(3000):
        if len(resident) < 8 or rng.random() < 0.5:
            key = (rng.choice(layers), rng.randrange(6))
            policy.touch(key)
            ref.touch(key)
            if name == "lfu":
                touch_ref(key)
            resident.add(key)
            continue
        blocked = {k for k in resident if rng.random() < 0.3}
        want = ref.victim(lambda k, b=blocked: k not in b)
        assert policy.victim(lambda k, b=blocked: k not in b) == want, step
        if want is not None:
            policy.remove(want)
            ref.remove(want)
            resident.discard(want)


def test_profile_evicts_least_popular_in_its_layer():
    profile = np.array([[10, 1, 5], [0, 9, 2]])  # routing counts; rows are layers 3 and 7
    keys = [(3, 0), (3, 1), (7, 0), (7, 2), (7, 1)]
    arena = full_arena(5, keys, "profile", profile=profile, layers=[3, 7])
    # popularity within its layer: (3,0) 10/16, (3,1) 1/16, (3,2) 5/16, (7,0) 0, (7,1) 9/11,
    # (7,2) 2/11; layer 5 has no profile row: 0
    assert evict(arena, (3, 2)) == (7, 0)
    assert evict(arena, (7, 0)) == (3, 1)
    assert evict(arena, (5, 0)) == (7, 0)
    arena.pin([arena.slot_of[(5, 0)]])
    assert evict(arena, (5, 1)) == (7, 2)  # (5,0) is pinned
    arena.unpin_all()
    arena.touch((5, 0))  # ties go by LRU: (5,1) is now the older of the two at 0
    assert evict(arena, (5, 2)) == (5, 1)
    # no profile at all: plain LRU
    lru = full_arena(2, [(0, 0), (0, 1)], "profile")
    lru.touch((0, 0))
    assert evict(lru, (0, 2)) == (0, 1)


def test_layer_evicts_the_layer_that_comes_back_last():
    layers = [0, 1, 2, 3]
    keys = [(layer, e) for layer in layers for e in (0, 1)]
    arena = full_arena(8, keys, "layer", layers=layers)
    arena.touch((2, 0))  # LRU within layer 2: (2,1) is older now
    arena.set_layer(2)
    # the current layer first: its experts not needed now come back after a whole cycle
    assert evict(arena, (2, 5)) == (2, 1)
    arena.pin([arena.slot_of[(2, 0)], arena.slot_of[(2, 5)]])  # the running layer's experts
    order = []
    for i in range(6):
        order.append(evict(arena, (2, 10 + i)))
        arena.pin([arena.slot_of[(2, 10 + i)]])
    # then the layer before, and so on backwards; the layer after the current one last
    assert order == [(1, 0), (1, 1), (0, 0), (0, 1), (3, 0), (3, 1)]
    assert arena.allocate((2, 99)) is None  # every slot pinned


def test_layer_policy_visits_layers_backwards_from_the_current_one():
    layers = [10, 20, 30, 40, 50]
    policy = LayerDistance(layers=layers)
    for layer in layers:
        policy.touch((layer, 0))
    order = {}
    for current in (10, 30, 50):
        policy.current = current
        seen, evictable = [], set(layers)
        while (v := policy.victim(lambda k, ev=evictable: k[0] in ev)) is not None:
            seen.append(v[0])
            evictable.discard(v[0])
        order[current] = seen
    assert order == {
        10: [10, 50, 40, 30, 20],
        30: [30, 20, 10, 50, 40],
        50: [50, 40, 30, 20, 10],
    }


def test_layer_policy_without_a_layer_list_still_evicts():
    arena = full_arena(2, [(4, 0), (6, 0)], "layer")  # Arena(n, rb, "layer"): no layers given
    arena.set_layer(6)
    assert evict(arena, (6, 1)) == (6, 0)


@pytest.mark.parametrize("eviction", sorted(POLICIES))
def test_pinned_and_loading_slots_are_never_evicted(eviction):
    rng = random.Random(eviction)
    layers = [0, 1, 2]
    profile = np.array([[rng.randint(0, 9) for _ in range(8)] for _ in layers])
    arena = Arena(6, ALIGNMENT, eviction, profile=profile, layers=layers)
    keys = [(layer, e) for layer in layers for e in range(8)]
    refused = evictions = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.5:
            key = rng.choice(keys)
            if key in arena.slot_of:
                arena.touch(key)
                continue
            arena.set_layer(key[0])
            busy = {arena.owner[s] for s in arena.pinned | arena.loading}
            got = arena.allocate(key)
            if got is None:
                refused += 1
                assert len(arena.pinned | arena.loading) == arena.n_slots, "refused, yet idle"
                continue
            slot, victim = got
            assert slot in arena.loading and arena.owner[slot] == key
            if victim is not None:
                evictions += 1
                assert victim not in busy, f"evicted a busy expert {victim}"
        elif op < 0.7 and arena.loading:
            arena.loaded(rng.choice(sorted(arena.loading)))
        elif op < 0.85:
            owned = [s for s, k in enumerate(arena.owner) if k is not None]
            if owned:
                arena.pin([rng.choice(owned)])
        elif op < 0.97:
            arena.unpin_all()
        elif arena.loading:
            arena.release(rng.choice(sorted(arena.loading)))  # a dropped read
        # residency stays a bijection
        assert all(arena.owner[s] == k for k, s in arena.slot_of.items())
    assert evictions > 100 and refused > 0  # both paths were exercised


def test_each_documented_policy_is_built_by_name():
    assert sorted(POLICIES) == ["layer", "lfu", "lru", "profile"]
    for name, cls in POLICIES.items():
        policy = Arena(1, ALIGNMENT, name, profile=np.ones((1, 2)), layers=[0]).policy
        assert type(policy) is cls and policy.name == name
    with pytest.raises(ValueError, match="unknown eviction policy"):
        Arena(1, ALIGNMENT, "fifo")


@pytest.mark.parametrize("hugepages", [True, False])
def test_arena_slots_read_back_what_was_written_with_huge_pages_or_not(hugepages):
    """The CPU backend's arena gives its zeroed pages back to come back huge; the slots still
    start as zeros and the device sees what the host writes."""
    arena = Arena(6, 2 * ALIGNMENT, hugepages=hugepages)
    assert not np.array(arena.rows).any()
    for s in range(6):
        arena.view(s)[:] = s + 1
    rows = np.array(arena.rows)
    assert all((rows[s] == s + 1).all() for s in range(6))


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside, kb = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= address < hi
        elif inside and head[:1] == ["AnonHugePages:"]:
            kb += int(head[1])
    return kb


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text() or mx.default_device() != mx.cpu,
    reason="Linux transparent huge pages, the CPU backend's arena",
)
def test_cpu_arena_slots_fault_in_as_huge_pages():
    """Reads land in huge pages (1.3-1.7x direct-read bandwidth on the dev machine): the
    arena's memory shows AnonHugePages once written; left in small pages, none (where THP is
    "madvise": with "always" every large mapping gets them). Each case runs in a fresh process:
    glibc raises its mmap threshold after a large free, so a later arena can land in heap
    memory an earlier advised arena left flagged for huge pages."""
    script = (
        "import sys\nfrom pathlib import Path\n"
        + inspect.getsource(_anon_huge_kb)
        + "from strata_mlx.stream.arena import Arena\n"
        "arena = Arena(16, 983040, hugepages=sys.argv[1] == '1')  # 15 MB: several 2 MB extents\n"
        "for s in range(arena.n_slots):\n"
        "    arena.view(s)[:] = 1\n"
        "print(_anon_huge_kb(arena.address(8)))\n"
    )
    for hugepages in (True, False):
        out = subprocess.run(
            [sys.executable, "-c", script, str(int(hugepages))],
            capture_output=True,
            text=True,
            check=True,
        )
        kb = int(out.stdout.split()[-1])
        if hugepages or "[madvise]" in THP.read_text():
            assert (kb > 0) == hugepages, (hugepages, kb)


def test_the_c_evictable_answers_as_the_arena_s_rule():
    """strata_mlx._nextuse.Evictable (the arena's rule, which the native policies check
    without a Python call) against that rule in Python, over random residents, pins, reads
    in flight, protected layers and kept keys; a key not resident is a KeyError in both."""
    from strata_mlx._nextuse import Evictable

    rng = random.Random(0)
    for _ in range(200):
        keys = list({(rng.randrange(4), rng.randrange(8)) for _ in range(12)})
        slot_of = {k: i for i, k in enumerate(keys)}
        pinned = set(rng.sample(range(len(keys)), rng.randint(0, 4)))
        loading = set(rng.sample(range(len(keys)), rng.randint(0, 4)))
        protect = set(rng.sample(range(4), rng.randint(0, 2))) or None
        keep = set(rng.sample(keys, rng.randint(0, 3))) or None
        ev = Evictable(slot_of, pinned, loading, protect, keep)
        for k in keys:
            want = (
                k[0] not in (protect or ())
                and k not in (keep or ())
                and slot_of[k] not in pinned
                and slot_of[k] not in loading
            )
            assert ev(k) is want
    ev = Evictable({}, set(), set())
    with pytest.raises(KeyError):
        ev((9, 9))
    for bad in ((1,), [1, 2], 3):
        with pytest.raises(TypeError, match="tuple"):
            ev(bad)
    with pytest.raises(TypeError):
        Evictable([], set(), set())
