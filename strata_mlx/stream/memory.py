"""Memory guard: what the machine can give, checked before the arena, KV cache and prompt
scratch are allocated.

Owns probing the memory a new allocation can get (`available_bytes`) and the one-line refusal
(`MemoryGuardError`) when a requested arena does not fit; shrinks an automatic arena to what is
available. Sources, tightest wins:
  - MLX on a Metal GPU: the wired-memory limit, device_info()["max_recommended_working_set_size"]
    (~19 GB on a 24 GB Mac), less what MLX already holds (dense weights);
  - Linux: MemAvailable in /proc/meminfo; the cgroup limit less its usage, for this process's
    cgroup and each above it (v2 memory.max / memory.current, v1 memory.limit_in_bytes /
    memory.usage_in_bytes); RLIMIT_AS less the address space in use.
Allocating past these does not raise in MLX: the process dies (SIGSEGV inside mx.eval, or the
OOM killer), so the check must come first. Never allocates, never reads the store.
"""

from __future__ import annotations

import math
import resource
from pathlib import Path

import mlx.core as mx

from ..format.store import StoreError

GB = 1024**3
# Kept free beyond what we count: the rest of the process (tokenizer, Python, MLX's own
# buffers) and the OS. An automatic arena leaves more (a quarter of what is available).
RESERVE = GB // 2
PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")


class MemoryGuardError(StoreError):
    """What does not fit in memory, and what to change (one line)."""


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def meminfo_available(proc: Path = PROC) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_available(proc: Path = PROC, root: Path = CGROUP) -> int | None:
    """The least (limit - usage) over this process's memory cgroup and its ancestors."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    dirs = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":  # v2
            dirs.append((root, parts[2], "memory.max", "memory.current"))
        elif "memory" in parts[1].split(","):  # v1
            dirs.append(
                (root / "memory", parts[2], "memory.limit_in_bytes", "memory.usage_in_bytes")
            )
    best = None
    for base, rel, limit_name, usage_name in dirs:
        # inside a container the mount shows our own cgroup at its root; outside, at rel
        rel_parts = [p for p in rel.split("/") if p]
        candidates = [base / Path(*rel_parts[:i]) for i in range(len(rel_parts), -1, -1)]
        for d in candidates:
            limit = _read_int(d / limit_name)
            if limit is None or limit >= 1 << 60:  # v1 says "no limit" with ~2^63
                continue
            free = max(limit - (_read_int(d / usage_name) or 0), 0)
            best = free if best is None else min(best, free)
    return best


def address_space_available(proc: Path = PROC) -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(soft - int(line.split()[1]) * 1024, 0)
    except (OSError, ValueError, IndexError):
        pass
    return soft


def gpu_available() -> int | None:
    """Metal: the wired-memory limit less what MLX holds; None elsewhere."""
    if mx.default_device() != mx.gpu or not mx.metal.is_available():
        return None
    info = mx.metal.device_info()
    limit = info.get("max_recommended_working_set_size") or info.get("memory_size")
    if not limit:
        return None
    return max(int(limit) - mx.get_active_memory(), 0)


def available_bytes() -> int | None:
    """What a new allocation can get now (the tightest source), or None if nothing is known."""
    found = [
        v
        for v in (
            gpu_available(),
            meminfo_available(),
            cgroup_available(),
            address_space_available(),
        )
        if v is not None
    ]
    return min(found) if found else None


def activation_itemsize(dtype: str | None) -> int:
    """Bytes an element of the activations, KV cache included, of a model whose dense
    weights are `dtype` (a config's torch_dtype: float32 stores compute in float32)."""
    return 4 if dtype == "float32" else 2


def kv_cache_bytes(args, tokens: int, itemsize: int = 2) -> int:
    """The KV cache and recurrent state after `tokens` positions, at `itemsize` bytes an
    element (fp16 by default), as the families allocate them: attention layers' KVCache grows
    in steps of 256 positions (as mlx-lm's) and holds, per position,
      - keys and values of every KV head (GQA), sliding-window layers included (GPT-OSS keeps
        every position: strata_mlx.models.gpt_oss);
      - for multi-head latent attention (DeepSeek-V3, `kv_lora_rank`), the compressed latent
        and the shared rotary key only (kv_lora_rank + qk_rope_head_dim), not the heads'
        keys and values, ~25x less at DeepSeek-V3's shape;
    and Qwen3-Next's linear-attention layers a fixed state whatever `tokens`: the conv window
    [kernel - 1, conv width] at `itemsize` and the float32 delta-rule state [Hv, Dv, Dk]."""
    layers = getattr(args, "num_hidden_layers", 0) or 0
    positions = -(-tokens // 256) * 256
    rank = getattr(args, "kv_lora_rank", None)
    if rank:
        return layers * (rank + args.qk_rope_head_dim) * positions * itemsize
    heads = getattr(args, "num_attention_heads", 1) or 1
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or getattr(args, "hidden_size", 0) // heads
    per_layer = 2 * kv_heads * head_dim * positions * itemsize
    is_linear = getattr(args, "is_linear", None)
    linear = sum(1 for i in range(layers) if is_linear(i)) if callable(is_linear) else 0
    total = (layers - linear) * per_layer
    if linear:
        n_k, n_v = args.linear_num_key_heads, args.linear_num_value_heads
        d_k, d_v = args.linear_key_head_dim, args.linear_value_head_dim
        conv = (args.linear_conv_kernel_dim - 1) * (2 * n_k * d_k + n_v * d_v) * itemsize
        total += linear * (conv + n_v * d_v * d_k * 4)
    return total


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= GB // 10 else f"{n / 2**20:.1f} MB"


def _floor_gb(n: int) -> str:
    """n bytes as an --arena-gb value rounded down (to 0.1 from 1 GB, else 3 digits)."""
    digits = 1 if n >= GB else 3 - math.floor(math.log10(max(n, 1) / GB))
    return f"{math.floor(n / GB * 10**digits) / 10**digits:.{max(digits, 1)}f}".rstrip("0").rstrip(
        "."
    )


def fit_arena(
    arena_bytes: int,
    record_bytes: int,
    other_bytes: int,
    arena_gb: float | None,
    available: int | None = None,
) -> int:
    """The arena size to allocate: `arena_bytes` if it and `other_bytes` (KV cache, prompt
    scratch) fit in what is available; an automatic arena (arena_gb None) shrunk to fit; else
    a MemoryGuardError saying what to change."""
    available = available_bytes() if available is None else available
    if available is None:
        return arena_bytes
    room = available - RESERVE - other_bytes
    if arena_gb is None:
        arena_bytes = min(arena_bytes, room - max(room, 0) // 4)
    arena_bytes = max(arena_bytes, record_bytes)  # the arena holds at least one expert
    if arena_bytes <= room:
        return arena_bytes
    what = f"--arena-gb {arena_gb:g}" if arena_gb is not None else "the automatic arena"
    need = arena_bytes + other_bytes + RESERVE
    fix = (
        f"use --arena-gb {_floor_gb(room)} or less"
        if room >= record_bytes
        else "free memory, or use a smaller --prefill-step-size "
        f"(the arena needs at least one expert, {_gb(record_bytes)})"
    )
    raise MemoryGuardError(
        f"{what} needs {_gb(need)} (arena {_gb(arena_bytes)}, KV cache, prompt scratch and kept caches "
        f"{_gb(other_bytes)}, reserve {_gb(RESERVE)}) but {_gb(available)} is available; {fix}"
    )
