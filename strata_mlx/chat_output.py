"""A chat completion's text as OpenAI's clients expect it: `<think>...</think>` reasoning split
into `reasoning_content`, Qwen3's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks parsed into `tool_calls`, the rest `content`; all at once (`parse`) or as the text
streams (`ChatStream`, which holds back only what may still begin a tag).

A block that is not valid JSON, or one cut off by max_tokens, stays in the content as the
model wrote it: nothing the model said is dropped. This module knows nothing of models or HTTP.
"""

from __future__ import annotations

import json
import uuid
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
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", {})
    return ToolCall(call["name"], args if isinstance(args, str) else json.dumps(args))


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
    `<think>` block itself (as some templates' generation prompts do)."""

    def __init__(self, tools: bool = False, in_reasoning: bool = False):
        self.tools = tools
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
                tags = [THINK_OPEN] + ([TOOL_OPEN] if self.tools else [])
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
                i = self.pending.find(TOOL_CLOSE)
                if i < 0:
                    break
                body = self.pending[:i]
                self.pending = self.pending[i + len(TOOL_CLOSE) :]
                self.mode, self.trim = "content", True
                call = _tool_call(body.strip())
                if call is None:
                    out.append(("content", TOOL_OPEN + body + TOOL_CLOSE))
                else:
                    self.tool_calls.append(call)
                    out.append(("tool_call", call))
        return out

    def close(self) -> list[tuple[str, object]]:
        """The end of the text: what was held back."""
        out: list[tuple[str, object]] = []
        if self.mode == "tool":  # cut off mid-call: the model's words, as written
            out.append(("content", TOOL_OPEN + self.pending))
        elif self.pending:
            self._emit(out, self.mode, self.pending)
        self.pending = ""
        return out


@dataclass
class ChatOutput:
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]


def parse(text: str, tools: bool = False, in_reasoning: bool = False) -> ChatOutput:
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
