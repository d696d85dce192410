"""Sampling: the sampler and the logits processors, built once from the user's options and
shared by `generate`, `serve` and the Python API.

The semantics are mlx-lm's (mlx_lm/sample_utils.py; tests/generation/test_sampling.py checks ours against
it: the same filtered distributions, the same tokens from the same seed). The filters act on
the log-probabilities at temperature 1, in mlx-lm's order (top-p, min-p, XTC, top-k), and the
token is then drawn from what they keep at `temp`. Logits processors (logit bias, then the
repetition, presence and frequency penalties) act on the raw logits before they are
normalised, and see every token so far, the prompt's included.

Two readings differ from mlx-lm, both where mlx-lm would surprise or raise: top_p 0 is greedy
(the limit of a shrinking nucleus, as our server has always read it; mlx-lm skips the filter),
and top_k at or above the vocabulary keeps every token (mlx-lm raises mid-generation).
Ranges are checked by strata_mlx.config. Nothing here touches the model or the disk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mlx.core as mx

from ..config import check_logits_processors, check_sampler

Sampler = Callable[[mx.array], mx.array]  # log-probabilities [B, V] -> tokens [B]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # (tokens so far, logits) -> logits

# Compiled as mlx-lm does, the random state threaded through, so that a seed draws the same
# tokens here as there.
_compiled = partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@_compiled
def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p` (ties at the
    edge all kept)."""
    sorted_logprobs = mx.sort(logprobs, axis=-1)
    sorted_probs = mx.exp(sorted_logprobs.astype(mx.float32))
    mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + sorted_probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_logprobs, dropped, axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


@_compiled
def apply_min_p(logprobs: mx.array, min_p: float, min_tokens_to_keep: int = 1) -> mx.array:
    """Keep the tokens at least `min_p` times as likely as the most likely one, and at least
    the `min_tokens_to_keep` most likely."""
    drop = logprobs < mx.max(logprobs, axis=-1, keepdims=True) + math.log(min_p)
    if min_tokens_to_keep > 1:
        top = mx.argpartition(logprobs, kth=-min_tokens_to_keep, axis=-1)
        drop = mx.put_along_axis(drop, top[..., -min_tokens_to_keep:], mx.array(False), axis=-1)
    return mx.where(drop, -mx.inf, logprobs)


@_compiled
def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the `top_k` most likely tokens."""
    drop = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, drop, mx.array(-mx.inf, logprobs.dtype), axis=-1)


@_compiled
def apply_xtc(
    logprobs: mx.array, probability: float, threshold: float, special_tokens: list[int]
) -> mx.array:
    """Exclude Top Choices: with `probability`, drop every token above `threshold` but the
    least likely of them (special tokens are never dropped)."""
    probs = mx.softmax(logprobs, -1)
    drop = probs > mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    if special_tokens:
        drop[..., special_tokens] = False
    return mx.where(
        mx.random.uniform(0, 1) > probability, logprobs, mx.where(drop, -mx.inf, logprobs)
    )


@_compiled
def categorical(logprobs: mx.array, temp: float) -> mx.array:
    return mx.random.categorical(logprobs * (1.0 / temp))


def make_sampler(
    temp: float = 0.0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: list[int] | None = None,
) -> Sampler:
    """A sampler of log-probabilities [B, V] -> tokens [B]: greedy at temp 0 (or top_p 0),
    else the filters that are on (top_p < 1, min_p > 0, xtc_probability > 0, top_k > 0),
    then a draw at `temp`. mlx-lm's make_sampler, arguments in its order."""
    check_sampler(temp, top_p, min_p, min_tokens_to_keep, top_k, xtc_probability, xtc_threshold)
    if temp == 0 or top_p == 0:
        return greedy
    specials = list(xtc_special_tokens or [])
    filters: list[Callable[[mx.array], mx.array]] = []
    if top_p < 1:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p > 0:
        # keeping the whole vocabulary or more is no filter (argpartition needs kth < size)
        filters.append(
            lambda x: (
                x
                if min_tokens_to_keep >= x.shape[-1]
                else apply_min_p(x, min_p, min_tokens_to_keep)
            )
        )
    if xtc_probability > 0:
        filters.append(lambda x: apply_xtc(x, xtc_probability, xtc_threshold, specials))
    if top_k > 0:
        filters.append(lambda x: x if top_k >= x.shape[-1] else apply_top_k(x, top_k))

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        return categorical(logprobs, temp)

    return sample


def make_repetition_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """Divide a positive logit (multiply a negative one) by `penalty` for each token among the
    last `context_size` (https://arxiv.org/abs/1909.05858)."""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if len(tokens) > 0:
            tokens = tokens[-context_size:]
            picked = logits[:, tokens]
            logits[:, tokens] = mx.where(picked < 0, picked * penalty, picked / penalty)
        return logits

    return process


def make_presence_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """Subtract `penalty` once from the logit of each token among the last `context_size`."""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if len(tokens) > 0:
            logits[:, tokens[-context_size:]] -= penalty
        return logits

    return process


def make_frequency_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """Subtract `penalty` from a token's logit for each time it is among the last
    `context_size`."""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if len(tokens) > 0:
            logits = logits.at[:, tokens[-context_size:]].subtract(penalty)
        return logits

    return process


def make_logits_processors(
    logit_bias: dict[int, float] | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    presence_penalty: float | None = None,
    presence_context_size: int = 20,
    frequency_penalty: float | None = None,
    frequency_context_size: int = 20,
    vocab_size: int | None = None,
) -> list[LogitsProcessor]:
    """mlx-lm's make_logits_processors: a penalty of None or 0 is off. With `vocab_size`,
    logit_bias's token ids are checked against it."""
    check_logits_processors(
        logit_bias,
        repetition_penalty,
        repetition_context_size,
        presence_penalty,
        presence_context_size,
        frequency_penalty,
        frequency_context_size,
        vocab_size,
    )
    processors: list[LogitsProcessor] = []
    if logit_bias:
        ids = mx.array(list(logit_bias.keys()))
        values = mx.array(list(logit_bias.values()))
        processors.append(lambda _, logits: logits.at[:, ids].add(values))
    for make, penalty, size in (
        (make_repetition_penalty, repetition_penalty, repetition_context_size),
        (make_presence_penalty, presence_penalty, presence_context_size),
        (make_frequency_penalty, frequency_penalty, frequency_context_size),
    ):
        if penalty:
            processors.append(make(penalty, size))
    return processors


@dataclass
class SamplingOptions:
    """Every sampling option a user sets, with mlx-lm's defaults: what the CLI's flags and a
    request's fields fill in, and the one place both build their sampler from."""

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20

    def check(self, vocab_size: int | None = None, cli: bool = False) -> None:
        check_sampler(
            self.temp,
            self.top_p,
            self.min_p,
            self.min_tokens_to_keep,
            self.top_k,
            self.xtc_probability,
            self.xtc_threshold,
            cli=cli,
        )
        check_logits_processors(
            self.logit_bias,
            self.repetition_penalty,
            self.repetition_context_size,
            self.presence_penalty,
            self.presence_context_size,
            self.frequency_penalty,
            self.frequency_context_size,
            vocab_size,
            cli=cli,
        )

    def sampler(self, tokenizer=None) -> Sampler:
        """XTC never drops a newline or an end-of-sequence token (as mlx-lm's server)."""
        specials: list[int] = []
        if self.xtc_probability > 0 and tokenizer is not None:
            specials = list(tokenizer.encode("\n", add_special_tokens=False))
            specials += sorted(tokenizer.eos_token_ids)
        return make_sampler(
            self.temp,
            self.top_p,
            self.min_p,
            self.min_tokens_to_keep,
            self.top_k,
            self.xtc_probability,
            self.xtc_threshold,
            specials,
        )

    def logits_processors(self, vocab_size: int | None = None) -> list[LogitsProcessor]:
        return make_logits_processors(
            self.logit_bias,
            self.repetition_penalty,
            self.repetition_context_size,
            self.presence_penalty,
            self.presence_context_size,
            self.frequency_penalty,
            self.frequency_context_size,
            vocab_size,
        )
