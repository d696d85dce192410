"""RuntimeConfig: how the expert cache runs, each runtime option declared once as a field (its
load() keyword, CLI flag, preset key and bench variant all come from it: strata_mlx.config)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import (
    MAX_IO_WORKERS,
    MAX_PREFILL_STEP,
    PANEL_MEMORY,
    group,
    multiple_of_4kb,
    opt,
    runtime_options,
)
from ..stream.policies import check as check_policy
from ..stream.prediction import ReadAhead
from ..stream.scheduler import SCHEDULERS
from ..stream.stats import RoutingTrace
from .decode import MODES


@dataclass
class RuntimeConfig:
    """How the expert cache runs. Each field with `opt(...)` metadata is a runtime option,
    declared here once: load()'s keyword, the CLI flag (--name-with-dashes), the preset key
    and, where it has one, bench's policy variant all come from the field
    (strata_mlx.config.runtime_options), and check_runtime() holds it to its range.
    `read_ahead` is a group: prediction.ReadAhead's fields are options too (`read_ahead`
    itself sets its policy, or takes a ReadAhead whole)."""

    arena_gb: float | None = field(
        default=None,
        metadata=opt("Arena size in GiB (2^30 bytes).", (0.0, None), lo_open=True, panel=PANEL_MEMORY,
                     shown="from memory"),
    )  # fmt: skip
    io_workers: int = field(
        default=8,
        metadata=opt("Reader threads.", (1, MAX_IO_WORKERS), panel=PANEL_MEMORY, variant="io"),
    )
    # Split reads: while workers would idle (decode's few misses a layer), a record is read as
    # parts of at least this many KB by several workers side by side (reader.Reader's split):
    # gated demand decode 1.08-1.34x as fast on an H100's tmpfs (docs/decisions.md, "Split
    # reads").
    read_split_kb: int = field(
        default=256,
        metadata=opt("Split reads into parts of at least this many KB (0: whole records).",
                     (0, 1 << 20), check=multiple_of_4kb, variant="s"),
    )  # fmt: skip
    # A reader thread with nothing to read polls for work this long before it sleeps
    # (reader.Reader's spin_us), so that a decode miss's read, or its parts, start without a
    # sleeping thread's wake-up; at most read_spinners threads poll at once, a CPU core each.
    read_spin_us: int = field(
        default=0,
        metadata=opt("Reader threads poll this many us for work before sleeping (0: never).",
                     (0, 1_000_000), variant="rs"),
    )  # fmt: skip
    read_spinners: int = field(
        default=4,
        metadata=opt("Reader threads that may poll at once (read_spin_us).", (1, 1 << 11),
                     variant="rn"),
    )  # fmt: skip
    # A batch of misses split over every idle reader thread, each woken for its part, not
    # idle / batch-size parts a record with one thread waking the next (reader.Reader's spread).
    read_spread: bool = field(
        default=False,
        metadata=opt("Split a batch's reads over every idle reader thread.", variant="sp"),
    )
    # The reader's threads let go of their slot on the drive once a pread returns, before the
    # bounce copy and the checksum (reader.Reader's overlap): io_workers preads in flight.
    read_overlap: bool = field(
        default=True,
        metadata=opt("Reader threads free the drive before copying and checksumming.",
                     variant="ov"),
    )  # fmt: skip
    # CUDA: each read reaches its slot by the GPU's copy engine from pinned host memory, the
    # arena kept on the device; off, the CPU copies it into managed memory, which the driver
    # then migrates back to the device when a kernel first touches the slot (reader.Reader's
    # device_copy). Ignored where there is no CUDA device.
    device_copy: bool = field(
        default=True,
        metadata=opt("CUDA: reads reach the arena by the GPU's copy engine.", variant="dc"),
    )
    # CUDA with device_copy: the arena is plain device memory (allocated by a GPU op), which
    # the host never maps; off, CUDA managed memory kept on the device. On an H200's tmpfs:
    # lookahead's cold prefill chunk 1.37 s against 2.05-2.33 s (docs/benchmarks.md).
    device_arena: bool = field(
        default=True,
        metadata=opt("CUDA: the arena in plain device memory (else managed memory).",
                     variant="da"),
    )  # fmt: skip
    # CUDA with device_copy: a reader thread reads the next record while a read-ahead record's
    # copy runs (reader.Reader's copy_behind; urgent reads are waited for at once). On an H200's
    # tmpfs the data path 16.1 -> 16.8 and 17.7 -> 18.9 GB/s (docs/benchmarks.md).
    copy_behind: bool = field(
        default=True,
        metadata=opt("CUDA: read the next record while the last one's copy runs.", variant="cb"),
    )
    # CUDA with device_copy: a miss's record (or a split part) copied while its checksum is
    # taken, not after it: on an H100's tmpfs a part's checksum took 35-71 us and its copy 68,
    # of a miss's ~300-550 us from submission to landing. Off: decode with it ran 0.83-1.09x
    # as fast, within the runs' spread (docs/decisions.md, "A miss's checksum while its copy
    # runs").
    verify_in_copy: bool = field(
        default=False,
        metadata=opt("CUDA: a miss's checksum taken while its copy runs (a mismatched record "
                     "reaches its slot; its read fails all the same).", variant="vc"),
    )  # fmt: skip
    read_ahead: ReadAhead = field(default_factory=ReadAhead, metadata=group())
    scheduler: str = field(
        default="loop",
        metadata=opt("loop (an asyncio loop keeps the drive busy between handshakes) | sync "
                     "(reads scheduled inside the handshake only).", choices=SCHEDULERS,
                     panel=PANEL_MEMORY, variant="choices"),
    )  # fmt: skip
    scheduler_low_water: int | None = field(
        default=None,
        metadata=opt("loop: top up the queue below this many reads.", (0, 1 << 20),
                     variant="lw", shown="2 x io-workers"),
    )  # fmt: skip
    # loop: the reader's pipe wakes the loop at every completion; off, only while the queue
    # has room and the reserve has reads left (Reader.notify_below). On an H200 the fewer
    # wake-ups cut the loop's GIL time in prefill by a fifth (486 -> 358-403 ms a chunk) but
    # no chunk got faster, and decode ran 4-8 % slower (the handshake then collects the
    # completions the loop took while the main thread waited on the device): kept as option.
    scheduler_wake_every: bool = field(
        default=True,
        metadata=opt("loop: wake at every completion, not only when the queue has room.",
                     variant="we"),
    )  # fmt: skip
    # loop: the reserve (lookahead's layers after the next) is read from the loop's thread
    # alone, woken by each completion, where reads are in flight, instead of by whichever
    # thread collects completions, mostly the handshake's, which builds the device's work.
    # Replayed on the dev CPU (decode_host.py, lookahead): the handshake's wall time 29-31 %
    # less a layer, its CPU time 15 %, the same misses. On an H100 behind a 12 GB/s emulated
    # drive: the host 2-11 % less a token, decode's tok/s the same (docs/benchmarks.md). Off.
    scheduler_loop_top_up: bool = field(
        default=False,
        metadata=opt("loop, with wake-every: the reserve's reads sent from the loop's "
                     "thread alone, not the handshake's.", variant="lt"),
    )  # fmt: skip
    # The expected-next-use duel: on the full-size store's GPU decode trace it closes 66 % of
    # LRU's gap to Belady's optimum, and live on an H200 it read 25-47 % fewer decode bytes a
    # token than LRU at 0.99x LRU's ms a token behind a 12 GB/s drive, 0.90x at 6 GB/s
    # (docs/decisions.md, "Eviction").
    eviction: str | Callable = field(
        default="nextuse-duel",
        metadata=opt("nextuse-duel | lru | lfu | profile | layer, another candidate of "
                     "strata_mlx.stream.policies, or module:Class (a plug-in).",
                     check=check_policy, panel=PANEL_MEMORY),
    )  # fmt: skip
    # Checksums: dense weights once at load (again only when the file changed), every expert
    # record as the reader's threads read it. Off only to measure what it costs.
    verify: bool = field(
        default=True,
        metadata=opt("Checksums of the dense weights (once) and of every expert record as it "
                     "is read.", panel=PANEL_MEMORY),
    )  # fmt: skip
    prefill_step_size: int | None = field(
        default=None,
        metadata=opt("Prompt tokens per chunk.", (1, MAX_PREFILL_STEP), panel=PANEL_MEMORY,
                     shown="from memory"),
    )  # fmt: skip
    fake_stream: bool = field(
        default=False, metadata=opt("Every expert counts as resident: times compute alone.")
    )
    decode: str = field(
        default="pipelined",
        metadata=opt("pipelined (routing checked a layer late, no per-layer sync) | sync.",
                     choices=MODES),
    )  # fmt: skip
    # With the routing board (gated decode on CUDA, by default), 4 layers submitted at once
    # and checked 4 behind (docs/decisions.md, "The routing board"); elsewhere 1 and 1.
    decode_lag: int | None = field(
        default=None,
        metadata=opt("pipelined: layers the host reads routing behind.", (0, 1 << 10),
                     variant="lag", shown="4 with the routing board, else 1 (quick misses: "
                     "gated tokens at their end)"),
    )  # fmt: skip
    decode_sync_above: float = field(
        default=0.3,
        metadata=opt("pipelined: tokens run synced while more layers than this miss.",
                     (0.0, 1.0)),
    )  # fmt: skip
    decode_token_below: float = field(
        default=0.02,
        metadata=opt("pipelined: whole tokens, overlapped with the next one's build, while "
                     "fewer layers than this miss.", (0.0, 1.0)),
    )  # fmt: skip
    # One submit a token, as mlx-lm's generate_step makes: every expert resident on an H100,
    # 0.81-1.02x mlx-lm's time a token against 0.98-1.13x with 4 layers a submit (medians of
    # the rounds' ratios in three interleaved runs; docs/benchmarks.md, "Every expert resident").
    decode_chunk: int = field(
        default=0,
        metadata=opt("pipelined token mode: layers submitted to the device at once (0: the "
                     "whole token).", (0, 1 << 10)),
    )  # fmt: skip
    decode_layers_chunk: int | None = field(
        default=None,
        metadata=opt("pipelined layers and gated modes: layers submitted to the device at "
                     "once.", (1, 1 << 10), variant="lc",
                     shown="4 with the routing board (gated tokens 8 with quick misses), else 1"),
    )  # fmt: skip
    # Gated decode: with misses, a token's layers are queued ahead of their routing checks and
    # each layer's experts wait on the device for their reads (strata_mlx.stream.gate), where
    # the pipelined decoder otherwise stops at every layer ("sync") or recomputes after a miss
    # ("layers"). The gate waits on a CUDA device; elsewhere the host waits as "sync" does, so
    # by default (None) it is on only where the device can wait (docs/decisions.md, "Gated
    # decode": 1.3-1.8x ungated decode's speed on the H100 with misses).
    decode_gate: bool | None = field(
        default=None,
        metadata=opt("pipelined: with misses, layers wait on the device for their reads "
                     "instead of a per-layer sync.", variant="gt", switch=True,
                     shown="on where the device can wait (CUDA)"),
    )  # fmt: skip
    # A gate gives up when its read is stuck (after 5 s), failed, or its copy is held. A few
    # waiting out the timeout in a decoder's life mean something holds the reads back: the
    # decoder then stops gating, warning once. One given up at once does not count.
    decode_gate_give_ups: int = field(
        default=4,
        metadata=opt("gated: gates that waited out their timeout (a stuck read) before the "
                     "decoder stops gating; 0: never stops.", (0, 1 << 20), variant="gg"),
    )  # fmt: skip
    # A record's device copy takes ~50-70 us; a free of device or pinned memory while a gate
    # spins holds every copy queued meanwhile (docs/decisions.md, "A copy held behind its gate").
    decode_copy_held_ms: float = field(
        default=50.0,
        metadata=opt("gated (CUDA): a device copy held this long gives up the gate waiting for "
                     "it at once (its token recomputed), not after the gate's timeout; 0: off.",
                     (0.0, 60000.0), variant="ch"),
    )  # fmt: skip
    # A host function queued behind a read-ahead record's copy to store its ready word holds
    # the copy stream's next copy back; in prefill no gate waits for the word, so the reader's
    # thread stores it once it has waited for the copy (docs/decisions.md, "Gated decode").
    prefill_words_by_driver: bool = field(
        default=False,
        metadata=opt("gated: prefill's read-ahead ready words stored by the driver as decode's "
                     "are (else by the reader's thread after the copy).", variant="pw"),
    )  # fmt: skip
    # On by default where the device gate runs: behind an emulated 6 GB/s drive on an H100,
    # lookahead decoded 27.2 / 27.5 tok/s cold / warm with it against 24.0 / 22.4 without
    # (docs/decisions.md, "The routing board").
    decode_gate_board: bool | None = field(
        default=None,
        metadata=opt("gated (CUDA): each layer's routing written by the device into mapped "
                     "host memory for its check, instead of a command buffer of its own.",
                     variant="bd", switch=True, shown="on where the device gate runs (CUDA)"),
    )  # fmt: skip
    decode_gate_fused: bool = field(
        default=False,
        metadata=opt("gated, with the routing board: its write and the gate in one kernel a "
                     "layer (one call less a layer for the host).", variant="gf", switch=True),
    )  # fmt: skip
    # Gated decode's misses read by the reader's own thread off the board (stream.quick), a
    # gated token then checked at its end, 8 layers a submit: on an H100's tmpfs 1.13-1.18x
    # lookahead's decode speed, 1.26-1.27x demand's (docs/decisions.md, "Quick misses").
    decode_quick_misses: int | None = field(
        default=None,
        metadata=opt("gated (CUDA, with the routing board): a reserve of this many arena "
                     "slots into which the reader's own thread reads a layer's misses as its "
                     "routing lands on the board (0: off; the layer's check reads them).",
                     (0, 1 << 16), variant="qm",
                     shown="32 (an eighth of the arena at most) where the routing board runs"),
    )  # fmt: skip
    decode_quick_ahead: bool = field(
        default=False,
        metadata=opt("gated, with decode_quick_misses: the reader also reads lookahead's "
                     "predictions off the board, as read-ahead, while more than half its "
                     "reserve is left.", variant="qa", switch=True),
    )  # fmt: skip
    # Off, a predicting decoder runs "layers" mode: measured on the H200, token mode cost
    # lookahead 41.6 against demand's 32.0 ms/token where 0.9 % of lookups missed.
    decode_token_while_predicting: bool = field(
        default=False,
        metadata=opt("pipelined: token mode while decode lookahead predicts, when few layers "
                     "miss."),
    )  # fmt: skip
    experts_per_token: int | None = field(
        default=None,
        metadata=opt("Every MoE block's top-k.", (1, 1 << 20), shown="the store's"),
    )
    moce_bonus: float = field(
        default=0.0,
        metadata=opt("Cache-aware routing: bonus on resident experts' logits in decode.",
                     (0.0, None)),
    )  # fmt: skip
    # Research hooks on the expert cache, set in code: dump(layer, x, ids, scores, y) gets
    # every MoE layer's state (--dump-moe: tools.MoeDumper; decode then runs the per-layer
    # handshake), trace (a stats.RoutingTrace) records routing and lookahead's predictions.
    dump: Callable | None = None
    trace: RoutingTrace | None = None

    def __post_init__(self):
        if isinstance(self.read_ahead, str):  # RuntimeConfig(read_ahead="demand")
            self.read_ahead = ReadAhead(self.read_ahead)

    def options(self) -> dict:
        """Every runtime option by its name."""
        out = {}
        for o in runtime_options(type(self)):
            value = self
            for attr in o.path:
                value = getattr(value, attr)
            out[o.name] = value
        return out

    def replace(self, **options) -> RuntimeConfig:
        """A copy with `options` (by option name, or `dump` / `trace`) set; `read_ahead` may
        also be a ReadAhead. An unknown name is a TypeError, as a call's unknown keyword is."""
        paths = {o.name: o.path for o in runtime_options(type(self))}
        unknown = sorted(set(options) - set(paths) - {"dump", "trace"})
        if unknown:
            raise TypeError(f"unknown runtime option {unknown[0]!r}")
        read_ahead = self.read_ahead
        if isinstance(options.get("read_ahead"), ReadAhead):
            read_ahead = options.pop("read_ahead")
        top = {n: v for n, v in options.items() if len(paths.get(n, ())) < 2}
        ahead = {paths[n][1]: v for n, v in options.items() if len(paths.get(n, ())) == 2}
        return dataclasses.replace(self, **top, read_ahead=dataclasses.replace(read_ahead, **ahead))
