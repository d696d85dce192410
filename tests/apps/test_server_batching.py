"""The server with requests decoding together (--decode-concurrency > 1), through the official
`openai` client on loopback: concurrent requests, streamed or not, greedy or seeded, get what
they get alone and from the one-at-a-time server; a client that leaves stops its request only;
the flags' bad values are one line."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest
from test_server import (  # noqa: F401  (tiny: the module's fixture)
    LONG,
    NAME,
    chat,
    load_tiny,
    running,
    stream_chat,
    tiny,
    wait_for,
)

from strata_mlx.apps.server import create_app

PROMPTS = ["the cat sat", "a dog ran in the park", "paris is a city", "tell me a story"]
# (prompt, streamed, sampling): more requests than the batch has rows, so some wait and join
# while others decode
JOBS = [
    (PROMPTS[i % 4], i % 3 == 0, {"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i})
    for i in range(7)
]


def client_of(base: str, timeout: float = 120) -> openai.OpenAI:
    http = httpx.Client(trust_env=False, timeout=timeout)
    return openai.OpenAI(
        base_url=base + "/v1", api_key="none", max_retries=0, timeout=timeout, http_client=http
    )


def one(c, job) -> str:
    p, streamed, sampling = job
    if streamed:
        return stream_chat(c, p, max_tokens=10, **sampling)[0]
    return chat(c, p, max_tokens=10, **sampling).choices[0].message.content


@pytest.fixture(scope="module")
def model(tiny):  # noqa: F811
    model, tok = load_tiny(tiny)  # 5 slots for 16 experts: requests stream and evict
    yield model, tok
    model.expert_cache.close()


def test_concurrent_requests_get_what_they_get_alone(model):
    model, tok = model
    app = create_app(model, tok, NAME, max_queue=16, decode_concurrency=1)
    with running(app) as base:  # one at a time: today's server
        c = client_of(base)
        alone = [one(c, job) for job in JOBS]
        c.close()
    app = create_app(model, tok, NAME, max_queue=16, decode_concurrency=4)
    engine = app.state.engine
    with running(app) as base:
        c = client_of(base)
        with ThreadPoolExecutor(len(JOBS)) as pool:
            together = list(pool.map(lambda job: one(c, job), JOBS, timeout=120))
        c.close()
    assert together == alone and all(alone)
    gen = engine.batch
    assert gen.rows > gen.steps  # steps held several requests
    assert engine.requests == len(JOBS) and engine.active == 0


def test_a_client_that_leaves_stops_only_its_request(model):
    model, tok = model
    app = create_app(model, tok, NAME, max_tokens_limit=LONG, decode_concurrency=3)
    with running(app) as base:
        c = client_of(base)
        alone = [chat(c, p, max_tokens=12).choices[0].message.content for p in PROMPTS[:2]]
        started = threading.Event()

        def leaver():
            stream = c.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": "tell me a story"}],
                stream=True,
                max_tokens=LONG,
                temperature=0,
            )
            for n, _ in enumerate(stream):
                if n == 2:
                    started.set()
                    stream.close()  # the client leaves mid-stream
                    return

        with ThreadPoolExecutor(3) as pool:
            left = pool.submit(leaver)
            assert started.wait(60)
            others = list(pool.map(lambda p: stream_chat(c, p, max_tokens=12)[0], PROMPTS[:2]))
            left.result(timeout=60)
        assert others == alone
        s, _ = wait_for(base, lambda s: s["active"] == 0 and s["queued"] == 0)
        assert s["cancelled"] == 1 and s["completion_tokens"] < LONG
        assert chat(c, PROMPTS[0], max_tokens=12).choices[0].message.content == alone[0]
        c.close()


@pytest.mark.parametrize("flag", ["--decode-concurrency", "--prompt-concurrency"])
def test_bad_concurrency_flag_is_one_line(flag):
    r = subprocess.run(
        [sys.executable, "-m", "strata_mlx", "serve", flag, "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert flag in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_shutdown_stops_the_batch_and_waiting_requests(model):
    model, tok = model
    app = create_app(
        model, tok, NAME, max_tokens_limit=LONG, decode_concurrency=2, shutdown_timeout=5
    )
    engine = app.state.engine
    with running(app) as base:
        c = client_of(base, timeout=60)
        pool = ThreadPoolExecutor(3)
        # two decode together, the third waits for a place
        futures = [pool.submit(chat, c, p, max_tokens=LONG) for p in PROMPTS[:3]]
        wait_for(base, lambda s: s["active"] == 2 and s["queued"] == 1)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 30  # uvicorn's grace, then the engine's drain
    assert engine._idle.is_set() and engine.active == 0 and engine.queued == 0
    for f in futures:  # cut or answered, never left hanging
        with contextlib.suppress(openai.APIError, httpx.HTTPError):
            f.result(timeout=30)
    pool.shutdown()
    c.close()


def test_the_queue_bound_counts_the_batch(model):
    """--decode-concurrency 2 and --max-queue 1: two decode, one waits, the next is a 429."""
    model, tok = model
    app = create_app(model, tok, NAME, max_queue=1, max_tokens_limit=LONG, decode_concurrency=2)
    with running(app) as base:
        slow = client_of(base, timeout=3)  # cut after 3 s: their jobs are cancelled then
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(chat, slow, "tell me a story", max_tokens=LONG) for _ in range(3)
            ]
            wait_for(base, lambda s: s["active"] == 2 and s["queued"] == 1)
            c = client_of(base)
            with pytest.raises(openai.RateLimitError) as e:
                chat(c, "a dog", max_tokens=2)
            assert e.value.body["code"] == "queue_full"
            for f in futures:
                with contextlib.suppress(openai.APITimeoutError):
                    f.result(timeout=60)
        wait_for(base, lambda s: s["active"] == 0 and s["queued"] == 0)
        assert chat(c, "a dog", max_tokens=2).usage.completion_tokens >= 1  # served again
        slow.close()
        c.close()


def test_serve_says_whether_a_step_fits_the_arena(model, tiny, monkeypatch):  # noqa: F811
    from strata_mlx.apps.server.app import started_lines

    model, _ = model  # 5 slots; 2 MoE layers of 8 experts, top-2
    lines = started_lines(NAME, tiny, model, "127.0.0.1", 8080, decode_concurrency=2)
    assert "up to 2 requests decode together: a step uses up to 8 experts" in lines[2]
    assert "lower --decode-concurrency" in lines[2]
    assert len(started_lines(NAME, tiny, model, "127.0.0.1", 8080)) == 3  # one at a time
    # a request's step alone needs more than the slots (4 against 3): fewer requests cannot
    # help, and the line does not say they would
    monkeypatch.setattr(model.expert_cache.arena, "n_slots", 3)
    line = started_lines(NAME, tiny, model, "127.0.0.1", 8080, decode_concurrency=2)[2]
    assert line.endswith("(more than the arena's slots, as one request's step alone)")


def test_the_api_and_the_cli_default_to_the_same_concurrency():
    """create_app, serve() and `strata-mlx serve` decode (and prefill) as many requests
    together by default: the defaults come from one place."""
    import inspect

    from strata_mlx.apps.cli import serve as cli
    from strata_mlx.apps.server import app
    from strata_mlx.config import DEFAULT_DECODE_CONCURRENCY

    def defaults(name):
        flag = inspect.signature(cli.serve).parameters[name].default.default
        api = inspect.signature(app.create_app).parameters[name].default
        served = inspect.signature(app.serve).parameters[name].default
        return flag, api, served

    flag, api, served = defaults("prompt_concurrency")
    assert api == served == flag, (api, served, flag)
    # serve's default (None) is DEFAULT_DECODE_CONCURRENCY, lowered where it does not fit
    flag, api, served = defaults("decode_concurrency")
    assert flag is None and served is None and api == DEFAULT_DECODE_CONCURRENCY
