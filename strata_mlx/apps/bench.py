"""`strata-mlx bench`: read-ahead policies side by side on one store, in one run.

mlx-lm's `-p 2048 -g 128` convention: a random prompt of p tokens is prefilled in chunks, then
g tokens are decoded. Each policy runs cold (a fresh arena; reads are direct, so the page
cache holds no experts) and then warm (the same prompt again on the arena the cold run left).
Policies are interleaved in A/B rounds, rotating the order each round, because this machine's
drive and cores are shared and noisy: only ratios measured side by side mean anything.

Floors: the SSD floor of a chunk is its bytes read over the drive's own probe bandwidth
(probe-ssd at the same worker count); the compute floor is the same chunk in fake-stream mode
(every expert counts as resident). A chunk can be no faster than the larger of the two.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import OptionError, runtime_options
from ..format.store import EXPERTS, load_manifest, write_text_atomic
from ..generation.generate import generate_step, make_sampler
from ..runtime.loader import RuntimeConfig, kv_past_a_chunk, load_model
from ..stream import trace as traces
from ..stream.reader import drive_limit_gbps, drive_note
from ..stream.stats import ExpertStats, RoutingTrace


@dataclass
class Run:
    policy: str
    phase: str  # cold | warm
    chunks: list[ExpertStats] = field(default_factory=list)
    decode: ExpertStats | None = None
    decode_s: float = 0.0
    decode_tokens: int = 0
    layers: dict | None = None  # bench --plot: per-layer counts (strata_mlx.plots)
    ranks: list[dict] | None = None  # bench --pipeline: each rank's share (strata_mlx.distributed)
    # decode's misses as the reader saw them: reads submitted urgent that landed (or failed),
    # their ns from submission to landing in all (Reader.stats' urgent_*; in a pipelined
    # bench rank 0's, as the other decode figures)
    urgent_reads: int = 0
    urgent_ns: int = 0
    copies_held: int = 0  # words given up for a copy held past decode_copy_held_ms (queued too)
    gates_stopped: int = 0  # ... and times every gate was stopped for one (GateTable.stopped)
    quick_dry: int = 0  # misses the reader's quick misses left for want of a reserve slot


def _drop_page_cache(store: Path) -> bool:
    """Evict the store's own files from the page cache (posix_fadvise DONTNEED on each); the
    rest of the machine's cache is left alone (this used to write /proc/sys/vm/drop_caches,
    which as root dropped every process's cache). False where the OS has no fadvise (macOS:
    reads there are F_NOCACHE, so experts do not enter the cache anyway)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    ok = True
    for f in sorted(p for p in Path(store).iterdir() if p.is_file()):
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            ok = False
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


# Variants that set an option to one value, by name (the rest come from the declarations)
NAMED_VARIANTS = {
    "always": {"lookahead_decode_min_miss": 0.0},  # lookahead predicts in decode too
    # ... or not past decode's first layers (prefill's lookahead, decode's demand)
    "never": {"lookahead_decode_min_miss": 1.0},
    "nv": {"verify": False},  # records not verified
}


def _variant(v: str) -> dict | None:
    """The runtime option a policy variant sets: a named one, an eviction policy, or one a
    runtime option declares (config.opt's `variant`): a choice, `<v>0` / `<v>1` for a switch,
    `<v>N` for a number."""
    from ..stream.policies import names

    if v in NAMED_VARIANTS:
        return NAMED_VARIANTS[v]
    if v in names():  # the arena's policies and the candidates alike
        return {"eviction": v}
    for o in runtime_options(RuntimeConfig):
        prefix = o.option.variant
        if prefix == "choices" and v in o.option.choices:
            return {o.name: v}
        if prefix is None or prefix == "choices" or not v.startswith(prefix):
            continue
        rest = v[len(prefix) :]
        if o.is_switch and rest in ("0", "1"):
            return {o.name: rest == "1"}
        if not o.is_switch and rest.isascii() and rest.isdigit():  # (not "²")
            return {o.name: int(rest)}
    return None


def variant_grammar() -> str:
    """Every variant a policy name takes, for help and errors."""
    from ..stream.policies import names

    out = list(NAMED_VARIANTS)
    for o in runtime_options(RuntimeConfig):
        prefix = o.option.variant
        if prefix == "choices":
            out += list(o.option.choices)
        elif prefix is not None:
            out.append(f"{prefix}0 | {prefix}1" if o.is_switch else f"{prefix}N")
    return " | ".join(out + names())


def trace_paths(trace: str | Path, order: list[str], round: int, repeats: int) -> dict:
    """Where each run of one round (its policies in `order`) writes its trace, by position:
    trace.run_path's names, a policy named twice in a round numbered by its turn (the second
    run's file replaced the first's)."""
    several = len(order) * repeats > 1
    out, turn = {}, dict.fromkeys(order, 0)
    for i, policy in enumerate(order):
        turn[policy] += 1
        name = policy if order.count(policy) == 1 else f"{policy}-{turn[policy]}"
        out[i] = traces.run_path(trace, name, round, several)
    return out


def policy_options(policy: str) -> dict:
    """Runtime options of a bench policy name: a read-ahead policy, then `:variant`s, each
    setting one option (`lookahead:sync:d3`: the loop-less scheduler, 3 layers predicted
    ahead). The values are checked with the rest of the config (check_runtime)."""
    name, *variants = policy.split(":")
    out: dict = {"read_ahead": name}
    by: dict[str, str] = {}  # option -> the variant that set it
    for v in variants:
        options = _variant(v)
        if options is None:
            raise OptionError(
                f"--policies {policy!r}: unknown variant {v!r} ({variant_grammar()})",
                "policies",
            )
        for option in options:
            if option in by:
                raise OptionError(
                    f"--policies {policy!r}: {by[option]!r} and {v!r} both set {option}; give one",
                    "policies",
                )
            by[option] = v
        out.update(options)
    return out


def run_policy(
    model,
    ids: list[int],
    gen: int,
    step: int,
    policy: str,
    phase: str,
    layers=None,
    status=None,
) -> Run:
    """Prefill `ids` in chunks of `step`, then decode `gen` tokens greedily as generate does
    (the decode time runs from the first generated token, the prefill's, to the last).
    `layers` (plots.LayerCounts) is cut where the chunks' and decode's stats are taken;
    `status(text)` is told where the run is, after each chunk and each token."""
    run = Run(policy, phase)
    ec = model.expert_cache
    say = status or (lambda _: None)
    label = f"{policy} {phase}"

    def chunk_done(chunk: ExpertStats) -> None:
        run.chunks.append(chunk)
        if layers is not None:
            layers.cut("prefill")

    steps = generate_step(
        model,
        mx.array(ids),
        gen + 1,
        make_sampler(0.0),
        step,
        on_chunk=chunk_done,
        prompt_progress_callback=lambda done, total: say(f"{label}: prefill {done}/{total} tok"),
    )
    next(steps)  # the prefill and the first token
    if layers is not None:
        layers.cut("first")  # the last prompt token's forward: in no chunk, not decode
    before, reads = ec.stats.copy(), ec.reader.stats()
    t = time.perf_counter()
    for i, _ in enumerate(steps, 1):
        say(f"{label}: decode {i}/{gen} tok")
    run.decode_s = time.perf_counter() - t
    after = ec.reader.stats()
    run.urgent_reads = after["urgent_reads"] - reads["urgent_reads"]
    run.urgent_ns = after["urgent_ns"] - reads["urgent_ns"]
    run.copies_held = sum(
        after.get(k, 0) - reads.get(k, 0) for k in ("copies_held", "words_given_up")
    )
    run.gates_stopped = after.get("gates_stopped", 0) - reads.get("gates_stopped", 0)
    run.quick_dry = after.get("quick_dry", 0) - reads.get("quick_dry", 0)
    run.decode = ec.stats.minus(before)
    if layers is not None:
        layers.cut("decode")
    run.decode.wall_s = run.decode_s
    run.decode_tokens = gen
    return run


def bench(
    path: str | Path,
    prompt_tokens: int = 2048,
    gen_tokens: int = 128,
    arena_gb: float | None = None,
    prefill_step_size: int = 1024,
    policies: tuple[str, ...] = ("demand", "static", "lookahead"),
    repeats: int = 1,
    io_workers: int = 8,
    static_cap: int = 256,
    probe_seconds: float = 2.0,
    seed: int = 0,
    log=print,
    status=None,
    eviction: str = "nextuse-duel",
    baseline: str | None = None,
    plot: str | Path | None = None,
    pipeline=None,
    trace: str | Path | None = None,
    config: RuntimeConfig | None = None,
) -> dict:
    """Every policy cold then warm, each from `config` (the runtime options the policy's
    variants do not set; the keywords above override it); `trace`: each cold run's routing
    trace written there (strata_mlx.stream.trace; one file per run when there are several: trace.run_path); with `baseline="mlx-lm"`, then mlx-lm's own model and
    strata-mlx's on the same prompt, side by side (strata_mlx.baseline). `pipeline` (a
    function that returns a fresh strata_mlx.distributed.Pipeline): every load is pipelined,
    each run adds its ranks' figures; ranks other than 0 serve and return {}. `status(text)`:
    where the bench is, told as often as a chunk or a token ends (a progress line's text)."""
    path = Path(path)
    _check_baseline_and_plot(path, baseline, plot, pipeline)
    m = load_manifest(path)
    vocab = m.config["vocab_size"]
    ids = np.random.default_rng(seed).integers(0, vocab, size=prompt_tokens).tolist()
    base = (config or RuntimeConfig()).replace(
        arena_gb=arena_gb,
        io_workers=io_workers,
        prefill_step_size=prefill_step_size,
        static_cap=static_cap,
        eviction=eviction,
    )

    fake_cfg = base.replace(read_ahead="demand", fake_stream=True)
    rounds = [list(policies[r % len(policies) :]) + list(policies[: r % len(policies)])
              for r in range(repeats)]  # fmt: skip
    if pipeline is not None and pipeline().rank != 0:
        from ..runtime.distributed import serve_loads

        configs = [base.replace(**policy_options(p)) for order in rounds for p in order]
        serve_loads(path, [fake_cfg] + configs, pipeline, lambda: _drop_page_cache(path))
        return {}

    say = status or (lambda _: None)
    runner = _Runner(path, gen_tokens, prefill_step_size, pipeline, log, say)
    if pipeline is None:  # (as generate reserves it)
        runner.reserve = kv_past_a_chunk(path, prompt_tokens + gen_tokens, prefill_step_size)
    say("probing the drive and the data path")
    ssd_gbps, path_gbps = _probes(path, m, base, io_workers, probe_seconds, log)
    runner.release()  # (the data path's arena)
    fake = runner.compute_floor(fake_cfg, ids)

    def line(run: Run) -> str:
        return _line(run, fake, ssd_gbps, path_gbps)

    runs: list[Run] = []
    for r, order in enumerate(rounds):
        paths = trace_paths(trace, order, r, repeats) if trace is not None else {}
        for i, policy in enumerate(order):
            cfg = base.replace(**policy_options(policy))
            out = paths.get(i)
            if out is not None:
                cfg = cfg.replace(trace=RoutingTrace())
            cold_warm, arena_size_gb = runner.cold_and_warm(cfg, ids, policy, out, plot, line)
            runs += cold_warm
    result = {
        "store": str(path),
        "expert_gb": m.expert_bytes / 1e9,
        "arena_gb": arena_size_gb,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "prefill_step_size": prefill_step_size,
        "ssd_gbps": ssd_gbps,
        "data_path_gbps": path_gbps,
        "emulated_drive_gbps": drive_limit_gbps(),  # STRATA_MLX_DRIVE_GBPS; 0: the real drive
        # CUDA's hardware queues as this process asked for them (the package's default or not)
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "compute_chunk_s": _mean([c.wall_s for c in fake.chunks]),
        "compute_decode_tps": fake.decode_tokens / fake.decode_s,
        "runs": [_summary(run, fake, ssd_gbps, path_gbps) for run in runs],
    }
    if fake.ranks is not None:
        result["compute_ranks"] = fake.ranks
        for row, run in zip(result["runs"], runs):
            row["ranks"] = run.ranks
    if plot is not None:
        from .plots import figures, plot_bench

        result["plot"] = figures(runs, fake, ssd_gbps)
        plot_bench(result, plot)
    if baseline is not None:
        from .baseline import compare

        say("mlx-lm's model beside ours")
        result["baseline"] = compare(path, ids, gen_tokens, prefill_step_size, base, log=log)
    return result


def _check_baseline_and_plot(path: Path, baseline: str | None, plot, pipeline) -> None:
    """--baseline and --plot against what else was asked, before any run."""
    if pipeline is not None and (baseline is not None or plot is not None):
        raise OptionError("--pipeline: --baseline and --plot are not pipelined")
    if baseline not in (None, "mlx-lm"):
        raise OptionError(f"--baseline {baseline}: the one baseline is mlx-lm")
    if baseline is not None:
        from .baseline import check_runnable

        check_runnable(path)  # fail before the runs, not after them


class _Runner:
    """Loads, runs and closes bench's models, pipelined or not (a pipelined run adds each
    rank's figures)."""

    def __init__(
        self,
        path: Path,
        gen_tokens: int,
        prefill_step_size: int,
        pipeline=None,
        log=print,
        status=lambda _: None,
    ):
        self.path, self.gen_tokens, self.step = path, gen_tokens, prefill_step_size
        self.pipeline = pipeline
        self.log, self.status = log, status
        self.reserve = 0  # memory load() leaves free beside the arena (load_model's)

    def compute_floor(self, fake_cfg: RuntimeConfig, ids: list[int]) -> Run:
        """The fake-stream run (every expert resident), after a warm-up pass."""
        self.status("compute floor: loading")
        model = self.load(fake_cfg)
        # The first pass compiles kernels (MLX CUDA JITs them), which no run should pay. One
        # measured pass still varied 2x between benches on one H100 (712 and 358 ms a chunk,
        # 56 and 43 tok/s), so the floor is the faster of two passes.
        head = ids[: min(len(ids), self.step + 1)]
        run_policy(model, head, 2, self.step, "compute floor", "warm-up", status=self.status)
        fake = _fastest([self.run(model, ids, "fake-stream", "compute") for _ in range(2)])
        self.close(model)
        del model
        self.release()
        self.log(
            f"compute floor (fake-stream): {_mean([c.wall_s for c in fake.chunks]) * 1e3:.0f} "
            f"ms/chunk, decode {fake.decode_tokens / fake.decode_s:.2f} tok/s"
        )
        self.log_ranks(fake)
        return fake

    def cold_and_warm(
        self, cfg: RuntimeConfig, ids: list[int], policy: str, trace: Path | None, plot, line
    ) -> tuple[list[Run], float]:
        """One policy's cold run then its warm run on the same load, each logged by `line`;
        `trace`: where the cold run's routing goes. The runs, and the arena's GB."""
        dropped = _drop_page_cache(self.path)
        self.status(f"{policy}: loading")
        model = self.load(cfg)
        arena_gb = model.expert_cache.arena.nbytes / 1e9
        layers = None
        if plot is not None:
            from .plots import LayerCounts

            layers = LayerCounts(model.expert_cache)
        runs = []
        for phase in ("cold", "warm"):
            run = self.run(model, ids, policy, phase, layers)
            runs.append(run)
            if trace is not None and phase == "cold":
                traces.write(trace, traces.of_model(model))
                model.expert_cache.stop_trace()  # the warm run is not in the file
                self.log(f"trace: {trace}")
            if plot is not None:
                run.layers = layers.take()
            pages = "" if dropped or phase == "warm" else " (store's pages not evicted)"
            self.log(line(run) + pages)
            self.log_ranks(run)
        self.close(model)
        del model, layers
        self.release()
        return runs, arena_gb

    def load(self, cfg: RuntimeConfig):
        pipe = self.pipeline() if self.pipeline else None
        model = load_model(self.path, config=cfg, pipeline=pipe, reserve_bytes=self.reserve)
        if hasattr(model, "rank_stats"):
            model.wait_ready()
        return model

    def run(self, model, ids, policy: str, phase: str, layers=None) -> Run:
        ranked = hasattr(model, "rank_stats")
        before = model.rank_stats() if ranked else None
        t = time.perf_counter()
        run = run_policy(model, ids, self.gen_tokens, self.step, policy, phase, layers, self.status)
        if ranked:
            from ..runtime.distributed import rank_figures

            run.ranks = rank_figures(before, model.rank_stats(), time.perf_counter() - t)
        return run

    def log_ranks(self, run: Run) -> None:
        from ..runtime.distributed import rank_figure_line

        for f in run.ranks or []:
            self.log(rank_figure_line(f))

    @staticmethod
    def close(model) -> None:
        if hasattr(model, "rank_stats"):
            model.close()  # the other ranks stop serving this load
        model.expert_cache.close()

    @staticmethod
    def release() -> None:
        """Once a closed model is no longer referred to: its buffers freed and MLX's cache
        emptied, so that the next load starts as in a process of its own (generate.py,
        RELEASE_EVERY: a cache full of an earlier model's buffers makes later allocations
        free them, each free waiting for the device)."""
        gc.collect()  # (a model's modules and its expert cache refer to each other)
        mx.clear_cache()


def _probes(path: Path, m, base: RuntimeConfig, io_workers: int, seconds: float, log):
    """(probe-ssd GB/s, the data path's GB/s): the drive alone, then the drive and every step
    after it into an arena, as the cache's options set them."""
    from ..stream.probe import probe_data_path, probe_ssd

    probe = probe_ssd(
        path / EXPERTS, record_bytes=m.layout.record_bytes, workers_list=(io_workers,),
        seconds=seconds,
    )[0]  # fmt: skip
    ssd_gbps = probe["gb_per_s"]
    emulated = f"; {note}" if (note := drive_note()) else ""
    log(
        f"probe-ssd: {ssd_gbps:.2f} GB/s at {io_workers} workers (direct={probe['direct']}"
        f"{emulated})"
    )
    path_probe = probe_data_path(
        path, m, workers=io_workers, seconds=seconds, overlap=base.read_overlap,
        device_copy=None if base.device_copy else False, device_memory=base.device_arena,
        copy_behind=base.copy_behind,
    )  # fmt: skip
    path_gbps = path_probe["gb_per_s"]
    log(
        f"data path into the arena: {path_gbps:.2f} GB/s, "
        f"{100 * path_gbps / ssd_gbps if ssd_gbps else 0:.0f}% of probe-ssd "
        f"(verified, bounce={path_probe['bounce']}, device copy={path_probe['device_copy']}, "
        f"device arena={path_probe['device_copy'] and base.device_arena})"
    )
    return ssd_gbps, path_gbps


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def _total(chunks: list[ExpertStats]) -> ExpertStats:
    t = ExpertStats()
    for c in chunks:
        t.add(c)
    return t


def _fastest(runs: list[Run]) -> Run:
    """The floor from several passes of one run: the prefill chunks of the pass whose chunks
    took least in all, the decode of the pass whose tokens came fastest."""
    prefill = min(runs, key=lambda r: sum(c.wall_s for c in r.chunks))
    decode = min(runs, key=lambda r: r.decode_s / max(r.decode_tokens, 1))
    return replace(
        prefill, decode=decode.decode, decode_s=decode.decode_s, decode_tokens=decode.decode_tokens
    )


def _decode_floors(run: Run, fake: Run, path_gbps: float) -> tuple[float, float]:
    """Decode's floor, max(compute, bytes a token over the data path), and its serial floor,
    the compute plus the misses' bytes over the data path where that is more (s a token)."""
    d, per_tok = run.decode, max(run.decode_tokens, 1)
    compute = fake.decode_s / fake.decode_tokens if fake.decode_tokens else 0.0
    read = d.bytes_read / per_tok / (path_gbps * 1e9) if path_gbps > 0 else 0.0
    floor = max(compute, read)
    # A miss is read once its layer's routing is known and the layer's experts wait for it:
    # its read does not overlap the compute, so what misses cost adds to it (read-ahead still
    # in flight when its layer needs it is waited for too, and not counted here).
    record = d.bytes_read / d.experts_read if d.experts_read else 0.0
    misses = d.misses * record / per_tok / (path_gbps * 1e9) if path_gbps > 0 else 0.0
    return floor, max(floor, compute + misses)


def _summary(run: Run, fake: Run, ssd_gbps: float, path_gbps: float = 0.0) -> dict:
    """One run's figures. Floors: ssd (bytes over probe-ssd), read (bytes over the data path's
    own probe: what the engine can get into its arena), compute (fake-stream); decode's two
    (`_decode_floors`)."""
    p = _total(run.chunks)
    n = max(len(run.chunks), 1)
    compute_floor = _mean([c.wall_s for c in fake.chunks])
    ssd_floor = (p.bytes_read / n) / (ssd_gbps * 1e9) if ssd_gbps > 0 else 0.0
    read_floor = (p.bytes_read / n) / (path_gbps * 1e9) if path_gbps > 0 else 0.0
    chunk_s = p.wall_s / n
    d = run.decode
    per_tok = max(run.decode_tokens, 1)
    decode_floor, serial_floor = _decode_floors(run, fake, path_gbps)
    decode_s = run.decode_s / per_tok
    return {
        "policy": run.policy,
        "phase": run.phase,
        "chunk_ms": chunk_s * 1e3,
        "prefill_tps": p.tokens / p.wall_s if p.wall_s else 0.0,
        "streamed_ahead_pct": p.streamed_ahead_pct,
        "miss_pct": p.miss_pct,
        "exposed_wait_ms_per_chunk": p.exposed_wait_s / n * 1e3,
        "experts_read_per_chunk": p.experts_read / n,
        "wasted_readahead": p.wasted_readahead,
        "dropped_readahead": p.readahead_dropped,
        "gb_read": p.gb_read,
        "gb_per_s": p.bytes_read / p.wall_s / 1e9 if p.wall_s else 0.0,
        "ssd_floor_ms": ssd_floor * 1e3,
        "compute_floor_ms": compute_floor * 1e3,
        "floor_ratio": chunk_s / max(ssd_floor, compute_floor)
        if max(ssd_floor, compute_floor)
        else 0.0,
        "read_floor_ms": read_floor * 1e3,
        "path_floor_ratio": chunk_s / max(read_floor, compute_floor)
        if max(read_floor, compute_floor)
        else 0.0,
        "decode_floor_ms": decode_floor * 1e3,
        "decode_floor_ratio": decode_s / decode_floor if decode_floor else 0.0,
        "decode_serial_floor_ms": serial_floor * 1e3,
        "decode_serial_ratio": decode_s / serial_floor if serial_floor else 0.0,
        "decode_tps": run.decode_tokens / run.decode_s if run.decode_s else 0.0,
        "decode_ms_per_token": run.decode_s / per_tok * 1e3,
        "decode_wait_ms_per_token": d.exposed_wait_s / per_tok * 1e3,
        "decode_sync_ms_per_token": d.route_sync_s / per_tok * 1e3,
        "decode_host_ms_per_token": d.host_s / per_tok * 1e3,
        "decode_miss_pct": d.miss_pct,
        "decode_streamed_ahead_pct": d.streamed_ahead_pct,
        "decode_gb_read": d.gb_read,
        # the scheduler's loop thread: GIL time, and reads it added when the queue ran low
        "loop_ms_per_chunk": p.loop_s / n * 1e3,
        "loop_cpu_ms_per_chunk": p.loop_cpu_s / n * 1e3,
        "topped_up_per_chunk": p.topped_up / n,
        "decode_loop_ms_per_token": d.loop_s / per_tok * 1e3,
        "decode_loop_cpu_ms_per_token": d.loop_cpu_s / per_tok * 1e3,
        # tokens begun in each decoder mode; gated decode's gates that gave up (recomputed)
        "decode_modes": {m: getattr(d, f"{m}_mode_tokens") for m in DECODE_MODES},
        # tokens begun with lookahead predicting (its miss rate's rule, and the duel's)
        "decode_predicting_tokens": d.predicting_tokens,
        "decode_gate_timeouts": d.gate_timeouts,
        # ... of them, those whose device copy was held past decode_copy_held_ms
        "decode_copies_held": run.copies_held,
        # ... and the times every gate was stopped for one (the gate table's stop word)
        "decode_gates_stopped": run.gates_stopped,
        # the device's time at its gates, waiting for reads (gated decode's wait)
        "decode_gate_wait_ms_per_token": d.gate_wait_s / per_tok * 1e3,
        # the device gate's checks, on their own thread (beside the decoding thread's time)
        "decode_check_ms_per_token": d.check_s / per_tok * 1e3,
        "decode_check_cpu_ms_per_token": d.check_cpu_s / per_tok * 1e3,
        # ... and their time from each routing read to its misses' reads submitted
        "decode_check_claim_ms_per_token": d.check_claim_s / per_tok * 1e3,
        # ... and their waits for the GIL once each layer's routing was on the board
        "decode_check_gil_ms_per_token": d.check_gil_s / per_tok * 1e3,
        # misses the reader read off the routing board itself (decode_quick_misses), a token
        "decode_quick_per_token": d.quick_misses / per_tok,
        "decode_misses_per_token": d.misses / per_tok,
        "decode_quick_dry_per_token": run.quick_dry / per_tok,
        "decode_quick_ahead_per_token": d.quick_ahead / per_tok,
        # a miss's read, from its submission to its landing (its ready word stored)
        "decode_miss_landing_us": run.urgent_ns / run.urgent_reads / 1e3
        if run.urgent_reads
        else 0.0,
    }


DECODE_MODES = ("token", "layers", "sync", "gated")


def _line(run: Run, fake: Run, ssd_gbps: float, path_gbps: float = 0.0) -> str:
    s = _summary(run, fake, ssd_gbps, path_gbps)
    return (
        f"{s['policy']:>9} {s['phase']}: prefill {s['chunk_ms']:.0f} ms/chunk ({s['prefill_tps']:.1f} tok/s), "
        f"ahead {s['streamed_ahead_pct']:.1f}% miss {s['miss_pct']:.1f}% wait {s['exposed_wait_ms_per_chunk']:.0f} ms, "
        f"read {_reads(s)} wasted {s['wasted_readahead']}, "
        f"loop {s['loop_ms_per_chunk']:.1f} ms (cpu {s['loop_cpu_ms_per_chunk']:.1f}) topped up {s['topped_up_per_chunk']:.0f}/chunk, "
        f"x{s['floor_ratio']:.2f} of floor (ssd {s['ssd_floor_ms']:.0f} ms, compute {s['compute_floor_ms']:.0f} ms), "
        f"x{s['path_floor_ratio']:.2f} of the data path's (read {s['read_floor_ms']:.0f} ms) | "
        f"decode {s['decode_tps']:.2f} tok/s (wait {s['decode_wait_ms_per_token']:.1f}, sync {s['decode_sync_ms_per_token']:.1f}, "
        f"host {s['decode_host_ms_per_token']:.1f} ms/tok; miss {s['decode_miss_pct']:.1f}%"
        f"{_predicting(s, run)}), "
        f"x{s['decode_floor_ratio']:.2f} of its floor ({s['decode_floor_ms']:.1f} ms), "
        f"x{s['decode_serial_ratio']:.2f} of its serial floor "
        f"({s['decode_serial_floor_ms']:.1f} ms: the compute plus its misses' reads)" + _modes(s)
    )


def _predicting(s: dict, run: Run) -> str:
    p = s["decode_predicting_tokens"]
    return f"; predicting in {p} of {run.decode_tokens} tokens" if p else ""


def _modes(s: dict) -> str:
    """Decode's modes where any token was gated: gated decode's figures to read beside."""
    m = s["decode_modes"]
    if not m["gated"]:
        return ""
    seen = ", ".join(f"{k} {v}" for k, v in m.items() if v)
    checks = s["decode_check_ms_per_token"]
    cpu = s.get("decode_check_cpu_ms_per_token", 0.0)
    claim = s.get("decode_check_claim_ms_per_token", 0.0)
    gil = s.get("decode_check_gil_ms_per_token", 0.0)
    aside = (
        f"; checks aside {checks:.1f} ms/tok (cpu {cpu:.1f}, GIL {gil:.1f}, to reads {claim:.1f})"
        if checks
        else ""
    )
    waited = s.get("decode_gate_wait_ms_per_token", 0.0)
    device = f"; device at gates {waited:.1f} ms/tok" if waited else ""
    us = s.get("decode_miss_landing_us", 0.0)
    landing = f"; a miss lands {us:.0f} us after its read's submission" if us else ""
    quick = s.get("decode_quick_per_token", 0.0)
    if quick:
        dry = s.get("decode_quick_dry_per_token", 0.0)
        ahead = s.get("decode_quick_ahead_per_token", 0.0)
        landing += (
            f"; quick misses {quick:.1f} of {s['decode_misses_per_token']:.1f}/tok"
            f" ({dry:.1f} left for want of a slot, {ahead:.1f} predictions read ahead)"
        )
    held, stops = s.get("decode_copies_held", 0), s.get("decode_gates_stopped", 0)
    stopped = f", every gate stopped {stops}x" if stops else ""
    gave = f"{s['decode_gate_timeouts']}" + (
        f" ({held} words for a held copy{stopped})" if held else ""
    )
    return f" [modes: {seen}; gates given up {gave}{aside}{device}{landing}]"


def _reads(s: dict) -> str:
    """Reads a chunk and their rate: three figures, so a slow CPU run's 0.0016 GB/s is not
    printed as 0.00; nothing read says so."""
    if not s["experts_read_per_chunk"]:
        return "0/chunk"
    return f"{s['experts_read_per_chunk']:.0f}/chunk at {s['gb_per_s']:.3g} GB/s,"


def markdown_table(result: dict) -> str:
    cols = [
        "policy",
        "phase",
        "chunk_ms",
        "prefill_tps",
        "streamed_ahead_pct",
        "miss_pct",
        "exposed_wait_ms_per_chunk",
        "experts_read_per_chunk",
        "wasted_readahead",
        "gb_per_s",
        "floor_ratio",
        "path_floor_ratio",
        "decode_tps",
        "decode_wait_ms_per_token",
        "decode_sync_ms_per_token",
        "decode_miss_pct",
        "decode_floor_ratio",
        "decode_serial_ratio",
    ]
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    rows = []
    for r in result["runs"]:
        rows.append(
            "| "
            + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols)
            + " |"
        )
    return head + "\n".join(rows)


def save(result: dict, path: str | Path) -> None:
    write_text_atomic(path, json.dumps(result, indent=1))
