"""What stands in front of every request, as ASGI middleware: the Host / Origin check that keeps
a loopback server out of reach of web pages (a page doing DNS rebinding sends its own name as
Host; a cross-site form post sends its own Origin), and the clean end of an event stream that
shutdown cuts (uvicorn cancels what still runs when the grace period ends: the stream gets its
protocol's final error event rather than a bare close), the request body's size limit, and
the connections themselves (a cap, and clients that stop sending: `guarded_http`). Never:
parses a request body or knows an endpoint's schema (a stream registers its own final bytes
with `end_stream_with`)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from fastapi import Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...config import OptionError
from .schemas import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_STREAM_END = "strata_mlx.stream_end"


def is_loopback(host: str) -> bool:
    """Whether the bind address `host` is reachable from this machine only."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The name in a Host header (or an address): port and IPv6 brackets dropped, lowercase."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1 : v.find("]")] if "]" in v else v
    if v.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        v = v.split(":")[0]
    return v.rstrip(".")


def check_host_names(text: str, flag: str = "--allowed-hosts") -> list[str]:
    """The comma-separated host names of `flag`: each a name or an address, without a scheme,
    path or port; OptionError naming the flag otherwise."""
    names = [n.strip() for n in text.split(",")]
    if not any(names):
        raise OptionError(f"{flag} {text!r}: expected host names, e.g. myhost.local,10.0.0.5")
    for n in names:
        if not n or any(c in n for c in "/ @?#") or host_name(n) != n.lower().strip("[]"):
            raise OptionError(f"{flag}: {n!r} is not a host name (no scheme, port or path)")
    return [host_name(n) for n in names]


def check_origins(text: str, flag: str = "--allowed-origins") -> list[str]:
    """The comma-separated origins of `flag` ('*', or scheme://host[:port] as browsers send
    them in Origin); OptionError naming the flag otherwise."""
    origins = [o.strip() for o in text.split(",")]
    if not any(origins):
        raise OptionError(f"{flag} {text!r}: expected origins, e.g. https://app.example")
    for o in origins:
        if o == "*":
            continue
        try:
            parts = urlsplit(o)
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number
        except ValueError:
            parts = None
        if (
            parts is None
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            or parts.path
            or parts.query
            or parts.fragment
            or "@" in parts.netloc
        ):
            raise OptionError(
                f"{flag}: {o!r} is not an origin (expected scheme://host[:port], e.g. "
                "https://app.example, or '*')"
            )
    return origins


class HostGuard:
    """Refuse (403) a request whose Host header names anything but this machine's loopback
    names, the bound host and `allowed_hosts`, or whose Origin header (sent by browsers) is
    neither one of `allowed_origins` nor on such a host. A request without either header (a
    command-line client speaking HTTP/1.0) passes: a browser always sends Host."""

    def __init__(self, app, hosts: list[str], allowed_origins: list[str] | None = None):
        self.app = app
        self.hosts = {host_name(h) for h in hosts}
        self.origins = set(allowed_origins or ())

    def _refusal(self, headers: dict) -> str | None:
        host = headers.get(b"host")
        if host is not None and host_name(host.decode("latin-1")) not in self.hosts:
            return f"Host {host.decode('latin-1')[:100]!r} is not served here"
        origin = headers.get(b"origin")
        if origin is None or "*" in self.origins:
            return None
        origin = origin.decode("latin-1")
        if origin in self.origins:
            return None
        try:
            name = urlsplit(origin).hostname
        except ValueError:
            name = None
        if name is None or host_name(name) not in self.hosts:
            return f"Origin {origin[:100]!r} is not allowed"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self._refusal(dict(scope["headers"]))
            if refusal is not None:
                err = APIError(
                    f"{refusal}: this server answers {', '.join(sorted(self.hosts))} "
                    "(--allowed-hosts and --allowed-origins add more)",
                    403,
                    code="host_not_allowed",
                )
                await err.response(scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _TooLarge(StarletteHTTPException):
    def __init__(self) -> None:
        super().__init__(413, "request body too large")


class BodyLimit:
    """Answer a request whose body is over `limit` bytes 413 with the server's error body: at
    once by its Content-Length, else as it arrives (the handler reading it gets an HTTP 413
    exception, answered by the app's handler). Starlette's own limit answers in plain text."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            await body_too_large(self.limit).response(scope.get("path", ""))(scope, receive, send)
            return
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        await self.app(scope, counted, send)


class JsonBodies:
    """Answer a POST to one of `paths` (the routes that read a JSON body) whose body is not
    sent as JSON 415, naming its content type: FastAPI reads only an application/json (or
    application/*+json) body as JSON and validated any other (curl's -d sends
    application/x-www-form-urlencoded) as a string, "Input should be a valid dictionary".
    Other paths are left to routing (a 404, or a 405 with its Allow header)."""

    def __init__(self, app, paths: set[str]):
        self.app = app
        self.paths = paths  # (filled once the app's routes are added)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            given = dict(scope["headers"]).get(b"content-type", b"")
            kind = given.split(b";")[0].strip().lower()
            main, _, sub = kind.partition(b"/")
            if main != b"application" or not (sub == b"json" or sub.endswith(b"+json")):
                shown = given.decode("latin-1")[:80] or "none"
                await APIError(
                    "the request body must be JSON, sent with Content-Type: application/json "
                    f"(got {shown})",
                    415,
                    code="unsupported_media_type",
                ).response(scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HeadAsGet:
    """HEAD answered wherever GET is, as HTTP asks of a server: the app sees a GET (each
    route declares GET alone, so the schema keeps one operation a route) and the server,
    which still sees the HEAD, sends the response's headers without its body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


def body_too_large(limit: int) -> APIError:
    return APIError(
        f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)",
        413,
        code="request_too_large",
    )


def end_stream_with(request: Request, final: Callable[[], bytes]) -> None:
    """`final()` makes what the response streaming to `request` sends last if shutdown cuts it
    (its protocol's error event, and OpenAI's [DONE]), from what it has sent so far."""
    request.scope[_STREAM_END] = final


class StreamEnd:
    """When the server's shutdown cancels a response that has begun streaming, send the final
    bytes its handler registered (end_stream_with) and end the body, rather than let the
    connection close mid-stream."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "ended": False}

        async def watched_send(message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except asyncio.CancelledError:
            end = scope.get(_STREAM_END)
            if end is None or not state["started"] or state["ended"]:
                raise
            # outside the response's own cancelled task group, the connection still writes
            await send({"type": "http.response.body", "body": end(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


# ---- connections: a cap, and clients that stop sending -----------------------------------------

# A client has this long to send the next bytes of a request's head or body: uvicorn sets no
# limit of its own (it leaves that to a proxy in front), so a client that opens connections and
# sends nothing, or half a head, held each one, and enough of them took every file descriptor.
STALL_S = 30.0


def max_connections() -> int:
    """The open connections a server keeps: half the process's file descriptors (the store,
    the reader and the model hold some), at most 1024, at least 16."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(16, min(1024, soft // 2))


def _busy() -> bytes:
    error = APIError("too many open connections; try again", 503,
                     code="too_many_connections", type="server_error")  # fmt: skip
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def guarded_http(limit: int | None = None, stall_s: float = STALL_S) -> type:
    """uvicorn's h11 protocol with two limits of its own: a connection whose client sends
    nothing for `stall_s` while its request's head or body is due (or, after a response, the
    next request) is closed; past `limit` open connections (max_connections()) a new one
    closes the one that has waited on its client the longest since it last sent, or where
    every one has its request in (head and body) is answered 503 and closed. A request whose
    body is in is never cut."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    limit = limit or max_connections()
    busy = _busy()

    class GuardedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            self.last_data = time.monotonic()
            self.stall_timer = None
            super().connection_made(transport)
            # (a connection closed here stays in the set until its close completes)
            live = [c for c in self.connections if not c.transport.is_closing()]
            if len(live) > limit:
                # (getattr: a connection upgraded to another protocol is not one of these)
                waiting = [c for c in live if c is not self and getattr(c, "waiting", None)]
                waiting = [c for c in waiting if c.waiting()]
                if not waiting:
                    transport.write(busy)
                    transport.close()
                    return
                # abort: a close would wait for bytes a client that reads nothing never takes
                min(waiting, key=lambda c: c.last_data).transport.abort()
            self.stall_timer = self.loop.call_later(stall_s, self.check_stall)

        def data_received(self, data: bytes) -> None:
            self.last_data = time.monotonic()
            super().data_received(data)

        def on_response_complete(self) -> None:
            # the client's turn begins: its quiet time counts from here, not from the bytes
            # of a request the app held for longer than stall_s
            self.last_data = time.monotonic()
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            if self.stall_timer is not None:
                self.stall_timer.cancel()
                self.stall_timer = None
            super().connection_lost(exc)

        def waiting(self) -> bool:
            """Whether the request's head or body (or the next request) is due from the
            client, and this side is reading."""
            return self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not (
                self.flow is not None and self.flow.read_paused
            )

        def check_stall(self) -> None:
            quiet = time.monotonic() - self.last_data
            if quiet >= stall_s and self.waiting():
                self.stall_timer = None
                self.transport.abort()  # (it owes the client nothing: see connection_made)
            else:
                self.stall_timer = self.loop.call_later(
                    stall_s - quiet if quiet < stall_s else stall_s, self.check_stall
                )

    return GuardedH11
