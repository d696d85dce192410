"""A chat completion's text as OpenAI's clients expect it: `<think>...</think>` reasoning split
into `reasoning_content`, the model's tool-call blocks parsed into `tool_calls`, the rest
`content`; all at once (`parse`) or as the text streams (`ChatStream`, which holds back only
what may still begin a tag).

Tool-call formats (`FORMATS`, picked from the chat template by `tool_format`): Qwen3 / Hermes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; GLM-4.5 `<tool_call>NAME
<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`; Mistral `[TOOL_CALLS] [{...}]`
to the end of the text; DeepSeek-V3 `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
```json ARGS ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (and V3.1's `NAME<｜tool▁sep｜>ARGS`);
Kimi-K2 `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
<|tool_call_argument_begin|>ARGS<|tool_call_end|>...<|tool_calls_section_end|>`.

A block that is not valid JSON, or one cut off by max_tokens, stays in the content as the
model wrote it: nothing the model said is dropped. This module knows nothing of models or HTTP.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_dict(self, index: int | None = None) -> dict:
        d = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return d if index is None else {"index": index, **d}


def _tool_call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _json_call(call)


def _json_call(call) -> ToolCall | None:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return ToolCall(call["name"], args if isinstance(args, str) else json.dumps(args))


def _json_args(text: str) -> str | None:
    """Arguments as JSON text, if `text` is a JSON object."""
    try:
        args = json.loads(text)
    except json.JSONDecodeError:
        return None
    return json.dumps(args) if isinstance(args, dict) else None


def _qwen3(body: str) -> list[ToolCall] | None:
    call = _tool_call(body.strip())
    return None if call is None else [call]


def _glm(body: str) -> list[ToolCall] | None:
    name, _, rest = body.strip().partition("<arg_key>")
    name = name.strip()
    if not name or "\n" in name or "{" in name:
        return None
    args = {}
    rest = "<arg_key>" + rest if rest else ""
    while rest.strip():
        m = re.match(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", rest, re.S)
        if m is None:
            return None
        key, value = m.group(1).strip(), m.group(2)
        try:  # the template writes non-strings as JSON, strings as they are
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
        rest = rest[m.end() :]
    return [ToolCall(name, json.dumps(args))]


def _mistral(body: str) -> list[ToolCall] | None:
    try:
        calls = json.loads(body.strip())
    except json.JSONDecodeError:
        return _mistral_headers(body)
    calls = calls if isinstance(calls, list) else [calls]
    out = [_json_call(c) for c in calls]
    return None if not out or None in out else out


def _mistral_headers(body: str) -> list[ToolCall] | None:
    """Newer Mistral templates: `NAME[ARGS]{...}`, repeated."""
    decoder, out, pos = json.JSONDecoder(), [], 0
    while body[pos:].strip():
        m = re.compile(r"\s*([\w-]+)\s*\[ARGS\]\s*").match(body, pos)
        if m is None:
            return None
        try:
            args, pos = decoder.raw_decode(body, m.end())
        except json.JSONDecodeError:
            return None
        if not isinstance(args, dict):
            return None
        out.append(ToolCall(m.group(1), json.dumps(args)))
    return out or None


def _sections(body: str, begin: str, end: str, one) -> list[ToolCall] | None:
    parts = body.split(begin)
    if parts[0].strip():
        return None
    out = []
    for part in parts[1:]:
        inner, sep, tail = part.partition(end)
        call = one(inner) if sep and not tail.strip() else None
        if call is None:
            return None
        out.append(call)
    return out or None


def _deepseek_one(inner: str) -> ToolCall | None:
    kind, sep, rest = inner.partition("<｜tool▁sep｜>")
    if not sep:
        return None
    if kind.strip() == "function":  # V3: NAME, then the arguments in a json fence
        name, _, args = rest.partition("\n")
        args = args.strip().removeprefix("```json").removesuffix("```")
    else:  # V3.1: NAME<｜tool▁sep｜>ARGS
        name, args = kind, rest
    args = _json_args(args.strip())
    return ToolCall(name.strip(), args) if args is not None and name.strip() else None


def _deepseek(body: str) -> list[ToolCall] | None:
    return _sections(body, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", _deepseek_one)


def _kimi_one(inner: str) -> ToolCall | None:
    head, sep, args = inner.partition("<|tool_call_argument_begin|>")
    m = re.fullmatch(r"\s*(?:functions\.)?([^\s:]+)(?::\d+)?\s*", head)
    args = _json_args(args.strip()) if sep else None
    return ToolCall(m.group(1), args) if m and args is not None else None


def _kimi(body: str) -> list[ToolCall] | None:
    return _sections(body, "<|tool_call_begin|>", "<|tool_call_end|>", _kimi_one)


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call block: its tags and the parser of what lies between them
    (None: not a tool call, it stays content). `close` None: the block runs to the end."""

    name: str
    open: str
    close: str | None
    parse: Callable[[str], list[ToolCall] | None]


FORMATS = {
    "qwen3": ToolFormat("qwen3", TOOL_OPEN, TOOL_CLOSE, _qwen3),
    "glm": ToolFormat("glm", TOOL_OPEN, TOOL_CLOSE, _glm),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", None, _mistral),
    "deepseek": ToolFormat("deepseek", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _deepseek),
    "kimi": ToolFormat("kimi", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", _kimi),
}


def tool_format(chat_template: str | None) -> ToolFormat:
    """The tool-call format a chat template renders (and so the model writes): the first
    format whose marks it contains; Qwen3's (Hermes') otherwise."""
    t = chat_template or ""
    for mark, name in (
        ("<arg_key>", "glm"),
        ("<｜tool▁calls▁begin｜>", "deepseek"),
        ("<|tool_calls_section_begin|>", "kimi"),
        ("[TOOL_CALLS]", "mistral"),
    ):
        if mark in t:
            return FORMATS[name]
    return FORMATS["qwen3"]


def _in_string(text: str) -> bool:
    """Whether JSON text ends inside a string literal (an odd count of unescaped quotes)."""
    inside = escaped = False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = inside
        elif c == '"':
            inside = not inside
    return inside


def _holdback(text: str, tags: list[str]) -> int:
    """Length of the longest end of `text` that begins one of `tags`."""
    for n in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


class ChatStream:
    """Feed the completion's text as it comes; each call returns the events it completes:
    ("reasoning", str), ("content", str), ("tool_call", ToolCall). `tools`: parse tool-call
    blocks (only when the request offered tools); `in_reasoning`: the prompt opened a
    `<think>` block itself (as some templates' generation prompts do). `tools` True is
    Qwen3's format; a ToolFormat names another."""

    def __init__(self, tools: bool | ToolFormat = False, in_reasoning: bool = False):
        self.tools = tools
        self.fmt = tools if isinstance(tools, ToolFormat) else FORMATS["qwen3"]
        self.mode = "reasoning" if in_reasoning else "content"
        self.pending = ""
        self.trim = in_reasoning  # the newline after a tag is the template's, not text
        self.tool_calls: list[ToolCall] = []

    def _emit(self, out: list, kind: str, text: str) -> None:
        if self.trim:
            text = text.lstrip("\n")
            self.trim = not text
        if text:
            out.append((kind, text))

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.pending += text
        out: list[tuple[str, object]] = []
        while self.pending:
            if self.mode == "content":
                tags = [THINK_OPEN] + ([self.fmt.open] if self.tools else [])
                hits = [(i, t) for t in tags if (i := self.pending.find(t)) >= 0]
                if not hits:
                    keep = _holdback(self.pending, tags)
                    self._emit(out, "content", self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                i, tag = min(hits)
                self._emit(out, "content", self.pending[:i])
                self.pending = self.pending[i + len(tag) :]
                self.mode = "reasoning" if tag == THINK_OPEN else "tool"
                self.trim = True
            elif self.mode == "reasoning":
                i = self.pending.find(THINK_CLOSE)
                if i < 0:
                    keep = _holdback(self.pending, [THINK_CLOSE])
                    body = self.pending[: len(self.pending) - keep]
                    keep += len(body) - len(body.rstrip("\n"))  # may precede the close
                    self._emit(out, "reasoning", self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                self._emit(out, "reasoning", self.pending[:i].rstrip("\n"))
                self.pending = self.pending[i + len(THINK_CLOSE) :]
                self.mode, self.trim = "content", True
            else:  # inside a tool call: wait for its end
                close = self.fmt.close
                i = self.pending.find(close) if close else -1
                i = self._skip_quoted(i, close)
                if i < 0:
                    break
                body = self.pending[:i]
                self.pending = self.pending[i + len(close) :]
                self.mode, self.trim = "content", True
                self._calls(out, body, close)
        return out

    def _skip_quoted(self, i: int, close: str) -> int:
        """The close that ends the call begun in `pending`, from the first at `i`: one inside
        a JSON string is an argument's text (code that writes the tag), so the next is taken,
        unless a new call opens before it (the JSON was broken: the first close ends it,
        as `close` does for a call still open at the end); -1: wait for more."""
        first = i
        while i >= 0 and self.fmt.name == "qwen3" and _in_string(self.pending[:i]):
            after = i + len(close)
            j = self.pending.find(close, after)
            opened = self.pending.find(self.fmt.open, after)
            if opened >= 0 and (j < 0 or opened < j):
                return first
            i = j
        return i

    def _calls(self, out: list, body: str, close: str) -> None:
        calls = self.fmt.parse(body)
        if calls is None:
            out.append(("content", self.fmt.open + body + close))
            return
        for call in calls:
            self.tool_calls.append(call)
            out.append(("tool_call", call))

    def close(self) -> list[tuple[str, object]]:
        """The end of the text: what was held back."""
        out: list[tuple[str, object]] = []
        if self.mode == "tool" and self.fmt.close is None:  # a block that runs to the end
            self._calls(out, self.pending, "")
        elif self.mode == "tool" and self.fmt.close in self.pending:  # a close taken for an
            # argument's text and none after it: the first ends the call after all
            i = self.pending.find(self.fmt.close)
            body, rest = self.pending[:i], self.pending[i + len(self.fmt.close) :]
            self.pending, self.mode, self.trim = "", "content", True
            self._calls(out, body, self.fmt.close)
            return out + self.feed(rest) + self.close()
        elif self.mode == "tool":  # cut off mid-call: the model's words, as written
            out.append(("content", self.fmt.open + self.pending))
        elif self.pending:
            self._emit(out, self.mode, self.pending)
        self.pending = ""
        return out


@dataclass
class ChatOutput:
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]


def parse(text: str, tools: bool | ToolFormat = False, in_reasoning: bool = False) -> ChatOutput:
    s = ChatStream(tools, in_reasoning)
    events = s.feed(text) + s.close()
    content = "".join(v for k, v in events if k == "content")
    reasoning = "".join(v for k, v in events if k == "reasoning")
    calls = [v for k, v in events if k == "tool_call"]
    if calls and not content.strip():
        content = None  # OpenAI: a message of tool calls alone has no content
    return ChatOutput(content, reasoning or None, calls)


def opens_reasoning(prompt: str) -> bool:
    """The generation prompt ends inside a `<think>` block the template opened."""
    return prompt.rstrip().endswith(THINK_OPEN)
