"""One chat turn through the server's engine, for the APIs other than chat completions
(strata_mlx.apps.anthropic_api, strata_mlx.apps.responses_api).

Each of them translates its request into a ChatCompletionRequest; this module runs that as
/v1/chat/completions does (the chat template, the engine's queue, cancellation and sampling,
the model's tool-call and reasoning parser, strata_mlx.generation.chat_output) and hands the output back
as blocks in the order the model wrote them: reasoning, text, tool calls. `complete` gives
them all at once, `stream` as they come; both go through the same `Blocks`, so a streamed
answer adds up to the one not streamed. This module formats no API's objects and never goes
past the engine into generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from ..generation.chat_output import ChatStream, ToolCall
from .server.engine import Result, ServeState
from .server.routes import chat_job
from .server.schemas import APIError, ChatCompletionRequest, generation_error

# ("start" | "delta" | "stop", block kind, value): a block opens, grows, closes. Kinds:
# "reasoning" and "text" (deltas carry text) and "tool_call" (start and stop carry the
# ToolCall, no deltas: a call is parsed whole).
Op = tuple[str, str, object]


class Blocks:
    """The parsed text's events ("reasoning" / "content" / "tool_call", from ChatStream) as
    blocks: consecutive reasoning is one block, consecutive content one text block, each tool
    call one block of its own.

    Content that is only whitespace waits: text after it opens a text block with it, and it
    is dropped before a block of another kind or at the end of a turn that called a tool (as
    chat completions answer no content for a message of tool calls alone)."""

    def __init__(self) -> None:
        self.open: str | None = None
        self.pending = ""
        self.tool_calls: list[ToolCall] = []

    def _close(self, out: list[Op]) -> None:
        if self.open is not None:
            out.append(("stop", self.open, None))
            self.open = None

    def feed(self, events: list[tuple[str, object]]) -> list[Op]:
        out: list[Op] = []
        for kind, value in events:
            if kind == "tool_call":
                self._close(out)
                self.pending = ""
                self.tool_calls.append(value)
                out += [("start", "tool_call", value), ("stop", "tool_call", value)]
            elif kind == "reasoning":
                if self.open != "reasoning":
                    self._close(out)
                    self.pending = ""
                    out.append(("start", "reasoning", None))
                    self.open = "reasoning"
                out.append(("delta", "reasoning", value))
            else:
                if self.open != "text":
                    if not (self.pending + value).strip():
                        self.pending += value
                        continue
                    self._close(out)
                    out.append(("start", "text", None))
                    self.open = "text"
                    value, self.pending = self.pending + value, ""
                out.append(("delta", "text", value))
        return out

    def close(self) -> list[Op]:
        """The end of the turn: what was held, and the last block's end."""
        out: list[Op] = []
        if self.pending and not self.tool_calls:  # whitespace was all the model said last
            self._close(out)
            out += [("start", "text", None), ("delta", "text", self.pending)]
            self.open = "text"
        self.pending = ""
        self._close(out)
        return out


def _parser(chat) -> ChatStream:
    return ChatStream(chat.tools, chat.in_reasoning)


async def complete(
    state: ServeState, request: Request, req: ChatCompletionRequest
) -> tuple[list[Op], list[ToolCall], Result]:
    """Run `req` to its end: its blocks, its tool calls and the engine's result. APIError for
    a bad request, a full queue, a client that left or a failure in generation."""
    chat = await asyncio.to_thread(chat_job, state, req)  # tokenizing is off the event loop
    try:
        r = await state.engine.complete(chat.job, request)
    except asyncio.CancelledError:
        # uvicorn cancels what still runs when the shutdown's grace period ends
        raise APIError(
            "the server shut down before the request finished",
            503,
            code="shutdown",
            type="server_error",
        ) from None
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - answered as an error body, connection kept
        raise generation_error(e) from None
    if r is None:  # nobody is listening; 499 as nginx logs a client that left
        raise APIError("the client disconnected", 499, code="cancelled")
    parser, blocks = _parser(chat), Blocks()
    ops = blocks.feed(parser.feed(r.text)) + blocks.feed(parser.close()) + blocks.close()
    return ops, blocks.tool_calls, r


@dataclass
class Streamed:
    """A turn admitted to the engine: its prompt's length, and its blocks' ops as they come,
    then ("done", "", Result) or ("error", "", APIError); nothing more once the client left."""

    prompt_tokens: int
    blocks: Blocks
    ops: AsyncIterator[Op]


async def stream(state: ServeState, request: Request, req: ChatCompletionRequest) -> Streamed:
    """Admit `req` now (a full queue is an APIError 429 here, before any event is sent)."""
    chat = await asyncio.to_thread(chat_job, state, req)  # tokenizing is off the event loop
    events = state.engine.stream(chat.job, request)
    parser, blocks = _parser(chat), Blocks()

    async def ops() -> AsyncIterator[Op]:
        async for what, value in events:
            if what == "text":
                for op in blocks.feed(parser.feed(value)):
                    yield op
            elif what == "done":
                for op in blocks.feed(parser.close()) + blocks.close():
                    yield op
                yield ("done", "", value)
            else:
                yield ("error", "", generation_error(value))

    return Streamed(len(chat.job.ids), blocks, ops())
