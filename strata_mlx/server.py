"""`strata-mlx serve`: an OpenAI-compatible HTTP server for one model (FastAPI + uvicorn).

Endpoints: POST /v1/chat/completions, POST /v1/completions (both streaming as SSE or not),
GET /v1/models, GET /v1/stats (also /stats) with the expert cache's counters.

One model, one expert cache, one KV cache per request: generation runs on a single worker
thread, so requests queue and never share state, and the event loop stays free to accept and
stream. Bad requests are answered 400 with an OpenAI-style error body
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import typer
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .generate import stop_holdback

DEFAULT_MAX_TOKENS = 512

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


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def unsupported(self) -> list[tuple[str, bool]]:
        """(parameter, set to something this server does not do)."""
        return [
            ("n", self.n != 1),
            ("presence_penalty", self.presence_penalty != 0),
            ("frequency_penalty", self.frequency_penalty != 0),
        ]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False

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
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = (
            message,
            status,
            param,
            code,
            type,
        )

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
        return JSONResponse(self.body(), status_code=self.status)


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
        return APIError(f"missing required parameter: {param}", param=param, code="missing")
    return APIError(f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


# ---- generation ----------------------------------------------------------------------------


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    temp: float
    top_p: float
    seed: int | None
    stop: list[str]


@dataclass
class Result:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class Engine:
    """Runs generation jobs one at a time on a single worker thread."""

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-generate")
        self._lock = threading.Lock()  # belt and braces: one generation at a time
        self.requests = 0
        self.queued = 0
        self.active = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.served = None  # ExpertStats summed over requests, with their wall time and tokens

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def run(
        self,
        job: Job,
        on_text: Callable[[str], None] | None = None,
        cancelled: threading.Event | None = None,
    ) -> Result:
        """Generate on the calling thread (the worker). Stop strings are matched here on the
        whole text so far; with `on_text`, text that may begin a stop string is held back."""
        from .generate import stream_generate

        with self._lock:
            self.queued -= 1
            self.active += 1
            try:
                return self._run(job, on_text, cancelled, stream_generate)
            finally:
                self.active -= 1

    def _run(self, job, on_text, cancelled, stream_generate) -> Result:
        self.requests += 1
        self.prompt_tokens += len(job.ids)
        if job.max_tokens == 0:
            return Result("", "length", len(job.ids), 0)
        stops = [s for s in job.stop if s]
        longest = max((len(s) for s in stops), default=0)
        text, emitted, n, finish, r = "", 0, 0, None, None
        gen = stream_generate(
            self.model,
            self.tokenizer,
            job.ids,
            max_tokens=job.max_tokens,
            temp=job.temp,
            top_p=job.top_p,
            seed=job.seed,
        )
        with contextlib.closing(gen):
            for r in gen:
                n += 1
                start = max(0, len(text) - longest + 1)
                text += r.text
                finish = r.finish_reason
                if stops:
                    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
                    if hits:
                        text, finish = text[: min(hits)], "stop"
                if on_text is not None:
                    safe = len(text) if finish else len(text) - stop_holdback(text, stops)
                    if safe > emitted:
                        on_text(text[emitted:safe])
                        emitted = safe
                if finish is not None or (cancelled is not None and cancelled.is_set()):
                    break
        self.completion_tokens += n
        if r is not None and r.expert_stats is not None:
            if self.served is None:
                self.served = r.expert_stats.copy()
            else:
                self.served.add(r.expert_stats)
        return Result(text, finish or "length", len(job.ids), n)

    async def complete(self, job: Job) -> Result:
        loop = asyncio.get_running_loop()
        self.queued += 1
        return await loop.run_in_executor(self._executor, self.run, job)

    async def stream(self, job: Job) -> AsyncIterator[tuple[str, object]]:
        """("text", str) events as they come, then ("done", Result) or ("error", exc)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (server shutting down)
                cancelled.set()

        def work() -> None:
            try:
                if cancelled.is_set():  # the client left while queued
                    self.queued -= 1
                    return
                put(("done", self.run(job, lambda s: put(("text", s)), cancelled)))
            except Exception as e:  # noqa: BLE001 - reported to the client as an error event
                put(("error", e))

        self.queued += 1
        loop.run_in_executor(self._executor, work)
        try:
            while True:
                kind, value = await queue.get()
                yield kind, value
                if kind != "text":
                    return
        finally:
            cancelled.set()


# ---- the app -------------------------------------------------------------------------------


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def _usage(r: Result) -> dict:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }


def create_app(model, tokenizer, model_name: str, default_max_tokens: int = DEFAULT_MAX_TOKENS):
    """The FastAPI app serving `model` under the name `model_name`."""
    engine = Engine(model, tokenizer)
    created = int(time.time())
    vocab = model.args.vocab_size

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = FastAPI(title="strata-mlx", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(str(exc.detail), exc.status_code, type=kind).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return APIError(msg, 500, type="server_error").response()

    def check_request(req: _Sampling) -> None:
        for param, bad in req.unsupported():
            if bad:
                raise APIError(
                    f"{param}: not supported by this server", param=param, code="unsupported"
                )
        if req.model is not None and req.model != model_name:
            raise APIError(
                f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                404,
                param="model",
                code="model_not_found",
            )

    def need_tokenizer(what: str) -> None:
        if tokenizer is None:
            raise APIError(f"{model_name}: the model has no tokenizer; {what}")

    def make_job(req: _Sampling, ids: list[int], max_tokens: int | None) -> Job:
        if not ids:
            raise APIError("the prompt is empty", param="prompt")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise APIError(f"prompt token id {bad[0]} outside [0, {vocab})", param="prompt")
        temp = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        if top_p == 0.0:
            temp = 0.0  # nucleus of zero mass: the most likely token
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return Job(
            ids=ids,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temp=temp,
            top_p=top_p,
            seed=req.seed,
            stop=stop,
        )

    async def respond(req: _Sampling, job: Job, kind: str):
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if kind == "chat" else "text_completion"
        head = {"id": rid, "created": int(time.time()), "model": model_name}

        if not req.stream:
            r = await engine.complete(job)
            if kind == "chat":
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": r.text},
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
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

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            c = {**head, "object": chunk_obj, "choices": [choice]}
            if include_usage:
                c["usage"] = None
            return c

        async def events():
            if kind == "chat":
                yield _sse(chunk(None, None, first=True))
            async for ev, value in engine.stream(job):
                if ev == "text":
                    yield _sse(chunk(value, None))
                elif ev == "done":
                    yield _sse(chunk(None, value.finish_reason))
                    if include_usage:
                        yield _sse(
                            {**head, "object": chunk_obj, "choices": [], "usage": _usage(value)}
                        )
                else:
                    msg = str(value).splitlines()[0] if str(value) else type(value).__name__
                    yield _sse(APIError(msg, 500, type="server_error").body())
            yield b"data: [DONE]\n\n"

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        check_request(req)
        need_tokenizer("use /v1/completions with token ids")
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
            messages.append(msg)
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # the template's raise_exception, or a jinja error
            raise APIError(f"messages: the chat template failed: {e}", param="messages") from None
        # As Hugging Face's apply_chat_template(tokenize=True): the template places any special
        # tokens itself.
        ids = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        return await respond(req, make_job(req, ids, max_tokens), "chat")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_request(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError("prompt: one prompt per request (n = 1)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            need_tokenizer("send the prompt as token ids")
            ids = tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        return await respond(req, make_job(req, ids, req.max_tokens), "completion")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "strata-mlx"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str):
        if name != model_name:
            raise APIError(
                f"the model {name!r} does not exist", 404, param="model", code="model_not_found"
            )
        return model_card()

    async def stats():
        cache = getattr(model, "expert_cache", None)
        body = {
            "model": model_name,
            "server": {
                "requests": engine.requests,
                "active": engine.active,
                "queued": max(engine.queued, 0),
                "prompt_tokens": engine.prompt_tokens,
                "completion_tokens": engine.completion_tokens,
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

    app.get("/v1/stats")(stats)
    app.get("/stats")(stats)
    return app


# ---- running it ----------------------------------------------------------------------------


def serve(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_name: str | None = None,
    log_level: str = "info",
    **runtime,
) -> None:
    """Load the store at `model_path` with RuntimeConfig(**runtime) and serve it until stopped."""
    import uvicorn

    from .loader import RuntimeConfig, load

    try:
        cfg = RuntimeConfig(**runtime)
    except TypeError as e:
        raise ValueError(f"serve: {e}") from None
    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such store")
    model, tokenizer = load(path, config=cfg)
    app = create_app(model, tokenizer, model_name or path.resolve().name)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        model.expert_cache.close()


def serve_command(
    model: Path | None = typer.Option(
        None, "--model", help="A strata-mlx store (default: the built-in model)."
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port"),
    model_name: str | None = typer.Option(
        None, "--model-name", help="The name clients ask for (default: the store's folder name)."
    ),
    arena_gb: float | None = typer.Option(
        None, "--arena-gb", help="Arena size (default: from memory)."
    ),
    io_workers: int = typer.Option(8, "--io-workers"),
    read_ahead: str = typer.Option("lookahead", "--read-ahead", help="demand | static | lookahead"),
    prefill_step_size: int | None = typer.Option(None, "--prefill-step-size"),
    log_level: str = typer.Option("info", "--log-level"),
):
    """Serve a store over an OpenAI-compatible HTTP API (chat and text completions)."""
    if not 0 < port < 65536:
        raise ValueError(f"--port {port}: must lie in [1, 65535]")
    if arena_gb is not None and arena_gb <= 0:
        raise ValueError(f"--arena-gb {arena_gb}: must be positive")
    if io_workers < 1:
        raise ValueError(f"--io-workers {io_workers}: must be at least 1")
    if model is None:
        from .default_model import DEFAULT_ARENA_GB, default_store

        model = default_store()
        model_name = model_name or "smollm2-135m-instruct-split"
        arena_gb = DEFAULT_ARENA_GB if arena_gb is None else arena_gb
    serve(
        model,
        host=host,
        port=port,
        model_name=model_name,
        log_level=log_level,
        arena_gb=arena_gb,
        io_workers=io_workers,
        read_ahead=read_ahead,
        prefill_step_size=prefill_step_size,
    )
