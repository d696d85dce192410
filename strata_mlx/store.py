"""The on-disk store: manifest, expert records, dense weights, routing profile.

A store is a directory:

    manifest.json       format version, architecture config, record layout, offsets, checksums
    dense.safetensors   every weight that is not an expert (attention, norms, routers, embeddings)
    experts.bin         one record per (MoE layer, expert): gate, up and down with their scales,
                        contiguous and aligned to 4 KiB, so one expert is one read
    profile.json        per-layer expert popularity from a calibration pass
    tokenizer files     copied from the source when it has them

This module owns the layout and its validation. It never computes with weights and never
talks to the arena; readers get byte ranges and layouts from here and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_NAME = "strata-mlx-store"
FORMAT_VERSION = 1
ALIGNMENT = 4096
COMPONENT_ALIGNMENT = 64
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MANIFEST = "manifest.json"
DENSE = "dense.safetensors"
EXPERTS = "experts.bin"
PROFILE = "profile.json"


class StoreError(Exception):
    """A store (or a source file) is missing, truncated, inconsistent or corrupt.

    The message is one line and names the file.
    """


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class Component:
    """One tensor inside an expert record: bytes [offset, offset + nbytes) of the record."""

    name: str  # e.g. "gate_proj.weight", "gate_proj.scales"
    dtype: str  # numpy dtype name: float32, float16, bfloat16, uint32, uint8
    shape: list[int]
    offset: int
    nbytes: int


@dataclass
class RecordLayout:
    """How one expert record is laid out, and how each projection is quantized.

    `quant[proj]` is {"format": "float"} or {"format": "affine", "bits": b, "group_size": g}
    or {"format": "gguf", "type": "IQ2_XS"}; every expert of every layer shares one layout.
    """

    components: list[Component]
    quant: dict[str, dict[str, Any]]
    record_bytes: int

    def padded(self, record_bytes: int) -> RecordLayout:
        """The same layout in records of `record_bytes` (every layer's slots are one size)."""
        if record_bytes < self.record_bytes or record_bytes % ALIGNMENT:
            raise ValueError(f"cannot pad a {self.record_bytes}-byte record to {record_bytes}")
        return RecordLayout(self.components, self.quant, record_bytes)

    def to_json(self) -> dict[str, Any]:
        return {"components": [asdict(c) for c in self.components], "quant": self.quant}

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    @classmethod
    def build(cls, tensors: dict[str, tuple[str, tuple[int, ...]]], quant: dict) -> RecordLayout:
        """Lay out named tensors (name -> (dtype, shape)) in insertion order."""
        comps, off = [], 0
        for name, (dtype, shape) in tensors.items():
            nbytes = int(np.prod(shape)) * _itemsize(dtype)
            comps.append(Component(name, dtype, list(shape), off, nbytes))
            off = _round_up(off + nbytes, COMPONENT_ALIGNMENT)
        return cls(comps, quant, _round_up(max(off, 1), ALIGNMENT))

    def pack(self, arrays: dict[str, np.ndarray]) -> bytes:
        """Serialize one expert's tensors (numpy; bfloat16 as uint16 bits) into a record."""
        buf = bytearray(self.record_bytes)
        for c in self.components:
            a = np.ascontiguousarray(arrays[c.name])
            raw = a.view(np.uint8).reshape(-1)
            if raw.size != c.nbytes or list(a.shape) != c.shape:
                raise ValueError(f"expert tensor {c.name}: shape {a.shape}, layout wants {c.shape}")
            buf[c.offset : c.offset + c.nbytes] = raw.tobytes()
        return bytes(buf)


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


@dataclass
class Manifest:
    model_type: str
    config: dict[str, Any]
    layout: RecordLayout
    moe_layers: list[int]
    num_experts: int
    offsets: list[list[int]]  # [moe layer position][expert] -> byte offset in experts.bin
    crc32: list[list[int]]
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    # Per MoE layer position, where layers differ (a GGUF's down projection is Q6_K in some
    # layers and Q4_K in others); None: every layer uses `layout`. All share record_bytes.
    layer_layouts: list[RecordLayout] | None = None

    def layout_of(self, layer: int) -> RecordLayout:
        """The record layout of a layer's experts (`layer` is the model's layer index)."""
        if self.layer_layouts is None:
            return self.layout
        return self.layer_layouts[self.layer_position(layer)]

    @property
    def layouts(self) -> list[RecordLayout]:
        return [self.layout] if self.layer_layouts is None else self.layer_layouts

    def record(self, layer: int, expert: int) -> tuple[int, int]:
        """(offset, crc32) of a layer's expert; `layer` is the model's layer index."""
        pos = self.layer_position(layer)
        return self.offsets[pos][expert], self.crc32[pos][expert]

    def layer_position(self, layer: int) -> int:
        try:
            return self._positions[layer]
        except AttributeError:
            self._positions = {l: i for i, l in enumerate(self.moe_layers)}
            return self._positions[layer]

    @property
    def expert_bytes(self) -> int:
        return self.layout.record_bytes * self.num_experts * len(self.moe_layers)

    def to_json(self) -> dict[str, Any]:
        per_layer = {}
        if self.layer_layouts is not None:
            distinct: list[dict] = []
            index = []
            for lay in self.layer_layouts:
                j = lay.to_json()
                if j not in distinct:
                    distinct.append(j)
                index.append(distinct.index(j))
            per_layer = {"layouts": distinct, "layer_layout": index}
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "model_type": self.model_type,
            "config": self.config,
            "experts": {
                "file": EXPERTS,
                "alignment": ALIGNMENT,
                "record_bytes": self.layout.record_bytes,
                "num_experts": self.num_experts,
                "moe_layers": self.moe_layers,
                "quant": self.layout.quant,
                "components": [asdict(c) for c in self.layout.components],
                "offsets": self.offsets,
                "crc32": self.crc32,
                **per_layer,
            },
            "dense": DENSE,
            "profile": PROFILE,
            **({"extra": self.extra} if self.extra else {}),
        }


def load_manifest(store: str | Path) -> Manifest:
    """Read and validate a store's manifest against the files beside it."""
    store = Path(store)
    path = store / MANIFEST
    if not store.is_dir():
        raise StoreError(f"{store}: not a directory (expected a strata-mlx store)")
    if not path.is_file():
        raise StoreError(f"{path}: missing (not a strata-mlx store; convert the model first)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: unreadable JSON ({e})") from None
    if raw.get("format") != FORMAT_NAME:
        raise StoreError(f"{path}: not a strata-mlx manifest")
    if raw.get("version") != FORMAT_VERSION:
        raise StoreError(
            f"{path}: store version {raw.get('version')}, this build reads {FORMAT_VERSION}"
        )
    try:
        ex = raw["experts"]
        comps = [Component(**c) for c in ex["components"]]
        rb = int(ex["record_bytes"])
        layout = RecordLayout(comps, ex["quant"], rb)
        layer_layouts = None
        if "layouts" in ex:
            distinct = [
                RecordLayout([Component(**c) for c in j["components"]], j["quant"], rb)
                for j in ex["layouts"]
            ]
            layer_layouts = [distinct[int(i)] for i in ex["layer_layout"]]
        m = Manifest(
            model_type=raw["model_type"],
            config=raw["config"],
            layout=layout,
            moe_layers=[int(x) for x in ex["moe_layers"]],
            num_experts=int(ex["num_experts"]),
            offsets=ex["offsets"],
            crc32=ex["crc32"],
            version=raw["version"],
            extra=raw.get("extra", {}),
            layer_layouts=layer_layouts,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None
    _validate(m, store)
    return m


def _validate(m: Manifest, store: Path) -> None:
    path = store / MANIFEST
    rb = m.layout.record_bytes
    if rb <= 0 or rb % ALIGNMENT:
        raise StoreError(f"{path}: record_bytes {rb} is not a positive multiple of {ALIGNMENT}")
    n_layers = len(m.moe_layers)
    if m.layer_layouts is not None and len(m.layer_layouts) != n_layers:
        raise StoreError(f"{path}: layer_layout covers {len(m.layer_layouts)} of {n_layers} layers")
    for lay in m.layouts:
        for c in lay.components:
            if c.offset < 0 or c.offset + c.nbytes > rb:
                raise StoreError(
                    f"{path}: component {c.name} [{c.offset}, +{c.nbytes}) outside the record"
                )
            if int(np.prod(c.shape)) * _itemsize(c.dtype) != c.nbytes:
                raise StoreError(
                    f"{path}: component {c.name} shape {c.shape} does not match {c.nbytes} bytes"
                )
    if len(m.offsets) != n_layers or len(m.crc32) != n_layers:
        raise StoreError(f"{path}: offsets/crc32 tables do not cover {n_layers} MoE layers")
    experts_path = store / EXPERTS
    if n_layers and not experts_path.is_file():
        raise StoreError(f"{experts_path}: missing")
    size = experts_path.stat().st_size if n_layers else 0
    for pos, row in enumerate(m.offsets):
        if len(row) != m.num_experts or len(m.crc32[pos]) != m.num_experts:
            raise StoreError(
                f"{path}: layer {m.moe_layers[pos]} lists {len(row)} experts, expected {m.num_experts}"
            )
        for e, off in enumerate(row):
            if off % ALIGNMENT or off < 0 or off + rb > size:
                raise StoreError(
                    f"{experts_path}: record of layer {m.moe_layers[pos]} expert {e} at {off} "
                    f"(+{rb}) lies outside the file ({size} bytes) or is unaligned; truncated store?"
                )
    if not (store / DENSE).is_file():
        raise StoreError(f"{store / DENSE}: missing")


def load_profile(store: str | Path, m: Manifest) -> np.ndarray | None:
    """Per-layer expert counts [n_moe_layers, num_experts] from calibration, or None."""
    path = Path(store) / PROFILE
    if not path.is_file():
        return None
    try:
        counts = np.asarray(json.loads(path.read_text())["counts"], dtype=np.int64)
    except (OSError, ValueError, KeyError) as e:
        raise StoreError(f"{path}: unreadable profile ({e})") from None
    if counts.shape != (len(m.moe_layers), m.num_experts):
        raise StoreError(
            f"{path}: counts shape {counts.shape}, expected {(len(m.moe_layers), m.num_experts)}"
        )
    return counts


def save_profile(store: str | Path, counts: np.ndarray, tokens: int, source: str) -> None:
    data = {
        "counts": np.asarray(counts).astype(int).tolist(),
        "tokens": int(tokens),
        "source": source,
    }
    _atomic_write_text(Path(store) / PROFILE, json.dumps(data))


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_record(
    store: str | Path, m: Manifest, layer: int, expert: int, verify: bool = True
) -> bytes:
    """One record through the page cache (conversion, tests; the runtime reads via the arena)."""
    path = Path(store) / EXPERTS
    off, crc = m.record(layer, expert)
    with open(path, "rb") as f:
        f.seek(off)
        data = f.read(m.layout.record_bytes)
    if len(data) != m.layout.record_bytes:
        raise StoreError(f"{path}: short read of layer {layer} expert {expert} (truncated store?)")
    if verify and zlib.crc32(data) != crc:
        raise StoreError(f"{path}: checksum mismatch in layer {layer} expert {expert}")
    return data


class StoreWriter:
    """Writes a store into a temporary directory beside `out`; `commit()` renames it into place.

    Nothing is left at `out` unless the whole store was written: a failed conversion removes
    the temporary directory.
    """

    def __init__(
        self,
        out: str | Path,
        model_type: str,
        config: dict,
        layout: RecordLayout,
        moe_layers: list[int],
        num_experts: int,
        layer_layouts: list[RecordLayout] | None = None,
    ):
        """`layer_layouts` (one per MoE layer, all of `layout.record_bytes`) where layers'
        formats differ; `layout` is then the first layer's."""
        if layer_layouts is not None and any(
            lay.record_bytes != layout.record_bytes for lay in layer_layouts
        ):
            raise ValueError("every layer's records must be the same size (pad them)")
        self.out = Path(out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        self.manifest = Manifest(
            model_type,
            config,
            layout,
            list(moe_layers),
            num_experts,
            offsets=[[-1] * num_experts for _ in moe_layers],
            crc32=[[0] * num_experts for _ in moe_layers],
            layer_layouts=layer_layouts,
        )
        self._f = open(self.tmp / EXPERTS, "wb")
        self._pos = 0

    @property
    def path(self) -> Path:
        """The temporary directory (write tokenizer files and the profile here)."""
        return self.tmp

    def add_expert(self, layer: int, expert: int, arrays: dict[str, np.ndarray]) -> None:
        rec = self.manifest.layout_of(layer).pack(arrays)
        pos = self.manifest.layer_position(layer)
        self.manifest.offsets[pos][expert] = self._pos
        self.manifest.crc32[pos][expert] = zlib.crc32(rec)
        self._f.write(rec)
        self._pos += len(rec)

    def add_record(self, layer: int, expert: int, record: bytes) -> None:
        """A record already packed (e.g. GGUF blocks repacked without requantizing)."""
        if len(record) != self.manifest.layout.record_bytes:
            raise ValueError("record size does not match the layout")
        pos = self.manifest.layer_position(layer)
        self.manifest.offsets[pos][expert] = self._pos
        self.manifest.crc32[pos][expert] = zlib.crc32(record)
        self._f.write(record)
        self._pos += len(record)

    def write_dense(self, weights: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
        import mlx.core as mx

        mx.save_safetensors(str(self.tmp / DENSE), weights, metadata=metadata or {"format": "mlx"})

    def finalize(self) -> Path:
        """Write the manifest into the temporary directory (loadable there, not yet in place)."""
        self._f.close()
        missing = [
            (self.manifest.moe_layers[p], e)
            for p, row in enumerate(self.manifest.offsets)
            for e, off in enumerate(row)
            if off < 0
        ]
        if missing:
            raise ValueError(
                f"store incomplete: {len(missing)} expert records never written, e.g. {missing[0]}"
            )
        _atomic_write_text(self.tmp / MANIFEST, json.dumps(self.manifest.to_json()))
        return self.tmp

    def commit(self) -> Path:
        """Move the finished store into place."""
        if not (self.tmp / MANIFEST).is_file():
            self.finalize()
        os.chmod(self.tmp, 0o755)  # mkdtemp made it private
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        try:
            self._f.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
