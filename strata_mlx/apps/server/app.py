"""The FastAPI app (create_app: middleware, handlers, the dashboard) and `serve`, which runs
it under uvicorn for one loaded model. Never: handles a request itself (routes does)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...config import (
    DEFAULT_DECODE_CONCURRENCY,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPT_CONCURRENCY,
    DEFAULT_SHUTDOWN_TIMEOUT,
    OptionError,
)
from ...stream.memory import MemoryGuardError
from ..dashboard import add_routes
from .engine import Engine, ServeState
from .guard import (
    LOOPBACK_NAMES,
    BodyLimit,
    HeadAsGet,
    HostGuard,
    JsonBodies,
    StreamEnd,
    is_loopback,
)
from .routes import (
    api_error,
    chat_completions,
    completions,
    http_error,
    internal_error,
    invalid_request,
    model_info,
    models,
    stats,
    stats_body,
)
from .schemas import APIError

FALLBACK_CONTEXT = 8192  # the limits' default for a model whose config names no context


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
            page = scope.get("path", "") == "/" or scope.get("path", "").startswith("/dashboard")
            if not self._ok(auth, page):
                challenge = 'Basic realm="strata-mlx dashboard"' if page else "Bearer"
                err = APIError(
                    "missing or incorrect API key: send Authorization: Bearer <key>",
                    401,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": challenge},
                )
                await err.response(scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def chars_per_token(tokenizer) -> int | None:
    """The most characters one token can stand for, where the tokenizer bounds it: byte-level
    BPE without a normalizer puts every byte of the text in exactly one token, none longer than
    its longest vocabulary entry. None otherwise (a word-level tokenizer's unknown token stands
    for a word of any length)."""
    import json

    tok = getattr(tokenizer, "_tok", None)
    if tok is None:
        return None
    spec = json.loads(tok.to_str())
    byte_level = '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer"))
    if spec.get("model", {}).get("type") != "BPE" or spec.get("normalizer") or not byte_level:
        return None
    return max(len(t) for t in tok.get_vocab(with_added_tokens=True))


def named_context(model) -> int | None:
    """The model's context length (max_position_embeddings), None if its config names none."""
    return context_of(getattr(model, "args", None))


def context_of(args) -> int | None:
    """The context length ModelArgs `args` name (max_position_embeddings), or None."""
    n = getattr(args, "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def model_context(model) -> int:
    """The model's context length (max_position_embeddings), FALLBACK_CONTEXT if unnamed."""
    return named_context(model) or FALLBACK_CONTEXT


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
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    bound_host: str = "127.0.0.1",
    allowed_hosts: list[str] | None = None,
    decode_concurrency: int = DEFAULT_DECODE_CONCURRENCY,
    prompt_concurrency: int = DEFAULT_PROMPT_CONCURRENCY,
):
    """The FastAPI app serving `model` under the name `model_name`.

    `max_tokens_limit` and `max_prompt_tokens` default to the model's context; at most
    `max_queue` requests wait behind the running one. With `api_key`, requests need it as a
    bearer token; `allowed_origins` (e.g. ["https://app.example"], or ["*"]) are answered
    CORS headers. At shutdown, generation still running is cancelled and waited for up to
    `shutdown_timeout` seconds. `kv` (prompt_cache.KVOptions: mlx-lm's --max-kv-size,
    --kv-bits, ...) shapes every generation's KV cache; a family that cannot take it is
    refused here, before anything is served. A request body over `max_body_bytes` is a 413.
    Served on a loopback address (`bound_host`), or with `allowed_hosts`, a request whose Host
    is not this machine's loopback names, the bound host or one of `allowed_hosts` is a 403,
    and so is one whose Origin is neither on such a host nor in `allowed_origins` (a web page
    cannot reach the server through DNS rebinding). `decode_concurrency` requests decode
    together, stepped as one batch (strata_mlx.generation.batch; 1: one at a time), and
    `prompt_concurrency` of them prefill a chunk between two steps."""
    from ...generation.prompt_cache import make_prompt_cache
    from .. import anthropic_api, responses_api  # they build on this package's request models

    engine = Engine(model, tokenizer, max_queue, kv, decode_concurrency, prompt_concurrency)
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
        context=named_context(model),
    )
    most = chars_per_token(tokenizer)
    state.max_prompt_chars = None if most is None else most * state.max_prompt_tokens

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.close, shutdown_timeout)

    app = FastAPI(title="strata-mlx", lifespan=lifespan)
    app.state.serve = state
    app.state.max_body_bytes = max_body_bytes
    app.state.engine = engine
    # Starlette runs the last middleware added first: a stream cut at shutdown is ended
    # cleanly, a foreign Host or Origin is refused before anything else, CORS answers
    # preflights (which carry no credentials) before the key is checked, and adds its headers
    # to 401s too; a body not sent as JSON is refused once the key is checked.
    json_paths: set[str] = set()  # (the POST routes', once they are added below)
    app.add_middleware(JsonBodies, paths=json_paths)
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
    if is_loopback(bound_host) or allowed_hosts:
        hosts = [*LOOPBACK_NAMES, bound_host, *(allowed_hosts or ())]
        app.add_middleware(HostGuard, hosts=hosts, allowed_origins=allowed_origins)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(StreamEnd)
    app.add_middleware(HeadAsGet)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/completions")(completions)
    anthropic_api.add_routes(app)  # POST /v1/messages
    responses_api.add_routes(app)  # POST /v1/responses
    app.get("/v1/models")(models)
    app.get("/v1/models/{name:path}")(model_info)
    app.get("/v1/stats")(stats)
    app.get("/stats")(stats)
    # GET /dashboard, and / sends a browser there
    app.state.dashboard = add_routes(app, model, engine, lambda: stats_body(state))
    app.get("/", include_in_schema=False)(_to_dashboard)
    json_paths.update(r.path for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods)
    return app


async def _to_dashboard():
    from fastapi.responses import RedirectResponse

    return RedirectResponse("/dashboard")


def model_id(path: Path) -> str:
    """The id clients ask for: the store's name as the user gave it (`./q3` is "q3" even
    where q3 is a link to another folder), its resolved name only for "." and the like."""
    return path.name if path.name not in ("", ".", "..") else path.resolve().name


@dataclass
class KVReserve:
    """The KV caches serve's memory guard counts beside the model: `sequences` of
    `positions` positions each, `bytes` in all."""

    sequences: int
    positions: int
    bytes: int


def kv_reserve(
    path: str | Path,
    decode_concurrency: int,
    kv=None,
    max_prompt_tokens: int | None = None,
    max_tokens_limit: int | None = None,
) -> KVReserve:
    """What decoding requests may hold at once: `decode_concurrency` KV caches, each as long as
    a request may grow (its prompt and answer within the model's context; a rotating cache's
    --max-kv-size), at the store's dtype or --kv-bits."""
    from ...runtime.loader import sequence_kv_bytes, store_args

    context = context_of(store_args(path))
    most = context or FALLBACK_CONTEXT
    longest = (max_prompt_tokens or most) + (max_tokens_limit or most)
    positions = min(longest, context) if context else longest
    bits, group = None, 64
    if kv is not None:
        if kv.max_kv_size:
            positions = min(positions, kv.max_kv_size)
        bits, group = kv.kv_bits, kv.kv_group_size
    per = sequence_kv_bytes(path, positions, bits, group)
    return KVReserve(decode_concurrency, positions, decode_concurrency * per)


def started_lines(
    name: str,
    path: Path,
    model,
    host: str,
    port: int,
    decode_concurrency: int = 1,
    kv_reserved: KVReserve | None = None,
    automatic_arena: bool = False,
    kept_bytes: int = 0,
    concurrency_chosen: bool = False,
) -> list[str]:
    """What serve prints once the model is loaded: the model, its arena (`automatic_arena`:
    sized by load() from memory, after the KV caches and the `kept_bytes` of prompt caches
    serve holds beside it), the KV caches its memory guard counted, how many requests decode
    together (`concurrency_chosen`: serve halved the default until the caches fit) and whether
    their experts fit, where to reach it."""
    cache = model.expert_cache
    record = cache.manifest.layout.record_bytes
    slots = cache.arena.n_slots
    total = cache.manifest.num_experts * len(cache.layers)
    share = 100 * min(slots, total) / max(total, 1)
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    lines = [
        f"strata-mlx: serving {name!r} ({path})",
        f"  arena {slots * record / 2**30:.3f} GiB: {slots} expert slots, {share:.0f} % of "
        "the experts resident at once",
    ]
    if automatic_arena:
        lines.append(_automatic_arena_line(slots, total, record, kv_reserved, kept_bytes))
    if kv_reserved is not None:
        r = kv_reserved
        lines.append(
            f"  memory counted for {r.sequences} KV cache{'s' if r.sequences > 1 else ''} of "
            f"{r.positions} positions ({r.bytes / 2**30:.3f} GiB: --decode-concurrency x "
            "the longest request)"
        )
    top_k = getattr(model.args, "num_experts_per_tok", None)
    if decode_concurrency > 1 and top_k:
        # a step's union of experts, every MoE layer's; past the arena each step evicts
        # what the next needs (docs/benchmarks.md, "Does batching decodes share reads?")
        experts, layers = cache.manifest.num_experts, len(cache.layers)
        need = min(decode_concurrency * top_k, experts) * layers
        alone = min(top_k, experts) * layers  # (fewer requests help only down to this)
        note = ""
        if need > slots:
            note = (
                " (more than the arena's slots: try a lower --decode-concurrency)"
                if alone <= slots
                else " (more than the arena's slots, as one request's step alone)"
            )
        lines.append(
            f"  up to {decode_concurrency} requests decode together: a step uses up to "
            f"{need} experts{note}"
        )
    lines.append(f"  OpenAI-compatible API at {base}/v1   dashboard: {base}/dashboard")
    r = kv_reserved
    if concurrency_chosen and r is not None and r.sequences < DEFAULT_DECODE_CONCURRENCY:
        lines.append(
            f"  --decode-concurrency {r.sequences}: the KV caches of "
            f"{DEFAULT_DECODE_CONCURRENCY} requests do not fit beside the model "
            "(--decode-concurrency, --max-kv-size or --kv-bits to choose)"
        )
    return lines


def _automatic_arena_line(
    slots: int, total: int, record: int, kv_reserved: KVReserve | None, kept_bytes: int
) -> str:
    """Why the automatic arena has its size: load() gives it what memory leaves after the
    dense weights, a prefill chunk's scratch and what serve holds beside the model (the
    decoding requests' KV caches, the kept prompt caches): how many slots those took."""
    beside = []
    if kv_reserved is not None and kv_reserved.bytes:
        n = kv_reserved.sequences
        beside.append(f"{n} KV cache{'s' if n > 1 else ''} ({kv_reserved.bytes / 2**30:.3f} GiB)")
    if kept_bytes:
        beside.append(f"kept prompt caches ({kept_bytes / 2**30:.3f} GiB)")
    if slots >= total:
        return "  automatic arena: every expert fits" + (
            f", with {' and '.join(beside)} beside the model" if beside else ""
        )
    held = " and ".join(beside) or "nothing else"
    taken = (kv_reserved.bytes if kv_reserved is not None else 0) + kept_bytes
    # they come out of the arena's share (loader.auto_arena_bytes, memory.fit_arena)
    more = min(taken // record, total - slots)
    return (
        f"  automatic arena: memory less the dense weights, a prefill chunk's scratch and "
        f"{held}; without those it could hold up to {more} more expert slots (lower "
        "--decode-concurrency, --max-prompt-tokens or --prompt-cache-bytes, use --max-kv-size "
        "or --kv-bits, or choose --arena-gb)"
    )


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
    allowed_hosts: list[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
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
    decode_concurrency: int | None = None,
    prompt_concurrency: int = DEFAULT_PROMPT_CONCURRENCY,
    **runtime,
) -> None:
    """Load the store at `model_path` with `config` (a RuntimeConfig) and the `runtime`
    options given by name (`read_ahead="demand"`, as load() takes them) and serve it until
    stopped (SIGTERM or Ctrl-C: requests in flight get `shutdown_timeout` seconds).
    `pipeline`: this process is a rank of mlx.launch; rank 0 serves HTTP, the others compute
    their layers (strata_mlx.runtime.distributed). `prompt_cache_dir`: the prompt caches also
    spill to that directory, up to `prompt_cache_dir_bytes` (strata_mlx.apps.prompt_cache_dir).
    `decode_concurrency` None: DEFAULT_DECODE_CONCURRENCY, halved until the requests' KV caches
    fit beside the model (a number given is kept, or refused)."""

    from ...runtime.loader import RuntimeConfig

    cfg = (config or RuntimeConfig()).replace(**runtime)
    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such directory (expected a strata-mlx store)")
    pipe = None
    if pipeline:
        from ...runtime.distributed import Pipeline, serve_stage

        pipe = Pipeline(split=pipeline_split, timeout_s=pipeline_timeout)
    # before the model loads: a port in use is one line at once (rank 0 alone serves HTTP)
    sock = _bind(host, port) if pipe is None or pipe.rank == 0 else None
    # the prompt caches it keeps (up to prompt_cache_bytes) are memory the arena leaves free
    # (none with several ranks: those keep no prompt caches, below)
    kept = prompt_cache_bytes if prompt_cache_size > 0 and (pipe is None or pipe.size == 1) else 0
    model, tokenizer, reserved = _load_counting_kv(
        path, cfg, pipe, kept, decode_concurrency, kv, max_prompt_tokens, max_tokens_limit
    )
    if pipe is not None and pipe.size > 1:
        if pipe.rank != 0:
            serve_stage(model)
            return
        model.wait_ready()
        prompt_cache_size = 0  # the other ranks hold one sequence's state, not rank 0's picks
    else:
        pipe = None
    name = model_name or model_id(path)
    app = create_app(
        model,
        tokenizer,
        name,
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
        max_body_bytes=max_body_bytes,
        bound_host=host,
        allowed_hosts=allowed_hosts,
        # the other ranks of a pipeline hold one sequence's state
        decode_concurrency=1 if pipe is not None or reserved is None else reserved.sequences,
        prompt_concurrency=prompt_concurrency,
    )
    from ...generation.prompt_cache import PromptCacheLRU

    app.state.engine.prompt_caches = PromptCacheLRU(prompt_cache_size, prompt_cache_bytes)
    if prompt_cache_dir is not None and pipe is None:
        from ..prompt_cache_dir import DEFAULT_MAX_BYTES, attach

        attach(app, prompt_cache_dir, prompt_cache_dir_bytes or DEFAULT_MAX_BYTES)
    if pipe is not None:
        _stop_ranks_at_shutdown(app, model)
    engine = app.state.engine
    lines = started_lines(
        name, path, model, host, port, engine.decode_concurrency, reserved,
        automatic_arena=cfg.arena_gb is None, kept_bytes=kept,
        concurrency_chosen=decode_concurrency is None,
    )  # fmt: skip
    _announce(lines, host, api_key)
    try:
        _run(app, sock, log_level, shutdown_timeout)
    finally:
        sock.close()
        # the lifespan's shutdown closes the engine; where uvicorn failed before its lifespan
        # began, its worker would keep the process from exiting (a second close only waits)
        engine.close(timeout=min(shutdown_timeout, 2.0))
        if pipe is not None:
            model.close()
        model.expert_cache.close()


def _announce(lines: list[str], host: str, api_key: str | None) -> None:
    """The started lines on stdout; on stderr, a server any address reaches without a key."""
    print("\n".join(lines), flush=True)
    if api_key is None and not is_loopback(host):
        print(
            f"warning: --host {host} without --api-key: anyone who reaches this address can "
            "use the server",
            file=sys.stderr,
            flush=True,
        )


def _run(app, sock, log_level: str, shutdown_timeout: float) -> None:
    """uvicorn serving `app` on `sock` until shutdown, through the guarded h11 protocol."""
    import uvicorn

    from .guard import guarded_http

    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout,
        http=guarded_http(),
        ws="none",  # (no websocket routes: no connection leaves the guarded protocol)
    )
    uvicorn.Server(config).run(sockets=[sock])


def _load_counting_kv(
    path: Path,
    cfg,
    pipe,
    kept: int,
    decode_concurrency: int | None,
    kv,
    max_prompt_tokens,
    max_tokens_limit,
):
    """load() with the memory guard counting `kept` bytes of prompt caches and the KV caches
    of the requests decoding at once (kv_reserve): (model, tokenizer, the KVReserve or None).
    A refusal names --decode-concurrency."""
    from ...generation.generate import load

    # a pipeline's ranks hold one sequence's caches, split by layers: not counted here
    if pipe is not None:
        return (*load(path, config=cfg, pipeline=pipe, reserve_bytes=kept), None)
    n = decode_concurrency or DEFAULT_DECODE_CONCURRENCY
    one = kv_reserve(path, 1, kv, max_prompt_tokens, max_tokens_limit)
    while True:
        reserved = KVReserve(n, one.positions, n * one.bytes)
        try:
            model, tokenizer = load(path, config=cfg, reserve_bytes=kept + reserved.bytes)
            return model, tokenizer, reserved
        except MemoryGuardError as e:
            if decode_concurrency is None and n > 1:
                n //= 2  # not asked for: fewer requests decode together
                continue
            raise MemoryGuardError(
                f"--decode-concurrency {n}: {reserved.sequences} KV caches of "
                f"{reserved.positions} positions ({reserved.bytes / 2**30:.2f} GiB) are "
                f"counted; {e}; or lower --decode-concurrency, --max-prompt-tokens or "
                "--max-tokens-limit, or use --max-kv-size or --kv-bits"
            ) from None


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port`, as uvicorn would make it; OptionError naming the
    flags when the host is unknown or the port taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as e:
        raise OptionError(f"--host {host!r}: not an address of this machine ({e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        sock.close()
        raise OptionError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror})"
        ) from None
    sock.set_inheritable(True)
    return sock


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
