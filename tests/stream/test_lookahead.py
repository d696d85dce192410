"""Lookahead: exact predictions where routing is predictable, and a win in reads."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.convert.hf import convert_hf
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import teacher_forced_logits
from strata_mlx.runtime.experts import RoutingTrace


def predictable_store(tmp_path, hf_model):
    """A Qwen3-MoE whose layers leave the residual stream unchanged (zero attention output
    and expert down projections) and share one router and one MoE norm: layer l+1's routing
    of layer l's MoE input is then exactly layer l+1's true routing."""
    import torch

    m = hf_model("qwen3_moe").float().eval()
    layers = m.model.layers
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.post_attention_layernorm.weight.copy_(layers[0].post_attention_layernorm.weight)
            layer.mlp.gate.weight.copy_(layers[0].mlp.gate.weight)
            for name, p in layer.mlp.experts.named_parameters():
                if "down" in name:
                    p.zero_()
    src = tmp_path / "hf"
    m.save_pretrained(src)
    return convert_hf(src, tmp_path / "store", progress=False, calibration_tokens=16)


def test_predicted_sets_equal_true_sets_on_a_predictable_model(tmp_path, tiny_hf_model):
    path = predictable_store(tmp_path, tiny_hf_model)
    model, _ = strata_mlx.load(path, read_ahead="lookahead")
    trace = model.expert_cache.trace = RoutingTrace()
    teacher_forced_logits(model, prompt_ids(24, seed=11), step=8)
    layers = sorted(trace.ids)
    assert trace.predicted  # predictions were made
    for nxt in layers[1:]:
        pred = np.concatenate(trace.predicted[nxt])
        true = np.concatenate(trace.ids[nxt])
        assert pred.shape == true.shape
        assert all(set(p) == set(t) for p, t in zip(pred, true))


def test_lookahead_reads_before_the_layer_asks(store):
    """Same arena, same prompt: lookahead turns misses into reads streamed ahead, in prefill
    and in one-token decode, and never changes the outputs.

    The arena holds 13 of the 16 experts. In much smaller arenas wrong predictions evict
    experts that would have been hits (measured here with 10 slots: misses 51 -> 55 with
    LRU), which docs/decisions.md records."""
    path = store("qwen3_moe")
    m = load_manifest(path)
    arena = 13 * m.layout.record_bytes / 1024**3
    ids = prompt_ids(24, seed=12)
    stats, outs = {}, {}
    for policy in ("demand", "lookahead"):
        model, _ = strata_mlx.load(path, arena_gb=arena, read_ahead=policy)
        outs[policy] = teacher_forced_logits(model, ids, 4)
        decode = [r.token for r in strata_mlx.stream_generate(model, None, ids[:4], max_tokens=12)]
        outs[policy + "-decode"] = np.array(decode)
        stats[policy] = model.expert_cache.stats
    assert np.array_equal(outs["demand"], outs["lookahead"])
    assert np.array_equal(outs["demand-decode"], outs["lookahead-decode"])
    d, la = stats["demand"], stats["lookahead"]
    assert la.misses < d.misses and la.streamed_ahead > 0
    assert d.exposed_wait_s > 0  # demand's misses were waited for, and the wait timed
    assert d.lookups == la.lookups  # the same routing


def test_min_tokens_knob_filters_predictions(store):
    path = store("qwen3_moe")
    ids = prompt_ids(32, seed=13)
    submitted = {}
    for min_tokens in (1, 8):
        model, _ = strata_mlx.load(
            path,
            arena_gb=10 * load_manifest(path).layout.record_bytes / 1024**3,
            read_ahead="lookahead",
            lookahead_min_tokens=min_tokens,
        )
        teacher_forced_logits(model, ids, 16)
        submitted[min_tokens] = model.expert_cache.stats.readahead_submitted
    assert submitted[8] < submitted[1]


def test_lookahead_depth_reads_further_ahead_exactly(tmp_path, monkeypatch, tiny_hf_model):
    """lookahead_depth=2 predicts layers l+1 and l+2 from layer l's input (each layer is
    predicted twice, from both layers before it); outputs never change."""
    path = predictable_store(tmp_path, tiny_hf_model)
    m = load_manifest(path)
    layers = list(m.moe_layers)
    ids = prompt_ids(24, seed=16)
    outs, targets = {}, {}
    for depth in (1, 2):
        model, _ = strata_mlx.load(
            path, arena_gb=0.05, read_ahead="lookahead", lookahead_depth=depth
        )
        ec = model.expert_cache
        targets[depth] = seen = []

        def record(layer, *a, seen=seen, submit=ec.sched.read_ahead, **k):
            seen.append(layer)
            return submit(layer, *a, **k)

        def record_reserve(keys, predicted, seen=seen, reserve=ec.sched.reserve):
            seen.extend(dict.fromkeys(layer for layer, _ in keys))  # distinct, in order
            return reserve(keys, predicted)

        def record_both(layer, ranked, keys, predicted, seen=seen, both=ec.sched.predicted):
            seen.append(layer)
            seen.extend(dict.fromkeys(later for later, _ in keys))
            return both(layer, ranked, keys, predicted)

        monkeypatch.setattr(ec.sched, "read_ahead", record)
        monkeypatch.setattr(ec.sched, "reserve", record_reserve)
        monkeypatch.setattr(ec.sched, "predicted", record_both)  # the handshake's: both at once
        outs[depth] = teacher_forced_logits(model, ids, 24)  # one chunk
    assert np.array_equal(outs[1], outs[2])
    # The first layer is predicted from the profile once the chunk is done (the next forward's).
    assert targets[1] == layers[1:] + layers[:1]
    want = [t for i in range(len(layers)) for t in layers[i + 1 : i + 3]] + layers[:1]
    assert targets[2] == want


def test_one_token_ranking_equals_the_general_rule():
    """Decode's one-token fast path ranks as np.unique + lexsort over the same ids would."""
    from strata_mlx.stream.prediction import rank_by_tokens

    rng = np.random.default_rng(0)
    for _ in range(50):
        row = rng.choice(64, 8, replace=False)[None, :]
        for min_tokens in (1, 2):
            experts, counts = np.unique(row, return_counts=True)
            keep = counts >= min_tokens
            want = experts[keep][np.lexsort((experts[keep], -counts[keep]))].tolist()
            assert rank_by_tokens(row, min_tokens) == want
            assert rank_by_tokens(np.repeat(row, 2, axis=0), min_tokens) == sorted(row[0].tolist())


def test_expected_use_scores_a_read_ahead_against_its_victim():
    """A read-ahead for the next layer is next used 1 + L (1 / q - 1) handshakes away, q the
    share of that layer's predictions its routing used; inside `Arena.scored` a slot is
    given up only by a victim the policy expects used later than that."""
    from strata_mlx.format.store import ALIGNMENT
    from strata_mlx.stream.arena import Arena
    from strata_mlx.stream.prediction import Ahead, ExpectedUse

    ex = ExpectedUse([0, 1, 2, 3], prior=0.5, rate=0.5)
    assert ex.bar(1) == 1 + 4 * (1 / 0.5 - 1)
    ex.predicted(1, [0, 1])
    ex.observe(1, [0, 5])  # half of the prediction used: q stays 0.5
    assert ex.precision[1] == 0.5
    ex.predicted(1, [0, 1])
    ex.observe(1, [6, 7])  # none used
    assert ex.precision[1] == 0.25 and ex.bar(1) == 1 + 4 * 3

    arena = Arena(4, ALIGNMENT, "nextuse", layers=[0, 1, 2, 3])
    for layer in (0, 1, 2, 3):
        arena.set_layer(layer)
        got = arena.allocate((layer, 0))
        arena.loaded(got[0])
    victim = arena.policy.victim(lambda k: True)
    far = arena.policy.distance(victim)
    with arena.scored(Ahead(0, [7], far)):  # the victim is expected used no later
        assert arena.allocate((0, 7)) is None
    with arena.scored(Ahead(0, [7], far - 0.5)):
        assert arena.allocate((0, 7)) is not None
    assert arena.read_ahead_bar is None
    ex.predicted(2, [0, 1])
    assert ex.bar(2, distance=2) == ex.bar(2) + 1  # a layer further ahead: one more handshake


def test_scored_read_ahead_keeps_the_outputs_and_reads_no_more(store):
    """Decode with the score reads no more ahead than lookahead and computes the same
    tokens."""
    path = store("qwen3_moe")
    rb = load_manifest(path).layout.record_bytes
    ids = prompt_ids(16, seed=14)
    tokens, stats = {}, {}
    for score in (False, True):
        model, _ = strata_mlx.load(
            path,
            arena_gb=9 * rb / 1024**3,
            read_ahead="lookahead",
            lookahead_score=score,
            lookahead_decode_min_miss=0.0,
            decode="sync",
            eviction="nextuse",
        )
        out = strata_mlx.stream_generate(model, None, ids, max_tokens=24, prefill_step_size=8)
        tokens[score] = [r.token for r in out]
        stats[score] = model.expert_cache.stats
        model.expert_cache.close()
    assert tokens[True] == tokens[False]
    assert stats[True].readahead_submitted < stats[False].readahead_submitted


def test_pipelined_decode_reads_ahead_through_the_score(store):
    """The pipelined decoder's read-ahead goes through the expected-use rule the per-layer
    handshake's does: each checked layer's routing updates the share of its prediction used,
    and the read-ahead it predicts carries the bar (Predictor.ahead_bar)."""
    path = store("qwen3_moe")
    model, _ = strata_mlx.load(
        path,
        read_ahead="lookahead",
        lookahead_score=True,
        lookahead_decode_min_miss=0.0,
        decode="pipelined",
        decode_lag=0,
    )  # fmt: skip (lag 0: layer 0's check predicts layer 1 of the 2-layer model)
    ec = model.expert_cache
    ec.warm()  # every expert resident: no check fails, so no layer goes through run_layer
    bars = []
    scored = ec.arena.scored

    def spy(ahead):
        bars.append(ahead)
        return scored(ahead)

    ec.arena.scored = spy
    list(strata_mlx.stream_generate(model, None, prompt_ids(12, seed=3), max_tokens=12))
    ec.close()
    assert ec.stats.misses == 0
    decode = [a for a in bars if a is not None]  # None: the prompt's, never scored
    assert decode and all(a.layer == 1 and a.bar is not None for a in decode)
    assert ec.predictor.expected.precision[1] != 0.5  # the prior moved: routing was observed


def test_predicting_after_the_experts_changes_no_output(store, monkeypatch):
    """lookahead_after_experts queues a layer's expert kernels before its predictions are
    made (the device computes while the host ranks): same logits and tokens as predicting
    first, in prefill and in sync decode, with a small arena that evicts."""
    path = store("qwen3_moe")
    arena = 10 * load_manifest(path).layout.record_bytes / 1024**3
    ids = prompt_ids(24, seed=17)
    outs, order = {}, {}
    for after in (False, True):
        model, _ = strata_mlx.load(
            path,
            arena_gb=arena,
            read_ahead="lookahead",
            lookahead_after_experts=after,
            lookahead_decode_min_miss=0.0,
            decode="sync",
        )
        ec = model.expert_cache
        order[after] = seen = []

        def by_expert(*a, seen=seen, call=ec.compute.by_expert, **k):
            seen.append("experts")
            return call(*a, **k)

        def one_token(*a, seen=seen, call=ec.compute.one_token, **k):  # decode's
            seen.append("experts")
            return call(*a, **k)

        def predicted(*a, seen=seen, call=ec.sched.predicted, **k):
            seen.append("predicted")
            return call(*a, **k)

        monkeypatch.setattr(ec.compute, "by_expert", by_expert)
        monkeypatch.setattr(ec.compute, "one_token", one_token)
        monkeypatch.setattr(ec.sched, "predicted", predicted)
        logits = teacher_forced_logits(model, ids, 8)
        tokens = [r.token for r in strata_mlx.stream_generate(model, None, ids[:6], max_tokens=8)]
        outs[after] = (logits, tokens)
    assert np.array_equal(outs[False][0], outs[True][0])
    assert outs[False][1] == outs[True][1]
    # Each handshake with a prediction: before the kernel call by default, after it when asked.
    assert order[False][:2] == ["predicted", "experts"]
    assert order[True][:2] == ["experts", "predicted"]
    assert order[True].count("predicted") == order[False].count("predicted") > 0
    # decode's handshakes too: each prediction right before (after) its layer's kernel call
    for after, seen in order.items():
        at = [i for i, s in enumerate(seen) if s == "predicted"]
        assert all(seen[i + (-1 if after else 1)] == "experts" for i in at)


def test_lookahead_that_never_predicts_in_decode_reads_ahead_in_prefill_alone(store):
    """bench's `lookahead:never` (lookahead_decode_min_miss 1.0): prefill reads ahead as
    lookahead does, and decode predicts in its first two steps at most (the prompt's last
    token, which is prefill's and leaves the running miss rate at its start, 1.0, and the
    first generated one, whose first layer takes it below), then reads as demand does; the
    tokens are lookahead's."""
    from strata_mlx.apps.bench import policy_options

    path = store("qwen3_moe")
    gb = 9 * load_manifest(path).layout.record_bytes / 1024**3
    never = policy_options("lookahead:never")
    assert never == {"read_ahead": "lookahead", "lookahead_decode_min_miss": 1.0}
    tokens, stats = {}, {}
    for name, opts in (("lookahead", {"read_ahead": "lookahead"}), ("never", never)):
        model, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", **opts)
        out = strata_mlx.stream_generate(
            model, None, prompt_ids(16, seed=14), max_tokens=12, prefill_step_size=8
        )
        tokens[name] = [r.token for r in out]
        stats[name] = model.expert_cache.stats
        model.expert_cache.close()
    assert tokens["never"] == tokens["lookahead"]
    assert 0 < stats["never"].readahead_submitted < stats["lookahead"].readahead_submitted
    assert stats["never"].predicting_tokens <= 2 < stats["lookahead"].predicting_tokens


def test_the_decode_duel_keeps_the_faster_way_and_times_it_again():
    from strata_mlx.stream.prediction import DecodeDuel

    def run(duel, tokens: int, pace) -> list[bool]:
        ways = []
        for i in range(tokens):
            duel.begin()
            ways.append(duel.predicting)
            duel.token(duel.predicting, pace(duel.predicting, i))
        return ways

    trial = [True, True, False, False, False, False, True, True]
    # here not predicting is faster: kept after each trial of 2 tokens a block
    ways = run(DecodeDuel(block=2, keep=3), 2 * (8 + 3), lambda way, i: 0.03 if way else 0.02)
    assert ways == 2 * (trial + [False] * 3)
    # a way's first token after the other's is not timed: the arena holds the other's reads
    duel = DecodeDuel(block=2, keep=3)
    run(duel, 8, lambda way, i: [9.0, 0.03, 9.0, 0.02, 0.02, 0.02, 9.0, 0.03][i])
    assert duel.samples == {True: [0.03, 0.03], False: [0.02, 0.02, 0.02]}
    duel.begin()
    assert duel.predicting is False
    # nor is a generation's first (its decode starts after a prefill)
    duel = DecodeDuel(block=2, keep=3)
    duel.begin()
    duel.token(True, 1.0)
    duel.start()
    duel.begin()
    duel.token(True, 2.0)
    assert duel.samples[True] == []
    # a trial in which one way never ran (the miss rate kept prediction off) changes nothing
    duel = DecodeDuel(block=2, keep=3)
    for _ in range(8):
        duel.begin()
        duel.token(False, 0.01)
    duel.begin()
    assert duel.predicting is True
    with pytest.raises(ValueError):
        DecodeDuel(keep=0)


def test_the_decode_duel_is_lookaheads_alone():
    from strata_mlx.stream.prediction import Predictor, ReadAhead

    class Manifest:
        moe_layers, num_experts = [0, 1], 4

    on = Predictor(ReadAhead(policy="lookahead", decode_duel=True), Manifest(), None)
    assert on.duel is not None and on.predicts_in_decode()
    on.duel.block = 1
    on.decode_begin()  # the trial's first block: predicting
    assert on.predicts_in_decode()
    on.decode_begin()  # its second: demand's
    assert not on.predicts_in_decode() and on.targets(0, decoding=True) == []
    always = Predictor(ReadAhead(policy="lookahead", decode_min_miss=0.0), Manifest(), None)
    always.duel.block = 1
    always.decode_begin()
    always.decode_begin()  # (the demand block: --lookahead-decode-min-miss 0 predicts still)
    assert always.predicts_in_decode()
    demand = Predictor(ReadAhead(policy="demand", decode_duel=True), Manifest(), None)
    assert demand.duel is None and not demand.predicts_in_decode()
