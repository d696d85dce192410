"""Generation: stop strings across tokens, sampling, and the response objects."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.tokenizer import StreamingDetokenizer


class WordTokenizer:
    """Token i decodes to "w{i} ": enough to test text handling without a vocabulary file."""

    eos_token_ids: set[int] = set()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"w{i} " for i in ids)

    def detokenizer(self):
        return StreamingDetokenizer(self)


def test_stop_string_spanning_tokens_is_never_streamed(store):
    model, _ = strata_mlx.load(store("qwen3_moe"))
    tok = WordTokenizer()
    ids = prompt_ids(8, seed=9)
    full = [r.token for r in strata_mlx.stream_generate(model, tok, ids, max_tokens=8)]
    words = [f"w{t}" for t in full]
    stop = f"{words[2]} {words[3]}"  # spans tokens 2 and 3
    chunks = list(strata_mlx.stream_generate(model, tok, ids, max_tokens=8, stop=[stop]))
    text = "".join(c.text for c in chunks)
    assert text == "".join(f"{w} " for w in words[:2])
    assert chunks[-1].finish_reason == "stop"
    assert strata_mlx.generate(model, tok, ids, max_tokens=8, stop=[stop]) == text


def test_length_finish_and_stats(store):
    model, _ = strata_mlx.load(store("qwen3_moe"), arena_gb=0.0001)
    rs = list(strata_mlx.stream_generate(model, WordTokenizer(), prompt_ids(8), max_tokens=4))
    assert [r.finish_reason for r in rs] == [None, None, None, "length"]
    last = rs[-1]
    assert last.generation_tokens == 4 and last.prompt_tokens == 8
    s = last.expert_stats
    assert s.lookups == s.hits + s.streamed_ahead + s.misses > 0
    assert s.bytes_read > 0 and s.gb_per_s > 0


def test_seeded_sampling_repeats(store):
    model, _ = strata_mlx.load(store("qwen3_moe"))
    ids = prompt_ids(8, seed=10)
    a = [
        r.token
        for r in strata_mlx.stream_generate(
            model, None, ids, max_tokens=6, temp=1.0, top_p=0.9, seed=3
        )
    ]
    b = [
        r.token
        for r in strata_mlx.stream_generate(
            model, None, ids, max_tokens=6, temp=1.0, top_p=0.9, seed=3
        )
    ]
    assert a == b


def quarter_arena_gb(path) -> float:
    m = load_manifest(path)
    return m.num_experts * len(m.moe_layers) * m.layout.record_bytes / 4 / 1024**3


@pytest.mark.parametrize("scheduler", ["loop", "sync"])
@pytest.mark.parametrize("resident", [True, False])  # nothing left to read / reads every token
def test_a_generation_resumed_after_close_fails_with_one_line(store, scheduler, resident):
    """close() is idempotent; a generation that goes on after it (left at a yield and
    resumed) raises one line, also when every expert it needs is resident (nothing to read)."""
    path = store("qwen3_moe")
    model, _ = strata_mlx.load(
        path, arena_gb=None if resident else quarter_arena_gb(path), scheduler=scheduler
    )
    ec = model.expert_cache
    if resident:
        ec.warm()
    gen = strata_mlx.stream_generate(model, None, prompt_ids(8, seed=19), max_tokens=16)
    for _ in range(2):
        next(gen)
    assert (ec.stats.experts_read == 0) == resident
    ec.close()
    ec.close()
    with pytest.raises(RuntimeError, match="^expert cache is closed$"):
        next(gen)


EXIT_SCRIPT = """
import sys
import strata_mlx
from strata_mlx.generation.generate import stream_generate

abandoned = []  # generators left at a yield, closed by the interpreter's exit
for close, gb in ((True, None), (True, {gb}), (False, {gb})):
    model, _ = strata_mlx.load(sys.argv[1], arena_gb=gb)
    gen = stream_generate(model, None, list(range(8)), 16)
    for _ in range(2):
        next(gen)
    if close:
        model.expert_cache.close()
    abandoned.append(gen)
"""


def test_exit_with_an_abandoned_generation_prints_nothing(store):
    """Generators left at a yield, their expert cache closed or not: the interpreter's exit
    closes them (rolling back the token built ahead) without a word."""
    path = store("qwen3_moe")
    script = EXIT_SCRIPT.format(gb=quarter_arena_gb(path))
    r = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_prompt_progress_callback_is_called_as_mlx_lm_calls_it(store):
    """mlx-lm's `prompt_progress_callback`: (0, T) first, then after each prefill chunk the
    positions done, then (T, T) with the first token; the same calls, in order, as mlx-lm's
    own generate_step makes on its own model of the same store with the same chunk."""
    from mlx_lm.generate import generate_step as mlx_lm_generate_step

    from strata_mlx.apps.baseline import load_mlx_lm
    from strata_mlx.generation.generate import stream_generate

    path = store("qwen3_moe")
    ids = prompt_ids(29, seed=21)
    model, _ = strata_mlx.load(path)
    ours: list[tuple[int, int]] = []
    list(stream_generate(model, None, ids, max_tokens=3, prefill_step_size=8,
                         prompt_progress_callback=lambda *a: ours.append(a)))  # fmt: skip
    model.expert_cache.close()
    import mlx.core as mx

    ref_model = load_mlx_lm(path)
    theirs: list[tuple[int, int]] = []
    gen = mlx_lm_generate_step(mx.array(ids), ref_model, max_tokens=3, prefill_step_size=8,
                               prompt_progress_callback=lambda *a: theirs.append(a))  # fmt: skip
    list(gen)
    assert ours == theirs
    assert ours[0] == (0, 29) and ours[-1] == (29, 29) and (8, 29) in ours


def test_closing_expert_line_adds_up_and_names_the_arena():
    """hit rate = resident + streamed ahead, hit rate + misses = 100 (README, "What the
    numbers mean"); nothing read says so, not "0.00 GB/s"; the arena in use is printed."""
    import re

    from strata_mlx.generation.generate import expert_line
    from strata_mlx.stream.stats import ExpertStats

    s = ExpertStats(lookups=1000, hits=860, streamed_ahead=100, misses=40, experts_read=140)
    s.bytes_read, s.wall_s = 140 * 4096, 2.0
    line = expert_line(s, (120 * 4096, 120))
    hit, resident, ahead, missed = map(
        float,
        re.search(
            r"hit rate ([\d.]+)% \(([\d.]+)% resident \+ ([\d.]+)% streamed "
            r"ahead\), misses ([\d.]+)%",
            line,
        ).groups(),  # fmt: skip
    )
    assert hit == pytest.approx(resident + ahead) and hit + missed == pytest.approx(100)
    assert (hit, missed) == (96.0, 4.0) and "arena 0.000 GiB (120 slots)" in line
    quiet = expert_line(ExpertStats(lookups=10, hits=10))
    assert "0 read" in quiet and "GB/s" not in quiet and "misses 0.0%" in quiet


def test_mlx_buffer_cache_is_emptied_around_the_prompt(store, monkeypatch):
    """An earlier model's freed buffers in MLX's cache would make later allocations free them
    (on CUDA, waiting for the device): generate_step empties the cache before and after the
    prompt and every RELEASE_EVERY tokens, as mlx-lm's does. (This CPU backend keeps no
    cache, so the calls are what is checked.)"""
    import mlx.core as mx

    from strata_mlx.generation import generate

    model, _ = strata_mlx.load(store("qwen3_moe"))
    events = []
    monkeypatch.setattr(generate, "RELEASE_EVERY", 2)
    monkeypatch.setattr(mx, "clear_cache", lambda: events.append("clear"))
    steps = generate.generate_step(
        model, mx.array(prompt_ids(8)), max_tokens=5, prefill_step_size=4,
        on_chunk=lambda _: events.append("chunk"),
    )  # fmt: skip
    for _ in steps:
        events.append("token")
    # the prompt's 7 tokens but its last in two chunks, the cache emptied around them
    assert events == ["clear", "chunk", "chunk", "clear"] + ["token", "token", "clear"] * 2 + [
        "token"
    ]


def test_the_api_refuses_what_it_would_misread(store):
    """Token ids as a NumPy or MLX array of integers are the list's; bytes, floats, booleans,
    strings, None and arrays not of one dimension as a prompt, a negative prefill step (it
    ran no chunk: the prompt skipped; 0 is the model's step), a stop list holding no strings, a prompt cache that is not the model's layers
    and cached tokens without one are refused by name (they were misread, or a library's
    error); one stop string alone is taken as OpenAI's API takes it."""
    import mlx.core as mx
    import numpy as np

    from strata_mlx.config import OptionError

    model, _ = strata_mlx.load(store("qwen3_moe"))
    tok, ids = WordTokenizer(), prompt_ids(8, seed=9)
    want = strata_mlx.generate(model, tok, ids, max_tokens=3)
    for same in (np.array(ids), np.array(ids, dtype=np.int32), mx.array(ids), tuple(ids)):
        assert strata_mlx.generate(model, tok, same, max_tokens=3) == want
    bad = [
        (dict(prompt=b"hello"), "prompt: text or token ids, got bytes"),
        (dict(prompt=None), "prompt: text or token ids, got NoneType"),
        (dict(prompt=5), "prompt: text or token ids, got int"),
        (dict(prompt=[1.5, 2.0]), "must be integers, got float 1.5"),
        (dict(prompt=[True]), "must be integers, got bool True"),
        (dict(prompt=["a"]), "must be integers, got str 'a'"),
        (dict(prefill_step_size=-1), "prefill_step_size -1: expected an integer in"),
        (dict(prefill_step_size=-512), "prefill_step_size -512"),
        (dict(prefill_step_size=2.5), "prefill_step_size 2.5"),
        (dict(prompt=np.array(5)), "token ids in one dimension, got an array of 0"),
        (dict(prompt=mx.array([ids])), "token ids in one dimension, got an array of 2"),
        (dict(stop=[None]), r"stop: a string or a list of strings, got \[None\]"),
        (dict(prompt_cache=[]), "prompt_cache: a list of the model's"),
        (dict(prompt_cache=[1, 2]), "prompt_cache: a list of the model's"),
        (dict(cached_tokens=[1, 2]), "cached_tokens: the tokens a prompt_cache covers"),
    ]
    for kw, message in bad:
        kw = {"prompt": ids, **kw}
        with pytest.raises(OptionError, match=message):
            strata_mlx.generate(model, tok, max_tokens=3, **kw)
    assert strata_mlx.generate(model, tok, ids, max_tokens=3, prefill_step_size=0) == want
    words = want.split()
    cut = strata_mlx.generate(model, tok, ids, max_tokens=3, stop=words[1])
    assert cut == strata_mlx.generate(model, tok, ids, max_tokens=3, stop=[words[1]])
    assert cut == f"{words[0]} "


@pytest.mark.parametrize("decode", ["pipelined", "sync"])
def test_a_sampler_giving_an_id_past_the_vocabulary_is_an_error_not_a_crash(store, decode):
    """A custom sampler's id past the vocabulary (or negative) is refused by name before it
    is yielded; the token built on it ahead meanwhile reads a clamped id (MLX's gather does
    not check its indices: it was a segmentation fault). The model decodes on after it."""
    import mlx.core as mx

    model, _ = strata_mlx.load(store("qwen3_moe"), decode=decode)
    tok, ids = WordTokenizer(), prompt_ids(8, seed=9)
    want = strata_mlx.generate(model, tok, ids, max_tokens=3)
    for bad in (10**6, -1):

        def sampler(logprobs, bad=bad):
            return mx.array([bad], dtype=mx.int32)

        with pytest.raises(ValueError, match=rf"the sampler gave token id {bad}, outside the "
                                             r"vocabulary \[0, \d+\)"):  # fmt: skip
            strata_mlx.generate(model, tok, ids, max_tokens=3, sampler=sampler)
    assert strata_mlx.generate(model, tok, ids, max_tokens=3) == want


def test_text_that_begins_with_bos_gets_no_second_one():
    """A chat template's text carries its BOS; encoding it with the tokenizer's own BOS again
    doubled it (mlx-lm's stream_generate checks the same)."""
    from types import SimpleNamespace

    from strata_mlx.generation.generate import _prompt_ids

    class Tok:
        bos_token = "<s>"

        def encode(self, text, add_special_tokens=True):
            return [1] * add_special_tokens + [2] * len(text.split())

    model = SimpleNamespace(args=SimpleNamespace(vocab_size=8, max_position_embeddings=64))
    assert _prompt_ids(model, Tok(), "<s> hi there", None) == [2, 2, 2]
    assert _prompt_ids(model, Tok(), "hi there", None) == [1, 2, 2]
