"""`strata-mlx serve`: an OpenAI-compatible HTTP server for one model (FastAPI + uvicorn).

Endpoints: POST /v1/chat/completions, POST /v1/completions (both streaming as SSE or not),
POST /v1/messages (Anthropic's Messages API, strata_mlx.apps.anthropic_api), POST /v1/responses
(OpenAI's Responses API, strata_mlx.apps.responses_api), GET /v1/models, GET /v1/stats (also
/stats) with the expert cache's counters, GET /dashboard (a live page of them,
strata_mlx.apps.dashboard).

Sampling fields are mlx-lm's server's (temperature, top_p, top_k, min_p, xtc_probability,
xtc_threshold, logit_bias, repetition_penalty and repetition_context_size, presence_penalty,
frequency_penalty and their context sizes, seed, stop), built into one sampler by
strata_mlx.generation.sampling exactly as `generate`'s flags are; an omitted temperature is OpenAI's 1.
Chat requests' `tools` go through the model's chat template (`tool_choice` "auto" or "none");
the model's `<think>` reasoning comes back as `reasoning_content` and its Qwen3 `<tool_call>`
blocks as `tool_calls`, streamed as OpenAI streams them (strata_mlx.generation.chat_output).

One model, one expert cache, one KV cache per request: generation runs on a single worker
thread, so requests queue and never share state, and the event loop stays free to accept and
stream. What a request can get wrong is answered 4xx with an OpenAI-style error body
{"error": {"message", "type", "param", "code"}}, never 500 (kept for faults of the server
itself, e.g. a corrupt store):

- a request whose client disconnects is cancelled, queued or running, streaming or not: the
  worker stops at its next token, or mid-prefill at the end of the chunk it is in;
- at most `max_queue` requests wait behind the running one; more are answered 429 with a
  Retry-After estimated from recent requests' durations;
- a prompt longer than `max_prompt_tokens` and a max_tokens above `max_tokens_limit` are 400s
  (both default to the model's context);
- with an API key every request must carry `Authorization: Bearer <key>` (compared in constant
  time) or gets 401 (/dashboard, a browser's page, also takes HTTP Basic with the key as the
  password); with allowed origins, browsers' CORS preflights from them succeed;
- on SIGTERM the server stops accepting, lets requests in flight finish for up to
  `shutdown_timeout` seconds, then cancels what is left and exits.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SHUTDOWN_TIMEOUT,
    MAX_SEED,
    OptionError,
)
from ..generation.chat_output import ChatStream, ToolFormat, opens_reasoning, parse, tool_format
from ..generation.sampling import SamplingOptions
from .dashboard import add_routes

FALLBACK_CONTEXT = 8192  # the limits' default for a model whose config names no context

# ---- request models ------------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: no "5" -> 5 or true -> 1 coercion; unknown fields are ignored, as OpenAI's
    # clients send some (user, metadata, ...) that do not change the output.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, for the template
    tool_call_id: str | None = None  # a tool's answer: to which call


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    # mlx-lm's server's fields beyond OpenAI's; ranges are checked by strata_mlx.config
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> bias
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20

    def unsupported(self) -> list[tuple[str, bool]]:
        """(parameter, set to something this server does not do)."""
        return [("n", self.n != 1)]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    tools: list[dict] | None = None
    tool_choice: Literal["auto", "none"] | None = None  # "required" / a named one: not done

    def unsupported(self):
        return super().unsupported() + [("logprobs", self.logprobs)]


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self):
        return super().unsupported() + [
            ("echo", self.echo),
            ("logprobs", bool(self.logprobs)),
            ("suffix", bool(self.suffix)),
        ]


# ---- errors --------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        message = " ".join(message.splitlines())  # one line, whatever a request echoes in it
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = (
            message,
            status,
            param,
            code,
            type,
        )
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _one_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _generation_error(e: Exception) -> APIError:
    """A failure inside generation: a ValueError is the request's (an option out of range),
    anything else the server's."""
    if isinstance(e, ValueError):
        return APIError(_one_line(e))
    return APIError(_one_line(e), 500, type="server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return APIError(f"request body is not valid JSON: {e.get('msg')}", code="invalid_json")
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    if e.get("type") == "missing":
        if param is None:
            return APIError("the request has no body: expected a JSON object", code="missing")
        return APIError(f"missing required parameter: {param}", param=param, code="missing")
    return APIError(f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


# ---- generation ----------------------------------------------------------------------------


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    sampling: SamplingOptions
    seed: int | None
    stop: list[str]


@dataclass
class Result:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None  # the request's stop string that ended the text


class _Stopped(Exception):
    """Raised from the prompt progress callback: the job's client left, or shutdown."""


class Engine:
    """Runs generation jobs one at a time on a single worker thread, behind a bounded queue.

    Every job carries a cancel event, set when its client disconnects or its request task is
    cancelled (shutdown); the worker checks it before starting the job, between prefill
    chunks (a long prompt stops mid-prefill) and after every token.
    Counters are changed by the event loop and the worker, under `_counts`.
    """

    def __init__(self, model, tokenizer, max_queue: int = DEFAULT_MAX_QUEUE, kv=None):
        from ..generation.prompt_cache import KVOptions

        self.model = model
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.kv = kv or KVOptions()  # every generation's KV cache: rotating, quantized
        # one worker thread: one generation at a time, no lock needed around it
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-generate")
        self._counts = threading.Lock()
        self._closing = threading.Event()  # shutdown: every job stops at its next token
        self._idle = threading.Event()  # no job running
        self._idle.set()
        self.requests = 0
        self.queued = 0  # admitted, not started
        self.active = 0
        self.cancelled = 0  # stopped early or never started: the client left, or shutdown
        self.rejected = 0  # answered 429
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.mean_request_s: float | None = None  # running mean, for Retry-After
        self.served = None  # ExpertStats summed over requests, with their wall time and tokens
        self.last = None  # the running (or last) request's latest GenerationResponse
        from ..generation.prompt_cache import PromptCacheLRU

        # The last conversations' KV / recurrent state: a request that extends one prefills
        # only what is new (mlx-lm server's prompt cache). Touched by the worker thread only.
        self.prompt_caches = PromptCacheLRU()
        self.prefilled_tokens = 0  # prompt tokens run through the model (reused ones are not)

    def close(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> bool:
        """Cancel every job, queued or running, and wait up to `timeout` seconds for the
        worker to stop; returns whether it did."""
        self._closing.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        return self._idle.wait(timeout)

    def retry_after(self) -> int:
        """Seconds until a place in the queue frees up: when the running request ends, at
        most a mean request's duration from now (at least 1)."""
        return max(1, min(3600, math.ceil(self.mean_request_s or 1.0)))

    def _submit(
        self, job: Job, on_text: Callable[[str], None] | None, cancelled: threading.Event
    ) -> asyncio.Future:
        """Admit `job` (429 when the queue is full) and hand it to the worker."""
        with self._counts:
            if self._closing.is_set():
                raise APIError("the server is shutting down", 503, type="server_error")
            if self.queued + self.active > self.max_queue:  # it would wait behind them
                self.rejected += 1
                wait = self.retry_after()
                raise APIError(
                    f"too many requests: {self.queued} already waiting (--max-queue "
                    f"{self.max_queue}); retry after {wait} s",
                    429,
                    code="queue_full",
                    type="rate_limit_error",
                    headers={"Retry-After": str(wait)},
                )
            self.queued += 1
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, self._work, job, on_text, cancelled)

    def _work(self, job, on_text, cancelled) -> Result | None:
        with self._counts:
            self.queued -= 1
            if cancelled.is_set() or self._closing.is_set():  # the client left while queued
                self.cancelled += 1
                return None
            self.active += 1
            self._idle.clear()
        try:
            return self.run(job, on_text, cancelled)
        finally:
            with self._counts:
                self.active -= 1
                if not self.active:
                    self._idle.set()

    def run(
        self,
        job: Job,
        on_text: Callable[[str], None] | None = None,
        cancelled: threading.Event | None = None,
    ) -> Result:
        """Generate on the calling thread (the worker), passing each piece of text to
        `on_text`. Stop strings are stream_generate's: it holds back text that may begin one."""
        from ..generation.generate import stream_generate

        t0 = time.perf_counter()
        self.requests += 1
        self.prompt_tokens += len(job.ids)
        if job.max_tokens == 0:
            return Result("", "length", len(job.ids), 0)
        text, n, finish, r, matched = "", 0, None, None, None
        stopped = False
        from ..generation.prompt_cache import make_prompt_cache

        cache, reused = self.prompt_caches.take(job.ids)
        if cache is None:
            cache = make_prompt_cache(self.model, self.kv)
        self.prefilled_tokens += len(job.ids) - reused
        tokens: list[int] = []

        def progress(done: int, total: int) -> None:  # between prefill chunks, and at the end
            if self._closing.is_set() or (cancelled is not None and cancelled.is_set()):
                raise _Stopped

        gen = stream_generate(
            self.model,
            self.tokenizer,
            job.ids[reused:],
            max_tokens=job.max_tokens,
            seed=job.seed,
            sampler=job.sampling.sampler(self.tokenizer),
            logits_processors=job.sampling.logits_processors(self.model.args.vocab_size),
            prompt_cache=cache,
            cached_tokens=job.ids[:reused],
            stop=[s for s in job.stop if s],
            prompt_progress_callback=progress,
            max_kv_size=self.kv.max_kv_size,
            kv_bits=self.kv.kv_bits,
            kv_group_size=self.kv.kv_group_size,
            quantized_kv_start=self.kv.quantized_kv_start,
        )
        with contextlib.closing(gen):
            try:
                for r in gen:
                    n += 1
                    tokens.append(getattr(r, "token", None))
                    self.last = r
                    with self._counts:  # per token: /v1/stats and the dashboard see it move
                        self.completion_tokens += 1
                    text += r.text
                    finish = r.finish_reason
                    matched = getattr(r, "stop_sequence", None)
                    if on_text is not None and r.text:
                        on_text(r.text)
                    if finish is not None:
                        break
                    if self._closing.is_set() or (cancelled is not None and cancelled.is_set()):
                        stopped = True
                        break
            except _Stopped:  # between two prefill chunks: a long prompt stops there
                stopped = True
        # Closed or finished, the cache covers the prompt and every token but the last; kept
        # only where each layer's own count agrees.
        covered = job.ids + tokens[:-1]
        if tokens and None not in tokens and all(c.offset == len(covered) for c in cache):
            self.prompt_caches.put(covered, cache)
        with self._counts:
            self.cancelled += stopped
        elapsed = time.perf_counter() - t0
        m = self.mean_request_s
        self.mean_request_s = elapsed if m is None else m + 0.2 * (elapsed - m)
        if r is not None and r.expert_stats is not None:
            if self.served is None:
                self.served = r.expert_stats.copy()
            else:
                self.served.add(r.expert_stats)
        return Result(text, finish or "length", len(job.ids), n, matched)

    async def complete(self, job: Job, request: Request | None = None) -> Result | None:
        """Run `job` to the end; None if it was cancelled because `request`'s client left."""
        cancelled = threading.Event()
        future = self._submit(job, None, cancelled)
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({future, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not future.done() or future.cancelled():  # the client left, or shutdown
                return None
            return future.result()
        finally:  # the client left, or this task was cancelled (shutdown): stop the job
            cancelled.set()
            gone.cancel()

    def stream(self, job: Job, request: Request | None = None) -> AsyncIterator[tuple[str, object]]:
        """Admit `job` now (so that a full queue is a 429, not an event) and return its events:
        ("text", str) as they come, then ("done", Result) or ("error", exc); nothing more once
        the client has left."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (server shutting down)
                cancelled.set()

        future = self._submit(job, lambda s: put(("text", s)), cancelled)

        def finished(f: asyncio.Future) -> None:
            if f.cancelled():
                queue.put_nowait(("gone", None))
            elif f.exception() is not None:
                queue.put_nowait(("error", f.exception()))
            elif f.result() is None:
                queue.put_nowait(("gone", None))
            else:
                queue.put_nowait(("done", f.result()))

        future.add_done_callback(finished)

        async def events():
            # Starlette notices a client gone only when it next writes; text held back (a
            # stop string) or a long prefill writes nothing, so watch the connection too.
            gone = asyncio.ensure_future(_client_gone(request))
            gone.add_done_callback(lambda _: cancelled.set() or queue.put_nowait(("gone", None)))
            try:
                while True:
                    kind, value = await queue.get()
                    if kind == "gone":
                        return
                    yield kind, value
                    if kind != "text":
                        return
            finally:
                cancelled.set()
                gone.cancel()

        return events()


async def _client_gone(request: Request | None) -> None:
    """Return once the client of `request` has disconnected (never, without a request)."""
    if request is None:
        await asyncio.Event().wait()
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- the app -------------------------------------------------------------------------------


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def _usage(r: Result) -> dict:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }


class _BearerAuth:
    """ASGI middleware: every HTTP request must carry `Authorization: Bearer <key>` (or, as
    Anthropic's clients send it, `x-api-key: <key>`); the key is compared in constant time.
    Runs before the body is read, so an unauthenticated client learns nothing from
    validation errors. /dashboard (a page a person opens in a browser,
    which cannot send a bearer token) also takes HTTP Basic with the key as the password: a
    401 there asks the browser for it, which then sends it with the page's own polls."""

    def __init__(self, app, key: str):
        self.app = app
        self.key = key.encode()

    def _ok(self, auth: bytes, page: bool) -> bool:
        scheme, _, token = auth.partition(b" ")
        scheme, token = scheme.lower(), token.strip()
        if page and scheme == b"basic":
            try:
                token = base64.b64decode(token, validate=True).partition(b":")[2]
            except ValueError:
                token = b""
            return hmac.compare_digest(token, self.key)
        # compare_digest on the token even when the scheme is wrong: no early exit
        return hmac.compare_digest(token, self.key) and scheme == b"bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            if b"x-api-key" in headers and not auth:
                auth = b"Bearer " + headers[b"x-api-key"]
            page = scope.get("path", "").startswith("/dashboard")
            if not self._ok(auth, page):
                challenge = 'Basic realm="strata-mlx dashboard"' if page else "Bearer"
                err = APIError(
                    "missing or incorrect API key: send Authorization: Bearer <key>",
                    401,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": challenge},
                )
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _template_tool_call(call: dict) -> dict:
    """An OpenAI tool call as chat templates take it (Hugging Face's convention): its
    arguments a mapping, not JSON text."""
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            fn = {**fn, "arguments": json.loads(fn["arguments"])}
        except json.JSONDecodeError:
            pass
        call = {**call, "function": fn}
    return call


def model_context(model) -> int:
    """The model's context length (max_position_embeddings), FALLBACK_CONTEXT if unnamed."""
    n = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else FALLBACK_CONTEXT


@dataclass
class ServeState:
    """What the handlers read, as `app.state.serve`: the engine and the server's limits."""

    engine: Engine
    model_name: str
    created: int
    vocab: int
    default_max_tokens: int
    max_tokens_limit: int
    max_prompt_tokens: int

    @property
    def model(self):
        return self.engine.model

    @property
    def tokenizer(self):
        return self.engine.tokenizer


def create_app(
    model,
    tokenizer,
    model_name: str,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    *,
    max_tokens_limit: int | None = None,
    max_prompt_tokens: int | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    kv=None,
):
    """The FastAPI app serving `model` under the name `model_name`.

    `max_tokens_limit` and `max_prompt_tokens` default to the model's context; at most
    `max_queue` requests wait behind the running one. With `api_key`, requests need it as a
    bearer token; `allowed_origins` (e.g. ["https://app.example"], or ["*"]) are answered
    CORS headers. At shutdown, generation still running is cancelled and waited for up to
    `shutdown_timeout` seconds. `kv` (prompt_cache.KVOptions: mlx-lm's --max-kv-size,
    --kv-bits, ...) shapes every generation's KV cache; a family that cannot take it is
    refused here, before anything is served."""
    from ..generation.prompt_cache import make_prompt_cache
    from . import anthropic_api, responses_api  # they build on this module's request models

    engine = Engine(model, tokenizer, max_queue, kv)
    make_prompt_cache(model, engine.kv)  # (DeepSeek-V3's latent cache is not quantized)
    context = model_context(model)
    max_tokens_limit = context if max_tokens_limit is None else max_tokens_limit
    state = ServeState(
        engine=engine,
        model_name=model_name,
        created=int(time.time()),
        vocab=model.args.vocab_size,
        default_max_tokens=min(default_max_tokens, max_tokens_limit),
        max_tokens_limit=max_tokens_limit,
        max_prompt_tokens=context if max_prompt_tokens is None else max_prompt_tokens,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.close, shutdown_timeout)

    app = FastAPI(title="strata-mlx", lifespan=lifespan)
    app.state.serve = state
    app.state.engine = engine
    # Starlette runs the last middleware added first: CORS answers preflights (which carry
    # no credentials) before the key is checked, and adds its headers to 401s too.
    if api_key:
        app.add_middleware(_BearerAuth, key=api_key)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            max_age=600,
        )
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _internal)
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/completions")(completions)
    anthropic_api.add_routes(app)  # POST /v1/messages
    responses_api.add_routes(app)  # POST /v1/responses
    app.get("/v1/models")(models)
    app.get("/v1/models/{name:path}")(model_info)
    app.get("/v1/stats")(stats)
    app.get("/stats")(stats)
    # GET /dashboard
    app.state.dashboard = add_routes(app, model, engine, lambda: stats_body(state))
    return app


# ---- handlers: module-level, over app.state.serve ------------------------------------------


async def _api_error(request: Request, exc: APIError):
    return exc.response()


async def _invalid(request: Request, exc: RequestValidationError):
    return _validation_error(exc).response()


async def _http(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(str(exc.detail), exc.status_code, type=kind).response()


async def _internal(request: Request, exc: Exception):
    return APIError(_one_line(exc), 500, type="server_error").response()


def _state(request: Request) -> ServeState:
    return request.app.state.serve


def _check_request(state: ServeState, req: _Sampling) -> None:
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


def _encode(state: ServeState, text: str, param: str, **kw) -> list[int]:
    try:
        return state.tokenizer.encode(text, **kw)
    except Exception as e:  # e.g. a lone surrogate the tokenizer cannot take as UTF-8
        raise APIError(f"{param}: cannot be tokenized ({_one_line(e)})", param=param) from None


def _make_job(
    state: ServeState,
    req: _Sampling,
    ids: list[int],
    max_tokens: int | None,
    prompt_param: str = "prompt",
    tokens_param: str = "max_tokens",
) -> Job:
    if not ids:
        raise APIError("the prompt is empty", param=prompt_param)
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
    return Job(
        ids=ids,
        max_tokens=state.default_max_tokens if max_tokens is None else max_tokens,
        sampling=_sampling_options(req, state.vocab),
        seed=req.seed,
        stop=stop,
    )


def _sampling_options(req: _Sampling, vocab: int) -> SamplingOptions:
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
    req: _Sampling,
    job: Job,
    kind: str,
    tools: bool = False,
    in_reasoning: bool = False,
):
    """`tools`: parse the model's tool-call blocks; `in_reasoning`: the prompt opened a
    <think> block (chat only, strata_mlx.generation.chat_output)."""
    engine = state.engine
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    obj = "chat.completion" if kind == "chat" else "text_completion"
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}

    if not req.stream:
        try:
            r = await engine.complete(job, request)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs when the shutdown's grace period ends (the
            # job itself stops at its next token): say so rather than let it answer 500
            return APIError(
                "the server shut down before the request finished",
                503,
                code="shutdown",
                type="server_error",
            ).response()
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - answered as an error body, connection kept
            raise _generation_error(e) from None
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

    parser = ChatStream(tools, in_reasoning) if kind == "chat" else None

    def deltas(parsed) -> list[bytes]:
        out = []
        for what, value in parsed:
            if what == "tool_call":
                index = len(parser.tool_calls) - 1
                delta = {"tool_calls": [value.as_dict(index)]}
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
                    finish = "tool_calls" if parser.tool_calls else finish
                yield _sse(chunk(None, finish))
                if include_usage:
                    yield _sse({**head, "object": chunk_obj, "choices": [], "usage": _usage(value)})
            else:
                yield _sse(_generation_error(value).body())
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
    state = _state(request)
    chat = chat_job(state, req)
    return await _respond(state, request, req, chat.job, "chat", chat.tools, chat.in_reasoning)


def chat_job(state: ServeState, req: ChatCompletionRequest) -> ChatJob:
    """Template and tokenize a chat request into a job, as /v1/chat/completions does (the
    Anthropic and Responses APIs translate their requests into one); APIError if bad."""
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
        msg = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            msg["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    tools = bool(req.tools) and req.tool_choice != "none"
    extra = {"tools": req.tools} if tools else {}
    tokenizer = state.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except Exception as e:  # the template's raise_exception, or a jinja error
        raise APIError(f"messages: the chat template failed: {e}", param="messages") from None
    # As Hugging Face's apply_chat_template(tokenize=True): the template places any special
    # tokens itself.
    ids = _encode(state, text, "messages", add_special_tokens=False)
    given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    job = _make_job(state, req, ids, getattr(req, given), "messages", given)
    # the tool-call format the template renders is the one the model writes
    fmt = tools and tool_format(tokenizer.chat_template)
    return ChatJob(job, fmt, opens_reasoning(text))


async def completions(req: CompletionRequest, request: Request):
    state = _state(request)
    _check_request(state, req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError("prompt: one prompt per request (n = 1)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _need_tokenizer(state, "send the prompt as token ids")
        ids = _encode(state, prompt, "prompt")
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
    name = _state(request).model_name
    return {
        "object": "list",
        "data": [_model_card(_state(request))],
        # Anthropic's pagination fields: one page
        "has_more": False,
        "first_id": name,
        "last_id": name,
    }


async def model_info(name: str, request: Request):
    state = _state(request)
    if name != state.model_name:
        raise APIError(
            f"the model {name!r} does not exist", 404, param="model", code="model_not_found"
        )
    return _model_card(state)


async def stats(request: Request):
    return stats_body(_state(request))


def stats_body(state: ServeState) -> dict:
    """GET /v1/stats: the server's counters and the expert cache's."""
    engine, model = state.engine, state.model
    cache = getattr(model, "expert_cache", None)
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


# ---- running it ----------------------------------------------------------------------------


def serve(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_name: str | None = None,
    log_level: str = "info",
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    max_tokens_limit: int | None = None,
    max_prompt_tokens: int | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    prompt_cache_size: int = 10,
    prompt_cache_bytes: int = 1 << 30,
    prompt_cache_dir: str | Path | None = None,
    prompt_cache_dir_bytes: int | None = None,
    pipeline: bool = False,
    pipeline_split: str | None = None,
    pipeline_timeout: float = 300.0,
    kv=None,
    config=None,
    **runtime,
) -> None:
    """Load the store at `model_path` with `config` (a RuntimeConfig) and the `runtime`
    options given by name (`read_ahead="demand"`, as load() takes them) and serve it until
    stopped (SIGTERM or Ctrl-C: requests in flight get `shutdown_timeout` seconds).
    `prompt_cache_dir`: the prompt caches also spill to that directory, up to
    `prompt_cache_dir_bytes` (strata_mlx.apps.prompt_cache_dir).
    `pipeline`: this process is a rank of mlx.launch; rank 0 serves HTTP, the others compute
    their layers (strata_mlx.runtime.distributed)."""
    import uvicorn

    from ..runtime.loader import RuntimeConfig, load

    cfg = (config or RuntimeConfig()).replace(**runtime)
    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such store")
    pipe = None
    if pipeline:
        from ..runtime.distributed import Pipeline, serve_stage

        pipe = Pipeline(split=pipeline_split, timeout_s=pipeline_timeout)
    # the prompt caches it keeps (up to prompt_cache_bytes) are memory the arena leaves free
    # (none with several ranks: those keep no prompt caches, below)
    kept = prompt_cache_bytes if prompt_cache_size > 0 and (pipe is None or pipe.size == 1) else 0
    model, tokenizer = load(path, config=cfg, pipeline=pipe, reserve_bytes=kept)
    if pipe is not None and pipe.size > 1:
        if pipe.rank != 0:
            serve_stage(model)
            return
        model.wait_ready()
        prompt_cache_size = 0  # the other ranks hold one sequence's state, not rank 0's picks
    else:
        pipe = None
    app = create_app(
        model,
        tokenizer,
        model_name or path.resolve().name,
        max_tokens,
        max_tokens_limit=max_tokens_limit,
        max_prompt_tokens=max_prompt_tokens,
        max_queue=max_queue,
        api_key=api_key,
        allowed_origins=allowed_origins,
        # after the graceful period uvicorn cancels the requests; their jobs stop at the
        # next token, which this bounds
        shutdown_timeout=min(shutdown_timeout, 2.0),
        kv=kv,
    )
    from ..generation.prompt_cache import PromptCacheLRU

    app.state.engine.prompt_caches = PromptCacheLRU(prompt_cache_size, prompt_cache_bytes)
    if prompt_cache_dir is not None and pipe is None:
        from .prompt_cache_dir import DEFAULT_MAX_BYTES, attach

        attach(app, prompt_cache_dir, prompt_cache_dir_bytes or DEFAULT_MAX_BYTES)
    if pipe is not None:
        _stop_ranks_at_shutdown(app, model)
    try:
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=shutdown_timeout,
        )
    finally:
        if pipe is not None:
            model.close()
        model.expert_cache.close()


def _stop_ranks_at_shutdown(app, model) -> None:
    """Tell the pipeline's other ranks to exit once the app has shut down and its worker is
    idle (uvicorn re-raises SIGTERM after the lifespan, before serve()'s `finally`)."""
    engine = app.state.engine
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            yield state
        if engine._idle.is_set():  # a generation still running owns the ring
            model.close()

    app.router.lifespan_context = lifespan
