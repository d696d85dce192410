"""A GGUF file read with gguf-py's GGUFReader: its metadata and tensors, with StoreErrors
that name the file, and the header checked before gguf-py parses it (`check_header`).
Never: converts or writes anything.
"""

from __future__ import annotations

from pathlib import Path

from ...format.store import StoreError

GGUF_PROJ = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
MAX_DIM = 1 << 24  # any width, head count or layer count read from a header
MAX_LAYERS = 1 << 12


# ---- reading ------------------------------------------------------------------------------


class Gguf:
    """A GGUF file's metadata and tensors, with StoreErrors that name the file."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        if not path.is_file():
            raise StoreError(f"{path}: no such file")
        check_header(path)
        try:
            self.reader = GGUFReader(str(path))
        except MemoryError:
            raise  # a header that slipped past check_header: a bug of ours, not the file's
        except Exception as e:  # gguf-py raises ValueError/struct.error/IndexError
            raise StoreError(
                f"{path}: not a readable GGUF file ({type(e).__name__}: {e})"
            ) from None
        self.path = path
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.str("general.architecture")
        if self.arch is None:
            raise StoreError(f"{path}: GGUF metadata has no general.architecture")

    def get(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except (ValueError, IndexError) as e:  # bad UTF-8, a value cut short
            raise StoreError(f"{self.path}: metadata {key}: unreadable ({e})") from None

    def need(self, key: str):
        v = self.get(key)
        if v is None:
            raise StoreError(f"{self.path}: GGUF metadata lacks {key}")
        return v

    def fail(self, key: str, msg: str):
        raise StoreError(f"{self.path}: metadata {key}: {msg}")

    def int(self, key: str, default: int | None = None, lo: int = 1, hi: int = MAX_DIM) -> int:
        """An integer field in [lo, hi] (needed when `default` is None)."""
        v = self.need(key) if default is None else self.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(key, f"expected an integer, got {type(v).__name__} {v!r:.40}")
        if not lo <= v <= hi:
            self.fail(key, f"{v} outside [{lo}, {hi}]")
        return v

    def float(self, key: str, default: float | None = None) -> float:
        """A finite number > 0 (epsilons, rope bases and factors)."""
        v = self.need(key) if default is None else self.get(key, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
            self.fail(key, f"expected a number > 0, got {type(v).__name__} {v!r:.40}")
        return float(v)

    def str(self, key: str, default: str | None = None) -> str | None:
        v = self.get(key, default)
        if v is not None and not isinstance(v, str):
            self.fail(key, f"expected a string, got {type(v).__name__}")
        return v

    def tensor(self, name: str, shape: tuple[int, ...] | None = None):
        """Tensor `name`; with `shape` ([rows, cols] order, as numpy), checked against it."""
        t = self.tensors.get(name)
        if t is None:
            raise StoreError(f"{self.path}: tensor {name} not found")
        if shape is not None:
            have = tuple(int(x) for x in reversed(t.shape))
            # ggml drops a tensor's trailing size-1 dims (ggml_n_dims) when llama-quantize
            # writes it: Qwen3-Next's [1, D] shared-expert gate comes back as [D].
            if _outer_ones_dropped(have) != _outer_ones_dropped(tuple(shape)):
                raise StoreError(
                    f"{self.path}: tensor {name} is {list(have)}, the metadata implies {list(shape)}"
                )
        return t


# GGUF value types (gguf-py's GGUFValueType): scalar sizes in bytes, then STRING and ARRAY.
def _outer_ones_dropped(shape: tuple[int, ...]) -> tuple[int, ...]:
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def check_header(path: Path) -> None:
    """Walk a GGUF header (metadata and tensor infos) checking every count and length against
    the bytes left in the file, before gguf-py parses it: gguf-py reads an array item by item
    and, past the end of the file, gets empty items that do not advance, so a flipped array
    length of 2^64 - 1 used to append empty items until the machine ran out of memory."""
    import mmap
    import struct

    size = path.stat().st_size
    if size < 24:
        raise StoreError(f"{path}: not a GGUF file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise StoreError(f"{path}: not a GGUF file (no GGUF magic)")
        order = ">" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF == 0 else "<"
        pos = 8

        def need(n: int, what: str) -> None:
            if n < 0 or n > size - pos:
                raise StoreError(
                    f"{path}: {what} needs {n} bytes at offset {pos}, the file has "
                    f"{size - pos} left (corrupt or truncated header)"
                )

        def read(fmt: str, what: str) -> int:
            nonlocal pos
            n = struct.calcsize(fmt)
            need(n, what)
            (v,) = struct.unpack_from(order + fmt, m, pos)
            pos += n
            return v

        def skip(n: int, what: str) -> None:
            nonlocal pos
            need(n, what)
            pos += n

        def value(t: int, what: str, depth: int = 0) -> None:
            if t in _SCALAR_BYTES:
                skip(_SCALAR_BYTES[t], what)
            elif t == _STRING:
                skip(read("Q", what), what)
            elif t == _ARRAY and depth < 2:
                item, n = read("I", what), read("Q", what)
                if item in _SCALAR_BYTES:
                    skip(n * _SCALAR_BYTES[item], f"{what} ({n} items)")
                    return
                need(n * (8 if item == _STRING else 12), f"{what} ({n} items)")
                for _ in range(n):
                    value(item, what, depth + 1)
            else:
                raise StoreError(f"{path}: {what}: unknown GGUF value type {t}")

        n_tensors, n_kv = read("Q", "tensor count"), read("Q", "metadata count")
        need(n_kv * 13 + n_tensors * 24, f"{n_kv} metadata fields and {n_tensors} tensor infos")
        for i in range(n_kv):
            key_len = read("Q", f"metadata field {i}")
            skip(key_len, f"metadata field {i}'s key")
            key = repr(bytes(m[pos - key_len : pos][:40]).decode("utf-8", "replace"))
            value(read("I", f"metadata {key}"), f"metadata {key}")
        for i in range(n_tensors):
            skip(read("Q", f"tensor info {i}"), f"tensor info {i}'s name")
            n_dims = read("I", f"tensor info {i}")
            if n_dims > 4:  # GGML_MAX_DIMS
                raise StoreError(f"{path}: tensor info {i}: {n_dims} dimensions")
            skip(8 * n_dims + 4 + 8, f"tensor info {i}")


def bool_field(g: Gguf, key: str, default: bool = False) -> bool:
    v = g.get(key, default)
    if not isinstance(v, bool):
        g.fail(key, f"expected true or false, got {type(v).__name__}")
    return v
