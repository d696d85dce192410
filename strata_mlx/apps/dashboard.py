"""`/dashboard` of `strata-mlx serve`: a live page of the served model's expert cache.

Owns the page (strata_mlx/apps/dashboard.html: plain HTML and JavaScript, no build step) and the
JSON it polls, /dashboard/data:

- "stats": the body of /v1/stats itself (the cache's session counters, the server's), so the
  page shows exactly what the stats endpoint says;
- "layers": per MoE layer, experts resident in the arena and the hits / streamed-ahead /
  misses of its lookups since the server started (plots.LayerCounts, which reads the cache's
  own counters around its per-layer entry points; they add up to "stats");
- "rates": drive GB/s and generated tokens/s, the change of those counters over the last
  few seconds of polls;
- "request": the running (or last) request's prompt and generation tok/s as generation
  measures them.

With --api-key the page and its feed need the key like every route.

Never changes what the cache does, never reads the store, and never blocks on generation:
everything here is read from the event loop while the worker thread generates.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Awaitable, Callable
from importlib import resources

from .plots import LayerCounts

WINDOW_S = 3.0  # rates are averaged over the polls of the last few seconds


class Dashboard:
    """Per-layer counters attached to the model's `expert_cache` (None: a model without one)
    when the server starts, and the recent samples of the cache's byte and token counters
    that rates are taken from."""

    def __init__(self, expert_cache, engine, stats: Callable[[], Awaitable[dict] | dict]):
        self.cache = expert_cache
        self.engine = engine
        self.stats = stats
        # attached before any request: its per-layer sums equal the session counters
        self.layers = LayerCounts(self.cache) if self.cache is not None else None
        self.num_experts = self.cache.manifest.num_experts if self.cache is not None else 0
        self._samples: deque[tuple[float, int, int]] = deque()

    def _resident(self) -> dict[int, int]:
        """Experts of each layer holding a slot (read in flight included, as /v1/stats's
        arena.resident counts them)."""
        out = dict.fromkeys(self.cache.layers, 0)
        for layer, _ in list(self.cache.arena.slot_of):  # list(): one atomic copy
            out[layer] = out.get(layer, 0) + 1
        return out

    def _rates(self, bytes_read: int, tokens: int) -> dict:
        now = time.monotonic()
        s = self._samples
        s.append((now, bytes_read, tokens))
        while len(s) > 2 and now - s[1][0] >= WINDOW_S:  # keep one sample older than the window
            s.popleft()
        t0, b0, n0 = s[0]
        dt = now - t0
        return {
            "window_s": dt,
            "drive_gb_per_s": (bytes_read - b0) / dt / 1e9 if dt > 0 else 0.0,
            "tokens_per_s": (tokens - n0) / dt if dt > 0 else 0.0,
        }

    async def data(self) -> dict:
        stats = self.stats()
        if inspect.isawaitable(stats):  # the server's stats route is a coroutine
            stats = await stats
        ec = stats.get("expert_cache") or {}
        layers = []
        if self.layers is not None:
            counts, resident = self.layers.open(), self._resident()
            for layer in sorted(resident):
                hits, ahead, misses = counts.get(layer, [0, 0, 0])
                lookups = hits + ahead + misses
                layers.append(
                    {
                        "layer": layer,
                        "resident": resident[layer],
                        "experts": self.num_experts,
                        "hits": hits,
                        "streamed_ahead": ahead,
                        "misses": misses,
                        "lookups": lookups,
                        "hit_rate": (hits + ahead) / lookups if lookups else None,
                    }
                )
        last = getattr(self.engine, "last", None)
        request = None
        if last is not None:
            request = {
                "prompt_tokens": last.prompt_tokens,
                "prompt_tps": last.prompt_tps,
                "generation_tokens": last.generation_tokens,
                "generation_tps": last.generation_tps,
            }
        return {
            "time": time.time(),
            "stats": stats,
            "layers": layers,
            "rates": self._rates(ec.get("bytes_read", 0), stats["server"]["completion_tokens"]),
            "request": request,
        }


def page() -> str:
    return resources.files(__package__).joinpath("dashboard.html").read_text()


def add_routes(app, model, engine, stats: Callable[[], Awaitable[dict] | dict]) -> Dashboard:
    """GET /dashboard (the page) and GET /dashboard/data (what it shows) on `app`."""
    from fastapi.responses import HTMLResponse

    board = Dashboard(model.expert_cache, engine, stats)
    html = page()

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard():
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data():
        return await board.data()

    return board
