"""Anthropic's Messages API on the server: POST /v1/messages, streamed (SSE) or not, and
POST /v1/messages/count_tokens.

The request (system prompt, messages of text / tool_use / tool_result blocks, tools,
tool_choice "auto" or "none", stop_sequences, max_tokens, temperature, top_p, top_k) is
translated into the chat-completions request it means and run by strata_mlx.apps.chat_turn,
through the server's one engine: the same queue, cancellation, chat template, sampling and
tool-call parsing as /v1/chat/completions, so both answer the same request alike. The answer
comes back as Anthropic's message: the model's `<think>` reasoning as a thinking block (with
an empty signature: nothing here signs it), its text as text blocks, its tool calls as
tool_use blocks; stop_reason end_turn, max_tokens, stop_sequence (with the string) or
tool_use. Streamed, the events are Anthropic's: message_start, then per block
content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) /
content_block_stop, then message_delta with the stop reason and usage, and message_stop.

Errors are Anthropic's body {"type": "error", "error": {"type", "message"}} with the status
the chat path gives the same fault. This module owns the translation both ways; it never
runs generation itself nor keeps state between requests.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..generation.chat_output import ToolCall
from . import chat_turn
from .server.engine import Result
from .server.guard import end_stream_with
from .server.routes import chat_prompt, serve_state, shutdown_error
from .server.schemas import APIError, ChatCompletionRequest, chat_request

# ---- request models ------------------------------------------------------------------------


class _Strict(BaseModel):
    # as the chat path's: no coercion; fields this server does not use (metadata,
    # cache_control, thinking, ...) are ignored, since they do not change the output
    model_config = ConfigDict(strict=True, extra="ignore")


class Block(_Strict):
    """A content block of a message: text, tool_use (an assistant's), tool_result (a
    user's), thinking (an assistant's, dropped: templates do not take it back) or a kind this
    server refuses (image, document)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict] | None = None
    is_error: bool = False


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class SystemBlock(_Strict):
    type: Literal["text"]
    text: str


class Tool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict | None = None  # absent from Anthropic's server tools (refused)
    type: str | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(_Strict):
    model: str
    max_tokens: int = Field(ge=0)  # 0 (as Anthropic's API allows): an empty answer
    messages: list[Message] = Field(min_length=1)
    system: str | list[SystemBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(1, ge=0)  # not sent: counting generates nothing


# ---- the request as chat completions take it -----------------------------------------------

# Text blocks of one turn are paragraphs of it (Claude Code sends reminders and the prompt as
# separate blocks): joined by a blank line, never glued word to word.
JOIN = "\n\n"


def _unsupported(what: str, param: str) -> APIError:
    return APIError(f"{param}: {what} not supported by this server", param=param)


def _result_text(b: Block, param: str) -> str:
    if b.content is None or isinstance(b.content, str):
        return b.content or ""
    parts = []
    for k, part in enumerate(b.content):
        where = f"{param}.content.{k}"
        if part.get("type") != "text":
            raise _unsupported(f"{part.get('type')!r} blocks are", where)
        if not isinstance(part.get("text"), str):
            raise APIError(f"{where}.text: a text block's text must be a string", param=where)
        parts.append(part["text"])
    return JOIN.join(parts)


def _messages(req: MessagesRequest) -> list[dict]:
    out: list[dict] = []
    if req.system:
        system = req.system
        if not isinstance(system, str):
            system = JOIN.join(b.text for b in system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(i, m.content))
        else:
            out += _user(i, m.content)
    return out


def _assistant(i: int, blocks: list[Block]) -> dict:
    text: list[str] = []
    calls: list[dict] = []
    for j, b in enumerate(blocks):
        param = f"messages.{i}.content.{j}"
        if b.type == "text" and b.text is not None:
            text.append(b.text)
        elif b.type in ("thinking", "redacted_thinking"):
            continue
        elif b.type == "tool_use":
            if b.id is None or b.name is None:
                raise APIError(f"{param}: a tool_use block needs an id and a name", param=param)
            arguments = json.dumps(b.input or {}, ensure_ascii=False)
            fn = {"name": b.name, "arguments": arguments}
            calls.append({"id": b.id, "type": "function", "function": fn})
        else:
            raise _unsupported(f"{b.type!r} blocks in assistant messages are", param)
    msg: dict = {"role": "assistant", "content": JOIN.join(text)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(i: int, blocks: list[Block]) -> list[dict]:
    """A user's turn: its text, and each tool result as a tool message, in their order."""
    out: list[dict] = []
    text: list[str] = []
    for j, b in enumerate(blocks):
        param = f"messages.{i}.content.{j}"
        if b.type == "text" and b.text is not None:
            text.append(b.text)
        elif b.type == "tool_result":
            if b.tool_use_id is None:
                raise APIError(f"{param}: a tool_result block needs tool_use_id", param=param)
            if text:
                out.append({"role": "user", "content": JOIN.join(text)})
                text = []
            content = _result_text(b, param)
            if b.is_error:  # (a tool message has no such flag: the model reads it in the text)
                content = f"Error: {content}"
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        else:
            raise _unsupported(f"{b.type!r} blocks in user messages are", param)
    if text or not out:
        out.append({"role": "user", "content": JOIN.join(text)})
    return out


def _tools(req: MessagesRequest) -> list[dict] | None:
    if not req.tools:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if t.input_schema is None or t.type not in (None, "custom"):
            raise _unsupported(f"the tool {t.name!r} ({t.type}): server tools are", f"tools.{i}")
        fn = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        tools.append({"type": "function", "function": fn})
    return tools


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat-completions request that asks the same of the model."""
    choice = req.tool_choice.type if req.tool_choice is not None else None
    if choice in ("any", "tool"):
        raise APIError(
            f"tool_choice: {choice!r} not supported by this server (only 'auto' and 'none')",
            param="tool_choice",
            code="unsupported",
        )
    body = {
        "model": req.model,
        "messages": _messages(req),
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": req.stop_sequences,
        "tools": _tools(req),
        "tool_choice": choice,
    }
    if req.top_k is not None:
        body["top_k"] = req.top_k
    return chat_request(body, {"stop": "stop_sequences"})


# ---- the answer as Anthropic's ---------------------------------------------------------------


def _input(call: ToolCall) -> dict:
    """A call's arguments as tool_use's input (an object); arguments that are not a JSON
    object (a model that wrote a string) are kept whole under "arguments"."""
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"arguments": call.arguments}


def _block(kind: str, value, streamed: bool) -> dict:
    """A block as it starts: empty when streamed (its deltas follow), whole otherwise."""
    if kind == "text":
        return {"type": "text", "text": ""}
    if kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {
        "type": "tool_use",
        "id": value.id,
        "name": value.name,
        "input": {} if streamed else _input(value),
    }


def stop_reason(r: Result, tool_calls: list[ToolCall]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished turn."""
    if tool_calls:
        return "tool_use", None
    if r.finish_reason == "length":
        return "max_tokens", None
    if r.stop_sequence is not None:
        return "stop_sequence", r.stop_sequence
    return "end_turn", None


def _message(state, content: list[dict]) -> dict:
    return {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": state.model_name,
        "content": content,
    }


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def messages(req: MessagesRequest, request: Request):
    state = serve_state(request)
    chat = to_chat(req)
    if not req.stream:
        ops, calls, r = await chat_turn.complete(state, request, chat)
        content: list[dict] = []
        for op, kind, value in ops:
            if op == "start":
                content.append(_block(kind, value, streamed=False))
            elif op == "delta":
                content[-1]["text" if kind == "text" else "thinking"] += value
        reason, sequence = stop_reason(r, calls)
        return JSONResponse(
            {
                **_message(state, content),
                "stop_reason": reason,
                "stop_sequence": sequence,
                "usage": {"input_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens},
            }
        )

    turn = await chat_turn.stream(state, request, chat)  # admitted here: a full queue is a 429
    end_stream_with(request, lambda: _event("error", shutdown_error().anthropic_body()))

    async def events() -> AsyncIterator[bytes]:
        start = _message(state, [])
        start.update(stop_reason=None, stop_sequence=None)
        start["usage"] = {"input_tokens": turn.prompt_tokens, "output_tokens": 0}
        yield _event("message_start", {"type": "message_start", "message": start})
        index = -1
        async for op, kind, value in turn.ops:
            if op == "start":
                index += 1
                block = _block(kind, value, streamed=True)
                yield _event(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": block},
                )
                if kind == "tool_call":
                    partial = json.dumps(_input(value), ensure_ascii=False)
                    delta = {"type": "input_json_delta", "partial_json": partial}
                    yield _event(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": delta},
                    )
            elif op == "delta":
                delta = (
                    {"type": "text_delta", "text": value}
                    if kind == "text"
                    else {"type": "thinking_delta", "thinking": value}
                )
                yield _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
            elif op == "stop":
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            elif op == "done":
                reason, sequence = stop_reason(value, turn.blocks.tool_calls)
                yield _event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": {
                            "input_tokens": value.prompt_tokens,
                            "output_tokens": value.completion_tokens,
                        },
                    },
                )
                yield _event("message_stop", {"type": "message_stop"})
            else:
                yield _event("error", value.anthropic_body())

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def count_tokens(req: CountTokensRequest, request: Request):
    """The prompt's length in tokens, as /v1/messages would template it (past the model's
    context too: a client asks in order to know)."""
    ids, _, _ = await asyncio.to_thread(chat_prompt, serve_state(request), to_chat(req))
    return {"input_tokens": len(ids)}


# ---- routes --------------------------------------------------------------------------------


def add_routes(app: FastAPI) -> None:
    """POST /v1/messages and /v1/messages/count_tokens on `app` (strata_mlx.apps.server's,
    whose error handlers answer these paths in Anthropic's body: APIError.response)."""
    app.post("/v1/messages")(messages)
    app.post("/v1/messages/count_tokens")(count_tokens)
