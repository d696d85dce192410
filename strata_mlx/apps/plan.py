"""`strata-mlx plan MODEL`: will this model run here (or on another machine), and how fast?

Owns the forecast: from a store, a Hugging Face checkpoint directory (config.json and the
safetensors headers only) or a GGUF file (its header only), plus a machine (this one: its
memory and a short probe of the drive; or `--target-memory` / `--target-ssd-gbps`), it says
whether the model fits, the arena and prefill chunk load() would pick (loader.choose_arena,
the same code), the share of experts resident, and the expected prefill and decode tok/s.
Never converts anything and never allocates an arena beyond the short fake-stream run that
measures the compute floor of a store on this machine.

The model (measured against `strata-mlx bench`: docs/benchmarks.md, "Forecasts"):
  - Popularity: the routing profile's per-layer counts give p_i, the chance that a token
    picks expert i (uniform k/E without a profile), with Good-Turing's share for the experts
    calibration never saw (smoothed_shares). A chunk of T tokens needs expert i with
    q_i = 1 - (1 - p_i)^T; its distinct experts are the sum of the q_i.
  - Residency: the arena is LRU over a layer-major sweep, so an expert needed again after g
    chunks (tokens, in decode) is still resident iff fewer than `slots` distinct experts were
    needed in between: U(g) = sum_i 1 - (1 - q_i)^g <= slots. g* is the largest such g, and
    an expert is a hit with probability 1 - (1 - q_i)^min(g*, history) (Che's approximation,
    with the deterministic gaps of a sweep). When one chunk needs more than the arena holds,
    g* = 0: every chunk reads all it needs (LRU on a cyclic sweep).
  - Prefill: each chunk takes max(SSD floor, compute floor): bytes it reads over the probe's
    GB/s at the I/O worker count, and the fake-stream chunk time (or FLOPs over a rate).
  - Decode: of a token's k lookups a layer, 1 - hit are not resident, hit taken token by
    token from what the cold prefill's sweep left in the arena as decode's own working set
    replaces it (decode_hits: the first tokens after a long prompt miss far more than the
    steady state); lookahead predicts a share `recall` of them from an earlier layer's
    input (measured with the experts' real outputs: each layer's input through the next
    layers' routers; the sync handshake's predictions of a layer from the `depth` layers
    before it, together, by their measured union: they miss alike; independent guesses for a
    target machine), which are streamed ahead, and the rest are misses. The decoder's mode
    follows its own rule (decode.choose_mode), simulated token by token: the running share
    of layers with a miss (0.02 a layer toward each observation, from 0) puts it in "sync"
    above decode_sync_above, else "layers" while lookahead predicts (unless
    decode_token_while_predicting), else "token". A token costs that mode's fake-stream
    decode time (its per-layer routing syncs included), plus in "sync" mode the
    handshake's Python per layer (measured in a short real decode), plus what its absent
    lookups cost, plus in "layers" mode one synced layer recomputed for each layer that
    missed. An absent lookup costs what one cost in that short real decode (the token's
    time beyond compute and handshake over its absent lookups: the drive at the queue depth
    decode keeps, the predictions read in vain, the device's work on fresh slots); for a
    target machine, or when that decode read too little, the misses' reads at the probe's
    bandwidth for that many in flight, and streamed-ahead reads only what the layers
    between prediction and use do not hide.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..config import OptionError
from ..format.store import (
    ALIGNMENT,
    COMPONENT_ALIGNMENT,
    EXPERTS,
    MANIFEST,
    StoreError,
    write_text_atomic,
)
from ..stream.memory import activation_itemsize

GB = 1024**3
# The reference system's GPU work: 2.0-2.4 s for a 1024-token chunk of an 80B-A3B model on a
# 24 GB M5 MacBook Air (SPEC), ~2.8 TFLOP/s effective: the default rate for a target machine.
REFERENCE_LAPTOP_TFLOPS = 2.8
# Bytes a token's dense and expert weights take to stream through the laptop's memory
# (M4/M5 Air: 120-153 GB/s): the decode compute floor of a target machine.
REFERENCE_LAPTOP_MEMORY_GBPS = 120.0
TOLERANCE = 0.25  # the issue's +-25 %


@dataclass
class ModelShape:
    """What the forecast needs from a model, whatever its source."""

    source: str  # store | hf | gguf
    path: str
    model_type: str
    record_bytes: int  # one expert: gate + up + down, aligned as a store record
    num_experts: int
    moe_layers: int
    top_k: int
    dense_bytes: int
    active_params: int  # per token: dense matmuls + top-k experts (FLOPs = 2x this)
    profile: np.ndarray | None = field(default=None, repr=False)  # [layers, experts] counts
    args: object = field(default=None, repr=False)  # the family's ModelArgs (memory sizing)
    note: str = ""
    kv_itemsize: int = 2  # the activations' and KV cache's bytes an element

    @property
    def n_records(self) -> int:
        return self.num_experts * self.moe_layers

    @property
    def expert_bytes(self) -> int:
        return self.n_records * self.record_bytes


@dataclass
class Machine:
    memory_bytes: int
    available_bytes: int | None  # for a new allocation, dense weights already held
    ssd_gbps: float  # random record reads at the I/O worker count (1e9 B/s)
    ssd_gbps_one: float  # one read in flight
    io_workers: int
    name: str = "this machine"


@dataclass
class Compute:
    """What this machine (or a target) spends: with every expert resident (fake-stream runs
    of a store, or estimates), per token unless named otherwise; and what lookahead predicts
    and an absent lookup costs."""

    prefill_s: float
    decode_s: float  # decode "token" mode: whole tokens, no per-layer sync
    decode_layers_s: float | None = None  # "layers" mode: routing read a layer late
    decode_sync_s: float | None = None  # the per-layer handshake's sync
    handshake_s: float = 0.0  # per decode layer: the handshake's Python, which fake-stream skips
    recall: dict[int, float] = field(default_factory=dict)  # distance -> lookahead's recall
    # a -> the share of a layer's picks that the predictions from the a layers before it
    # find together (the sync handshake's, a = min(depth, layers before)); measured, as
    # guesses from neighbouring layers miss alike (H200 run 9: 68 % streamed ahead of the
    # absent lookups, where independent guesses at the same recall said 81 %)
    recall_union: dict[int, float] = field(default_factory=dict)
    # per decode lookup that was not resident (not per token): what it adds to its token, its
    # read at the queue depth decode keeps, the predictions read in vain around it, the
    # device's work on a fresh slot, the Python for it beyond the handshake's per layer; from
    # a short real decode that reads (measure_real, with lookahead predicting, in sync mode:
    # applied alike to every mode's absent lookups). None: the reads are costed from the
    # probe's bandwidth (estimates for a target, or that decode read too little)
    absent_s: float | None = None

    @classmethod
    def of(cls, c: Compute | tuple[float, float]) -> Compute:
        """A Compute, or (s per prefill token, s per decode token) for every mode alike."""
        return c if isinstance(c, Compute) else cls(float(c[0]), float(c[1]))

    def mode_s(self, mode: str) -> float:
        v = {"layers": self.decode_layers_s, "sync": self.decode_sync_s}.get(mode)
        return self.decode_s if v is None else v


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
    ssd_gbps: float = 0.0
    prompt_tokens: int = 0
    gen_tokens: int = 0  # decode tokens forecast after the cold prompt
    distinct_per_chunk: float = 0.0  # experts a full chunk needs, all layers
    gb_read_per_chunk: float = 0.0  # mean over the cold prompt's chunks
    ssd_floor_s: float = 0.0  # mean per chunk
    compute_floor_s: float = 0.0  # per full chunk
    compute_source: str = ""  # fake-stream | estimate
    prefill_tps: float = 0.0
    decode_hit_rate: float = 0.0  # resident when asked (LRU)
    decode_streamed_ahead: float = 0.0  # share of lookups lookahead brought in
    decode_miss_rate: float = 0.0  # share of lookups the computation waited for
    decode_modes: dict = field(default_factory=dict)  # tokens per decoder mode
    decode_misses_per_token: float = 0.0
    decode_compute_ms: float = 0.0
    # what an absent lookup cost plan's short real decode (None: reads costed from the probe)
    decode_absent_ms: float | None = None
    decode_ms_per_token: float = 0.0
    decode_tps: float = 0.0
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [
            f"{self.model} ({self.source}) on {self.machine}",
            f"  {self.verdict}",
        ]
        if not self.fits:
            return out + [f"  note: {n}" for n in self.notes]
        out += [
            f"  experts {self.expert_gb:.2f} GB, dense {self.dense_gb:.2f} GB; "
            f"arena {self.arena_bytes / GB:.2f} GB = {self.slots} slots "
            f"({100 * self.resident_share:.1f} % of the experts resident), "
            f"prefill chunk {self.prefill_step_size}",
            f"  prefill ({self.prompt_tokens} tokens, cold): {self.prefill_tps:.1f} tok/s; "
            f"per chunk {self.distinct_per_chunk:.0f} distinct experts, "
            f"{self.gb_read_per_chunk:.3f} GB read, SSD floor {self.ssd_floor_s * 1e3:.0f} ms "
            f"at {self.ssd_gbps:.2f} GB/s, compute floor {self.compute_floor_s * 1e3:.0f} ms "
            f"({self.compute_source})",
            f"  decode ({self.gen_tokens} tokens): {self.decode_tps:.2f} tok/s "
            f"({self.decode_ms_per_token:.1f} ms/token: "
            f"compute {self.decode_compute_ms:.1f}, {self.decode_misses_per_token:.1f} misses "
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
        return out + [f"  note: {n}" for n in self.notes]


# ---- model shapes ---------------------------------------------------------------------


def _record_bytes(parts: list[int]) -> int:
    """A store record of components of these sizes (64-byte aligned each, 4 KiB in all)."""
    n = sum(-(-p // COMPONENT_ALIGNMENT) * COMPONENT_ALIGNMENT for p in parts)
    return max(-(-n // ALIGNMENT) * ALIGNMENT, ALIGNMENT)


def _args(config: dict, source):
    from ..models.base import normalize_config
    from ..runtime.loader import family

    config = normalize_config(config)
    fam = family(config.get("model_type"), source)
    return fam, fam.ModelArgs.from_dict(config, source)


def _active_params(args, per_expert_params: int, moe_layers: int) -> int:
    """Matmul weights a token uses: attention and dense MLPs (estimated from the shape), the
    LM head, and top-k experts in each MoE layer."""
    D = args.hidden_size
    L = args.num_hidden_layers
    heads = getattr(args, "num_attention_heads", 1) or 1
    kv = getattr(args, "num_key_value_heads", None) or heads
    hd = getattr(args, "head_dim", None) or D // heads
    attn = D * hd * (2 * heads + 2 * kv)
    dense_mlp = 3 * D * (getattr(args, "intermediate_size", 0) or 0)
    k = _top_k(args)
    vocab = getattr(args, "vocab_size", 0) or 0
    return L * attn + (L - moe_layers) * dense_mlp + moe_layers * k * per_expert_params + D * vocab


def from_store(path: Path) -> ModelShape:
    from ..format.store import DENSE, load_manifest, load_profile

    m = load_manifest(path)
    _, args = _args(m.config, path / MANIFEST)
    lay = m.layout
    per_expert = 3 * args.hidden_size * _expert_width(args)
    return ModelShape(
        "store",
        str(path),
        m.model_type,
        lay.record_bytes,
        m.num_experts,
        len(m.moe_layers),
        _top_k(args),
        (path / DENSE).stat().st_size,
        _active_params(args, per_expert, len(m.moe_layers)),
        load_profile(path, m),
        args,
        kv_itemsize=activation_itemsize(m.config.get("torch_dtype")),
    )


def _expert_width(args) -> int:
    """An expert's intermediate width (a split llama's experts share its MLP's columns)."""
    width = getattr(args, "moe_intermediate_size", None)
    if width:
        return width
    if args.model_type == "llama":
        return args.intermediate_size // max(args.num_experts, 1)
    return args.intermediate_size


def _top_k(args) -> int:
    return getattr(args, "num_experts_per_tok", None) or getattr(args, "num_experts", 1)


def _safetensors_headers(src: Path) -> dict[str, tuple[str, int]]:
    """name -> (dtype, bytes) from every *.safetensors header in src (no tensor data read)."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise StoreError(f"{src}: no *.safetensors files")
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise StoreError(f"{f}: truncated safetensors (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > f.stat().st_size - 8:
                raise StoreError(f"{f}: truncated safetensors (header claims {n} bytes)")
            try:
                header = json.loads(fh.read(n))
            except ValueError:
                raise StoreError(f"{f}: corrupt safetensors header") from None
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = (v["dtype"], v["data_offsets"][1] - v["data_offsets"][0])
    return out


ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1, "I8": 1, "F64": 8}


def from_hf(src: Path, q_bits: int | None = None, q_group_size: int = 64) -> ModelShape:
    """As `convert --hf-path` would store it: experts as they are (an mlx-lm checkpoint's
    quantized experts stay so), or MLX-affine at `q_bits` (-q)."""
    from ..convert.hf import read_config

    config = read_config(src)
    fam, args = _args(config, src / "config.json")
    tensors = _safetensors_headers(src)
    prefixes = {}
    for layer in range(args.num_hidden_layers):
        p = fam.EXPERT_PREFIX.format(layer=layer)
        prefixes[layer] = (p + ".", p.rsplit(".", 1)[0] + ".switch_mlp.")
    moe = [l for l, ps in prefixes.items() if any(k.startswith(ps) for k in tensors)]
    E = getattr(args, "num_experts", None) or getattr(args, "num_local_experts", 0) or 0
    expert_total, dense = 0, 0
    for k, (_dtype, n) in tensors.items():
        if any(k.startswith(prefixes[l]) for l in moe):
            expert_total += n
        else:
            dense += n
    D, inter = args.hidden_size, _expert_width(args)
    if q_bits is not None:  # weights at q_bits, fp16 scale and bias per group
        parts = [D * inter * q_bits // 8, 2 * 2 * D * inter // q_group_size] * 3
        record = _record_bytes(parts)
    else:
        record = _record_bytes([expert_total // max(len(moe) * E, 1)])
    note = "experts as in the checkpoint" if q_bits is None else f"experts at {q_bits}-bit"
    return ModelShape(
        "hf",
        str(src),
        config.get("model_type", "?"),
        record,
        E,
        len(moe),
        _top_k(args),
        dense,
        _active_params(args, 3 * D * inter, len(moe)),
        None,
        args,
        note,
        kv_itemsize=activation_itemsize(config.get("torch_dtype") or config.get("dtype")),
    )


def from_gguf(path: Path, split_experts: int | None = None) -> ModelShape:
    """As `convert --gguf-path` would store it (convert.gguf.gguf_config, the converter's own
    reading of the header: config, MoE layers, record layouts): expert blocks kept as they
    are, or a dense llama's MLPs split into `split_experts` (16 when not given); dense
    tensors as DenseWriter keeps them (Q4_0/Q4_1/Q8_0 repacked, others in the model's
    dtype: float32 under 2 GB of file, else float16; bfloat16 for gpt-oss)."""
    from ..convert.gguf import AFFINE_TYPES, GROUP, _Gguf, _has_experts, gguf_config, qtype_name

    g = _Gguf(path)
    if split_experts is None and g.arch == "llama" and not _has_experts(g):
        split_experts = 16
    c = gguf_config(g, split_experts)
    _, args = _args(c.config, path)
    item = 2 if c.dtype in ("float16", "bfloat16") else 4
    dense = 0
    for name in c.dense_tensors:
        t = g.tensors[name]
        n = int(t.n_elements)
        bits = AFFINE_TYPES.get(qtype_name(t))
        if bits and len(t.shape) == 2 and "ffn_gate_inp" not in name:  # routers stay float
            dense += n * bits // 8 + 2 * (n // GROUP) * item
        else:
            dense += n * item
    D, inter = args.hidden_size, _expert_width(args)
    if c.split_experts:  # the converter's routers, float [E, D] and [E] a layer
        dense += len(c.moe_layers) * c.num_experts * (D + 1) * item
    moe = len(c.moe_layers)
    return ModelShape(
        "gguf",
        str(path),
        c.model_type,
        c.layouts[0].record_bytes,
        c.num_experts,
        moe,
        _top_k(args),
        dense,
        _active_params(args, 3 * D * inter, moe),
        None,
        args,
        f"llama MLPs split into {c.num_experts} experts" if c.split_experts else "",
        kv_itemsize=item,
    )


def model_shape(
    path: str | Path, q_bits: int | None = None, split_experts: int | None = None
) -> ModelShape:
    path = Path(path)
    if path.is_dir() and (path / MANIFEST).is_file():
        return from_store(path)
    if path.is_dir() and (path / "config.json").is_file():
        return from_hf(path, q_bits)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return from_gguf(path, split_experts)
        raise StoreError(f"{path}: not a GGUF file (magic {magic!r})")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    raise StoreError(
        f"{path}: not a store (manifest.json), a Hugging Face checkpoint (config.json) or a GGUF"
    )


# ---- the machine ----------------------------------------------------------------------


def probe_file(shape: ModelShape) -> Path:
    """A large file on the drive the model lives on."""
    p = Path(shape.path)
    if shape.source == "store":
        return p / EXPERTS
    if shape.source == "hf":
        return max(p.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    return p


def this_machine(
    shape: ModelShape, io_workers: int = 8, probe_seconds: float = 1.0, ssd_gbps=None
) -> Machine:
    from ..runtime.loader import physical_memory
    from ..stream import memory
    from ..stream.probe import probe_ssd

    if ssd_gbps is None:
        rows = probe_ssd(
            probe_file(shape),
            record_bytes=shape.record_bytes,
            workers_list=(1, io_workers),
            seconds=probe_seconds / 2,
        )
        one, many = rows[0]["gb_per_s"], rows[1]["gb_per_s"]
    else:
        one = many = ssd_gbps
    avail = memory.available_bytes()
    if avail is not None:
        avail = max(avail - shape.dense_bytes, 0)  # load() sizes the arena with dense loaded
    return Machine(physical_memory(), avail, many, one, io_workers)


def target_machine(memory_gb: float, ssd_gbps: float, io_workers: int = 8) -> Machine:
    """Another machine: `memory_gb` of which the wired limit of a Mac (~19 of 24 GB, SPEC)
    can go to MLX, less the dense weights; a drive of `ssd_gbps` at any queue depth."""
    mem = int(memory_gb * GB)
    return Machine(mem, None, ssd_gbps, ssd_gbps, io_workers, f"a {memory_gb:g} GB machine")


# ---- residency and reads --------------------------------------------------------------


def pick_probabilities(shape: ModelShape) -> np.ndarray:
    """[layers * experts] chance that one token picks each expert (sums to k a layer)."""
    k, E, L = shape.top_k, shape.num_experts, shape.moe_layers
    prof = shape.profile
    if prof is None or prof.sum() == 0:
        return np.full(L * E, k / max(E, 1))
    return np.clip(smoothed_shares(prof) * k, 0.0, 1.0).reshape(-1)


def smoothed_shares(counts: np.ndarray) -> np.ndarray:
    """[layers, experts] share of a layer's picks each expert gets, from calibration counts.
    The experts calibration never saw are not absent, only rarer than it could tell: Good and
    Turing's estimate gives them, together, the share of picks that went to experts seen once
    (n1 / n), split evenly but none above what an expert seen once gets, and scales the seen
    ones' shares down by as much; a layer calibration never reached is uniform. Without it a
    chunk longer than the calibration run was forecast to need only the experts calibration
    saw (H200 run 8: 365 of 512 a layer from 256 tokens, against 453 read). Spreading that
    share evenly over every unseen expert overshoots where popularity has a long tail: on the
    qwen3-next synthetic shape's own routing (benchmarks/synthetic_routing.py, 4 layers), a
    1024-token chunk needs 419 a layer; from a 256-token profile this gives 470 (+12 %), what
    calibration saw 326 (-22 %), Chao's estimate of the unseen count 380 (-9 %); from 512
    tokens 455 / 382 / 417. The forecast errs toward reading more."""
    c = counts.astype(np.float64)
    n = c.sum(axis=1, keepdims=True)
    unseen = c == 0
    n_unseen = unseen.sum(axis=1, keepdims=True)
    singles = (c == 1).sum(axis=1, keepdims=True)
    safe_n = np.maximum(n, 1)
    # no unseen expert above what one seen once would get; none seen once: rare, not absent
    each = np.minimum(singles / safe_n / np.maximum(n_unseen, 1), 1 / (safe_n + n_unseen))
    each = np.where(n_unseen > 0, np.maximum(each, 1e-3 / safe_n), 0.0)
    share = np.where(unseen, each, c / safe_n * (1 - each * n_unseen))
    share = share / share.sum(axis=1, keepdims=True)
    return np.where(n > 0, share, 1.0 / c.shape[1])  # a layer calibration never reached


def reuse_gap(q: np.ndarray, slots: int, limit: int) -> int:
    """The largest g <= limit with sum_i 1 - (1 - q_i)^g <= slots: an item needed again
    after g steps is still resident (LRU)."""
    if len(q) <= slots:
        return limit
    lq = np.log1p(-np.minimum(q, 1 - 1e-12))

    def distinct(g: int) -> float:
        return float(np.sum(-np.expm1(lq * g)))

    if distinct(1) > slots:
        return 0
    lo, hi = 1, 1
    while hi < limit and distinct(hi) <= slots:
        lo, hi = hi, min(hi * 2, limit)
    if distinct(hi) <= slots:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if distinct(mid) <= slots else (lo, mid)
    return lo


def hit_probability(q: np.ndarray, gap: int) -> np.ndarray:
    return -np.expm1(np.log1p(-np.minimum(q, 1 - 1e-12)) * gap)


def prefill_reads(p: np.ndarray, slots: int, prompt: int, step: int) -> list[tuple[int, float]]:
    """[(tokens, experts read)] for each chunk of a cold prompt."""
    out = []
    done = 0
    q_full = -np.expm1(np.log1p(-np.minimum(p, 1 - 1e-12)) * step)
    gap = reuse_gap(q_full, slots, max(prompt // step, 1))
    c = 0
    while done < prompt:
        t = min(step, prompt - done)
        q = -np.expm1(np.log1p(-np.minimum(p, 1 - 1e-12)) * t)
        hit = hit_probability(q_full, min(gap, c)) if c else np.zeros_like(q)
        out.append((t, float(np.sum(q * (1 - hit)))))
        done += t
        c += 1
    return out


def decode_hits(
    p: np.ndarray, layers: int, slots: int, prompt: int, step: int, gen: int
) -> np.ndarray:
    """[gen] share of each decode token's lookups resident, decoding right after a cold
    prompt: the arena starts with what the prefill's layer sweep left and turns over to
    decode's own working set.

    What the sweep left: its (chunk, layer) positions walked from the newest back, each adding
    the experts it touched that no newer position had, until `slots` are accounted for (LRU
    keeps the most recent). An expert is resident at decode token t if decode used it within
    its last min(t, g*) tokens (g*: decode's LRU reuse gap), or if the prefill left it and it
    has not been pushed out: once decode has brought in more items than the arena had free,
    the prefill's items go, oldest first (taken as evenly spread)."""
    p_layers = p.reshape(layers, -1)
    left = np.zeros_like(p_layers)
    room = float(slots)
    sizes = [min(step, prompt - c) for c in range(0, max(prompt, 0), step)]
    newest_first = ((tokens, l) for tokens in reversed(sizes) for l in reversed(range(layers)))
    for tokens, l in newest_first:
        add = hit_probability(p_layers[l], tokens) * (1 - left[l])
        total = float(add.sum())
        if total <= 0:
            continue
        f = min(1.0, room / total)
        left[l] += f * add
        room -= f * total
        if room <= 1e-9:
            break
    left = left.reshape(-1)
    held = float(left.sum())
    free = max(slots - held, 0.0)
    g_star = reuse_gap(p, slots, max(gen, 1))
    out = np.empty(gen)
    for t in range(gen):
        own = hit_probability(p, min(t, g_star))
        new = float(np.sum(hit_probability(p, t) * (1 - left)))
        kept = min(max(1 - max(new - free, 0.0) / held, 0.0), 1.0) if held > 0 else 0.0
        hit = 1 - (1 - own) * (1 - left * kept)
        out[t] = float(np.sum(p * hit) / np.sum(p))
    return out


def read_gbps(machine: Machine, in_flight: float) -> float:
    """Bandwidth at `in_flight` reads: between the one-read and the full-queue probes."""
    n = max(1.0, min(in_flight, machine.io_workers))
    if machine.io_workers <= 1:
        return machine.ssd_gbps
    f = (n - 1) / (machine.io_workers - 1)
    return machine.ssd_gbps_one + f * (machine.ssd_gbps - machine.ssd_gbps_one)


# ---- compute --------------------------------------------------------------------------


def measure_compute(
    path: Path, step: int, tokens: int, decode_tokens: int, arena_gb: float
) -> Compute:
    """Fake-stream runs (every expert counts as resident: compute alone, as bench's compute
    floor): prefill, and decode in each of the decoder's modes; then a short real run for the
    handshake's Python per layer, lookahead's recall and union, and what an absent lookup
    costs decode (measure_real)."""
    from ..format.store import load_manifest
    from ..runtime.loader import RuntimeConfig, load
    from .bench import _run

    vocab = load_manifest(path).config["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, size=tokens).tolist()
    cfg = RuntimeConfig(
        arena_gb=arena_gb, read_ahead="demand", fake_stream=True, prefill_step_size=step
    )
    model, _ = load(path, config=cfg)
    try:
        _run(model, ids[: min(tokens, 8)], 1, step, "warmup", "-")  # kernels compile once
        run = _run(model, ids, decode_tokens, step, "fake-stream", "compute")
        per_mode = {}
        dec = model.decoder
        if dec is not None:
            keep = dec.sync_above, dec.token_below
            for mode, (sync_above, token_below) in (("layers", (1.0, 0.0)), ("sync", (-1.0, 0))):
                dec.sync_above, dec.token_below = sync_above, token_below
                r = _run(model, ids[: min(tokens, step) + 1], decode_tokens, step, mode, "-")
                per_mode[mode] = r.decode_s / max(decode_tokens, 1)
            dec.sync_above, dec.token_below = keep
    finally:
        model.expert_cache.close()
    del model
    prefill_s = sum(c.wall_s for c in run.chunks)
    real = measure_real(path, ids, step, decode_tokens, arena_gb)
    sync_s = per_mode.get("sync", run.decode_s / max(decode_tokens, 1))
    return Compute(
        prefill_s / max(tokens, 1),
        run.decode_s / max(decode_tokens, 1),
        per_mode.get("layers"),
        per_mode.get("sync"),
        handshake_s=real.handshake_s,
        recall=real.recall,
        recall_union=real.union,
        absent_s=real.absent_s(sync_s),
    )


def lookahead_recall(
    model, ids: list[int], step: int, distances, depth: int = 0
) -> tuple[dict[int, float], dict[int, float]]:
    """(recall, union). recall: distance d -> the share of a token's top-k at layer l + d that
    layer l + d's router, applied to layer l's MoE input, picks: what one-token lookahead gets
    right (decode predicts from the layer before in the per-layer handshake, from `lag + 1`
    layers before in pipelined "layers" mode). union: a in 1..depth -> the share that the
    predictions from the a layers before a layer pick together (the sync handshake predicts
    each layer from up to `depth` before it). From the prefill of `ids` (one prompt chunk)."""
    import mlx.core as mx

    cache = model.expert_cache
    seen: dict[int, tuple] = {}

    def record(layer, x, inds, scores, y):
        seen[layer] = (x, inds)

    cache.dump = record
    try:
        model(mx.array([ids[:step]]), cache=model.make_cache())
    finally:
        cache.dump = None
    layers = [l for l in cache.layers if l in seen]
    reach = max([*distances, depth, 0])
    picks: dict[tuple[int, int], list[set]] = {}  # (target index, d) -> each token's picks
    for j, target in enumerate(layers):
        if target not in cache.routers:
            continue
        k = seen[target][1].shape[-1]
        for d in range(1, min(reach, j) + 1):
            pred = np.array(cache.routers[target](seen[layers[j - d]][0])).reshape(-1, k)
            picks[j, d] = [set(p) for p in pred.tolist()]
    truth = {
        j: np.array(seen[l][1]).reshape(-1, seen[l][1].shape[-1]).tolist()
        for j, l in enumerate(layers)
    }

    def share(j: int, ds: range) -> tuple[int, int]:
        found = [set().union(*g) for g in zip(*(picks[j, d] for d in ds))]
        return sum(len(f & set(t)) for f, t in zip(found, truth[j])), sum(map(len, truth[j]))

    def mean(pairs) -> float | None:
        hit, total = map(sum, zip(*pairs)) if pairs else (0, 0)
        return hit / total if total else None

    recall = {
        d: mean([share(j, range(d, d + 1)) for j in range(len(layers)) if (j, d) in picks])
        for d in distances
        if d > 0
    }
    union = {
        a: mean(
            [
                share(j, range(1, a + 1))
                for j in range(len(layers))
                if all((j, d) in picks for d in range(1, a + 1))
            ]
        )
        for a in range(1, depth + 1)
    }
    return (
        {d: r for d, r in recall.items() if r is not None},
        {a: u for a, u in union.items() if u is not None},
    )


RECALL_TOKENS = 64  # tokens whose routing gives lookahead's recall (each picks k a layer)
# Fewer absent lookups than this in measure_real's decode: too few to say what one costs
MIN_ABSENT = 32


@dataclass
class RealDecode:
    """measure_real's findings: per decode layer, the handshake's Python; lookahead's recall
    (by distance, and the sync handshake's predictions together); and the short decode's
    seconds a token and lookups a token that were not resident."""

    handshake_s: float
    recall: dict[int, float]
    union: dict[int, float]
    s_per_token: float
    absent_per_token: float
    layers: int
    tokens: int

    def absent_s(self, sync_s: float) -> float | None:
        """What one absent lookup added to its token beyond `sync_s` (the sync handshake's
        compute, fake-stream) and the handshake's Python, or None if too few were seen.
        Fake-stream's time holds part of that Python too (ids to numpy, the kernel's call), so
        it is taken off twice here and added back once a token by the forecast: exact at this
        decode's share of absent lookups, a little low where fewer are absent."""
        if self.absent_per_token * self.tokens < MIN_ABSENT:
            return None
        extra = self.s_per_token - sync_s - self.layers * self.handshake_s
        return max(extra, 0.0) / self.absent_per_token


def measure_real(path: Path, ids: list[int], step: int, tokens: int, arena_gb: float) -> RealDecode:
    """With the experts' real outputs: seconds of Python per decode layer in the handshake
    (classify, read-ahead, completions; outside its syncs and waits) and what its absent
    lookups cost, from a short decode with per-layer sync after a prompt of one chunk, and
    lookahead's recall at each distance it predicts from and of the sync handshake's
    predictions together (lookahead_recall). Not from
    the fake-stream run, whose expert outputs are whatever the slots hold: the hidden states
    there lack the updates that move routing from one layer to the next (H200 run 8: the
    forecast streamed ahead 87 % of the absent lookups on that recall, bench 70 %)."""
    from ..runtime.loader import RuntimeConfig, load
    from .bench import _run

    cfg = RuntimeConfig(arena_gb=arena_gb, decode="sync", prefill_step_size=step)
    model, _ = load(path, config=cfg)
    try:
        n_layers = len(model.expert_cache.layers)
        run = _run(model, ids[: min(len(ids), step) + 1], tokens, step, "handshake", "-")
        depth = model.runtime.read_ahead.depth
        distances = sorted({*range(1, depth + 1), model.runtime.decode_lag + 1})
        recall, union = lookahead_recall(model, ids, min(step, RECALL_TOKENS), distances, depth)
    finally:
        model.expert_cache.close()
    d, n = run.decode, max(tokens, 1)
    return RealDecode(
        d.host_s / max(tokens * n_layers, 1),
        recall,
        union,
        run.decode_s / n,
        (d.lookups - d.hits) / n,
        n_layers,
        n,
    )


# A host sync of a layer's routing ids: ~125 us on the H200 under MLX CUDA (SPEC); the
# handshake's Python, 16-27 ms a 48-layer token there: ~0.45 ms a layer. For target machines.
SYNC_S = 125e-6
HANDSHAKE_S = 0.45e-3


def estimate_compute(shape: ModelShape, tflops: float, memory_gbps: float) -> Compute:
    """FLOPs over a rate; weight bytes a token reads over memory bandwidth; the per-layer
    sync and the handshake's Python as measured on the H200."""
    prefill = 2 * shape.active_params / (tflops * 1e12)
    touched = shape.dense_bytes + shape.top_k * shape.moe_layers * shape.record_bytes
    decode = max(touched / (memory_gbps * 1e9), prefill)
    synced = decode + shape.moe_layers * SYNC_S
    return Compute(prefill, decode, synced, synced, HANDSHAKE_S)


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
    the decoder's own rules (strata_mlx.runtime.decode; thresholds from RuntimeConfig's defaults)."""
    from ..runtime.decode import choose_mode
    from ..runtime.loader import RuntimeConfig

    cfg = RuntimeConfig()
    k, L, rb = shape.top_k, max(shape.moe_layers, 1), shape.record_bytes
    hits = decode_hits(p, L, slots, prompt_tokens, step, gen_tokens)
    distance = {"sync": 1, "layers": cfg.decode_lag + 1, "token": 1}  # prediction to use
    r = compute.recall
    depth = cfg.read_ahead.depth

    # Share of a layer's absent lookups some prediction read ahead. The sync handshake predicts
    # layers l+1 .. l+depth from layer l's input, so layer i is predicted from up to `depth`
    # layers before it (their union measured); "layers" mode predicts from lag + 1
    # layers before, and a layer that missed is recomputed through the sync handshake, which
    # predicts as sync does. The first layers of a token have nothing that far before them.
    def union_at(a: int) -> float:  # measured, or (estimates) independent guesses
        if a in compute.recall_union:
            return compute.recall_union[a]
        return 1 - float(np.prod([1 - r.get(d, 0.0) for d in range(1, a + 1)]))

    union = np.array([union_at(min(depth, i)) if i else 0.0 for i in range(L)])
    lag1 = distance["layers"]
    lagged = np.where(np.arange(L) >= lag1, r.get(lag1, 0.0), 0.0)

    def shares(mode: str, absent: float) -> tuple[float, float]:
        """(streamed ahead, missed) of a lookup in `mode`. In "layers" mode the share of
        layers recomputed through the sync handshake depends on the misses it leaves: a few
        rounds of fixed point."""
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

    def read_s(n: float) -> float:  # n reads of one layer, issued together
        return n * rb / (read_gbps(machine, n) * 1e9) if n > 0 else 0.0

    layer_rate, miss_rate = 0.0, 1.0  # the decoder's running averages, as a fresh load has them
    modes: dict[str, int] = {}
    total_s = compute_s = misses = ahead_sum = miss_sum = 0.0
    for t in range(gen_tokens):
        absent = 1 - hits[t]
        predicting = miss_rate >= cfg.read_ahead.decode_min_miss
        mode = choose_mode(
            layer_rate,
            predicting,
            cfg.decode_sync_above,
            cfg.decode_token_below,
            cfg.decode_token_while_predicting,
        )
        modes[mode] = modes.get(mode, 0) + 1
        ahead, missed = shares(mode, absent) if predicting else (0.0, absent)
        layer_missed = 1 - (1 - missed) ** k  # a layer with at least one miss
        base = compute.mode_s(mode)
        # the sync handshake's Python; the deferred path's is in fake-stream's own time
        cost = base + (L * compute.handshake_s if mode == "sync" else 0.0)
        if compute.absent_s is not None:  # measured: every absent lookup, missed or not
            cost += L * k * (missed + ahead) * compute.absent_s
        else:
            # streamed-ahead reads are hidden behind the layers between prediction and use
            cost += L * read_s(k * missed)
            cost += L * max(read_s(k * ahead) - distance[mode] * base / L, 0.0)
        if mode == "layers":  # a layer that missed is drained and recomputed synced
            cost += L * layer_missed * (compute.mode_s("sync") / L + compute.handshake_s)
        total_s += cost
        compute_s += base
        misses += L * k * missed
        ahead_sum += ahead
        miss_sum += missed
        for _ in range(L):
            layer_rate += 0.02 * (layer_missed - layer_rate)
            miss_rate += 0.01 * (missed - miss_rate)
    n = max(gen_tokens, 1)
    return {
        "shares": (float(hits.mean()) if gen_tokens else 0.0, ahead_sum / n, miss_sum / n),
        "modes": modes,
        "misses_per_token": misses / n,
        "compute_s": compute_s / n,
        "s_per_token": total_s / n,
    }


# ---- the forecast ---------------------------------------------------------------------


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
    from ..runtime.loader import choose_arena
    from ..stream.memory import MemoryGuardError

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
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        compute_source=compute_source,
    )
    available = machine.available_bytes
    if available is None:
        available = max(machine.memory_bytes - shape.dense_bytes, 0)
    try:
        arena, step = choose_arena(
            shape.args,
            shape.record_bytes,
            shape.n_records,
            shape.dense_bytes,
            arena_gb,
            prefill_step_size,
            machine.memory_bytes,
            available,
            kv_itemsize=shape.kv_itemsize,
        )
    except MemoryGuardError as e:
        f.fits = False
        f.verdict = f"does not fit: {e}"
        return f
    slots = max(1, min(arena // shape.record_bytes, shape.n_records))
    f.arena_bytes, f.prefill_step_size, f.slots = arena, step, slots
    f.resident_share = slots / max(shape.n_records, 1)
    f.verdict = (
        "fits: every expert resident"
        if slots >= shape.n_records
        else f"fits, streaming: the arena holds {100 * f.resident_share:.1f} % of the experts"
    )
    p = pick_probabilities(shape)
    rb = shape.record_bytes
    chunks = prefill_reads(p, slots, prompt_tokens, step)
    per_token = Compute.of(compute).prefill_s
    total_s, bytes_read, ssd_s = 0.0, 0.0, 0.0
    for tokens, reads in chunks:
        ssd = reads * rb / (machine.ssd_gbps * 1e9)
        total_s += max(ssd, per_token * tokens)
        bytes_read += reads * rb
        ssd_s += ssd
    n = len(chunks)
    f.distinct_per_chunk = float(np.sum(-np.expm1(np.log1p(-np.minimum(p, 1 - 1e-12)) * step)))
    f.gb_read_per_chunk = bytes_read / n / 1e9
    f.ssd_floor_s = ssd_s / n
    f.compute_floor_s = per_token * min(step, prompt_tokens)
    f.prefill_tps = prompt_tokens / total_s if total_s else 0.0
    layer_width = max(f.distinct_per_chunk / max(shape.moe_layers, 1), 1)
    if layer_width > slots:
        f.notes.append(
            f"a chunk needs ~{layer_width:.0f} experts a layer, more than the arena's {slots} "
            "slots: layers run in expert-major groups"
        )

    d = decode_forecast(
        shape, machine, Compute.of(compute), p, slots, prompt_tokens, gen_tokens, step
    )
    f.decode_hit_rate, f.decode_streamed_ahead, f.decode_miss_rate = d["shares"]
    f.decode_modes = d["modes"]
    f.decode_misses_per_token = d["misses_per_token"]
    f.decode_compute_ms = d["compute_s"] * 1e3
    absent_s = Compute.of(compute).absent_s
    f.decode_absent_ms = None if absent_s is None else absent_s * 1e3
    f.decode_ms_per_token = d["s_per_token"] * 1e3
    f.decode_tps = 1e3 / f.decode_ms_per_token if f.decode_ms_per_token else 0.0
    if shape.profile is None:
        f.notes.append("no routing profile: expert popularity taken as uniform")
    return f


def plan(
    model: str | Path,
    arena_gb: float | None = None,
    prefill_step_size: int | None = None,
    prompt_tokens: int = 2048,
    gen_tokens: int = 128,
    io_workers: int = 8,
    target_memory_gb: float | None = None,
    target_ssd_gbps: float | None = None,
    target_tflops: float | None = None,
    measure: bool = True,
    measure_tokens: int | None = None,
    probe_seconds: float = 1.0,
    q_bits: int | None = None,
    split_experts: int | None = None,
) -> Forecast:
    """The forecast for `model` on this machine, or on a target machine where
    `target_memory_gb` / `target_ssd_gbps` are given (the other taken from this one)."""
    from ..runtime.loader import default_prefill_step, physical_memory

    shape = model_shape(model, q_bits, split_experts)
    if shape.n_records == 0:
        raise StoreError(f"{model}: no experts (a dense model): nothing streams")
    targeted = target_memory_gb is not None or target_ssd_gbps is not None
    if targeted:
        here = None
        if target_memory_gb is None or target_ssd_gbps is None:
            here = this_machine(shape, io_workers, probe_seconds)
        machine = target_machine(
            target_memory_gb if target_memory_gb is not None else here.memory_bytes / GB,
            target_ssd_gbps if target_ssd_gbps is not None else here.ssd_gbps,
            io_workers,
        )
    else:
        machine = this_machine(shape, io_workers, probe_seconds)
    step = prefill_step_size or default_prefill_step(
        machine.memory_bytes if targeted else physical_memory()
    )
    notes = []
    if targeted:
        tflops = target_tflops or REFERENCE_LAPTOP_TFLOPS
        compute = estimate_compute(shape, tflops, REFERENCE_LAPTOP_MEMORY_GBPS)
        source = f"estimate: {tflops:g} TFLOP/s"
        if target_tflops is None:
            notes.append(
                f"target compute taken as the reference 24 GB laptop's ({tflops:g} TFLOP/s "
                "effective; --target-tflops to change)"
            )
    elif measure and shape.source == "store":
        tokens = measure_tokens or min(step, prompt_tokens)
        fake_arena = min(arena_gb or 1.0, 1.0, shape.expert_bytes / GB)
        compute = measure_compute(Path(shape.path), step, tokens, 8, fake_arena)
        source = f"fake-stream, {tokens} tokens"
    else:
        tflops = target_tflops or _measured_tflops()
        compute = estimate_compute(shape, tflops, _measured_memory_gbps())
        source = f"estimate: {tflops:.3g} TFLOP/s"
        notes.append("compute estimated from FLOPs (no store to time in fake-stream mode)")
    f = forecast(shape, machine, compute, source, arena_gb, step, prompt_tokens, gen_tokens)
    f.notes = notes + f.notes
    return f


def _measured_tflops() -> float:
    """This machine's float32 matmul rate (a short MLX run)."""
    import time

    import mlx.core as mx

    a = mx.random.normal((512, 1024))
    b = mx.random.normal((1024, 1024))
    mx.eval(a @ b)
    t = time.perf_counter()
    for _ in range(4):
        mx.eval(a @ b)
    return 4 * 2 * 512 * 1024 * 1024 / (time.perf_counter() - t) / 1e12


def _measured_memory_gbps() -> float:
    import time

    a = np.ones(1 << 25, dtype=np.float32)
    t = time.perf_counter()
    float(a.sum())
    return a.nbytes / (time.perf_counter() - t) / 1e9


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
