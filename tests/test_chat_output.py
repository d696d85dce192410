"""strata_mlx.chat_output: <think> reasoning and Qwen3 <tool_call> blocks split out of a chat
completion's text, at once and as it streams (split at every character: the same result)."""

from __future__ import annotations

import json

from strata_mlx.chat_output import ChatStream, opens_reasoning, parse

TEXT = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


def streamed(text: str, step: int, **kw):
    s = ChatStream(**kw)
    events = []
    for i in range(0, len(text), step):
        events += s.feed(text[i : i + step])
    events += s.close()
    content = "".join(v for k, v in events if k == "content")
    reasoning = "".join(v for k, v in events if k == "reasoning")
    calls = [(v.name, v.arguments) for k, v in events if k == "tool_call"]
    return content, reasoning, calls


def test_reasoning_content_and_tool_calls():
    out = parse(TEXT, tools=True)
    assert out.reasoning == "The user wants the weather."
    assert out.content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert len({c.id for c in out.tool_calls}) == 2
    d = out.tool_calls[0].as_dict(0)
    assert d["index"] == 0 and d["type"] == "function" and d["function"]["name"] == "get_weather"


def test_streaming_split_anywhere_equals_parse():
    whole = parse(TEXT, tools=True)
    for step in (1, 2, 3, 7, len(TEXT)):
        content, reasoning, calls = streamed(TEXT, step, tools=True)
        assert content == whole.content and reasoning == whole.reasoning, step
        assert calls == [(c.name, c.arguments) for c in whole.tool_calls], step


def test_what_is_not_a_tool_call_stays_content():
    # no tools offered: the block is text
    assert parse(TEXT.split("</think>\n\n")[1]).content.startswith("Let me look.\n<tool_call>")
    bad = 'a <tool_call>{"name": oops}</tool_call> b'
    assert parse(bad, tools=True).content == bad and not parse(bad, tools=True).tool_calls
    cut = 'a <tool_call>{"name": "f", "argu'  # max_tokens mid-call
    assert parse(cut, tools=True).content == cut
    for step in (1, 4):
        assert streamed(cut, step, tools=True)[0] == cut
    assert parse("a < b <thinking").content == "a < b <thinking"
    assert parse("plain text").reasoning is None


def test_prompt_that_opens_the_think_block():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    out = parse("\nhmm, Paris.\n</think>\n\nParis.", in_reasoning=True)
    assert (out.reasoning, out.content) == ("hmm, Paris.", "Paris.")
    assert streamed("\nhmm, Paris.\n</think>\n\nParis.", 1, in_reasoning=True)[:2] == (
        "Paris.",
        "hmm, Paris.",
    )
