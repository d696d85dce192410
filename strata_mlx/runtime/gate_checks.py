"""Gated decode's checks on a thread of their own.

With the device gate (strata_mlx.runtime.deferred, "gated" layers) a layer's experts wait on
the device until the reads its check submits land, and that check runs on the host once the
layer's routing is known. Run by the thread that builds the token, a check can be held up
behind anything that thread does meanwhile; and some of that waits for the device itself:
MLX's evaluation may allocate, and a CUDA allocation or free can synchronize the device
(measured on the H200: an `async_eval` of the next layer held the host for the gate's whole
timeout, the gate meanwhile waiting for the check behind it). Checked here instead, by one
thread in the order the layers were built, a layer's reads go out as soon as its routing is
known, whatever the building thread waits for.

A check that raises (a failed read, the cache closed) ends the checks queued behind it and
marks every gate-table word not landed FAILED (their gates give up at once); the error is
raised by the next `wait`. Never builds an MLX graph: a check only waits for arrays the
building thread scheduled and reads them.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable

from ..stream.scheduler import CLOSED
from .threads import end_mlx_thread


class GateChecks:
    """`check(d)` for each submitted gated layer `d`, in order, on a thread started at the
    first; `fail()` when one raises. `check` is a bound method, held weakly: the thread
    keeps no model alive (it ends once its owner is gone)."""

    def __init__(self, check: Callable, fail: Callable[[], None]):
        self._check, self._fail = weakref.WeakMethod(check), fail
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._running = False  # a check is running (taken off the queue)
        self._closed = False
        # cancel() or close() began: a check waiting on the device gives up (RoutingBoard)
        self.stopping = False

    def submit(self, d) -> None:
        """Check `d` after the layers submitted before it."""
        with self._cond:
            if self._closed:
                raise RuntimeError(CLOSED)
            self._queue.append(d)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="strata-mlx-gate-checks", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def wait(self, d) -> None:
        """Until `d`'s check has run; raises the error of a check that failed meanwhile, or
        RuntimeError(CLOSED) where the checks were closed before it ran."""
        with self._cond:
            while not d.gated.done and self._error is None and not self._closed:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            if not d.gated.done:
                raise RuntimeError(CLOSED)

    def drain(self) -> None:
        """Until every submitted check has run or been dropped (no error raised)."""
        with self._cond:
            while self._queue or self._running:
                self._cond.wait()

    def cancel(self) -> None:
        """Checks queued are dropped (a token stopped by an error); returns once the one
        running, if any, has ended."""
        with self._cond:
            self.stopping = True
            self._queue.clear()
            self._cond.notify_all()
        self.drain()

    def reset(self) -> None:
        """A generation starts: a failed check's error, raised or not, is forgotten."""
        self.drain()
        with self._cond:
            self._error = None
            self.stopping = False

    def close(self) -> None:
        """Checks queued are dropped (their gates give up: the table is closing too); the
        thread ends after the check running, if any."""
        with self._cond:
            self._closed = self.stopping = True
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closed:
                        if not self._cond.wait(timeout=1.0) and self._check() is None:
                            return  # the owner was collected without close()
                    if not self._queue:
                        return
                    d = self._queue.popleft()
                    self._running = True
                error, check = None, self._check()
                try:
                    if check is None:
                        raise RuntimeError(CLOSED)
                    check(d)
                except BaseException as e:  # raised on the decoding thread by `wait`
                    error = e
                finally:
                    check = None
                with self._cond:
                    self._running = False
                    d.gated.done = True
                    if error is not None:
                        self._error = error
                        self._queue.clear()
                        self._fail()
                    self._cond.notify_all()
        finally:
            end_mlx_thread()
