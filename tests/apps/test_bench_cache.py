"""bench and the page cache: before a cold run only the store's own files are
evicted (posix_fadvise DONTNEED on each); /proc/sys/vm/drop_caches is never written."""

from __future__ import annotations

import builtins
import os

import pytest

from strata_mlx.apps import bench


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this OS")
def test_drop_page_cache_advises_only_the_stores_files(store, monkeypatch):
    path = store("qwen3_moe")
    advised, opened = [], []
    real_fadvise, real_open = os.posix_fadvise, builtins.open

    def fadvise(fd, offset, length, advice):
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        return real_fadvise(fd, offset, length, advice)

    def guarded_open(file, *a, **kw):
        opened.append(str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(builtins, "open", guarded_open)
    assert bench._drop_page_cache(path)
    files = sorted(str(p.resolve()) for p in path.iterdir() if p.is_file())
    assert sorted(a[0] for a in advised) == files
    assert all(a[1:] == (0, 0, os.POSIX_FADV_DONTNEED) for a in advised)
    assert not any("drop_caches" in f for f in opened)


def test_bench_help_says_what_it_does_to_caches():
    from typer.testing import CliRunner

    from strata_mlx.apps.cli import app

    r = CliRunner().invoke(app, ["bench", "--help"])
    assert r.exit_code == 0
    text = " ".join(r.output.replace("│", " ").split())  # rich boxes and wraps the help
    assert "posix_fadvise" in text and "nothing else on the machine is touched" in text


def test_bench_policy_variants_name_the_runtime_options():
    from strata_mlx.apps.bench import policy_options
    from strata_mlx.config import OptionError

    assert policy_options("lookahead:ov0:nv:io16") == {
        "read_ahead": "lookahead",
        "read_overlap": False,
        "verify": False,
        "io_workers": 16,
    }
    assert policy_options("demand:ov1") == {"read_ahead": "demand", "read_overlap": True}
    with pytest.raises(OptionError, match="unknown variant 'ov2'"):
        policy_options("demand:ov2")
    # every eviction policy by name, the candidates of stream/policies.py too
    assert policy_options("demand:lru")["eviction"] == "lru"
    assert policy_options("demand:arc")["eviction"] == "arc"
    # two variants of one option: refused, not the last one taken without a word
    with pytest.raises(OptionError, match="'nextuse-duel' and 'lru' both set eviction"):
        policy_options("demand:nextuse-duel:lru")
    with pytest.raises(OptionError, match="'sync' and 'loop' both set"):
        policy_options("lookahead:sync:loop")
    with pytest.raises(OptionError, match="unknown variant 'd²'"):  # (str.isdigit takes "²")
        policy_options("lookahead:d²")
    # the scored read-ahead beside plain lookahead in one bench
    assert policy_options("lookahead:nextuse-duel:sc1")["lookahead_score"] is True
    assert policy_options("demand:nextuse-duel") == {
        "read_ahead": "demand",
        "eviction": "nextuse-duel",
    }


def test_bench_line_reads_keep_three_figures_and_nothing_read_says_so():
    from strata_mlx.apps.bench import _reads

    assert _reads({"experts_read_per_chunk": 496, "gb_per_s": 0.0016}) == (
        "496/chunk at 0.0016 GB/s,"
    )
    assert _reads({"experts_read_per_chunk": 0, "gb_per_s": 0.0}) == "0/chunk"


def test_compute_floor_is_the_fastest_pass_of_each_phase():
    from strata_mlx.apps.bench import Run, _fastest
    from strata_mlx.stream.stats import ExpertStats

    def run(chunk_s: list[float], decode_s: float) -> Run:
        chunks = [ExpertStats(wall_s=s) for s in chunk_s]
        return Run("fake-stream", "compute", chunks, ExpertStats(), decode_s, 8)

    slow_prefill, slow_decode = run([0.7, 0.7], 0.1), run([0.3, 0.4], 0.2)
    best = _fastest([slow_prefill, slow_decode])
    assert [c.wall_s for c in best.chunks] == [0.3, 0.4]
    assert (best.decode_s, best.decode_tokens) == (0.1, 8)
    assert best.decode is slow_prefill.decode


def test_a_policy_named_twice_in_a_bench_traces_to_two_files(tmp_path):
    """`--policies demand,demand --trace t.npz` wrote t-demand-r0.npz twice, the second run's
    file replacing the first's."""
    from strata_mlx.apps.bench import trace_paths

    t = tmp_path / "t.npz"
    paths = trace_paths(t, ["demand", "lookahead", "demand"], 0, 1)
    assert [p.name for p in paths.values()] == [
        "t-demand-1-r0.npz",
        "t-lookahead-r0.npz",
        "t-demand-2-r0.npz",
    ]
    assert trace_paths(t, ["demand"], 0, 1) == {0: t}  # a lone run: the file named


def reserves(monkeypatch, module) -> list[int]:
    """Each `module.load_model` call's reserve_bytes, from here on (the call itself made)."""
    seen, real = [], module.load_model

    def load_model(*a, reserve_bytes=0, **kw):
        seen.append(reserve_bytes)
        return real(*a, reserve_bytes=reserve_bytes, **kw)

    monkeypatch.setattr(module, "load_model", load_model)
    return seen


def test_bench_leaves_room_for_the_kv_cache_of_its_prompt_and_tokens(store, monkeypatch):
    """As generate: the KV cache of -p + -g beyond the one chunk load()'s arena leaves room
    for is reserved beside the arena, in every run's load (the compute floor's too)."""
    from strata_mlx.apps import bench
    from strata_mlx.runtime import loader

    path = store("qwen3_moe")
    reserved = reserves(monkeypatch, bench)
    bench.bench(path, prompt_tokens=300, gen_tokens=2, prefill_step_size=16,
                policies=("demand",), probe_seconds=0.05, log=lambda *_: None)  # fmt: skip
    want = loader.sequence_kv_bytes(path, 302) - loader.sequence_kv_bytes(path, 16)
    assert want > 0 and set(reserved) == {want} and len(reserved) >= 2
