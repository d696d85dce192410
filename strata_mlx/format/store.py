"""The on-disk store: manifest, expert records, dense weights, routing profile.

A store is a directory:

    manifest.json       format version, architecture config, record layout, offsets, checksums
                        (crc32c of every record and of dense.safetensors; stores made before
                        crc32c carry zlib's crc32 of each record and none of the dense file)
    dense.safetensors   every weight that is not an expert (attention, norms, routers, embeddings)
    experts.bin         one record per (MoE layer, expert): gate, up and down with their scales,
                        contiguous and aligned to 4 KiB, so one expert is one read
    profile.json        per-layer expert popularity from a calibration pass
    tokenizer files     copied from the source when it has them
    .verified.json      written at load: the dense file's size and mtime when its checksum last
                        matched, so that it is read again only when it changed

This module owns the layout and its validation (writing a store: writer.py; checksums:
checksums.py). It never computes with weights and never
talks to the arena; readers get byte ranges and layouts from here and nothing else.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from custom_kernels.formats import PROJECTIONS

from .checksums import CHECKSUM, CHECKSUMS, checksum, file_checksum

FORMAT_NAME = "strata-mlx-store"
FORMAT_VERSION = 1
ALIGNMENT = 4096
COMPONENT_ALIGNMENT = 64
MANIFEST = "manifest.json"
DENSE = "dense.safetensors"
EXPERTS = "experts.bin"
PROFILE = "profile.json"
VERIFIED = ".verified.json"


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
    or {"format": "gguf", "type": "IQ2_XS"} or {"format": "mxfp4"} (OCP MXFP4 as GPT-OSS ships
    it: `weight` uint8 [out, in/2], two E2M1 codes a byte, low nibble first; `scales` uint8
    [out, in/32], an E8M0 exponent per 32 weights); every expert of every layer shares one layout.
    Components `{proj}.bias` (float [out]), where present, are added to that projection's
    output. `activation` is None for SwiGLU (silu(gate) * up), or GPT-OSS's clamped variant
    {"name": "swiglu_oai", "alpha": a, "limit": l} (custom_kernels.formats.activation_fn).
    """

    components: list[Component]
    quant: dict[str, dict[str, Any]]
    record_bytes: int
    activation: dict[str, Any] | None = None

    def padded(self, record_bytes: int) -> RecordLayout:
        """The same layout in records of `record_bytes` (every layer's slots are one size)."""
        if record_bytes < self.record_bytes or record_bytes % ALIGNMENT:
            raise ValueError(f"cannot pad a {self.record_bytes}-byte record to {record_bytes}")
        return RecordLayout(self.components, self.quant, record_bytes, self.activation)

    def to_json(self) -> dict[str, Any]:
        j = {"components": [asdict(c) for c in self.components], "quant": self.quant}
        if self.activation is not None:
            j["activation"] = self.activation
        return j

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    @classmethod
    def build(
        cls,
        tensors: dict[str, tuple[str, tuple[int, ...]]],
        quant: dict,
        activation: dict[str, Any] | None = None,
    ) -> RecordLayout:
        """Lay out named tensors (name -> (dtype, shape)) in insertion order."""
        comps, off = [], 0
        for name, (dtype, shape) in tensors.items():
            nbytes = int(np.prod(shape)) * _itemsize(dtype)
            comps.append(Component(name, dtype, list(shape), off, nbytes))
            off = _round_up(off + nbytes, COMPONENT_ALIGNMENT)
        return cls(comps, quant, _round_up(max(off, 1), ALIGNMENT), activation)

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
    checksums: list[list[int]]  # [moe layer position][expert] -> `checksum` of the record
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    # Per MoE layer position, where layers differ (a GGUF's down projection is Q6_K in some
    # layers and Q4_K in others); None: every layer uses `layout`. All share record_bytes.
    layer_layouts: list[RecordLayout] | None = None
    checksum: str = CHECKSUM  # the algorithm of `checksums` and `dense_checksum`
    dense_checksum: int | None = None  # of dense.safetensors; None in stores made before it

    def layout_of(self, layer: int) -> RecordLayout:
        """The record layout of a layer's experts (`layer` is the model's layer index)."""
        if self.layer_layouts is None:
            return self.layout
        return self.layer_layouts[self.layer_position(layer)]

    @property
    def layouts(self) -> list[RecordLayout]:
        return [self.layout] if self.layer_layouts is None else self.layer_layouts

    def record(self, layer: int, expert: int) -> tuple[int, int]:
        """(offset, checksum) of a layer's expert; `layer` is the model's layer index."""
        pos = self.layer_position(layer)
        return self.offsets[pos][expert], self.checksums[pos][expert]

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
                **(
                    {"activation": self.layout.activation}
                    if self.layout.activation is not None
                    else {}
                ),
                "offsets": self.offsets,
                "checksum": self.checksum,
                "checksums": self.checksums,
                **per_layer,
            },
            "dense": DENSE,
            **({"dense_checksum": self.dense_checksum} if self.dense_checksum is not None else {}),
            "profile": PROFILE,
            **({"extra": self.extra} if self.extra else {}),
        }


MAX_MANIFEST_BYTES = 1 << 30  # a 48-layer x 512-expert manifest is ~0.6 MB
MAX_INT = (1 << 63) - 1  # offsets, sizes: what a C off_t / numpy int64 holds
QUANT_FORMATS = ("float", "affine", "gguf", "mxfp4")
AFFINE_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize / gather_qmm accept (bits 0 dies of SIGFPE)
AFFINE_GROUP_SIZES = (32, 64, 128)
COMPONENT_DTYPES = ("float32", "float16", "bfloat16", "uint32", "uint8")


class JsonFields:
    """Typed reads of a parsed JSON file: every failure is a StoreError naming the file and
    the field (e.g. `experts.offsets[3][7]`), never a TypeError from deep inside the runtime."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, msg: str):
        raise StoreError(f"{self.path}: {field}: {msg}")

    def int(self, v: Any, field: str, lo: int = 0, hi: int = MAX_INT) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(field, f"expected an integer, got {_short(v)}")
        if not lo <= v <= hi:
            self.fail(field, f"{v} outside [{lo}, {hi}]")
        return v

    def str(self, v: Any, field: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(v, str):
            self.fail(field, f"expected a string, got {_short(v)}")
        if choices is not None and v not in choices:
            self.fail(field, f"{v!r} is not one of {', '.join(choices)}")
        return v

    def list(self, v: Any, field: str, n: int | None = None) -> list:
        if not isinstance(v, list):
            self.fail(field, f"expected a list, got {_short(v)}")
        if n is not None and len(v) != n:
            self.fail(field, f"{len(v)} entries, expected {n}")
        return v

    def dict(self, v: Any, field: str, keys: tuple[str, ...] = ()) -> dict:
        if not isinstance(v, dict):
            self.fail(field, f"expected an object, got {_short(v)}")
        for k in keys:
            if k not in v:
                self.fail(f"{field}.{k}", "missing")
        return v

    def ints(self, v: Any, field: str, n: int, lo: int = 0, hi: int = MAX_INT) -> list[int]:
        v = self.list(v, field, n)
        for i, x in enumerate(v):
            if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
                self.int(x, f"{field}[{i}]", lo, hi)
        return v


def _short(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 40 else r[:37] + '...'}"


def read_json(path: Path, what: str = "JSON") -> Any:
    """A JSON file's contents, or a one-line StoreError naming it."""
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise StoreError(f"{path}: {path.stat().st_size} bytes; not a {what} file")
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StoreError(f"{path}: unreadable {what} ({msg})") from None


def _not_a_store(path: Path) -> str:
    """Why `path`, no directory, is no store: what it is and, for a model file, the convert
    flag that takes it."""
    if not path.exists():
        return "no such directory (expected a strata-mlx store)"
    if path.suffix.lower() == ".gguf":
        return (
            "a GGUF file, not a strata-mlx store; convert it first: strata-mlx convert "
            f"--gguf-path {path} --mlx-path DIR"
        )
    return "not a directory (expected a strata-mlx store)"


def load_manifest(store: str | Path) -> Manifest:
    """Read and validate a store's manifest against the files beside it: every field's type
    and range, before anything is allocated or computed."""
    store = Path(store)
    path = store / MANIFEST
    if not store.is_dir():
        raise StoreError(f"{store}: {_not_a_store(store)}")
    if not path.is_file():
        raise StoreError(f"{path}: missing (not a strata-mlx store; convert the model first)")
    raw = read_json(path)
    f = JsonFields(path)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise StoreError(f"{path}: not a strata-mlx manifest")
    version = raw.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version != FORMAT_VERSION:
        raise StoreError(f"{path}: store version {version!r}, this build reads {FORMAT_VERSION}")
    f.dict(raw, "manifest", ("model_type", "config", "experts"))
    model_type = f.str(raw["model_type"], "model_type")
    config = f.dict(raw["config"], "config")
    extra = f.dict(raw.get("extra", {}), "extra")
    ex = f.dict(
        raw["experts"],
        "experts",
        ("record_bytes", "num_experts", "moe_layers", "quant", "components", "offsets"),
    )
    # A manifest without `checksum` predates crc32c: zlib's crc32 of each record, under "crc32".
    checksum = f.str(ex.get("checksum", "crc32"), "experts.checksum", CHECKSUMS)
    sums_key = "checksums" if "checksum" in ex else "crc32"
    if sums_key not in ex and "checksums" in ex:  # (a store of today's without its kind)
        f.fail("experts.checksum", "missing")
    f.dict(ex, "experts", (sums_key,))
    dense_checksum = raw.get("dense_checksum")
    if dense_checksum is not None:
        f.int(dense_checksum, "dense_checksum", 0, 0xFFFFFFFF)
    if ex.get("file", EXPERTS) != EXPERTS:
        f.fail("experts.file", f"{_short(ex['file'])}; this build reads {EXPERTS}")
    if ex.get("alignment", ALIGNMENT) != ALIGNMENT:
        f.fail("experts.alignment", f"{_short(ex['alignment'])}; this build reads {ALIGNMENT}")
    rb = f.int(ex["record_bytes"], "experts.record_bytes", ALIGNMENT)
    if rb % ALIGNMENT:
        f.fail("experts.record_bytes", f"{rb} is not a multiple of {ALIGNMENT}")
    num_experts = f.int(ex["num_experts"], "experts.num_experts", 0, 1 << 20)
    moe_layers = f.list(ex["moe_layers"], "experts.moe_layers")
    f.ints(moe_layers, "experts.moe_layers", len(moe_layers), 0, 1 << 20)
    if any(b <= a for a, b in zip(moe_layers, moe_layers[1:])):
        f.fail("experts.moe_layers", "not strictly increasing")
    if moe_layers and not num_experts:
        f.fail("experts.num_experts", "0, but the store has MoE layers")
    n_layers = len(moe_layers)
    layout = _read_layout(f, ex, "experts", rb)
    layer_layouts = None
    if "layouts" in ex or "layer_layout" in ex:
        distinct = [
            _read_layout(f, j, f"experts.layouts[{i}]", rb)
            for i, j in enumerate(f.list(ex.get("layouts"), "experts.layouts"))
        ]
        index = f.ints(ex.get("layer_layout"), "experts.layer_layout", n_layers)
        for i, j in enumerate(index):
            f.int(j, f"experts.layer_layout[{i}]", 0, len(distinct) - 1)
        layer_layouts = [distinct[j] for j in index]
        if layer_layouts and layer_layouts[0] != layout:
            f.fail("experts.layer_layout", "layer 0's layout differs from experts.components")
    offsets = f.list(ex["offsets"], "experts.offsets", n_layers)
    checksums = f.list(ex[sums_key], f"experts.{sums_key}", n_layers)
    for pos in range(n_layers):
        f.ints(offsets[pos], f"experts.offsets[{pos}]", num_experts)
        f.ints(checksums[pos], f"experts.{sums_key}[{pos}]", num_experts, 0, 0xFFFFFFFF)
    m = Manifest(
        model_type=model_type,
        config=config,
        layout=layout,
        moe_layers=list(moe_layers),
        num_experts=num_experts,
        offsets=offsets,
        checksums=checksums,
        version=version,
        extra=extra,
        layer_layouts=layer_layouts,
        checksum=checksum,
        dense_checksum=dense_checksum,
    )
    _validate(m, store)
    return m


def _read_layout(f: JsonFields, j: Any, field: str, record_bytes: int) -> RecordLayout:
    """A record layout (`components` and `quant`) checked for types, ranges and overlaps."""
    j = f.dict(j, field, ("components", "quant"))
    comps = []
    for i, c in enumerate(f.list(j["components"], f"{field}.components")):
        cf = f"{field}.components[{i}]"
        c = f.dict(c, cf, ("name", "dtype", "shape", "offset", "nbytes"))
        unknown = sorted(set(c) - {"name", "dtype", "shape", "offset", "nbytes"})
        if unknown:
            f.fail(cf, f"unknown key {unknown[0]!r}")
        name = f.str(c["name"], f"{cf}.name")
        dtype = f.str(c["dtype"], f"{cf}.dtype", COMPONENT_DTYPES)
        shape = f.list(c["shape"], f"{cf}.shape")
        if not 1 <= len(shape) <= 4:
            f.fail(f"{cf}.shape", f"{len(shape)} dimensions, expected 1 to 4")
        f.ints(shape, f"{cf}.shape", len(shape), 1, record_bytes)
        offset = f.int(c["offset"], f"{cf}.offset", 0, record_bytes)
        nbytes = f.int(c["nbytes"], f"{cf}.nbytes", 1, record_bytes)
        if offset % _itemsize(dtype):
            f.fail(f"{cf}.offset", f"{offset} is not a multiple of the {dtype} item size")
        comps.append(Component(name, dtype, list(shape), offset, nbytes))
    names = [c.name for c in comps]
    if len(set(names)) != len(names):
        f.fail(f"{field}.components", "duplicate component names")
    for a, b in zip(
        sorted(comps, key=lambda c: c.offset), sorted(comps, key=lambda c: c.offset)[1:]
    ):
        if a.offset + a.nbytes > b.offset:
            f.fail(f"{field}.components", f"{a.name} and {b.name} overlap")
    quant = f.dict(j["quant"], f"{field}.quant", PROJECTIONS)
    for p in PROJECTIONS:
        _read_quant(f, quant[p], f"{field}.quant.{p}")
    activation = j.get("activation")
    if activation is not None:
        _read_activation(f, activation, f"{field}.activation")
    return RecordLayout(comps, quant, record_bytes, activation)


ACTIVATIONS = {"swiglu_oai": ("alpha", "limit")}  # name -> its parameters (all numbers > 0)


def _read_activation(f: JsonFields, spec: Any, field: str) -> None:
    spec = f.dict(spec, field, ("name",))
    name = f.str(spec["name"], f"{field}.name", tuple(ACTIVATIONS))
    for key in ACTIVATIONS[name]:
        v = f.dict(spec, field, (key,))[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            f.fail(f"{field}.{key}", f"expected a number > 0, got {_short(v)}")


def _read_quant(f: JsonFields, spec: Any, field: str) -> None:
    spec = f.dict(spec, field, ("format",))
    fmt = f.str(spec["format"], f"{field}.format", QUANT_FORMATS)
    if fmt == "affine":
        f.dict(spec, field, ("bits", "group_size"))
        f.int(spec["bits"], f"{field}.bits", 0)
        if spec["bits"] not in AFFINE_BITS:
            f.fail(f"{field}.bits", f"{spec['bits']} is not one of {AFFINE_BITS}")
        f.int(spec["group_size"], f"{field}.group_size", 0)
        if spec["group_size"] not in AFFINE_GROUP_SIZES:
            f.fail(
                f"{field}.group_size", f"{spec['group_size']} is not one of {AFFINE_GROUP_SIZES}"
            )
    elif fmt == "gguf":
        from .gguf_quants import FORMATS

        f.dict(spec, field, ("type", "in_features"))
        f.str(spec["type"], f"{field}.type", tuple(sorted(FORMATS)))
        block = FORMATS[spec["type"]].block_size
        n = f.int(spec["in_features"], f"{field}.in_features", block, 1 << 24)
        if n % block:
            f.fail(f"{field}.in_features", f"{n} is not a multiple of the block size {block}")


def _validate(m: Manifest, store: Path) -> None:
    """The parts that are checked against each other and against the files."""
    path = store / MANIFEST
    rb = m.layout.record_bytes
    for lay in m.layouts:
        for c in lay.components:
            if c.offset + c.nbytes > rb:
                raise StoreError(
                    f"{path}: component {c.name} [{c.offset}, +{c.nbytes}) outside the record"
                )
            if math.prod(c.shape) * _itemsize(c.dtype) != c.nbytes:
                raise StoreError(
                    f"{path}: component {c.name} shape {c.shape} does not match {c.nbytes} bytes"
                )
    experts_path = store / EXPERTS
    if m.moe_layers and not experts_path.is_file():
        raise StoreError(f"{experts_path}: missing")
    size = experts_path.stat().st_size if experts_path.is_file() else 0
    if rb > max(size, ALIGNMENT):
        raise StoreError(
            f"{path}: experts.record_bytes {rb} is larger than {experts_path} ({size} bytes)"
        )
    for pos, row in enumerate(m.offsets):
        for e, off in enumerate(row):
            if off % ALIGNMENT or off + rb > size:
                raise StoreError(
                    f"{experts_path}: record of layer {m.moe_layers[pos]} expert {e} at {off} "
                    f"(+{rb}) lies outside the file ({size} bytes) or is unaligned; truncated store?"
                )
    if not (store / DENSE).is_file():
        raise StoreError(f"{store / DENSE}: missing")


def load_profile(store: str | Path, m: Manifest) -> np.ndarray | None:
    """Per-layer expert counts [n_moe_layers, num_experts] from calibration, or None."""
    path = Path(store) / PROFILE
    if not path.exists():
        return None
    if not path.is_file():  # (a directory read as "no profile", static read-ahead unranked)
        raise StoreError(f"{path}: not a file")
    f = JsonFields(path)
    raw = f.dict(read_json(path, "profile"), "profile", ("counts",))
    rows = f.list(raw["counts"], "counts", len(m.moe_layers))
    for pos, row in enumerate(rows):
        f.ints(row, f"counts[{pos}]", m.num_experts)
    return np.array(rows, dtype=np.int64).reshape(len(m.moe_layers), m.num_experts)


def write_atomic(path: str | Path, write, tmp_suffix: str = ".tmp") -> None:
    """`write(tmp)` writes the whole file at a temporary path beside `path` (a new name of
    this call's own, ending in `tmp_suffix`: a writer that insists on an extension gets one),
    which then replaces `path` in one rename: a reader sees the old file or the new, never
    half of one; on any failure the temporary file is removed and `path` is left as it was.
    No file of the user's is taken for the temporary one (`<name>.tmp` was, and went).
    A symbolic link's target is replaced, the link kept; a path that is no regular file (a
    device such as /dev/null, a pipe) is refused, never replaced by one. A write that fails
    with an OSError (a full disk, a read-only file system, no permission) or MLX's words for
    a full disk is an OutputError naming `path`: a StoreError (one line for a user) and an
    OSError still (callers that let a cache's write fail go on)."""
    import secrets

    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    if path.exists() and not path.is_file():
        raise OutputError(f"{path}: not a regular file (a device, a pipe); give a file's path")
    # (named, not created: the writer creates it with the process's umask, as it would the
    # file itself; mkstemp's would be 0600)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{tmp_suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        # (MLX's own writers say "[write] Unable to write N bytes to file." for a full disk)
        if isinstance(e, OSError) or "Unable to write" in str(e):
            full = not isinstance(e, OSError) or e.errno in (None, errno.ENOSPC, errno.EDQUOT)
            hint = "; is the disk full?" if full else ""
            raise OutputError(f"{path}: cannot write it ({_reason(e)}){hint}") from e
        raise


class OutputError(StoreError, OSError):
    """An output file write_atomic could not write: a StoreError, and an OSError too."""


def _reason(e: BaseException) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip()


def write_text_atomic(path: str | Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def read_record(
    store: str | Path, m: Manifest, layer: int, expert: int, verify: bool = True
) -> bytes:
    """One record through the page cache (conversion, tests; the runtime reads via the arena)."""
    path = Path(store) / EXPERTS
    off, expected = m.record(layer, expert)
    with open(path, "rb") as f:
        f.seek(off)
        data = f.read(m.layout.record_bytes)
    if len(data) != m.layout.record_bytes:
        raise StoreError(f"{path}: short read of layer {layer} expert {expert} (truncated store?)")
    if verify and checksum(m.checksum, data) != expected:
        raise StoreError(f"{path}: checksum mismatch in layer {layer} expert {expert}")
    return data


def verify_dense(store: str | Path, m: Manifest) -> bool:
    """Check dense.safetensors against the manifest's checksum, once: a stamp beside it
    (.verified.json) records the file's size and mtime when it last matched, and while they
    are unchanged the file is not read again (so corruption that keeps both, bit rot, is
    caught only after the stamp is deleted). Where the store is read-only no stamp can be
    written and the file is checked at every load. Returns whether the file was read (False
    also for a store made before dense checksums, which cannot be checked). A mismatch is a
    StoreError naming the file."""
    if m.dense_checksum is None:
        return False
    store = Path(store)
    path = store / DENSE
    try:
        st = path.stat()
        stamp = {
            "file": DENSE,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "checksum": m.checksum,
            "value": m.dense_checksum,
        }
        try:
            if json.loads((store / VERIFIED).read_text()) == stamp:
                return False
        except (OSError, ValueError):
            pass  # no stamp, or an unreadable one: verify
        value = file_checksum(path, m.checksum)
    except OSError as e:
        raise StoreError(f"{path}: unreadable ({e.strerror or e})") from None
    if value != m.dense_checksum:
        raise StoreError(
            f"{path}: checksum mismatch ({m.checksum} {value:08x}, the manifest records "
            f"{m.dense_checksum:08x}): the file is corrupt or was changed; reconvert the store"
        )
    try:
        write_text_atomic(store / VERIFIED, json.dumps(stamp))
    except OSError:
        pass  # a read-only store: checked again at the next load
    return True
