"""Anthropic's Messages API (/v1/messages) through the official `anthropic` client against a
live server on 127.0.0.1: each answer, streamed or not, is the one /v1/chat/completions gives
the same request (system prompt, stop sequences, max_tokens, a tool call and its result),
with Anthropic's stop reasons, event sequence and error bodies."""

from __future__ import annotations

import json

import anthropic
import httpx2 as httpx
import openai
import pytest
import test_server
from test_server import KEY, NAME, SAID, TOOLS, load_tiny, openai_client, running

from strata_mlx.apps.server import create_app

# test_server's fixtures: the tiny store, a server on it, one with a tool template, a scripted model
tiny, served, tool_served, says = (
    test_server.tiny,
    test_server.served,
    test_server.tool_served,
    test_server.says,
)

SYSTEM = "tell me a story about a red fox"


def anthropic_client(base: str, api_key: str = "none") -> anthropic.Anthropic:
    http = httpx.Client(trust_env=False, timeout=60)  # localhost only, no proxies
    return anthropic.Anthropic(base_url=base, api_key=api_key, max_retries=0, http_client=http)


@pytest.fixture
def clients(served):
    base, _, _ = served
    a, o = anthropic_client(base), openai_client(base)
    yield a, o
    a.close()
    o.close()


# Greedy: the client no longer has sampling arguments, the API still takes them
GREEDY = {"temperature": 0}


def ask(a: anthropic.Anthropic, content: str, **kw):
    kw.setdefault("extra_body", GREEDY)
    kw.setdefault("max_tokens", 10)
    return a.messages.create(model=NAME, messages=[{"role": "user", "content": content}], **kw)


def ask_streamed(a: anthropic.Anthropic, content: str, **kw):
    """The streamed answer as the client accumulates it, and the event types in order."""
    kw.setdefault("extra_body", GREEDY)
    kw.setdefault("max_tokens", 10)
    messages = [{"role": "user", "content": content}]
    with a.messages.stream(model=NAME, messages=messages, **kw) as s:
        types = [e.type for e in s]
        return s.get_final_message(), types


def chat(o: openai.OpenAI, content: str, system: str | None = None, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 10)
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return o.chat.completions.create(model=NAME, messages=messages, **kw)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_is_the_chat_completion_of_the_same_request(clients):
    a, o = clients
    r = ask(a, "what is the capital of france", system=SYSTEM)
    c = chat(o, "what is the capital of france", system=SYSTEM)
    expected = c.choices[0].message.content
    assert expected and text_of(r) == expected
    assert r.type == "message" and r.role == "assistant" and r.model == NAME
    assert r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"]
    finish = c.choices[0].finish_reason
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
    assert r.stop_sequence is None
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    # the system prompt reached the model: without it the prompt is shorter
    assert ask(a, "what is the capital of france").usage.input_tokens < r.usage.input_tokens

    # a list of system blocks is the same prompt as one string
    blocks = [{"type": "text", "text": SYSTEM}]
    assert text_of(ask(a, "what is the capital of france", system=blocks)) == expected

    streamed, types = ask_streamed(a, "what is the capital of france", system=SYSTEM)
    assert text_of(streamed) == expected
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (
        r.stop_reason,
        r.usage.output_tokens,
    )
    assert streamed.usage.input_tokens == r.usage.input_tokens
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert types[1] == "content_block_start" and types[-3] == "content_block_stop"
    assert types[-2] == "message_delta" and "content_block_delta" in types
    # counted without generating: the prompt's length
    counted = a.messages.count_tokens(
        model=NAME,
        system=SYSTEM,
        messages=[{"role": "user", "content": "what is the capital of france"}],
    )
    assert counted.input_tokens == r.usage.input_tokens


def test_stop_sequences(clients):
    a, o = clients
    full = chat(o, "a dog ran", max_tokens=16).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full  # the tiny model's greedy output is long enough
    # one word, and a stop sequence spanning two tokens listed after one never said
    for stops in ([words[2]], ["zzz-never", f"{words[1]} {words[2]}"]):
        expected = chat(o, "a dog ran", max_tokens=16, stop=stops).choices[0].message.content
        assert expected == full[: full.find(stops[-1])]
        r = ask(a, "a dog ran", max_tokens=16, stop_sequences=stops)
        assert text_of(r) == expected
        assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stops[-1])
        s, _ = ask_streamed(a, "a dog ran", max_tokens=16, stop_sequences=stops)
        assert (text_of(s), s.stop_reason, s.stop_sequence) == (
            expected,
            "stop_sequence",
            stops[-1],
        )


def test_max_tokens(clients):
    a, o = clients
    c = chat(o, "the cat sat on the mat", max_tokens=2)
    assert c.choices[0].finish_reason == "length"  # the tiny model goes on past 2 tokens
    r = ask(a, "the cat sat on the mat", max_tokens=2)
    assert (text_of(r), r.stop_reason) == (c.choices[0].message.content, "max_tokens")
    assert r.usage.output_tokens == 2
    s, _ = ask_streamed(a, "the cat sat on the mat", max_tokens=2)
    assert (text_of(s), s.stop_reason, s.usage.output_tokens) == (text_of(r), "max_tokens", 2)


def test_models_list_names_the_model_for_anthropic_clients(clients):
    a, o = clients
    (m,) = a.models.list().data
    assert (m.id, m.type, m.display_name) == (NAME, "model", NAME)
    assert [m.id for m in o.models.list().data] == [NAME]


JSON = {"Content-Type": "application/json"}


def test_bad_requests_answer_anthropic_error_bodies(clients, served):
    a, _ = clients
    with pytest.raises(anthropic.NotFoundError) as e:
        a.messages.create(
            model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "claude-x" in e.value.body["error"]["message"]
    bad = [
        # a validation error of the body, as the client does not check it
        dict(max_tokens=4, messages=[]),
        dict(max_tokens=4, messages=[{"role": "user", "content": "hi"}], extra_body={"top_p": 2}),
        # what this server does not do
        dict(
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
                    ],
                }
            ],
        ),
        dict(
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any"},
        ),
        # what the chat request made of it refuses (it was a 500)
        dict(
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"name": "", "input_schema": {"type": "object"}}],
        ),
    ]
    for kw in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(model=NAME, **kw)
        assert e.value.body["type"] == "error", kw
        err = e.value.body["error"]
        assert err["type"] == "invalid_request_error" and len(err["message"].splitlines()) == 1
    base, _, _ = served
    with httpx.Client(trust_env=False, timeout=30) as http:  # max_tokens is required
        r = http.post(base + "/v1/messages", json={"model": NAME, "messages": []})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in r.json()["error"]["message"]
        # a lone surrogate (the client cannot send one); count_tokens templates the same
        lone = dict(max_tokens=4, messages=[{"role": "user", "content": "\udc00"}])
        for path, body in [("", lone), ("/count_tokens", lone), ("/count_tokens", bad[-1])]:
            data = json.dumps({"model": NAME, **body})  # (ASCII: the surrogate escaped)
            r = http.post(f"{base}/v1/messages{path}", content=data, headers=JSON)
            assert r.status_code == 400 and r.json()["type"] == "error", (path, r.text)
        # refused before the route runs (the guards: a body not sent as JSON, one nested
        # past the parser's depth): Anthropic's body too, as on its routes' own errors
        for path in ("", "/count_tokens"):
            r = http.post(f"{base}/v1/messages{path}", content=b"{}", headers={
                "content-type": "text/plain"})  # fmt: skip
            assert r.status_code == 415 and r.json()["type"] == "error", r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = http.post(base + "/v1/messages", content=b"[" * 100_000, headers=JSON)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        # a tool result's text block whose text is no string (it said text blocks were
        # not supported)
        block = {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": 5}]}  # fmt: skip
        body = {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}
        r = http.post(base + "/v1/messages", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "messages.0.content.0.content.0.text: a text block's text must be a string"
        )


def test_an_api_key_is_taken_as_anthropic_clients_send_it(tiny):
    model, tok = load_tiny(tiny)
    body = {"model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "the"}]}
    try:
        with running(create_app(model, tok, NAME, api_key=KEY)) as base:
            a = anthropic_client(base, api_key=KEY)
            assert ask(a, "the cat", max_tokens=1).usage.output_tokens == 1
            a.close()
            a = anthropic_client(base, api_key=KEY + "x")
            with pytest.raises(anthropic.AuthenticationError):
                ask(a, "the cat", max_tokens=1)
            a.close()
            # Anthropic's API key header, as its other clients (and Claude Code) send it
            with httpx.Client(trust_env=False, timeout=30) as http:
                for key, status in ((KEY, 200), (KEY + "x", 401)):
                    r = http.post(base + "/v1/messages", json=body, headers={"x-api-key": key})
                    assert r.status_code == status, key
    finally:
        model.expert_cache.close()


# ---- tool use ------------------------------------------------------------------------------

A_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


def test_tool_use_round_trip_prompts_as_chat_completions(tool_served, says):
    base, tok = tool_served
    a, o = anthropic_client(base), openai_client(base)
    user = {"role": "user", "content": "what is the weather in paris"}
    prompts = says(SAID)
    r = a.messages.create(model=NAME, messages=[user], tools=A_TOOLS, max_tokens=64)
    assert r.stop_reason == "tool_use"
    thinking, call = r.content
    assert thinking.type == "thinking" and thinking.thinking == "The user wants the weather."
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    assert call.input == {"city": "Paris"}
    # the tools reached the template as chat completions pass them
    o.chat.completions.create(model=NAME, messages=[user], tools=TOOLS, max_tokens=64)
    assert prompts[-2] == prompts[-1]

    # streamed: thinking_delta and input_json_delta, accumulated by the client
    with a.messages.stream(model=NAME, messages=[user], tools=A_TOOLS, max_tokens=64) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
        streamed = s.get_final_message()
    assert "input_json_delta" in deltas and "thinking_delta" in deltas
    assert streamed.stop_reason == "tool_use"
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in r.content
    ]

    # the call and its result go back through the template as chat completions' do
    says(["It is sunny in Paris."])
    history = [
        user,
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
        },
    ]
    r2 = a.messages.create(model=NAME, messages=history, tools=A_TOOLS, max_tokens=64)
    assert [b.type for b in r2.content] == ["text"] and r2.stop_reason == "end_turn"
    assert r2.content[0].text == "It is sunny in Paris."
    arguments = json.dumps(call.input)
    o.chat.completions.create(
        model=NAME,
        messages=[
            user,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ],
        tools=TOOLS,
        max_tokens=64,
    )
    assert prompts[-2] == prompts[-1] and len(prompts[-1]) > len(prompts[0])

    # tool_choice "none": no tools in the prompt, the block stays text
    says(SAID)
    r3 = a.messages.create(
        model=NAME, messages=[user], tools=A_TOOLS, tool_choice={"type": "none"}, max_tokens=64
    )
    assert r3.stop_reason == "end_turn" and "<tool_call>" in text_of(r3)
    assert prompts[-1] == tok.encode(tok.apply_chat_template([user]), add_special_tokens=False)
    a.close()
    o.close()


def test_a_failure_mid_stream_ends_it_with_an_error_event(tool_served, monkeypatch):
    import sys
    from types import SimpleNamespace

    def stream_generate(model, tokenizer, ids, **kw):
        yield SimpleNamespace(text="It is", finish_reason=None, expert_stats=None)
        raise RuntimeError("the store is corrupt")

    monkeypatch.setattr(
        sys.modules["strata_mlx.generation.generate"], "stream_generate", stream_generate
    )
    base, _ = tool_served
    body = {
        "model": NAME,
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.Client(trust_env=False, timeout=30) as http:
        r = http.post(base + "/v1/messages", json=body)
    events = [block.split("\n") for block in r.text.strip().split("\n\n")]
    names = [e[0].removeprefix("event: ") for e in events]
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert names[-1] == "error" and "message_stop" not in names
    error = json.loads(events[-1][1].removeprefix("data: "))
    assert error == {
        "type": "error",
        "error": {"type": "api_error", "message": "the store is corrupt"},
    }
