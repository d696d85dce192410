"""strata_mlx.generation.chat_output: <think> reasoning and Qwen3 <tool_call> blocks split out of a chat
completion's text, at once and as it streams (split at every character: the same result)."""

from __future__ import annotations

import json

from strata_mlx.generation.chat_output import ChatStream, opens_reasoning, parse

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


# ---- other families' tool-call formats ------------------------------------------------------

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]  # fmt: skip

# (format, what the model writes between its tool-call tags, mlx-lm's parser of the same body)
OTHER_FORMATS = [
    ("glm", "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n", "glm47"),
    ("mistral", ' [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', "mistral"),
    ("mistral", 'get_weather[ARGS]{"city": "Paris", "days": 3}', "mistral"),
    ("kimi", '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
             '{"city": "Paris", "days": 3}<|tool_call_end|>', "kimi_k2"),
]  # fmt: skip


def test_other_formats_parse_as_mlx_lm_parses_them():
    """The body of each family's block, parsed by mlx-lm's own tool parser and by ours (then
    through the whole stream, split at every character): the same names and arguments."""
    import importlib

    import pytest

    from strata_mlx.generation.chat_output import FORMATS

    pytest.importorskip("mlx_lm.tool_parsers")
    for name, body, theirs_name in OTHER_FORMATS:
        theirs = importlib.import_module(f"mlx_lm.tool_parsers.{theirs_name}")
        expected = theirs.parse_tool_call(body, WEATHER)
        expected = expected if isinstance(expected, list) else [expected]
        fmt = FORMATS[name]
        text = "Sure.\n" + fmt.open + body + (fmt.close or "")
        for step in (1, 3, len(text)):
            content, _, calls = streamed(text, step, tools=fmt)
            assert content == "Sure.\n", (name, step)
            got = [(n, json.loads(a)) for n, a in calls]
            assert got == [(c["name"], c["arguments"]) for c in expected], (name, step)


def test_deepseek_tool_calls_v3_and_v31():
    from strata_mlx.generation.chat_output import FORMATS

    fmt = FORMATS["deepseek"]
    v3 = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n"
          "```<｜tool▁call▁end｜>")  # fmt: skip
    v31 = '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "CET"}<｜tool▁call▁end｜>'
    text = "Let me see." + fmt.open + v3 + v31 + fmt.close
    for step in (1, 5, len(text)):
        content, _, calls = streamed(text, step, tools=fmt)
        assert content == "Let me see."
        assert [(n, json.loads(a)) for n, a in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]  # fmt: skip
    broken = "x" + fmt.open + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\nnot json" + fmt.close
    out = parse(broken, tools=fmt)
    assert out.tool_calls == [] and out.content == broken


def test_tool_format_is_picked_from_the_chat_template():
    from strata_mlx.generation.chat_output import tool_format

    assert tool_format(None).name == "qwen3"
    assert tool_format("{{ '<tool_call>' }}{{ tool_call.name }}<arg_key>").name == "glm"
    assert tool_format("{{'<｜tool▁calls▁begin｜>'}}").name == "deepseek"
    assert tool_format("<|tool_calls_section_begin|>").name == "kimi"
    assert tool_format("[TOOL_CALLS]").name == "mistral"
    out = parse("[TOOL_CALLS] not json", tools=tool_format("[TOOL_CALLS]"))
    assert out.tool_calls == [] and out.content == "[TOOL_CALLS] not json"


def test_a_close_tag_inside_an_argument_string_does_not_end_the_call():
    """Code an agent asks the model to write may hold "</tool_call>" in an argument: inside
    a JSON string it ends no call (the whole call came back as text), streamed in pieces or
    not; a malformed call before a good one still stays text, the good one a call."""
    text = ('<tool_call>\n{"name": "write", "arguments": {"code": "print(\\"</tool_call>\\")"}}'
            "\n</tool_call> after")  # fmt: skip
    want = '{"code": "print(\\"</tool_call>\\")"}'
    out = parse(text, tools=True)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("write", want)]
    assert out.content == " after"
    stream = ChatStream(True)
    events = [e for k in range(0, len(text), 3) for e in stream.feed(text[k : k + 3])]
    events += stream.close()
    calls = [v for k, v in events if k == "tool_call"]
    assert [(c.name, c.arguments) for c in calls] == [("write", want)]
    assert "".join(v for k, v in events if k == "content") == " after"
    out = parse('<tool_call>oops</tool_call> t <tool_call>{"name": "f", "arguments": {}}'
                "</tool_call>", tools=True)  # fmt: skip
    assert out.content == "<tool_call>oops</tool_call> t " and out.tool_calls[0].name == "f"
    # a broken call whose string never ends: a later call still counts (its open tag ends
    # the broken one at its first close), and the text after it is the text, streamed too
    broken = '<tool_call>{"name": "a", "arguments": {"x": "open}}</tool_call>'
    for tail, content, calls in (
        (' t <tool_call>{"name": "b", "arguments": {}}</tool_call>', broken + " t ", ["b"]),
        (" t", broken + " t", []),
    ):
        out = parse(broken + tail, tools=True)
        assert out.content == content
        assert [c.name for c in out.tool_calls] == calls
        stream = ChatStream(True)
        text = broken + tail
        events = [e for k in range(0, len(text), 4) for e in stream.feed(text[k : k + 4])]
        events += stream.close()
        assert "".join(v for k, v in events if k == "content") == out.content
