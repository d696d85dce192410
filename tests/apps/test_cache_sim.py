"""Trace replay (strata_mlx.apps.cache_sim): it counts what a live run counts, Belady's optimum is
optimal, and `strata-mlx cache-sim` prints a line per policy or a one-line error."""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
import pytest
from conftest import prompt_ids
from test_policies import Greedy, IgnoresPins, Never, Twice

import strata_mlx
from strata_mlx.apps import cache_sim
from strata_mlx.config import OptionError
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import stream_generate
from strata_mlx.stream import trace
from strata_mlx.stream.arena import LRU
from strata_mlx.stream.stats import RoutingTrace

FAMILY = "qwen3_moe"
SLOTS = 9  # of the tiny store's 16 records: every call fits, and it misses


def live_run(path, eviction, scheduler="loop"):
    rb = load_manifest(path).layout.record_bytes
    model, _ = strata_mlx.load(
        path,
        arena_gb=SLOTS * rb / 1024**3,
        read_ahead="demand",
        decode="sync",
        eviction=eviction,
        scheduler=scheduler,
        trace=RoutingTrace(),
    )
    assert model.expert_cache.arena.n_slots == SLOTS
    tokens = [
        r.token
        for r in stream_generate(
            model, None, prompt_ids(24, seed=9), max_tokens=12, prefill_step_size=8
        )
    ]
    model.expert_cache.close()
    return model, tokens


@pytest.mark.parametrize("eviction", ["lru", "lfu", "arc", "nextuse", "nextuse-duel"])
@pytest.mark.parametrize("scheduler", ["loop", "sync"])
def test_a_replay_counts_the_misses_of_a_live_run(store, tmp_path, eviction, scheduler):
    path = store(FAMILY)
    model, _ = live_run(path, eviction, scheduler)
    live = model.expert_cache.stats
    f = tmp_path / "t.npz"
    trace.write(f, trace.of_model(model))
    r = cache_sim.replay(trace.read(f), SLOTS, eviction)
    assert live.misses > 10  # the arena misses, in prefill and decode
    assert r.prefill_lookups + r.decode_lookups == live.lookups
    assert r.prefill_misses + r.decode_misses == live.misses
    assert r.decode_misses > 0 and r.decode_tokens == 11


def brute_force_min_misses(seq, slots):
    """The fewest misses of any eviction choice (exhaustive): seq is [(layer keys)]."""

    @functools.cache
    def best(i, resident):
        if i == len(seq):
            return 0
        keys = seq[i]
        missed = [k for k in keys if k not in resident]
        states = [frozenset(resident)]
        for k in missed:  # each miss evicts some unpinned resident when the arena is full
            nxt = []
            for s in states:
                if len(s) < slots:
                    nxt.append(s | {k})
                else:
                    nxt += [(s - {v}) | {k} for v in s if v not in keys]
            states = nxt
        return len(missed) + min(best(i + 1, s) for s in states)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_the_optimum_and_no_policy_beats_it(seed):
    rng = np.random.default_rng(seed)
    calls = 9
    ids = {l: [rng.integers(0, 5, (1, 2)) for _ in range(calls)] for l in (0, 1)}
    t = trace.Trace([0, 1], 5, 4096, ids, decode_from=0)
    seq = [tuple((l, int(e)) for e in es) for _, l, es in t.lookups()]
    best = cache_sim.replay(t, 4, "belady")
    assert best.decode_misses == brute_force_min_misses(seq, 4)
    for name in ("lru", "lfu", "layer", "lru2", "lrfu", "arc", "protected", "nextuse"):
        assert cache_sim.replay(t, 4, name).decode_misses >= best.decode_misses, name


def test_lru_replay_known_answer():
    # one layer, 2 slots, one expert a call: 0 1 2 0 1 2 misses all six under LRU,
    # while Belady keeps 0 (or 1) and misses four
    ids = {0: [np.array([[e]]) for e in (0, 1, 2, 0, 1, 2)]}
    t = trace.Trace([0], 3, 1 << 20, ids, decode_from=0)
    assert cache_sim.replay(t, 2, "lru").decode_misses == 6
    b = cache_sim.replay(t, 2, "belady")
    assert b.decode_misses == 4
    assert b.mb_per_token == pytest.approx(4 * (1 << 20) / 6 / 1e6)


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strata_mlx", "cache-sim", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cache_sim_prints_a_line_per_policy(tmp_path):
    rng = np.random.default_rng(0)
    ids = {l: [rng.integers(0, 16, (8, 2))] + [rng.integers(0, 16, (1, 2)) for _ in range(30)]
           for l in (0, 1)}  # fmt: skip
    f = tmp_path / "t.npz"
    trace.write(f, trace.Trace([0, 1], 16, 8192, ids))
    r = run_cli(f, "--slots", 12, "--policy", "lru,lfu,arc,belady")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "29 decode" in lines[0] and len(lines) == 6
    for line, name in zip(lines[1:], ("lru", "lfu", "arc", "belady")):
        assert line.split(":")[0].strip() == name
        assert "% miss" in line and "MB/token" in line and "prefill" in line
    assert "gap closed 100.0 %" in lines[-2]
    assert lines[-1].startswith("gap closed: the share of LRU's decode misses above Belady's")


@pytest.mark.parametrize(
    "args, says",
    [
        (["--slots", 3], "--slots 3: a layer needs"),
        (["--slots", 12, "--policy", "nope"], "--policy 'nope': unknown eviction policy"),
        (["--slots", 12, "--policy", "no_such_module:P"], "cannot import 'no_such_module'"),
        (["--slots", 12, "--policy", ","], "--policy: name at least one"),
        (["--slots", "4,,8"], "--slots '4,,8': an empty entry"),
        # (spaces inside an entry: not 20004000 slots)
        (["--slots", "2000 4000"], "--slots '2000 4000': expected comma-separated slot counts"),
        (["--slots", 10**12], "--slots 1000000000000: more than the trace's 16 expert records"),
    ],
)
def test_cache_sim_bad_input_is_one_line(tmp_path, args, says):
    f = tmp_path / "t.npz"
    trace.write(f, trace.Trace([0], 16, 8192, {0: [np.arange(8).reshape(4, 2)]}))
    r = run_cli(f, *args)
    assert r.returncode != 0 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = run_cli(tmp_path / "missing.npz", "--slots", 4)
    assert r.returncode != 0 and "no such trace file" in r.stderr


def test_cache_sim_sweeps_arena_sizes_and_plots_them(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    rng = np.random.default_rng(1)
    ids = {l: [rng.integers(0, 16, (1, 2)) for _ in range(20)] for l in (0, 1)}
    f = tmp_path / "t.npz"
    trace.write(f, trace.Trace([0, 1], 16, 8192, ids))
    png = tmp_path / "sweep.png"
    r = run_cli(f, "--slots", "4,8,16", "--policy", "lru,belady", "--plot", png)
    assert r.returncode == 0, r.stderr
    heads = [line for line in r.stdout.splitlines() if line.startswith(str(f))]
    assert [h.split(", ")[-1] for h in heads] == ["4 slots (12.5 %)", "8 slots (25.0 %)",
                                                  "16 slots (50.0 %)"]  # fmt: skip
    assert matplotlib.image.imread(png).ndim == 3
    r = run_cli(f, "--slots", "4,x")
    assert (
        r.returncode != 0
        and "--slots '4,x': expected comma-separated slot counts, e.g. 2000,4000" in r.stderr
    )


def predicted_trace(perfect: bool) -> trace.Trace:
    """4 layers of 16 experts, one token a call; predictions the true next layer's ids, or
    ids never used."""
    rng = np.random.default_rng(3)
    ids = {l: [np.arange(8).reshape(4, 2)] + [rng.integers(0, 8, (1, 2)) for _ in range(300)]
           for l in range(4)}  # fmt: skip
    pred = {l: [c if perfect else c + 8 for c in ids[l]] for l in range(1, 4)}
    return trace.Trace(list(range(4)), 16, 4096, ids, predicted=pred, decode_from=1)


def test_read_ahead_is_modelled_from_the_trace_s_predictions():
    t = predicted_trace(perfect=True)
    plain = cache_sim.replay(t, 12, "lru")
    ahead = cache_sim.replay(t, 12, "lru", "lookahead")
    assert ahead.policy == "lru+lookahead"
    # layers 1-3 are read ahead before they run: only layer 0 can miss
    assert ahead.decode_misses < plain.decode_misses
    assert ahead.decode_ahead_used == ahead.decode_ahead_reads > 0
    reads = ahead.decode_misses + ahead.decode_ahead_reads
    assert ahead.mb_per_token == pytest.approx(reads * 4096 / t.decode_tokens / 1e6)
    # predictions never used: lookahead reads them all for nothing and evicts what was needed;
    # the scored read-ahead learns that they are not used: once a guess is expected used
    # later than the residents it would evict, it stops (LRU has no such estimate: it reads
    # as lookahead does)
    t = predicted_trace(perfect=False)
    wasted = cache_sim.replay(t, 12, "nextuse", "lookahead")
    scored = cache_sim.replay(t, 12, "nextuse", "scored")
    assert wasted.decode_ahead_used == 0 and wasted.decode_misses >= plain.decode_misses
    assert scored.decode_ahead_reads < wasted.decode_ahead_reads / 2
    assert scored.decode_misses < wasted.decode_misses
    lru = cache_sim.replay(t, 12, "lru", "scored")
    assert lru.decode_ahead_reads == cache_sim.replay(t, 12, "lru", "lookahead").decode_ahead_reads


def test_read_ahead_needs_predictions_and_an_online_policy():
    t = predicted_trace(perfect=True)
    with pytest.raises(OptionError, match="Belady's optimum reads nothing ahead"):
        cache_sim.replay(t, 12, "belady", "lookahead")
    t.predicted = {}
    with pytest.raises(OptionError, match="--read-ahead: the trace has no prediction"):
        cache_sim.replay(t, 12, "lru", "lookahead")
    with pytest.raises(OptionError, match="--read-ahead 'always': one of none"):
        cache_sim.replay(t, 12, "lru", "always")


def test_a_trace_file_that_is_empty_or_holds_no_arrays_is_one_line(tmp_path):
    """An empty file printed only "Aborted." (numpy's EOFError); an .npz whose member is no
    .npy array an AttributeError's traceback."""
    import zipfile

    empty, hollow = tmp_path / "e.npz", tmp_path / "h.npz"
    empty.write_bytes(b"")
    trace.write(hollow, trace.Trace([0], 16, 8192, {0: [np.arange(8).reshape(4, 2)]}))
    with zipfile.ZipFile(hollow) as z:
        members = {n: z.read(n) for n in z.namelist()}
    with zipfile.ZipFile(hollow, "w") as z:
        for n, data in members.items():
            z.writestr(n, b"" if n.startswith("L0") else data)
    for f in (empty, hollow):
        r = run_cli(f, "--slots", 4)
        assert r.returncode != 0 and f"{f}: not a trace file" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def one_layer(calls, decode_from: int, slots_of: int = 3) -> trace.Trace:
    """Layer 0 of `slots_of` experts, one call a list of experts."""
    return trace.Trace([0], slots_of, 4096, {0: [np.array([c]).T for c in calls]},
                       decode_from=decode_from)  # fmt: skip


def test_belady_bounds_the_decode_misses_it_is_compared_with():
    # Belady's fewest misses over prompt and decode (evict 0 for 2) missed in decode where
    # LFU did not: LFU closed "200 %" of LRU's gap
    t = one_layer([[0], [0], [0], [1], [2], [1], [0]], decode_from=6)
    lru, lfu, best = (cache_sim.replay(t, 2, p) for p in ("lru", "lfu", "belady"))
    assert (lru.decode_misses, lfu.decode_misses, best.decode_misses) == (1, 0, 0)
    assert "gap closed 100.0 %" in lfu.line(lru, best)


def brute_force_min_decode_misses(seq, slots):
    """The fewest decode misses of any eviction choice: seq is [(is decode, layer keys)]."""

    @functools.cache
    def best(i, resident):
        if i == len(seq):
            return 0
        decode, keys = seq[i]
        missed = [k for k in keys if k not in resident]
        states = [frozenset(resident)]
        for k in missed:
            nxt = []
            for s in states:
                nxt += (
                    [s | {k}] if len(s) < slots else [(s - {v}) | {k} for v in s if v not in keys]
                )
            states = nxt
        return decode * len(missed) + min(best(i + 1, s) for s in states)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_the_fewest_decode_misses_and_no_read_ahead_reads_less(seed):
    rng = np.random.default_rng(seed)
    ids = {l: [rng.integers(0, 5, (1, 2)) for _ in range(8)] for l in (0, 1)}
    pred = {1: [rng.integers(0, 5, (1, 2)) for _ in range(8)]}
    t = trace.Trace([0, 1], 5, 4096, ids, predicted=pred, decode_spans=[(2, 5), (6, 8)])
    seq = [(d, tuple((l, int(e)) for e in es)) for d, l, es in t.lookups()]
    best = cache_sim.replay(t, 4, "belady")
    assert best.decode_misses == brute_force_min_decode_misses(seq, 4)
    for name in ("lru", "lfu", "arc", "nextuse"):
        for ahead in ("none", "lookahead", "scored"):
            assert cache_sim.replay(t, 4, name, ahead).decode_reads >= best.decode_misses


def test_read_ahead_stops_where_every_slot_is_pinned():
    # each call's layer fills both slots: no slot is left to read the next layer into
    t = trace.Trace([0, 1], 6, 4096, {0: [np.array([[0, 1]])] * 4, 1: [np.array([[2, 3]])] * 4},
                    predicted={1: [np.array([[4, 5]])] * 4}, decode_from=1)  # fmt: skip
    plain = cache_sim.replay(t, 2, "lru")
    for ahead in ("lookahead", "scored"):
        r = cache_sim.replay(t, 2, "lru", ahead)
        assert r.decode_ahead_reads == 0 and r.decode_misses == plain.decode_misses


@pytest.mark.parametrize(
    "policy, says",
    [
        (IgnoresPins, r"victim \(0, 2\) may not be evicted \(pinned"),
        (Never, r"victim\(\) returned None while resident experts could be evicted"),
        (Twice, r"victims\(\) named a key twice"),
        (Greedy, r"victims\(\) named a key twice, or more keys than the 16 asked for"),
    ],
)
def test_a_plug_in_victim_the_arena_would_refuse_is_refused(policy, says):
    # (obeyed, the pinned victim missed fewer than any live run: a layer's expert evicted
    # for another of the same layer, both counted resident)
    # (the batch call: 16 misses at once; 32 slots, so that more than 16 may go)
    wide = [list(range(32)), list(range(32, 48))]
    batch = policy in (Twice, Greedy)
    t = one_layer(wide if batch else [[0, 1], [2, 3]], 0, 64)
    with pytest.raises(OptionError, match=f"eviction policy {policy.__name__}: {says}"):
        cache_sim.replay(t, 32 if batch else 2, policy)


def test_the_plot_may_not_overwrite_the_trace(tmp_path):
    f = tmp_path / "t.png"  # (a trace by any name)
    trace.write(f, one_layer([[0], [1]], 1))
    link = tmp_path / "link.png"
    link.symlink_to(f)
    before = f.read_bytes()
    for plot in (f, link, tmp_path / "." / "t.png"):
        with pytest.raises(OptionError, match=f"--plot {plot}: is the trace being read"):
            cache_sim.report(f, 2, "lru", plot=plot)
    assert f.read_bytes() == before


@pytest.mark.parametrize("slots", [32.5, float("nan"), "4", True])
def test_slots_are_a_whole_number(slots):
    with pytest.raises(OptionError, match="--slots .*: expected a whole number of slots"):
        cache_sim.replay(one_layer([[0], [1]], 1), slots, "lru")


def test_policy_names_are_stripped_and_reads_count_the_read_ahead(tmp_path):
    f = tmp_path / "t.npz"
    trace.write(f, predicted_trace(perfect=True))
    lines = cache_sim.report(f, 12, " lru, belady ", read_ahead="lookahead")
    assert [line.split(":")[0].strip() for line in lines[1:4]] == [
        "lru", "lru+lookahead", "belady"]  # fmt: skip
    r = cache_sim.replay(predicted_trace(perfect=True), 12, "lru", "lookahead")
    reads = r.prefill_misses + r.decode_misses + r.decode_ahead_reads
    assert r.prefill_share == pytest.approx(100 * r.prefill_misses / reads)


def test_decode_is_every_call_of_a_decode_span():
    # two generations: a prompt of 2 calls, 2 decode steps; a prompt of 3 calls, 1 step
    t = trace.Trace([0], 4, 4096, {0: [np.array([[e % 4]]) for e in range(8)]},
                    decode_spans=[(2, 4), (7, 8)])  # fmt: skip
    r = cache_sim.replay(t, 2, "lru")
    assert (r.decode_lookups, r.prefill_lookups, r.decode_tokens) == (3, 5, 3)
    phases = []

    class Told(LRU):
        def phase(self, decoding):
            phases.append(decoding)

    cache_sim.replay(t, 2, Told)
    assert phases == [False, True, False, True]
