"""Decode without a host round trip per layer (the layer handshake, in its decode form).

The per-layer handshake (strata_mlx.experts, "sync") stops the device at every MoE layer to
read its routing ids: 48 syncs a token cost 21-26 ms/token on the H200 where the whole token
computes in ~14 ms. The pipelined decoder builds each layer with its expert slots looked up on
the device, in the residency row the cache keeps current, and verifies each layer's routing
later against the row it was built with:

  - all chosen experts were resident: the layer is exact (the kernels compute each
    (token, expert) pair from its slot, the same arithmetic as the sync path);
  - one was not: the device is drained (what was computed after it is discarded), the KV /
    recurrent state of those layers is rolled back, and the layer is computed again with the
    sync handshake (its misses are urgent reads that it waits for, as every miss is; they were
    submitted when the check found them, so they land while the device drains); decoding
    goes on pipelined from the next layer.

A token runs in one of three ways, chosen from the running share of decode layers that missed
(`ExpertCache.decode_layer_miss_rate`):

  - "token" (below `token_below`, the warm case): the whole token is built and submitted (in
    chunks of `chunk` layers; 0: at once) without a check; its layers are verified once the
    next token is built too (`Step` / `finish`), so the host builds token t+1 while the device
    computes token t, as mlx-lm's generate_step does. A miss discards both and recomputes from the
    missed layer. No read-ahead is issued in this mode.
  - "layers" (up to `sync_above`, or whenever decode lookahead predicts, unless
    `token_while_predicting` lets the share of layers that missed alone decide): layers are
    submitted `layers_chunk` at a time (default 1) and each is verified `lag` layers later,
    while the device computes the ones after it; a miss costs at most `lag` + 1 layers of
    recomputation plus its read, and the lookahead reads of layer l + lag + 1 go in while
    layer l's successors compute. With `lag` >= `layers_chunk` - 1 every check reads a layer
    already submitted (a smaller lag is exact too, its checks evaluate the layer themselves).
  - "sync" (above `sync_above`): the per-layer handshake (measured break-even,
    docs/decisions.md); its misses keep the running rate current, so pipelining resumes.
  - "gated" (instead of "layers" and "sync" where the expert cache keeps a gate table,
    RuntimeConfig.decode_gate): layers are submitted as in "layers" mode, but each layer's
    routing ids go to the device ahead of its experts, and its experts wait on the device
    (the gate kernel, custom_kernels/gate.py) until the gate table (strata_mlx.stream.gate)
    shows their records landed. The check `lag` layers behind is the layer's handshake: it
    submits the misses the device is waiting for and lookahead's read-ahead, and never
    fails, so nothing is recomputed and the host is never between two layers of a token on
    the device. A gate that gives up (a read stuck past its timeout) sets a flag the token's
    end reads: that layer is recomputed by the per-layer handshake (a token built on this
    one meanwhile is discarded, as after a miss); once `gate_give_ups` of them have waited out
    their timeout in the decoder's life it stops gating (the rest of that token included),
    warning once. Where the device cannot wait (no CUDA), the host's gate runs each layer's
    check before its experts are queued and waits for its reads, as "sync" does. No token is
    built on a gated one before it is verified: its last checks may give a miss the slot of a
    layer not computing yet, which a token built on top ("token" mode: slots looked up when
    built) would read unchecked. A token that may launch a kernel the process has not loaded (the
    first with its cache's buffer shapes, one that grows a buffer or whose keys reach a count
    where attention changes kernels) runs ungated: CUDA may
    synchronize the context to load a module, and a read's copy then waits behind the
    waiting gate until it gives up (`PipelinedDecoder._loads_code`).

Outputs are bit-identical to the sync path in every mode (tests/test_decode.py).

Slots are safe to refill only while nothing in flight reads them: the arena is written only
after a drain, or ("layers" and "gated" modes) into slots of layers not in flight (their rows
are rebuilt before those layers are built again; a gated layer reads the gate table when the
device reaches it). A gated layer's miss may also take a slot from a layer built after it:
the device cannot pass the missing layer's gate before that read lands, so no later layer has
read the table yet (DeferredHandshake.check_gated).

Both strategies sit behind one interface, `Decoder.decode(...)`: an iterator of (token,
logprobs) that generation's `generate_step` runs after the prefill. `SyncDecoder` runs every
token through the model's forward (the per-layer handshake); `PipelinedDecoder` the modes
above. The loop itself (sampling, building the next token ahead, resampling after a miss from
the same random key) is written once, in `Decoder.decode`.

This module never reads files; the expert cache does.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx

from ..models.base import ArraysCache, key_buffer
from .deferred import joint_routing, spread_routing

# sample(logits [1, n, vocab]) -> (token [1], logprobs [vocab]) from the last position
Sample = Callable[[mx.array], tuple[mx.array, mx.array]]

MODES = ("pipelined", "sync")
WHOLE_TOKEN = 1 << 20  # a lag past every layer: checked at the token's end


def choose_mode(
    layer_miss_rate: float,
    predicting: bool,
    sync_above: float,
    token_below: float,
    token_while_predicting: bool = False,
    gated: bool = False,
) -> str:
    """ "sync", "token", "layers" or ("gated": the expert cache keeps a gate table) "gated"
    for the next token, from the running share of decode layers that missed and whether
    decode lookahead predicts (see the module docstring)."""
    token = layer_miss_rate < token_below and (token_while_predicting or not predicting)
    if gated and sync_above >= 0:  # (a negative sync_above forces "sync": thresholds())
        return "token" if token else "gated"
    if layer_miss_rate > sync_above:
        return "sync"
    return "token" if token else "layers"


class Step:
    """One decode token built on the device, its routing not all verified yet."""

    def __init__(self, cache: list, mode: str, predicting: bool = False):
        self.cache = cache
        self.mode = mode
        self.saved = [_save(c) for c in cache]  # each layer's state before this token
        self.inputs: list[mx.array | None] = [None] * len(cache)
        self.pending: list[tuple[int, object]] = []  # (decoder layer, Deferred) unverified
        self.logits: mx.array | None = None
        self.last: mx.array | None = None  # the last array submitted to the device
        self.tail: mx.array | None = None  # the last layer output built (submitted or not)
        self.built = 0  # layers built (their state written)
        # gated: (layer, its gate's `late`: the give-up flag, the longest wait)
        self.late: list[tuple[int, mx.array]] = []
        self.joint: mx.array | None = None  # "token": its layers' routing as one array
        self.discarded = False
        self.begun = mode  # the mode it was begun in (a miss turns `mode` to "layers")
        self.predicting = predicting  # decode lookahead predicted when it was begun


def _unsent_board(pending: list) -> bool:
    """Whether a layer of `pending` reads its routing from the board and is not on the device."""
    return any(d.gated is not None and d.gated.board and not d.gated.sent for _, d in pending)


def _sent(step: Step) -> None:
    """Everything built of `step` was just submitted to the device."""
    for _, d in step.pending:
        if d.gated is not None:
            d.gated.sent = True


class Done:
    """A token the model's forward computed whole: nothing left to verify (the per-layer
    handshake ran it, predicting as decode lookahead did then)."""

    begun = "sync"

    def __init__(self, logits: mx.array, predicting: bool):
        self.logits = logits
        self.predicting = predicting


class Decoder:
    """The decode loop over one strategy's steps: `start` builds a token, `finish` verifies
    it (False: its logits were recomputed), `discard` rolls back one never used, `mode` says
    how the next token runs. Subclasses set `expert_cache`."""

    expert_cache = None
    gates = False  # whether its tokens may wait on a device gate (ExpertCache.phase)

    def mode(self) -> str:
        return "sync"

    def start(self, tokens: mx.array, cache: list, gate: bool = True):
        """Build one token and submit it; `gate`: it may wait on a device gate."""
        raise NotImplementedError

    def finish(self, step, later=None) -> bool:
        return True

    def builds_on(self, step) -> bool:
        """Whether a token may be built on `step` before it is verified."""
        return True

    def discard(self, step) -> None:
        pass

    def decode(
        self,
        y: mx.array,
        cache: list,
        sample: Sample,
        max_tokens: int,
        may_build_ahead: Callable[[], bool] = lambda: True,
        between: Callable[[], None] = lambda: None,
    ) -> Iterator[tuple[int, mx.array]]:
        """(token, logprobs) pairs after the prompt's last token `y` [1], which `cache`
        does not hold yet. `may_build_ahead()`: whether the next token may be built on this
        one before it is verified (not when the KV cache is about to be quantized: a miss
        recomputes this token, which must find the cache it was first built on); `between()`
        runs between two tokens when none was built ahead. Close the iterator to stop: a
        token built ahead and never verified is rolled back, so `cache` then covers every
        yielded token but the last."""
        ec = self.expert_cache
        # The prompt's last token is prefill's, and waits on no device gate: in prefill's
        # phase no held copy is given up (tell_words), and on an H200 four device gates of a
        # second generation's first token, built right after its prompt's chunks, waited out
        # their timeout, which stopped gated decode for the model's life (2.6x slower after).
        with ec.phase(decoding=False):
            step = self.start(y[None], cache, gate=False)
        later = None
        pr = ec.predictor
        clock = _TokenClock(pr)
        with ec.phase(decoding=True, gating=self.gates):
            try:
                for n in range(max_tokens):
                    rng = mx.random.state[0]  # the key this token's sample draws from
                    token, logprobs = sample(step.logits)
                    # The next token is built on this one before this one is verified, while
                    # the device computes it ("token" mode; mlx-lm's generate_step overlaps
                    # alike), unless the next token reads ahead where this one did not (the
                    # read-ahead duel's switch: the mode is chosen again for it).
                    later, begun = None, False
                    ahead = n + 1 < max_tokens and may_build_ahead() and self.builds_on(step)
                    if ahead and self.mode() == "token":
                        pr.decode_begin()
                        begun = True
                        if ec.predicts_in_decode() == step.predicting:
                            # (an id past the vocabulary, a custom sampler's, is refused
                            # below; the token built on it meanwhile must not read past the
                            # embedding: MLX's gather does not check its indices)
                            safe = mx.clip(token, 0, logprobs.shape[-1] - 1)
                            later = self.start(safe[None], cache)
                    if not self.finish(step, later):
                        # A layer missed: the logits were recomputed and `later` discarded.
                        # Sample again from the same key: the tokens equal the sync path's.
                        mx.random.seed(_seed_of(rng))
                        token, logprobs = sample(step.logits)
                        later = None
                    mx.eval(token)
                    _count_mode(ec, step)
                    clock.final(step.predicting, first=n == 0)
                    if n == 0:  # (the prompt's last token recorded)
                        _mark_decode(ec.trace, "begin_decode")
                    t = token.item()
                    if not 0 <= t < logprobs.shape[-1]:
                        raise ValueError(
                            f"the sampler gave token id {t}, outside the vocabulary "
                            f"[0, {logprobs.shape[-1]})"
                        )
                    yield t, logprobs
                    if n + 1 == max_tokens:
                        break
                    if later is None:
                        between()
                        if not begun:
                            pr.decode_begin()
                    step, later = later or self.start(mx.array([[t]]), cache), None
            finally:
                if later is not None:  # closed at a yield: the token built ahead is unchecked
                    self.discard(later)
                _mark_decode(ec.trace, "end_decode")


def _mark_decode(trace, mark: str) -> None:
    """A routing trace told where decode begins or ends, where it takes such marks (a
    script's own recorder may not: its split is then guessed, strata_mlx.stream.trace)."""
    told = getattr(trace, mark, None)
    if told is not None:
        told()


class SyncDecoder(Decoder):
    """Every token through `forward` (the model, or the pipeline's rank 0), each MoE layer
    by the per-layer handshake."""

    def __init__(self, forward: Callable, expert_cache):
        self.forward = forward
        self.expert_cache = expert_cache

    def start(self, tokens: mx.array, cache: list, gate: bool = True) -> Done:
        predicting = self.expert_cache.predicts_in_decode()
        return Done(self.forward(tokens, cache=cache), predicting)


def _count_mode(expert_cache, step) -> None:
    """One token's logits are final: count the decoder mode it was begun in (a token built
    ahead and discarded counts once, as the token it was rebuilt as)."""
    st = expert_cache.stats
    name = f"{step.begun}_mode_tokens"
    setattr(st, name, getattr(st, name) + 1)
    st.predicting_tokens += step.predicting


class _TokenClock:
    """Each decode token's wall time from the token before it final to its own, told to the
    predictor (which keeps prediction on in decode only while it pays: prediction.DecodeDuel).
    The caller's time at the yield is in it: a token built ahead computes meanwhile."""

    def __init__(self, predictor):
        self.predictor = predictor
        self.last = 0.0  # when the token before was final
        predictor.decode_start()

    def final(self, predicted: bool, first: bool) -> None:
        now = time.perf_counter()
        if not first:  # (the first is the prompt's last token, built in prefill's phase)
            self.predictor.decode_token(predicted, now - self.last)
        self.last = now


def _seed_of(key: mx.array) -> int:
    """The seed that makes `key` ([2] uint32) the global random key again."""
    hi, lo = (int(v) for v in key.tolist())
    return (hi << 32) | lo


def _check(lag: int, chunk: int, layers_chunk: int, sync_above: float, token_below: float):
    """PipelinedDecoder's arguments, each in its range (ValueError naming it where not)."""
    if lag < 0:
        raise ValueError(f"decode lag must be >= 0, got {lag}")
    if chunk < 0:
        raise ValueError(f"decode_chunk must be >= 0 (0: the whole token), got {chunk}")
    if layers_chunk < 1:
        raise ValueError(f"decode_layers_chunk must be >= 1, got {layers_chunk}")
    for name, v in (("decode_sync_above", sync_above), ("decode_token_below", token_below)):
        if not 0 <= v <= 1:
            raise ValueError(f"{name} must lie in [0, 1], got {v}")


class PipelinedDecoder(Decoder):
    """Decode steps (one token each) of `model` with deferred routing checks."""

    def __init__(
        self,
        model,
        lag: int = 1,
        sync_above: float = 0.3,
        token_below: float = 0.02,
        chunk: int = 0,
        layers_chunk: int = 1,
        token_while_predicting: bool = False,
        gate_give_ups: int = 0,
        gated: tuple[int, int] | None = None,
    ):
        _check(lag, chunk, layers_chunk, sync_above, token_below)
        self.model = model
        self.expert_cache = model.expert_cache
        # a gated token's (lag, layers_chunk) where its own (WHOLE_TOKEN: checked at its end)
        self.lag, self.gated_lag, self.gated_chunk = lag, *(gated or (lag, layers_chunk))
        self.sync_above = sync_above
        self.token_below = token_below
        self.chunk = chunk
        self.layers_chunk = layers_chunk
        self.token_while_predicting = token_while_predicting
        # Gated decode stops once this many gates waited out their timeout (0: never; the
        # loader passes RuntimeConfig.decode_gate_give_ups); `given_up` counts them.
        self.gate_give_ups, self.given_up = gate_give_ups, 0
        # "token" mode reads a token's routing in one transfer at its end (joint_routing,
        # where JOIN_IDS: CUDA, a transfer a read), not one a layer; off for a comparison.
        self.join_routing = True
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.layers = model.layers
        tied = getattr(model.args, "tie_word_embeddings", False)
        self.head = inner.embed_tokens.as_linear if tied else model.lm_head
        self.expert_cache.plan_pipelined_lookahead(lag + 1)
        # The caches' buffer shapes some token ran ungated with (`_loads_code`).
        self.ran: set[tuple] = set()

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        """tokens [1, 1] -> logits [1, 1, vocab], bit-identical to model(tokens, cache)."""
        step = self.start(tokens, cache)
        self.finish(step)
        return step.logits

    @contextmanager
    def thresholds(self, sync_above: float, token_below: float) -> Iterator[None]:
        """Run with these mode thresholds inside the block (a forecast times each mode
        alone: sync_above -1 forces "sync", 1 with token_below 0 forces "layers")."""
        kept = self.sync_above, self.token_below
        self.sync_above, self.token_below = sync_above, token_below
        try:
            yield
        finally:
            self.sync_above, self.token_below = kept

    def mode(self) -> str:
        """How the next token runs: "token", "layers", "sync" or "gated" (module docstring)."""
        return self._mode(gated=True)

    def _mode(self, gated: bool) -> str:
        ec = self.expert_cache
        return choose_mode(
            ec.decode_layer_miss_rate,
            ec.predicts_in_decode(),
            self.sync_above,
            self.token_below,
            self.token_while_predicting,
            gated and ec.pipelined.gated and not self.gave_up,
        )

    def _loads_code(self, cache: list) -> bool:
        """Whether a token built now may launch a kernel this process has not loaded: a
        cache's buffer grows with it, its keys reach one of ATTENTION_STEPS, or no token ran
        ungated with these buffers' shapes (the first, or the first after a prompt of another
        length: cuDNN's attention plans are keyed by the buffer's shape and built at their
        first use). Loading a module may synchronize the CUDA context: behind a device gate
        waiting for a read, the read's copy then waits for the load and the gate gives up.
        Such a token runs ungated, and loads its kernels there."""
        if not self.expert_cache.pipelined.device_gate:
            return False
        if any(hasattr(c, "grows") and c.grows(1) or _reaches_step(c) for c in cache):
            return True
        return _shapes(cache) not in self.ran

    @property
    def gates(self) -> bool:
        return self.expert_cache.pipelined.gated

    @property
    def gave_up(self) -> bool:
        """Whether gating stopped: `gate_give_ups` gates waited out their timeout in this
        decoder's life."""
        return 0 < self.gate_give_ups <= self.given_up

    def start(self, tokens: mx.array, cache: list, gate: bool = True) -> Step:
        """Build one token (tokens [1, 1], possibly not yet evaluated) and submit it; in
        "token" mode nothing is verified until `finish`; without `gate`, never on the device's
        gate (the host's gate may still run it)."""
        ec = self.expert_cache
        mode = self.mode()
        device_gate = ec.pipelined.device_gate
        if mode == "gated" and (not gate and device_gate or self._loads_code(cache)):
            mode = self._mode(gated=False)
        step = Step(cache, mode, ec.predicts_in_decode())
        if step.mode == "sync":
            # Most layers miss: each would be built, found wrong and recomputed. The sync
            # handshake is cheaper here (H200: 178 against 228 ms/token at 35 % misses).
            ec.settle()
            step.logits = self.model(tokens, cache=cache)
        else:
            if step.mode in ("layers", "gated"):
                ec.settle()  # the last token is verified and drained: no slot in use
            self._build(step, 0, self.embed(tokens))
        if mode != "gated" and device_gate:  # (its kernels loaded: `_loads_code`)
            self.ran.add(_shapes(cache))
        return step

    def finish(self, step: Step, later: Step | None = None) -> bool:
        """Verify every layer of `step`. On a miss, `later` (a token built on top of this
        one) is discarded, and `step`'s logits are recomputed exactly: returns False."""
        ec, pr = self.expert_cache, self.expert_cache.predictor
        exact = True
        counted = None  # what was counted before a gate given up: its layers' only count
        try:
            while (wrong := self._first_wrong(step, later is None)) is not None:
                j, late = wrong
                if late and counted is None:
                    # A gate gave up waiting (a stuck read): every layer of the token was
                    # checked, and counted, already (a gated token's checks never fail, and
                    # none is built on it); the miss rates observed them too.
                    counted = ec.stats.uses(), pr.decode_miss_rate, pr.decode_layer_miss_rate
                # Layer j's output is wrong, and so is everything after it, `later` included:
                # recomputed from j (j itself through the per-layer handshake).
                if later is not None:
                    self.discard(later)
                    later = None
                h = self._recover(step, j)
                step.pending = []
                if not late or self.gave_up:
                    step.mode = "layers"  # the rest is checked as it is built
                self._build(step, j + 1, h)
                exact = False
            return exact
        finally:
            if counted is not None:  # the recompute's counts and observations undone
                uses, pr.decode_miss_rate, pr.decode_layer_miss_rate = counted
                ec.stats.restore_uses(uses)

    def _first_wrong(self, step: Step, alone: bool) -> tuple[int, bool] | None:
        """(the first layer of `step` to recompute, whether its gate gave up): its pending
        layers checked in order (a miss), then its gates' flags; None where all are exact.
        `alone`: no token is built on `step`."""
        if step.joint is not None:  # "token" mode: every layer's routing in one read
            t = time.perf_counter()
            spread_routing(step.joint, [d for _, d in step.pending])
            step.joint = None
            self.expert_cache.stats.route_sync_s += time.perf_counter() - t
        while step.pending:
            j, d = step.pending.pop(0)
            if not self.expert_cache.check_deferred(d, alone=alone):
                return j, False
        j = self._late(step)
        return None if j is None else (j, True)

    def builds_on(self, step: Step) -> bool:
        """Not on a gated token: its last checks may give a miss the slot of any layer not
        computing yet, which a token built on top (its slots looked up when built, in "token"
        mode) would read without its check seeing it."""
        return step.mode != "gated"

    def _late(self, step: Step) -> int | None:
        """The first layer of `step` whose device gate gave up, or None (one read a token,
        which also counts the time the device stood at the token's gates: `gate_wait_s`)."""
        if not step.late:
            return None
        layers = [j for j, _ in step.late]
        flags = mx.concatenate([f for _, f in step.late]).tolist()
        step.late = []
        table = self.expert_cache.sched.residency.gate
        if table.stopped():  # (the token's gates have run: none is waiting on the word)
            table.go_on()
        st = self.expert_cache.stats
        st.gate_wait_s += sum(flags[1::2]) * 1e-6
        late = [j for j, f in zip(layers, flags[0::2]) if f]
        if not late:
            return None
        from custom_kernels.gate import timeout_ms

        st.gate_timeouts += len(late)
        stopped = self.gave_up
        # Only a gate that waited out its timeout counts toward stopping: one given up at once
        # (a held copy's, past decode_copy_held_ms; a failed read's) cost a recompute only.
        timeout_us = timeout_ms() * 1000
        self.given_up += sum(1 for f, w in zip(flags[0::2], flags[1::2]) if f and w >= timeout_us)
        if self.gave_up and not stopped:
            warnings.warn(
                f"gated decode: {self.given_up} gates waited out their {timeout_ms()} ms "
                "timeout for their reads; decoding without the gate from here "
                "(--decode-gate-give-ups sets how many)",
                RuntimeWarning,
                stacklevel=2,
            )
        return late[0]

    def discard(self, step: Step) -> None:
        """Undo a token that was built but will not be used: wait for the device to finish
        it (its kernels read slots that a miss is about to refill) and roll its state back."""
        if step.discarded:  # (an error inside finish, after it discarded `step`)
            return
        step.discarded = True
        step.joint = None
        if step.last is not None:  # (a sync token has no last: it was evaluated layer by layer)
            mx.eval(step.last)
        for c, s in zip(step.cache, step.saved):
            _restore(c, s)
        step.pending = []
        self.expert_cache.settle()

    def _build(self, step: Step, i: int, h: mx.array) -> None:
        """Build layers i.. and the head of `step`; in "layers" mode check as we go."""
        ec = self.expert_cache
        n = len(self.layers)
        checked = step.mode in ("layers", "gated")  # as built; "token" mode at its end
        gated = step.mode == "gated"
        lag = (self.gated_lag if gated else self.lag) if checked else n
        chunk = (self.gated_chunk if gated else self.layers_chunk) if checked else self.chunk or n
        lookahead = checked  # "token" mode checks too late for a prediction
        outs: list[mx.array] = []
        while True:
            if i < n:
                step.inputs[i] = h
                with ec.pipelined.building(lookahead, gated) as deferred:
                    h = self.layers[i](h, None, step.cache[i])
                step.tail = h
                step.pending += [(i, d) for d in deferred]
                step.late += [
                    (i, d.gated.late)
                    for d in deferred
                    if d.gated is not None and d.gated.late is not None
                ]
                # (a gated layer's outputs are already submitted or evaluated, or feed the
                # board's kernel on the way to h: not again, where the checks' thread reads them)
                outs += [a for d in deferred if d.gated is None for a in d.outputs()]
                i += 1
                step.built = max(step.built, i)
            if i < n:
                check = max(len(step.pending) - lag, 0)
                # (a check that reads the routing board waits for the device: its layer
                # goes there first, chunk or not)
                if i % chunk == 0 or _unsent_board(step.pending[:check]):
                    mx.async_eval(h, *outs)
                    step.last, outs = h, []
                    _sent(step)
            else:  # every layer built: the head goes in while the last ones are checked
                step.logits = self.head(self.norm(h))
                if not checked and self.join_routing:  # its routing read once, at its end
                    step.joint = joint_routing([d for _, d in step.pending])
                if step.joint is not None:  # (ahead of the head: the first thing read)
                    mx.async_eval(step.joint, step.logits, *outs)
                else:
                    mx.async_eval(step.logits, *outs)
                step.last = step.logits
                _sent(step)
                check = len(step.pending) if checked else 0
            missed = None
            for _ in range(check):
                j, d = step.pending.pop(0)
                if not ec.check_deferred(d):
                    missed = j
                    break
            if missed is not None:
                # Everything built after layer `missed` used its wrong output: discard it.
                h = self._recover(step, missed)
                step.pending, outs, i = [], [], missed + 1
            elif i == n:
                return

    def _recover(self, step: Step, j: int) -> mx.array:
        """Layer j missed: drain the device, roll back layers j.. and run j synchronously."""
        ec = self.expert_cache
        t = time.perf_counter()
        # Nothing in flight may read a slot that the misses will refill: the layers built
        # but not yet submitted (chunks) too, since their KV writes would run later, when
        # the rebuilt layers are evaluated on top of them.
        mx.eval(step.last, step.tail)
        ec.settle(keep=j)  # layer j's slots stay protected until its handshake pins them
        ec.stats.route_sync_s += time.perf_counter() - t
        ec.stats.recomputed_layers += step.built - j
        step.built = j + 1
        for k in range(j, len(step.cache)):
            _restore(step.cache[k], step.saved[k])
        # The sync handshake: urgent reads for the misses, waited for; groups if needed.
        h = self.layers[j](step.inputs[j], None, step.cache[j])
        mx.async_eval(h)
        step.last = h
        return h


# The key counts at which MLX's CUDA attention for one token changes kernels: its vector
# kernel below 256 keys; cuDNN's from 256 where the keys are a slice of a buffer of a multiple
# of 256 positions (mlx-lm's caches and ours); the vector kernel's two-pass form past 1024.
ATTENTION_STEPS = (256, 1025)


def _reaches_step(c) -> bool:
    """Whether the next token's keys in cache `c` reach one of ATTENTION_STEPS."""
    offset = getattr(c, "offset", None)
    if not isinstance(offset, int) or getattr(c, "keys", None) is None:
        return False
    before, after = offset, offset + 1
    if (cap := getattr(c, "max_size", None)) is not None:  # (a window's keys stop at it)
        before, after = min(before, cap), min(after, cap)
    return any(before < s <= after for s in ATTENTION_STEPS)


def _shapes(cache: list) -> tuple:
    """Each cache's kind and its keys' buffer's shape (what attention reads), where it has one."""
    return tuple(
        None if (keys := key_buffer(c)) is None else (type(c).__name__, tuple(keys.shape))
        for c in cache
    )


def _save(c):
    if c is None:
        return None
    if hasattr(c, "snapshot"):  # a cache that overwrites (RotatingKVCache) saves its own
        return c.snapshot()
    return (c.offset, list(c.cache) if isinstance(c, ArraysCache) else None)


def _restore(c, state) -> None:
    if c is None:
        return
    if hasattr(c, "restore"):
        c.restore(state)
        return
    c.offset, arrays = state
    if arrays is not None:
        c.cache[:] = arrays
