"""The forecast (Forecast) from a shape, a machine and the residency model: prefill and decode
tok/s, decode simulated token by token; its comparison with a bench run, and its JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ...config import OptionError
from ...format.store import (
    write_text_atomic,
)
from .machine import GB, Compute, Machine, read_gbps
from .residency import decode_hits, hit_probability, pick_probabilities, prefill_reads, runs
from .shapes import ModelShape

TOLERANCE = 0.25  # the issue's +-25 %


@dataclass
class Forecast:
    model: str
    source: str
    machine: str
    fits: bool
    verdict: str
    arena_bytes: int = 0
    prefill_step_size: int = 0
    slots: int = 0
    resident_share: float = 0.0
    expert_gb: float = 0.0
    dense_gb: float = 0.0
    kv_cache_gb: float = 0.0  # the KV cache and recurrent state at -p + -g positions
    ssd_gbps: float = 0.0
    read_source: str = ""  # the probe ssd_gbps came from (machine.read_floor_source) or "given"
    prompt_tokens: int = 0
    gen_tokens: int = 0  # decode tokens forecast after the cold prompt
    distinct_per_chunk: float = 0.0  # experts a full chunk (or a shorter prompt) needs
    gb_read_per_chunk: float = 0.0  # mean over the cold prompt's chunks
    ssd_floor_s: float = 0.0  # mean per chunk: the read floor, at ssd_gbps
    compute_floor_s: float = 0.0  # a chunk's compute, the mean over the prompt's chunks
    compute_source: str = ""  # fake-stream | estimate
    prefill_tps: float = 0.0
    decode_hit_rate: float = 0.0  # resident when asked (LRU)
    decode_streamed_ahead: float = 0.0  # share of lookups lookahead brought in
    decode_miss_rate: float = 0.0  # share of lookups the computation waited for
    decode_modes: dict = field(default_factory=dict)  # tokens per decoder mode
    decode_misses_per_token: float = 0.0
    decode_compute_ms: float = 0.0
    # a token's synced layers' handshake Python and route sync beyond the compute
    decode_handshake_ms: float = 0.0
    # what an absent lookup cost plan's short real decode (None: reads costed from the probe)
    decode_absent_ms: float | None = None
    decode_ms_per_token: float = 0.0
    decode_tps: float = 0.0
    recommended_arena_gb: float = 0.0  # the automatic arena on this machine (GiB)
    recommendation: str = ""  # the arena and chunk to pass, and why
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [
            f"{self.model} ({self.source}) on {self.machine}",
            f"  {self.verdict}",
        ]
        if not self.fits:
            return out + [f"  note: {n}" for n in self.notes]
        out += [
            f"  experts {self.expert_gb:.2f} GB, dense {self.dense_gb:.2f} GB, KV cache "
            f"{self.kv_cache_gb:.2f} GB ({self.prompt_tokens + self.gen_tokens} positions); "
            f"arena {self.arena_bytes / GB:.2f} GB = {self.slots} slots "
            f"({100 * self.resident_share:.1f} % of the experts resident), "
            f"prefill chunk {self.prefill_step_size}",
            f"  prefill ({self.prompt_tokens} tokens, cold): {self.prefill_tps:.1f} tok/s; "
            f"per chunk {self.distinct_per_chunk:.0f} distinct experts, "
            f"{self.gb_read_per_chunk:.3f} GB read, read floor {self.ssd_floor_s * 1e3:.0f} ms "
            f"at {self.ssd_gbps:.2f} GB/s ({self.read_source or 'probe-ssd'}), "
            f"compute floor {self.compute_floor_s * 1e3:.0f} ms ({self.compute_source})",
            f"  decode ({self.gen_tokens} tokens): {self.decode_tps:.2f} tok/s "
            f"({self.decode_ms_per_token:.1f} ms/token: "
            f"compute {self.decode_compute_ms:.1f}, handshake {self.decode_handshake_ms:.1f}, "
            f"{self.decode_misses_per_token:.1f} misses "
            f"a token: {100 * self.decode_hit_rate:.1f} % resident, "
            f"{100 * self.decode_streamed_ahead:.1f} % streamed ahead, "
            f"{100 * self.decode_miss_rate:.1f} % missed; modes "
            + ", ".join(f"{m} {n}" for m, n in self.decode_modes.items())
            + (
                ""
                if self.decode_absent_ms is None
                else f"; an absent lookup {self.decode_absent_ms:.3g} ms, measured"
            )
            + ")",
        ]
        if self.recommendation:
            out.append(f"  recommended: {self.recommendation}")
        return out + [f"  note: {n}" for n in self.notes]


def _prediction_shares(compute: Compute, L: int, k: int, depth: int, lag1: int):
    """shares(mode, absent) -> (streamed ahead, missed) of a decode lookup absent from the
    arena with probability `absent`, in decoder mode `mode`.

    Share of a layer's absent lookups some prediction read ahead. The sync handshake predicts
    layers l+1 .. l+depth from layer l's input, so layer i is predicted from up to `depth`
    layers before it (their union measured); "layers" mode predicts from lag + 1 (`lag1`)
    layers before, and a layer that missed is recomputed through the sync handshake, which
    predicts as sync does. The first layers of a token have nothing that far before them."""
    r = compute.recall

    def union_at(a: int) -> float:  # measured, or (estimates) independent guesses
        if a in compute.recall_union:
            return compute.recall_union[a]
        return 1 - float(np.prod([1 - r.get(d, 0.0) for d in range(1, a + 1)]))

    union = np.array([union_at(min(depth, i)) if i else 0.0 for i in range(L)])
    lagged = np.where(np.arange(L) >= lag1, r.get(lag1, 0.0), 0.0)

    def shares(mode: str, absent: float) -> tuple[float, float]:
        """In "layers" mode the share of layers recomputed through the sync handshake depends
        on the misses it leaves: a few rounds of fixed point."""
        if mode == "token":
            return 0.0, absent
        if mode == "sync":
            ahead = absent * float(union.mean())
            return ahead, absent - ahead
        missed = absent
        for _ in range(4):
            recomputed = 1 - (1 - missed) ** k  # the layer before missed
            ahead = absent * float((recomputed * union + (1 - recomputed) * lagged).mean())
            missed = absent - ahead
        return ahead, missed

    return shares


# Within a run of decode tokens (residency.runs) the decoder's rule runs for up to WINDOW
# tokens, each standing for its share of the run's: near a threshold its mode alternates every
# few tokens, and a run taken whole would alternate run by run instead (on a 12-layer shape,
# 1159 of 8000 tokens in sync mode token by token, 3545 by runs taken whole).
WINDOW = 128


@dataclass(frozen=True)
class _TokenCost:
    """One decode token in one decoder mode: its seconds, compute, synced layers' handshake,
    and its lookups' shares streamed ahead and missed; the share of layers with a miss."""

    s: float
    compute_s: float
    synced_s: float
    ahead: float
    missed: float
    layer_missed: float


def _token_cost(shape: ModelShape, machine: Machine, compute: Compute, cfg):
    """cost(mode, predicting, absent, at) -> _TokenCost of a token whose lookups are absent
    from the arena with probability `absent`, its attention over the context `at` s."""
    k, L, rb = shape.top_k, max(shape.moe_layers, 1), shape.record_bytes
    # (ungated, the lag's default is 1: 4 goes with gated decode's routing board)
    lag = 1 if cfg.decode_lag is None else cfg.decode_lag
    distance = {"sync": 1, "layers": lag + 1, "token": 1}  # prediction to use
    shares = _prediction_shares(compute, L, k, cfg.read_ahead.depth, distance["layers"])
    # the sync handshake's Python and its route sync beyond the compute, on every synced
    # layer whether it missed or not; the deferred path's are in fake-stream's own time
    synced_layer_s = compute.handshake_s + compute.sync_beyond_s

    def read_s(n: float) -> float:  # n reads of one layer, issued together
        return n * rb / (read_gbps(machine, n) * 1e9) if n > 0 else 0.0

    def cost(mode: str, predicting: bool, absent: float, at: float) -> _TokenCost:
        ahead, missed = shares(mode, absent) if predicting else (0.0, absent)
        layer_missed = 1 - (1 - missed) ** k  # a layer with at least one miss
        base = compute.mode_s(mode) + at
        synced = L * synced_layer_s if mode == "sync" else 0.0
        s = base + synced
        if compute.absent_s is not None:  # measured: every absent lookup, missed or not
            s += L * k * (missed + ahead) * compute.absent_s
        else:
            # streamed-ahead reads are hidden behind the layers between prediction and use
            s += L * read_s(k * missed)
            s += L * max(read_s(k * ahead) - distance[mode] * base / L, 0.0)
        if mode == "layers":
            # a layer that missed is drained and recomputed synced, and the `lag` layers built
            # after it on its wrong output are discarded and built again
            redo = (lag + 1) * (compute.mode_s("sync") + at) / L
            s += L * layer_missed * (redo + synced_layer_s)
            synced += L * layer_missed * synced_layer_s
        return _TokenCost(s, base, synced, ahead, missed, layer_missed)

    return cost


def _after(rates: list[float], c: _TokenCost, layers: int) -> None:
    """The decoder's running averages [layers with a miss, lookups missed] after `layers`
    decode layers like those of `c` (runtime.decode: 0.02 and 0.01 toward each layer's)."""
    rates[0] = c.layer_missed + (rates[0] - c.layer_missed) * 0.98**layers
    rates[1] = c.missed + (rates[1] - c.missed) * 0.99**layers


def decode_forecast(
    shape: ModelShape,
    machine: Machine,
    compute: Compute,
    p: np.ndarray,
    slots: int,
    prompt_tokens: int,
    gen_tokens: int,
    step: int,
) -> dict:
    """Decode of `gen_tokens` after a cold prompt in chunks of `step`, token by token through
    the decoder's own rules (strata_mlx.runtime.decode; thresholds from RuntimeConfig's defaults),
    without the device gate: gated decode (the default on CUDA) is not forecast. Past the
    first EXACT_STEPS, in runs of many tokens (residency.runs), so that its cost does not
    grow with `gen_tokens`.
    The prompt's last token runs first, untimed: it goes through the decoder outside any chunk
    (the arena's and the decoder's state move with it), and bench's decode time starts after it;
    counted, the coldest token of all (the decoder's averages at their start) was charged to
    decode."""
    from ...runtime.decode import choose_mode
    from ...runtime.loader import RuntimeConfig

    cfg = RuntimeConfig()
    k, L = shape.top_k, max(shape.moe_layers, 1)
    steps = runs(gen_tokens + 1)
    middles = [t + (n - 1) // 2 for t, n in steps]
    hits = decode_hits(p, L, slots, prompt_tokens, step, gen_tokens + 1, middles)
    token_cost = _token_cost(shape, machine, compute, cfg)

    def mode_at(layer_rate: float, miss_rate: float) -> tuple[str, bool]:
        predicting = miss_rate >= cfg.read_ahead.decode_min_miss
        return choose_mode(
            layer_rate,
            predicting,
            cfg.decode_sync_above,
            cfg.decode_token_below,
            cfg.decode_token_while_predicting,
        ), predicting

    rates = [0.0, 1.0]  # the decoder's running averages, as a fresh load has them
    modes: dict[str, int] = {}
    sums = dict.fromkeys(("s", "compute_s", "synced_s", "misses", "hit", "ahead", "missed"), 0.0)
    for (t, n), hit in zip(steps, hits, strict=True):
        # its attention over the context, at the run's mean position
        at = compute.decode_position_s(prompt_tokens + t + (n - 1) / 2)
        costs: dict[tuple[str, bool], _TokenCost] = {}
        w, done = min(n, WINDOW), 0
        for i in range(w):
            key = mode_at(*rates)
            c = costs[key] = costs.get(key) or token_cost(*key, 1 - hit, at)
            _after(rates, c, L)
            m = n // w + (i < n % w)  # the run's tokens this one stands for
            # the averages move straight toward what this token gives: where that stays in
            # this mode, so does every later token of the run
            steady = mode_at(*rates) == key == mode_at(c.layer_missed, c.missed)
            if steady:
                m = n - done
                _after(rates, c, L * (m - 1))
            done += m
            if t:  # (token 0, the prompt's last: state only)
                modes[key[0]] = modes.get(key[0], 0) + m
                for name, v in zip(sums, (c.s, c.compute_s, c.synced_s, L * k * c.missed, hit,
                                          c.ahead, c.missed)):  # fmt: skip
                    sums[name] += m * v
            if steady:
                break
    g = max(gen_tokens, 1)
    return {
        "shares": (sums["hit"] / g, sums["ahead"] / g, sums["missed"] / g),
        "modes": modes,
        "misses_per_token": sums["misses"] / g,
        "compute_s": sums["compute_s"] / g,
        "handshake_s": sums["synced_s"] / g,
        "s_per_token": sums["s"] / g,
    }


# ---- the forecast ---------------------------------------------------------------------


def _prefill_forecast(
    f: Forecast,
    shape: ModelShape,
    machine: Machine,
    compute: Compute,
    p: np.ndarray,
    slots: int,
    step: int,
) -> None:
    """The cold prompt's figures into `f`: each chunk takes the longer of its reads at the
    drive's GB/s and its compute."""
    prompt_tokens = f.prompt_tokens
    rb = shape.record_bytes
    chunks = prefill_reads(p, slots, prompt_tokens, step)
    total_s, bytes_read, ssd_s, compute_s = 0.0, 0.0, 0.0, 0.0
    for c, n, tokens, reads in chunks:
        ssd = reads * rb / (machine.ssd_gbps * 1e9)
        chunk_s = compute.chunk_s(tokens, (c + (n - 1) / 2) * step)  # at the run's mean start
        total_s += n * max(ssd, chunk_s)
        bytes_read += n * reads * rb
        ssd_s += n * ssd
        compute_s += n * chunk_s
    n = sum(n for _, n, _, _ in chunks)
    # the most a chunk holds: a prompt shorter than the chunk is one chunk of its own length
    chunk = min(step, prompt_tokens)
    f.distinct_per_chunk = float(np.sum(hit_probability(p, chunk)))
    f.gb_read_per_chunk = bytes_read / n / 1e9
    f.ssd_floor_s = ssd_s / n
    f.compute_floor_s = compute_s / n
    f.prefill_tps = prompt_tokens / total_s if total_s else 0.0
    layer_width = max(f.distinct_per_chunk / max(shape.moe_layers, 1), 1)
    if layer_width > slots:
        f.notes.append(
            f"a chunk needs ~{layer_width:.0f} experts a layer, more than the arena's {slots} "
            "slots: layers run in expert-major groups"
        )


def forecast(
    shape: ModelShape,
    machine: Machine,
    compute: Compute | tuple[float, float],
    compute_source: str,
    arena_gb: float | None = None,
    prefill_step_size: int | None = None,
    prompt_tokens: int = 2048,
    gen_tokens: int = 128,
) -> Forecast:
    if prompt_tokens < 1 or gen_tokens < 1:
        raise OptionError(
            f"a forecast needs >= 1 prompt and decode token, got {prompt_tokens} and {gen_tokens}"
        )
    f = Forecast(
        Path(shape.path).name,
        shape.source + (f", {shape.note}" if shape.note else ""),
        machine.name,
        True,
        "",
        expert_gb=shape.expert_bytes / 1e9,
        dense_gb=shape.dense_bytes / 1e9,
        ssd_gbps=machine.ssd_gbps,
        read_source=machine.read_source,
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        compute_source=compute_source,
    )
    fitted = _fit(f, shape, machine, arena_gb, prefill_step_size)
    if fitted is None:
        return f
    arena, step, auto = fitted
    slots = max(1, min(arena // shape.record_bytes, shape.n_records))
    f.arena_bytes, f.prefill_step_size, f.slots = arena, step, slots
    f.resident_share = slots / max(shape.n_records, 1)
    f.verdict = (
        "fits: every expert resident"
        if slots >= shape.n_records
        else f"fits, streaming: the arena holds {100 * f.resident_share:.1f} % of the experts"
    )
    p = pick_probabilities(shape)
    _prefill_forecast(f, shape, machine, Compute.of(compute), p, slots, step)

    d = decode_forecast(
        shape, machine, Compute.of(compute), p, slots, prompt_tokens, gen_tokens, step
    )
    f.decode_hit_rate, f.decode_streamed_ahead, f.decode_miss_rate = d["shares"]
    f.decode_modes = d["modes"]
    f.decode_misses_per_token = d["misses_per_token"]
    f.decode_compute_ms = d["compute_s"] * 1e3
    f.decode_handshake_ms = d["handshake_s"] * 1e3
    absent_s = Compute.of(compute).absent_s
    f.decode_absent_ms = None if absent_s is None else absent_s * 1e3
    f.decode_ms_per_token = d["s_per_token"] * 1e3
    f.decode_tps = 1e3 / f.decode_ms_per_token if f.decode_ms_per_token else 0.0
    if shape.profile is None:
        f.notes.append("no routing profile: expert popularity taken as uniform")
    f.recommended_arena_gb = auto / GB
    f.recommendation = recommend(f, shape, machine, auto)
    return f


def _fit(
    f: Forecast,
    shape: ModelShape,
    machine: Machine,
    arena_gb: float | None,
    prefill_step_size: int | None,
) -> tuple[int, int, int] | None:
    """(arena, chunk, automatic arena) as load() picks them (loader.choose_arena), with room
    beside them for the KV cache of the prompt and the generated tokens; or None, with `f`'s
    verdict saying what does not fit. load() counts one chunk's KV cache (it knows no prompt):
    the rest, up to -p + -g positions, is held beside the arena as serve's kept caches are."""
    from ...runtime.loader import choose_arena, default_prefill_step, kv_beyond_a_chunk
    from ...stream import memory
    from ...stream.memory import MemoryGuardError

    available = machine.available_bytes
    if available is None:
        available = max(machine.memory_bytes - shape.dense_bytes, 0)
    step = prefill_step_size or default_prefill_step(machine.memory_bytes)
    positions = f.prompt_tokens + f.gen_tokens
    kv = memory.kv_cache_bytes(shape.args, positions, shape.kv_itemsize)
    beyond = kv_beyond_a_chunk(shape.args, shape.kv_itemsize, positions, step)
    f.kv_cache_gb = kv / GB  # (GiB, as the arena's figures and --arena-gb)

    def arena_for(gb: float | None, reserve: int) -> int:
        return choose_arena(
            shape.args,
            shape.record_bytes,
            shape.n_records,
            shape.dense_bytes,
            gb,
            step,
            machine.memory_bytes,
            available,
            reserve_bytes=reserve,
            kv_itemsize=shape.kv_itemsize,
        )[0]

    try:
        arena = arena_for(arena_gb, beyond)
        auto = arena if arena_gb is None else arena_for(None, beyond)
    except MemoryGuardError as e:
        f.fits, f.verdict = False, f"does not fit: {e}"
        if beyond and _fits(lambda: arena_for(arena_gb, 0)):  # (it fits but for that cache)
            f.verdict = (
                f"does not fit: the KV cache of -p {f.prompt_tokens} + -g {f.gen_tokens} "
                f"tokens takes {kv / GB:.1f} GB: with a chunk's scratch, one expert and the "
                f"reserve, more than the {available / GB:.1f} GB available beside the dense "
                "weights; shorten -p or -g"
            )
        return None
    chunk_only = arena_for(None, 0) if beyond else auto
    if arena_gb is None and auto < chunk_only:
        f.notes.append(
            f"load()'s automatic arena ({chunk_only / GB:.3g} GB) counts one chunk's KV cache; "
            f"{positions} positions take {kv / GB:.2f} GB: the arena here leaves room for them, "
            "as generate and bench do (from Python: load()'s reserve_bytes, "
            "loader.kv_past_a_chunk)"
        )
    return arena, step, auto


def _fits(choose) -> bool:
    """Whether `choose()` (loader.choose_arena) finds an arena that fits."""
    from ...stream.memory import MemoryGuardError

    try:
        choose()
    except MemoryGuardError:
        return False
    return True


def recommend(f: Forecast, shape: ModelShape, machine: Machine, auto_bytes: int) -> str:
    """`--arena-gb A --prefill-step-size S`, and why: the arena is what memory leaves once the
    dense weights, a chunk's scratch and the KV cache of -p + -g positions are held (load()'s
    automatic arena, with room for that KV cache); the chunk, because each chunk reads every
    expert it needs once, so a longer chunk reads fewer bytes a token, bounded by the scratch
    a chunk's activations take."""
    share = min(auto_bytes // shape.record_bytes, shape.n_records) / max(shape.n_records, 1)
    held = (
        "every expert: nothing streams after the first read"
        if share >= 1
        else f"{100 * share:.0f} % of the experts"
    )
    arena = (
        f"--arena-gb {auto_bytes / GB:.3g} (the automatic arena: "
        f"{machine.memory_bytes / GB:.0f} GB of memory less {shape.dense_bytes / GB:.2f} GB of "
        f"dense weights, a chunk's scratch and the KV cache of {f.prompt_tokens} + "
        f"{f.gen_tokens} positions; it holds {held})"
    )
    per_token = f.gb_read_per_chunk / max(min(f.prefill_step_size, f.prompt_tokens), 1)
    chunk = (
        f"--prefill-step-size {f.prefill_step_size} (a chunk reads each expert it needs once: "
        f"{f.distinct_per_chunk:.0f} experts, {1e3 * per_token:.2f} MB a prompt token; longer "
        f"chunks read less a token but need more scratch: "
        f"{'2048 from 16 GB of memory' if f.prefill_step_size >= 2048 else '512 below 16 GB'})"
    )
    return f"{arena}; {chunk}"


# ---- against bench --------------------------------------------------------------------


def compare(f: dict | Forecast, bench_result: dict, policy: str = "lookahead") -> list[dict]:
    """Forecast against a `bench --json` result (its cold run of `policy`): one row per
    figure with the ratio measured / forecast and whether it is within TOLERANCE."""
    f = asdict(f) if isinstance(f, Forecast) else f
    for key, bench_key, flag in (
        ("prompt_tokens", "prompt_tokens", "-p"),
        ("prefill_step_size", "prefill_step_size", "--prefill-step-size"),
        ("gen_tokens", "gen_tokens", "-g"),
    ):
        # (forecasts recorded before gen_tokens was kept have none: not checked)
        if f.get(key) and bench_result.get(bench_key) and f[key] != bench_result[bench_key]:
            raise OptionError(
                f"the forecast is for {flag} {f[key]}, the bench run used {bench_result[bench_key]}"
            )
    runs = [r for r in bench_result["runs"] if r["policy"] == policy and r["phase"] == "cold"]
    if not runs:
        raise OptionError(f"bench result has no cold {policy} run")
    r = runs[0]
    rows = []
    for name, measured, predicted in (
        ("prefill tok/s", r["prefill_tps"], f["prefill_tps"]),
        ("decode tok/s", r["decode_tps"], f["decode_tps"]),
        ("GB read per chunk", r["gb_read"] / max(_chunks(bench_result), 1), f["gb_read_per_chunk"]),
        ("decode miss %", r["decode_miss_pct"], 100 * _decode_miss_rate(f)),
    ):
        ratio = measured / predicted if predicted else math.inf
        rows.append(
            {
                "figure": name,
                "forecast": predicted,
                "measured": measured,
                "ratio": ratio,
                "within": abs(ratio - 1) <= TOLERANCE,
            }
        )
    return rows


def _decode_miss_rate(f: dict) -> float:
    # forecasts recorded before streamed-ahead was told from misses have no decode_miss_rate
    if "decode_miss_rate" in f:
        return f["decode_miss_rate"]
    return 1 - f["decode_hit_rate"]


def _chunks(bench_result: dict) -> int:
    return -(-bench_result["prompt_tokens"] // bench_result["prefill_step_size"])


def save(f: Forecast, path: str | Path) -> None:
    write_text_atomic(path, json.dumps(asdict(f), indent=1))
