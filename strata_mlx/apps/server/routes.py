"""The HTTP handlers, module-level over app.state.serve: chat and text completions
(streaming as SSE or not), models, stats, and the error handlers.
Never: builds the app or owns the engine (app does)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...config import (
    OptionError,
)
from ...generation.chat_output import ChatStream, ToolFormat, opens_reasoning, parse, tool_format
from ...generation.sampling import SamplingOptions
from .engine import Job, Result, ServeState
from .guard import end_stream_with
from .schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    generation_error,
    one_line,
    validation_error,
)

# ---- the app -------------------------------------------------------------------------------


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def _usage(r: Result) -> dict:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }


def _template_tool_call(call: dict) -> dict:
    """An OpenAI tool call as chat templates take it (Hugging Face's convention): its
    arguments a mapping, not JSON text."""
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            fn = {**fn, "arguments": json.loads(fn["arguments"])}
        except (json.JSONDecodeError, RecursionError):  # (text as it came: nested too deep too)
            pass
        call = {**call, "function": fn}
    return call


# ---- handlers: module-level, over app.state.serve ------------------------------------------


async def api_error(request: Request, exc: APIError):
    return exc.response(request.url.path)


async def invalid_request(request: Request, exc: RequestValidationError):
    return validation_error(exc).response(request.url.path)


async def http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = str(exc.detail)
    if exc.status_code == 413:  # FastAPI's body limit (create_app's max_body_bytes)
        limit = getattr(request.app.state, "max_body_bytes", None)
        message = (
            f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)"
        )
        return APIError(message, 413, code="request_too_large").response(request.url.path)
    # (a 405's Allow header, which HTTP requires, comes in the exception's headers)
    err = APIError(message, exc.status_code, type=kind, headers=exc.headers)
    return err.response(request.url.path)


async def internal_error(request: Request, exc: Exception):
    return APIError(one_line(exc), 500, type="server_error").response(request.url.path)


def shutdown_error() -> APIError:
    """What a request cut by the server's shutdown is answered (or its stream ends with)."""
    return APIError(
        "the server shut down before the request finished",
        503,
        code="shutdown",
        type="server_error",
    )


def serve_state(request: Request) -> ServeState:
    """The serving state of the app that received `request`."""
    return request.app.state.serve


def _check_request(state: ServeState, req: SamplingFields) -> None:
    for param, bad in req.unsupported():
        if bad:
            raise APIError(
                f"{param}: not supported by this server", param=param, code="unsupported"
            )
    if req.model is not None and req.model != state.model_name:
        raise APIError(
            f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
            404,
            param="model",
            code="model_not_found",
        )


def _need_tokenizer(state: ServeState, what: str) -> None:
    if state.tokenizer is None:
        raise APIError(f"{state.model_name}: the model has no tokenizer; {what}")


def check_prompt_chars(state: ServeState, n_chars: int, param: str) -> None:
    """Refuse a prompt whose text alone is too long for max_prompt_tokens, before the
    tokenizer spends seconds on it (a bound only some tokenizers give: ServeState)."""
    if state.max_prompt_chars is not None and n_chars > state.max_prompt_chars:
        raise APIError(
            f"{param}: {n_chars} characters, more than this server's limit of "
            f"{state.max_prompt_tokens} tokens can hold (--max-prompt-tokens)",
            param=param,
            code="context_length_exceeded",
        )


def _encode(state: ServeState, text: str, param: str, **kw) -> list[int]:
    try:
        return state.tokenizer.encode(text, **kw)
    except Exception as e:  # e.g. a lone surrogate the tokenizer cannot take as UTF-8
        raise APIError(f"{param}: cannot be tokenized ({one_line(e)})", param=param) from None


def _make_job(
    state: ServeState,
    req: SamplingFields,
    ids: list[int],
    max_tokens: int | None,
    prompt_param: str = "prompt",
    tokens_param: str = "max_tokens",
) -> Job:
    if not ids:
        raise APIError("the prompt is empty", param=prompt_param)
    if state.context is not None and len(ids) > state.context:  # whatever the KV cache
        raise APIError(
            f"{prompt_param}: {len(ids)} tokens, more than the model's context of "
            f"{state.context} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if len(ids) > state.max_prompt_tokens:
        raise APIError(
            f"{prompt_param}: {len(ids)} tokens, more than this server's limit of "
            f"{state.max_prompt_tokens} (--max-prompt-tokens)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and max_tokens > state.max_tokens_limit:
        raise APIError(
            f"{tokens_param}: {max_tokens}, more than this server's limit of "
            f"{state.max_tokens_limit} (--max-tokens-limit)",
            param=tokens_param,
            code="invalid_value",
        )
    bad = [i for i in ids if not 0 <= i < state.vocab]
    if bad:
        raise APIError(f"prompt token id {bad[0]} outside [0, {state.vocab})", param=prompt_param)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    max_tokens = state.default_max_tokens if max_tokens is None else max_tokens
    if state.context is not None and state.engine.kv.max_kv_size is None:
        # As llama.cpp's server: generation ends at the context's end ("length"), past
        # which the model reads positions it was never trained on (docs/decisions.md).
        max_tokens = min(max_tokens, state.context - len(ids))
    return Job(
        ids=ids,
        max_tokens=max_tokens,
        sampling=_sampling_options(req, state.vocab),
        seed=req.seed,
        stop=stop,
    )


def _sampling_options(req: SamplingFields, vocab: int) -> SamplingOptions:
    """The request's sampling fields, checked by the ranges the CLI's flags have; what a
    request leaves out takes OpenAI's default (temperature 1) or mlx-lm's."""
    bias = None
    if req.logit_bias is not None:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(
                    f"logit_bias: {key!r} is not a token id", param="logit_bias"
                ) from None
    options = SamplingOptions(
        temp=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=req.min_p,
        top_k=req.top_k,
        xtc_probability=req.xtc_probability,
        xtc_threshold=req.xtc_threshold,
        logit_bias=bias,
        repetition_penalty=req.repetition_penalty,
        repetition_context_size=req.repetition_context_size,
        presence_penalty=req.presence_penalty,
        presence_context_size=req.presence_context_size,
        frequency_penalty=req.frequency_penalty,
        frequency_context_size=req.frequency_context_size,
    )
    try:
        options.check(vocab)
    except OptionError as e:
        raise APIError(str(e), param=e.param, code="invalid_value") from None
    return options


async def _respond(
    state: ServeState,
    request: Request,
    req: SamplingFields,
    job: Job,
    kind: str,
    tools: bool = False,
    in_reasoning: bool = False,
):
    """`tools`: parse the model's tool-call blocks; `in_reasoning`: the prompt opened a
    <think> block (chat only, strata_mlx.generation.chat_output)."""
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}
    if not req.stream:
        return await _complete(state.engine, request, job, kind, head, tools, in_reasoning)
    return _stream(state.engine, request, req, job, kind, head, tools, in_reasoning)


async def _complete(engine, request: Request, job: Job, kind: str, head: dict, tools: bool,
                    in_reasoning: bool):  # fmt: skip
    """The whole completion as one JSON body (or an error body: shut down, client gone)."""
    obj = "chat.completion" if kind == "chat" else "text_completion"
    try:
        r = await engine.complete(job, request)
    except asyncio.CancelledError:
        # uvicorn cancels what still runs when the shutdown's grace period ends (the
        # job itself stops at its next token): say so rather than let it answer 500
        return shutdown_error().response()
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - answered as an error body, connection kept
        raise generation_error(e) from None
    if r is None:  # nobody is listening; 499 as nginx logs a client that left
        return APIError("the client disconnected", 499, code="cancelled").response()
    if kind == "chat":
        out = parse(r.text, tools, in_reasoning)
        message = {"role": "assistant", "content": out.content}
        if out.reasoning is not None:
            message["reasoning_content"] = out.reasoning
        if out.tool_calls:
            message["tool_calls"] = [c.as_dict() for c in out.tool_calls]
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": "tool_calls" if out.tool_calls else r.finish_reason,
        }
    else:
        choice = {
            "index": 0,
            "text": r.text,
            "logprobs": None,
            "finish_reason": r.finish_reason,
        }
    return JSONResponse({**head, "object": obj, "choices": [choice], "usage": _usage(r)})


def _stream(engine, request: Request, req: SamplingFields, job: Job, kind: str, head: dict,
            tools: bool, in_reasoning: bool) -> StreamingResponse:  # fmt: skip
    """The completion streamed as server-sent events, OpenAI's chunks, then [DONE]."""
    obj = "chat.completion" if kind == "chat" else "text_completion"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    chunk_obj = obj + ".chunk" if kind == "chat" else obj

    def chunk(text: str | None, finish: str | None, first: bool = False, delta=None) -> dict:
        if kind == "chat":
            delta = delta or ({"role": "assistant", "content": ""} if first else {})
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        c = {**head, "object": chunk_obj, "choices": [choice]}
        if include_usage:
            c["usage"] = None
        return c

    stream = engine.stream(job, request)  # admitted here: a full queue is a 429
    end_stream_with(request, lambda: _sse(shutdown_error().body()) + b"data: [DONE]\n\n")

    parser = ChatStream(tools, in_reasoning) if kind == "chat" else None
    # With tools offered, content that is whitespace alone so far waits: before a tool call
    # it is dropped, as the unstreamed answer's content is then null.
    lead = {"held": "", "open": not tools}

    def deltas(parsed) -> list[bytes]:
        out = []
        for what, value in parsed:
            if what == "tool_call":
                index = len(parser.tool_calls) - 1
                delta = {"tool_calls": [value.as_dict(index)]}
                lead["held"] = ""
            elif what == "content" and not lead["open"]:
                value = lead["held"] + value
                if not value.strip():
                    lead["held"] = value
                    continue
                lead.update(held="", open=True)
                delta = {"content": value}
            else:
                delta = {"reasoning_content" if what == "reasoning" else "content": value}
            out.append(_sse(chunk(None, None, delta=delta)))
        return out

    async def events():
        if kind == "chat":
            yield _sse(chunk(None, None, first=True))
        async for ev, value in stream:
            if ev == "text":
                if parser is None:
                    yield _sse(chunk(value, None))
                    continue
                for c in deltas(parser.feed(value)):
                    yield c
            elif ev == "done":
                finish = value.finish_reason
                if parser is not None:
                    for c in deltas(parser.close()):
                        yield c
                    if lead["held"] and not parser.tool_calls:  # whitespace was all it said
                        yield _sse(chunk(None, None, delta={"content": lead["held"]}))
                    finish = "tool_calls" if parser.tool_calls else finish
                yield _sse(chunk(None, finish))
                if include_usage:
                    yield _sse({**head, "object": chunk_obj, "choices": [], "usage": _usage(value)})
            else:
                yield _sse(generation_error(value).body())
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@dataclass
class ChatJob:
    """A chat request made ready for the engine: its job, the tool-call format to parse (False
    when the request offered no tools) and whether the prompt opened a <think> block."""

    job: Job
    tools: ToolFormat | Literal[False]
    in_reasoning: bool


async def chat_completions(req: ChatCompletionRequest, request: Request):
    state = serve_state(request)
    chat = await asyncio.to_thread(chat_job, state, req)  # tokenizing is off the event loop
    return await _respond(state, request, req, chat.job, "chat", chat.tools, chat.in_reasoning)


def chat_job(state: ServeState, req: ChatCompletionRequest) -> ChatJob:
    """Template and tokenize a chat request into a job, as /v1/chat/completions does (the
    Anthropic and Responses APIs translate their requests into one); APIError if bad."""
    ids, text, tools = chat_prompt(state, req)
    given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    job = _make_job(state, req, ids, getattr(req, given), "messages", given)
    # the tool-call format the template renders is the one the model writes
    fmt = tools and tool_format(state.tokenizer.chat_template)
    return ChatJob(job, fmt, opens_reasoning(text))


def chat_prompt(state: ServeState, req: ChatCompletionRequest) -> tuple[list[int], str, bool]:
    """A chat request's prompt: (its token ids, its text, whether it offers tools), templated
    as chat_job does, without a job's limits (count_tokens counts past the context)."""
    _check_request(state, req)
    _need_tokenizer(state, "use /v1/completions with token ids")
    messages = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            parts = []
            for p in m.content:
                if p.type != "text" or p.text is None:
                    raise APIError(
                        f"messages[{i}].content: only text parts are supported, got {p.type!r}",
                        param=f"messages.{i}.content",
                    )
                parts.append(p.text)
            content = "".join(parts)
        else:
            content = m.content or ""
        # OpenAI's "developer" messages are its system messages; chat templates know "system"
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            msg["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    check_prompt_chars(state, sum(len(m["content"]) for m in messages), "messages")
    tools = bool(req.tools) and req.tool_choice != "none"
    extra = {"tools": req.tools} if tools else {}
    variables = req.chat_template_kwargs or {}
    fixed = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
    if taken := sorted(set(variables) & fixed):
        raise APIError(
            f"chat_template_kwargs: {', '.join(taken)} set by the request itself",
            param="chat_template_kwargs",
        )
    extra.update(variables)
    tokenizer = state.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except Exception as e:  # the template's raise_exception, or a jinja error
        raise APIError(f"messages: the chat template failed: {e}", param="messages") from None
    if tools and state.template_takes_tools is None:
        _tell_if_tools_dropped(state, text, messages, variables)
    # As Hugging Face's apply_chat_template(tokenize=True): the template places any special
    # tokens itself.
    return _encode(state, text, "messages", add_special_tokens=False), text, tools


def _tell_if_tools_dropped(state, text: str, messages: list[dict], variables: dict) -> None:
    """Whether the chat template renders tools at all (the prompt without them the same):
    one line on stderr where it does not, once a server."""
    try:
        bare = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **variables
        )
    except Exception:  # (a template that fails without tools renders them)
        bare = None
    state.template_takes_tools = bare != text
    if not state.template_takes_tools:
        print(
            f"warning: the chat template of {state.model_name} renders no tools: requests' "
            "tools do not reach the model",
            file=sys.stderr,
            flush=True,
        )


async def completions(req: CompletionRequest, request: Request):
    state = serve_state(request)
    _check_request(state, req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError("prompt: one prompt per request (n = 1)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _need_tokenizer(state, "send the prompt as token ids")
        check_prompt_chars(state, len(prompt), "prompt")
        ids = await asyncio.to_thread(_encode, state, prompt, "prompt")  # off the event loop
    else:
        ids = list(prompt)
    job = _make_job(state, req, ids, req.max_tokens)
    return await _respond(state, request, req, job, "completion")


def _model_card(state: ServeState) -> dict:
    """The model as OpenAI's clients list it, with the fields Anthropic's read."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.created))
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "strata-mlx",
        "type": "model",
        "display_name": state.model_name,
        "created_at": created,
    }


async def models(request: Request):
    name = serve_state(request).model_name
    return {
        "object": "list",
        "data": [_model_card(serve_state(request))],
        # Anthropic's pagination fields: one page
        "has_more": False,
        "first_id": name,
        "last_id": name,
    }


async def model_info(name: str, request: Request):
    state = serve_state(request)
    if name != state.model_name:
        raise APIError(
            f"the model {name!r} does not exist", 404, param="model", code="model_not_found"
        )
    return _model_card(state)


async def stats(request: Request):
    return stats_body(serve_state(request))


def stats_body(state: ServeState) -> dict:
    """GET /v1/stats: the server's counters and the expert cache's."""
    engine, model = state.engine, state.model
    cache = model.expert_cache
    disk = getattr(engine.prompt_caches, "disk", None)  # strata_mlx.apps.prompt_cache_dir
    body = {
        "model": state.model_name,
        "server": {
            "requests": engine.requests,
            "active": engine.active,
            "queued": max(engine.queued, 0),
            "max_queue": engine.max_queue,
            "cancelled": engine.cancelled,
            "rejected": engine.rejected,
            "prompt_tokens": engine.prompt_tokens,
            "completion_tokens": engine.completion_tokens,
            "prefilled_tokens": engine.prefilled_tokens,
            "prompt_cache": {
                "entries": len(engine.prompt_caches),
                "hits": engine.prompt_caches.hits,
                "reused_tokens": engine.prompt_caches.reused_tokens,
                # --prompt-cache-dir: the files, and what requests resumed from them
                "disk": disk.stats() if disk is not None else None,
            },
        },
        # the cache's session counters (wall_s/tokens are not kept there) ...
        "expert_cache": cache.stats.as_dict() if cache is not None else None,
        # ... and the same summed over served requests, with their wall time and tokens
        "served": engine.served.as_dict() if engine.served is not None else None,
    }
    if cache is not None:
        body["arena"] = {
            "slots": cache.arena.n_slots,
            "resident": len(cache.arena.slot_of),
            "record_bytes": cache.layout.record_bytes,
        }
    return body
