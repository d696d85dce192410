"""Prediction: which experts the next layer will want, before its routing is known.

Three read-ahead policies, selectable because every claim about them is a side-by-side
measurement:

- "demand": no read-ahead; every non-resident expert is an urgent miss.
- "static": the seed's baseline. After layer l's wait returns, the next layer's most popular
  experts from the routing profile, capped (default 256).
- "lookahead": right after layer l's routing, layer l+1's router (exact top-k) applied to
  layer l's MoE input for every token; predicted experts ordered most-tokens-first and all
  submitted (no cap) before layer l waits on its misses. Layer 0 comes from the profile rank.

With lookahead, the layers after the next one (depth > 1) are predicted from the same input
through their own routers; the scheduler reads them once the next layer's reads are done.

With `score`, decode's read-ahead is scored by expected use (`ExpectedUse`): a predicted
expert is read only while its expected next use comes before that of the expert its read
would evict (the eviction policy's estimate, e.g. NextUse.distance), not to a fixed depth.
Both decoders' read-ahead goes through `Predictor.ahead_bar` (the per-layer handshake's and
the pipelined decoder's checks), which is also where the eviction policy is told the
prediction (Arena.scored: its optional `predicted` hook).

`Predictor` holds the policy's decisions for one model: which layers a handshake predicts,
what it submits after its wait (static, layer 0), the running decode miss rates that
switch decode's prediction and the pipelined decoder's modes, and the read-ahead's score.
It only ranks and scores expert ids; it never reads files or touches the arena.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..config import PANEL_MEMORY, opt

READ_AHEAD_POLICIES = ("demand", "static", "lookahead")


@dataclass
class ReadAhead:
    """The read-ahead settings: a group of runtime options inside runtime.options.
    RuntimeConfig, each declared here once (strata_mlx.config.opt: its flag, preset key, range
    and bench variant)."""

    policy: str = field(
        default="lookahead",
        metadata=opt(
            "demand (no read-ahead) | static (the profile's popular experts) | lookahead "
            "(the next layers' routers on this layer's input).",
            choices=READ_AHEAD_POLICIES,
            panel=PANEL_MEMORY,
            name="read_ahead",
        ),
    )
    static_cap: int = field(
        default=256, metadata=opt("static: experts read ahead per layer.", (0, None))
    )
    min_tokens: int = field(
        default=1,
        metadata=opt(
            "lookahead: a predicted expert needs at least this many tokens.",
            (1, None),
            name="lookahead_min_tokens",
        ),
    )
    # Decode predicts only while the recent decode miss rate exceeds this: with a warm arena
    # (measured on the H200: ~1 % decode misses) the prediction's router work and its extra
    # kernels on each layer's critical path cost more than the reads it could hide
    # (lookahead decode 14.4 tok/s against demand 19.2). 0 predicts always.
    decode_min_miss: float = field(
        default=0.02,
        metadata=opt(
            "Decode predicts while its miss rate is above this (0: always).",
            (0.0, 1.0),
            name="lookahead_decode_min_miss",
        ),
    )
    # lookahead: layers predicted from each layer's input (l+1 .. l+depth, each through its
    # own router), read in that order; those after l+1 once l+1's reads are done
    depth: int = field(
        default=2,
        metadata=opt(
            "lookahead: layers predicted ahead from each layer's input.",
            (1, 1 << 10),
            name="lookahead_depth",
            variant="d",
        ),
    )

    # Decode's one token: each layer ahead predicted as the router's top k + extra, not its
    # top k, and all of them read ahead. On an H100 (docs/benchmarks.md, "Wider decode
    # lookahead") +5 and +10 cut decode's misses from 7.7 % to 4.3 and 2.6, but the extra
    # reads made the misses left land later: decode 0.79-0.94x and 0.62-0.73x as fast, on the
    # tmpfs and behind 6 GB/s. Off.
    extra: int = field(
        default=0,
        metadata=opt(
            "lookahead in decode: experts predicted beyond the router's top k for each layer "
            "ahead (its next best), read ahead too; families whose router gives ids alone.",
            (0, 1 << 10),
            name="lookahead_extra",
            variant="x",
        ),
    )

    # Decode's prediction hides a miss's read behind the layers before it, but costs the host
    # the predicted routers' ids (the checks' thread ~6 ms more CPU a token on an H100) and
    # the drive the reads it guesses wrong. Which wins depends on the drive, the arena and
    # the model, so decode times its tokens each way and keeps the faster (DecodeDuel): on an
    # H100 1.06-1.26x the tok/s of predicting every token on the tmpfs, 1.18-1.19x behind an
    # emulated 2 GB/s drive, a tie behind 6 GB/s (docs/benchmarks.md).
    decode_duel: bool = field(
        default=True,
        metadata=opt(
            "lookahead in decode: time tokens with and without prediction and keep the "
            "faster way (timed again every ~100 tokens; --lookahead-decode-min-miss 0 "
            "predicts always).",
            name="lookahead_decode_duel",
            variant="dd",
        ),
    )

    # Replayed on the traces of docs/research.md (section 6), the score reads fewer records
    # than plain lookahead where the arena holds most of a pass's experts; off by default
    # until a live run on the full-size store says what it does to ms/token.
    score: bool = field(
        default=False,
        metadata=opt(
            "lookahead in decode: read a predicted expert only while its expected next use "
            "comes before that of the expert it evicts.",
            name="lookahead_score",
            variant="sc",
        ),
    )

    # The sync handshake submits a layer's predictions before waiting for its misses, so the
    # device is idle while the host ranks them (on an H200: ~170 us of a decode layer's ~500,
    # 1-2 ms of a prefill layer's handshake). After: this layer's expert kernels are queued
    # first and computed while the host predicts; the predicted reads start after the wait for
    # this layer's misses instead of beside it. Off until a GPU run says which is faster.
    after_experts: bool = field(
        default=False,
        metadata=opt(
            "lookahead: predict once this layer's expert kernels are queued (the device "
            "computes them meanwhile), not before waiting for its misses.",
            name="lookahead_after_experts",
            variant="ae",
        ),
    )

    @property
    def predicts(self) -> bool:
        return self.policy == "lookahead"

    def decode_width(self, k: int, num_experts: int) -> int:
        """Experts one decode token's lookahead predicts for a layer ahead (`extra`)."""
        return min(k + self.extra, num_experts)


@dataclass(frozen=True)
class Ahead:
    """A decode read-ahead: lookahead's `experts` for `layer`, and the expected next use
    (handshakes) a victim must be beyond for one of them to take its slot (None: any)."""

    layer: int
    experts: list[int]
    bar: float | None = None


class ExpectedUse:
    """Decode read-ahead scored by expected use. Lookahead predicts the next layer's
    experts; one is picked there with chance q, the running share of that layer's predicted
    experts its routing then used (`observe`). Counted as NextUse counts the next use of a
    resident expert (d(l) + L (1 / p - 1) handshakes, L the MoE layers), a read-ahead for a
    layer d layers ahead is next used d + L (1 / q - 1) handshakes from now: `bar(layer, d)`
    (d is 1 for the per-layer handshake, the lag plus one for the pipelined decoder). Its
    read is worth the slot it takes only from a victim expected later than that (the arena
    gives no slot otherwise: Arena.read_ahead_bar), so read-ahead stops where the arena's
    residents are wanted sooner than the guesses, instead of at a fixed depth."""

    def __init__(self, layers: list[int], prior: float = 0.5, rate: float = 0.05):
        self.layers = list(layers)
        self.rate = rate  # weight of one call in the running share: ~20 calls
        self.precision = {layer: prior for layer in self.layers}
        self._predicted: dict[int, set[int]] = {}

    def predicted(self, layer: int, experts) -> None:
        """Lookahead predicted `experts` for `layer`'s next call."""
        self._predicted[layer] = {int(e) for e in experts}

    def observe(self, layer: int, needed) -> None:
        """`layer`'s routing chose `needed`: the share of its prediction that was used."""
        pred = self._predicted.pop(layer, None)
        if pred:
            used = len(pred.intersection(int(e) for e in needed)) / len(pred)
            q = self.precision.get(layer, used)
            self.precision[layer] = q + self.rate * (used - q)

    def bar(self, layer: int, distance: int = 1) -> float:
        """Handshakes until a read-ahead for `layer`, `distance` layers ahead of the running
        one, is expected used."""
        q = self.precision.get(layer, 0.0)
        if q <= 0.0:
            return math.inf
        return distance + len(self.layers) * (1.0 / q - 1.0)


class DecodeDuel:
    """Decode with or without lookahead's prediction, whichever its tokens say is faster: a
    trial of `block` tokens each way, in the order predict, demand, demand, predict (a drift
    of the machine's pace over the trial falls on both ways alike), then the way whose
    tokens took less (median) for `keep` tokens, then a trial again. A token takes its way
    when it is begun (`begin`; a token built ahead of the last one's check is begun before
    that one is final) and counts for that way, only where the token before it was begun the
    same way: the first tokens after a switch still find the other way's reads (or their
    absence) in the arena. Which way a token runs never changes what it computes."""

    TRIAL = (True, False, False, True)

    def __init__(self, block: int = 4, keep: int = 96):
        if block < 1 or keep < 1:
            raise ValueError(f"a duel needs a block and a keep of 1 at least: {block}, {keep}")
        self.block, self.keep = block, keep
        self.position = 0  # of the next token begun: the trial's, then the kept way's
        self.choice = True  # the kept way: predict until a trial says otherwise
        self.predicting = True  # the way of the token begun last (the one being built)
        self.samples: dict[bool, list[float]] = {True: [], False: []}
        self.last: bool | None = None  # the way of the last token timed

    @property
    def trial_tokens(self) -> int:
        return len(self.TRIAL) * self.block

    def begin(self) -> None:
        """A decode token is begun: it takes the cycle's next way."""
        p, trial = self.position, self.trial_tokens
        if p == 0:  # a trial begins: its own samples only
            self.samples = {True: [], False: []}
        elif p == trial:
            self.choice = self._faster()
        self.predicting = self.TRIAL[p // self.block] if p < trial else self.choice
        self.position = (p + 1) % (trial + self.keep)

    def start(self) -> None:
        """A generation's decode starts: its first token's time is not one of the way before."""
        self.last = None

    def token(self, predicted: bool, seconds: float) -> None:
        """A decode token begun `predicted` is final, `seconds` after the one before it."""
        if predicted == self.last:
            self.samples[predicted].append(seconds)
        self.last = predicted

    def _faster(self) -> bool:
        timed, untimed = self.samples[True], self.samples[False]
        if not timed or not untimed:  # (a way not run: the miss rate kept prediction off)
            return self.choice
        return float(np.median(timed)) <= float(np.median(untimed))


def rank_by_tokens(ids: np.ndarray, min_tokens: int = 1, in_order: bool = False) -> list[int]:
    """Distinct experts in `ids` ([T, k] top-k ids, or one token's as a list), most tokens
    first, ties by id; one token's kept in its own order with `in_order`."""
    if isinstance(ids, list):  # one token's (decode): each expert once, by id
        if min_tokens > 1:
            return []
        return list(dict.fromkeys(ids)) if in_order else sorted(set(ids))
    ids = np.asarray(ids)
    if ids.ndim == 2 and ids.shape[0] == 1:  # one token (decode), as a list
        return rank_by_tokens(ids[0].tolist(), min_tokens, in_order)
    counts = np.bincount(ids.reshape(-1))
    order = np.argsort(-counts, kind="stable")  # most tokens first, ties by id
    return order[counts[order] >= max(min_tokens, 1)].tolist()


def profile_rank(counts: np.ndarray | None, num_experts: int) -> list[int]:
    """Experts of one layer, most popular in the calibration profile first."""
    if counts is None:
        return list(range(num_experts))
    counts = np.asarray(counts)
    return np.lexsort((np.arange(num_experts), -counts)).tolist()


class Predictor:
    """The read-ahead policy's decisions for the MoE layers of one model (`manifest`'s)."""

    def __init__(self, read_ahead: ReadAhead, manifest, profile):
        self.read_ahead = read_ahead
        self.manifest = manifest
        self.layers = list(manifest.moe_layers)
        self.profile = profile
        self._profile_ranks: dict[int, list[int]] = {}
        self.num_experts = manifest.num_experts
        self.routers: dict = {}  # layer -> route(x) -> top-k ids
        self._targets: dict[int, list[int]] = {}
        self.decode_miss_rate = 1.0  # running average; starts high so decode predicts at first
        # Running fraction of decode layers that missed (pipelined decode's fallback rule)
        self.decode_layer_miss_rate = 0.0
        self.layer0_width = 0  # experts the first layer needed last time
        self.expected = ExpectedUse(self.layers) if read_ahead.score else None
        duel = read_ahead.decode_duel and read_ahead.predicts
        self.duel = DecodeDuel() if duel else None

    def register_router(self, layer: int, route) -> None:
        self.routers[layer] = route
        depth = self.read_ahead.depth
        self._targets = {
            l: [t for t in self.layers[i + 1 : i + 1 + depth] if t in self.routers]
            for i, l in enumerate(self.layers)
        }

    def targets(self, layer: int, decoding: bool) -> list[int]:
        """The layers `layer`'s handshake predicts from its input, nearest first."""
        if not self.read_ahead.predicts:
            return []
        if decoding and not self.predicts_in_decode():
            return []
        return self._targets.get(layer, [])

    def observe_use(self, layer: int, needed, decoding: bool) -> None:
        """`layer` needs `needed` (each handshake, before it predicts)."""
        if self.expected is not None and decoding:
            self.expected.observe(layer, needed)

    def ahead_bar(
        self, layer: int, experts: list[int], decoding: bool, distance: int = 1
    ) -> Ahead | None:
        """Decode's read-ahead of `experts` for `layer`, `distance` layers ahead of the
        running one (Arena.scored: the policy is told it, and with the score, a victim must
        be expected used beyond its bar for one of them to get its slot); None in prefill."""
        if not decoding:
            return None
        if self.expected is None:
            return Ahead(layer, experts)
        self.expected.predicted(layer, experts)
        return Ahead(layer, experts, self.expected.bar(layer, distance))

    def predicts_in_decode(self) -> bool:
        """Whether the next decode token predicts: lookahead's, while decode's running miss
        rate is at least `decode_min_miss` and the duel (where on) says so; always where
        `decode_min_miss` is 0 (as its flag says)."""
        ra = self.read_ahead
        if not ra.predicts or self.decode_miss_rate < ra.decode_min_miss:
            return False
        return self.duel is None or ra.decode_min_miss <= 0 or self.duel.predicting

    def decode_start(self) -> None:
        """A generation's decode starts (DecodeDuel.start); nothing without the duel."""
        if self.duel is not None:
            self.duel.start()

    def decode_begin(self) -> None:
        """A decode token is begun (DecodeDuel.begin)."""
        if self.duel is not None:
            self.duel.begin()

    def decode_token(self, predicted: bool, seconds: float) -> None:
        """A decode token is final (DecodeDuel.token)."""
        if self.duel is not None:
            self.duel.token(predicted, seconds)

    def rank(self, ids: np.ndarray | list[int]) -> list[int]:
        # (lookahead_extra: one token's ids come best first, the top k before the extra ones:
        # read in that order, an extra never takes a slot before a top-k expert)
        return rank_by_tokens(ids, self.read_ahead.min_tokens, in_order=self.read_ahead.extra > 0)

    def after_wait(self, layer: int, nxt: int | None, needed: int) -> tuple[int, list[int]] | None:
        """What to read once `layer`'s own misses are in: static's profile-ranked next layer;
        lookahead's first layer of the next forward (no router input for it yet), as wide as
        it was last time. `needed`: how many experts `layer` used."""
        if layer == self.layers[0]:
            width, self.layer0_width = self.layer0_width, needed
        else:
            width = self.layer0_width
        policy = self.read_ahead.policy
        if policy == "static":
            target = self.layers[0] if nxt is None else nxt
            return target, self.profile_rank(target)[: self.read_ahead.static_cap]
        if policy == "lookahead" and nxt is None:
            first = self.layers[0]
            return first, self.profile_rank(first)[: max(width, 1)]
        return None

    def observe_decode_layer(self, miss_rate: float) -> None:
        """Running averages over the last ~100 decode layers (the share of lookups that
        missed: whether decode predicts) and ~50 (the share of layers with a miss: whether
        pipelined decode falls back to the sync handshake)."""
        self.decode_miss_rate += 0.01 * (miss_rate - self.decode_miss_rate)
        missed = float(miss_rate > 0)
        self.decode_layer_miss_rate += 0.02 * (missed - self.decode_layer_miss_rate)

    def profile_rank(self, layer: int) -> list[int]:
        """The profile's rank of `layer`'s experts, sorted once (a lexsort of every expert
        per handshake otherwise: static's each layer, lookahead's last); callers slice it."""
        ranked = self._profile_ranks.get(layer)
        if ranked is None:
            counts = (
                None if self.profile is None else self.profile[self.manifest.layer_position(layer)]
            )
            ranked = self._profile_ranks[layer] = profile_rank(counts, self.num_experts)
        return ranked
