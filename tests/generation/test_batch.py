"""Continuous batching (strata_mlx.generation.batch): each sequence's tokens and log-probabilities
are those it gets alone, bit for bit on the CPU, whatever joins or leaves the batch; the MoE
layers run once per step for the batch, reading the union of its experts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import prompt_ids
from test_prompt_cache import wide_store  # noqa: F401  (the module's fixture)

import strata_mlx
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.batch import BatchGenerator, batch_forward
from strata_mlx.generation.sampling import make_sampler

# (prompt length, max_tokens, temperature, seed): greedy and seeded sampling, prompts shorter
# and longer than a prefill chunk
REQUESTS = [
    (9, 7, 0.0, None),
    (3, 5, 0.0, None),
    (21, 6, 0.8, 11),
    (1, 4, 0.0, None),
    (14, 8, 1.0, 5),
]


def small_arena(path, slots: int = 5):
    rb = load_manifest(path).layout.record_bytes
    return strata_mlx.load(path, arena_gb=slots * rb / 1024**3, prefill_step_size=8)


def alone(model, ids, max_tokens, temp, seed):
    rs = list(
        strata_mlx.stream_generate(model, None, ids, max_tokens=max_tokens, temp=temp, seed=seed)
    )
    return [r.token for r in rs], [np.array(r.logprobs) for r in rs]


@pytest.mark.parametrize(
    "family, quantize, one_forward",
    [
        ("qwen3_moe", False, True),
        ("qwen3_moe", True, True),
        ("qwen3_moe", False, False),
        ("mixtral", False, True),
        ("olmoe", True, True),
        ("glm4_moe", False, True),
        # the families whose rows meet at the MoE layers only: recurrent layers, MLA, sinks
        ("qwen3_next", False, True),
        ("deepseek_v3", False, True),
        ("gpt_oss", False, True),
    ],
)
def test_each_sequence_gets_what_it_gets_alone(store, family, quantize, one_forward):
    path = store(family, quantize)
    model, _ = small_arena(path)
    prompts = [prompt_ids(n, seed=20 + i) for i, (n, *_) in enumerate(REQUESTS)]
    expected = [alone(model, p, m, t, s) for p, (_, m, t, s) in zip(prompts, REQUESTS)]
    model.expert_cache.close()

    # a fresh model (another residency history), sequences joining one by one as others run
    model, _ = small_arena(path)
    gen = BatchGenerator(
        model, None, decode_concurrency=4, prefill_step_size=8, one_forward=one_forward
    )
    got: dict[int, tuple[list, list]] = {i: ([], []) for i in range(len(REQUESTS))}
    which, waiting, sizes = {}, list(range(len(REQUESTS))), set()
    while waiting or gen.sequences:
        if waiting and gen.has_room():  # one joins per step, while others decode
            i = waiting.pop(0)
            _, m, t, s = REQUESTS[i]
            seq = gen.insert(prompts[i], m, make_sampler(t), seed=s)
            which[id(seq)] = i
        out = gen.step()
        sizes.add(len(out))
        for seq, r in out:
            tokens, logprobs = got[which[id(seq)]]
            tokens.append(r.token)
            logprobs.append(np.array(r.logprobs))
    assert {1, 2, 3, 4} <= sizes  # batches of every size up to 4 ran
    for i, (tokens, logprobs) in got.items():
        assert tokens == expected[i][0], i
        for a, b in zip(logprobs, expected[i][1]):
            assert np.array_equal(a, b), i  # bit for bit
    s = model.expert_cache.stats
    assert s.experts_read > 0  # the arena really streamed
    model.expert_cache.close()


def test_removed_sequence_leaves_the_others_exact(store):
    path = store("qwen3_moe")
    model, _ = small_arena(path)
    a, b = prompt_ids(6, seed=1), prompt_ids(5, seed=2)
    want = alone(model, b, 6, 0.0, None)[0]
    gen = BatchGenerator(model, None, decode_concurrency=2)
    sa = gen.insert(a, 100)
    sb = gen.insert(b, 6)
    tokens = []
    for n in range(10):
        for seq, r in gen.step():
            if seq is sb:
                tokens.append(r.token)
        if n == 3:
            gen.remove(sa)  # its client left
    assert tokens == want and not gen.sequences
    # the removed sequence's cache covers its prompt and every token but the last
    assert all(c.offset == len(a) - 1 + len(sa.tokens) for c in sa.cache)
    model.expert_cache.close()


def test_a_prefill_forward_stops_only_once_every_sequence_in_it_is_gone(store):
    """stop_prefill true of one of two sequences prefilling together: their forward runs on
    (the other still wants it) and that sequence gets what it gets alone; true of every one:
    the forward stops at its next MoE layer, each sequence handed over with PrefillStopped."""
    from strata_mlx.runtime.experts import PrefillStopped

    path = store("qwen3_moe")
    model, _ = small_arena(path)
    a, b = prompt_ids(20, seed=1), prompt_ids(20, seed=2)
    want = alone(model, b, 3, 0.0, None)[0]
    gen = BatchGenerator(model, None, decode_concurrency=2, prompt_concurrency=2,
                         prefill_step_size=8)  # fmt: skip
    sa, sb = gen.insert(a, 3), gen.insert(b, 3)
    failed, tokens = [], []
    while gen.sequences:
        for seq, r in gen.step(on_error=lambda s, e: failed.append((s, e)),
                               stop_prefill=lambda s: s is sa):  # fmt: skip
            if seq is sb:
                tokens.append(r.token)
            if seq is sa:
                gen.remove(sa)  # (its client is gone: it would be removed between steps)
    assert failed == [] and tokens == want
    ec = model.expert_cache
    layers_run = []
    run_layer = ec.run_layer
    # (the handshakes themselves: a row's forward hands its layer to the batch first)
    ec.run_layer = lambda *x: (ec.gather is None and layers_run.append(x[0])) or run_layer(*x)
    gen = BatchGenerator(model, None, decode_concurrency=2, prompt_concurrency=2,
                         prefill_step_size=8)  # fmt: skip
    sa, sb = gen.insert(a, 3), gen.insert(b, 3)
    assert gen.step(on_error=lambda s, e: failed.append((s, e)), stop_prefill=lambda s: True) == []
    assert [s for s, _ in failed] == [sa, sb] and not gen.sequences
    assert all(isinstance(e, PrefillStopped) for _, e in failed)
    assert layers_run == [ec.layers[0]]  # stopped at the first MoE layer's handshake
    ec.run_layer = run_layer
    model.expert_cache.close()


@pytest.mark.parametrize("one_forward", [True, False])
def test_one_moe_call_per_layer_reads_the_union(store, one_forward):
    """A batched step runs each MoE layer once for all rows: as many handshakes as one
    sequence's token, and no expert read twice in a step."""
    path = store("qwen3_moe")
    model, _ = small_arena(path, slots=16)  # every expert fits: nothing read twice
    ec = model.expert_cache
    rows = []
    for i in range(4):
        cache = model.make_cache()
        mx.eval(model(mx.array(prompt_ids(5, seed=i))[None], cache=cache))
        rows.append((mx.array([[i + 3]]), cache))
    calls = []
    run = ec.run_layer

    def counting(layer, x, inds):
        if ec.gather is None:
            calls.append((layer, x.size // x.shape[-1]))
        return run(layer, x, inds)

    ec.run_layer = counting
    before = ec.stats.copy()
    logits = batch_forward(model, rows, one_forward)
    mx.eval(logits)
    n_layers = len(ec.layers)
    assert calls == [(layer, 4) for layer in ec.layers]  # one handshake a layer, 4 tokens
    assert ec.stats.minus(before).experts_read <= n_layers * 8
    ec.close()


@pytest.mark.parametrize("family, quantize", [("qwen3_moe", True), ("qwen3_next", False)])
def test_prompts_prefill_together_and_stay_exact(store, family, quantize):
    """prompt_concurrency 3: a step runs three prompts' chunks as one batch_forward, every
    MoE layer once for their tokens; each sequence still gets what it gets alone."""
    path = store(family, quantize)
    model, _ = small_arena(path)
    prompts = [prompt_ids(n, seed=40 + i) for i, n in enumerate((19, 9, 14))]
    expected = [alone(model, p, 4, 0.0, None) for p in prompts]
    model.expert_cache.close()

    model, _ = small_arena(path)
    ec = model.expert_cache
    handshakes = []
    run = ec.run_layer

    def counting(layer, x, inds):
        if ec.gather is None:
            handshakes.append(x.size // x.shape[-1])
        return run(layer, x, inds)

    ec.run_layer = counting
    gen = BatchGenerator(
        model, None, decode_concurrency=3, prompt_concurrency=3, prefill_step_size=8
    )
    seqs = [gen.insert(p, 4) for p in prompts]
    first = gen.step()  # the first chunks, 8 tokens of each prompt, together (then the
    # 9-token prompt, all in its cache but its last token, decodes its first token)
    assert handshakes[: len(ec.layers)] == [24] * len(ec.layers)
    got = {id(s): ([], []) for s in seqs}
    while first or gen.sequences:
        for seq, r in first or gen.step():
            got[id(seq)][0].append(r.token)
            got[id(seq)][1].append(np.array(r.logprobs))
        first = None
    for seq, (tokens, logprobs) in zip(seqs, expected):
        assert got[id(seq)][0] == tokens
        assert all(np.array_equal(a, b) for a, b in zip(got[id(seq)][1], logprobs))
    ec.close()


@pytest.mark.parametrize("bad", [{"decode_concurrency": 0}, {"prompt_concurrency": 0}])
def test_bad_concurrency_is_one_line(store, bad):
    model, _ = strata_mlx.load(store("qwen3_moe"))
    with pytest.raises(strata_mlx.config.OptionError, match="concurrency"):
        BatchGenerator(model, None, **bad)
    model.expert_cache.close()


def test_a_batch_past_the_sorted_expert_path_is_exact(store):
    """32 rows of top-2 are 64 (token, expert) pairs: the expert computation then sorts the
    pairs by expert (mlx-lm's SwitchGLU above 63 pairs), which no sequence alone does in
    decode. Each row still gets what it gets alone."""
    path = store("qwen3_moe")
    model, _ = small_arena(path, slots=16)
    prompts = [prompt_ids(3, seed=100 + i) for i in range(32)]
    expected = [alone(model, p, 3, 0.0, None) for p in prompts]
    gen = BatchGenerator(model, None, decode_concurrency=32, prompt_concurrency=32)
    seqs = [gen.insert(p, 3) for p in prompts]
    got = {id(s): ([], []) for s in seqs}
    sizes = set()
    while gen.sequences:
        out = gen.step()
        sizes.add(len(out))
        for seq, r in out:
            got[id(seq)][0].append(r.token)
            got[id(seq)][1].append(np.array(r.logprobs))
    assert 32 in sizes
    for seq, (tokens, logprobs) in zip(seqs, expected):
        assert got[id(seq)][0] == tokens
        assert all(np.array_equal(a, b) for a, b in zip(got[id(seq)][1], logprobs))
    model.expert_cache.close()


@pytest.mark.parametrize(
    "kv",
    [{"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 6}, {"max_kv_size": 8}],
    ids=["quantized", "rotating"],
)
def test_kv_cache_options_stay_exact(store, wide_store, kv):  # noqa: F811
    """Caches quantized mid-way, or rotating past their window, row by row as alone."""
    from strata_mlx.generation.prompt_cache import KVOptions

    model, _ = small_arena(wide_store if "kv_bits" in kv else store("qwen3_moe"))
    prompts = [prompt_ids(n, seed=40 + n) for n in (4, 7, 2)]
    expected = [
        [r.token for r in strata_mlx.stream_generate(model, None, p, max_tokens=10, **kv)]
        for p in prompts
    ]
    gen = BatchGenerator(
        model, None, decode_concurrency=3, prompt_concurrency=3, kv=KVOptions(**kv)
    )
    seqs = [gen.insert(p, 10) for p in prompts]
    while gen.sequences:
        gen.step()
    assert [s.tokens for s in seqs] == expected
    quantized = any(type(c).__name__ == "QuantizedKVCache" for c in seqs[1].cache)
    assert quantized == ("kv_bits" in kv)
    model.expert_cache.close()


def test_mlx_buffer_cache_is_emptied_after_prompt_chunks_and_every_so_many_steps(
    store, monkeypatch
):
    """As generate_step (generate.RELEASE_EVERY): MLX's cache emptied after each step's
    prompt chunks and every RELEASE_EVERY token steps, when nothing is in flight."""
    from strata_mlx.generation import generate

    path = store("qwen3_moe")
    model, _ = small_arena(path)
    events = []
    monkeypatch.setattr(generate, "RELEASE_EVERY", 2)
    monkeypatch.setattr(mx, "clear_cache", lambda: events.append("clear"))
    gen = BatchGenerator(model, None, decode_concurrency=2, prefill_step_size=4)
    gen.insert(prompt_ids(8, seed=3), 4)  # 7 tokens to prefill: two chunks, two steps
    while gen.sequences:
        for seq, r in gen.step():
            events.append("token")
            if r.finish_reason is not None:
                gen.remove(seq)
    # a step's clears come before the tokens it returns: step 1 a chunk; step 2 the last
    # chunk and token step 1; then a token step a step, emptied after steps 2 and 4
    assert events == ["clear", "clear", "token", "clear", "token", "token", "clear", "token"]
    model.expert_cache.close()
