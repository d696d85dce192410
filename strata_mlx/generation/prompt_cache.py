"""Prompt caches: the KV and recurrent state a generation runs on, made, quantized, saved,
loaded and kept for reuse.

Owns which cache objects a generation uses (`make_prompt_cache`: the family's own, rotating
with `--max-kv-size`, quantized from `--quantized-kv-start` on with `--kv-bits`, as mlx-lm's
flags), the file a saved cache lives in, and the server's in-memory caches of the last
conversations (`PromptCacheLRU`). The cache classes themselves are in models/base.py.
Never runs the model (strata_mlx.generation.generate does) and never reads expert records.

A saved cache is one .safetensors file: per layer `<layer>.<name>` arrays (a layer's cache
class says which: `keys`, `values`, `keys.codes`, `0`, ...) and, as its string metadata,
`format` ("strata-mlx prompt cache"), `version`, `layers` (JSON: per layer its class and
integers: offset, ring position, quantization), `tokens` (JSON: the token ids the state
covers), `store` (the store's path when saved), `store_id` (sha256 of its manifest.json:
the model's identity), `model_type`, `experts_per_token`, `chat_template_config` and
`checksum` ("crc32c:<8 hex digits>" over every array's name, dtype, shape and bytes, in name
order, then the other metadata as sorted JSON).

Loading checks, before any state is used: the checksum, every metadata field's type and
range, each layer's arrays (names, dtypes, shapes against the layer's offset, quantization
and ring position), and with a model, that each layer's state fits it (its kind of cache, and
one throwaway step of the layer's attention over a copy of the state). A file failing any of
them is a PromptCacheError: one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..config import OptionError, check_choice, check_int
from ..format.store import write_atomic
from ..models.base import (
    CACHE_TYPES,
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

FORMAT = "strata-mlx prompt cache"
VERSION = 2  # 2: `checksum` of the payload; version 1 files had none and are refused
CHECKSUM = "crc32c"  # as the store's records: an instruction on every CPU we target
MAX_POSITIONS = (1 << 31) - 1  # MLX indexes with 32-bit integers
MAX_SLOTS = 64  # an ArraysCache's slots (conv window and recurrent state: 2 today)
KEEP = 4  # positions a rotating cache never drops (mlx-lm's keep for --max-kv-size)
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_QUANTIZED_KV_START = 5000  # mlx-lm's


class PromptCacheError(ValueError):
    """A prompt cache file that cannot be used: one line naming the file."""


@dataclass
class KVOptions:
    """The KV cache's shape for a generation (mlx-lm's flags of the same names)."""

    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START

    def check(self, cli: bool = False) -> None:
        if self.max_kv_size is not None:
            check_int("max_kv_size", self.max_kv_size, KEEP + 1, cli=cli)
        if self.kv_bits is not None:
            check_choice("kv_bits", self.kv_bits, KV_BITS, cli=cli)
        check_choice("kv_group_size", self.kv_group_size, KV_GROUP_SIZES, cli=cli)
        check_int("quantized_kv_start", self.quantized_kv_start, 0, cli=cli)
        if self.max_kv_size is not None and self.kv_bits is not None:
            flags = ("--max-kv-size", "--kv-bits") if cli else ("max_kv_size", "kv_bits")
            raise OptionError(f"{flags[0]} and {flags[1]}: a rotating cache is not quantized")


def make_prompt_cache(model, kv: KVOptions | None = None, cli: bool = False) -> list:
    """The model's cache for a new generation: its family's (`make_cache`), or with
    `max_kv_size` a RotatingKVCache per layer. A family whose state cannot live in the asked
    form is refused in one line."""
    kv = kv or KVOptions()
    kv.check(cli)
    cache = model.make_cache()
    family = model.args.model_type
    plain = getattr(model, "plain_kv_only", None)  # why the family takes no other cache
    if plain and (kv.max_kv_size is not None or kv.kv_bits is not None):
        name = "max_kv_size" if kv.max_kv_size is not None else "kv_bits"
        flag = "--" + name.replace("_", "-") if cli else name
        raise OptionError(
            f"{flag}: {family} keeps a plain KV cache, neither rotating nor quantized ({plain})"
        )
    if kv.kv_bits is not None and not getattr(model, "quantized_kv", True):
        flag = "--kv-bits" if cli else "kv_bits"
        raise OptionError(f"{flag}: {family}'s latent attention cache cannot be quantized")
    if kv.max_kv_size is None:
        return cache
    if any(not isinstance(c, KVCache) for c in cache):
        flag = "--max-kv-size" if cli else "max_kv_size"
        raise OptionError(
            f"{flag}: {family} keeps recurrent state over the whole context in its "
            "linear-attention layers; only attention-only families take a rotating KV cache"
        )
    return [RotatingKVCache(kv.max_kv_size, keep=KEEP) for _ in cache]


def quantize_due(cache: list, kv: KVOptions | None) -> bool:
    """Would `maybe_quantize` convert a layer now?"""
    if kv is None or kv.kv_bits is None:
        return False
    return any(type(c) is KVCache and c.offset >= kv.quantized_kv_start for c in cache)


def maybe_quantize(cache: list, kv: KVOptions | None) -> None:
    """Replace (in place) each KVCache holding `quantized_kv_start` positions or more by its
    quantized form, as mlx-lm's maybe_quantize_kv_cache does after every model call."""
    if not quantize_due(cache, kv):
        return
    for i, c in enumerate(cache):
        if type(c) is KVCache and c.offset >= kv.quantized_kv_start:
            if c.keys is not None and c.keys.shape[-1] % kv.kv_group_size:
                raise OptionError(
                    f"kv_group_size {kv.kv_group_size}: does not divide the head dimension "
                    f"{c.keys.shape[-1]}"
                )
            cache[i] = c.to_quantized(kv.kv_group_size, kv.kv_bits)


# ---- identity ---------------------------------------------------------------------------------


def store_id(path: str | Path) -> str:
    """sha256 of the store's manifest.json: its config, layout and every record's checksum."""
    return hashlib.sha256(Path(path, "manifest.json").read_bytes()).hexdigest()


def experts_per_token(model) -> list[int]:
    """The experts per token the MoE blocks route to (--experts-per-token changes the model)."""
    ks = {getattr(b, "top_k", None) for b in model.moe_blocks().values()}
    return sorted(k for k in ks if k is not None)


def identity(model) -> dict[str, Any]:
    path = getattr(model, "store_path", None)
    return {
        "store": str(path) if path is not None else "",
        "store_id": store_id(path) if path is not None else "",
        "model_type": model.args.model_type,
        "experts_per_token": experts_per_token(model),
    }


# ---- the file ---------------------------------------------------------------------------------


def save_prompt_cache(
    path: str | Path, cache: list, model, tokens: list[int], extra: dict[str, str] | None = None
) -> None:
    """Write `cache` (covering `tokens`) to `path`: a temporary file, then renamed."""
    path = Path(path)
    arrays: dict[str, mx.array] = {}
    layers = []
    for i, c in enumerate(cache):
        a, meta = c.to_saved()
        arrays.update({f"{i}.{k}": v for k, v in a.items()})
        layers.append({"type": type(c).__name__, **meta})
    ident = identity(model)
    metadata = {
        "format": FORMAT,
        "version": str(VERSION),
        "layers": json.dumps(layers),
        "tokens": json.dumps(list(tokens)),
        "store": ident["store"],
        "store_id": ident["store_id"],
        "model_type": ident["model_type"],
        "experts_per_token": json.dumps(ident["experts_per_token"]),
        **(extra or {}),
    }
    metadata["checksum"] = payload_checksum(arrays, metadata)
    # mx.save_safetensors adds ".safetensors" to a name without it
    write_atomic(path, lambda tmp: mx.save_safetensors(str(tmp), arrays, metadata),
                 tmp_suffix=".tmp.safetensors")  # fmt: skip


def load_prompt_cache(path: str | Path, model=None) -> tuple[list, list[int], dict[str, str]]:
    """(cache, the tokens it covers, its metadata) from a file `save_prompt_cache` wrote;
    with `model`, refused unless it was made by this model (store and experts per token)."""
    path = Path(path)
    if path.is_dir():
        raise PromptCacheError(f"{path}: is a directory; name a prompt cache file")
    if not path.is_file():
        raise PromptCacheError(f"{path}: no such prompt cache file")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # mlx words its own errors; the first line says enough
        raise PromptCacheError(f"{path}: not a readable safetensors file ({_first(e)})") from None
    if meta.get("format") != FORMAT:
        raise PromptCacheError(
            f"{path}: not a strata-mlx prompt cache (no format {FORMAT!r} in its metadata; "
            "write one with strata-mlx cache-prompt)"
        )
    if meta.get("version") == "1":
        raise PromptCacheError(
            f"{path}: made before prompt caches carried a checksum; re-create it with "
            "strata-mlx cache-prompt"
        )
    if meta.get("version") != str(VERSION):
        raise PromptCacheError(f"{path}: prompt cache version {_brief(meta.get('version'))}, "
                               f"this build reads {VERSION}")  # fmt: skip
    if meta.get("checksum") != payload_checksum(arrays, meta):
        raise PromptCacheError(
            f"{path}: checksum mismatch (the file is damaged; re-create it with strata-mlx "
            "cache-prompt)"
            if isinstance(meta.get("checksum"), str) and meta["checksum"].startswith(CHECKSUM)
            else f"{path}: no {CHECKSUM} checksum in its metadata"
        )
    layers, tokens = _check_metadata(path, meta)
    if model is not None:
        _check_belongs(path, meta, layers, tokens, model)
    per_layer: list[dict[str, mx.array]] = [{} for _ in layers]
    for name, a in arrays.items():
        layer, _, key = name.partition(".")
        if not (layer.isdigit() and layer.isascii()) or int(layer) >= len(layers):
            raise PromptCacheError(f"{path}: tensor {_brief(name)} names no layer of the cache")
        per_layer[int(layer)][key] = a
    cache = []
    for i, (m, a) in enumerate(zip(layers, per_layer)):
        _check_layer(f"{path}: layer {i} ({m['type']})", m, a)
        c = CACHE_TYPES[m["type"]].from_saved(a, m)
        if c.offset != len(tokens):
            raise PromptCacheError(
                f"{path}: layer {i} holds {c.offset} positions, the file covers {len(tokens)} tokens"
            )
        cache.append(c)
    if model is not None:
        _check_fits(path, cache, model)
    return cache, tokens, meta


def payload_checksum(arrays: dict[str, mx.array], metadata: dict[str, str]) -> str:
    """What a saved prompt cache's `checksum` says: crc32c of every array (its name, dtype,
    shape and bytes, in name order), then of the metadata but `checksum` as sorted JSON."""
    from ..format.checksums import checksum

    value = 0
    for name in sorted(arrays):
        a = arrays[name]
        head = json.dumps([name, str(a.dtype), list(a.shape)]).encode()
        value = checksum(CHECKSUM, head, value)
        value = _checksum_array(a, value)
    rest = {k: v for k, v in metadata.items() if k != "checksum"}
    value = checksum(CHECKSUM, json.dumps(rest, sort_keys=True).encode(), value)
    return f"{CHECKSUM}:{value:08x}"


def _checksum_array(a: mx.array, value: int) -> int:
    """crc32c of the array's bytes in row-major order (as safetensors stores them), from its
    own buffer where it is contiguous (no copy: ~10 GB/s against ~2 with one), else from a
    copy (to_saved's keys[..., :offset, :] are slices)."""
    from ..format.checksums import checksum

    mx.eval(a)
    try:
        return checksum(CHECKSUM, memoryview(a), value)
    except BufferError:
        return checksum(CHECKSUM, np.array(a.reshape(-1).view(mx.uint8)), value)


# Per cache type: the integer fields of its `layers` entry and the arrays it saves (an
# ArraysCache saves its filled slots, named by their index).
LAYER_FIELDS = {
    "KVCache": ("offset",),
    "QuantizedKVCache": ("offset", "group_size", "bits"),
    "RotatingKVCache": ("offset", "keep", "max_size", "idx"),
    "ArraysCache": ("offset", "size"),
}
QUANTIZED_PARTS = ("codes", "scales", "biases")
FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def _check_metadata(path: Path, meta: dict) -> tuple[list[dict], list[int]]:
    """`layers` and `tokens` parsed and typed: a list of objects naming a known cache type
    with its integer fields in range, and a list of integer token ids."""
    try:
        layers = json.loads(meta["layers"])
        tokens = json.loads(meta["tokens"])
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise PromptCacheError(f"{path}: bad metadata ({_first(e)})") from None
    if not (isinstance(tokens, list) and all(_is_int(t) for t in tokens)):
        raise PromptCacheError(f"{path}: bad metadata (tokens is not a list of integers)")
    if not isinstance(layers, list) or not layers:
        raise PromptCacheError(f"{path}: bad metadata (layers is not a list of layers)")
    for i, m in enumerate(layers):
        kind = m.get("type") if isinstance(m, dict) else None
        if not isinstance(kind, str) or kind not in LAYER_FIELDS:
            raise PromptCacheError(f"{path}: layer {i}: unknown cache type {_brief(m)}")
        for name in LAYER_FIELDS[kind]:
            v = m.get(name)
            if not (_is_int(v) and 0 <= v <= MAX_POSITIONS):
                raise PromptCacheError(
                    f"{path}: layer {i} ({kind}): {name} {_brief(v)}: expected an integer in "
                    f"[0, {MAX_POSITIONS}]"
                )
        where = f"{path}: layer {i} ({kind})"
        if kind == "QuantizedKVCache" and m["bits"] not in KV_BITS:
            raise PromptCacheError(f"{where}: bits {m['bits']}: one of {KV_BITS}")
        if kind == "QuantizedKVCache" and m["group_size"] not in KV_GROUP_SIZES:
            raise PromptCacheError(
                f"{where}: group_size {m['group_size']}: one of {KV_GROUP_SIZES}"
            )
        if kind == "RotatingKVCache" and not m["keep"] < m["max_size"]:
            raise PromptCacheError(
                f"{where}: keep {m['keep']} is not below max_size {m['max_size']}"
            )
        if kind == "ArraysCache" and not 1 <= m["size"] <= MAX_SLOTS:
            raise PromptCacheError(f"{where}: size {m['size']} outside [1, {MAX_SLOTS}]")
    return layers, tokens


def _check_layer(where: str, m: dict, a: dict[str, mx.array]) -> None:
    """A layer's arrays against its `layers` entry `m` (types already checked): the names
    its cache type saves, float states and uint32 codes, [1, heads, positions, width] keys
    and values of one heads and positions count, as many positions as `offset` says."""

    def fail(msg: str):
        raise PromptCacheError(f"{where}: {msg}")

    kind, offset = m["type"], m["offset"]
    if kind == "ArraysCache":
        for k, v in a.items():
            if not (k.isdigit() and k.isascii() and int(k) < m["size"]):
                fail(f"slot {_brief(k)} outside the cache's {m['size']} slots")
            if v.dtype not in FLOATS:
                fail(f"slot {k} is {_dtype(v)}, expected a float state")
        if a and len(a) != m["size"] or not a and offset:  # a run fills every slot
            fail(f"{len(a)} of {m['size']} slots saved for {offset} positions")
        return
    parts = QUANTIZED_PARTS if kind == "QuantizedKVCache" else ("",)
    names = {f"{kv}.{p}".rstrip(".") for kv in ("keys", "values") for p in parts}
    if not a:
        if offset or m.get("idx"):
            fail(f"no keys or values for {offset} positions")
        return
    if set(a) != names:
        extra = sorted(set(a) ^ names)[0]
        fail(f"{'missing' if extra in names else 'unexpected'} array {_brief(extra)}")
    for k, v in a.items():
        want = mx.uint32 if k.endswith(".codes") else None
        if (v.dtype != want) if want else v.dtype not in FLOATS:
            fail(f"{k} is {_dtype(v)}, expected {'uint32' if want else 'a float dtype'}")
        if v.ndim != 4 or v.shape[0] != 1 or 0 in v.shape[1:2] + v.shape[3:]:
            fail(f"{k} has shape {list(v.shape)}, expected [1, heads, positions, width]")
    first = a[sorted(a)[0]]
    lead = tuple(first.shape[:3])
    if any(tuple(v.shape[:3]) != lead for v in a.values()):
        fail("keys and values of different heads or positions")
    positions = lead[2]
    if kind == "RotatingKVCache":
        if not m["idx"] <= min(positions, offset):
            fail(f"idx {m['idx']} past the {min(positions, offset)} positions it holds")
        return
    if positions != offset:
        fail(f"{positions} positions saved, offset says {offset}")
    if kind == "QuantizedKVCache":
        for kv in ("keys", "values"):
            codes, scales, biases = (a[f"{kv}.{p}"] for p in QUANTIZED_PARTS)
            width = codes.shape[-1] * 32 // m["bits"]
            if scales.shape != biases.shape or scales.shape[-1] * m["group_size"] != width:
                fail(
                    f"{kv}.scales / biases {list(scales.shape)} / {list(biases.shape)} do not "
                    f"fit {kv}.codes {list(codes.shape)} at {m['bits']} bits in groups of "
                    f"{m['group_size']}"
                )


def _check_fits(path: Path, cache: list, model) -> None:
    """Each layer's state against the model: the kind of cache the layer keeps, and one
    throwaway one-token step of the layer's attention (or recurrent mixer) over a copy of the
    state, so that a state of the wrong width, heads or slots (or holding NaN) is refused
    here rather than failing inside a generation. Costs about one decode step's attention."""
    fresh = model.make_cache()
    quantized_ok = getattr(model, "quantized_kv", True)
    hidden = model.args.hidden_size
    for i, (c, f, layer) in enumerate(zip(cache, fresh, model.layers)):
        where = f"{path}: layer {i} ({type(c).__name__})"
        if isinstance(f, ArraysCache) != isinstance(c, ArraysCache) or (
            isinstance(f, ArraysCache) and len(f.cache) != len(c.cache)
        ):
            raise PromptCacheError(f"{where}: the model keeps a {type(f).__name__} there")
        if isinstance(c, QuantizedKVCache) and not quantized_ok:
            raise PromptCacheError(f"{where}: {model.args.model_type} has no quantized cache")
        linear = getattr(layer, "linear_attn", None)
        mixer = linear if linear is not None else getattr(layer, "self_attn", None)
        if mixer is None:
            continue
        arrays, meta = c.to_saved()
        copy = type(c).from_saved({k: mx.array(v) for k, v in arrays.items()}, meta)
        x = mx.zeros((1, 1, hidden), mx.float32)
        try:  # one token: no mask in any family
            out = mixer(x, copy) if linear is not None else mixer(x, None, copy)
            mx.eval(out)
            ok = tuple(out.shape) == (1, 1, hidden) and bool(mx.all(mx.isfinite(out)))
        except Exception as e:  # MLX words a shape mismatch as ValueError or RuntimeError
            raise PromptCacheError(
                f"{where}: the state does not fit the model ({_first(e)})"
            ) from None
        if not ok:
            raise PromptCacheError(f"{where}: the state does not fit the model (non-finite)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _brief(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _dtype(a: mx.array) -> str:
    return str(a.dtype).split(".")[-1]


def _check_belongs(path: Path, meta: dict, layers: list, tokens: list, model) -> None:
    ours = identity(model)
    if meta.get("store_id") != ours["store_id"]:
        raise PromptCacheError(
            f"{path}: made by another model (store {_brief(meta.get('store') or '?')}, "
            f"{_brief(meta.get('model_type', '?'))}), not by {ours['store']}"
        )
    theirs_k = meta.get("experts_per_token")
    try:
        theirs_k = json.loads(theirs_k) if theirs_k is not None else None
    except (ValueError, TypeError, RecursionError):
        raise PromptCacheError(f"{path}: bad metadata (experts_per_token)") from None
    if theirs_k is not None and theirs_k != ours["experts_per_token"]:
        raise PromptCacheError(
            f"{path}: made with {_brief(theirs_k)} experts per token, this model routes to "
            f"{ours['experts_per_token']} (--experts-per-token)"
        )
    if len(layers) != len(model.layers):
        raise PromptCacheError(f"{path}: {len(layers)} layers, the model has {len(model.layers)}")
    vocab = model.args.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise PromptCacheError(f"{path}: token ids outside [0, {vocab})")


def check_kv_matches(path: str | Path, cache: list, kv: KVOptions, cli: bool = False) -> None:
    """A loaded cache against the asked --max-kv-size: a rotating cache of another size (or a
    full one where a rotating one is asked) would silently change the context kept."""
    sizes = {c.max_size for c in cache if isinstance(c, RotatingKVCache)}
    flag = "--max-kv-size" if cli else "max_kv_size"
    if kv.max_kv_size is not None and sizes != {kv.max_kv_size}:
        have = f"rotating, size {sorted(sizes)[0]}" if sizes else "not rotating"
        raise PromptCacheError(f"{path}: the saved KV cache is {have}; {flag} {kv.max_kv_size}")
    if kv.max_kv_size is None and sizes:
        raise PromptCacheError(
            f"{path}: the saved KV cache is rotating, size {sorted(sizes)[0]}: give {flag} "
            f"{sorted(sizes)[0]}"
        )
    # (a quantized cache is continued as it is: asked for other bits, it would not be them)
    kinds = {(c.bits, c.group_size) for c in cache if isinstance(c, QuantizedKVCache)}
    if kv.kv_bits is not None and kinds and kinds != {(kv.kv_bits, kv.kv_group_size)}:
        bits, group = sorted(kinds)[0]
        flags = ("--kv-bits", "--kv-group-size") if cli else ("kv_bits", "kv_group_size")
        raise PromptCacheError(
            f"{path}: the saved KV cache is quantized to {bits} bits in groups of {group}; "
            f"{flags[0]} {kv.kv_bits} {flags[1]} {kv.kv_group_size}"
        )


def _first(e: BaseException) -> str:
    s = str(e)
    return s.splitlines()[0] if s else type(e).__name__


# ---- reuse ------------------------------------------------------------------------------------


def cache_nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable_prefix(tokens: list[int], cache: list, prompt: list[int]) -> int:
    """How many of `prompt`'s first tokens a cache covering `tokens` can stand for, leaving
    at least one prompt token to run (its logits start the generation): the common prefix
    where every layer can be trimmed back to it, else all of `tokens` or nothing."""
    n = min(common_prefix(tokens, prompt), len(prompt) - 1)
    if n == len(tokens):
        return n
    if n > 0 and all(c.is_trimmable() for c in cache):
        return n
    return 0


def trim_to(cache: list, n_tokens: int, covered: int) -> None:
    for c in cache:
        c.trim(covered - n_tokens)


class PromptCacheLRU:
    """The caches of the last conversations (mlx-lm server's prompt cache), most recent last,
    bounded by `max_entries` and `max_bytes`. `take` removes the entry it reuses: the new
    generation extends that cache in place, and is `put` back when it ends."""

    def __init__(self, max_entries: int = 10, max_bytes: int = 1 << 30):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, tuple[list[int], list]] = OrderedDict()
        self._next = 0
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to a kept cache
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(cache_nbytes(c) for _, c in self._entries.values())

    def take(self, prompt: list[int]) -> tuple[list | None, int]:
        """(a cache trimmed to the longest reusable prefix of `prompt`, its length) or
        (None, 0)."""
        best, best_n = None, 0
        for key, (tokens, cache) in self._entries.items():
            n = reusable_prefix(tokens, cache, prompt)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None, 0
        tokens, cache = self._entries.pop(best)
        trim_to(cache, best_n, len(tokens))
        self.hits += 1
        self.reused_tokens += best_n
        return cache, best_n

    def put(self, tokens: list[int], cache: list) -> None:
        if not tokens or self.max_entries == 0 or cache_nbytes(cache) > self.max_bytes:
            return
        # An entry whose tokens the new one extends holds nothing the new one lacks.
        for key in [k for k, (t, c) in self._entries.items() if common_prefix(t, tokens) == len(t)]:
            del self._entries[key]
        self._entries[self._next] = (list(tokens), cache)
        self._next += 1
        while self._entries and (
            len(self._entries) > self.max_entries or self.nbytes > self.max_bytes
        ):
            self._entries.popitem(last=False)
