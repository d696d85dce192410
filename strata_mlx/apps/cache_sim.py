"""Trace replay: what an arena of N slots would have read under each eviction policy, and
under Belady's optimum, for a recorded routing trace (strata_mlx.stream.trace).

    strata-mlx cache-sim TRACE --slots N --policy lru,lfu,arc,belady

The replay does what the handshake does, call by call and MoE layer by layer: the policy is
told the running layer (`current`), the layer's distinct experts are looked up together,
the layer's hits are touched and pinned, then its misses get slots one by one (each evicts
the policy's victim among the unpinned residents, or takes a free slot) and are touched; in
decode a policy with `predicted` is then told the trace's lookahead prediction for the next
layer. A policy with `phase` is told when the prompt's calls end and decode starts, as
generation tells the arena. The
online policies are the arena's own classes and the plug-ins of strata_mlx.stream.policies, so a
replay's LRU misses equal a live run's with demand reads and the per-layer handshake
(tests/test_cache_sim.py checks it). These are demand misses unless `--read-ahead` models
decode's lookahead from the trace's predictions (replay's docstring): then MB/token counts
the read-ahead too, and the misses are the reads a token still waits for.

Belady's optimum evicts the unpinned resident expert whose next use in decode is farthest
in the future; one next used in a prompt goes first (evicting it costs decode no read: the
prompt's miss reads it again). No eviction misses less in decode, and no read-ahead reads
less in decode (misses + read ahead: reading a record before its use saves no read).
"gap closed" is the share of LRU's decode misses above that optimum that a policy saves,
counting the reads ahead of a read-ahead line too (the misses alone a read-ahead could
take below the optimum: they are what a token waits for, not what it reads).

Decode figures count the trace's decode calls (every generation's decode steps: bench's
decode tokens); MB a token is reads x the store's record bytes / decode tokens. The prompts
are replayed too, so the arena enters decode holding what it would, and their misses are
reported beside decode's.

Nothing here loads a model or reads expert records.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import OptionError, parse_tokens
from ..stream import arena as arena_module
from ..stream import policies
from ..stream import trace as traces
from ..stream.prediction import ExpectedUse


@dataclass
class Replay:
    """One policy's misses over one trace at one arena size."""

    policy: str
    slots: int
    record_bytes: int
    decode_tokens: int
    prefill_lookups: int = 0
    prefill_misses: int = 0
    decode_lookups: int = 0
    decode_misses: int = 0
    decode_ahead_reads: int = 0  # read ahead in decode (modelled lookahead)
    decode_ahead_used: int = 0  # of those, used by the layer they were read for

    def count(self, decode: bool, lookups: int, misses: int, ahead_used: int) -> None:
        """One layer's lookups, misses and hits on read-ahead, in decode or in prefill."""
        if decode:
            self.decode_lookups += lookups
            self.decode_misses += misses
            self.decode_ahead_used += ahead_used
        else:
            self.prefill_lookups += lookups
            self.prefill_misses += misses

    @property
    def miss_pct(self) -> float:
        """Decode lookups that missed, %."""
        return 100.0 * self.decode_misses / self.decode_lookups if self.decode_lookups else 0.0

    @property
    def prefill_miss_pct(self) -> float:
        return 100.0 * self.prefill_misses / self.prefill_lookups if self.prefill_lookups else 0.0

    @property
    def mb_per_token(self) -> float:
        """Decode's reads a token, MB (record bytes x (misses + read-ahead) / decode tokens)."""
        if not self.decode_tokens:
            return 0.0
        return self.decode_reads * self.record_bytes / self.decode_tokens / 1e6

    @property
    def decode_reads(self) -> int:
        """Records read in decode: misses and read-ahead."""
        return self.decode_misses + self.decode_ahead_reads

    @property
    def prefill_share(self) -> float:
        """The prefill's share of the run's reads (decode's read-ahead included), %."""
        total = self.prefill_misses + self.decode_reads
        return 100.0 * self.prefill_misses / total if total else 0.0

    def line(self, lru: Replay | None = None, best: Replay | None = None) -> str:
        """One line: decode miss % and MB/token, the prefill's; with the LRU and Belady
        replays, the share of LRU's decode misses above the optimum's that this policy's
        decode reads save (module docstring)."""
        mb = f"{self.mb_per_token:8.2f} MB/token" if self.record_bytes else "    - MB/token"
        out = (
            f"{self.policy:>12}: decode {self.miss_pct:5.1f} % miss "
            f"({self.decode_misses} of {self.decode_lookups}) {mb} | prefill "
            f"{self.prefill_miss_pct:5.1f} % miss, {self.prefill_share:4.1f} % of reads"
        )
        if self.decode_ahead_reads:
            used = 100 * self.decode_ahead_used / self.decode_ahead_reads
            out += f" | read ahead {self.decode_ahead_reads / max(self.decode_tokens, 1):.1f}/token, {used:.0f} % used"
        if lru is not None and best is not None and lru.decode_misses > best.decode_misses:
            closed = (lru.decode_misses - self.decode_reads) / (
                lru.decode_misses - best.decode_misses
            )
            out += f" | gap closed {100 * closed:5.1f} %"
        return out


def _check_slots(trace: traces.Trace, slots: int) -> None:
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)):
        raise OptionError(f"--slots {slots!r}: expected a whole number of slots")
    if slots < 1:
        raise OptionError(f"--slots {slots}: expected at least 1")
    records = len(trace.layers) * trace.num_experts
    if slots > records:
        raise OptionError(
            f"--slots {slots}: more than the trace's {records} expert records (every one "
            f"fits at {records})"
        )
    widest = max(
        (len(np.unique(trace.ids[l][c])) for l in trace.layers for c in range(trace.calls)),
        default=0,
    )
    if widest > slots:
        raise OptionError(
            f"--slots {slots}: a layer needs {widest} experts in one call of this trace "
            f"(the runtime would run expert-major groups); give at least {widest}"
        )


def _predictions(trace: traces.Trace) -> dict[int, list[np.ndarray]]:
    """The trace's predictions for each layer that has one for every call (a run that
    predicted only some calls cannot be lined up with them)."""
    return {l: p for l, p in trace.predicted.items() if len(p) >= trace.calls}


READ_AHEAD = ("none", "lookahead", "scored")


class _Arena:
    """The replay's arena: which experts are resident, which of them were read ahead for a
    layer that has not run yet, and the policy that orders them (the handshake's steps on
    the arena, without slots or reads)."""

    def __init__(self, pol, name: str, slots: int):
        self.pol, self.name, self.slots = pol, name, slots
        self.distance = getattr(pol, "distance", None)
        self.phase = getattr(pol, "phase", None)
        self.decoding: bool | None = None
        self.resident: set = set()
        self.ahead: set = set()

    def set_phase(self, decoding: bool) -> None:
        """The policy's optional `phase` hook, at each change (as Arena.set_phase)."""
        if decoding != self.decoding:
            self.decoding = decoding
            if self.phase is not None:
                self.phase(decoding)

    def lookup(self, layer: int, keys: list, pinned: set) -> tuple[list, int]:
        """A layer's distinct experts: its hits touched, then its misses given slots (each
        evicting among the unpinned); (the misses, how many hits had been read ahead)."""
        missed = [k for k in keys if k not in self.resident]
        used = 0
        for k in keys:
            if k in self.resident:
                self.pol.touch(k)
                used += k in self.ahead
        self.ahead.difference_update([k for k in self.ahead if k[0] == layer])
        i, batch = 0, getattr(self.pol, "victims", None)
        while i < len(missed):
            if (
                batch is None
                or len(self.resident) < self.slots
                or len(missed) - i < arena_module.BATCH_FROM
            ):
                if len(self.resident) >= self.slots and not self.evict(pinned):
                    raise OptionError(f"--slots {self.slots}: every slot is pinned")
                self.resident.add(missed[i])
                self.pol.touch(missed[i])
                i += 1
                continue
            # the victims of one evict a miss, asked for together (as Arena.allocate_many)
            given = missed[i : i + len(self._victims(batch, pinned, missed[i:]))]
            for k in given:
                self.resident.add(k)
                self.pol.touch(k)
            i += len(given)
        return missed, used

    def _victims(self, batch, pinned: set, keys: list) -> list:
        """The policy's `victims` for `keys`, evicted (as evict's, one after another)."""
        victims = list(batch(lambda v, p=pinned: v not in p, keys) or [])
        if not victims and not self._may_go(None, pinned):
            raise OptionError(f"--slots {self.slots}: every slot is pinned")
        if len(set(victims)) < len(victims) or len(victims) > len(keys):
            raise OptionError(
                f"eviction policy {self.name}: victims() named a key twice, or more keys "
                f"than the {len(keys)} asked for"
            )
        for victim in victims:
            self._may_go(victim, pinned)
            self.pol.remove(victim)
            self.resident.discard(victim)
            self.ahead.discard(victim)
        return victims

    def read_ahead(self, keys: list, pinned: set, bar: float | None) -> int:
        """Read `keys` that are not resident, in order, until no slot may be given up (a
        victim expected used within `bar` handshakes, with a score); how many were read."""
        reads = 0
        for k in keys:
            if k in self.resident:
                continue
            if len(self.resident) >= self.slots and not self.evict(pinned, bar):
                break  # as the scheduler: the rest waits for demand (or no slot is free)
            self.resident.add(k)
            self.pol.touch(k)
            self.ahead.add(k)
            pinned.add(k)  # in flight: the arena does not evict a slot being read
            reads += 1
        return reads

    def _may_go(self, victim, pinned: set) -> bool:
        """Whether the policy's `victim` may be evicted: False for None where every resident
        is pinned (the arena is full of the running layer and its read-ahead); an
        OptionError naming the policy where the victim breaks the interface (as the arena's
        for a plug-in: obeyed, it would count fewer misses than any live run has)."""
        if victim is None:
            if all(k in pinned for k in self.resident):
                return False
            why = "victim() returned None while resident experts could be evicted"
        elif victim not in self.resident:
            why = f"victim {victim!r} is not resident"
        elif victim in pinned:
            why = (
                f"victim {victim!r} may not be evicted (pinned: the running layer's, or read ahead)"
            )
        else:
            return True
        raise OptionError(f"eviction policy {self.name}: {why}")

    def evict(self, pinned: set, bar: float | None = None) -> bool:
        """Evict the policy's victim among the unpinned; False (nothing evicted) where every
        resident is pinned, or the victim is expected used within `bar` handshakes."""
        victim = self.pol.victim(lambda v, p=pinned: v not in p)
        if not self._may_go(victim, pinned):
            return False  # as the scheduler: no slot to read ahead into
        if bar is not None and self.distance is not None and self.distance(victim) <= bar:
            return False  # the arena gives no slot: wanted sooner than the read-ahead
        self.pol.remove(victim)
        self.resident.discard(victim)
        self.ahead.discard(victim)
        return True


def _online(trace: traces.Trace, policy, read_ahead: str):
    """(display name, the policy built for `trace`, its predictions by layer), checked."""
    if read_ahead not in READ_AHEAD:
        raise OptionError(f"--read-ahead {read_ahead!r}: one of {', '.join(READ_AHEAD)}")
    name, _ = policies.resolve(policy, "--policy")
    pol = policies.build(policy, trace.profile, trace.layers)
    needs = getattr(pol, "predicted", None) is not None or read_ahead != "none"
    preds = _predictions(trace) if needs else {}
    if read_ahead != "none" and not preds:
        raise OptionError(
            "--read-ahead: the trace has no prediction for every call (record it with "
            "--read-ahead lookahead --decode sync --lookahead-decode-min-miss 0)"
        )
    return name, pol, preds


def replay(trace: traces.Trace, slots: int, policy, read_ahead: str = "none") -> Replay:
    """Misses of `trace` in an arena of `slots` under `policy` (a name, "module:Class" or a
    class: strata_mlx.stream.policies), or "belady". `read_ahead` models decode's lookahead from
    the trace's predictions: "lookahead" reads every predicted expert of the next layer that
    is not resident once a layer's misses have slots (as the handshake does), "scored" only
    while the victim's expected next use (the policy's `distance`) comes after the read-ahead's
    (strata_mlx.stream.prediction.ExpectedUse; a policy without `distance` reads as lookahead)."""
    _check_slots(trace, slots)
    if policy == "belady":
        if read_ahead != "none":
            raise OptionError("--read-ahead: Belady's optimum reads nothing ahead")
        return _belady(trace, slots)
    name, pol, preds = _online(trace, policy, read_ahead)
    given = policy if isinstance(policy, str) else getattr(policy, "__name__", str(policy))
    nxt = dict(zip(trace.layers, trace.layers[1:]))
    out = Replay(name if read_ahead == "none" else f"{name}+{read_ahead}", slots,
                 trace.record_bytes, trace.decode_tokens)  # fmt: skip
    expected = ExpectedUse(trace.layers) if read_ahead == "scored" else None
    told = getattr(pol, "predicted", None)
    arena = _Arena(pol, given, slots)  # (a plug-in class named as given, not by its base's name)
    for c, decode in enumerate(trace.decoding().tolist()):
        arena.set_phase(decode)
        for layer in trace.layers:
            pol.current = layer
            target = nxt.get(layer)
            predicted = np.unique(preds[target][c]).tolist() if target in preds else None
            keys = [(layer, int(e)) for e in np.unique(trace.ids[layer][c])]
            pinned = set(keys)
            missed, used = arena.lookup(layer, keys, pinned)
            out.count(decode, len(keys), len(missed), used)
            if not decode:
                continue
            if expected is not None:
                expected.observe(layer, [k[1] for k in keys])
            if predicted is None:
                continue
            if told is not None:
                told(target, predicted)  # as the handshake: once the misses have slots
            if read_ahead == "none":
                continue
            bar = None
            if expected is not None:
                expected.predicted(target, predicted)
                bar = expected.bar(target)
            out.decode_ahead_reads += arena.read_ahead(
                [(target, e) for e in predicted], pinned, bar
            )
    return out


def _belady(trace: traces.Trace, slots: int) -> Replay:
    """Evict the unpinned resident expert whose next use in decode is farthest in the future,
    one next used in a prompt as one never used again (a lazy heap of next uses): the fewest
    decode misses (module docstring)."""
    seq = [(d, [(l, int(e)) for e in es]) for d, l, es in trace.lookups()]
    never = len(seq)
    nxt: list[list[int]] = [[0] * len(k) for _, k in seq]
    last: dict = {}
    for i in range(len(seq) - 1, -1, -1):
        decode = seq[i][0]
        for j, key in enumerate(seq[i][1]):
            nxt[i][j] = last.get(key, never)
            # (evicted before a prompt's use, an expert costs decode nothing: the prompt's
            # miss reads it again, as keeping it would have had it there)
            last[key] = i if decode else never
    out = Replay("belady", slots, trace.record_bytes, trace.decode_tokens)
    resident: set = set()
    heap: list = []  # (-next use, key): live while it is the key's next use
    next_use: dict = {}
    for i, (decode, keys) in enumerate(seq):
        pinned = set(keys)
        # hits first, as the handshake: their next use moves before any miss evicts
        order = [j for j, k in enumerate(keys) if k in resident]
        order += [j for j, k in enumerate(keys) if k not in resident]
        misses = 0
        for j in order:
            key = keys[j]
            if key not in resident:
                misses += 1
                if len(resident) >= slots:
                    skipped = []
                    while True:
                        neg, v = heapq.heappop(heap)
                        if v not in resident or next_use.get(v) != -neg:
                            continue
                        if v not in pinned:
                            break
                        skipped.append((neg, v))
                    for item in skipped:
                        heapq.heappush(heap, item)
                    resident.discard(v)
                resident.add(key)
            next_use[key] = nxt[i][j]
            heapq.heappush(heap, (-nxt[i][j], key))
        if decode:
            out.decode_lookups += len(keys)
            out.decode_misses += misses
        else:
            out.prefill_lookups += len(keys)
            out.prefill_misses += misses
    return out


def compare(trace: traces.Trace, slots: int, names: list, read_ahead: str = "none") -> list[Replay]:
    """Every policy of `names` replayed on `trace` (each checked before any runs); with
    `read_ahead`, each online policy also with that read-ahead beside it."""
    for name in names:
        if name != "belady":
            policies.check(name, "--policy")
    _check_slots(trace, slots)
    out = []
    for n in names:
        out.append(replay(trace, slots, n))
        if read_ahead != "none" and n != "belady":
            out.append(replay(trace, slots, n, read_ahead))
    return out


def parse_slots(text: str) -> list[int]:
    """--slots: one arena size or a comma-separated sweep."""
    return parse_tokens(text, "--slots", "slot counts", "2000,4000")


def report(
    path: str | Path,
    slots: str | int,
    policy_list: str,
    plot: str | Path | None = None,
    read_ahead: str = "none",
) -> list[str]:
    """cache-sim's lines: the trace, then one line per policy, for each arena size; with
    `plot`, a PNG of decode MB/token (miss % without record bytes) against the arena."""
    names = [p.strip() for p in policy_list.split(",") if p.strip()]
    if not names:
        raise OptionError("--policy: name at least one (e.g. lru,belady)")
    sizes = parse_slots(str(slots))
    if read_ahead not in READ_AHEAD:
        raise OptionError(f"--read-ahead {read_ahead!r}: one of {', '.join(READ_AHEAD)}")
    if plot is not None:
        if _same_file(plot, path):
            raise OptionError(f"--plot {plot}: is the trace being read ({path}); name another file")
        from .plots import require

        require()
    trace = traces.read(path)
    lines, sweep, gaps = [], [], False
    for n in sizes:
        results = compare(trace, n, names, read_ahead)
        sweep.append(results)
        by = {r.policy: r for r in results}
        lru, best = by.get("lru"), by.get("belady")
        gaps = gaps or (
            lru is not None and best is not None and lru.decode_misses > best.decode_misses
        )
        records = len(trace.layers) * trace.num_experts
        several = len(trace.decode_spans) > 1
        lines.append(
            f"{path}: {trace.calls} calls ({trace.prompt_calls} prompt, {trace.decode_tokens} "
            f"decode{f' in {len(trace.decode_spans)} generations' if several else ''}), "
            f"{len(trace.layers)} MoE layers x {trace.num_experts} experts, "
            f"{n} slots ({100 * n / records:.1f} %)"
        )
        lines += [r.line(lru, best) for r in results]
    if gaps:
        lines.append(
            "gap closed: the share of LRU's decode misses above Belady's fewest that a policy's "
            "decode reads save (its misses, and with --read-ahead its reads ahead)"
        )
    if plot is not None:
        plot_sweep(sweep, plot, str(path))
    return lines


def _same_file(a: str | Path, b: str | Path) -> bool:
    """Whether paths `a` and `b` name one file (the same path, a link to it, a hard link)."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # (either missing: not one file)
        return False


def plot_sweep(sweep: list[list[Replay]], path: str | Path, title: str = "") -> Path:
    """Decode MB/token (miss % when the trace has no record bytes) of each policy against
    the arena's slots, one line per policy, written to a PNG (temporary file, then rename)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..format.store import write_atomic

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_bytes = all(r.record_bytes for rs in sweep for r in rs)
    for i, name in enumerate(r.policy for r in sweep[0]):
        xs = [rs[i].slots for rs in sweep]
        ys = [rs[i].mb_per_token if by_bytes else rs[i].miss_pct for rs in sweep]
        ax.plot(xs, ys, marker="o", label=name, linestyle="--" if name == "belady" else "-")
    ax.set_xlabel("arena slots (expert records)")
    ax.set_ylabel("decode MB/token" if by_bytes else "decode miss %")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png"), tmp_suffix=".tmp.png")
    plt.close(fig)
    return Path(path)
