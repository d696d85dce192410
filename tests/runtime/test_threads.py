"""MLX on threads of our own (strata_mlx.runtime.threads): a thread that generated and ends its
streams lets the process exit cleanly (without it, MLX 0.32.4's CPU build aborted the exit of
most such runs: "terminate called without an active exception"); the server's worker and a
dropped cache's closing thread end theirs."""

from __future__ import annotations

import subprocess
import sys
import threading

import mlx.core as mx

from strata_mlx.runtime import threads

SCRIPT = """
import sys, threading
import strata_mlx
from strata_mlx.generation.generate import stream_generate
from strata_mlx.runtime.threads import last_on_thread

model, _ = strata_mlx.load(sys.argv[1], arena_gb=0.001)

def generate():
    for r in stream_generate(model, None, list(range(3, 27)), 4, temp=0.7):
        pass

t = threading.Thread(target=last_on_thread, args=(generate,))
t.start()
t.join()
print("generated")
"""


def test_a_generation_on_a_thread_that_ends_its_streams_exits_cleanly(store):
    path = store("qwen3_moe")
    for _ in range(4):
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0 and "generated" in r.stdout, (r.returncode, r.stderr[-2000:])


def cleared_on(monkeypatch) -> list[str]:
    """The names of the threads that end their MLX streams, in order."""
    names: list[str] = []
    monkeypatch.setattr(mx, "clear_streams", lambda: names.append(threading.current_thread().name))
    return names


def test_last_on_thread_ends_the_streams_even_when_it_raises(monkeypatch):
    names = cleared_on(monkeypatch)
    assert threads.last_on_thread(lambda a: a + 1, 1) == 2

    def fails():
        raise ValueError("x")

    try:
        threads.last_on_thread(fails)
    except ValueError:
        pass
    assert names == ["MainThread", "MainThread"]


def test_the_server_worker_ends_its_streams_at_close(store, monkeypatch):
    import strata_mlx
    from strata_mlx.apps.server.engine import Engine

    model, _ = strata_mlx.load(store("qwen3_moe"), arena_gb=0.001)
    names = cleared_on(monkeypatch)
    engine = Engine(model, None)
    worker = engine._executor.submit(lambda: threading.current_thread().name).result()
    assert engine.close(10)
    engine._executor.shutdown(wait=True)
    assert names == [worker] and worker.startswith("strata-generate")
    model.expert_cache.close()


def test_closing_the_server_engine_twice_is_harmless(monkeypatch):
    """Engine.close() is idempotent (it was before its worker's last task ended the streams):
    a second call hands the shut-down executor nothing and only waits, and the worker's
    streams end once."""
    from strata_mlx.apps.server.engine import Engine

    names = cleared_on(monkeypatch)
    engine = Engine(None, None)
    assert engine.close(10) and engine.close(10)
    engine._executor.shutdown(wait=True)
    assert len(names) == 1


def test_a_dropped_cache_closes_on_a_thread_that_ends_its_streams(store, monkeypatch):
    import gc

    import strata_mlx

    names = cleared_on(monkeypatch)
    model, _ = strata_mlx.load(store("qwen3_moe"), arena_gb=0.001)
    sched = model.expert_cache.sched
    del model
    gc.collect()
    for t in threading.enumerate():
        if t.name == "strata-mlx-close":
            t.join(30)
    assert sched.closed and names and set(names) == {"strata-mlx-close"}
