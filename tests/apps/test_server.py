"""The OpenAI-compatible server, through the official `openai` client against a live uvicorn
server on 127.0.0.1 (a random free port): chat and text completions, streaming, stop, limits,
errors, concurrency, models and stats; clients that leave, the queue bound, SIGTERM, the API
key and CORS."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest
import uvicorn
from conftest import wait_until_serving

import strata_mlx
from strata_mlx.apps.server import create_app
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.sampling import SamplingOptions

FAMILY = "qwen3_moe"
NAME = "tiny-qwen3-moe"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "what is the capital of france",
    "paris is a city in france",
    "tell me a story about a red fox",
]


def write_tokenizer(d, vocab_size: int = 128) -> None:
    """A word-level tokenizer trained on a few sentences, padded to the tiny model's vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    special = ["<unk>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = {w for line in SENTENCES + ["system user assistant"] for w in line.split()}
    filler = [f"w{i}" for i in range(vocab_size - len(special) - len(words))]
    corpus = SENTENCES + ["system user assistant"] + [" ".join(filler)]
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=special)
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == vocab_size
    assert all(tok.token_to_id(w) is not None for w in words)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None})
    )


LONG = 1_000_000  # max_tokens of a request that runs until it is cancelled


def set_context(d, n: int) -> None:
    """Give the store at `d` a context (max_position_embeddings) of n tokens."""
    path = d / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"]["max_position_embeddings"] = n
    path.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def tiny(store, tmp_path_factory):
    """The tiny store with a tokenizer and a chat template, and a context past LONG: the
    server ends generation at the context's end, and a request of max_tokens=LONG has to
    run until it is cancelled (the tiny model writes 512 tokens in about two seconds)."""
    d = tmp_path_factory.mktemp("served") / "tiny"
    shutil.copytree(store(FAMILY), d)
    write_tokenizer(d)
    set_context(d, 2 * LONG)
    return d


def load_tiny(path):
    rb = load_manifest(path).layout.record_bytes
    # 5 slots for 2 layers x 8 experts: requests really stream and evict.
    model, tok = strata_mlx.load(path, arena_gb=5 * rb / 1024**3, read_ahead="lookahead")
    assert tok is not None and tok.eos_token_ids == {tok._tok.token_to_id("<|im_end|>")}
    return model, tok


@contextlib.contextmanager
def running(app, **config):
    """`app` served by uvicorn on a thread, on a free port (`config`: more of uvicorn.Config's
    arguments); yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5, **config
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def served(tiny):
    model, tok = load_tiny(tiny)
    # room for the concurrency test's 20 requests; max_tokens up to LONG; prompts up to 512
    app = create_app(model, tok, NAME, max_queue=32, max_tokens_limit=LONG, max_prompt_tokens=512)
    try:
        with running(app) as base:
            yield base, model, tok
    finally:
        model.expert_cache.close()


@pytest.fixture
def client(served):
    base, _, _ = served
    http = httpx.Client(trust_env=False, timeout=60)  # localhost only, no proxies
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, http_client=http)
    yield c
    http.close()


def chat_ids(tok, content: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": content}])
    return tok.encode(text, add_special_tokens=False)


def chat(client, content, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": content}], **kw
    )


def stream_chat(client, content, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    text, finish, usage, n = "", None, None, 0
    for chunk in client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": content}], stream=True, **kw
    ):
        n += 1
        assert n < 1000
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish, usage


def test_chat_matches_generate(served, client):
    _, model, tok = served
    r = chat(client, "what is the capital of france", max_tokens=10)
    ids = chat_ids(tok, "what is the capital of france")
    expected = strata_mlx.generate(model, tok, ids, max_tokens=10)
    assert r.model == NAME and r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == expected and expected
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(ids)
    assert 1 <= r.usage.completion_tokens <= 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_equals_non_streaming(client):
    full = chat(client, "tell me a story", max_tokens=10)
    text, finish, usage = stream_chat(
        client, "tell me a story", max_tokens=10, stream_options={"include_usage": True}
    )
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_text_completions(served, client):
    _, model, tok = served
    r = client.completions.create(model=NAME, prompt="the cat sat", max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == strata_mlx.generate(
        model, tok, tok.encode("the cat sat"), max_tokens=6
    )
    ids = [5, 9, 17, 3]
    r2 = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert r2.choices[0].text == strata_mlx.generate(model, tok, ids, max_tokens=6)
    assert r2.usage.prompt_tokens == 4
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=NAME, prompt="the cat sat", max_tokens=6, temperature=0, stream=True
        )
    )
    assert text == r.choices[0].text


def test_stop_sequences(client):
    full = chat(client, "a dog ran", max_tokens=16, stop=None).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full  # the tiny model's greedy output is long enough
    # one word, a list, and a stop sequence spanning two tokens
    for stop in (words[2], ["zzz-never", words[3]], f"{words[1]} {words[2]}"):
        first = stop if isinstance(stop, str) else stop[1]
        expected = full[: full.find(first)]
        r = chat(client, "a dog ran", max_tokens=16, stop=stop)
        assert r.choices[0].message.content == expected, stop
        assert r.choices[0].finish_reason == "stop"
        text, finish, _ = stream_chat(client, "a dog ran", max_tokens=16, stop=stop)
        assert (text, finish) == (expected, "stop"), stop


def test_max_tokens(client):
    r = chat(client, "the cat sat on the mat", max_tokens=3)
    assert r.usage.completion_tokens <= 3
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 3
    r0 = chat(client, "the cat sat on the mat", max_tokens=0)
    assert r0.choices[0].message.content == "" and r0.usage.completion_tokens == 0
    assert r0.choices[0].finish_reason == "length"
    r4 = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "the cat"}],
        max_completion_tokens=2,
        temperature=0,
    )
    assert r4.usage.completion_tokens <= 2


def test_sampling_with_seed_is_reproducible(client):
    a = chat(client, "a red fox", temperature=1.0, top_p=0.9, seed=7, max_tokens=8)
    b = chat(client, "a red fox", temperature=1.0, top_p=0.9, seed=7, max_tokens=8)
    assert a.choices[0].message.content == b.choices[0].message.content


# ---- sampling fields as mlx-lm's server spells them ---------------------------------------


def content(client, prompt: str, **kw) -> str:
    return chat(client, prompt, **kw).choices[0].message.content


def api(model, tok, prompt: str, max_tokens: int = 8, seed=None, **kw) -> str:
    """What the Python API generates for the chat `prompt` with sampling.SamplingOptions(**kw)."""
    opts = SamplingOptions(**kw)
    return strata_mlx.generate(
        model,
        tok,
        chat_ids(tok, prompt),
        max_tokens=max_tokens,
        seed=seed,
        sampler=opts.sampler(tok),
        logits_processors=opts.logits_processors(model.args.vocab_size),
    )


def test_top_k_and_min_p_sample_as_the_api_does(served, client):
    _, model, tok = served
    greedy = content(client, "a red fox", temperature=0)
    # top_k 1 and min_p 1 keep only the most likely token: greedy whatever the seed
    for seed in (1, 2):
        for extra in ({"top_k": 1}, {"min_p": 1.0}):
            assert (
                content(client, "a red fox", temperature=1, seed=seed, extra_body=extra) == greedy
            )
    body = {"top_k": 20, "min_p": 0.02}
    outs = {
        seed: content(client, "a red fox", temperature=0.9, seed=seed, extra_body=body)
        for seed in (1, 2, 3, 4)
    }
    assert len(set(outs.values())) > 1  # it samples
    assert content(client, "a red fox", temperature=0.9, seed=3, extra_body=body) == outs[3]
    assert outs[3] == api(model, tok, "a red fox", seed=3, temp=0.9, top_k=20, min_p=0.02)
    streamed, _, _ = stream_chat(client, "a red fox", temperature=0.9, seed=3, extra_body=body)
    assert streamed == outs[3]


def test_logit_bias_and_penalties_as_the_api_does(served, client):
    _, model, tok = served
    paris = tok.encode("paris", add_special_tokens=False)[0]
    forced = content(client, "a dog ran", temperature=0, logit_bias={str(paris): 100})
    assert forced.split() == ["paris"] * 8  # +100 on one token: nothing else is drawn
    assert forced == api(model, tok, "a dog ran", logit_bias={paris: 100})
    greedy = content(client, "a dog ran", temperature=0)
    first = tok.encode(greedy.split()[0], add_special_tokens=False)[0]
    banned = content(client, "a dog ran", temperature=0, logit_bias={str(first): -100})
    assert banned.split()[0] != greedy.split()[0]
    for fields in (
        {"repetition_penalty": 1.5, "repetition_context_size": 8},
        {"presence_penalty": 1.0},
        {"frequency_penalty": 0.7, "frequency_context_size": 30},
    ):
        got = content(client, "a dog ran", temperature=0, max_tokens=12, extra_body=fields)
        assert got == api(model, tok, "a dog ran", max_tokens=12, **fields), fields
    # a penalty on what was said: the forced token once, then never again in its window
    bias = {str(paris): 100}
    once = content(client, "a dog ran", temperature=0, logit_bias=bias, presence_penalty=200)
    assert once.split()[0] == "paris" and "paris" not in once.split()[1:]
    assert once == api(model, tok, "a dog ran", logit_bias={paris: 100}, presence_penalty=200)
    again = content(
        client,
        "a dog ran",
        temperature=0,
        logit_bias=bias,
        extra_body={"repetition_penalty": 1e6},  # (100 + logit) / 1e6: as good as gone
    )
    assert again.split()[0] == "paris" and "paris" not in again.split()[1:]


def test_out_of_range_sampling_fields_are_400s(served):
    base, _, _ = served
    cases = [
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": "5"}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": "x"}, "min_p"),
        ({"xtc_probability": 2.0}, "xtc_probability"),
        ({"xtc_threshold": 0.9}, "xtc_threshold"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_context_size": 0}, "repetition_context_size"),
        ({"presence_penalty": "high"}, "presence_penalty"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"paris": 1}}, "logit_bias"),
        ({"logit_bias": {"999": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"stop": ["a", 3]}, "stop"),
        # each below was answered 200, the field ignored
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "no"}}]}, "tools"),
        ({"response_format": {"type": "bogus"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format",
        ),  # (no constrained decoding: not the answer asked for)
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ]
    url = base + "/v1/chat/completions"
    with httpx.Client(trust_env=False, timeout=30) as http:
        for extra, param in cases:
            for stream in (False, True):  # refused before a stream starts
                body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], **extra}
                r = http.post(url, json={**body, "stream": stream})
                assert r.status_code == 400, (extra, r.text)
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["message"], extra
                assert (err["param"] or "").startswith(param), (extra, err)
        r = http.post(base + "/v1/completions", json={"model": NAME, "prompt": [1, 2], "top_k": -3})
        assert r.status_code == 400 and "top_k" in r.json()["error"]["message"]


def test_bad_requests_answer_400_with_an_error_body(served, client):
    base, _, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hello", max_tokens=-1)
    assert e.value.status_code == 400
    err = e.value.body
    assert set(err) >= {"message", "type", "param", "code"} and err["param"] == "max_tokens"

    url = base + "/v1/chat/completions"
    cases = [
        ({"model": NAME}, "messages"),  # missing messages
        ({"model": NAME, "messages": "hi"}, "messages"),  # wrong type
        ({"model": NAME, "messages": []}, "messages"),  # empty
        ({"model": NAME, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"model": NAME, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            "temperature",
        ),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
            "max_tokens",
        ),
        ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
        ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "stop": 3}, "stop"),
    ]
    with httpx.Client(trust_env=False, timeout=30) as http:
        for body, param in cases:
            r = http.post(url, json=body)
            assert r.status_code == 400, body
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "invalid_request_error" and err["message"]
            assert (err["param"] or "").startswith(param), (body, err)
        r = http.post(url, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = http.post(base + "/v1/completions", json={"model": NAME, "prompt": [500]})
        assert r.status_code == 400 and "500" in r.json()["error"]["message"]
        r = http.post(url, json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = http.get(base + "/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()


def test_concurrent_requests_match_requests_made_alone(client):
    prompts = ["the cat sat", "a dog ran in the park", "paris is a city", "tell me a story"]
    alone = {p: chat(client, p, max_tokens=6).choices[0].message.content for p in prompts}
    jobs = [(prompts[i % 4], i % 3 == 0) for i in range(20)]  # a third of them streamed

    def one(job):
        p, streamed = job
        if streamed:
            return p, stream_chat(client, p, max_tokens=6)[0]
        return p, chat(client, p, max_tokens=6).choices[0].message.content

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, jobs, timeout=120))
    assert len(results) == 20
    for p, text in results:
        assert text == alone[p], p


def test_models_endpoint(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME


def test_stats_endpoint(served, client):
    base, model, _ = served
    chat(client, "the cat", max_tokens=2)
    with httpx.Client(trust_env=False, timeout=30) as http:
        for path in ("/v1/stats", "/stats"):
            s = http.get(base + path).json()
            assert s["model"] == NAME
            ec = s["expert_cache"]
            assert ec["lookups"] > 0 and ec["experts_read"] > 0 and 0 <= ec["hit_rate"] <= 1
            assert ec["lookups"] == model.expert_cache.stats.lookups
            assert s["arena"]["slots"] == 5
            assert s["server"]["requests"] >= 1 and s["server"]["completion_tokens"] >= 1
            assert s["served"]["lookups"] > 0 and s["served"]["wall_s"] > 0
            assert s["served"]["tokens"] > 0
    # the server's records are verified as they are read (the default)
    reads = model.expert_cache.reader.stats()
    assert model.expert_cache.verify and reads["verified"] == reads["requests_done"] > 0


def test_client_leaving_a_stream_stops_its_generation(served, client):
    base, _, _ = served
    with httpx.Client(trust_env=False, timeout=30) as http:
        before = http.get(base + "/v1/stats").json()["server"]
        stream = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "tell me a story"}],
            stream=True,
            max_tokens=2000,
            temperature=0,
        )
        next(iter(stream))
        # the event loop answers while the worker thread generates
        assert http.get(base + "/v1/models").status_code == 200
        stream.close()
        deadline = time.monotonic() + 30
        while True:
            s = http.get(base + "/v1/stats").json()["server"]
            if s["active"] == 0 and s["requests"] > before["requests"]:
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.05)
        assert s["completion_tokens"] - before["completion_tokens"] < 2000
    assert chat(client, "the cat", max_tokens=2).usage.completion_tokens >= 1


def test_a_client_leaving_during_prefill_stops_it_inside_its_chunk(tiny):
    """A job cancelled while its prompt prefills stops at the next MoE layer of the chunk it
    is in (it used to prefill every chunk, then stop at the first token; then to finish its
    chunk: minutes for a 2048-token chunk on a CPU), and the engine serves the next job as a
    fresh generation does."""
    from strata_mlx.apps.server import Engine, Job

    rb = load_manifest(tiny).layout.record_bytes
    model, tok = strata_mlx.load(tiny, arena_gb=5 * rb / 1024**3, prefill_step_size=8)
    ec = model.expert_cache
    layers = len(load_manifest(tiny).moe_layers)
    done = []  # handshakes that ran to the end
    run_layer = ec.run_layer

    def counted(*a, **kw):
        y = run_layer(*a, **kw)
        done.append(a[0])
        return y

    class Counting:  # the model, counting its forwards (a prefill chunk is one)
        def __init__(self):
            self.calls = 0

        def __call__(self, *a, **kw):
            self.calls += 1
            return model(*a, **kw)

        def __getattr__(self, name):
            return getattr(model, name)

    class LeavesAfterOneLayer(threading.Event):  # the client leaves once a layer has run
        def is_set(self):
            return len(done) >= 1

    ec.run_layer = counted
    try:
        engine = Engine(model, tok)
        engine.model = counting = Counting()
        long = Job(list(range(3, 63)), 4, SamplingOptions(), None, [])  # 59 positions: 8 chunks
        r = engine.run(long, None, LeavesAfterOneLayer())
        assert (r.completion_tokens, engine.cancelled, counting.calls) == (0, 1, 1)
        assert len(done) == 1 < layers  # the first chunk stopped at its second layer
        engine.model = model
        ec.run_layer = run_layer
        ids = chat_ids(tok, "the cat")
        after = engine.run(Job(ids, 6, SamplingOptions(), None, []))
        assert after.text == api(model, tok, "the cat", max_tokens=6)
    finally:
        model.expert_cache.close()


def test_serve_with_a_rotating_kv_cache_answers_as_the_api(tiny):
    """`serve --max-kv-size` (mlx-lm's flag): every request's cache is a RotatingKVCache of
    that size; the first answer is what the Python API gives with the same max_kv_size (which
    equals mlx-lm's, tests/generation/test_prompt_cache.py), and a conversation that goes on from it
    reuses its kept cache and answers as the API continuing that same cache does."""
    from strata_mlx.generation.prompt_cache import KVOptions, make_prompt_cache

    model, tok = load_tiny(tiny)
    kv = KVOptions(max_kv_size=16)
    app = create_app(model, tok, NAME, kv=kv)
    first = [{"role": "user", "content": "tell me about the quick brown fox"}]
    try:
        with running(app) as base:
            c = openai_client(base)
            got = c.chat.completions.create(model=NAME, messages=first, max_tokens=12,
                                            temperature=0)  # fmt: skip
            one = got.choices[0].message.content
            ids = tok.encode(tok.apply_chat_template(first), add_special_tokens=False)
            assert len(ids) + 12 > 16  # the cache rotated
            cache = make_prompt_cache(model, kv)
            ref = list(strata_mlx.stream_generate(model, tok, ids, max_tokens=12,
                                                  prompt_cache=cache))  # fmt: skip
            assert one == "".join(r.text for r in ref)
            more = [
                *first,
                {"role": "assistant", "content": one},
                {"role": "user", "content": "and?"},
            ]
            two = c.chat.completions.create(model=NAME, messages=more, max_tokens=8,
                                            temperature=0).choices[0].message.content  # fmt: skip
            s = stats(base)
            more_ids = tok.encode(tok.apply_chat_template(more), add_special_tokens=False)
            covered = ids + [r.token for r in ref][:-1]
            assert more_ids[: len(covered)] == covered
            cont = strata_mlx.stream_generate(model, tok, more_ids[len(covered) :], max_tokens=8,
                                              prompt_cache=cache, cached_tokens=covered)  # fmt: skip
            assert two == "".join(r.text for r in cont)
            c.close()
    finally:
        model.expert_cache.close()
    assert s["prompt_cache"]["hits"] == 1 and s["prompt_cache"]["reused_tokens"] == len(covered)


# ---- clients that leave, limits, the queue, authentication, CORS, shutdown ----------------


def stats(base: str) -> dict:
    with httpx.Client(trust_env=False, timeout=30) as http:
        return http.get(base + "/v1/stats", headers={"Authorization": f"Bearer {KEY}"}).json()[
            "server"
        ]


def wait_for(base: str, what, timeout: float = 30.0) -> tuple[dict, float]:
    """Poll the server's counters until `what(counters)`; (counters, seconds it took)."""
    t0 = time.monotonic()
    while True:
        s = stats(base)
        if what(s):
            return s, time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, s
        time.sleep(0.02)


def openai_client(base: str, timeout: float = 60, api_key: str = "none") -> openai.OpenAI:
    http = httpx.Client(trust_env=False, timeout=timeout)
    return openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, http_client=http)


def test_non_streaming_client_that_leaves_frees_the_server_within_a_second(served):
    base, _, _ = served
    before = stats(base)
    impatient = openai_client(base, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        chat(impatient, "tell me a story", max_tokens=LONG)
    assert time.monotonic() - t0 < 10
    s, freed_in = wait_for(base, lambda s: s["active"] == 0 and s["queued"] == 0)
    assert freed_in < 1.0, s
    assert s["cancelled"] == before["cancelled"] + 1
    assert 0 < s["completion_tokens"] - before["completion_tokens"] < LONG
    impatient.close()


def test_limits_and_out_of_range_fields_are_400s(served, client):
    base, _, _ = served
    too_long = client.completions  # the server's limit is 512 tokens
    with pytest.raises(openai.BadRequestError) as e:
        too_long.create(model=NAME, prompt=[1] * 513, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "the cat", max_tokens=LONG + 1)
    assert e.value.body["param"] == "max_tokens" and "limit" in e.value.body["message"]
    for seed in (-1, 1 << 64):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "the cat", seed=seed)
        assert e.value.body["param"] == "seed"
    with httpx.Client(trust_env=False, timeout=30) as http:
        url = base + "/v1/chat/completions"
        body = {"model": NAME, "messages": [{"role": "user", "content": "\ud800"}]}
        r = http.post(url, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        r = http.post(url, content=b"[" * 100_000, headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = http.put(url, json={})
        assert r.status_code == 405 and "error" in r.json()
        assert r.headers["allow"] == "POST"  # (HTTP requires it of a 405)
        # JSON sent as a form (curl's -d) or with no type: a 415 that says what to send
        for headers in ({"content-type": "application/x-www-form-urlencoded"}, {}):
            r = http.post(url, content=json.dumps(body), headers=headers)
            assert r.status_code == 415, r.text
            assert "Content-Type: application/json" in r.json()["error"]["message"]
        # ... on the routes that read JSON: elsewhere routing answers, as for any method
        r = http.post(base + "/v1/models", content=b"x")
        assert r.status_code == 405 and r.headers["allow"] == "GET", r.text
        assert http.post(base + "/v1/nowhere", content=b"x").status_code == 404
        # HEAD wherever GET answers: the headers alone
        got, head = http.get(base + "/v1/models"), http.head(base + "/v1/models")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == got.headers["content-length"]
    assert chat(client, "the cat", max_tokens=2).usage.completion_tokens >= 1


KEY = "sk-test-0123456789"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def guarded(tiny):
    """A second server (its own model: one generation at a time per model) with a queue of
    one behind one running request, an API key and one allowed origin; limits from the
    model's context."""
    model, tok = load_tiny(tiny)
    kw = dict(max_queue=1, api_key=KEY, allowed_origins=[ORIGIN], decode_concurrency=1)
    app = create_app(model, tok, NAME, **kw)
    try:
        with running(app) as base:
            yield base
    finally:
        model.expert_cache.close()


def test_queue_bound_answers_429_with_retry_after(guarded):
    base = guarded
    # 512 tokens: about two seconds of the tiny model, long enough to queue behind
    running_one = openai_client(base, timeout=3, api_key=KEY)
    queued_one = openai_client(base, timeout=3, api_key=KEY)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(chat, running_one, "tell me a story", max_tokens=512)
        wait_for(base, lambda s: s["active"] == 1)
        second = pool.submit(chat, queued_one, "the cat", max_tokens=512)
        wait_for(base, lambda s: s["queued"] == 1)
        c = openai_client(base, api_key=KEY)
        with pytest.raises(openai.RateLimitError) as e:
            chat(c, "a dog", max_tokens=2)
        r = e.value.response
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert e.value.body["code"] == "queue_full"
        for f in (first, second):  # done, or timed out and cancelled
            with contextlib.suppress(openai.APITimeoutError):
                f.result(timeout=60)
    s, _ = wait_for(base, lambda s: s["active"] == 0 and s["queued"] == 0)
    assert s["rejected"] >= 1
    assert chat(c, "a dog", max_tokens=2).usage.completion_tokens >= 1  # served again
    for x in (running_one, queued_one, c):
        x.close()


def test_api_key_is_required(guarded):
    base = guarded
    for key in ("none", KEY[:-1], KEY + "x"):
        c = openai_client(base, api_key=key)
        with pytest.raises(openai.AuthenticationError) as e:
            chat(c, "the cat", max_tokens=1)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
        c.close()
    with httpx.Client(trust_env=False, timeout=30) as http:
        r = http.get(base + "/v1/models")  # no Authorization header at all
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = http.get(base + "/v1/models", headers={"Authorization": f"Basic {KEY}"})
        assert r.status_code == 401
    c = openai_client(base, api_key=KEY)
    assert [m.id for m in c.models.list().data] == [NAME]
    assert chat(c, "the cat", max_tokens=2).usage.completion_tokens >= 1
    c.close()


def test_the_dashboard_behind_a_key_asks_a_browser_for_it(guarded):
    """A browser cannot send a bearer token to a page it opens: /dashboard answers 401 with
    a Basic challenge (the browser's login dialog), takes the key as the password, and its
    data is served the same way; the API itself still takes bearer tokens only."""
    base = guarded
    with httpx.Client(trust_env=False, timeout=30) as http:
        r = http.get(base + "/dashboard")
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == 'Basic realm="strata-mlx dashboard"'
        for wrong in (("u", KEY[:-1]), ("u", "none"), (KEY, "")):
            assert http.get(base + "/dashboard", auth=wrong).status_code == 401
        assert (
            http.get(base + "/dashboard", headers={"Authorization": "Basic %%%"}).status_code == 401
        )
        page = http.get(base + "/dashboard", auth=("anyone", KEY))
        assert page.status_code == 200 and "<html" in page.text.lower()
        data = http.get(base + "/dashboard/data", auth=("anyone", KEY))
        assert data.status_code == 200 and "stats" in data.json()
        assert (
            http.get(base + "/dashboard", headers={"Authorization": f"Bearer {KEY}"}).status_code
            == 200
        )
        assert http.get(base + "/v1/models", auth=("anyone", KEY)).status_code == 401


def test_cors_preflight_from_an_allowed_origin(guarded):
    base = guarded
    url = base + "/v1/chat/completions"
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    with httpx.Client(trust_env=False, timeout=30) as http:
        r = http.options(url, headers=preflight)  # a browser's preflight carries no key
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = http.options(url, headers={**preflight, "Origin": "https://evil.example"})
        # refused by the Host / Origin check (strata_mlx.apps.server.guard) before CORS
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        auth = {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
        r = http.post(url, json=body, headers=auth)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = http.post(url, json=body, headers={"Origin": ORIGIN})  # the browser can read the 401
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


SHORT = 64  # the context of the `short` servers' model


@pytest.fixture(scope="module")
def short(store, tmp_path_factory):
    """Servers on the tiny model with a context of SHORT tokens, a tokenizer that never ends
    a turn (every answer runs to its limit) and a prompt limit above the context: one with
    the KV cache that grows, one with a rotating cache of 32 tokens."""
    import copy

    from strata_mlx.generation.prompt_cache import KVOptions

    d = tmp_path_factory.mktemp("short") / "tiny"
    shutil.copytree(store(FAMILY), d)
    write_tokenizer(d)
    set_context(d, SHORT)
    model, tok = load_tiny(d)
    endless = copy.copy(tok)
    endless.eos_token_ids = set()
    kw = {"max_tokens_limit": LONG, "max_prompt_tokens": 4096}
    growing = create_app(model, endless, NAME, **kw)
    rotating = create_app(model, endless, NAME, kv=KVOptions(max_kv_size=32), **kw)
    try:
        with running(growing) as base, running(rotating) as rotating_base:
            yield base, rotating_base, endless
    finally:
        model.expert_cache.close()


def ask(base: str, path: str, content: str, max_tokens: int | None, stream: bool = False):
    """POST `content` as the one user message of `path`'s API, asking max_tokens (None: the
    request leaves it out); the response."""
    if path == "/v1/responses":
        body = {"model": NAME, "input": content, "max_output_tokens": max_tokens}
    else:
        body = {"model": NAME, "messages": [{"role": "user", "content": content}]}
        body["max_tokens"] = max_tokens
    body = {k: v for k, v in body.items() if v is not None}
    with httpx.Client(trust_env=False, timeout=60) as http:
        return http.post(base + path, json={**body, "temperature": 0, "stream": stream})


APIS = ["/v1/chat/completions", "/v1/messages", "/v1/responses"]


@pytest.mark.parametrize("path", APIS)
def test_a_prompt_past_the_context_is_a_400_before_any_prefill(short, path):
    """Refused in the API's own error shape, with a prompt limit above the context and with
    a rotating KV cache alike: the model reads no position past its context."""
    for base in short[:2]:
        before = stats(base)
        r = ask(base, path, "the cat sat on the mat " * 12, 1)  # 72 words and the template
        assert r.status_code == 400, r.text
        body = r.json()
        if path == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            message = body["error"]["message"]
        else:
            assert body["error"]["code"] == "context_length_exceeded"
            field = "input" if path == "/v1/responses" else "messages"  # the API's own name
            assert body["error"]["param"] == field
            message = body["error"]["message"]
            assert message.startswith(f"{field}: "), message
        assert f"more than the model's context of {SHORT} tokens" in message, message
        after = stats(base)
        assert after["prefilled_tokens"] == before["prefilled_tokens"]
        assert after["requests"] == before["requests"]
    with httpx.Client(trust_env=False, timeout=60) as http:  # token ids: /v1/completions
        r = http.post(short[0] + "/v1/completions", json={"prompt": [1] * (SHORT + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def _ended(path: str, body: dict) -> tuple[str, int, int]:
    """(how the answer ended, prompt tokens, answer tokens) of a non-streamed answer."""
    if path == "/v1/messages":
        usage = body["usage"]
        return body["stop_reason"], usage["input_tokens"], usage["output_tokens"]
    if path == "/v1/responses":
        usage = body["usage"]
        reason = body["incomplete_details"] and body["incomplete_details"]["reason"]
        return f"{body['status']}: {reason}", usage["input_tokens"], usage["output_tokens"]
    usage = body["usage"]
    return body["choices"][0]["finish_reason"], usage["prompt_tokens"], usage["completion_tokens"]


LENGTH = {
    "/v1/chat/completions": "length",
    "/v1/messages": "max_tokens",
    "/v1/responses": "incomplete: max_output_tokens",
}


@pytest.mark.parametrize("path", APIS)
def test_max_tokens_past_the_context_ends_at_the_context(short, path):
    """As llama.cpp's server: generation stops at the context's end, as at max_tokens, with
    prompt + answer = the context; a max_tokens that fits, or a rotating cache, is kept."""
    base, rotating, tok = short
    for max_tokens in (1000, None):  # None: the server's default (its --max-tokens)
        if max_tokens is None and path == "/v1/messages":
            continue  # Anthropic's max_tokens is required
        r = ask(base, path, "the cat sat on the mat", max_tokens)
        assert r.status_code == 200, r.text
        reason, prompt, answer = _ended(path, r.json())
        if max_tokens is None:  # the default, 256 (or less) with a prompt of 11: clamped too
            assert prompt + answer == SHORT, (prompt, answer)
            continue
        assert (reason, prompt + answer) == (LENGTH[path], SHORT), (reason, prompt, answer)
    r = ask(base, path, "the cat sat on the mat", 5)  # fits: as asked
    assert _ended(path, r.json())[0::2] == (LENGTH[path], 5)
    r = ask(rotating, path, "the cat sat on the mat", 80)  # past the context: rotating
    reason, prompt, answer = _ended(path, r.json())
    assert (reason, answer) == (LENGTH[path], 80) and prompt + answer > SHORT


def test_a_stream_past_the_context_ends_at_the_context(short):
    base, _, _ = short
    body = {"messages": [{"role": "user", "content": "the cat sat on the mat"}], "stream": True}
    body.update(max_tokens=1000, stream_options={"include_usage": True})
    with httpx.Client(trust_env=False, timeout=60) as http:
        r = http.post(base + "/v1/chat/completions", json=body)
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length"
    assert chunks[-1]["usage"]["total_tokens"] == SHORT
    r = ask(base, "/v1/messages", "the cat sat on the mat", 1000, stream=True)
    deltas = [json.loads(x[6:]) for x in r.text.splitlines() if '"message_delta"' in x]
    (delta,) = [d for d in deltas if d.get("type") == "message_delta"]
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["input_tokens"] + delta["usage"]["output_tokens"] == SHORT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_or_cancels_requests_within_the_deadline(tiny):
    deadline = 3.0
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "strata_mlx", "serve", "--model", str(tiny), "--port", str(port)]
    cmd += ["--model-name", NAME, "--shutdown-timeout", str(deadline), "--log-level", "warning"]
    cmd += ["--max-tokens-limit", str(LONG), "--arena-gb", "0.001"]
    env = {**os.environ, "STRATA_MLX_API_KEY": KEY}  # the key from the environment
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        wait_until_serving([proc], lambda: httpx.get(base + "/v1/models", headers=auth))
        short = openai_client(base, api_key=KEY)
        long = openai_client(base, api_key=KEY)
        stream = short.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "a dog ran"}],
            stream=True,
            max_tokens=48,
            temperature=0,
        )
        chunks = iter(stream)
        next(chunks)  # the short streaming request is running
        with ThreadPoolExecutor(1) as pool:
            cut_short = pool.submit(chat, long, "tell me a story", max_tokens=LONG)
            # the long one waits behind the short one (or, on a fast machine, already runs)
            wait_for(base, lambda s: s["queued"] == 1 or s["requests"] == 2)
            t_term = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finish[-1] in ("stop", "length")  # the request in flight finished
            with pytest.raises(openai.InternalServerError) as e:
                cut_short.result(timeout=60)  # ... the one that would not was cancelled
            assert e.value.status_code == 503 and e.value.body["code"] == "shutdown"
        proc.wait(timeout=60)
        took = time.monotonic() - t_term
        assert took < deadline + 5, took
        # uvicorn re-raises the signal once it has shut down gracefully
        assert proc.returncode in (0, -signal.SIGTERM), proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- tool calls and reasoning ---------------------------------------------------------------

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}{% for c in m['tool_calls'] or [] %}"
    "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# What a Qwen3 model says when it calls a tool, cut where the tags are split across tokens.
SAID = [
    "<thi",
    "nk>\nThe user wants",
    " the weather.\n</th",
    "ink>\n\n<tool_",
    'call>\n{"name": "get_weather", "argu',
    'ments": {"city": "Paris"}}\n</tool_call>',
]


@pytest.fixture(scope="module")
def tool_served(tiny, tmp_path_factory):
    """A server whose chat template renders tools and tool calls, one request at a time (the
    `says` fixture scripts the model through stream_generate, which that engine calls)."""
    d = tmp_path_factory.mktemp("tools") / "tiny"
    shutil.copytree(tiny, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TOOLS_TEMPLATE})
    )
    model, tok = load_tiny(d)
    try:
        with running(create_app(model, tok, NAME, decode_concurrency=1)) as base:
            yield base, tok
    finally:
        model.expert_cache.close()


@pytest.fixture
def says(monkeypatch):
    """The model says `pieces` (one generation step each); the prompts it got are recorded."""
    from types import SimpleNamespace

    prompts: list[list[int]] = []
    script: list[str] = []

    def stream_generate(model, tokenizer, ids, **kw):
        prompts.append(list(ids))
        for i, text in enumerate(script):
            last = i == len(script) - 1
            yield SimpleNamespace(
                text=text, finish_reason="stop" if last else None, expert_stats=None
            )

    # the module, not the package's generate function (strata_mlx.generate)
    monkeypatch.setattr(
        sys.modules["strata_mlx.generation.generate"], "stream_generate", stream_generate
    )

    def set_script(pieces: list[str]) -> list[list[int]]:
        script[:] = pieces
        return prompts

    return set_script


def test_tool_call_round_trip_through_the_openai_client(tool_served, says):
    base, tok = tool_served
    c = openai_client(base)
    user = {"role": "user", "content": "what is the weather in paris"}
    prompts = says(SAID)
    r = c.chat.completions.create(model=NAME, messages=[user], tools=TOOLS, max_tokens=64)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content is None and msg.reasoning_content == "The user wants the weather."
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id
    # the tools went through the template
    rendered = tok.apply_chat_template([user], tools=TOOLS)
    assert rendered.startswith("<|im_start|>system\nget_weather ")
    assert prompts[-1] == tok.encode(rendered, add_special_tokens=False)

    # streamed: deltas as OpenAI streams them, accumulated by the client's own types
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in c.chat.completions.create(
        model=NAME, messages=[user], tools=TOOLS, max_tokens=64, stream=True
    ):
        for ch in chunk.choices:
            d = ch.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                calls.setdefault(tc.index, {"name": "", "arguments": ""})
                calls[tc.index]["name"] += tc.function.name or ""
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert (reasoning, content, finish) == ("The user wants the weather.", "", "tool_calls")
    assert [(x["name"], json.loads(x["arguments"])) for x in calls.values()] == [
        ("get_weather", {"city": "Paris"})
    ]

    # the call and its answer go back to the model through the template
    says(["It is sunny in Paris."])
    history = [
        user,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    r = c.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=64)
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    expected = [
        user,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    **call.model_dump(),
                    # the client's keys in its order (tojson as transformers': json.dumps,
                    # keys not sorted), the arguments a mapping
                    "function": {**call.model_dump()["function"], "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": call.id},
    ]
    rendered = tok.apply_chat_template(expected, tools=TOOLS)
    assert '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}' in rendered
    assert prompts[-1] == tok.encode(rendered, add_special_tokens=False)

    # tool_choice "none": no tools in the prompt, the block stays text
    says(SAID)
    r = c.chat.completions.create(
        model=NAME, messages=[user], tools=TOOLS, tool_choice="none", max_tokens=64
    )
    assert "<tool_call>" in r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert prompts[-1] == tok.encode(tok.apply_chat_template([user]), add_special_tokens=False)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=[user], tools=TOOLS, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    c.close()


def test_serve_says_what_it_serves_and_names_the_model_as_given(tiny, tmp_path):
    """On start: the model, its arena and the URLs; / sends a browser to the dashboard; the
    model id is the name the user gave (a link named q3 serves "q3", not its target's name)."""
    link = tmp_path / "q3"
    link.symlink_to(Path(tiny).resolve(), target_is_directory=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "strata_mlx", "serve", "--model", "q3", "--port", str(port)]
    cmd += ["--log-level", "warning", "--arena-gb", "0.001"]
    env = {k: v for k, v in os.environ.items() if k != "STRATA_MLX_API_KEY"}
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lines: queue.Queue = queue.Queue()  # read on a thread: a server that says nothing
        threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
        out = ""
        while "dashboard:" not in out:
            out += lines.get(timeout=120)
        assert "serving 'q3'" in out and "arena" in out and "slots" in out, out
        assert f"{base}/v1" in out and f"{base}/dashboard" in out, out
        r = wait_until_serving(
            [proc],
            lambda: httpx.get(base + "/", follow_redirects=False),
            timeout=60,
            output=lambda: out,
        )
        assert r.status_code in (302, 307) and r.headers["location"] == "/dashboard"
        ids = [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]
        assert ids == ["q3"], ids
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_chat_template_kwargs_reach_the_template(served, monkeypatch):
    """enable_thinking=false and the like (mlx-lm's and vLLM's field) were dropped without a
    word; response_format "text" is what the server does anyway."""
    base, _, tok = served
    seen = []
    render = tok.apply_chat_template

    def recorded(messages, add_generation_prompt=True, **kwargs):
        seen.append(kwargs)
        return render(messages, add_generation_prompt, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", recorded)
    body = {"model": NAME, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False},
            "response_format": {"type": "text"}}  # fmt: skip
    with httpx.Client(trust_env=False, timeout=30) as http:
        r = http.post(base + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert seen == [{"enable_thinking": False}]


def test_agents_requests_reach_the_template_as_they_mean_them(tiny, capfd, says):
    """What coding agents send: a "developer" message is the system prompt (OpenAI's newer
    name; the template knows "system"); a tool call's arguments nested past Python's recursion
    limit stay text (a 500 before); an Anthropic tool result with is_error says so in the text
    the model reads (the flag was dropped); tools a chat template does not render are said
    once on stderr (they are dropped, as mlx-lm's server drops them)."""
    model, tok = load_tiny(tiny)
    prompts = says(["the"])  # (the prompts the model is given, recorded)
    try:
        with (
            running(create_app(model, tok, NAME, decode_concurrency=1)) as base,
            httpx.Client(base_url=base, trust_env=False, timeout=60) as http,
        ):

            def prompt_tokens(messages, **kw) -> list[int]:
                body = {"model": NAME, "messages": messages, "max_tokens": 1, **kw}
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return prompts[-1]

            user = {"role": "user", "content": "the cat sat"}
            as_system = prompt_tokens([{"role": "system", "content": "a dog"}, user])
            assert prompt_tokens([{"role": "developer", "content": "a dog"}, user]) == as_system
            nested = "[" * 5000 + "]" * 5000
            call = {"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": nested}}  # fmt: skip
            history = [user, {"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1", "content": "ok"}]  # fmt: skip
            prompt_tokens(history)
            capfd.readouterr()
            tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            prompt_tokens([user], tools=tools)
            prompt_tokens([user], tools=tools)
            err = capfd.readouterr().err
            assert err.count("renders no tools: requests' tools do not reach the model") == 1

            def result_tokens(is_error: bool) -> int:
                block = {"type": "tool_result", "tool_use_id": "t1", "content": "no such file",
                         "is_error": is_error}  # fmt: skip
                use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
                body = {"model": NAME, "messages": [
                    {"role": "user", "content": "the cat"},
                    {"role": "assistant", "content": [use]},
                    {"role": "user", "content": [block]}]}  # fmt: skip
                r = http.post("/v1/messages/count_tokens", json=body)
                assert r.status_code == 200, r.text
                return r.json()["input_tokens"]

            assert result_tokens(True) > result_tokens(False)
    finally:
        model.expert_cache.close()


def test_count_tokens_counts_past_the_context(tiny, tmp_path):
    """Anthropic's count_tokens answers a prompt longer than the model's context with its
    count (a client asks in order to know; it was a 400), where /v1/messages refuses it."""
    d = tmp_path / "tiny"
    shutil.copytree(tiny, d)
    set_context(d, 16)
    model, tok = load_tiny(d)
    body = {"model": NAME, "max_tokens": 4,
            "messages": [{"role": "user", "content": "the cat sat on the mat " * 8}]}  # fmt: skip
    try:
        with (
            running(create_app(model, tok, NAME)) as base,
            httpx.Client(base_url=base, trust_env=False, timeout=60) as http,
        ):
            r = http.post("/v1/messages/count_tokens", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["input_tokens"] > 16
            r = http.post("/v1/messages", json=body)
            assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    finally:
        model.expert_cache.close()


def test_whitespace_before_a_tool_call_is_not_streamed_as_content(tool_served, says):
    """The model's whitespace before a tool call: the unstreamed message's content is null,
    and the stream sends no content either (it sent the spaces); whitespace that is all the
    model says comes through both ways alike, and text before a call keeps its whitespace."""
    base, _ = tool_served
    c = openai_client(base)
    user = {"role": "user", "content": "what is the weather in paris"}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    def both(pieces) -> tuple[str | None, str]:
        says(pieces)
        whole = c.chat.completions.create(model=NAME, messages=[user], tools=TOOLS)
        says(pieces)
        streamed = ""
        for chunk in c.chat.completions.create(
            model=NAME, messages=[user], tools=TOOLS, stream=True
        ):
            streamed += "".join(ch.delta.content or "" for ch in chunk.choices)
        return whole.choices[0].message.content, streamed

    assert both(["  ", " \n\n", call[:9], call[9:]]) == (None, "")
    assert both(["  ", " "]) == ("   ", "   ")
    assert both(["Sure ", " \n", call]) == ("Sure  \n", "Sure  \n")
