"""The engine: one worker thread that runs generation for queued jobs, so the event loop stays
free: one job at a time (`decode_concurrency` 1), or up to `decode_concurrency` decoding
together in steps (strata_mlx.generation.batch), joining and leaving between steps; the queue
bound, cancellation of jobs whose client left, and the shutdown drain. ServeState: what the
handlers read. Never: parses HTTP requests (routes does)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from ...config import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_SHUTDOWN_TIMEOUT,
)
from ...generation.sampling import SamplingOptions
from ...runtime.experts import PrefillStopped, stoppable
from .schemas import APIError

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
    """Runs generation jobs on a single worker thread, behind a bounded queue: one at a time,
    or with `decode_concurrency` > 1 that many at once, stepped together.

    Every job carries a cancel event, set when its client disconnects or its request task is
    cancelled (shutdown); the worker checks it before starting the job, at each MoE layer of
    a prefill forward (runtime.experts.stoppable: a long prompt stops inside its chunk) and after
    every token.
    Counters are changed by the event loop and the worker, under `_counts`.
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_queue: int = DEFAULT_MAX_QUEUE,
        kv=None,
        decode_concurrency: int = 1,
        prompt_concurrency: int = 1,
    ):
        from ...generation.prompt_cache import KVOptions

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
        from ...generation.prompt_cache import PromptCacheLRU

        # The last conversations' KV / recurrent state: a request that extends one prefills
        # only what is new (mlx-lm server's prompt cache). Touched by the worker thread only.
        self.prompt_caches = PromptCacheLRU()
        self.prefilled_tokens = 0  # prompt tokens run through the model (reused ones are not)
        self.decode_concurrency = decode_concurrency
        self.batch = None  # the BatchGenerator, when jobs are stepped together
        if decode_concurrency > 1:
            from ...generation.batch import BatchGenerator

            self.batch = BatchGenerator(
                model, tokenizer, decode_concurrency, prompt_concurrency, kv=self.kv
            )
            self._steps = StepLoop(self, self.batch)
            self._executor.submit(self._steps.run)

    def close(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> bool:
        """Cancel every job, queued or running, and wait up to `timeout` seconds for the
        worker to stop; returns whether it did. A second call only waits."""
        from ...runtime.threads import end_mlx_thread

        with self._counts:
            again = self._closing.is_set()
            self._closing.set()
        if again:  # only waits: a shut-down executor refuses any task
            return self._idle.wait(timeout)
        if self.batch is not None:
            self._steps.put(None)  # wakes the step loop, which then ends
        # Jobs still queued return at once (`_work`); the worker's last task ends its MLX
        # streams, as MLX requires of a thread before the process exits.
        self._executor.submit(end_mlx_thread)
        self._executor.shutdown(wait=False)
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
            # it would wait behind them (decode_concurrency run at once)
            if self.queued + self.active >= self.max_queue + self.decode_concurrency:
                self.rejected += 1
                wait = self.retry_after()
                raise APIError(
                    f"too many requests: {self.queued} waiting and {self.active} running, "
                    f"as many as this server takes (--max-queue {self.max_queue} beyond "
                    f"--decode-concurrency {self.decode_concurrency}); retry after {wait} s",
                    429,
                    code="queue_full",
                    type="rate_limit_error",
                    headers={"Retry-After": str(wait)},
                )
            self.queued += 1
        if self.batch is not None:
            done: Future = Future()
            self._steps.put((job, on_text, cancelled, done))
            return asyncio.wrap_future(done)
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
        from ...generation.generate import stream_generate

        t0 = time.perf_counter()
        self.requests += 1
        self.prompt_tokens += len(job.ids)
        if job.max_tokens == 0:
            return Result("", "length", len(job.ids), 0)
        text, n, finish, r, matched = "", 0, None, None, None
        stopped = False
        from ...generation.prompt_cache import make_prompt_cache

        cache, reused = self.prompt_caches.take(job.ids)
        if cache is None:
            cache = make_prompt_cache(self.model, self.kv)
        self.prefilled_tokens += len(job.ids) - reused
        tokens: list[int] = []

        def gone() -> bool:
            return self._closing.is_set() or (cancelled is not None and cancelled.is_set())

        def progress(done: int, total: int) -> None:  # between prefill chunks, and at the end
            if gone():
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
        with contextlib.closing(gen), stoppable(self.model.expert_cache, gone):
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
                    if gone():
                        stopped = True
                        break
            except (_Stopped, PrefillStopped):  # a prompt stopped between or inside its chunks
                stopped = True
        # Closed or finished, the cache covers the prompt and every token but the last; kept
        # only where each layer's own count agrees.
        covered = job.ids + tokens[:-1]
        if tokens and None not in tokens and all(c.offset == len(covered) for c in cache):
            self.keep(covered, cache)
        with self._counts:
            self.cancelled += stopped
        elapsed = time.perf_counter() - t0
        m = self.mean_request_s
        self.mean_request_s = elapsed if m is None else m + 0.2 * (elapsed - m)
        if r is not None and r.expert_stats is not None:
            self._serve_stats(r.expert_stats)
        return Result(text, finish or "length", len(job.ids), n, matched)

    def _serve_stats(self, stats) -> None:
        """A request's expert-cache figures added to the server's (`served`)."""
        if self.served is None:
            self.served = stats.copy()
        else:
            self.served.add(stats)

    def keep(self, covered: list[int], cache: list) -> None:
        """Keep `cache` (covering `covered`) for reuse, its arrays computed first, here on the
        thread that built them: a recurrent layer's last state is still unevaluated after the
        last token, and MLX cannot evaluate it on another thread (streams are per thread), as
        the prompt cache directory's write at shutdown would."""
        import mlx.core as mx

        mx.eval([c.state for c in cache])
        self.prompt_caches.put(covered, cache)

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


class StepLoop:
    """The worker's loop while jobs are stepped together (decode_concurrency > 1): jobs come
    through `inbox`; up to `batch.decode_concurrency` of them are in `batch` at once. It
    keeps `engine`'s counters and answers each job's future."""

    def __init__(self, engine: Engine, batch):
        self.engine = engine
        self.batch = batch  # strata_mlx.generation.batch.BatchGenerator
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (job, on_text, cancelled, done)

    def put(self, item) -> None:
        """A job to run (or None: wake the loop, at shutdown)."""
        self._inbox.put(item)

    def run(self) -> None:
        """The worker's loop while jobs are batched: admit waiting jobs while the batch has
        room, drop those whose client left, run one step, hand each job its text. Ends at
        shutdown, every job still admitted or waiting answered None (cancelled)."""
        running: dict[int, _Running] = {}  # id(Sequence) -> its job
        while not self.engine._closing.is_set() or running:
            try:
                self._step(running)
            except Exception as e:  # a fault of the loop itself: fail what runs, go on
                for r in running.values():
                    self.batch.remove(r.seq)
                    self._end(r)
                    r.done.set_exception(e)
                running.clear()
        self._drain_inbox()
        self.engine._idle.set()

    def _step(self, running: dict) -> None:
        """Admit, drop the jobs whose client left, one step (see `_step_loop`)."""
        gen = self.batch
        while gen.has_room() and not self.engine._closing.is_set():
            try:  # wait for work only when there is nothing to step
                item = self._inbox.get(block=not running)
            except queue.Empty:
                break
            if item is None:
                continue
            with self.engine._counts:
                self.engine.queued -= 1
            job, on_text, cancelled, done = item
            if cancelled.is_set():  # the client left while queued
                with self.engine._counts:
                    self.engine.cancelled += 1
                done.set_result(None)
                continue
            r = self._admit(job, on_text, cancelled, done)
            if r is not None:
                running[id(r.seq)] = r
        for key, r in list(running.items()):
            if self.engine._closing.is_set() or r.cancelled.is_set():
                gen.remove(r.seq)
                del running[key]
                self._finish(r, stopped=True)
        if not running:
            return

        def failed(seq, e: BaseException) -> None:
            r = running.pop(id(seq))
            if isinstance(e, PrefillStopped):  # every client of its prefill forward left
                self._finish(r, stopped=True)
                return
            self._end(r)
            r.done.set_exception(e)

        def gone(seq) -> bool:
            r = running.get(id(seq))
            return self.engine._closing.is_set() or r is None or r.cancelled.is_set()

        before = self.engine.model.expert_cache.stats.copy()
        t0 = time.perf_counter()
        out = gen.step(on_error=failed, stop_prefill=gone)
        self._count_step(before, time.perf_counter() - t0, len(out))
        for seq, resp in out:
            r = running[id(seq)]
            r.tokens.append(resp.token)
            r.text += resp.text
            self.engine.last = resp
            with self.engine._counts:
                self.engine.completion_tokens += 1
            if r.on_text is not None and resp.text:
                r.on_text(resp.text)
            if resp.finish_reason is not None:
                del running[id(seq)]
                r.finish, r.matched = resp.finish_reason, resp.stop_sequence
                self._finish(r, stopped=False)

    def _admit(self, job: Job, on_text, cancelled, done: Future) -> _Running | None:
        """Start `job` in the batch (its prompt cache as `run` takes it); None when it is
        answered at once (max_tokens 0, or bad input)."""
        from ...generation.prompt_cache import make_prompt_cache

        self.engine.requests += 1
        self.engine.prompt_tokens += len(job.ids)
        if job.max_tokens == 0:
            done.set_result(Result("", "length", len(job.ids), 0))
            return None
        with self.engine._counts:
            self.engine.active += 1
            self.engine._idle.clear()
        cache, reused = self.engine.prompt_caches.take(job.ids)
        if cache is None:
            cache = make_prompt_cache(self.engine.model, self.engine.kv)
        self.engine.prefilled_tokens += len(job.ids) - reused
        r = _Running(job, on_text, cancelled, done, time.perf_counter())
        try:
            r.seq = self.batch.insert(
                job.ids[reused:],
                job.max_tokens,
                job.sampling.sampler(self.engine.tokenizer),
                job.sampling.logits_processors(self.engine.model.args.vocab_size),
                seed=job.seed,
                stop=job.stop,
                prompt_cache=cache,
                cached_tokens=job.ids[:reused],
            )
        except Exception as e:
            self._end(r)
            done.set_exception(e)
            return None
        return r

    def _finish(self, r: _Running, stopped: bool) -> None:
        """`r` ended (finished, or `stopped`: its client left, or shutdown): keep its cache
        for reuse, count it, answer it."""
        covered = r.job.ids + r.tokens[:-1]
        cache = r.seq.cache
        if r.tokens and all(c.offset == len(covered) for c in cache):
            self.engine.keep(covered, cache)
        with self.engine._counts:
            self.engine.cancelled += stopped
        self._end(r)
        m, elapsed = self.engine.mean_request_s, time.perf_counter() - r.started
        self.engine.mean_request_s = elapsed if m is None else m + 0.2 * (elapsed - m)
        result = Result(r.text, r.finish or "length", len(r.job.ids), len(r.tokens), r.matched)
        r.done.set_result(result)

    def _end(self, r: _Running) -> None:
        with self.engine._counts:
            self.engine.active -= 1
            if not self.engine.active:
                self.engine._idle.set()

    def _count_step(self, before, wall_s: float, tokens: int) -> None:
        """The expert cache's figures over one step go to `served` (requests share steps)."""
        if not tokens:
            return
        step = self.engine.model.expert_cache.stats.minus(before)
        step.wall_s, step.tokens = wall_s, tokens
        if self.engine.served is None:
            self.engine.served = step
        else:
            self.engine.served.add(step)

    def _drain_inbox(self) -> None:
        """Shutdown: every job still waiting is answered None (cancelled)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                with self.engine._counts:
                    self.engine.queued -= 1
                    self.engine.cancelled += 1
                item[3].set_result(None)


@dataclass
class _Running:
    """A job in the batch: what it asked, and what it has produced so far."""

    job: Job
    on_text: Callable[[str], None] | None
    cancelled: threading.Event
    done: Future
    started: float
    seq: object = None  # its strata_mlx.generation.batch.Sequence
    tokens: list = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    matched: str | None = None


async def _client_gone(request: Request | None) -> None:
    """Return once the client of `request` has disconnected (never, without a request)."""
    if request is None:
        await asyncio.Event().wait()
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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
    # the longest prompt text, in characters, that could fit max_prompt_tokens (None: the
    # tokenizer gives no bound); longer text is refused before it is tokenized
    max_prompt_chars: int | None = None
    # the model's context (max_position_embeddings; None: its config names none): a longer
    # prompt is refused, and max_tokens ends at the context's end (a rotating KV cache aside)
    context: int | None = None
    # whether the chat template renders a request's tools (found at the first request with
    # tools: a template without them drops them, as mlx-lm's server does, and the server says
    # so once on stderr)
    template_takes_tools: bool | None = None

    @property
    def model(self):
        return self.engine.model

    @property
    def tokenizer(self):
        return self.engine.tokenizer
