"""Rotary position embeddings and their scalings, shared by the model families (the shape of
mlx-lm's rope_utils): `initialize_rope` builds the rotary module a config's `rope_scaling`
asks for, and `yarn_attention_scale` is YaRN's softmax-scale correction.

Kinds: "default", "linear" (positions / factor), "llama3" (frequencies smoothed between
low_freq_factor and high_freq_factor wavelengths), "yarn" / "deepseek_yarn" (per-dimension
blend of interpolated and original frequencies, transformers' rules), and llama.cpp's
explicit per-frequency divisors (`freq_factors`, GGUF's rope_freqs tensor).

`check_scaling` types and bounds every field of a scaling dict these read, so that a config
(a checkpoint's, a store's manifest) with a bad one is refused in one line naming the field
before a module is built, not as a TypeError or a NaN deep inside the arithmetic.

Never: reads weights or configs beyond the scaling dict it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

KINDS = ("default", "linear", "llama3", "yarn", "deepseek_yarn")
# Bounds of the numbers a scaling dict gives. Checkpoints use factors up to 64 and mscales
# near 1; past these bounds the YaRN frequencies or attention factor overflow float32
# (a factor of 1e308 gave inf logits).
MAX_FACTOR = float(1 << 16)
# ... and below: a factor of 2.2e-308 divided positions into inf (NaN log-probabilities)
MIN_FACTOR = 1.0 / MAX_FACTOR
MAX_MSCALE = 100.0
MAX_POSITIONS = (1 << 31) - 1
# key -> (lowest, whether the lowest itself is allowed, highest); None stands for the key's
# default wherever the rotary code reads it with `.get(key) or default`.
NUMBERS: dict[str, tuple[float, bool, float]] = {
    "factor": (MIN_FACTOR, True, MAX_FACTOR),
    "original_max_position_embeddings": (0.0, False, MAX_POSITIONS),
    "low_freq_factor": (MIN_FACTOR, True, MAX_FACTOR),
    "high_freq_factor": (MIN_FACTOR, True, MAX_FACTOR),
    "beta_fast": (MIN_FACTOR, True, MAX_FACTOR),
    "beta_slow": (MIN_FACTOR, True, MAX_FACTOR),
    "mscale": (0.0, True, MAX_MSCALE),
    "mscale_all_dim": (0.0, True, MAX_MSCALE),
    "attention_factor": (0.0, False, MAX_MSCALE),
}
OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def check_scaling(scaling: Any, base: Any, fail: Callable[[str, str], None]) -> None:
    """A config's `rope_scaling` and `rope_theta` (the base of the periods): every
    field initialize_rope and yarn_attention_scale read, of its type and in its range.
    `fail(field, message)` raises (a StoreError naming the config) on the first bad one."""
    if isinstance(base, (int, float)) and not isinstance(base, bool) and not base > 1:
        # the periods are base ** (2i / dims): a base of 1 or less (1e-58 was one) rotates
        # nothing or overflows the frequencies to inf, and YaRN divides by log(base)
        fail("rope_theta", f"{base}: expected a base > 1")
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        fail("rope_scaling", f"expected an object, got {_short(scaling)}")
    for key in ("rope_type", "type"):
        v = scaling.get(key)
        if v is not None and not isinstance(v, str):
            fail(f"rope_scaling.{key}", f"expected a string, got {_short(v)}")
    kind = rope_kind(scaling)
    if kind not in KINDS:
        fail(
            "rope_scaling.rope_type",
            f"unsupported rope scaling {kind!r}; supported: {', '.join(KINDS)}",
        )
    for key, (lo, closed, hi) in NUMBERS.items():
        if key not in scaling or (scaling[key] is None and key in OPTIONAL):
            continue
        v = scaling[key]
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not (number and (v >= lo if closed else v > lo) and v <= hi):
            low = f"[{lo:g}" if closed else f"({lo:g}"
            fail(f"rope_scaling.{key}", f"expected a number in {low}, {hi:g}], got {_short(v)}")
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        fail("rope_scaling.truncate", f"expected true or false, got {_short(truncate)}")
    if kind in ("linear", "llama3") and "factor" not in scaling:
        fail("rope_scaling.factor", "missing")
    if kind == "llama3" and scaling.get("low_freq_factor", 1.0) == scaling.get(
        "high_freq_factor", 4.0
    ):
        fail("rope_scaling.high_freq_factor", "equals low_freq_factor")
    if kind in ("yarn", "deepseek_yarn"):
        for key in ("factor", "original_max_position_embeddings"):
            if key not in scaling:
                fail(f"rope_scaling.{key}", f"missing ({kind} needs it)")


def _short(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 40 else r[:37] + '...'}"


def rope_kind(scaling: dict[str, Any] | None) -> str:
    """The scaling's rope type, "default" when none is given."""
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


class FreqsRoPE(nn.Module):
    """Rotary embedding with explicit per-frequency periods (Llama 3 scaling, rope_freqs)."""

    def __init__(self, dims: int, freqs: mx.array, traditional: bool = False):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self._freqs = _evaluated(freqs)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


def _evaluated(freqs: mx.array) -> mx.array:
    """`freqs` computed now, on the loading thread: left lazy, its graph is bound to this
    thread's stream, and the server's generation thread failed evaluating it ("There is no
    Stream(cpu, 0) in current thread")."""
    mx.eval(freqs)
    return freqs


def _periods(dims: int, base: float) -> mx.array:
    """1 / inverse frequency of each rotated pair: base ** (2i / dims)."""
    return base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def llama3_freqs(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    inv = _periods(dims, base)
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    wavelens = 2 * math.pi * inv
    freqs = mx.where(wavelens > old / low, inv * factor, inv)
    medium = (wavelens > old / high) & (wavelens < old / low)
    smooth = (old / wavelens - low) / (high - low)
    return mx.where(medium, freqs / ((1 - smooth) / factor + smooth), freqs)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class YarnRoPE(nn.Module):
    """YaRN: per-dimension blend of interpolated (positions / factor) and original
    frequencies, ramped between the dims that turn `beta_fast` and `beta_slow` times over the
    original context; rotated dims scaled by the attention factor (transformers' rules)."""

    def __init__(self, dims: int, base: float, traditional: bool, scaling: dict[str, Any]):
        super().__init__()
        factor = scaling["factor"]
        original = scaling["original_max_position_embeddings"]
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if scaling.get("attention_factor") is not None:
            self.mscale = scaling["attention_factor"]
        elif mscale and mscale_all_dim:
            self.mscale = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            self.mscale = _yarn_mscale(factor)

        def correction_dim(rotations: float) -> float:
            return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = math.floor(correction_dim(beta_fast)), math.ceil(correction_dim(beta_slow))
        if scaling.get("truncate", True) is False:
            low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        low, high = max(low, 0), min(high, dims - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
        keep = 1.0 - ramp  # share of the original (extrapolated) frequency
        period = _periods(dims, base)
        stretched = factor * period
        # 1 / (keep / period + (1 - keep) / stretched), as one division
        self._freqs = _evaluated((stretched * period) / (stretched * keep + period * (1 - keep)))
        self.dims = dims
        self.traditional = traditional

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        if self.mscale != 1.0:
            x = x.at[..., : self.dims].multiply(self.mscale)
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


def initialize_rope(
    dims: int,
    base: float,
    traditional: bool,
    scaling: dict[str, Any] | None = None,
    freq_factors: list[float] | None = None,
    kinds: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "deepseek_yarn"),
) -> nn.Module:
    """The rotary module for `dims` rotated dims: `freq_factors` (llama.cpp's per-frequency
    divisors) when given, else the kind `scaling` names, which must be one of `kinds` (the
    ones a family's checkpoints are known to use)."""
    if freq_factors is not None:
        periods = _periods(dims, base) * mx.array(freq_factors, dtype=mx.float32)
        return FreqsRoPE(dims, periods, traditional)
    kind = rope_kind(scaling)
    if kind not in kinds:
        raise ValueError(f"unsupported rope scaling {kind!r}")
    if kind == "default":
        return nn.RoPE(dims, traditional=traditional, base=base)
    if kind == "linear":
        return nn.RoPE(dims, traditional=traditional, base=base, scale=1.0 / scaling["factor"])
    if kind == "llama3":
        return FreqsRoPE(dims, llama3_freqs(dims, base, scaling), traditional)
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ValueError(f"rope_scaling: {kind} needs {key}")
    return YarnRoPE(dims, base, traditional, scaling)


def yarn_attention_scale(head_dim: int, scaling: dict[str, Any] | None) -> float:
    """head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where set
    (DeepSeek's softmax scale)."""
    scale = head_dim**-0.5
    if rope_kind(scaling) != "default" and scaling.get("mscale_all_dim"):
        s = _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * s * s
    return scale
