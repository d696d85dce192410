"""Eviction plug-ins and candidates (strata_mlx.stream.policies): a research script's own policy runs
in load() and in cache-sim alike, every policy leaves the outputs bit-identical, and each
candidate evicts what its rule says."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.apps import cache_sim
from strata_mlx.config import OptionError
from strata_mlx.format.store import ALIGNMENT, load_manifest
from strata_mlx.generation.generate import stream_generate, teacher_forced_logits
from strata_mlx.stream import nextuse, policies, trace
from strata_mlx.stream.arena import LRU, Arena
from strata_mlx.stream.stats import RoutingTrace

FAMILY = "qwen3_moe"
SLOTS = 9

PLUGIN = textwrap.dedent(
    '''
    """A research script's policy: evict the most recently used expert."""


    class MRU:
        def __init__(self, layers):
            self.layers = layers
            self.order = {}
            self.n = 0

        def touch(self, key):
            self.n += 1
            self.order[key] = self.n

        def remove(self, key):
            self.order.pop(key, None)

        def victim(self, evictable):
            keys = [k for k in self.order if evictable(k)]
            return max(keys, key=self.order.get) if keys else None
    '''
)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "research_mru.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    import research_mru

    return research_mru.MRU


class Recorder(LRU):
    """LRU that records what the runtime tells a plug-in: the phases, the touches of each
    phase, decode's hits touched while `current` named another layer, lookahead's
    predictions and the phase each came in."""

    def __init__(self):
        super().__init__()
        self.told: list[bool] = []  # phase(decoding) calls, in order
        self.touches = {None: 0, False: 0, True: 0}  # by phase (None: before any)
        self.stale_hits = 0  # decode hits touched while `current` was another layer
        self.predictions: list[tuple[bool | None, int, list[int]]] = []
        self._resident: set = set()

    def phase(self, decoding: bool) -> None:
        self.told.append(decoding)

    def _phase(self) -> bool | None:
        return self.told[-1] if self.told else None

    def touch(self, key) -> None:
        if key in self._resident and self._phase() and key[0] != self.current:
            self.stale_hits += 1
        self.touches[self._phase()] += 1
        self._resident.add(key)
        super().touch(key)

    def remove(self, key) -> None:
        self._resident.discard(key)
        super().remove(key)

    def predicted(self, layer: int, experts) -> None:
        self.predictions.append((self._phase(), layer, list(experts)))


def load_small(path, eviction, **kw):
    rb = load_manifest(path).layout.record_bytes
    kw.setdefault("read_ahead", "demand")
    return strata_mlx.load(path, arena_gb=SLOTS * rb / 1024**3, eviction=eviction, **kw)[0]


def generate(model, n=10):
    ids = prompt_ids(24, seed=11)
    return [r.token for r in stream_generate(model, None, ids, max_tokens=n, prefill_step_size=8)]


def test_a_plug_in_runs_in_load_and_in_cache_sim_alike(store, plugin, tmp_path):
    path = store(FAMILY)
    model = load_small(path, plugin, decode="sync", trace=RoutingTrace())
    assert isinstance(model.expert_cache.arena.policy, plugin)
    assert model.expert_cache.arena.policy.layers == load_manifest(path).moe_layers
    generate(model)
    live = model.expert_cache.stats.misses
    f = tmp_path / "t.npz"
    trace.write(f, trace.of_model(model))
    model.expert_cache.close()
    # the same class, given to the replay as a class and on the command line as module:Class
    r = cache_sim.replay(trace.read(f), SLOTS, plugin)
    assert r.prefill_misses + r.decode_misses == live
    lru = cache_sim.replay(trace.read(f), SLOTS, "lru")
    assert lru.prefill_misses + lru.decode_misses != live  # the plug-in did evict otherwise
    paths = [str(tmp_path), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    cmd = [sys.executable, "-m", "strata_mlx", "cache-sim", str(f), "--slots", str(SLOTS)]
    out = subprocess.run(
        [*cmd, "--policy", "research_mru:MRU,lru"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    line = out.stdout.splitlines()[1]
    assert line.split(": ")[0].strip() == "research_mru:MRU"
    assert f"({r.decode_misses} of {r.decode_lookups})" in line


def test_outputs_are_bit_identical_whatever_the_policy(store, plugin):
    path = store(FAMILY)
    ref_model, _ = strata_mlx.load(path, read_ahead="demand")
    ref_model.expert_cache.warm()
    ids = prompt_ids(24, seed=12)
    ref_logits = teacher_forced_logits(ref_model, ids, 8)
    ref_tokens = generate(ref_model)
    assert ref_model.expert_cache.stats.misses == 0
    runs = [(e, "pipelined") for e in policies.names()]
    runs += [(plugin, "pipelined"), ("research_mru:MRU", "sync"), ("adaptive", "sync")]
    runs += [(Recorder, "pipelined"), (Recorder, "sync")]
    for eviction, decode in runs:
        model = load_small(path, eviction, decode=decode, read_ahead="lookahead")
        assert np.array_equal(teacher_forced_logits(model, ids, 8), ref_logits), eviction
        assert generate(model) == ref_tokens, (eviction, decode)
        assert model.expert_cache.stats.misses > 0
        # the generation went from prefill to decode and back: a policy was told the phase
        assert model.expert_cache.arena.decoding is False
        if eviction is Recorder:
            assert model.expert_cache.arena.policy.told == [False, True, False]
        model.expert_cache.close()


@pytest.mark.parametrize("decode", ["sync", "pipelined"])
def test_a_policy_is_told_the_phase_and_the_replay_tells_it_at_the_same_call(
    store, tmp_path, decode
):
    path = store(FAMILY)
    model = load_small(path, Recorder, decode=decode, trace=RoutingTrace())
    generate(model)
    live = model.expert_cache.arena.policy
    f = tmp_path / "t.npz"
    trace.write(f, trace.of_model(model))
    model.expert_cache.close()
    assert live.told == [False, True, False]  # prefill, decode, and prefill again after
    assert live.touches[None] == 0 and live.touches[False] > 0 and live.touches[True] > 0
    made = []

    def factory():
        made.append(Recorder())
        return made[-1]

    cache_sim.replay(trace.read(f), SLOTS, factory)
    assert made[0].told == [False, True]
    if decode == "sync":  # the per-layer handshake: the replay's uses are the live run's
        assert made[0].touches == {**live.touches}


def test_pipelined_decode_names_the_running_layer_and_tells_its_predictions(store):
    """The pipelined decoder's check is its layer's handshake: the policy's `current` names
    that layer when its hits are touched, and lookahead's predictions reach the policy (in
    decode only) as the per-layer handshake's do."""
    path = store(FAMILY)
    rb = load_manifest(path).layout.record_bytes
    for arena_gb, read_ahead in ((SLOTS * rb / 1024**3, "demand"), (None, "lookahead")):
        model, _ = strata_mlx.load(
            path,
            arena_gb=arena_gb,
            eviction=Recorder,
            decode="pipelined",
            read_ahead=read_ahead,
            lookahead_decode_min_miss=0.0,
            decode_lag=0,
        )  # fmt: skip (lag 0: layer 0's check predicts layer 1 of the 2-layer model)
        if arena_gb is None:  # every expert resident: no check fails, none is recomputed
            model.expert_cache.warm()
        generate(model, 16)
        rec = model.expert_cache.arena.policy
        model.expert_cache.close()
        assert rec.stale_hits == 0, read_ahead
        if read_ahead == "demand":
            assert rec.touches[True] > 0
        else:
            assert model.expert_cache.stats.misses == 0
            assert rec.predictions and all(phase for phase, _, _ in rec.predictions)
            layers = load_manifest(path).moe_layers
            assert {layer for _, layer, _ in rec.predictions} <= set(layers[1:])


class NoVictim:
    def touch(self, key): ...

    def remove(self, key): ...


@pytest.mark.parametrize(
    "spec, says",
    [
        ("fifo", "unknown eviction policy"),
        ("no_such_module:P", "cannot import 'no_such_module'"),
        (":P", "cannot import '' \\(Empty module name\\)"),
        ("os:system", "not a policy's class or factory .*'command'"),  # a function, not one
        ("strata_mlx.stream.policies:Nope", "has no Nope"),
        ("strata_mlx.stream.policies:CANDIDATES", "is not a class"),
        (NoVictim, "a policy needs victim"),
        (3, "a policy name, 'module:Class' or a class"),
    ],
)
def test_a_bad_policy_is_refused_before_the_store_is_read(tmp_path, spec, says):
    with pytest.raises(OptionError, match=says):
        strata_mlx.load(tmp_path / "no-store", eviction=spec)


# Plug-ins that break the interface (cache-sim's tests take them too)


class Never(LRU):
    """Never names a victim."""

    def victim(self, evictable):
        return None

    victims = None  # (LRU's batch would name them)


class Stranger(Never):
    def victim(self, evictable):
        return (999, 999)


class IgnoresPins(LRU):
    """The most recently used expert, whether a computation reads it or not."""

    def victim(self, evictable):
        return next(reversed(self._order), None)

    victims = None


class Twice(LRU):
    def victims(self, evictable, keys):
        first = super().victim(evictable)
        return [first] * len(keys) if first is not None else []


class Greedy(LRU):
    """Every evictable key, however few were asked for."""

    def victims(self, evictable, keys):
        return [k for k in self._order if evictable(k)]


@pytest.mark.parametrize(
    "policy, says",
    [
        (Never, "victim\\(\\) returned None while resident experts could be evicted"),
        (Stranger, "victim \\(999, 999\\) is not resident"),
        (IgnoresPins, "victim \\(.*\\) may not be evicted \\(pinned, or its read in flight\\)"),
    ],
)
def test_a_plug_in_that_breaks_the_interface_is_named_not_obeyed(store, policy, says):
    # Obeyed, the first waited for a slot forever, the second crashed the arena (KeyError),
    # the third refilled a slot a computation was reading.
    model = load_small(store(FAMILY), policy, decode="sync")
    try:
        with pytest.raises(OptionError, match=f"eviction policy {policy.__name__}: {says}"):
            generate(model, n=4)
    finally:
        model.expert_cache.close()


@pytest.mark.parametrize("policy", [Twice, Greedy])
def test_a_plug_in_batch_naming_a_key_twice_or_too_many_is_refused(policy):
    # (obeyed: the second victim's slot was taken twice; the extra victims left the policy
    # but kept their slots, never to be evicted again)
    arena = Arena(3, ALIGNMENT, eviction=policy)
    for slot, _ in arena.allocate_many([(0, 0), (0, 1), (0, 2)]):
        arena.loaded(slot)
    with pytest.raises(OptionError, match=f"eviction policy {policy.__name__}: victims\\(\\)"):
        arena.allocate_many([(1, 0), (1, 1)], batch_from=1)
    assert sorted(arena.slot_of) == [(0, 0), (0, 1), (0, 2)]  # (nothing taken)


def drive(policy, uses, evict_among):
    """Touch `uses` in order, then the victim among `evict_among`."""
    for key in uses:
        policy.touch(key)
    return policy.victim(lambda k: k in evict_among)


def test_lru2_evicts_an_expert_used_once_before_one_used_twice():
    a, b, c = (0, 1), (0, 2), (0, 3)
    # a used twice long ago, b and c once each since: LRU would evict a, LRU-2 evicts b
    assert drive(policies.LRU2(), [a, a, b, c], {a, b, c}) == b
    assert drive(policies.build("lru"), [a, a, b, c], {a, b, c}) == a


def test_lrfu_spans_lru_to_lfu():
    a, b = (0, 1), (0, 2)
    uses = [a, a, a, b]  # a more often, b more recently
    assert drive(policies.LRFU(half_life=0.01), uses, {a, b}) == a  # recency: LRU
    assert drive(policies.LRFU(half_life=1e9), uses, {a, b}) == b  # frequency: LFU


def test_arc_keeps_experts_used_twice_through_a_scan():
    arc = policies.ARC()
    hot = [(0, e) for e in range(3)]
    resident = set(hot)
    for key in hot + hot:  # used twice: T2
        arc.touch(key)
    for e in range(10, 30):  # a scan of experts used once, 4 slots in all
        key = (1, e)
        if len(resident) >= 4:
            v = arc.victim(lambda k: True)
            arc.remove(v)
            resident.discard(v)
        resident.add(key)
        arc.touch(key)
    assert set(hot) <= resident  # LRU would have evicted all three


def test_protected_lru_keeps_a_prediction_until_its_layer_runs():
    p = policies.ProtectedLRU()
    a, b = (1, 5), (0, 7)
    p.current = 0
    p.touch(a)
    p.touch(b)
    p.predicted(1, [5])
    assert p.victim(lambda k: True) == b  # a is older, but predicted for layer 1
    assert p.victim(lambda k: k == a) == a  # protected, not pinned: the last resort
    p.current = 1  # layer 1 runs: the prediction is spent
    assert p.victim(lambda k: True) == a


def test_profile_lru_gives_popular_experts_a_head_start():
    profile = np.array([[100.0, 1.0, 1.0, 1.0]])
    p = policies.ProfileLRU(profile, [0])
    uses = [(0, 0), (0, 1), (0, 2)]
    assert drive(p, uses, set(uses)) == (0, 1)  # (0, 0) is older but popular


def test_a_plug_in_gets_the_keywords_it_names():
    class Both:
        def __init__(self, **kw):
            self.kw = kw

        touch = remove = victim = lambda *a: None

    class Neither:
        touch = remove = victim = lambda *a: None

    p = policies.build(Both, profile=np.ones((2, 4)), layers=[0, 3])
    assert p.kw["layers"] == [0, 3] and p.kw["profile"].shape == (2, 4)
    assert isinstance(policies.build(Neither, layers=[0]), Neither)


def test_adaptive_follows_the_component_that_would_have_missed_less():
    """Two experts of each layer are popular in the profile; a loop over six experts a layer
    in an eight-slot arena thrashes LRU, while the profile keeps the popular ones: the
    shadows count that, and the adaptive policy follows the profile."""
    profile = np.array([[50.0, 50.0, 1.0, 1.0, 1.0, 1.0]] * 2)
    p = policies.Adaptive(layers=[0, 1], profile=profile, components=("lru", "profile"))
    resident: set = set()
    for _ in range(30):
        for e in range(6):
            for layer in (0, 1):
                p.current = layer
                key = (layer, e)
                if key not in resident:
                    if len(resident) >= 8:
                        v = p.victim(lambda k, layer=layer: k[0] != layer)
                        p.remove(v)
                        resident.discard(v)
                    resident.add(key)
                p.touch(key)
    assert p.capacity == 8
    assert p.components[p.leader] == "profile"
    assert {(0, 0), (0, 1), (1, 0), (1, 1)} <= resident


def calls(p, *each, layer: int = 0) -> None:
    """One call of `layer` per argument, each using the keys it lists."""
    for keys in each:
        p.current = layer
        for key in keys:
            p.touch(key)


def cycle(p, passes: int, layers=(0, 1, 2), experts=(0, 1)) -> None:
    """`passes` forward passes, each layer's call using `experts`."""
    for _ in range(passes):
        for layer in layers:
            p.current = layer
            for e in experts:
                p.touch((layer, e))


def test_nextuse_evicts_the_expert_whose_layer_comes_back_last():
    """Every expert used every call, layer 0 running: layer 1's experts are wanted next,
    layer 2's after them. LRU evicts layer 1's (used longest ago), NextUse layer 2's."""
    for name, want in [("nextuse", (2, 0)), ("lru", (1, 0))]:
        p = policies.build(name, layers=[0, 1, 2])
        cycle(p, 5)
        p.remove((0, 1))  # evicted since
        p.current = 0
        p.touch((0, 0))  # in use by this call: pinned
        assert p.victim(lambda k: k != (0, 0)) == want, name


def test_nextuse_evicts_the_rarely_picked_expert_of_a_layer():
    """a picked by ten calls, b by the last one only: LRU takes a, the older; NextUse b,
    the one whose next pick is far off."""
    a, b, c = (0, 1), (0, 2), (0, 3)
    for name, want in [("nextuse", b), ("lru", a)]:
        p = policies.build(name, layers=[0])
        calls(p, *[[a]] * 10, [b], [c])
        assert p.victim(lambda k: k != c) == want, name


def test_nextuse_takes_the_profile_as_a_prior_and_recent_routing_over_it():
    """Before any history the profile's popular expert stays; nextuse-recent gives the
    prior little weight, so routing that contradicts the profile soon wins there."""
    profile = np.array([[100.0, 1.0, 1.0]])
    hot, cold, new = (0, 0), (0, 1), (0, 2)
    p = policies.build("nextuse", profile=profile, layers=[0])
    calls(p, [hot, cold], [new])
    assert p.victim(lambda k: k != new) == cold
    for name, want in [("nextuse-recent", hot), ("nextuse", cold)]:
        p = policies.build(name, profile=profile, layers=[0])
        calls(p, *[[cold]] * 40, [hot], [new])  # routing picks the profile's cold expert
        assert p.victim(lambda k: k != new) == want, name


def test_adaptive_shadows_miss_as_their_components_do_alone():
    """A shadow takes a call's hits, then its misses, evicting among experts the call does
    not use, as the arena does, so each shadow misses exactly as its policy alone does
    (shadows that pinned the whole running layer, LRU's usual victim there, and took uses
    in the arena's order missed more than LRU alone, and adaptive left LRU for that)."""
    from strata_mlx.apps import cache_sim
    from strata_mlx.stream import trace

    rng = np.random.default_rng(3)
    ids = {l: [rng.integers(0, 8, (1, 3)) for _ in range(40)] for l in (0, 1, 2)}
    t = trace.Trace([0, 1, 2], 8, 4096, ids, decode_from=0)
    made = []

    def adaptive(layers=None, profile=None):
        made.append(policies.Adaptive(layers, profile, ("lru", "lfu"), half_life=1e15))
        return made[-1]

    cache_sim.replay(t, 10, adaptive)
    made[0].current = None  # the last call ends: its uses reach the shadows
    for i, name in enumerate(("lru", "lfu")):
        alone = cache_sim.replay(t, 10, name)
        want = alone.prefill_misses + alone.decode_misses
        assert made[0].shadow_misses[i] == pytest.approx(want, rel=1e-9), name


def small_store_trace(decode_tokens: int = 96):
    """A store-like synthetic trace small enough to replay in a second: 8 layers x 128
    experts, top-8, a skewed popularity the profile knows."""
    from strata_mlx.stream import synthetic_trace as st

    knobs = st.RoutingKnobs(num_experts=128, top_k=8, layers=8, skew=2.5, drift=0.3)
    return st.make_trace(knobs, prompt_tokens=256, decode_tokens=decode_tokens, seed=1)


def duel(sample: float, min_shadow_slots: int = 0, made: list | None = None):
    def make(layers=None, profile=None):
        p = policies.NextUseDuel(layers, profile, sample, min_shadow_slots)
        if made is not None:
            made.append(p)
        return p

    return make


def test_a_duel_whose_sample_is_every_key_decides_as_the_full_one():
    """Sample 1, or an arena below min_shadow_slots, follows every key: the same misses
    in each shadow and the same victims as nextuse-duel-full."""
    t = small_store_trace(48)
    full = cache_sim.replay(t, 300, "nextuse-duel-full")
    for make in (duel(1.0), duel(1 / 16, 512)):
        r = cache_sim.replay(t, 300, make)
        assert (r.prefill_misses, r.decode_misses) == (full.prefill_misses, full.decode_misses)
    made: list = []
    cache_sim.replay(t, 300, duel(1 / 16, 512, made))
    assert made[0].rate == 1.0 and made[0].shadow_slots == 300


def test_miniature_shadows_follow_a_sample_of_the_keys_and_choose_as_the_full_ones():
    """At a quarter of the keys each shadow arena holds about a quarter of the slots, takes
    about a quarter of the uses, and ranks the components as the full shadows do: the
    duel's misses stay within 2 % of the full duel's."""
    t = small_store_trace()
    slots = 300
    made_full: list = []
    full = cache_sim.replay(t, slots, duel(1.0, made=made_full))
    made: list = []
    small = cache_sim.replay(t, slots, duel(0.25, made=made))
    mini, ref = made[0], made_full[0]
    mini.current = ref.current = None  # the last call's uses reach the shadows
    assert mini.rate == 0.25
    assert 0.15 * slots < mini.shadow_slots < 0.35 * slots
    yes, asked = mini.followed
    assert 0.15 < yes / asked < 0.35
    rank = lambda p: sorted(range(3), key=p.shadow_misses.__getitem__)  # noqa: E731
    assert rank(mini)[0] == rank(ref)[0]
    assert small.decode_misses == pytest.approx(full.decode_misses, rel=0.02)


def test_nextuse_victim_is_the_evictable_expert_expected_farthest():
    """The victim, ranked from distances kept between calls, is one whose expected next use
    is the farthest of all evictable residents, through calls, evictions and pinned keys (the
    Python reference, whose counts this reads; the native core gives its victims:
    test_nextuse_native.py)."""
    rng = np.random.default_rng(5)
    layers = [0, 1, 2, 3]
    p = nextuse.PyNextUse(layers, rng.random((4, 12)))
    resident: set = set()

    def fresh(key):  # d(l) + L (calls / count - 1), from the counts, nothing kept
        cycle = (layers.index(key[0]) - layers.index(p.current) - 1) % 4 + 1
        return cycle + 4 * (p._calls[layers.index(key[0])] / p._count[key] - 1.0)

    for step in range(300):
        layer = layers[step % 4]
        p.current = layer
        keys = {(layer, int(e)) for e in rng.choice(12, 3, replace=False)}
        for key in sorted(keys):
            if key not in resident and len(resident) >= 20:
                pinned = keys if rng.random() < 0.7 else keys | set(list(resident)[:5])
                v = p.victim(lambda k, pinned=pinned: k not in pinned)
                far = {k: fresh(k) for k in resident if k not in pinned}
                assert v not in pinned and far[v] == pytest.approx(max(far.values()))
                p.remove(v)
                resident.discard(v)
            resident.add(key)
            p.touch(key)


def test_a_native_duel_refuses_a_sample_or_half_life_not_above_zero():
    """Its one-line error names both values (a float in a native error message)."""
    for sample, half_life in ((0.0, 256.0), (0.25, -1.0)):
        with pytest.raises(ValueError, match=rf"sample {sample:g} and half_life {half_life:g}"):
            policies.NextUseDuel([0, 1], None, sample, 0, core="native", half_life=half_life)
