"""Generation: `load` (a store's model and tokenizer), chunked prefill, decode, sampling;
`stream_generate` and `generate`.

Shapes follow mlx-lm: `stream_generate` is a generator of GenerationResponse objects and the
CLI is a thin shell over it. Each response also carries the expert cache's statistics.
This module never touches the disk; the expert cache behind the model does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import closing
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..config import OptionError, check_int, check_prompt_length, check_sampling
from ..stream.stats import ExpertStats
from .prompt_cache import KVOptions, make_prompt_cache, maybe_quantize, quantize_due
from .sampling import LogitsProcessor, Sampler, make_sampler  # make_sampler lived here
from .tokenizer import load_tokenizer

# MLX keeps the buffers it frees for reuse until they and the live ones near its memory
# limit; past that, an allocation hands cached buffers back to the device's allocator first,
# and on CUDA that free waits for the device to go idle: the building thread stalls behind
# whatever the device is waiting for (a decode gate waiting for a read: the gate then waits
# out its timeout, measured on an H100 in bench's process, where an earlier model's buffers
# filled the cache). So, as mlx-lm's generate_step does, the cache is emptied before and
# after the prompt, when nothing is in flight, and every RELEASE_EVERY tokens after a token
# is verified (every gate of it passed).
RELEASE_EVERY = 256


@dataclass
class GenerationResponse:
    text: str
    token: int | None
    logprobs: mx.array | None
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason "stop")
    expert_stats: ExpertStats | None = None  # whole generation so far
    prefill_stats: ExpertStats | None = None
    chunks: list[ExpertStats] = field(default_factory=list)  # per prefill chunk


def load(
    path,
    arena_gb: float | None = None,
    config=None,
    pipeline=None,
    reserve_bytes: int = 0,
    **overrides,
):
    """Load a strata-mlx store: (model, tokenizer or None), as mlx-lm's load(); the model is
    runtime.loader.load_model's, which takes the same arguments. The tokenizer's files are
    checked before the model allocates anything."""
    from ..runtime.loader import load_model

    tokenizer = load_tokenizer(path)
    model = load_model(path, arena_gb, config, pipeline, reserve_bytes, **overrides)
    return model, tokenizer


def forward_chunks(
    model,
    tokens: mx.array,
    cache: list,
    step: int,
    on_logits: Callable[[mx.array], None] | None = None,
    on_chunk: Callable[[ExpertStats], None] | None = None,
    kv: KVOptions | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """The one loop over a prompt: `tokens` [T] through `model` in chunks of `step`
    positions, extending `cache`. Prefill, teacher-forced logits, the converter's calibration
    and baseline's parity logits all run it. After each chunk's forward: with `kv`, layers
    past `kv.quantized_kv_start` quantized; the cache evaluated, and the chunk's logits
    [1, n, vocab] with it when `on_logits` takes them (before the next forward, which may
    release the expert slots they were computed from); `on_chunk` gets the chunk's expert
    statistics; `on_progress` the positions done so far (it may raise to stop between
    chunks: nothing is in flight then). Logits no hook takes are never computed."""
    expert_cache = model.expert_cache if on_chunk is not None else None  # (mlx-lm models too)
    for i in range(0, tokens.shape[0], step):
        n = min(step, tokens.shape[0] - i)
        before = expert_cache.stats.copy() if expert_cache is not None else None
        t = time.perf_counter()
        logits = model(tokens[None, i : i + n], cache=cache)
        maybe_quantize(cache, kv)
        state = [s for c in cache for s in c.state]
        mx.eval(state if on_logits is None else [logits, state])
        if on_logits is not None:
            on_logits(logits)
        if expert_cache is not None:
            chunk = expert_cache.stats.minus(before)
            chunk.wall_s = time.perf_counter() - t
            chunk.tokens = n
            chunk.compute_s = chunk.wall_s - chunk.exposed_wait_s
            on_chunk(chunk)
        if on_progress is not None:
            on_progress(i + n)


def prefill(
    model,
    prompt: mx.array,
    cache,
    step: int,
    on_chunk=None,
    kv: KVOptions | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> mx.array:
    """Run all prompt tokens but the last in chunks of `step`; return the remainder. With
    `kv.kv_bits`, layers past `kv.quantized_kv_start` are quantized after each chunk."""
    n = max(prompt.shape[0] - 1, 0)
    forward_chunks(
        model, prompt[:n], cache, step, on_chunk=on_chunk, kv=kv, on_progress=on_progress
    )
    return prompt[n:]


def generate_step(
    model,
    prompt: mx.array,
    max_tokens: int = 256,
    sampler=None,
    prefill_step_size: int | None = None,
    on_chunk=None,
    logits_processors: list[LogitsProcessor] | None = None,
    prompt_cache: list | None = None,
    cached_tokens: list[int] | None = None,
    kv: KVOptions | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
) -> Generator[tuple[int, mx.array], None, None]:
    """Yield (token, logprobs) pairs; the prompt is prefilled in chunks first.
    `logits_processors` (mlx-lm's) change each step's logits before they are normalised;
    they see the tokens so far, the prompt's included.

    `prompt_cache` (strata_mlx.generation.prompt_cache) is the state after `cached_tokens`: `prompt`
    continues it, and the cache is extended in place. When the generator ends or is closed,
    the cache covers the prompt and every yielded token but the last, all verified (a token
    built ahead and not yet checked is rolled back). `kv` shapes a new cache (rotating,
    quantized). `prompt_progress_callback(done, total)` is mlx-lm's: called with 0 before the
    prompt, after each prefill chunk, and with `total` once the first token's logits are in;
    an exception it raises between chunks stops the generation there (the server's cancel)."""
    sampler = sampler or make_sampler()
    if prefill_step_size:  # (0: the model's; a negative step ran no chunk: the prompt skipped)
        check_int("prefill_step_size", prefill_step_size, 1)
    total = prompt.shape[0]
    progress = prompt_progress_callback or (lambda *_: None)
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model, kv)
    chunk = prefill_step_size or model.runtime.prefill_step_size or 512
    expert_cache = model.expert_cache
    # Nothing of an earlier generation is in flight (it ended, or was closed and its token
    # built ahead rolled back), nor of the prefill once its chunks are evaluated: what they
    # left in the expert cache (busy layers, the last handshake's pins) is released.
    expert_cache.idle()
    mx.clear_cache()  # (RELEASE_EVERY)
    progress(0, total)
    with expert_cache.phase(decoding=False):  # the eviction policy is told, as decode's is
        y = prefill(model, prompt, cache, chunk, on_chunk, kv, lambda d: progress(d, total))
    expert_cache.idle()
    mx.clear_cache()

    context = prompt  # the tokens so far, for logits_processors
    if cached_tokens:
        context = mx.concatenate([mx.array(cached_tokens, dtype=prompt.dtype), prompt])

    def sample(logits):
        logits = logits[:, -1, :]
        for processor in logits_processors or ():
            logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs), logprobs.squeeze(0)

    steps = model.decoding().decode(
        y,
        cache,
        sample,
        max_tokens,
        may_build_ahead=lambda: not quantize_due(cache, kv),
        between=lambda: maybe_quantize(cache, kv),  # after a model call, before the next
    )
    with closing(steps):  # closed early: the token built ahead is rolled back
        for n, (t, logprobs) in enumerate(steps):
            if logits_processors:
                context = mx.concatenate([context, mx.array([t], dtype=context.dtype)])
            if n == 0:
                progress(total, total)
            yield t, logprobs
            if (n + 1) % RELEASE_EVERY == 0:
                mx.clear_cache()


def stream_generate(
    model,
    tokenizer,
    prompt: str | list[int],
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    prefill_step_size: int | None = None,
    stop: list[str] | None = None,
    sampler: Sampler | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    prompt_cache: list | None = None,
    cached_tokens: list[int] | None = None,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
) -> Generator[GenerationResponse, None, None]:
    """Generate from `prompt` (text, or token ids), yielding one response per token.
    `sampler` and `logits_processors` (strata_mlx.generation.sampling) replace the sampler built from
    `temp` and `top_p`. `prompt_cache` (covering `cached_tokens`, e.g. from
    strata_mlx.generation.prompt_cache.load_prompt_cache) is continued by `prompt` and extended in
    place; `prompt_tokens` and `prompt_tps` then count the new tokens only, as mlx-lm's.
    `max_kv_size`, `kv_bits`, `kv_group_size`, `quantized_kv_start` and
    `prompt_progress_callback` (generate_step) are mlx-lm's."""
    check_sampling(max_tokens, temp, top_p, seed)
    stop = _check_continuation(model, stop, prompt_cache, cached_tokens)
    kv = KVOptions(max_kv_size, kv_bits, kv_group_size, quantized_kv_start)
    kv.check()
    if seed is not None:
        mx.random.seed(seed)
    ids = _prompt_ids(model, tokenizer, prompt, cached_tokens)
    eos = tokenizer.eos_token_ids if tokenizer is not None else set()
    detok = tokenizer.detokenizer() if tokenizer is not None else None
    clock = _Clock(model.expert_cache, len(ids))
    chunks: list[ExpertStats] = []
    text = ""
    emitted = 0  # characters of `text` already yielded
    n = 0
    matched = None  # the stop string found, if one ends the text
    for n, (token, logprobs) in enumerate(
        generate_step(
            model,
            mx.array(ids),
            max_tokens,
            sampler or make_sampler(temp, top_p),
            prefill_step_size,
            on_chunk=chunks.append,
            logits_processors=logits_processors,
            prompt_cache=prompt_cache,
            cached_tokens=cached_tokens,
            kv=kv,
            prompt_progress_callback=prompt_progress_callback,
        )
    ):
        if n == 0:
            clock.prefilled()
        text, end, finish, found = add_token(text, token, eos, detok, stop, n + 1 == max_tokens)
        matched = found or matched
        segment, emitted = text[emitted:end], end
        stats, generation_tps = clock.generated(n + 1)
        yield GenerationResponse(
            text=segment,
            token=token,
            logprobs=logprobs,
            from_draft=False,
            prompt_tokens=len(ids),
            prompt_tps=clock.prompt_tps,
            generation_tokens=n + 1,
            generation_tps=generation_tps,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            stop_sequence=matched,
            expert_stats=stats,
            prefill_stats=clock.prefill,
            chunks=chunks,
        )
        if finish is not None:
            break
    clock.done(n + 1)


class _Clock:
    """A generation's times and expert statistics: the prefill's once the first token is out,
    the whole generation's at every token, and the session's running totals at the end."""

    def __init__(self, expert_cache, prompt_tokens: int):
        self.expert_cache = expert_cache
        self.prompt_tokens = prompt_tokens
        self.start_stats = expert_cache.stats.copy()
        mx.reset_peak_memory()
        self.tic = self.start = time.perf_counter()
        self.prefill: ExpertStats | None = None
        self.prompt_tps = 0.0

    def prefilled(self) -> None:
        """The prompt is processed and the first token sampled: decode's clock starts."""
        prompt_time = time.perf_counter() - self.tic
        self.prompt_tps = self.prompt_tokens / prompt_time
        self.tic = time.perf_counter()
        self.prefill = self.expert_cache.stats.minus(self.start_stats)
        self.prefill.wall_s = prompt_time
        self.prefill.tokens = self.prompt_tokens

    def generated(self, n: int) -> tuple[ExpertStats, float]:
        """The statistics of the generation so far, `n` tokens out, and its tokens/s."""
        stats = self.expert_cache.stats.minus(self.start_stats)
        stats.wall_s = time.perf_counter() - self.tic + self.prefill.wall_s
        stats.tokens = self.prompt_tokens + n
        elapsed = time.perf_counter() - self.tic
        return stats, n / elapsed if elapsed > 0 else 0.0

    def done(self, n: int) -> None:
        """The session's running totals get the generation's time and tokens too."""
        self.expert_cache.stats.wall_s += time.perf_counter() - self.start
        self.expert_cache.stats.tokens += self.prompt_tokens + n


def _prompt_ids(model, tokenizer, prompt: str | list[int], cached_tokens) -> list[int]:
    """The prompt's token ids (text encoded by `tokenizer`), checked against the vocabulary
    and, with the cached tokens before them, the model's context. Text that begins with the
    BOS token (a chat template's) gets no second one, as mlx-lm's stream_generate does."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise OptionError("this store has no tokenizer: pass token ids")
        bos = getattr(tokenizer, "bos_token", None)
        ids = tokenizer.encode(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))
    else:
        ids = _token_list(prompt)
    if not ids:
        raise OptionError("empty prompt")
    vocab = model.args.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise OptionError(f"prompt token ids must lie in [0, {vocab})")
    check_prompt_length(
        len(ids) + len(cached_tokens or ()), getattr(model.args, "max_position_embeddings", None)
    )
    return ids


def _token_list(prompt) -> list[int]:
    """Token ids as Python ints, from a list, a NumPy or MLX array of integers; anything else
    (bytes, floats, booleans, strings, None) is refused by name."""
    if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
        raise OptionError(f"prompt: text or token ids, got {type(prompt).__name__}")
    if isinstance(prompt, (np.ndarray, mx.array)) and prompt.ndim != 1:
        raise OptionError(f"prompt: token ids in one dimension, got an array of {prompt.ndim}")
    items = prompt.tolist() if isinstance(prompt, (np.ndarray, mx.array)) else list(prompt)
    ids = []
    for i in items:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise OptionError(f"prompt token ids must be integers, got {type(i).__name__} {i!r}")
        ids.append(int(i))
    return ids


def _check_continuation(model, stop, prompt_cache, cached_tokens) -> list[str] | None:
    """stop (a string is one stop string, as OpenAI's API takes it) as a list of strings; a
    prompt cache of the model's layers, and cached tokens only beside one."""
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop)
    ):
        raise OptionError(f"stop: a string or a list of strings, got {stop!r}")
    if prompt_cache is not None:
        layers = len(model.layers)
        if (
            not isinstance(prompt_cache, list)
            or len(prompt_cache) != layers
            or not all(hasattr(c, "offset") for c in prompt_cache)
        ):
            raise OptionError(
                f"prompt_cache: a list of the model's {layers} layer caches (make_prompt_cache, "
                "load_prompt_cache)"
            )
    elif cached_tokens:
        raise OptionError("cached_tokens: the tokens a prompt_cache covers; no prompt_cache given")
    return None if stop is None else list(stop)


def add_token(
    text: str, token: int, eos, detok, stop, last: bool
) -> tuple[str, int, str | None, str | None]:
    """(the text with `token` added, how much of it may be yielded, the finish reason or None,
    the stop string that ended the text or None): an EOS token stops; a stop string ends the
    text before it; text that might still become a stop string is held back; `last`
    (max_tokens reached) finishes with "length"."""
    finish = matched = None
    if token in eos:
        finish = "stop"
    elif detok is not None:
        text += detok.add(token)
    end = len(text)
    if stop and finish != "stop":
        found = _find_stop(text, stop)
        if found is not None:
            hit, matched = found
            text, end, finish = text[:hit], hit, "stop"
        else:
            end = len(text) - stop_holdback(text, stop)  # might still become a stop string
    if finish is None and last:
        finish = "length"
    if finish is not None:
        end = len(text)
    return text, end, finish, matched


def stop_holdback(text: str, stop: list[str]) -> int:
    """Length of the longest end of `text` that begins some stop string: that much may still
    become a stop sequence, so streaming holds it back."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _find_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    """Where the first stop string in `text` begins, and which one (of two beginning at the
    same place, the one listed first)."""
    hits = [(text.find(s), i) for i, s in enumerate(stop) if s and s in text]
    if not hits:
        return None
    at, i = min(hits)
    return at, stop[i]


def generate(model, tokenizer, prompt: str | list[int], verbose: bool = False, **kwargs) -> str:
    """The whole completion as a string (mlx-lm's generate)."""
    text = ""
    last = None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(last.text, end="", flush=True)
        text += last.text
    if verbose and last is not None:
        print()
        print(summary(last))
    return text


def summary(r: GenerationResponse, arena: tuple[int, int] | None = None) -> str:
    """mlx-lm's closing lines, then the expert cache's (`arena`: its (bytes, slots))."""
    lines = [
        "=" * 10,
        f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec",
        f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec",
        f"Peak memory: {r.peak_memory:.3f} GB",
    ]
    s = r.expert_stats
    if s is not None:
        lines.append("Experts: " + expert_line(s, arena))
    return "\n".join(lines)


def expert_line(s, arena: tuple[int, int] | None = None) -> str:
    """The expert cache's figures, shares that add up: hit rate = resident + streamed ahead,
    hit rate + misses = 100 % of the lookups (README, "What the numbers mean")."""
    n = max(s.lookups, 1)
    hit = round(100 * (s.hits + s.streamed_ahead) / n, 1)
    resident = round(100 * s.hits / n, 1)
    ahead = round(hit - resident, 1)
    exact = s.hits + s.streamed_ahead + s.misses == s.lookups
    missed = round(100 - hit, 1) if exact else round(s.miss_pct, 1)
    out = (
        f"hit rate {hit:.1f}% ({resident:.1f}% resident + {ahead:.1f}% streamed ahead), "
        f"misses {missed:.1f}%, "
    )
    if s.experts_read:
        out += f"{s.experts_read} read, {s.gb_read:.3f} GB at {s.gb_per_s:.2f} GB/s, "
    else:
        out += "0 read, "
    out += f"exposed wait {s.exposed_wait_s * 1e3:.0f} ms"
    if arena is not None:
        out += f"; arena {arena[0] / 2**30:.3f} GiB ({arena[1]} slots)"
    return out


def cache_prompt(
    model,
    ids: list[int],
    kv: KVOptions | None = None,
    prefill_step_size: int | None = None,
    on_chunk=None,
    prompt_cache: list | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
) -> list:
    """The cache after every token of `ids` (mlx-lm's cache_prompt: the last token is run
    too), continuing `prompt_cache` if given; evaluated. `prompt_progress_callback(done,
    total)` as generate_step calls it: 0, after each chunk, and `total` at the end."""
    if not ids:
        raise OptionError("empty prompt")
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model, kv)
    step = prefill_step_size or model.runtime.prefill_step_size or 512
    total = len(ids)
    progress = prompt_progress_callback or (lambda *_: None)
    progress(0, total)
    with model.expert_cache.phase(decoding=False):
        y = prefill(model, mx.array(ids), cache, step, on_chunk, kv, lambda d: progress(d, total))
        model(y[None], cache=cache)
    maybe_quantize(cache, kv)
    mx.eval([s for c in cache for s in c.state])
    progress(total, total)
    return cache


def teacher_forced_logits(
    model, ids: list[int], step: int | None = None, on_progress=None
) -> np.ndarray:
    """float32 [T, vocab] logits of every prompt position (prefilled in chunks of `step`;
    `on_progress(done)` after each, as forward_chunks calls it)."""
    step = step or model.runtime.prefill_step_size or 512
    out = []
    forward_chunks(
        model,
        mx.array(ids),
        model.make_cache(),
        step,
        on_logits=lambda logits: out.append(np.array(logits[0].astype(mx.float32))),
        on_progress=on_progress,
    )
    return np.concatenate(out, axis=0)
