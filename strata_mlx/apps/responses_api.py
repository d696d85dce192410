"""OpenAI's Responses API on the server: POST /v1/responses, streamed (SSE) or not.

The request (`input` as a string or as items: messages, function_call and
function_call_output; `instructions`; function tools, tool_choice "auto" or "none";
max_output_tokens, temperature, top_p, and the chat path's extensions stop, seed, top_k,
min_p) is translated into the chat-completions request it means and run by
strata_mlx.apps.chat_turn, through the server's one engine: the same queue, cancellation, chat
template, sampling and tool-call parsing as /v1/chat/completions, so both answer the same
request alike. The answer is a response object whose output items are the model's `<think>`
reasoning (a reasoning item with reasoning_text), its text (a message item with output_text)
and its tool calls (function_call items); status "completed", or "incomplete" with
incomplete_details.reason "max_output_tokens" when the tokens ran out. Streamed, the events are
the API's: response.created, response.in_progress, then per item output_item.added,
content_part.added, output_text.delta / reasoning_text.delta / function_call_arguments.delta
and their .done events, output_item.done, and last response.completed (or
response.incomplete; a failure mid-way: an error event, then response.failed), each with its
sequence_number.

Errors are the chat path's OpenAI error bodies. This server keeps no responses:
previous_response_id is refused (send the conversation as input, as with store false). This
module owns the translation both ways; it never runs generation itself nor keeps state
between requests.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import MAX_SEED
from ..generation.chat_output import ToolCall
from . import chat_turn
from .server.engine import Result, ServeState
from .server.guard import end_stream_with
from .server.routes import serve_state, shutdown_error
from .server.schemas import APIError, ChatCompletionRequest, chat_request

# ---- request model -------------------------------------------------------------------------


class ResponsesRequest(BaseModel):
    # as the chat path's: no coercion; fields that do not change the output (store, user,
    # reasoning, ...) are ignored; metadata and parallel_tool_calls come back as given
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    previous_response_id: str | None = None
    text: dict | None = None
    # the chat path's extensions (mlx-lm's server's fields), not OpenAI's
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    top_k: int = 0
    min_p: float = 0.0
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None  # (null: the default, true)

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v):
        """A list holds input items, objects (a string in it read "input.str: Input should be
        a valid string")."""
        if isinstance(v, list) and not all(isinstance(x, dict) for x in v):
            i = next(i for i, x in enumerate(v) if not isinstance(x, dict))
            raise ValueError(f"item {i} is a {type(v[i]).__name__}, not an input item (an object)")
        return v


# ---- the request as chat completions take it -----------------------------------------------


def _unsupported(what: str, param: str) -> APIError:
    return APIError(
        f"{param}: {what} not supported by this server", param=param, code="unsupported"
    )


def _text(content, param: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{param}: expected a string or a list of parts", param=param)
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise _unsupported(f"{kind!r} parts are", f"{param}.{k}")
        parts.append(part["text"])
    return "".join(parts)


def _field(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{param}.{key}: expected a string", param=f"{param}.{key}")
    return value


def _messages(req: ResponsesRequest) -> list[dict]:
    out: list[dict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        param = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{param}.role: {role!r} is not a message role", param=param)
            out.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _field(item, "name", param),
                    "arguments": _field(item, "arguments", param),
                },
            }
            # the calls that follow a model's message are that message's
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = _text(output, f"{param}.output")
            call_id = _field(item, "call_id", param)
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            continue  # templates do not take earlier reasoning back
        else:
            raise _unsupported(f"{kind!r} items are", param)
    return out


def _tools(req: ResponsesRequest) -> list[dict] | None:
    if not req.tools:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise _unsupported(f"{t.get('type')!r} tools are", f"tools.{i}")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    return tools


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat-completions request that asks the same of the model."""
    if req.previous_response_id is not None:
        raise APIError(
            "previous_response_id: this server keeps no responses; send the whole "
            "conversation as input",
            param="previous_response_id",
            code="unsupported",
        )
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise APIError(
            f'text.format: expected an object such as {{"type": "text"}}, got {fmt!r}',
            param="text.format",
        )
    if fmt.get("type") != "text":
        raise _unsupported(f"the output format {fmt.get('type')!r} is", "text.format")
    if req.tool_choice not in (None, "auto", "none"):
        raise APIError(
            f"tool_choice: {req.tool_choice!r} not supported by this server (only 'auto' and "
            "'none')",
            param="tool_choice",
            code="unsupported",
        )
    body = {
        "model": req.model,
        "messages": _messages(req),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": req.stop,
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "tools": _tools(req),
        "tool_choice": req.tool_choice,
    }
    return chat_request(body, {"messages": "input", "max_tokens": "max_output_tokens"})


# ---- the answer as a response object -------------------------------------------------------


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class _Output:
    """A turn's blocks (strata_mlx.apps.chat_turn ops) as output items, and the stream events that
    build them; the items are the same whether or not the events are sent."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.sequence = 0

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return e

    def _at(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def feed(self, op: str, kind: str, value) -> list[dict]:
        if op == "start":
            return self._start(kind, value)
        if op == "delta":
            return self._delta(kind, value)
        return self._stop(kind)

    def _start(self, kind: str, value) -> list[dict]:
        item = _new_item(kind, value)
        self.items.append(item)
        added = copy.deepcopy(item)  # as it was when added: empty
        out = [
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)
        ]
        if kind == "tool_call":  # parsed whole: its arguments in one delta
            item["arguments"] = value.arguments
            delta = self.event(
                "response.function_call_arguments.delta", **self._at(), delta=value.arguments
            )
            return out + [delta]
        part = _TEXT_PART[kind]()
        item["content"].append(part)
        added = self.event(
            "response.content_part.added", **self._at(), content_index=0, part=dict(part)
        )
        return out + [added]

    def _delta(self, kind: str, text: str) -> list[dict]:
        self.items[-1]["content"][0]["text"] += text
        extra = {} if kind == "reasoning" else {"logprobs": []}
        what = _TEXT_PART[kind]()["type"]
        at = {**self._at(), "content_index": 0}
        return [self.event(f"response.{what}.delta", **at, delta=text, **extra)]

    def _stop(self, kind: str) -> list[dict]:
        item = self.items[-1]
        item["status"] = "completed"
        if kind == "tool_call":
            args = item["arguments"]
            out = [
                self.event("response.function_call_arguments.done", **self._at(), arguments=args)
            ]
        else:
            part = item["content"][0]
            extra = {} if kind == "reasoning" else {"logprobs": []}
            at = {**self._at(), "content_index": 0}
            out = [
                self.event(f"response.{part['type']}.done", **at, text=part["text"], **extra),
                self.event("response.content_part.done", **at, part=dict(part)),
            ]
        done = self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)
        return out + [done]


# the part a reasoning item and a message hold their text in
_TEXT_PART = {
    "reasoning": lambda: {"type": "reasoning_text", "text": ""},
    "text": lambda: {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
}


def _new_item(kind: str, value) -> dict:
    """An output item as it starts (in progress, empty) for a block of `kind`."""
    if kind == "tool_call":
        return {
            "id": _id("fc_"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": value.id,
            "name": value.name,
            "arguments": "",
        }
    if kind == "reasoning":
        return {
            "id": _id("rs_"),
            "type": "reasoning",
            "status": "in_progress",
            "summary": [],
            "content": [],
        }
    return {
        "id": _id("msg_"),
        "type": "message",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }


def status(r: Result, tool_calls: list[ToolCall]) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finished turn: tool calls, or text to its end, are
    complete; text cut off by max_output_tokens is not."""
    if r.finish_reason == "length" and not tool_calls:
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _usage(r: Result) -> dict:
    return {
        "input_tokens": r.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": r.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }


def _response(state: ServeState, req: ResponsesRequest, rid: str, created: int) -> dict:
    """The response object with what the request set, before any output."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "model": state.model_name,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "text": {"format": {"type": "text"}},
        "metadata": req.metadata or {},
        "store": False,  # (nothing is kept: previous_response_id is refused)
        "usage": None,
    }


def _finished(response: dict, output: _Output, r: Result, tool_calls: list[ToolCall]) -> dict:
    state_, incomplete = status(r, tool_calls)
    return {
        **response,
        "status": state_,
        "incomplete_details": incomplete,
        "output": output.items,
        "usage": _usage(r),
    }


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


# The chat request's fields that a chat job's errors name, as this API names them.
CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}


def _renamed(e: APIError) -> APIError:
    """A chat job's error with its parameter in this API's names (the whole field only: an
    index into the chat messages need not be the input item's)."""
    name = CHAT_NAMES.get(e.param or "")
    if name is None:
        return e
    message = name + e.message[len(e.param) :] if e.message.startswith(e.param) else e.message
    return APIError(message, e.status, name, e.code, e.type, e.headers)


async def responses(req: ResponsesRequest, request: Request):
    state = serve_state(request)
    chat = to_chat(req)
    response = _response(state, req, _id("resp_"), int(time.time()))
    output = _Output()
    try:
        if not req.stream:
            ops, calls, r = await chat_turn.complete(state, request, chat)
        else:  # admitted here: a full queue is a 429
            turn = await chat_turn.stream(state, request, chat)
    except APIError as e:
        raise _renamed(e) from None
    if not req.stream:
        for op in ops:
            output.feed(*op)
        return JSONResponse(_finished(response, output, r, calls))

    def cut() -> bytes:  # shutdown cut the stream: an error event, then response.failed
        e = shutdown_error()
        error = {"code": e.code, "message": e.message}
        failed = {**response, "status": "failed", "error": error, "output": output.items}
        return _sse(output.event("error", code=e.code, message=e.message, param=None)) + _sse(
            output.event("response.failed", response=failed)
        )

    end_stream_with(request, cut)

    async def events() -> AsyncIterator[bytes]:
        yield _sse(output.event("response.created", response=response))
        yield _sse(output.event("response.in_progress", response=response))
        async for op, kind, value in turn.ops:
            if op == "done":
                done = _finished(response, output, value, turn.blocks.tool_calls)
                name = (
                    "response.completed" if done["status"] == "completed" else "response.incomplete"
                )
                yield _sse(output.event(name, response=done))
            elif op == "error":
                yield _sse(
                    output.event("error", code=value.code, message=value.message, param=value.param)
                )
                error = {"code": value.code or value.type, "message": value.message}
                failed = {**response, "status": "failed", "error": error, "output": output.items}
                yield _sse(output.event("response.failed", response=failed))
            else:
                for e in output.feed(op, kind, value):
                    yield _sse(e)

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def add_routes(app: FastAPI) -> None:
    """POST /v1/responses on `app` (strata_mlx.apps.server.create_app's)."""
    app.post("/v1/responses")(responses)
