"""Continuous batching: several sequences decode together, one token each per step.

Owns the batched token step (`batch_forward`) and the scheduling of sequences through it
(`BatchGenerator`): a step runs the next prefill chunk of up to `prompt_concurrency`
sequences (generate_step's chunks, run together as rows of one batch_forward: each chunk's
dense computation its own, every MoE layer once for all of them), then one token of every
sequence that is decoding. Sequences join between steps and leave when they finish or are
removed.

In the token step each MoE layer runs once on the sequences' tokens stacked: the expert
cache's handshake sees the union of their experts and reads each missing record once. The
dense part stays each sequence's own computation, in one of two shapes (`batch_forward`):
families listed in ROWS_IN_ONE_FORWARD run the step as one [B, 1] forward, the matmuls over
the B rows at once and RoPE and attention per row over RowCaches (models/base.py); the others
run each sequence's forward in its own greenlet (a coroutine on this thread, so MLX sees one
thread), and the expert cache's `gather` hook switches back here at every MoE layer; once
every sequence waits at that layer, the layer runs once and each resumes with its rows.

Each sequence's tokens and log-probabilities are those it gets alone (stream_generate): the
prefill chunks are the same forwards; on MLX's CPU backend a matmul's row and an expert
pair's output do not depend on the rows beside them (tests/generation/test_batch.py checks
every family, bit for bit). On CUDA this is not measured: MLX's CUDA matmuls choose their
tiling by row count, which already makes prefill chunk sizes differ in the last bits there. Sampling keeps a random key per sequence, so a
seeded request draws what it draws alone.

Never reads files (the expert cache does) and never speaks HTTP (the server does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from greenlet import greenlet

from ..config import OptionError
from ..models.base import RowCaches
from ..runtime.experts import stoppable
from . import generate
from .generate import GenerationResponse, add_token
from .prompt_cache import KVOptions, make_prompt_cache, maybe_quantize
from .sampling import LogitsProcessor, Sampler, make_sampler

# Families whose attention reaches its cache only through `offset` (RoPE), `update_and_fetch`
# and base.attention, with plain nn.RoPE or rope.py's: their rows run as one [B, 1] forward over
# RowCaches (tests/generation/test_batch.py checks each, bit for bit).
ROWS_IN_ONE_FORWARD = ("qwen3_moe", "mixtral", "olmoe", "glm4_moe")


def batch_forward(model, rows: list[tuple[mx.array, list]], one_forward: bool = True) -> list:
    """The logits [1, L, vocab] of each row (its tokens [1, L] and its cache, which is
    extended), as `model(tokens, cache=cache)` computes them alone, with every MoE layer run
    once for all rows' tokens.

    Rows of one token of a family in ROWS_IN_ONE_FORWARD (and `one_forward`) run as one
    forward of [B, 1] tokens: the dense layers' matmuls take the B rows at once (on MLX's
    CPU backend a matmul's row does not depend on the rows beside it), RoPE and attention
    run per row over RowCaches. Other rows run their own forwards, one greenlet each, met at
    every MoE layer."""
    if len(rows) == 1:
        tokens, cache = rows[0]
        if tokens.shape == (1, 1):
            # alone in the step: the model's own decoder (pipelined, where the runtime asks
            # for it: no host sync per layer), one token without building the next ahead
            decoder = model.decoding()
            step = decoder.start(tokens, cache)
            decoder.finish(step)
            return [step.logits]
        return [model(tokens, cache=cache)]
    if (
        one_forward
        and getattr(model.args, "model_type", None) in ROWS_IN_ONE_FORWARD
        and all(t.shape == (1, 1) for t, _ in rows)
    ):
        tokens = mx.concatenate([t for t, _ in rows])
        caches = [RowCaches([c[i] for _, c in rows]) for i in range(len(rows[0][1]))]
        logits = model(tokens, cache=caches)
        return [logits[i : i + 1] for i in range(len(rows))]
    return _met_at_moe_layers(model, rows)


def _met_at_moe_layers(model, rows: list[tuple[mx.array, list]]) -> list:
    """Each row's own forward in a greenlet, every MoE layer run once for all of them."""
    ec = model.expert_cache
    parent = greenlet.getcurrent()

    def forward(tokens: mx.array, cache: list):
        return ("logits", model(tokens, cache=cache))

    def gather(layer: int, x: mx.array, inds: mx.array) -> mx.array:
        return parent.switch(("moe", layer, x, inds))

    lets = [greenlet(forward, parent) for _ in rows]
    try:
        with ec.gathering(gather):
            return _meet(ec, lets, rows)
    finally:
        for g in lets:  # (a failed step: the others are abandoned mid-forward)
            if not g.dead:
                g.throw()


def _meet(ec, lets: list, rows: list[tuple[mx.array, list]]) -> list:
    """Run the rows' greenlets to their logits, each MoE layer once for all of them."""
    msgs = [g.switch(*row) for g, row in zip(lets, rows)]
    while msgs[0][0] == "moe":
        layer = msgs[0][1]
        if any(m[0] != "moe" or m[1] != layer for m in msgs):
            raise RuntimeError("the rows of a batched step reached different layers")
        xs = [m[2] for m in msgs]
        inds = [m[3] for m in msgs]
        d, k = xs[0].shape[-1], inds[0].shape[-1]
        x = mx.concatenate([a.reshape(-1, d) for a in xs])
        i = mx.concatenate([a.reshape(-1, k) for a in inds])
        with ec.gathering(None):  # this call is the layer's one handshake
            y = ec.run_layer(layer, x[None], i[None])[0]
        outs, at = [], 0
        for a in xs:
            n = a.size // d
            outs.append(y[at : at + n].reshape(*a.shape[:-1], k, d))
            at += n
        msgs = [g.switch(o) for g, o in zip(lets, outs)]
    if any(m[0] != "logits" for m in msgs):
        raise RuntimeError("the rows of a batched step reached different layers")
    return [m[1] for m in msgs]


@dataclass
class Sequence:
    """One request in the batch: its prompt (the part its cache does not cover yet), its
    cache, what sampling it asks, and how far it has come."""

    ids: list[int]
    max_tokens: int
    sampler: Sampler
    logits_processors: list[LogitsProcessor]
    stop: list[str]
    cache: list
    cached_tokens: list[int]
    key: mx.array  # the random key its next sample draws from
    prefilled: int = 0  # prompt positions in the cache (of ids[:-1])
    y: mx.array | None = None  # the next token to run ([1]), once prefilled
    context: mx.array | None = None  # the tokens so far, for logits processors
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    stop_sequence: str | None = None
    finish_reason: str | None = None
    detok: object = None
    started: float = 0.0
    first_token_s: float = 0.0  # prompt time, to the first token
    decode_started: float = 0.0

    @property
    def decoding(self) -> bool:
        return self.y is not None


class BatchGenerator:
    """Sequences stepped together (see the module docstring). `insert` a request, call `step`
    until it has answered every token: each step returns a GenerationResponse for each
    sequence that produced one (finish_reason set on its last); `remove` one at any time
    between steps. After a sequence ends or is removed, its cache covers its prompt and
    every token it yielded but the last, as generate_step's does."""

    def __init__(
        self,
        model,
        tokenizer,
        decode_concurrency: int = 8,
        prompt_concurrency: int = 1,
        prefill_step_size: int | None = None,
        kv: KVOptions | None = None,
        one_forward: bool = True,
    ):
        """`one_forward`: batch_forward's (False: every family's rows met at the MoE layers
        only, as tests compare)."""
        if decode_concurrency < 1:
            raise OptionError(f"--decode-concurrency must be >= 1, got {decode_concurrency}")
        if prompt_concurrency < 1:
            raise OptionError(f"--prompt-concurrency must be >= 1, got {prompt_concurrency}")
        self.model = model
        self.tokenizer = tokenizer
        self.decode_concurrency = decode_concurrency
        self.prompt_concurrency = prompt_concurrency
        self.prefill_step_size = prefill_step_size or model.runtime.prefill_step_size or 512
        self.kv = kv or KVOptions()
        self.one_forward = one_forward
        self.sequences: list[Sequence] = []  # in the order they joined
        self.steps = 0  # batched token steps run
        self.rows = 0  # sequences in them, summed

    def has_room(self) -> bool:
        return len(self.sequences) < self.decode_concurrency

    def insert(
        self,
        ids: list[int],
        max_tokens: int = 256,
        sampler: Sampler | None = None,
        logits_processors: list[LogitsProcessor] | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        prompt_cache: list | None = None,
        cached_tokens: list[int] | None = None,
    ) -> Sequence:
        """Add a request: `ids` continue `prompt_cache` (which covers `cached_tokens`), as
        stream_generate's arguments of those names."""
        if not self.has_room():
            raise RuntimeError(f"the batch is full ({self.decode_concurrency} sequences)")
        if not ids:
            raise OptionError("empty prompt")
        if max_tokens < 1:
            raise OptionError("max_tokens must be >= 1")
        if seed is not None:
            mx.random.seed(seed)
        key = mx.random.state[0]
        if seed is None:  # later requests draw other numbers
            mx.random.seed(_seed_of(mx.random.split(key)[0]))
        cached = list(cached_tokens or ())
        seq = Sequence(
            ids=list(ids),
            max_tokens=max_tokens,
            sampler=sampler or make_sampler(),
            logits_processors=list(logits_processors or ()),
            stop=[s for s in stop or () if s],
            cache=prompt_cache
            if prompt_cache is not None
            else make_prompt_cache(self.model, self.kv),
            cached_tokens=cached,
            key=key,
            detok=self.tokenizer.detokenizer() if self.tokenizer is not None else None,
            started=time.perf_counter(),
        )
        if seq.logits_processors:
            seq.context = mx.array(cached + seq.ids)
        self.sequences.append(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        """Drop `seq` (finished, or its client left); the others go on."""
        if seq in self.sequences:
            self.sequences.remove(seq)

    def step(
        self,
        on_error: Callable[[Sequence, BaseException], None] | None = None,
        stop_prefill: Callable[[Sequence], bool] | None = None,
    ) -> list[tuple[Sequence, GenerationResponse]]:
        """One step: prefill chunks, then one token of every decoding sequence. The sequences
        of a failed prefill forward (their chunks run together) or token step are removed
        and handed to `on_error` (without it, the error is raised). A prefill forward stops
        at its next MoE layer once `stop_prefill` is true of every sequence in it (their
        error: runtime.experts.PrefillStopped)."""
        ec = self.model.expert_cache
        ec.idle()  # everything earlier steps built is evaluated
        prefilling = [s for s in self.sequences if not s.decoding][: self.prompt_concurrency]
        if prefilling:
            self._prefill_chunks(prefilling, on_error, stop_prefill)
            mx.clear_cache()  # (generate.RELEASE_EVERY: as mlx-lm's after each prompt chunk)
        rows = [s for s in self.sequences if s.decoding]
        if not rows:
            return []
        ec.idle()
        with ec.phase(decoding=True, gating=False):
            try:
                steps = [(s.y[None], s.cache) for s in rows]
                logits = batch_forward(self.model, steps, self.one_forward)
                sampled = [self._sample(s, lg) for s, lg in zip(rows, logits)]
                mx.eval([t for t, _ in sampled])
            except Exception as e:
                if on_error is None:
                    raise
                for s in rows:
                    self.remove(s)
                    on_error(s, e)
                return []
        self.steps += 1
        self.rows += len(rows)
        if self.steps % generate.RELEASE_EVERY == 0:
            mx.clear_cache()
        out = []
        for seq, (token, logprobs) in zip(rows, sampled):
            out.append((seq, self._respond(seq, token.item(), logprobs)))
        return out

    def _prefill_chunks(
        self,
        seqs: list[Sequence],
        on_error: Callable[[Sequence, BaseException], None] | None,
        stop: Callable[[Sequence], bool] | None = None,
    ) -> None:
        """The next prefill chunk of each of `seqs` (generate.forward_chunks' chunks: the same
        forwards), run together: batch_forward's rows, each chunk's dense computation its own
        and every MoE layer run once for all of them (the union of their experts read once).
        A sequence whose cache then covers all but its last prompt token decodes."""
        rows = []
        for seq in seqs:
            n_prompt = len(seq.ids) - 1
            n = min(self.prefill_step_size, n_prompt - seq.prefilled)
            if n > 0:
                rows.append(
                    (seq, mx.array(seq.ids[:n_prompt])[None, seq.prefilled : seq.prefilled + n])
                )
        if rows:
            ec = self.model.expert_cache
            stopped = (lambda: all(stop(s) for s, _ in rows)) if stop is not None else None
            try:
                with ec.phase(decoding=False), stoppable(ec, stopped):
                    if len(rows) == 1:
                        seq, tokens = rows[0]
                        self.model(tokens, cache=seq.cache)
                    else:
                        batch_forward(self.model, [(t, s.cache) for s, t in rows], self.one_forward)
                    for seq, _ in rows:
                        maybe_quantize(seq.cache, self.kv)
                    mx.eval([a for seq, _ in rows for c in seq.cache for a in c.state])
            except Exception as e:
                if on_error is None:
                    raise
                for seq, _ in rows:
                    self.remove(seq)
                    on_error(seq, e)
                return
            for seq, tokens in rows:
                seq.prefilled += tokens.shape[1]
        for seq in seqs:
            if seq.prefilled == len(seq.ids) - 1:
                seq.y = mx.array(seq.ids[-1:])

    def _sample(self, seq: Sequence, logits: mx.array) -> tuple[mx.array, mx.array]:
        """generate_step's sample, drawing from the sequence's own random key."""
        logits = logits[:, -1, :]
        for processor in seq.logits_processors:
            logits = processor(seq.context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.random.seed(_seed_of(seq.key))
        token = seq.sampler(logprobs)
        seq.key = mx.random.state[0]
        return token, logprobs.squeeze(0)

    def _respond(self, seq: Sequence, token: int, logprobs: mx.array) -> GenerationResponse:
        """Record `token` for `seq` (its text, stop strings, finish) and prepare its next step."""
        now = time.perf_counter()
        n = len(seq.tokens)
        if n == 0:
            seq.first_token_s = now - seq.started
            seq.decode_started = now
        seq.tokens.append(token)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else set()
        last = n + 1 == seq.max_tokens
        seq.text, end, finish, found = add_token(seq.text, token, eos, seq.detok, seq.stop, last)
        seq.stop_sequence = found or seq.stop_sequence
        segment, seq.emitted = seq.text[seq.emitted : end], end
        seq.finish_reason = finish
        if finish is not None:
            self.remove(seq)
        else:
            seq.y = mx.array([token])
            if seq.logits_processors:
                seq.context = mx.concatenate([seq.context, seq.y.astype(seq.context.dtype)])
            maybe_quantize(seq.cache, self.kv)  # between two tokens, as generate_step
        elapsed = now - seq.decode_started
        return GenerationResponse(
            text=segment,
            token=token,
            logprobs=logprobs,
            from_draft=False,
            prompt_tokens=len(seq.ids),
            prompt_tps=len(seq.ids) / seq.first_token_s if seq.first_token_s > 0 else 0.0,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            stop_sequence=seq.stop_sequence,
        )


def _seed_of(key: mx.array) -> int:
    """The seed that makes `key` ([2] uint32) the global random key again."""
    hi, lo = (int(v) for v in key.tolist())
    return (hi << 32) | lo
