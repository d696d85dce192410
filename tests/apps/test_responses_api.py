"""OpenAI's Responses API (/v1/responses) through the official `openai` client's
`responses.create` against a live server on 127.0.0.1: each answer, streamed or not, is the
one /v1/chat/completions gives the same request (instructions, stop sequences,
max_output_tokens, a function call and its output), with the API's status, items and event
sequence."""

from __future__ import annotations

import json

import openai
import pytest
import test_server
from test_server import NAME, SAID, TOOLS, openai_client

# test_server's fixtures: the tiny store, a server on it, one with a tool template, a scripted model
tiny, served, tool_served, says = (
    test_server.tiny,
    test_server.served,
    test_server.tool_served,
    test_server.says,
)

INSTRUCTIONS = "tell me a story about a red fox"


@pytest.fixture
def client(served):
    base, _, _ = served
    c = openai_client(base)
    yield c
    c.close()


def respond(c: openai.OpenAI, input, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 10)
    return c.responses.create(model=NAME, input=input, **kw)


def respond_streamed(c: openai.OpenAI, input, **kw):
    """The events' types, the text of their output_text deltas, and the final response."""
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 10)
    events = list(c.responses.create(model=NAME, input=input, stream=True, **kw))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return [e.type for e in events], text, events[-1].response


def chat(c: openai.OpenAI, content: str, system: str | None = None, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 10)
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return c.chat.completions.create(model=NAME, messages=messages, **kw)


def test_a_response_is_the_chat_completion_of_the_same_request(client):
    q = "what is the capital of france"
    r = respond(client, q, instructions=INSTRUCTIONS)
    c = chat(client, q, system=INSTRUCTIONS)
    expected = c.choices[0].message.content
    assert expected and r.output_text == expected
    assert r.object == "response" and r.model == NAME and r.id.startswith("resp_")
    (item,) = r.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    finish = c.choices[0].finish_reason
    assert r.status == {"stop": "completed", "length": "incomplete"}[finish]
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # input as message items, the instructions as a developer message: the same prompt
    items = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": q}]},
    ]
    c2 = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "developer", "content": INSTRUCTIONS}, {"role": "user", "content": q}],
        temperature=0,
        max_tokens=10,
    )
    assert respond(client, items).output_text == c2.choices[0].message.content

    types, text, final = respond_streamed(client, q, instructions=INSTRUCTIONS)
    assert text == expected and final.output_text == expected
    assert (final.status, final.usage.output_tokens) == (r.status, r.usage.output_tokens)
    last = "response.completed" if r.status == "completed" else "response.incomplete"
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]


def test_stop_sequences(client):
    full = chat(client, "a dog ran", max_tokens=16).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full  # the tiny model's greedy output is long enough
    # `stop` is the chat path's extension (mlx-lm's field), not one of OpenAI's Responses
    for stop in (words[2], ["zzz-never", f"{words[1]} {words[2]}"]):
        c = chat(client, "a dog ran", max_tokens=16, stop=stop)
        expected = c.choices[0].message.content
        assert c.choices[0].finish_reason == "stop" and len(expected) < len(full)
        r = respond(client, "a dog ran", max_output_tokens=16, extra_body={"stop": stop})
        assert (r.output_text, r.status) == (expected, "completed")
        _, text, final = respond_streamed(
            client, "a dog ran", max_output_tokens=16, extra_body={"stop": stop}
        )
        assert (text, final.status) == (expected, "completed")
        # the client's own accumulation of the stream (it needs response.completed)
        with client.responses.stream(
            model=NAME,
            input="a dog ran",
            temperature=0,
            max_output_tokens=16,
            extra_body={"stop": stop},
        ) as s:
            assert s.get_final_response().output_text == expected


def test_max_output_tokens(client):
    c = chat(client, "the cat sat on the mat", max_tokens=2)
    assert c.choices[0].finish_reason == "length"  # the tiny model goes on past 2 tokens
    r = respond(client, "the cat sat on the mat", max_output_tokens=2)
    assert r.output_text == c.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2
    types, text, final = respond_streamed(client, "the cat sat on the mat", max_output_tokens=2)
    assert types[-1] == "response.incomplete" and final.status == "incomplete"
    assert text == r.output_text and final.incomplete_details.reason == "max_output_tokens"


def test_bad_requests_are_400s_naming_the_parameter(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-x", input="hi")
    bad = [
        (dict(previous_response_id="resp_123"), "previous_response_id"),
        (dict(tool_choice="required", tools=[R_TOOLS[0]]), "tool_choice"),
        (dict(tools=[{"type": "web_search"}]), "tools.0"),
        (dict(text={"format": {"type": "json_object"}}), "text.format"),
        (dict(temperature=3.0), "temperature"),
        # what the chat request made of it refuses, or a format that is no object (500s once)
        (dict(tools=[{"type": "function", "name": "f", "parameters": "x"}]), "tools"),
        (dict(tools=[{"type": "function", "name": ""}]), "tools"),
        (dict(text={"format": "json"}), "text.format"),
    ]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=NAME, input="hi", **kw)
        assert e.value.body["param"] == param, kw
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input=[])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:  # (it said "input.str: ... a string")
        client.responses.create(model=NAME, input=["hello"])
    assert e.value.body["message"] == "input: item 0 is a str, not an input item (an object)"
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y"}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input=image)
    assert e.value.body["param"] == "input.0.content.0"


# ---- function calls ------------------------------------------------------------------------

R_TOOLS = [
    {
        "type": "function",
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "parameters": t["function"]["parameters"],
    }
    for t in TOOLS
]


def test_function_call_round_trip_prompts_as_chat_completions(tool_served, says):
    base, tok = tool_served
    c = openai_client(base)
    user = {"role": "user", "content": "what is the weather in paris"}
    prompts = says(SAID)
    r = c.responses.create(model=NAME, input=[user], tools=R_TOOLS, max_output_tokens=64)
    assert r.status == "completed"
    reasoning, call = r.output
    assert reasoning.type == "reasoning"
    assert [p.text for p in reasoning.content] == ["The user wants the weather."]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments) == {"city": "Paris"}
    # the tools reached the template as chat completions pass them
    c.chat.completions.create(model=NAME, messages=[user], tools=TOOLS, max_tokens=64)
    assert prompts[-2] == prompts[-1]

    # streamed: the arguments as function_call_arguments events, the same items at the end
    events = list(
        c.responses.create(
            model=NAME, input=[user], tools=R_TOOLS, max_output_tokens=64, stream=True
        )
    )
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types
    assert "response.function_call_arguments.delta" in types
    assert types[-1] == "response.completed"
    final = events[-1].response

    def items(resp):
        return [o.model_dump(exclude={"id"}) for o in resp.output]

    assert items(final) == [
        {**o, "call_id": final.output[1].call_id} if o["type"] == "function_call" else o
        for o in items(r)
    ]

    # the call and its output go back through the template as chat completions' do
    says(["It is sunny in Paris."])
    history = [
        user,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    r2 = c.responses.create(model=NAME, input=history, tools=R_TOOLS, max_output_tokens=64)
    assert r2.output_text == "It is sunny in Paris." and r2.status == "completed"
    chat_history = [
        user,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    c.chat.completions.create(model=NAME, messages=chat_history, tools=TOOLS, max_tokens=64)
    assert prompts[-2] == prompts[-1] and len(prompts[-1]) > len(prompts[0])

    # tool_choice "none": no tools in the prompt, the block stays text
    says(SAID)
    r3 = c.responses.create(
        model=NAME, input=[user], tools=R_TOOLS, tool_choice="none", max_output_tokens=64
    )
    assert "<tool_call>" in r3.output_text
    assert prompts[-1] == tok.encode(tok.apply_chat_template([user]), add_special_tokens=False)
    c.close()


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
    c = openai_client(base)
    events = list(c.responses.create(model=NAME, input="hi", stream=True))
    types = [e.type for e in events]
    assert "response.output_text.delta" in types and "response.completed" not in types
    assert types[-2:] == ["error", "response.failed"]
    assert events[-2].message == "the store is corrupt"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message == "the store is corrupt"
    c.close()


def test_a_response_echoes_its_metadata_and_parallel_tool_calls_and_stores_nothing(client):
    """metadata and parallel_tool_calls come back as the request set them (they came back
    {} and true whatever it set), and store says false: nothing is kept here, whatever the
    request asked (a later previous_response_id is refused)."""
    for streamed in (False, True):
        kw = dict(metadata={"task": "t1"}, parallel_tool_calls=False, store=True)
        if streamed:
            *_, r = respond_streamed(client, "the cat", **kw)
        else:
            r = respond(client, "the cat", **kw)
        assert r.metadata == {"task": "t1"} and r.parallel_tool_calls is False
        assert r.store is False
    r = respond(client, "the cat")
    assert r.metadata == {} and r.parallel_tool_calls is True
