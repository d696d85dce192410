"""MLX on threads of our own (the server's worker, a dropped cache's close, a prompt-cache
flush at shutdown).

MLX keeps streams per thread and requires every thread but the main one that used it to
destroy them (`mx.clear_streams()`) before it ends; otherwise their teardown may race the
interpreter's at exit and abort the process ("terminate called without an active
exception", exit 134: 14 of 18 runs of a generation on a second thread with the CPU build of
MLX 0.32.4). Never starts threads itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import mlx.core as mx

T = TypeVar("T")


def end_mlx_thread() -> None:
    """The calling thread runs no more MLX work: its streams go."""
    mx.clear_streams()


def last_on_thread(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` as a thread's last MLX work: its streams go after it, even when it raises."""
    try:
        return fn(*args)
    finally:
        end_mlx_thread()
