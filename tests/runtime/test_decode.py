"""Pipelined decode (strata_mlx.runtime.decode) is exact: greedy tokens and every decode step's
logits are bit-identical to the per-layer-sync path, for every family, arena size and lag,
including tokens where a layer misses and is recomputed."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import stream_generate
from strata_mlx.runtime import decode as decode_module
from strata_mlx.runtime import deferred
from strata_mlx.stream.scheduler import Scheduler

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen3_next", "glm4_moe", "deepseek_v3", "gpt_oss"]


def arena_for(path, fraction: float) -> float:
    m = load_manifest(path)
    slots = max(1, round(fraction * m.num_experts * len(m.moe_layers)))
    return slots * m.layout.record_bytes / 1024**3


def decode(model, ids, n=10, **kw):
    """Greedy (or sampled) tokens and the log-probabilities of every decode step."""
    out = [(r.token, np.array(r.logprobs)) for r in stream_generate(model, None, ids, n, **kw)]
    return [t for t, _ in out], np.stack([lp for _, lp in out])


# Pipelined variants, each forced into one mode: "layers" (checked `lag` layers late,
# `layers_chunk` submitted at a time) never runs whole tokens; "token" always does (each token verified after the next one is built,
# a miss discards both), with `chunk` layers submitted at a time.
VARIANTS = {
    "layers-lag0": dict(decode_lag=0, decode_token_below=0.0),
    "layers-lag2": dict(decode_lag=2, decode_token_below=0.0),
    "layers-lag5": dict(decode_lag=5, decode_token_below=0.0),
    # Layers submitted three at a time, checked two late (each check reads a submitted layer)
    # or one late (a check evaluates layers not yet submitted itself).
    "layers-chunk3-lag2": dict(decode_lag=2, decode_token_below=0.0, decode_layers_chunk=3),
    "layers-chunk3-lag1": dict(decode_lag=1, decode_token_below=0.0, decode_layers_chunk=3),
    "token-chunk1": dict(decode_token_below=1.0, decode_sync_above=1.0, decode_chunk=1),
    "token-chunk3": dict(decode_token_below=1.0, decode_sync_above=1.0, decode_chunk=3),
    "token-whole": dict(decode_token_below=1.0, decode_sync_above=1.0),  # (one submit a token)
    "adaptive": dict(),
    # lookahead predicting, token mode allowed meanwhile (decode_token_while_predicting)
    "adaptive-lookahead-token": dict(read_ahead="lookahead", decode_token_while_predicting=True),
    # gated (the host's gate on this CPU): every layer's reads waited for, slots from the gate
    # table; with lookahead's read-ahead in flight when layers ask
    "gated": dict(decode_gate=True, decode_token_below=0.0),
    "gated-lookahead": dict(decode_gate=True, decode_token_below=0.0, read_ahead="lookahead"),
    "gated-adaptive": dict(decode_gate=True, read_ahead="lookahead"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_pipelined_equals_sync(store, family):
    path = store(family)
    ids = prompt_ids(24, seed=11)
    for fraction in (1.0, 0.25, 0.05):
        gb = arena_for(path, fraction)
        sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead="demand")
        ref_tokens, ref_lp = decode(sync, ids)
        for name, kw in VARIANTS.items():
            model, _ = strata_mlx.load(path, arena_gb=gb, **{"read_ahead": "demand", **kw})
            tokens, lp = decode(model, ids)
            assert tokens == ref_tokens, (fraction, name)
            assert np.array_equal(lp, ref_lp), (fraction, name)
            s = model.expert_cache.stats
            assert s.lookups == sync.expert_cache.stats.lookups  # each layer counted once
            if fraction == 1.0:
                assert s.recomputed_layers == 0
            if name.startswith("gated") and model.expert_cache.pipelined.gated:
                assert s.recomputed_layers == 0 and s.gate_timeouts == 0, (fraction, name)
                assert fraction == 1.0 or s.gated_mode_tokens > 0, (fraction, name)
            model.expert_cache.close()
        sync.expert_cache.close()


def test_sampled_tokens_equal_sync_across_recomputed_tokens(store):
    """temp > 0: a token whose sample was drawn from logits that a miss then recomputed is
    drawn again from the same random key, so the sampled stream equals the sync path's."""
    path = store("qwen3_moe")
    ids = prompt_ids(24, seed=15)
    gb = arena_for(path, 0.25)
    kw = dict(n=16, temp=1.0, seed=5)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead="demand")
    ref = decode(sync, ids, **kw)
    model, _ = strata_mlx.load(path, arena_gb=gb, read_ahead="demand", **VARIANTS["token-chunk3"])
    got = decode(model, ids, **kw)
    assert model.expert_cache.stats.recomputed_layers > 0  # some tokens were discarded
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    greedy = decode(sync, ids, n=16)[0]
    assert ref[0] != greedy  # the comparison is of sampled tokens


class HoldingReader:
    """The native reader, except that non-blocking polls never see a completion: every read
    lands "late", so a layer built while its read-ahead is in flight misses. So that what is
    resident never depends on when the reader's threads got to a read: a wait for any
    completion (an arena whose slots are all busy) gets the oldest read's alone, and no
    read-ahead is cancelled (as if each had started: the reader cancels only queued ones)."""

    def __init__(self, reader):
        self._reader = reader
        self._out: dict[int, None] = {}  # tags submitted and not collected, oldest first

    def submit(self, reqs, urgent=False):
        skipped = self._reader.submit(reqs, urgent)  # (quick misses read those already)
        self._out.update(dict.fromkeys(r[0] for r in reqs if r[0] not in skipped))
        return skipped

    def cancel(self, tags):
        return []

    def wait(self, tags=None, timeout=None):
        if tags is None:
            if not self._out:
                return []
            tags = [next(iter(self._out))]
        done = self._reader.wait(tags, timeout)
        for c in done:
            self._out.pop(c[0], None)
        return done

    def poll(self):
        return []

    def __getattr__(self, name):
        return getattr(self._reader, name)

    @property
    def words_by_driver(self) -> bool:  # (set as well as read: the native reader's)
        return self._reader.words_by_driver

    @words_by_driver.setter
    def words_by_driver(self, on: bool) -> None:
        self._reader.words_by_driver = on


@pytest.mark.parametrize("lag,chunk", [(1, 1), (2, 3)])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_read_held_back_mid_token_recomputes_exactly(store, family, lag, chunk):
    path = store(family)
    ids = prompt_ids(24, seed=12)
    gb = arena_for(path, 0.5)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync")
    sync.expert_cache.read_ahead.decode_min_miss = 0.0  # both predict in every decode layer
    ref = decode(sync, ids, 12)
    # The sync scheduler collects completions only through the reader's own calls, which
    # the holding reader intercepts (the loop's would arrive through its pipe regardless).
    model, _ = strata_mlx.load(
        path,
        arena_gb=gb,
        read_ahead="lookahead",
        decode_lag=lag,
        decode_layers_chunk=chunk,
        scheduler="sync",
    )
    ec = model.expert_cache
    ec.reader = HoldingReader(ec.reader)
    ec.read_ahead.decode_min_miss = 0.0  # predict in every decode layer: reads in flight
    failed, observed = [], []
    check, observe = ec.check_deferred, ec.predictor.observe_decode_layer
    ec.check_deferred = lambda d, **kw: check(d, **kw) or failed.append(d.layer)
    ec.predictor.observe_decode_layer = lambda share: observed.append(share) or observe(share)
    tokens, lp = decode(model, ids, 12)
    assert tokens == ref[0]
    assert np.array_equal(lp, ref[1])
    assert ec.stats.recomputed_layers > 0
    assert ec.stats.streamed_ahead > 0  # held read-ahead was promoted and waited for
    # A layer recomputed because its read-ahead was late counts for the mode rule as the
    # miss it was when built (once), not as the recomputing handshake's streamed-ahead hit.
    assert failed and sum(share > 0 for share in observed) >= len(failed)


def test_all_resident_decode_does_no_per_expert_work(store, monkeypatch):
    """With every expert resident, decode neither classifies experts one by one nor records
    their uses (eviction cannot happen), and never recomputes."""
    path = store("qwen3_moe")
    model, _ = strata_mlx.load(path, arena_gb=arena_for(path, 1.0), read_ahead="demand")
    ec = model.expert_cache
    ec.warm()
    ids = prompt_ids(16, seed=13)
    cache = model.make_cache()
    mx.eval(model(mx.array([ids]), cache=cache))  # prefill: the sync handshake

    def forbidden(*a, **k):
        raise AssertionError("per-expert work on the all-resident decode path")

    monkeypatch.setattr(ec.arena, "touch", forbidden)
    monkeypatch.setattr(ec.sched, "claim", forbidden)
    for t in (3, 5, 7):
        mx.eval(model.decoder(mx.array([[t]]), cache))
    assert ec.stats.recomputed_layers == 0 and ec.stats.misses == 0


def test_decode_falls_back_to_sync_while_most_layers_miss(store):
    """A 5 % arena misses in nearly every layer: pipelined tokens would each be built,
    found wrong and recomputed, so tokens run the sync handshake instead (same outputs)."""
    path = store("qwen3_next")
    ids = prompt_ids(24, seed=14)
    gb = arena_for(path, 0.05)
    runs, modes = {}, {}
    for sync_above in (1.0, 0.3):
        model, _ = strata_mlx.load(
            path, arena_gb=gb, read_ahead="demand", decode_sync_above=sync_above
        )
        st = model.expert_cache.stats
        runs[sync_above] = (decode(model, ids, 12), st.recomputed_layers)
        modes[sync_above] = (st.token_mode_tokens, st.layers_mode_tokens, st.sync_mode_tokens)
        assert model.expert_cache.decode_layer_miss_rate > 0.3
        assert st.predicting_tokens == 0  # demand: nothing predicted
    (tokens_always, lp_always), recomputed_always = runs[1.0]
    (tokens, lp), recomputed = runs[0.3]
    assert tokens == tokens_always and np.array_equal(lp, lp_always)
    assert recomputed < recomputed_always
    # the stats count each of the 12 tokens once, in the mode it was begun in (a token built
    # ahead, discarded and rebuilt, once): the first "token" (the running share of layers with
    # a miss starts at 0), then "layers", and "sync" once that share passes 0.3 (never with 1)
    for m in modes.values():
        assert sum(m) == 12 and m[0] >= 1
    assert modes[1.0][2] == 0 and modes[0.3][2] > modes[0.3][1]
    # with lookahead the handshakes predict while decode's misses run above 2 %: counted too
    # (without the duel, whose trials would leave tokens unpredicted by the clock's say)
    model, _ = strata_mlx.load(
        path, arena_gb=gb, read_ahead="lookahead", lookahead_decode_duel=False
    )
    decode(model, ids, 12)
    assert model.expert_cache.stats.predicting_tokens >= 6


def test_a_token_built_on_top_keeps_its_layers_busy(store):
    """Checking token t while t + 1 is in flight must not release the slots of t + 1's layers
    to read-ahead (the loop's top-up may run at any moment): only a token with nothing built
    on top releases the layers before the one it checks."""
    path = store("qwen3_next")
    model, _ = strata_mlx.load(
        path, arena_gb=arena_for(path, 1.0), read_ahead="demand", **VARIANTS["token-chunk3"]
    )
    ec, dec = model.expert_cache, model.decoder
    cache = model.make_cache()
    mx.eval(model(mx.array([prompt_ids(16, seed=16)]), cache=cache))
    layers = set(ec.layers)
    step = dec.start(mx.array([[3]]), cache)
    later = dec.start(mx.array([[5]]), cache)
    assert dec.finish(step, later)  # every expert resident: nothing missed
    assert ec.sched.busy_layers >= layers  # `later` is in flight, every one of its layers
    dec.finish(later)
    assert not ec.sched.busy_layers & {l for l in layers if l < max(layers)}
    ec.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_miss_found_in_layers_mode_starts_its_reads_before_the_drain(store, family):
    """In "layers" mode a miss's urgent reads are submitted as soon as the check finds it,
    and the sync handshake that recomputes the layer claims them as misses (not read-ahead,
    nor hits if they landed first); outputs equal the sync path's."""
    path = store(family)
    ids = prompt_ids(24, seed=17)
    gb = arena_for(path, 0.25)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead="demand")
    ref = decode(sync, ids, 12)
    model, _ = strata_mlx.load(path, arena_gb=gb, read_ahead="demand", **VARIANTS["layers-lag2"])
    ec = model.expert_cache
    started = []
    real = ec.sched.start_misses
    ec.sched.start_misses = lambda layer, es, protect: (
        started.append(len(es)),
        real(layer, es, protect),
    )
    tokens, lp = decode(model, ids, 12)
    assert tokens == ref[0] and np.array_equal(lp, ref[1])
    assert sum(started) > 0 and ec.stats.recomputed_layers > 0
    # Demand reads nothing ahead: every record read is a miss, counted once, early or not.
    assert ec.stats.misses == ec.stats.experts_read
    assert ec.stats.streamed_ahead == 0
    ec.close()
    sync.expert_cache.close()


def test_a_token_discarded_twice_is_rolled_back_once(store):
    """An error inside finish() after it discarded the token built on top leaves generate's
    cleanup to discard it again: the second discard must not roll the cache back again."""
    path = store("qwen3_next")
    model, _ = strata_mlx.load(
        path, arena_gb=arena_for(path, 1.0), read_ahead="demand", **VARIANTS["token-chunk3"]
    )
    dec = model.decoder
    cache = model.make_cache()
    mx.eval(model(mx.array([prompt_ids(16, seed=18)]), cache=cache))
    later = dec.start(mx.array([[5]]), cache)
    dec.discard(later)
    step = dec.start(mx.array([[3]]), cache)  # the cache moves on after the first discard
    assert dec.finish(step)
    offsets = [c.offset for c in cache if hasattr(c, "offset")]
    dec.discard(later)
    assert [c.offset for c in cache if hasattr(c, "offset")] == offsets
    model.expert_cache.close()


def test_a_generation_starts_with_no_slot_in_use(store):
    """A generation leaves the last layer busy and the last handshake's slots pinned, and its
    prefill leaves the prompt's last layer pinned: both would only narrow eviction and
    read-ahead (perf). The next generation's prefill and every first decode token start with
    no busy layer and no pinned slot, and the tokens are still the sync path's."""
    path = store("qwen3_next")
    gb = arena_for(path, 0.5)
    prompts = [prompt_ids(24, seed=20), prompt_ids(24, seed=21)]
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead="demand")
    ref = [decode(sync, ids, 8) for ids in prompts]
    model, _ = strata_mlx.load(path, arena_gb=gb, read_ahead="demand", **VARIANTS["token-chunk3"])
    ec, dec = model.expert_cache, model.decoder
    seen = []  # (what started, busy layers, pinned slots) as each handshake or token starts
    handshake, start = ec.run_layer, dec.start

    def run_layer(layer, x, inds):
        if ec.pipelined.records is None:
            seen.append(("handshake", set(ec.sched.busy_layers), set(ec.arena.pinned)))
        return handshake(layer, x, inds)

    def start_token(tokens, cache, gate=True):
        seen.append(("token", set(ec.sched.busy_layers), set(ec.arena.pinned)))
        return start(tokens, cache, gate)

    ec.run_layer, dec.start = run_layer, start_token
    for n, ids in enumerate(prompts):
        seen.clear()
        tokens, lp = decode(model, ids, 8)
        assert tokens == ref[n][0] and np.array_equal(lp, ref[n][1])
        first_token = next(s for s in seen if s[0] == "token")
        assert first_token[1:] == (set(), set()), n
        if n > 0:
            assert seen[0] == ("handshake", set(), set())  # the prefill's first layer
    ec.close()
    sync.expert_cache.close()


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_token_mode_while_lookahead_predicts_is_exact(store, fraction):
    """decode_token_while_predicting: with lookahead predicting (its running miss rate starts
    high after a load) and few layers missing, tokens run "token" mode, where before they
    ran "layers"; the tokens and log-probabilities equal the per-layer-sync path's."""
    path = store("qwen3_next")
    ids = prompt_ids(24, seed=15)
    gb = arena_for(path, fraction)
    runs = {}
    for name, kw in (
        ("sync", dict(decode="sync")),
        ("layers", dict()),
        ("token", dict(decode_token_while_predicting=True)),
    ):
        # (without the duel, which would leave tokens unpredicted by the clock's say)
        model, _ = strata_mlx.load(
            path, arena_gb=gb, read_ahead="lookahead", lookahead_decode_duel=False, **kw
        )
        if fraction == 1.0:
            model.expert_cache.warm()
        runs[name] = decode(model, ids, 12), model.expert_cache.stats
    (ref, ref_lp), _ = runs["sync"]
    for name in ("layers", "token"):
        (tokens, lp), st = runs[name]
        assert tokens == ref and np.array_equal(lp, ref_lp), name
        assert st.predicting_tokens > 0, name
    old, new = runs["layers"][1], runs["token"][1]
    if fraction == 1.0:  # nothing misses: every token whole, where a predicting one was not
        assert old.token_mode_tokens == 0 and old.layers_mode_tokens == 12
        assert new.token_mode_tokens == 12
    else:
        assert new.token_mode_tokens > old.token_mode_tokens


def test_the_decode_benchmark_reports_variants_against_the_first_without_mlx_lm(capsys):
    """benchmarks/decode.py --no-baseline: each variant against the first (lookahead against
    demand), by medians and by the median of per-round ratios."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [  # round 1 drifted slow for both: per round, lookahead is 0.8x demand's time
        {"variant": "demand", "round": 0, "ms_per_token": 50.0},
        {"variant": "lookahead", "round": 0, "ms_per_token": 40.0},
        {"variant": "demand", "round": 1, "ms_per_token": 100.0},
        {"variant": "lookahead", "round": 1, "ms_per_token": 80.0},
        {"variant": "demand", "round": 2, "ms_per_token": 60.0},
        {"variant": "lookahead", "round": 2, "ms_per_token": 48.0},
    ]
    bench.summarize(rows, paired=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "demand: median 60.00 ms/token"
    assert lines[1] == "lookahead: median 48.00 ms/token, x0.80 demand (per round x0.80)"
    bench.summarize([*rows, {"variant": "mlx-lm", "round": 0, "ms_per_token": 30.0}], False)
    assert (
        capsys.readouterr().out.splitlines()[1] == "lookahead: median 48.00 ms/token, x1.60 mlx-lm"
    )


def test_token_ids_are_one_token_s_ids_as_ints():
    from strata_mlx.runtime.deferred import host_ids, token_ids

    ids = np.array([[7, 2, 511, 0]], dtype=np.uint32)
    for shape in ((4,), (1, 4), (1, 1, 4)):
        a = mx.array(ids.reshape(shape))
        assert token_ids(a) == [7, 2, 511, 0] == host_ids(a)[0].tolist()
    assert token_ids(mx.array(np.concatenate([ids, ids]))) is None  # two tokens


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_next"])
@pytest.mark.parametrize("quantize", [False, True])
def test_one_token_fast_path_equals_the_general_path(store, family, quantize, monkeypatch):
    """Decode's one-token handshake (its ids turned into ints once, the kernel called pair by
    pair, lookahead's routers giving ids alone) gives the general path's logits and tokens,
    with lookahead predicting in a small arena that evicts."""
    from strata_mlx.runtime import experts

    path = store(family, quantize)
    ids = prompt_ids(24, seed=5)
    out = {}
    for fast in (True, False):
        if not fast:  # every handshake through the numpy ids, by_expert and its local index
            monkeypatch.setattr(experts, "token_ids", lambda a: None)
            monkeypatch.setattr(deferred, "token_ids", lambda a: None)
            monkeypatch.setattr(experts, "joint_ids", lambda inds, preds: None)
        model, _ = strata_mlx.load(
            path,
            arena_gb=arena_for(path, 0.25),
            decode="sync",
            read_ahead="lookahead",
            lookahead_decode_min_miss=0.0,
        )
        ec, calls = model.expert_cache, []

        def one_token(*a, calls=calls, call=ec.compute.one_token):
            calls.append(a)
            return call(*a)

        monkeypatch.setattr(ec.compute, "one_token", one_token)
        out[fast] = (*decode(model, ids), ec.stats.lookups, len(calls))
        for block in model.blocks.values():  # the routers' ids alone are route()'s ids
            for n in (1, 5):
                x = mx.random.normal((1, n, model.args.hidden_size), key=mx.random.key(n))
                assert np.array_equal(block.route_ids(x), block.route(x)[0])
        ec.close()
    (tokens, lp, lookups, calls), (ref_tokens, ref_lp, ref_lookups, ref_calls) = out[1], out[0]
    assert tokens == ref_tokens
    assert np.array_equal(lp, ref_lp)
    assert lookups == ref_lookups
    assert calls > 0 and ref_calls == 0


def test_joint_ids_are_each_array_s_ids(monkeypatch):
    from strata_mlx.runtime.deferred import joint_ids, split_ids, token_ids

    monkeypatch.setattr(deferred, "JOIN_IDS", True)  # (on where reads are transfers: CUDA)

    inds = mx.array(np.array([[[7, 2, 511, 0]]], dtype=np.uint32))
    preds = [mx.array(np.array([[[3, 9, 1, 4]]], dtype=np.uint32)), mx.array([[5, 6, 8, 2]])]
    preds[1] = preds[1].astype(mx.uint32)
    joint = joint_ids(inds, preds)
    assert split_ids(joint, inds, preds) == (token_ids(inds), [token_ids(p) for p in preds])
    assert joint_ids(inds, []) is None  # nothing to join
    assert joint_ids(mx.concatenate([inds, inds], axis=1), preds) is None  # two tokens
    assert joint_ids(inds, [preds[0].astype(mx.int32)]) is None  # another dtype
    monkeypatch.setattr(deferred, "JOIN_IDS", False)  # the CPU's and Metal's default
    assert joint_ids(inds, preds) is None


@pytest.mark.parametrize("after_experts", [False, True])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_one_read_of_the_ids_equals_a_read_per_array(store, family, after_experts, monkeypatch):
    """Decode's ids and lookahead's predicted ids read back in one transfer give what a read
    per array gives: logits, tokens, lookups, misses and every read-ahead submitted (the
    loop-less scheduler with completions seen only where waited for, so that what is read
    does not depend on when reads land)."""
    from strata_mlx.runtime import experts
    from strata_mlx.stream.scheduler import Scheduler

    path = store(family, True)
    ids = prompt_ids(24, seed=7)
    monkeypatch.setattr(deferred, "JOIN_IDS", True)  # (on where reads are transfers: CUDA)
    out, submit = {}, Scheduler.predicted
    for joint in (True, False):
        joined, predicted = [], []
        if joint:

            def join(inds, preds, joined=joined):
                joined.append(1)
                return deferred.joint_ids(inds, preds)

            monkeypatch.setattr(experts, "joint_ids", join)
        else:
            monkeypatch.setattr(experts, "joint_ids", lambda i, p: None)

        def record(self, layer, ranked, keys, pred, seen=predicted):
            seen.append((layer, list(ranked), list(keys), sorted(pred)))
            return submit(self, layer, ranked, keys, pred)

        monkeypatch.setattr(Scheduler, "predicted", record)
        model, _ = strata_mlx.load(
            path,
            arena_gb=arena_for(path, 0.25),
            decode="sync",
            scheduler="sync",
            read_ahead="lookahead",
            lookahead_decode_min_miss=0.0,
            lookahead_after_experts=after_experts,
        )
        ec = model.expert_cache
        ec.reader = HoldingReader(ec.reader)  # completions seen only where waited for
        tokens, lp = decode(model, ids)
        st = ec.stats
        counts = (st.lookups, st.misses, st.hits, st.readahead_submitted, st.experts_read)
        out[joint] = (tokens, lp, counts, predicted, len(joined))
        ec.close()
    (tokens, lp, counts, predicted, joined), (ref_tokens, ref_lp, ref_counts, ref_pred, _) = (
        out[True],
        out[False],
    )
    assert joined > 0
    assert tokens == ref_tokens
    assert np.array_equal(lp, ref_lp)
    assert counts == ref_counts
    assert predicted == ref_pred and len(predicted) > 0


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler for the host dialect")
def test_kernels_pairs_decode_as_their_general_call(tmp_path, monkeypatch):
    """Where the expert kernels have `pairs` (the GPU dialects'; here the host dialect, which
    compiles the same kernel source), every one-token layer goes through it (the per-layer
    handshake's, token mode's with slots looked up on the device, gated layers'): the tokens
    and log-probabilities of the kernels' general call, bit for bit."""
    from test_synthetic import tiny_synthetic

    from strata_mlx.runtime import kernels

    monkeypatch.setenv("STRATA_MLX_GATE", "host")  # (the device gate's checks run aside)
    path = tiny_synthetic(tmp_path / "synth")
    ids = prompt_ids(16, seed=3)
    runs = {  # (options, the stat that says the mode ran)
        "sync": (dict(decode="sync"), "sync_mode_tokens"),
        "token": (
            dict(read_ahead="demand", decode_token_below=1.0, decode_sync_above=1.0),
            "token_mode_tokens",
        ),
        "gated": (dict(decode_gate=True, decode_token_below=0.0), "gated_mode_tokens"),
    }
    for name, (kw, ran) in runs.items():
        out = {}
        for direct in (True, False):
            model, _ = strata_mlx.load(path, arena_gb=arena_for(path, 0.5), **kw)
            compute, calls, handshake = model.expert_cache.compute, [], [False]
            for layer in compute.kernel:
                run = kernels.expert_kernel(model.expert_cache.manifest.layout_of(layer), "host")

                def pairs(*a, run=run, calls=calls, handshake=handshake):
                    calls.append(handshake[0])  # (from the per-layer handshake's one_token)
                    return run.pairs(*a)

                compute.kernel[layer] = run
                compute.pairs[layer] = pairs if direct else None
            one_token = compute.one_token

            def by_handshake(*a, one_token=one_token, handshake=handshake):
                handshake[0] = True
                try:
                    return one_token(*a)
                finally:
                    handshake[0] = False

            monkeypatch.setattr(compute, "one_token", by_handshake)
            tokens, lp = decode(model, ids, n=6)
            assert getattr(model.expert_cache.stats, ran) > 0, name
            out[direct] = tokens, lp, calls
            model.expert_cache.close()
        (tokens, lp, calls), (ref_tokens, ref_lp, ref_calls) = out[True], out[False]
        assert tokens == ref_tokens, name
        assert np.array_equal(lp, ref_lp), name
        assert ref_calls == [], name
        if name == "sync":
            assert calls and all(calls)
        else:  # the deferred layers' own calls, not only their recomputes'
            assert calls.count(False) > 0, name


def test_the_token_build_benchmark_times_both_models(tmp_path):
    """benchmarks/token_build.py on a tiny store: a line a round with both models' times and
    their ratio, then the median ratio; exit status 0."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from test_synthetic import tiny_synthetic

    path = tiny_synthetic(tmp_path / "synth")
    script = Path(__file__).parents[2] / "benchmarks" / "token_build.py"
    r = subprocess.run(
        [sys.executable, str(script), str(path), "--rounds", "2", "--reps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rounds = re.findall(
        r"^round \d: ms a token, mlx-lm [0-9.]+, strata-mlx token mode [0-9.]+ \(x[0-9.]+\)$",
        r.stdout,
        re.M,
    )
    assert len(rounds) == 2, r.stdout
    assert re.search(r"median of the rounds' ratios: x[0-9.]+$", r.stdout, re.M), r.stdout


class Unread:
    """An array's shape and dtype, whose values may not be read."""

    def __init__(self, a):
        self.shape, self.size, self.dtype, self.ndim = a.shape, a.size, a.dtype, a.ndim

    def __array__(self, *a, **kw):
        raise AssertionError("read on its own, not from the token's joint routing")

    def tolist(self):
        self.__array__()


@pytest.mark.parametrize("variant", ["token-chunk1", "token-chunk3"])
def test_token_routing_read_once_equals_a_read_per_layer(store, variant, monkeypatch):
    """ "token" mode's routing read in one transfer at the token's end (joint_routing, on
    where reads are transfers: CUDA) gives the per-layer reads' tokens, log-probabilities,
    lookups and hits, with misses discarding tokens (a quarter arena) and without (all
    resident); each layer's ids as its own read gives them, and the checks read those. The
    loop-less scheduler, completions seen only where waited for: what is resident does not
    depend on when reads land."""
    from strata_mlx.runtime.deferred import DeferredHandshake

    monkeypatch.setattr(deferred, "JOIN_IDS", True)
    spread, check = deferred.spread_routing, DeferredHandshake.check
    path = store("qwen3_next")
    moe_layers = len(load_manifest(path).moe_layers)
    ids = prompt_ids(24, seed=19)
    for fraction in (1.0, 0.25):
        gb = arena_for(path, fraction)
        out = {}
        for join in (True, False):
            calls, checked = [], []

            def counted(joint, ds, calls=calls):
                calls.append(len(ds))
                spread(joint, ds)
                for d in ds:  # each layer's ids as its own read gives them
                    assert np.array_equal(d.host, np.array(d.inds).reshape(d.host.shape))

            def seen(self, d, *a, checked=checked):
                checked.append(d.host is not None)
                if d.host is None:
                    return check(self, d, *a)
                inds, d.inds = d.inds, Unread(d.inds)  # a read of its own would raise
                try:
                    return check(self, d, *a)
                finally:
                    d.inds = inds

            monkeypatch.setattr(decode_module, "spread_routing", counted)
            monkeypatch.setattr(DeferredHandshake, "check", seen)
            model, _ = strata_mlx.load(
                path,
                arena_gb=gb,
                scheduler="sync",  # (completions seen only where waited for, below)
                **{"read_ahead": "demand", **VARIANTS[variant]},
            )
            model.expert_cache.reader = HoldingReader(model.expert_cache.reader)
            model.decoder.join_routing = join
            tokens, lp = decode(model, ids, n=12)
            st = model.expert_cache.stats
            out[join] = (tokens, lp, st.lookups, st.hits, st.token_mode_tokens)
            # a token's layers at once, and its checks read them: none without the join
            assert all(n == moe_layers for n in calls)
            assert 0 < len(calls) <= st.token_mode_tokens if join else not calls
            assert any(checked) == join and checked, (fraction, join)
            model.expert_cache.close()
        (tokens, lp, *counts), (ref_tokens, ref_lp, *ref_counts) = out[True], out[False]
        assert tokens == ref_tokens, fraction
        assert np.array_equal(lp, ref_lp), fraction
        assert counts == ref_counts and counts[-1] > 0, fraction


@pytest.mark.parametrize("decode_mode", ["sync", "pipelined"])
def test_wider_lookahead_reads_more_ahead_and_keeps_every_token(store, decode_mode, monkeypatch):
    """lookahead_extra: one token's lookahead routers give the top k + extra ids, best first
    (their top k the first k, kept in that order by the predictor's ranking), several tokens'
    their top k; decode hands the read-ahead a layer's k + extra predicted experts (the
    per-layer handshake's predictions; pipelined decode's checks', checked at once, `lag` 0,
    so that on this two-layer store the first layer's check predicts the second), and tokens
    and log-probabilities equal the per-layer handshake's without it. (How many of them are
    read is not compared: in an arena of a few slots a layer, that depends on which reads have
    landed and which layers still compute as each prediction comes.)"""
    path, ids = store("qwen3_moe"), prompt_ids(24, seed=11)
    sent = []  # (where, width) of decode's predictions handed to the read-ahead
    read_ahead, predicted = Scheduler.read_ahead, Scheduler.predicted

    def spy_read_ahead(self, layer, ranked, *a, **kw):  # (pipelined checks pass `protect`)
        if self.arena.decoding:
            sent.append(("checks" if "protect" in kw else "after_wait", len(ranked)))
        return read_ahead(self, layer, ranked, *a, **kw)

    def spy_predicted(self, layer, ranked, *a):
        if self.arena.decoding:
            sent.append(("handshake", len(ranked)))
        return predicted(self, layer, ranked, *a)

    monkeypatch.setattr(Scheduler, "read_ahead", spy_read_ahead)
    monkeypatch.setattr(Scheduler, "predicted", spy_predicted)
    opts = dict(arena_gb=arena_for(path, 0.6), read_ahead="lookahead",
                lookahead_decode_min_miss=0.0)  # fmt: skip
    mode = dict(decode="sync") if decode_mode == "sync" else dict(decode_lag=0)
    where = "handshake" if decode_mode == "sync" else "checks"
    ref_model, _ = strata_mlx.load(path, decode="sync", **opts)
    ref = decode(ref_model, ids, 8)
    ref_model.expert_cache.close()
    sent.clear()
    narrow, _ = strata_mlx.load(path, **mode, **opts)
    assert decode(narrow, ids, 8)[0] == ref[0]
    k = narrow.args.num_experts_per_tok
    assert (where, k) in sent and max(w for _, w in sent) == k, sent
    narrow.expert_cache.close()
    model, _ = strata_mlx.load(path, lookahead_extra=3, **mode, **opts)
    ec = model.expert_cache
    n = load_manifest(path).num_experts
    for layer, block in model.blocks.items():
        for tokens, width in ((1, min(k + 3, n)), (5, k)):
            x = mx.random.normal((1, tokens, model.args.hidden_size), key=mx.random.key(tokens))
            wide = np.array(ec.predictor.routers[layer](x)).reshape(tokens, -1)
            assert wide.shape[-1] == width
            top = np.array(block.route_ids(x)).reshape(tokens, -1)
            assert all(set(t) == set(w[:k]) for t, w in zip(top.tolist(), wide.tolist()))
            if tokens == 1:  # (as a list, and as pipelined checks hand it: [1, k + 3])
                assert ec.predictor.rank(wide[0].tolist()) == wide[0].tolist()
                assert ec.predictor.rank(wide) == wide[0].tolist()
    sent.clear()
    got = decode(model, ids, 8)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    assert (where, min(k + 3, n)) in sent, sent  # (a decode token's k + 3, handed whole)
    ec.close()


def test_wider_lookahead_on_a_family_without_a_router_of_ids_is_refused(store):
    """lookahead_extra where the family's router gives no ids alone (OLMoE): a one-line
    OptionError naming the option, before anything is allocated."""
    from strata_mlx.config import OptionError

    with pytest.raises(OptionError, match=r"^lookahead_extra 2: the olmoe family's router"):
        strata_mlx.load(store("olmoe"), lookahead_extra=2)


def test_wider_lookahead_with_a_routing_trace_is_refused(store):
    """lookahead_extra beside a routing trace (which records top-k predictions): a one-line
    OptionError naming the option."""
    from strata_mlx.config import OptionError
    from strata_mlx.stream.stats import RoutingTrace

    path = store("qwen3_moe")
    with pytest.raises(OptionError, match=r"^lookahead_extra 2: a routing trace"):
        strata_mlx.load(path, lookahead_extra=2, trace=RoutingTrace())


@pytest.mark.parametrize("variant", ["adaptive", "gated-adaptive"])
def test_the_decode_duel_switches_prediction_between_tokens_exactly(store, variant):
    """With lookahead's duel, decode tokens alternate between predicting and not (trials of
    one token each way here); tokens and logits equal the per-layer-sync path's."""
    path = store("qwen3_moe")
    ids = prompt_ids(24, seed=14)
    gb = arena_for(path, 0.25)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead="demand")
    ref = decode(sync, ids, 16)
    kw = {**VARIANTS[variant], "read_ahead": "lookahead"}
    model, _ = strata_mlx.load(path, arena_gb=gb, lookahead_decode_duel=True, **kw)
    ec, pr = model.expert_cache, model.expert_cache.predictor
    duel = pr.duel
    duel.block, duel.keep = 1, 3
    told, token, rank, ranked = [], duel.token, pr.rank, [0]

    def counted_rank(ids):  # (a prediction ranked: the way that predicts)
        ranked[0] += 1
        return rank(ids)

    def tell(predicted: bool, s: float) -> None:  # each token's way and what it ranked
        told.append((predicted, ranked[0]))
        token(predicted, s)

    pr.rank, duel.token = counted_rank, tell
    tokens, lp = decode(model, ids, 16)
    assert tokens == ref[0]
    assert np.array_equal(lp, ref[1])
    assert len(told) == 15  # (the prompt's last token is untold)
    predictions = {True: 0, False: 0}  # ranked while a token of each way was built
    for (predicted, after), (_, before) in zip(told[1:], told):
        predictions[predicted] += after - before
    assert predictions[True] > 0 and predictions[False] == 0, predictions
    assert 0 < ec.stats.predicting_tokens < 16
