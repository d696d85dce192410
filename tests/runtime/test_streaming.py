"""Streaming is exact: any arena size, prefill step and read-ahead policy gives bit-identical
logits and greedy tokens to the fully resident model; the statistics add up; faults surface."""

from __future__ import annotations

import itertools
import json
import os
import zlib

import mlx.core as mx
import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.format.store import EXPERTS, StoreError, load_manifest
from strata_mlx.generation.generate import stream_generate, teacher_forced_logits
from strata_mlx.runtime.experts import ExpertReadError

FAMILY = "qwen3_moe"


def arena_gb(path, fraction: float) -> float:
    m = load_manifest(path)
    total = m.num_experts * len(m.moe_layers)
    slots = max(1, round(fraction * total))
    return slots * m.layout.record_bytes / 1024**3


def resident(path, step):
    model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 1.0), read_ahead="demand")
    model.expert_cache.warm()
    return model


def greedy(model, ids, n=8, step=64):
    return [
        r.token for r in stream_generate(model, None, ids, max_tokens=n, prefill_step_size=step)
    ]


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "mixtral", "olmoe", "qwen3_next", "glm4_moe", "deepseek_v3", "gpt_oss"]
)
@pytest.mark.parametrize("step", [1, 7, 64])
def test_bit_identical_across_arenas_and_policies(store, step, family):
    path = store(family)
    ids = prompt_ids(40, seed=3)
    ref_model = resident(path, step)
    ref = teacher_forced_logits(ref_model, ids, step)
    ref_tokens = greedy(ref_model, ids, step=step)
    assert ref_model.expert_cache.stats.misses == 0  # truly resident
    for fraction, policy in itertools.product([0.05, 0.25, 1.0], ["demand", "static", "lookahead"]):
        model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, fraction), read_ahead=policy)
        out = teacher_forced_logits(model, ids, step)
        assert np.array_equal(out, ref), (fraction, policy)
        assert greedy(model, ids, step=step) == ref_tokens, (fraction, policy)
        model.expert_cache.close()


def test_prefill_step_sizes_agree(store):
    """Chunking changes only the batch shape; prefill state is bit-identical across chunk
    sizes on MLX's CPU backend. On CUDA a float32 matmul runs on TF32 tensor cores (10-bit
    mantissa: 2^-11 relative a rounding) and its tiling depends on the row count, so the
    summation order and the low bits differ and compound over the layers (up to 0.5 % of the
    largest logit seen on an H200): there the logits agree within 2^-6 of the largest and
    pick the same tokens."""
    path = store(FAMILY)
    ids = prompt_ids(40, seed=4)
    model = resident(path, 64)
    outs = [teacher_forced_logits(model, ids, s) for s in (1, 7, 64)]
    for out in outs[:2]:
        if mx.default_device() == mx.cpu:
            assert np.array_equal(out, outs[2])
        else:
            scale = float(np.abs(outs[2]).max())
            np.testing.assert_allclose(out, outs[2], rtol=0, atol=2**-6 * scale)
            assert np.array_equal(out.argmax(-1), outs[2].argmax(-1))


def test_small_arena_runs_expert_major_groups(store):
    path = store(FAMILY)
    model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.05))
    teacher_forced_logits(model, prompt_ids(16), 16)
    assert model.expert_cache.stats.groups > 0
    assert model.expert_cache.arena.n_slots == 1


@pytest.mark.parametrize("policy", ["demand", "static", "lookahead"])
def test_statistics_add_up(store, policy):
    path = store(FAMILY)
    model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.5), read_ahead=policy)
    teacher_forced_logits(model, prompt_ids(32, seed=5), 3)
    cache = model.expert_cache
    cache.sched.drain()
    s = cache.stats
    rb = load_manifest(path).layout.record_bytes
    assert s.lookups == s.hits + s.streamed_ahead + s.misses
    assert s.bytes_read == s.experts_read * rb
    # Every read was an urgent miss or a read-ahead that was submitted and not dropped.
    assert s.experts_read == s.misses + s.readahead_submitted - s.readahead_dropped - len(
        cache.sched.reads
    )
    assert s.wasted_readahead <= s.readahead_submitted
    if policy == "demand":
        assert s.readahead_submitted == 0 and s.streamed_ahead == 0
    else:
        assert s.readahead_submitted > 0


def test_lookahead_streams_ahead_on_a_tiny_model(store):
    path = store(FAMILY)
    ids = prompt_ids(32, seed=6)
    runs = {}
    for policy in ("demand", "lookahead"):
        model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.5), read_ahead=policy)
        teacher_forced_logits(model, ids, 1)
        runs[policy] = model.expert_cache.stats
    assert runs["lookahead"].misses < runs["demand"].misses
    assert runs["lookahead"].streamed_ahead > 0


def _copy_store(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_store_under_a_running_model(store, tmp_path):
    path = _copy_store(store(FAMILY), tmp_path / "s")
    model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.25))
    m = load_manifest(path)
    os.truncate(path / EXPERTS, m.layout.record_bytes * 3 + 100)
    with pytest.raises(ExpertReadError, match=r"layer \d+ expert \d+: short read \(\d+ of"):
        teacher_forced_logits(model, prompt_ids(16), 16)
    with pytest.raises(StoreError, match="truncated"):
        load_manifest(path)


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_record_is_an_error_by_default(store, tmp_path):
    path = _copy_store(store(FAMILY), tmp_path / "s")
    m = load_manifest(path)
    assert m.checksum == "crc32c"
    layer = m.moe_layers[-1]
    off, _ = m.record(layer, 3)
    _flip_byte(path / EXPERTS, off + 10)
    model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 1.0))
    with pytest.raises(ExpertReadError, match=f"layer {layer} expert 3: checksum mismatch"):
        model.expert_cache.warm()
    model.expert_cache.close()
    # read-ahead and demand reads are verified alike, under generation
    model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.5), read_ahead="lookahead")
    with pytest.raises(ExpertReadError, match=f"layer {layer} expert 3: checksum mismatch"):
        teacher_forced_logits(model, list(range(64)), 8)
    model.expert_cache.close()
    # --no-verify reads the corrupt bytes without complaint (for those measuring the cost)
    model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 1.0), verify=False)
    model.expert_cache.warm()
    assert model.expert_cache.reader.stats()["verified"] == 0
    model.expert_cache.close()


def test_every_read_is_verified(store):
    path = store(FAMILY)
    model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.25))
    teacher_forced_logits(model, prompt_ids(16), 16)
    cache = model.expert_cache
    stats = cache.reader.stats()
    assert stats["verified"] == stats["requests_done"] > 0 and stats["errors"] == 0
    cache.close()


def test_store_with_zlib_crc32_still_loads_and_is_verified(store, tmp_path):
    """A store converted before crc32c: zlib's crc32 per record under "crc32", no checksum of
    the dense file. It loads, computes the same, and its records are verified natively."""
    src = store(FAMILY)
    path = _copy_store(src, tmp_path / "old")
    manifest = json.loads((path / "manifest.json").read_text())
    ex = manifest["experts"]
    del ex["checksum"], ex["checksums"], manifest["dense_checksum"]
    m = load_manifest(src)
    data = (path / EXPERTS).read_bytes()
    rb = m.layout.record_bytes
    ex["crc32"] = [[zlib.crc32(data[o : o + rb]) for o in row] for row in m.offsets]
    (path / "manifest.json").write_text(json.dumps(manifest))
    old = load_manifest(path)
    assert old.checksum == "crc32" and old.dense_checksum is None
    ids = prompt_ids(16, seed=3)
    new_model, _ = strata_mlx.load(src, arena_gb=arena_gb(src, 0.25))
    old_model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.25))
    assert np.array_equal(
        np.array(teacher_forced_logits(new_model, ids, 16)),
        np.array(teacher_forced_logits(old_model, ids, 16)),
    )
    assert old_model.expert_cache.reader.stats()["verified"] > 0
    for model in (new_model, old_model):
        model.expert_cache.close()
    off, _ = old.record(old.moe_layers[0], 5)
    _flip_byte(path / EXPERTS, off + rb - 1)  # the record's last byte (padding included)
    model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 1.0))
    with pytest.raises(ExpertReadError, match=f"layer {old.moe_layers[0]} expert 5: checksum"):
        model.expert_cache.warm()
    model.expert_cache.close()


def test_fake_stream_reads_nothing(store):
    path = store(FAMILY)
    model, _ = strata_mlx.load(path, arena_gb=arena_gb(path, 0.25), fake_stream=True)
    teacher_forced_logits(model, prompt_ids(16), 16)
    assert model.expert_cache.stats.experts_read == 0
    assert model.expert_cache.stats.lookups > 0


def test_fake_stream_computes_the_same_groups(store):
    """Compute alone is the compute a run does at that arena: a layer that needs more experts
    than the arena has slots runs in the same expert-major groups (bench's and plan's floor)."""
    path = store(FAMILY)
    runs = []
    for fake in (False, True):
        model, _ = strata_mlx.load(
            path, arena_gb=arena_gb(path, 0.05), fake_stream=fake, read_ahead="demand"
        )
        teacher_forced_logits(model, prompt_ids(16), 16)
        runs.append(model.expert_cache.stats.groups)
        model.expert_cache.close()
    assert runs[0] > 0 and runs[1] == runs[0]


@pytest.mark.parametrize("policy", ["demand", "lookahead"])
def test_reader_overlap_on_and_off_stream_the_same_logits(store, policy):
    """read_overlap (the default) runs twice the reader threads, io_workers preads in flight;
    off, a worker's copy and checksum hold its read slot. Same bytes."""
    path = store(FAMILY)
    ids = prompt_ids(40, seed=5)
    out = {}
    for overlap in (False, True):
        model, _ = strata_mlx.load(
            path,
            arena_gb=arena_gb(path, 0.05),
            read_ahead=policy,
            read_overlap=overlap,
            io_workers=3,
        )
        out[overlap] = teacher_forced_logits(model, ids, 7)
        st = model.expert_cache.reader.stats()
        assert len(st["busy_ns"]) == (6 if overlap else 3) and 1 <= st["preads_max"] <= 3
        assert model.expert_cache.stats.misses > 0  # the reads happened
        model.expert_cache.close()
    assert np.array_equal(out[False], out[True])
