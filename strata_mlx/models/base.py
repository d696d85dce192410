"""Pieces every model family shares: config args, caches, masks, activations.

Families live one per file beside this one (mlx-lm's shape). A family's MoE block routes,
then hands its experts to `switch.SwitchGLU`, the seam; it never holds expert weights.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .rope import check_scaling

# Config values are checked for type and range before a model is built from them: a string
# `hidden_size` or a `decoder_sparse_step` of 0 otherwise fails deep inside MLX (or divides by
# zero), and a size of 2^40 would be allocated.
MAX_DIM = (1 << 31) - 1
POSITIVE = {
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "linear_num_value_heads",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "decoder_sparse_step",
    "full_attention_interval",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "partial_rotary_factor",
    "clip_qkv",
}
# Upper bounds below MAX_DIM: a model is built layer by layer in Python before its weights are
# checked, so a num_hidden_layers of 2^31 - 1 would exhaust memory building modules.
AT_MOST = {"partial_rotary_factor": 1, "num_hidden_layers": 1 << 12}
LAYER_TYPES = ("linear_attention", "full_attention")  # a family may name others (LAYER_TYPES)


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict[str, Any], source: str = "config", prefix: str = ""):
        """Build from a config dict, checking each field the dataclass declares for type and
        range first: a StoreError `{source}: {prefix}{field}: ...` on the first bad one."""
        from ..format.store import StoreError

        def fail(name: str, msg: str):
            raise StoreError(f"{source}: {prefix}{name}: {msg}")

        hints = typing.get_type_hints(cls)
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name not in params:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    fail(f.name, "missing")
                continue
            v = params[f.name]
            if not _conforms(v, hints[f.name]):
                fail(f.name, f"expected {_type_name(hints[f.name])}, got {_short(v)}")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                hi = AT_MOST.get(f.name, MAX_DIM)
                if f.name in POSITIVE and not v > 0:
                    fail(f.name, f"{v} must be > 0")
                if not 0 <= v <= hi:
                    fail(f.name, f"{v} outside [0, {hi}]")
            kw[f.name] = v
        _check_together(kw, fail, getattr(cls, "LAYER_TYPES", LAYER_TYPES))
        try:
            return cls(**kw)
        except (ValueError, ZeroDivisionError) as e:  # a family's own __post_init__ checks
            raise StoreError(f"{source}: {prefix[:-1] or 'config'}: {e}") from None


def _conforms(v: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(v, a) for a in typing.get_args(tp))
    if tp is type(None):
        return v is None
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if tp is str:
        return isinstance(v, str)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(v, list) and all(_conforms(x, item) for x in v)
    if origin is dict:
        return isinstance(v, dict) and all(isinstance(k, str) for k in v)
    return isinstance(v, tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _short(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 40 else r[:37] + '...'}"


def _check_together(kw: dict[str, Any], fail, layer_types=LAYER_TYPES) -> None:
    """Fields that only make sense together (head counts, top-k, layer lists, rope scaling)."""
    heads, kv = kw.get("num_attention_heads"), kw.get("num_key_value_heads")
    if heads and kv and heads % kv:
        fail("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    head_dim = kw.get("head_dim") or 0
    if heads and (heads + (kv or 0)) * head_dim > MAX_DIM:  # MLX indexes widths as int32
        fail("head_dim", f"{head_dim} x {heads} heads is wider than {MAX_DIM}")
    if heads and kw.get("head_dim") is None and kw.get("hidden_size", 0) % heads:
        fail("hidden_size", f"{kw['hidden_size']} is not a multiple of num_attention_heads {heads}")
    n = kw.get("num_experts", kw.get("num_local_experts"))
    k = kw.get("num_experts_per_tok")
    if n is not None and k is not None and k > n:
        fail("num_experts_per_tok", f"{k} is more than num_experts {n}")
    layers = kw.get("num_hidden_layers", 0)
    for i in kw.get("mlp_only_layers") or []:
        if not 0 <= i < layers:
            fail("mlp_only_layers", f"layer {i} outside [0, {layers})")
    types_ = kw.get("layer_types")
    if types_ is not None:
        if len(types_) < layers:
            fail("layer_types", f"{len(types_)} entries for {layers} layers")
        bad = [t for t in types_ if t not in layer_types]
        if bad:
            fail("layer_types", f"{bad[0]!r} is not one of {', '.join(layer_types)}")
    for v in kw.get("rope_freq_factors") or []:
        if not v > 0:
            fail("rope_freq_factors", f"{v} must be > 0")
    check_scaling(kw.get("rope_scaling"), kw.get("rope_theta"), fail)


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """Accept transformers 4 and 5 spellings: rope_parameters/rope_theta, num_local_experts."""
    c = dict(config)
    rp = c.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" in rp and "rope_theta" not in c:
            c["rope_theta"] = rp["rope_theta"]
        if "partial_rotary_factor" in rp and "partial_rotary_factor" not in c:
            c["partial_rotary_factor"] = rp["partial_rotary_factor"]
        if rp.get("rope_type", "default") not in ("default", None) and not c.get("rope_scaling"):
            c["rope_scaling"] = rp
    if "num_local_experts" in c and "num_experts" not in c:
        c["num_experts"] = c["num_local_experts"]
    if "num_experts" in c and "num_local_experts" not in c:
        c["num_local_experts"] = c["num_experts"]
    return c


def key_buffer(cache) -> mx.array | None:
    """The buffer a cache keeps its keys in (a QuantizedKVCache's codes), or None: none yet,
    or a cache without keys (ArraysCache)."""
    keys = getattr(cache, "keys", None)
    return keys[0] if isinstance(keys, (tuple, list)) else keys


class _GrowingCache:
    """What KVCache and QuantizedKVCache share: positions written only past `offset`."""

    offset: int

    def make_mask(self, n: int):
        return "causal" if n > 1 else None

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def is_trimmable(self) -> bool:
        return True

    def grows(self, n: int) -> bool:
        """Whether writing `n` more positions makes a new, larger buffer."""
        keys = key_buffer(self)
        return keys is None or self.offset + n > keys.shape[2]


class KVCache(_GrowingCache):
    """Keys and values grown in steps of 256 positions (as mlx-lm's KVCache).

    Writes go only past `offset`, so rolling a token back (strata_mlx.runtime.decode) is setting
    `offset` back; the same holds for QuantizedKVCache."""

    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        if self.keys is None or prev + keys.shape[2] > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            n = (self.step + keys.shape[2] - 1) // self.step * self.step
            new_k = mx.zeros((B, H, n, Dk), keys.dtype)
            new_v = mx.zeros((B, H, n, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        if self.keys is None:
            return []
        return [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def to_quantized(self, group_size: int, bits: int) -> QuantizedKVCache:
        q = QuantizedKVCache(group_size, bits)
        q.offset = self.offset
        if self.keys is not None:
            q.keys = mx.quantize(self.keys, group_size=group_size, bits=bits)
            q.values = mx.quantize(self.values, group_size=group_size, bits=bits)
        return q

    def to_saved(self) -> tuple[dict[str, mx.array], dict]:
        if self.keys is None:
            return {}, {"offset": 0}
        n = self.offset
        return {"keys": self.keys[..., :n, :], "values": self.values[..., :n, :]}, {"offset": n}

    @classmethod
    def from_saved(cls, arrays: dict[str, mx.array], meta: dict):
        c = cls()
        c.offset = meta["offset"]
        if arrays:
            c.keys, c.values = arrays["keys"], arrays["values"]
        return c


class QuantizedKVCache(_GrowingCache):
    """Keys and values stored as MLX affine codes (mlx-lm's QuantizedKVCache): `bits` per
    element plus a float scale and bias per `group_size` of the head dimension. Attention
    over it is `attention()`'s quantized path."""

    step = 256

    def __init__(self, group_size: int = 64, bits: int = 8):
        self.keys = None  # (codes, scales, biases)
        self.values = None
        self.offset = 0
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, S, Dk = keys.shape
        prev = self.offset
        if self.keys is None or prev + S > self.keys[0].shape[2]:
            per_word = 32 // self.bits
            n = (self.step + S - 1) // self.step * self.step

            def empty(d, dtype):
                g = d // self.group_size
                return (
                    mx.zeros((B, H, n, d // per_word), mx.uint32),
                    mx.zeros((B, H, n, g), dtype),
                    mx.zeros((B, H, n, g), dtype),
                )

            new_k, new_v = empty(Dk, keys.dtype), empty(values.shape[3], keys.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = tuple(
                    mx.concatenate([a[..., :prev, :], b], axis=2) for a, b in zip(self.keys, new_k)
                )
                self.values = tuple(
                    mx.concatenate([a[..., :prev, :], b], axis=2)
                    for a, b in zip(self.values, new_v)
                )
        self.offset += S
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self.offset, :] = qk[i]
            self.values[i][..., prev : self.offset, :] = qv[i]
        n = self.offset
        return (
            tuple(a[..., :n, :] for a in self.keys),
            tuple(a[..., :n, :] for a in self.values),
        )

    @property
    def state(self):
        if self.keys is None:
            return []
        return [*self.keys, *self.values]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def to_saved(self) -> tuple[dict[str, mx.array], dict]:
        meta = {"offset": self.offset, "group_size": self.group_size, "bits": self.bits}
        if self.keys is None:
            return {}, meta
        n = self.offset
        arrays = {}
        for name, parts in (("keys", self.keys), ("values", self.values)):
            for part, a in zip(("codes", "scales", "biases"), parts):
                arrays[f"{name}.{part}"] = a[..., :n, :]
        return arrays, meta

    @classmethod
    def from_saved(cls, arrays: dict[str, mx.array], meta: dict):
        c = cls(meta["group_size"], meta["bits"])
        c.offset = meta["offset"]
        if arrays:
            c.keys = tuple(arrays[f"keys.{p}"] for p in ("codes", "scales", "biases"))
            c.values = tuple(arrays[f"values.{p}"] for p in ("codes", "scales", "biases"))
        return c


class RotatingKVCache:
    """At most `max_size` positions of keys and values, the first `keep` always among them
    (mlx-lm's RotatingKVCache, the same layout, so attention sums in the same order): a
    multi-token step appends in temporal order (trimmed so each query still sees `max_size`
    positions); a one-token step overwrites the oldest position of a ring.

    The ring overwrites: a decode token cannot be undone by moving `offset` back. So the
    pipelined decoder takes a `snapshot()` before each token (new handles to the arrays,
    no copy) and `restore()`s it; while a snapshot holds the old arrays, a write copies the
    buffer instead of updating it in place (MLX donates a buffer only when nothing else
    holds it), one buffer's worth of memory traffic per layer and token, about what the
    attention over the full window reads anyway."""

    step = 256

    def __init__(self, max_size: int, keep: int = 0):
        self.keep = keep
        self.max_size = max_size
        self.keys = None
        self.values = None
        self.offset = 0
        self._idx = 0  # where the next one-token write goes

    def _trim(self, n: int, v: mx.array, append: mx.array | None = None) -> mx.array:
        parts = [v[..., : self.keep, :], v[..., n + self.keep :, :]] if n > 0 else [v]
        if append is not None:
            parts.append(append)
        return mx.concatenate(parts, axis=2)

    def _temporal_order(self, v: mx.array) -> mx.array:
        if self._idx == v.shape[2]:
            return v
        if self._idx < self.offset:  # wrapped: keep | oldest .. end | start .. newest
            return mx.concatenate(
                [v[..., : self.keep, :], v[..., self._idx :, :], v[..., self.keep : self._idx, :]],
                axis=2,
            )
        return v[..., : self._idx, :]

    def _append(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = self._temporal_order(self.keys)
            self.values = self._temporal_order(self.values)
            # Keep max_size - 1 old positions: the first new query then sees max_size.
            n = self.keys.shape[2] - self.max_size + 1
            self.keys = self._trim(n, self.keys, keys)
            self.values = self._trim(n, self.values, values)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _write_one(self, keys: mx.array, values: mx.array):
        B, H, S, Dk = keys.shape
        prev = self.offset
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            n = min(self.step, self.max_size - prev)
            new_k = mx.zeros((B, H, n, Dk), keys.dtype)
            new_v = mx.zeros((B, H, n, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            self._idx = prev
        over = self.keys.shape[2] - self.max_size  # after a long multi-token step
        if over > 0:
            self.keys = self._trim(over, self.keys)
            self.values = self._trim(over, self.values)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep
        i = self._idx
        self.keys[..., i : i + S, :] = keys
        self.values[..., i : i + S, :] = values
        self.offset += S
        self._idx += S
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] == 1:
            return self._write_one(keys, values)
        return self._append(keys, values)

    def grows(self, n: int) -> bool:
        """Whether writing `n` more positions makes a new buffer (a one-token write past the
        buffer before it holds `max_size`; any longer write appends)."""
        if self.keys is None or n > 1:
            return True
        return self.offset >= self.keys.shape[2] and self.keys.shape[2] < self.max_size

    def make_mask(self, n: int):
        if n == 1:
            return None
        offset = min(self.max_size - 1, self.offset)
        if offset + n > self.max_size:
            return causal_mask(n, offset, window=self.max_size)
        return "causal"

    def snapshot(self):
        fresh = lambda a: None if a is None else mx.array(a)  # noqa: E731
        return (self.offset, self._idx, fresh(self.keys), fresh(self.values))

    def restore(self, saved) -> None:
        # New handles again: the snapshot may be restored more than once (a second miss
        # later in the same token), and writes update a handle in place.
        self.offset, self._idx, keys, values = saved
        self.keys = None if keys is None else mx.array(keys)
        self.values = None if values is None else mx.array(values)

    @property
    def state(self):
        if self.keys is None:
            return []
        return [self.keys, self.values]

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        self._idx -= n
        return n

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def to_saved(self) -> tuple[dict[str, mx.array], dict]:
        meta = {"offset": self.offset, "keep": self.keep, "max_size": self.max_size,
                "idx": self._idx}  # fmt: skip
        if self.keys is None:
            return {}, meta
        return {"keys": self.keys, "values": self.values}, meta

    @classmethod
    def from_saved(cls, arrays: dict[str, mx.array], meta: dict):
        c = cls(meta["max_size"], meta["keep"])
        c.offset, c._idx = meta["offset"], meta["idx"]
        if arrays:
            c.keys, c.values = arrays["keys"], arrays["values"]
        return c


class ArraysCache:
    """Fixed slots of recurrent state (conv window, SSM / gated-delta state). Not trimmable:
    the state after n tokens cannot be recovered from the state after n + 1."""

    def __init__(self, size: int):
        self.cache = [None] * size
        self.offset = 0

    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, v):
        self.cache[i] = v

    @property
    def state(self):
        return [c for c in self.cache if c is not None]

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def to_saved(self) -> tuple[dict[str, mx.array], dict]:
        arrays = {str(i): a for i, a in enumerate(self.cache) if a is not None}
        return arrays, {"offset": self.offset, "size": len(self.cache)}

    @classmethod
    def from_saved(cls, arrays: dict[str, mx.array], meta: dict):
        c = cls(meta["size"])
        c.offset = meta["offset"]
        for i, a in arrays.items():
            if not i.isdigit() or int(i) >= len(c.cache):
                raise ValueError(f"slot {i!r} outside the cache's {len(c.cache)} slots")
            c.cache[int(i)] = a
        return c


CACHE_TYPES = {c.__name__: c for c in (KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache)}


def causal_mask(n: int, offset: int, window: int | None = None) -> mx.array:
    """bool [n, offset + n]: query i (at position offset + i) sees keys 0..offset + i, and
    with `window` only the last `window` of them."""
    keys = mx.arange(offset + n)
    queries = mx.arange(offset, offset + n) if offset else keys
    mask = queries[:, None] >= keys[None]
    if window is not None:
        mask = mask & (queries[:, None] < keys[None] + window)
    return mask


def create_attention_mask(h: mx.array, cache=None):
    """The cache's mask for a step of h.shape[1] tokens: "causal" for a multi-token step
    (the fused kernel's own mask), None for one token; an explicit windowed mask where a
    rotating cache's window cuts into the step."""
    if cache is not None:
        return cache.make_mask(h.shape[1])
    return "causal" if h.shape[1] > 1 else None


class RowCaches:
    """One layer's caches of several sequences that decode one token each in one forward
    (strata_mlx.generation.batch): row i of the step's [B, 1] tokens is sequence i, with its
    own cache and position. `offset` is the rows' positions ([B], which RoPE takes per row);
    `update_and_fetch` writes each row into its own cache and returns the rows' keys and
    values as lists, which `attention` attends one row at a time: each row's attention is the
    computation it is alone."""

    def __init__(self, caches: list):
        self.caches = caches

    @property
    def offset(self) -> mx.array:
        return mx.array([c.offset for c in self.caches])

    def make_mask(self, n: int):
        if n != 1:
            raise ValueError("a step of several sequences runs one token each")
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        rows = [
            c.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            for i, c in enumerate(self.caches)
        ]
        return [k for k, _ in rows], [v for _, v in rows]


def attention(q: mx.array, k, v, cache, scale: float, mask) -> mx.array:
    """Scaled dot-product attention over the cache's keys and values: the fused kernel, or
    over a QuantizedKVCache's codes by quantized matmuls (as mlx-lm's
    quantized_scaled_dot_product_attention: the same operations in the same order); over
    RowCaches, each row over its own cache."""
    if isinstance(cache, RowCaches):
        return mx.concatenate(
            [
                attention(q[i : i + 1], k[i], v[i], c, scale, mask)
                for i, c in enumerate(cache.caches)
            ]
        )
    if not isinstance(cache, QuantizedKVCache):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    B, n_heads, L, D = q.shape
    n_kv = k[0].shape[-3]
    repeats = n_heads // n_kv
    q = q * scale
    if repeats > 1:
        q = q.reshape(B, n_kv, repeats, L, D)
        k = tuple(mx.expand_dims(a, -3) for a in k)
        v = tuple(mx.expand_dims(a, -3) for a in v)
    g, bits = cache.group_size, cache.bits
    scores = mx.quantized_matmul(q, *k, transpose=True, group_size=g, bits=bits)
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            mask = mx.arange(kL - qL, kL)[:, None] >= mx.arange(kL)[None]
        if repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *v, transpose=False, group_size=g, bits=bits)
    if repeats > 1:
        out = out.reshape(B, n_heads, L, D)
    return out


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.silu(gate) * x


def top_k_route(
    gates: mx.array, k: int, norm_topk_prob: bool, softmax_first: bool = True, ids: bool = False
):
    """Softmax router: (ids [..., k], scores [..., k]) as mlx-lm's Qwen/OLMoE/Mixtral blocks;
    `ids`: the ids alone, the same ones (lookahead's routers: no graph built for scores)."""
    if softmax_first:
        probs = mx.softmax(gates, axis=-1, precise=True)
        inds = mx.stop_gradient(mx.argpartition(probs, kth=-k, axis=-1)[..., -k:])
        if ids:
            return inds
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores
    inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
    if ids:
        return inds
    scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
    return inds, scores
