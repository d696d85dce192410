"""Decode without a host round trip per layer (SPEC mechanism 4, in its decode form).

The per-layer handshake (strata_mlx.experts, "sync") stops the device at every MoE layer to
read its routing ids: 48 syncs a token cost 21-26 ms/token on the H200 where the whole token
computes in ~14 ms. The pipelined decoder builds each layer with its expert slots looked up on
the device, in the residency row the cache keeps current, and submits it with
`mx.async_eval`. The host reads a layer's routing `lag` layers later, while the device is busy
with the layers after it, and checks it against the row the layer was built with:

  - all chosen experts were resident: the layer is exact (the kernels compute each
    (token, expert) pair from its slot, the same arithmetic as the sync path);
  - one was not: the device is drained (the layers computed after it are discarded), the
    KV / recurrent state of those layers is rolled back, and the layer is computed again with
    the sync handshake (its misses become urgent reads that it waits for, as SPEC asks);
    decoding goes on pipelined from the next layer.

So outputs are bit-identical to the sync path (tests/test_decode.py) and a miss costs at most
`lag` + 1 layers of recomputation plus its read. While more than `sync_above` of recent decode
layers missed, whole tokens run the sync handshake instead (measured break-even, see
docs/decisions.md); its misses keep the running rate current, so pipelining resumes.

Slots are safe to refill only while nothing in flight reads them: in this decoder the arena is
written only after a drain, or into slots of layers not in flight (their rows are rebuilt
before those layers are built again).

This module never reads files; the expert cache does.
"""

from __future__ import annotations

import time

import mlx.core as mx

from .models.base import ArraysCache

MODES = ("pipelined", "sync")


class PipelinedDecoder:
    """One decode step (a single token) of `model` with deferred routing checks."""

    def __init__(self, model, lag: int = 1, sync_above: float = 0.3):
        if lag < 0:
            raise ValueError(f"decode lag must be >= 0, got {lag}")
        if not 0 <= sync_above <= 1:
            raise ValueError(f"decode_sync_above must lie in [0, 1], got {sync_above}")
        self.model = model
        self.expert_cache = model.expert_cache
        self.lag = lag
        self.sync_above = sync_above
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.layers = model.layers
        tied = getattr(model.args, "tie_word_embeddings", False)
        self.head = inner.embed_tokens.as_linear if tied else model.lm_head
        self.expert_cache.plan_pipelined_lookahead(lag + 1)
        self._last: mx.array | None = None  # the last step's logits

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        """tokens [1, 1] -> logits [1, 1, vocab], bit-identical to model(tokens, cache)."""
        ec = self.expert_cache
        if ec.decode_layer_miss_rate > self.sync_above:
            # Most layers miss: each would be built, found wrong and recomputed. The sync
            # handshake is cheaper here (H200: 178 against 228 ms/token at 35 % misses).
            ec.settle()
            return self.model(tokens, cache=cache)
        n = len(self.layers)
        saved = [_save(c) for c in cache]  # each layer's cache state before this token
        inputs: list[mx.array | None] = [None] * n
        pending: list[tuple[int, object]] = []  # (decoder layer, Deferred) not yet verified
        h = self.embed(tokens)
        i = 0
        if self._last is not None:
            mx.eval(self._last)  # (already evaluated by the sampler in a generation loop)
        ec.settle()
        ec.arena.unpin_all()  # the last token is evaluated: no slot is in use
        while True:
            outs: list[mx.array] = []
            if i < n:
                inputs[i] = h
                ec.pipeline = deferred = []
                try:
                    h = self.layers[i](h, None, cache[i])
                finally:
                    ec.pipeline = None
                pending += [(i, d) for d in deferred]
                outs = [a for d in deferred for a in d.outputs()]
                i += 1
            if i < n:
                mx.async_eval(h, *outs)
                check = max(len(pending) - self.lag, 0)
            else:  # every layer built: the head goes in while the last ones are checked
                logits = self.head(self.norm(h))
                mx.async_eval(logits, *outs)
                check = len(pending)
            missed = None
            for _ in range(check):
                j, d = pending.pop(0)
                if not ec.check_deferred(d):
                    missed = j
                    break
            if missed is not None:
                # Everything built after layer `missed` used its wrong output: discard it.
                h = self._recover(missed, i, h, inputs, cache, saved)
                pending, i = [], missed + 1
            elif i == n:
                self._last = logits
                return logits

    def _recover(self, j: int, built: int, h: mx.array, inputs, cache, saved) -> mx.array:
        """Layer j missed: drain the device, roll back layers j.. and run j synchronously."""
        ec = self.expert_cache
        t = time.perf_counter()
        mx.eval(h)  # nothing in flight may read a slot that the misses will refill
        ec.settle()
        ec.stats.route_sync_s += time.perf_counter() - t
        ec.stats.recomputed_layers += built - j
        ec.arena.unpin_all()
        for k in range(j, built):
            _restore(cache[k], saved[k])
        # The sync handshake: urgent reads for the misses, waited for; groups if needed.
        h = self.layers[j](inputs[j], None, cache[j])
        mx.async_eval(h)
        return h


def _save(c):
    if c is None:
        return None
    return (c.offset, list(c.cache) if isinstance(c, ArraysCache) else None)


def _restore(c, state) -> None:
    if c is None:
        return
    c.offset, arrays = state
    if arrays is not None:
        c.cache[:] = arrays


def forward(model, tokens: mx.array, cache: list) -> mx.array:
    """logits of `tokens` [1, T]: a single decode token goes through the pipelined decoder
    when the model's runtime asks for it, everything else through the model itself."""
    dec = getattr(model, "decoder", None)
    if dec is not None and tokens.shape[1] == 1 and model.expert_cache.dump is None:
        return dec(tokens, cache)
    return model(tokens, cache=cache)
