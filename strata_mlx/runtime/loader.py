"""load(): a store on disk -> MLX model modules with an expert cache behind their seams.

Owns family lookup, dense weight loading, arena sizing and wiring the cache to each MoE
layer. Never reads expert records itself (the cache does).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..config import (
    MAX_IO_WORKERS,
    MAX_PREFILL_STEP,
    PANEL_MEMORY,
    OptionError,
    check_int,
    check_runtime,
    group,
    multiple_of_4kb,
    opt,
    runtime_options,
)
from ..format.quant import check_layout
from ..format.store import (
    AFFINE_BITS,
    AFFINE_GROUP_SIZES,
    DENSE,
    JsonFields,
    StoreError,
    load_manifest,
    load_profile,
    verify_dense,
)
from ..generation.tokenizer import load_tokenizer
from ..models.base import normalize_config
from ..stream import memory
from ..stream.arena import Arena
from ..stream.policies import check as check_policy
from ..stream.prediction import ReadAhead
from ..stream.scheduler import SCHEDULERS
from ..stream.stats import RoutingTrace
from .decode import MODES
from .deferred import load_device_gate
from .experts import ExpertCache, device_gate_available, tell_words
from .model import StrataModel

# The supported model types, each run by models/<model_type>.py; ALIASES are run by
# another type's module.
FAMILIES = (
    "qwen3_moe",
    "qwen3_next",
    "mixtral",
    "olmoe",
    "glm4_moe",
    "deepseek_v3",
    "gpt_oss",
    "llama",
)
ALIASES = {"kimi_k2": "deepseek_v3"}  # the same architecture (mlx-lm maps it so too)

GB = 1024**3


def family(model_type: str, source: str | Path = "config.json"):
    """The model-family module for `model_type`, or a StoreError naming `source`."""
    name = ALIASES.get(model_type, model_type)
    if name not in FAMILIES:
        known = ", ".join(sorted((*FAMILIES, *ALIASES)))
        raise StoreError(f"{source}: unknown architecture {model_type!r}; supported: {known}")
    return importlib.import_module(f"..models.{name}", __package__)


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
        metadata=opt("Arena size in GB.", (0.0, None), lo_open=True, panel=PANEL_MEMORY,
                     shown="from memory"),
    )  # fmt: skip
    io_workers: int = field(
        default=8,
        metadata=opt("Reader threads.", (1, MAX_IO_WORKERS), panel=PANEL_MEMORY, variant="io"),
    )
    # Split reads: while workers would idle (decode's few misses a layer), a record is read as
    # parts of at least this many KB by several workers side by side (reader.Reader's split).
    # A gated layer's device waits for its misses' reads: on an H100 with the full-size store,
    # parts of 128-256 KB cut that wait from 21-27 to 15-16 ms a token on a tmpfs, and gated
    # demand decode ran 1.08-1.34x as fast there and 1.18x behind a 12 GB/s emulated drive,
    # within its spread on a 3.5 GB/s disk. Ungated decode and Metal are not measured with
    # them since (docs/decisions.md, "Split reads").
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
    # CUDA with device_copy: the arena is plain device memory (allocated by a GPU op, its
    # address read by a kernel), which the host never maps; off, CUDA managed memory kept on
    # the device (advised and prefetched there), which the copy engine writes through the
    # driver's unified-memory layer (10.7 GB/s into it on an H200 from a 37 GB/s tmpfs).
    # On by default: on an H200 reading a 27-39 GB/s tmpfs, lookahead's cold prefill chunk
    # takes 1.37 s against 2.27-2.33 s in managed memory and decode 12.3-12.7 tok/s against
    # 9.4-9.8 (docs/benchmarks.md); demand reads lose 5-18 % of prefill there (decisions.md).
    device_arena: bool = field(
        default=True,
        metadata=opt("CUDA: the arena in plain device memory (else managed memory).",
                     variant="da"),
    )  # fmt: skip
    # CUDA with device_copy: a reader thread queues a read-ahead record's copy and reads the
    # next record while it runs, waiting for the copy only then (two pinned buffers a thread);
    # urgent reads are still waited for at once (reader.Reader's copy_behind). On an H200
    # reading a 33-37 GB/s tmpfs: the data path 16.1 -> 16.8 and 17.7 -> 18.9 GB/s, lookahead's
    # prefill chunk 1540 / 1443 -> 1359 / 1384 ms (cold / warm), decode 11.8 -> 13.2 / 12.4
    # tok/s, one run each (docs/benchmarks.md).
    copy_behind: bool = field(
        default=True,
        metadata=opt("CUDA: read the next record while the last one's copy runs.", variant="cb"),
    )
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
    # With the routing board (asked for), 4 layers submitted at once and checked 4 behind
    # (docs/decisions.md, "The routing board"); elsewhere 1 and 1.
    decode_lag: int | None = field(
        default=None,
        metadata=opt("pipelined: layers the host reads routing behind.", (0, 1 << 10),
                     variant="lag", shown="4 with the routing board, else 1"),
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
    decode_chunk: int = field(
        default=4,
        metadata=opt("pipelined token mode: layers submitted to the device at once.",
                     (1, 1 << 10)),
    )  # fmt: skip
    decode_layers_chunk: int | None = field(
        default=None,
        metadata=opt("pipelined layers and gated modes: layers submitted to the device at "
                     "once.", (1, 1 << 10), variant="lc",
                     shown="4 with the routing board, else 1"),
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
    # A gate gives up when its read is stuck (after 5 s by default) or failed: a few in one
    # decoder's life mean something holds the reads back (on the full-size store a record's
    # device copy waited for the very gate that waited for it: docs/decisions.md, "Gated
    # decode"), and every one more costs the timeout and a recompute. Once this many have, the
    # decoder stops gating and runs "layers" / "sync" as without the gate, warning once.
    decode_gate_give_ups: int = field(
        default=4,
        metadata=opt("gated: gates given up (a stuck read waits out the gate's timeout) before "
                     "the decoder stops gating; 0: never stops.", (0, 1 << 20), variant="gg"),
    )  # fmt: skip
    # A record's device copy takes ~50-70 us; one held longer waits behind the gate waiting
    # for it (docs/decisions.md, "A copy held behind its gate"). Off until run on a GPU.
    decode_copy_held_ms: float = field(
        default=0.0,
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
    decode_gate_board: bool = field(
        default=False,
        metadata=opt("gated (CUDA): each layer's routing written by the device into mapped "
                     "host memory for its check, instead of a command buffer of its own.",
                     variant="bd"),
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


def apply_preset(cfg: RuntimeConfig, name: str) -> RuntimeConfig:
    """`cfg` with the options still at their defaults set from configs/runtime/NAME.json."""
    from .. import configs

    given, default = cfg.options(), RuntimeConfig().options()
    preset = {}
    for key, value in configs.read("runtime", name).items():
        if key.startswith("_"):
            continue
        if key not in given:
            raise StoreError(f"{configs.path('runtime', name)}: unknown setting {key!r}")
        if given[key] == default[key]:
            preset[key] = value
    return cfg.replace(**preset)


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * GB


def auto_arena_bytes(
    total_expert_bytes: int, dense_bytes: int, scratch_bytes: int, memory: int | None = None
) -> int:
    """Physical memory minus dense weights, cache/state and prompt scratch, minus headroom
    for the OS and the rest of the process (a quarter of memory, at least 2 GB)."""
    memory = memory or physical_memory()
    headroom = max(memory // 4, 2 * GB)
    free = memory - headroom - dense_bytes - scratch_bytes
    return max(min(free, total_expert_bytes), 0)


def prefill_scratch_bytes(args, step: int) -> int:
    """A generous estimate of one prefill chunk's activation scratch."""
    hidden = getattr(args, "hidden_size", 4096)
    inter = max(
        getattr(args, "moe_intermediate_size", 0) or 0, getattr(args, "intermediate_size", 0) or 0
    )
    k = getattr(args, "num_experts_per_tok", 1)
    return step * (hidden * 16 + inter * k * 3) * 4


def default_prefill_step(memory: int | None = None) -> int:
    """2048 from 16 GB of memory up (the reference: fewer expert reads per token), else 512."""
    return 2048 if (memory or physical_memory()) >= 16 * GB else 512


def choose_arena(
    args,
    record_bytes: int,
    n_records: int,
    dense_bytes: int,
    arena_gb: float | None,
    prefill_step_size: int | None,
    memory_bytes: int | None = None,
    available: int | None = None,
    reserve_bytes: int = 0,
    kv_itemsize: int = 2,
) -> tuple[int, int]:
    """(arena bytes, prefill chunk) that load() picks: the chunk from memory unless given, an
    automatic arena from memory less dense weights and scratch, then the memory guard
    (refuses, or shrinks an automatic arena, before anything is allocated). `memory_bytes`
    and `available` (what a new allocation can get, dense weights already loaded) default to
    this machine's; strata_mlx.plan passes another machine's. `reserve_bytes`: memory the
    caller will hold beside the model (serve's kept prompt caches), counted as scratch is;
    `kv_itemsize` the KV cache's bytes an element (memory.activation_itemsize)."""
    step = prefill_step_size or default_prefill_step(memory_bytes)
    scratch = prefill_scratch_bytes(args, step) + reserve_bytes
    if arena_gb is None:
        arena = auto_arena_bytes(n_records * record_bytes, dense_bytes, scratch, memory_bytes)
    else:
        arena = int(arena_gb * GB)
    arena = memory.fit_arena(
        min(arena, n_records * record_bytes),
        record_bytes,
        scratch + memory.kv_cache_bytes(args, step, kv_itemsize),
        arena_gb,
        available,
    )
    return arena, step


def load(
    path: str | Path,
    arena_gb: float | None = None,
    config: RuntimeConfig | None = None,
    pipeline=None,
    reserve_bytes: int = 0,
    **overrides,
):
    """Load a strata-mlx store: returns (model, tokenizer or None), as mlx-lm's load(); the
    model is a StrataModel (runtime/model.py), a context manager that closes its cache.
    `pipeline` (a strata_mlx.distributed.Pipeline): load only this rank's layers.
    `reserve_bytes`: memory the caller will hold beside the model (serve's kept prompt
    caches): the automatic arena leaves it free, the memory guard counts it."""
    cfg = config if config is not None else RuntimeConfig()
    if arena_gb is not None:
        overrides["arena_gb"] = arena_gb
    try:
        cfg = cfg.replace(**overrides)
    except TypeError as e:
        raise TypeError(f"load(): {e}") from None
    check_runtime(cfg)
    check_int("reserve_bytes", reserve_bytes, 0)
    if pipeline is not None and pipeline.size > 1:
        cfg.decode = "sync"  # the pipelined decoder runs a whole model (strata_mlx.decode)
    else:
        pipeline = None
    path = Path(path)
    manifest = load_manifest(path)
    module, args = build_module(manifest, cfg, path)
    tokenizer = load_tokenizer(path)  # its files are checked before anything is allocated

    dense_path = path / DENSE
    if cfg.verify:
        verify_dense(path, manifest)
    try:
        weights = mx.load(str(dense_path))
    except Exception as e:  # mlx raises RuntimeError/ValueError with its own wording
        raise StoreError(f"{dense_path}: unreadable safetensors ({e})") from None
    stage = None
    full_manifest = manifest
    if pipeline is not None:  # this rank's layers, records and weights only
        step = cfg.prefill_step_size or default_prefill_step()
        stage = pipeline.take(module, manifest, weights, args, step)
        manifest, weights = stage.manifest, stage.weights
    load_dense(module, weights, manifest, path)
    cache = build_expert_cache(
        path, manifest, full_manifest, stage, cfg, args, weights, reserve_bytes
    )
    blocks = None if stage is None else stage.blocks
    model = StrataModel(module, cache, cfg, path, blocks, pipeline)
    if pipeline is not None:
        model = pipeline.wrap(model)
    return model, tokenizer


def store_args(path: str | Path):
    """The family's ModelArgs of the store at `path` (its manifest's config); nothing built."""
    path = Path(path)
    return model_args(load_manifest(path), path)


def model_args(manifest, path: Path):
    """The family's ModelArgs from `manifest`'s config (the store at `path`)."""
    source = path / "manifest.json"
    fam = family(manifest.model_type, source)
    return fam.ModelArgs.from_dict(normalize_config(manifest.config), source, "config.")


def sequence_kv_bytes(
    path: str | Path, positions: int, kv_bits: int | None = None, kv_group_size: int = 64
) -> int:
    """The KV cache and recurrent state one sequence of `positions` positions holds in the
    store at `path`, as the memory guard counts caches (memory.kv_cache_bytes, at the store's
    activation itemsize); with `kv_bits`, the attention part as a quantized cache's codes
    plus a scale and a bias per `kv_group_size` elements."""
    path = Path(path)
    manifest = load_manifest(path)
    args = model_args(manifest, path)
    itemsize = memory.activation_itemsize(manifest.config.get("torch_dtype"))
    total = memory.kv_cache_bytes(args, positions, itemsize)
    if not kv_bits:
        return total
    fixed = memory.kv_cache_bytes(args, 0, itemsize)  # recurrent state: not quantized
    per_element = kv_bits / 8 + 2 * itemsize / kv_group_size
    return fixed + math.ceil((total - fixed) * per_element / itemsize)


def build_module(manifest, cfg: RuntimeConfig, path: Path) -> tuple[nn.Module, object]:
    """(the family's model, unevaluated, its ModelArgs) from the store's config, every MoE
    block routing to `cfg.experts_per_token` experts when that is set."""
    source = path / "manifest.json"
    fam = family(manifest.model_type, source)
    args = model_args(manifest, path)
    if cfg.experts_per_token is not None:
        if cfg.experts_per_token > manifest.num_experts:
            raise OptionError(
                f"{path}: experts_per_token {cfg.experts_per_token}: the store has "
                f"{manifest.num_experts} experts a layer"
            )
        # The family builds its blocks with this top-k: nothing is changed on them later.
        args = dataclasses.replace(args, num_experts_per_tok=cfg.experts_per_token)
    try:
        module = fam.Model(args)
    except (ValueError, OverflowError) as e:  # a family's refusal, or a width MLX cannot index
        if cfg.experts_per_token is not None:
            raise OptionError(f"experts_per_token: {str(e).splitlines()[0]}") from None
        raise StoreError(f"{source}: config: {str(e).splitlines()[0]}") from None
    check_experts(manifest, module, args, source)
    return module, args


def load_dense(module: nn.Module, weights: dict, manifest, path: Path) -> None:
    """Quantize `module`'s layers as config.quantization says, load `weights` (strict) and
    evaluate them."""
    source, dense_path = path / "manifest.json", path / DENSE
    quant = check_quantization(manifest.config.get("quantization"), source)
    if quant:

        def predicate(p, m):
            if p in quant and isinstance(quant[p], dict):
                return quant[p]
            return hasattr(m, "to_quantized") and f"{p}.scales" in weights

        try:
            nn.quantize(
                module,
                group_size=quant["group_size"],
                bits=quant["bits"],
                class_predicate=predicate,
            )
        except ValueError as e:  # a layer whose width the group size does not divide
            raise StoreError(f"{source}: config.quantization: {str(e).splitlines()[0]}") from None
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise StoreError(f"{dense_path}: {str(e).splitlines()[0]}") from None
    bad = [k for k, v in weights.items() if v.dtype not in DENSE_DTYPES]
    if bad:
        raise StoreError(f"{dense_path}: {bad[0]} is {weights[bad[0]].dtype}, not a weight dtype")
    mx.eval(module.parameters())


def build_expert_cache(
    path: Path,
    manifest,
    full_manifest,
    stage,
    cfg: RuntimeConfig,
    args,
    weights: dict,
    reserve_bytes: int,
) -> ExpertCache:
    """The arena (sized now: `cfg.prefill_step_size` is set here when it was automatic), the
    reader and the expert cache over `manifest`'s records (a pipeline `stage`'s own)."""
    rb = manifest.layout.record_bytes
    n_records = manifest.num_experts * len(manifest.moe_layers)
    dense_bytes = sum(v.nbytes for v in weights.values())
    itemsize = memory.activation_itemsize(manifest.config.get("torch_dtype"))
    arena_bytes, cfg.prefill_step_size = choose_arena(
        args, rb, n_records, dense_bytes, cfg.arena_gb, cfg.prefill_step_size,
        reserve_bytes=reserve_bytes, kv_itemsize=itemsize,
    )  # fmt: skip
    n_slots = max(1, min(arena_bytes // rb, n_records))
    k = getattr(args, "num_experts_per_tok", 1)  # (experts a token's layer reads)
    profile = load_profile(path, full_manifest)
    if stage is not None:
        profile = stage.profile(profile)
    from ..stream.reader import Reader, needs_bounce, uses_device_copy

    device_copy = cfg.device_copy and uses_device_copy()
    arena = Arena(
        n_slots, rb, cfg.eviction, profile, manifest.moe_layers, on_device=device_copy,
        device_memory=cfg.device_arena,
    )  # fmt: skip
    reader = Reader(
        cfg.io_workers,
        bounce=needs_bounce(),
        split=cfg.read_split_kb * 1024,
        overlap=cfg.read_overlap,
        device_copy=device_copy,
        copy_behind=cfg.copy_behind,
        record_bytes=rb,
        spin_us=cfg.read_spin_us,
        spinners=cfg.read_spinners,
    )
    cache = ExpertCache(
        path,
        manifest,
        arena,
        reader,
        read_ahead=cfg.read_ahead,
        profile=profile,
        verify=cfg.verify,
        fake_stream=cfg.fake_stream,
        scheduler=cfg.scheduler,
        loop=dict(
            low_water=cfg.scheduler_low_water,
            wake_every=cfg.scheduler_wake_every,
            loop_top_up=cfg.scheduler_loop_top_up,
        ),
        route_bonus=cfg.moce_bonus,
        dump=cfg.dump,
        trace=cfg.trace,
        # (an arena smaller than one token's experts runs a layer in groups: never gated)
        gate=cfg.decode == "pipelined"
        and (device_gate_available() if cfg.decode_gate is None else cfg.decode_gate)
        and n_slots >= k,
    )
    if (gate := cache.sched.residency.gate) is not None:
        gate.prefill_by_driver = cfg.prefill_words_by_driver
        gate.copy_held_us = round(cfg.decode_copy_held_ms * 1000)
        gate.board_on = bool(cfg.decode_gate_board) and cache.pipelined.device_gate
        tell_words(cache.sched, decoding=False)  # (until a phase says otherwise)
        if cache.pipelined.device_gate:
            load_device_gate(cache, k, cfg.read_ahead.depth, asked=cfg.decode_gate)
    return cache


# What dense.safetensors may hold: float weights, and uint32 codes of quantized layers.
DENSE_DTYPES = (mx.float32, mx.float16, mx.bfloat16, mx.uint32)


def check_experts(manifest, model, args, source: Path) -> None:
    """The manifest's expert tables against the model its config builds: the same MoE layers,
    as many experts as the routers choose from, and record layouts of the model's width."""
    blocks = sorted(model.moe_blocks())
    if blocks != manifest.moe_layers:
        raise StoreError(
            f"{source}: experts.moe_layers {_brief(manifest.moe_layers)} are not the model's "
            f"MoE layers {_brief(blocks)}"
        )
    n = getattr(args, "num_experts", None) or getattr(args, "num_local_experts", None)
    if blocks and n != manifest.num_experts:
        raise StoreError(f"{source}: experts.num_experts {manifest.num_experts}, config says {n}")
    if manifest.layer_layouts is None:
        check_layout(manifest.layout, args.hidden_size, f"{source}: experts")
    else:
        for layer, lay in zip(manifest.moe_layers, manifest.layer_layouts):
            check_layout(lay, args.hidden_size, f"{source}: experts, layer {layer}")


def check_quantization(quant, source: Path) -> dict | None:
    """config.quantization (the dense layers'): group size and bits MLX accepts, globally and
    per layer; None when the dense layers are not quantized."""
    if quant is None or quant == {}:
        return None
    f = JsonFields(source)
    f.dict(quant, "config.quantization", ("group_size", "bits"))
    if quant.get("mode", "affine") != "affine":
        f.fail("config.quantization.mode", f"{quant['mode']!r}; this build reads affine")
    for key, spec in [("", quant)] + [
        (f".{k}", v) for k, v in quant.items() if k not in ("group_size", "bits", "mode")
    ]:
        field = f"config.quantization{key}"
        if not isinstance(spec, dict):
            continue  # mlx-lm writes `path: false` for layers left unquantized
        f.dict(spec, field, ("group_size", "bits"))
        unknown = sorted(set(spec) - {"group_size", "bits", "mode"})
        if key and unknown:
            f.fail(field, f"unknown key {unknown[0]!r}")
        for name, allowed in (("bits", AFFINE_BITS), ("group_size", AFFINE_GROUP_SIZES)):
            f.int(spec[name], f"{field}.{name}")
            if spec[name] not in allowed:
                f.fail(f"{field}.{name}", f"{spec[name]} is not one of {allowed}")
    return quant


def _brief(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 8 else f"[{xs[0]}, {xs[1]}, ..., {xs[-1]}] ({len(xs)})"
