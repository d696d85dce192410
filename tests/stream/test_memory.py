"""strata_mlx.stream.memory: the available-memory probes (fake /proc and cgroup trees) and the guard
load() runs before allocating the arena: a one-line refusal, never an allocation that dies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import strata_mlx
from strata_mlx.config import DEFAULT_DECODE_CONCURRENCY, OptionError
from strata_mlx.format.store import StoreError, load_manifest
from strata_mlx.stream import memory
from strata_mlx.stream.memory import GB, RESERVE, MemoryGuardError


def _proc(tmp_path, meminfo_kb=None, cgroup="0::/\n"):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    if meminfo_kb is not None:
        (proc / "meminfo").write_text(
            f"MemTotal:       32000000 kB\nMemFree:         1000000 kB\n"
            f"MemAvailable:   {meminfo_kb} kB\nBuffers:          100 kB\n"
        )
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def test_meminfo_available(tmp_path):
    assert memory.meminfo_available(_proc(tmp_path, 12_000_000)) == 12_000_000 * 1024
    assert memory.meminfo_available(tmp_path / "nowhere") is None


def test_cgroup_v2_limit_less_usage_tightest_ancestor(tmp_path):
    proc = _proc(tmp_path, cgroup="0::/user.slice/job\n")
    root = tmp_path / "cg"
    (root / "user.slice" / "job").mkdir(parents=True)
    (root / "user.slice" / "job" / "memory.max").write_text("max\n")
    (root / "user.slice" / "memory.max").write_text(f"{8 * GB}\n")
    (root / "user.slice" / "memory.current").write_text(f"{3 * GB}\n")
    assert memory.cgroup_available(proc, root) == 5 * GB
    (root / "user.slice" / "job" / "memory.max").write_text(f"{4 * GB}\n")
    (root / "user.slice" / "job" / "memory.current").write_text(f"{1 * GB}\n")
    assert memory.cgroup_available(proc, root) == 3 * GB


def test_cgroup_v1_and_no_limit(tmp_path):
    proc = _proc(tmp_path, cgroup="4:memory:/docker/abc\n1:cpu:/\n")
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)  # a container's mount: our cgroup at the root
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory.cgroup_available(proc, root) is None  # v1's "unlimited"
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{6 * GB}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{2 * GB}\n")
    assert memory.cgroup_available(proc, root) == 4 * GB


def test_available_is_the_tightest(monkeypatch):
    monkeypatch.setattr(memory, "meminfo_available", lambda: 12 * GB)
    monkeypatch.setattr(memory, "cgroup_available", lambda: 3 * GB)
    monkeypatch.setattr(memory, "address_space_available", lambda: None)
    monkeypatch.setattr(memory, "gpu_available", lambda: None)
    assert memory.available_bytes() == 3 * GB
    monkeypatch.setattr(memory, "gpu_available", lambda: 2 * GB)  # Metal's wired limit
    assert memory.available_bytes() == 2 * GB


def test_fit_arena_refuses_in_one_line(monkeypatch):
    available = int(12.15 * GB)
    with pytest.raises(MemoryGuardError) as e:
        memory.fit_arena(30 * GB, 1 << 20, GB, 30.0, available=available)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, StoreError)
    assert msg.startswith("--arena-gb 30 needs 31.5 GB") and "12.1 GB is available" in msg
    assert msg.endswith("use --arena-gb 10.6 or less"), msg  # 12.15 - 1 - 0.5, rounded down
    assert memory.fit_arena(10 * GB, 1 << 20, GB, 10.0, available=available) == 10 * GB
    # nothing known about the machine: no guard
    monkeypatch.setattr(memory, "available_bytes", lambda: None)
    assert memory.fit_arena(30 * GB, 1 << 20, GB, 30.0) == 30 * GB


def test_fit_arena_shrinks_an_automatic_arena():
    got = memory.fit_arena(30 * GB, 1 << 20, GB, None, available=9 * GB + RESERVE)
    assert got == 6 * GB  # three quarters of the 8 GB left after KV cache and scratch
    with pytest.raises(MemoryGuardError, match="the automatic arena needs .* smaller"):
        memory.fit_arena(30 * GB, 1 << 20, GB, None, available=GB + RESERVE)


def test_kv_cache_bytes():
    args = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, hidden_size=64)  # fmt: skip
    assert memory.kv_cache_bytes(args, 1) == 2 * 2 * 2 * 8 * 256 * 2
    assert memory.kv_cache_bytes(args, 300) == 2 * 2 * 2 * 8 * 512 * 2


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "deepseek_v3", "gpt_oss"])
def test_kv_cache_bytes_is_the_real_cache_after_a_prefill(store, family):
    """GQA keys and values; DeepSeek-V3's latent cache (MLA); Qwen3-Next's fixed state in
    its linear-attention layers; GPT-OSS's sliding layers: the estimate is the bytes the
    families' caches hold after 300 positions (float32 stores: 4 bytes an element)."""
    import mlx.core as mx
    from conftest import prompt_ids

    model, _ = strata_mlx.load(store(family))
    cache = model.make_cache()
    ids = prompt_ids(300, seed=2)
    for i in range(0, len(ids), 128):
        mx.eval(model(mx.array([ids[i : i + 128]]), cache=cache))
    real = sum(a.nbytes for c in cache for a in c.state)
    assert memory.kv_cache_bytes(model.args, 300, itemsize=4) == real
    model.expert_cache.close()


def test_kv_cache_bytes_of_latent_attention_at_deepseek_v3_shape():
    """61 layers, 128 heads of 7168 / 128 = 56 by the GQA rule, ~25x the latent's 512 + 64."""
    args = SimpleNamespace(num_hidden_layers=61, num_attention_heads=128,
                           num_key_value_heads=128, hidden_size=7168)  # fmt: skip
    gqa = memory.kv_cache_bytes(args, 4096)
    mla = memory.kv_cache_bytes(SimpleNamespace(**vars(args), kv_lora_rank=512,
                                                qk_rope_head_dim=64), 4096)  # fmt: skip
    assert mla == 61 * 576 * 4096 * 2 and 24 < gqa / mla < 26


def _room_for_half_the_experts(path, monkeypatch) -> int:
    """Make what this machine has available room for half of the store's experts once the KV
    cache and prompt scratch of one 64-token chunk (measured: the guard's own figure at one
    load) and the reserve are counted; the experts' bytes."""
    m = load_manifest(path)
    experts = m.num_experts * len(m.moe_layers) * m.layout.record_bytes
    seen = []
    real = memory.fit_arena
    monkeypatch.setattr(memory, "fit_arena", lambda *a: seen.append(a[2]) or real(*a))
    strata_mlx.load(path, arena_gb=experts / GB / 4, prefill_step_size=64)[0].expert_cache.close()
    (other,) = seen
    monkeypatch.setattr(memory, "available_bytes", lambda: RESERVE + other + experts // 2)
    return experts


def test_load_refuses_an_arena_larger_than_available(store, monkeypatch):
    path = store("qwen3_moe")
    m = load_manifest(path)
    experts = _room_for_half_the_experts(path, monkeypatch)
    arena_gb = experts / GB
    with pytest.raises(MemoryGuardError) as e:
        strata_mlx.load(path, arena_gb=arena_gb, prefill_step_size=64)
    assert "\n" not in str(e.value) and f"--arena-gb {arena_gb:g} needs" in str(e.value)
    assert "or less" in str(e.value)
    model, _ = strata_mlx.load(path, arena_gb=arena_gb / 4, prefill_step_size=64)
    assert model.expert_cache.arena.n_slots * m.layout.record_bytes <= experts // 4 + 1


def test_memory_a_caller_keeps_beside_the_model_is_left_free(store, monkeypatch):
    """serve's kept prompt caches (`reserve_bytes`): an arena that fits without them is
    refused with them, the automatic arena leaves them free, and serve passes its
    --prompt-cache-bytes (none when it keeps no prompt caches)."""
    path = store("qwen3_moe")
    m = load_manifest(path)
    experts = _room_for_half_the_experts(path, monkeypatch)
    quarter = experts / GB / 4
    strata_mlx.load(path, arena_gb=quarter, prefill_step_size=64)[0].expert_cache.close()
    with pytest.raises(MemoryGuardError, match="kept caches"):
        strata_mlx.load(path, arena_gb=quarter, prefill_step_size=64, reserve_bytes=experts // 2)
    slots = []
    for reserve in (0, experts // 4):
        model, _ = strata_mlx.load(path, prefill_step_size=64, reserve_bytes=reserve)
        slots.append(model.expert_cache.arena.n_slots * m.layout.record_bytes)
        model.expert_cache.close()
    assert slots[1] < slots[0] and slots[1] <= experts // 2 - experts // 4
    with pytest.raises(OptionError, match="reserve_bytes"):
        strata_mlx.load(path, reserve_bytes=-1)

    from strata_mlx.apps import server
    from strata_mlx.apps.server import app as server_app
    from strata_mlx.generation import generate

    class Loaded(Exception):
        pass

    def load(*a, **kw):
        raise Loaded(kw["reserve_bytes"])

    monkeypatch.setattr(generate, "load", load)
    kv = server_app.kv_reserve(path, DEFAULT_DECODE_CONCURRENCY).bytes  # (the test below)
    for size, expect in ((10, 123), (0, 0)):
        with pytest.raises(Loaded) as e:
            server.serve(path, prompt_cache_size=size, prompt_cache_bytes=123)
        assert e.value.args == (expect + kv,)


def test_serve_counts_the_kv_caches_of_its_decoding_requests(store, monkeypatch):
    """--decode-concurrency N: the guard counts N KV caches, each as long as a request may
    grow (prompt and answer within the context, or --max-kv-size), says so at start-up, and
    a server whose caches do not fit is refused in one line naming --decode-concurrency."""
    from strata_mlx.apps import server
    from strata_mlx.apps.server import app as server_app
    from strata_mlx.generation.prompt_cache import KVOptions
    from strata_mlx.runtime.loader import sequence_kv_bytes, store_args

    path = store("qwen3_moe")
    context = store_args(path).max_position_embeddings
    r = server_app.kv_reserve(path, 4)
    assert (r.sequences, r.positions) == (4, context)
    assert r.bytes == 4 * memory.kv_cache_bytes(store_args(path), context, itemsize=4)
    assert server_app.kv_reserve(path, 4, None, 100, 50).positions == 150
    assert server_app.kv_reserve(path, 4, KVOptions(max_kv_size=300)).positions == 300
    quantized = server_app.kv_reserve(path, 4, KVOptions(kv_bits=4, kv_group_size=32)).bytes
    assert quantized == 4 * sequence_kv_bytes(path, context, 4, 32) < r.bytes

    class Started(Exception):  # stop once loaded, before the HTTP server runs
        pass

    def started(model, *a, **kw):
        model.expert_cache.close()
        raise Started(model)

    monkeypatch.setattr(server_app, "create_app", started)
    arena_gb = 4 * load_manifest(path).layout.record_bytes / GB
    seen = []
    real = memory.fit_arena
    monkeypatch.setattr(memory, "fit_arena", lambda *a: seen.append(a[2]) or real(*a))
    with pytest.raises(Started) as e:
        server.serve(path, port=0, decode_concurrency=1, prompt_cache_size=0, arena_gb=arena_gb)
    one = seen[-1]  # what the guard counts beside a one-request server's arena
    assert one >= server_app.kv_reserve(path, 1).bytes
    lines = server_app.started_lines("m", path, e.value.args[0], "127.0.0.1", 1, 4, r)
    assert f"memory counted for 4 KV caches of {context} positions" in "\n".join(lines)

    # room for that arena and one request's cache: eight are refused, naming the flag
    monkeypatch.setattr(memory, "available_bytes", lambda: RESERVE + one + int(arena_gb * GB))
    with pytest.raises(Started):
        server.serve(path, port=0, decode_concurrency=1, prompt_cache_size=0, arena_gb=arena_gb)
    with pytest.raises(MemoryGuardError) as refused:
        server.serve(path, port=0, decode_concurrency=8, prompt_cache_size=0, arena_gb=arena_gb)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("--decode-concurrency 8: 8 KV caches of")

    # not asked for: the default is halved until the caches fit, and serve says so
    asked = []
    monkeypatch.setattr(
        server_app, "create_app", lambda m, *a, **kw: asked.append(kw) or started(m)
    )
    with pytest.raises(Started):
        server.serve(path, port=0, prompt_cache_size=0, arena_gb=arena_gb)
    assert asked[-1]["decode_concurrency"] == 1


def test_serve_s_automatic_arena_gives_the_kv_caches_their_share(store, monkeypatch, capsys):
    """No --arena-gb: the KV caches of the default 8 decoding requests come out of the
    arena's share (the arena shrinks, the 8 stay) and serve says so at start-up; --arena-gb
    given in the same memory: the arena stays and the default concurrency is halved."""
    import uvicorn

    from strata_mlx.apps import server
    from strata_mlx.apps.server import app as server_app

    path = store("qwen3_moe")
    m = load_manifest(path)
    record, total = m.layout.record_bytes, m.num_experts * len(m.moe_layers)
    limits = {"max_prompt_tokens": 200, "max_tokens_limit": 16, "prompt_cache_size": 0}
    one = server_app.kv_reserve(path, 1, None, 200, 16).bytes

    class Started(Exception):  # stop where uvicorn would start serving
        pass

    asked = []

    def app(model, *a, **kw):  # what serve needs of the app, nothing that starts threads
        asked.append((model.expert_cache.arena.n_slots, kw["decode_concurrency"]))
        engine = SimpleNamespace(
            decode_concurrency=kw["decode_concurrency"], close=lambda timeout: True
        )
        return SimpleNamespace(state=SimpleNamespace(engine=engine))

    def run(self, sockets=None):
        raise Started

    monkeypatch.setattr(server_app, "create_app", app)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    seen = []
    real = memory.fit_arena
    monkeypatch.setattr(memory, "fit_arena", lambda *a: seen.append(a[2]) or real(*a))
    with pytest.raises(Started):
        server.serve(path, port=0, decode_concurrency=1, arena_gb=record / GB, **limits)
    # room for half the experts beside eight requests' caches
    room = RESERVE + seen[-1] + 7 * one + total // 2 * record
    monkeypatch.setattr(memory, "available_bytes", lambda: room)
    capsys.readouterr()
    for concurrency in (1, None):
        with pytest.raises(Started):
            server.serve(path, port=0, decode_concurrency=concurrency, **limits)
    (alone, _), (shared, n) = asked[-2:]
    assert n == DEFAULT_DECODE_CONCURRENCY and shared < alone <= total
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines()[::-1] if "automatic arena" in x)
    assert f"{DEFAULT_DECODE_CONCURRENCY} KV caches" in line
    assert f"up to {min(8 * one // record, total - shared)} more expert slots" in line

    # the same memory, the arena given as large as the automatic one of one request
    with pytest.raises(Started):
        server.serve(path, port=0, arena_gb=alone * record / GB, **limits)
    assert asked[-1][0] == alone and asked[-1][1] < DEFAULT_DECODE_CONCURRENCY
    assert "automatic arena" not in capsys.readouterr().out


def test_the_guard_counts_a_float32_store_s_cache_at_4_bytes(store, monkeypatch):
    """A float32 store (GGUF files under 2 GB, these tests' stores) computes, and keeps its
    KV cache, in float32: load() and plan count 4 bytes an element, not fp16's 2."""
    from strata_mlx.apps import plan
    from strata_mlx.runtime.loader import prefill_scratch_bytes

    path = store("qwen3_moe")
    assert load_manifest(path).config["torch_dtype"] == "float32"
    seen = []
    real = memory.fit_arena
    monkeypatch.setattr(memory, "fit_arena", lambda *a: seen.append(a[2]) or real(*a))
    model, _ = strata_mlx.load(path, prefill_step_size=300)
    kv = memory.kv_cache_bytes(model.args, 300, itemsize=4)
    assert seen == [prefill_scratch_bytes(model.args, 300) + kv]
    model.expert_cache.close()
    assert plan.from_store(path).kv_itemsize == 4
