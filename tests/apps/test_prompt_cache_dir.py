"""Prompt caches kept on disk (strata_mlx.apps.prompt_cache_dir, `serve --prompt-cache-dir`): a
restarted server, or one whose memory evicted a conversation, continues it prefilling only the
new turn, answering what a cold prefill answers; the directory is bounded oldest first and
files it cannot use are dropped (broken) or left alone (another model's, other KV options)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx2 as httpx
import mlx.core as mx
import pytest
import test_server
from conftest import wait_until_serving
from test_cli import _error_line, run
from test_server import NAME, free_port, load_tiny, running

import strata_mlx
from strata_mlx.apps.prompt_cache_dir import PromptCacheDir, SpillingPromptCacheLRU, attach
from strata_mlx.apps.server import create_app
from strata_mlx.models.base import KVCache

tiny = test_server.tiny  # the tiny store with a tokenizer: a fixture

FIRST = [{"role": "user", "content": "tell me a story about a red fox"}]


def post_chat(base: str, messages: list[dict], max_tokens: int = 6) -> str:
    body = {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    with httpx.Client(trust_env=False, timeout=60) as http:
        r = http.post(base + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]


def server_stats(base: str) -> dict:
    with httpx.Client(trust_env=False, timeout=60) as http:
        return http.get(base + "/v1/stats").json()["server"]


def ids_of(tok, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def test_a_restarted_server_continues_a_conversation_from_disk(tiny, tmp_path):
    d = tmp_path / "sessions"
    model, tok = load_tiny(tiny)
    try:
        app = create_app(model, tok, NAME)
        attach(app, d)
        with running(app) as base:
            answer = post_chat(base, FIRST)
            assert server_stats(base)["prompt_cache"]["disk"]["files"] == 0  # in memory only
        # shut down: what memory held is on disk
        assert len(list(d.glob("*.safetensors"))) == 1
    finally:
        model.expert_cache.close()

    second = FIRST + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "what is the capital of france"},
    ]
    ids = ids_of(tok, second)
    model, tok = load_tiny(tiny)  # a new process's model: nothing in memory
    try:
        cold = strata_mlx.generate(model, tok, ids, max_tokens=6)
        app = create_app(model, tok, NAME)
        attach(app, d)
        with running(app) as base:
            assert server_stats(base)["prompt_cache"]["disk"]["files"] == 1
            assert post_chat(base, second) == cold  # the resumed state answers as a cold one
            s = server_stats(base)
    finally:
        model.expert_cache.close()
    disk = s["prompt_cache"]["disk"]
    assert disk["hits"] == 1 and s["prompt_cache"]["hits"] == 1
    reused = disk["reused_tokens"]
    assert reused >= len(ids_of(tok, FIRST))  # at least the first turn's prompt came from disk
    assert s["prefilled_tokens"] == len(ids) - reused  # only the rest was prefilled


def test_a_conversation_whose_cache_memory_gave_up_resumes_from_disk(tiny, tmp_path):
    d = tmp_path / "sessions"
    model, tok = load_tiny(tiny)
    try:
        app = create_app(model, tok, NAME)
        app.state.engine.prompt_caches.max_entries = 1  # memory keeps one conversation
        caches = attach(app, d)
        assert caches.max_entries == 1
        other = [{"role": "user", "content": "a dog ran in the park"}]
        with running(app) as base:
            answer = post_chat(base, FIRST)
            # the other conversation shares the template's first tokens: it takes the first
            # one's cache and trims it, after writing it to disk
            post_chat(base, other)
            s = server_stats(base)["prompt_cache"]
            assert (s["entries"], s["disk"]["files"], s["disk"]["written"]) == (1, 1, 1)
            second = FIRST + [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "the cat sat"},
            ]
            before = server_stats(base)["prefilled_tokens"]
            post_chat(base, second)
            s = server_stats(base)
        assert s["prompt_cache"]["disk"]["hits"] == 1
        reused = s["prompt_cache"]["disk"]["reused_tokens"]
        assert reused >= len(ids_of(tok, FIRST))
        assert s["prefilled_tokens"] - before == len(ids_of(tok, second)) - reused
    finally:
        model.expert_cache.close()


def _cache(model, n: int) -> list:
    """A state of `n` positions for each of the tiny model's layers."""
    a = mx.zeros((1, 2, n, 8))
    return [KVCache.from_saved({"keys": a, "values": a}, {"offset": n}) for _ in model.layers]


def test_the_directory_is_bounded_oldest_first_and_skips_what_it_cannot_use(tiny, tmp_path):
    model, _ = load_tiny(tiny)
    try:
        d = PromptCacheDir(tmp_path, model)
        d.put([1, 2, 3], _cache(model, 3))
        one = d.nbytes
        # room for two files of this size: the third written drops the least recently used
        d = PromptCacheDir(tmp_path, model, max_bytes=2 * one + one // 2)
        assert len(d) == 1  # indexed from the file's metadata
        d.put([4, 5, 6], _cache(model, 3))
        cache, n = d.take([1, 2, 3, 9])  # reading [1, 2, 3] makes it the most recent
        assert n == 3 and [c.offset for c in cache] == [3, 3]
        d.put([7, 8, 9], _cache(model, 3))
        assert sorted(e.tokens for e in d._entries.values()) == [[1, 2, 3], [7, 8, 9]]
        assert len(list(tmp_path.glob("*.safetensors"))) == 2 and d.dropped == 1
        # a state that extends a kept one replaces it
        d.put([1, 2, 3, 4], _cache(model, 4))
        assert sorted(e.tokens for e in d._entries.values()) == [[1, 2, 3, 4], [7, 8, 9]]
        assert d.take([5, 5]) == (None, 0)  # no common prefix
        cache, n = d.take([7, 8, 5])  # a prefix of a kept state: trimmed to it
        assert n == 2 and [c.offset for c in cache] == [2, 2]

        # another model's file and a stranger's are left alone; a broken one of ours dropped
        (tmp_path / "notes.safetensors").write_bytes(b"not a safetensors file")
        elsewhere = PromptCacheDir(tmp_path / "elsewhere", model)
        elsewhere.put([1, 1], _cache(model, 2))
        raw = elsewhere.file_for([1, 1]).read_bytes()
        n_header = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n_header])
        header["__metadata__"]["store_id"] = "0" * 64  # as another store's
        foreign = tmp_path / "foreign.safetensors"
        foreign.write_bytes(
            raw[:8] + json.dumps(header).encode().ljust(n_header) + raw[8 + n_header :]
        )
        broken = d.file_for([7, 8, 9])
        raw = broken.read_bytes()
        broken.write_bytes(raw[: 8 + int.from_bytes(raw[:8], "little") + 16])  # tensors cut
        d = PromptCacheDir(tmp_path, model, max_bytes=2 * one + one // 2)
        assert sorted(e.tokens for e in d._entries.values()) == [[1, 2, 3, 4], [7, 8, 9]]
        assert d.take([7, 8, 9, 1]) == (None, 0) and not broken.exists()
        assert foreign.exists() and (tmp_path / "notes.safetensors").exists()
        # a file made under other KV options (a server started with --max-kv-size): not
        # used by it, and kept for a server with the options it was made under
        from strata_mlx.generation.prompt_cache import KVOptions

        rotating = PromptCacheDir(tmp_path, model, kv=KVOptions(max_kv_size=16))
        assert rotating.take([1, 2, 3, 4, 5]) == (None, 0)
        assert d.file_for([1, 2, 3, 4]).exists() and rotating.dropped == 0
        assert PromptCacheDir(tmp_path, model).take([1, 2, 3, 4, 5])[1] == 4

        # what the in-memory caches evict is written to the directory
        lru = SpillingPromptCacheLRU(d, max_entries=1)
        lru.put([3, 3, 3], _cache(model, 3))
        assert not d.file_for([3, 3, 3]).exists()
        lru.put([4, 4, 4], _cache(model, 3))
        assert d.file_for([3, 3, 3]).exists() and not d.file_for([4, 4, 4]).exists()
        lru.flush()
        assert d.file_for([4, 4, 4]).exists() and len(lru) == 1
    finally:
        model.expert_cache.close()


def test_prompt_cache_dir_that_is_a_file_is_a_one_line_error(tmp_path):
    f = tmp_path / "sessions"
    f.write_text("")
    line = _error_line(run("serve", "--model", tmp_path / "no-store", "--prompt-cache-dir", f))
    assert line == f"error: --prompt-cache-dir {f}: not a directory"


def test_prompt_cache_dir_bytes_must_be_positive(tmp_path):
    line = _error_line(
        run("serve", "--model", tmp_path / "no-store", "--prompt-cache-dir-bytes", "0")
    )
    assert "--prompt-cache-dir-bytes" in line


def test_a_failed_write_keeps_nothing_and_fails_nothing(tiny, tmp_path, monkeypatch):
    import errno

    import strata_mlx.apps.prompt_cache_dir as pcd

    def full_disk(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    model, _ = load_tiny(tiny)
    try:
        d = PromptCacheDir(tmp_path, model)
        monkeypatch.setattr(pcd, "save_prompt_cache", full_disk)
        d.put([1, 2, 3], _cache(model, 3))
        assert (len(d), d.written, d.failed_writes) == (0, 0, 1)
        assert d.stats()["failed_writes"] == 1
    finally:
        model.expert_cache.close()


def test_a_write_that_fails_at_shutdown_is_said_once(tiny, tmp_path, monkeypatch, capsys):
    import strata_mlx.apps.prompt_cache_dir as pcd

    def read_only(*a, **kw):
        raise OSError(30, "Read-only file system")

    model, tok = load_tiny(tiny)
    try:
        app = create_app(model, tok, NAME)
        attach(app, tmp_path / "sessions")
        monkeypatch.setattr(pcd, "save_prompt_cache", read_only)
        with running(app) as base:
            post_chat(base, FIRST)
    finally:
        model.expert_cache.close()
    err = capsys.readouterr().err
    assert "1 conversation(s) not written to --prompt-cache-dir" in err
    assert "Read-only file system" in err


def _serve(tiny, d, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "strata_mlx", "serve", "--model", str(tiny), "--port", str(port)]
    cmd += ["--model-name", NAME, "--log-level", "warning", "--prompt-cache-dir", str(d)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_until_serving([proc], lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models"))
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), proc.stdout.read().decode()


def test_serve_prompt_cache_dir_across_a_sigterm_restart(tiny, tmp_path):
    """The flag as a user gives it: stopped by SIGTERM, restarted, the conversation resumes."""
    d = tmp_path / "sessions"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _serve(tiny, d, port)
    try:
        answer = post_chat(base, FIRST)
        _stop(proc)
        assert len(list(d.glob("*.safetensors"))) == 1
        proc = _serve(tiny, d, port)
        second = FIRST + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "the cat sat"},
        ]
        post_chat(base, second)
        s = server_stats(base)
        assert s["prompt_cache"]["disk"]["hits"] == 1
        assert (
            s["prefilled_tokens"] == s["prompt_tokens"] - s["prompt_cache"]["disk"]["reused_tokens"]
        )
        _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_resume_benchmark_prefills_only_the_new_turn(tiny, tmp_path, monkeypatch):
    """benchmarks/resume_ttft.py --in-process: the conversation's state goes to disk through
    the server's PromptCacheDir, the resumed turn prefills only its new tokens, the cold one
    all of them, and the rows say so."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "resume_ttft.py"
    spec = importlib.util.spec_from_file_location("resume_ttft", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    argv = [str(path), str(tiny), "--in-process", "--prompt-tokens", "24", "--turn-tokens", "4"]
    argv += ["--rounds", "1", "--vocab", "50", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert (rows["resumed"]["prefilled"], rows["resumed"]["reused"]) == (4, 24)
    assert rows["resumed"]["disk_hits"] == 1
    assert (rows["cold"]["prefilled"], rows["cold"]["reused"]) == (28, 0)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_hybrid_model_s_state_reaches_the_disk_at_shutdown_and_resumes(
    store, tmp_path, concurrency
):
    """A gated-delta-net model's recurrent state is computed on the engine's worker thread
    and written to disk at shutdown from another one (MLX streams are per thread): the
    restarted server resumes the conversation from it, prefilling only the new turn; one
    request at a time and batched."""
    path = store("qwen3_next")
    d = tmp_path / "sessions"
    first = list(range(1, 41))
    body = {"model": NAME, "prompt": first, "max_tokens": 1, "temperature": 0}
    for _ in ("first turn", "next turn"):
        model, tok = strata_mlx.load(path)  # no tokenizer: prompts as token ids
        try:
            app = create_app(model, tok, NAME, decode_concurrency=concurrency)
            attach(app, d)
            with running(app) as base, httpx.Client(trust_env=False, timeout=60) as http:
                r = http.post(base + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                s = server_stats(base)
        finally:
            model.expert_cache.close()
        assert len(list(d.glob("*.safetensors"))) == 1
        body["prompt"] = first + [5, 6, 7, 8]
    assert s["prompt_cache"]["disk"]["hits"] == 1
    assert s["prefilled_tokens"] == 4
