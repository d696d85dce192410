"""The server's request parser, fuzzed (hypothesis) against a live tiny-store server: garbled
bytes, random JSON, fields of the wrong type, huge numbers, unicode and missing fields, posted
to /v1/completions and /v1/chat/completions; bodies over the size limit or trickled in slow
pieces, to those and /v1/messages and /v1/responses. Every answer is a 200 for a valid request or a 4xx
whose body is an OpenAI-style error with a one-line message; never a 500, never a traceback;
the server keeps serving afterwards. Bounded to a few seconds per test."""

from __future__ import annotations

import collections
import json
import math
import time

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_server import NAME, load_tiny, running, tiny  # noqa: F401 (tiny: a fixture)

from strata_mlx.apps.server import create_app

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
BODY_LIMIT = 64 << 10  # the fuzzed server's --max-body-bytes
FUZZ = settings(
    max_examples=60,  # about 30 s in all on two shared cores; CI can raise it
    deadline=None,
    database=None,
    # The same examples each run: the check that the field strategies also generate answers
    # (test_still_serving_after_the_fuzz) counted 9 answers of 97 in one random draw.
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzzed(tiny):  # noqa: F811 (the fixture imported above)
    """A server whose valid requests finish within 3 tokens."""
    model, tok = load_tiny(tiny)
    app = create_app(
        model, tok, NAME, default_max_tokens=2, max_tokens_limit=3, max_body_bytes=BODY_LIMIT
    )
    try:
        with running(app) as base:
            with httpx.Client(base_url=base, trust_env=False, timeout=60) as http:
                yield http
    finally:
        model.expert_cache.close()


COUNTS: collections.Counter = collections.Counter()  # answers of the field tests, by status


def check_answer(r: httpx.Response, stream: bool = False) -> int:
    assert r.status_code != 500 and "Traceback" not in r.text, r.text
    if r.status_code == 200:
        if stream and r.headers["content-type"].startswith("text/event-stream"):
            events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]", r.text
            for e in events[:-1]:
                assert "error" not in json.loads(e), e
        else:
            assert r.json()["choices"], r.text
        return 200
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    error = r.json()["error"]
    message = error["message"]
    assert isinstance(message, str) and message and "\n" not in message, error
    assert error["type"].endswith("_error"), error
    return r.status_code


def post(http: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


# ---- strategies ----------------------------------------------------------------------------

HUGE = st.sampled_from([2**31, 2**63, 2**64, 2**66, -(2**63) - 1, 10**30, 1e308, -1e308])
NUMBERS = st.one_of(
    st.integers(-5, 5),
    st.integers(-(2**70), 2**70),
    HUGE,
    st.floats(allow_nan=True, allow_infinity=True),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=12))
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
WORDS = st.sampled_from(
    [
        "the",
        "cat",
        "sat",
        "paris",
        "france",
        "<|im_end|>",
        "",
        "\u00e9t\u00e9",
        "\U0001f600",
        "\ud800",
        "\x00",
    ]
)
PROMPT_TEXT = st.lists(WORDS, max_size=6).map(" ".join) | st.text(max_size=20)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "bot", ""])
CONTENT = st.one_of(
    PROMPT_TEXT,
    st.none(),
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", ""]), "text": PROMPT_TEXT | JSON}
        ),
        max_size=3,
    ),
    JSON,
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": ROLES, "content": CONTENT},
        optional={"name": st.text(max_size=5) | JSON, "tool_calls": JSON, "tool_call_id": JSON},
    ),
    JSON,
)


SAMPLING = {  # each field's valid values (by the server's ranges, or just outside them)
    "model": st.sampled_from([NAME, "other"]),
    "max_tokens": st.integers(0, 3) | HUGE,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(PROMPT_TEXT, max_size=3) | PROMPT_TEXT,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(1, 2),
    "top_k": st.integers(0, 200) | HUGE,
    "min_p": st.floats(0, 1),
    "xtc_probability": st.floats(0, 1),
    "xtc_threshold": st.floats(0, 0.5),
    "logit_bias": st.dictionaries(
        st.integers(-3, 200).map(str) | st.text(max_size=3), st.floats(-100, 100), max_size=3
    ),
    "repetition_penalty": st.floats(0, 3),
    "repetition_context_size": st.integers(1, 50) | HUGE,
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "presence_context_size": st.integers(1, 50),
}
COMPLETION = {
    "prompt": PROMPT_TEXT
    | st.lists(st.integers(-2, 130) | HUGE, max_size=5)
    | st.lists(PROMPT_TEXT, max_size=2),
    "echo": st.booleans(),
    "logprobs": st.none() | st.integers(0, 2),
    "suffix": st.none() | PROMPT_TEXT,
    **SAMPLING,
}
CHAT = {
    "messages": st.lists(MESSAGE, max_size=3),
    "max_completion_tokens": st.integers(0, 3),
    "logprobs": st.booleans(),
    "tools": st.lists(st.dictionaries(st.text(max_size=6), JSON, max_size=3), max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    **SAMPLING,
}
VALID_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": PROMPT_TEXT}),
    min_size=1,
    max_size=2,
)


@st.composite
def requests(draw, fields: dict, required: str, valid_required) -> dict:
    """A request of some of `fields` and the `required` one; then, half the time, one field
    (or an unknown one) given any JSON value at all, or the required one left out."""
    optional = {k: v for k, v in fields.items() if k != required}
    body = draw(
        st.fixed_dictionaries({required: valid_required | fields[required]}, optional=optional)
    )
    how = draw(st.sampled_from(["as is", "as is", "any value", "missing"]))
    if how == "any value":
        body[draw(st.sampled_from([*fields, "zz_unknown"]))] = draw(JSON)
    elif how == "missing":
        del body[required]
    return body


def dumps(obj) -> bytes:
    # allow_nan: NaN / Infinity are what a sloppy client sends; surrogates as \ud800 escapes
    return json.dumps(obj, allow_nan=True).encode()


# ---- the tests -----------------------------------------------------------------------------


@FUZZ
@given(
    path=st.sampled_from(ENDPOINTS),
    body=st.binary(max_size=64) | st.text(max_size=40).map(str.encode),
)
@example(path="/v1/completions", body=b"")
@example(path="/v1/completions", body=b"{")
@example(path="/v1/chat/completions", body=b"\xff\xfe")
@example(path="/v1/completions", body=b'{"prompt": "a", "max_tokens": 1e999}')
@example(path="/v1/completions", body=b'{"prompt": "a", "seed": 99999999999999999999999}')
@example(path="/v1/completions", body=b'{"prompt": "a", "temperature": NaN}')
@example(
    path="/v1/chat/completions", body=b'{"messages": [{"role": "user", "content": "\\ud800"}]}'
)
def test_garbled_bodies(fuzzed, path, body):
    check_answer(post(fuzzed, path, body))


@FUZZ
@given(path=st.sampled_from(ENDPOINTS), body=JSON)
def test_any_json_value(fuzzed, path, body):
    check_answer(post(fuzzed, path, dumps(body)))


@settings(FUZZ, max_examples=45)  # these generate: ~0.2 s each
@given(body=requests(COMPLETION, "prompt", PROMPT_TEXT))
@example(body={"prompt": [2**64]})
@example(body={"prompt": "the cat", "logit_bias": {"1": math.inf}})
@example(body={"prompt": "the cat", "max_tokens": 2**64})
@example(body={"prompt": [], "stream": True})
def test_completion_fields(fuzzed, body):
    r = post(fuzzed, "/v1/completions", dumps(body))
    COUNTS[check_answer(r, stream=body.get("stream") is True)] += 1


@settings(FUZZ, max_examples=45)
@given(body=requests(CHAT, "messages", VALID_MESSAGES))
@example(body={"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]})
@example(
    body={"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": 3}]}]}
)
@example(body={"messages": [{"role": "user", "content": "hi"}], "tools": [[]], "stream": True})
def test_chat_fields(fuzzed, body):
    r = post(fuzzed, "/v1/chat/completions", dumps(body))
    COUNTS[check_answer(r, stream=body.get("stream") is True)] += 1


@settings(FUZZ, max_examples=40)
@given(
    path=st.sampled_from(ENDPOINTS + ("/v1/messages", "/v1/responses")),
    size=st.one_of(
        st.integers(0, 2 * BODY_LIMIT), st.sampled_from([BODY_LIMIT, BODY_LIMIT + 1, 50 << 20])
    ),
    piece=st.sampled_from([None, 1, 7, 4096, 1 << 20]),
    pause=st.sampled_from([0.0, 0.001, 0.01]),
)
@example(path="/v1/completions", size=50 << 20, piece=None, pause=0.0)
def test_oversized_and_slow_bodies(fuzzed, path, size, piece, pause):
    """A body of `size` bytes (a prompt padded to it), sent whole with its length or in pieces
    of `piece` bytes without one, `pause` s apart (a slow client; the first 20 pieces, then the
    rest, to bound the time): past the limit a 413 with the error body, at once or as it arrives;
    within it the answer any body gets."""
    head = b'{"prompt": "the cat ' if "completions" in path else b'{"x": "'
    body = head + b"a" * max(0, size - len(head) - 2) + b'"}'

    def pieces():  # 20 slow pieces, then the rest at once (a byte a write takes minutes)
        for i in range(0, min(len(body), 20 * piece), piece):
            time.sleep(pause)
            yield body[i : i + piece]
        if len(body) > 20 * piece:
            yield body[20 * piece :]

    try:
        r = post(fuzzed, path, body if piece is None else pieces())
    except httpx.WriteError:  # refused by its length while still sending: the server closed
        assert len(body) > BODY_LIMIT
        return
    if len(body) > BODY_LIMIT:
        assert r.status_code == 413, r.text
        assert "--max-body-bytes" in r.json()["error"]["message"]
    elif path in ENDPOINTS:
        check_answer(r)
    else:
        assert r.status_code < 500, r.text


def test_still_serving_after_the_fuzz(fuzzed):
    """...and the field tests did generate: the strategies are not all refusals."""
    still_serving(fuzzed)
    if COUNTS:
        assert COUNTS[200] >= 10 and sum(COUNTS.values()) - COUNTS[200] >= 10, COUNTS
    assert fuzzed.get("/v1/models").status_code == 200
