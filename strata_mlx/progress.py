"""One line of progress on stderr for a long step, in any layer: `StatusLine` (where the step
is and the time elapsed, redrawn each second) and `ticking` (a step that reports nothing as it
goes). Counted work with a total of its own (conversion's experts, warm()) keeps tqdm's bars."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager


class StatusLine:
    """Where a long command is, on one line of stderr: by default the text last `set` and the
    time since the line was made (`bar`: tqdm's own arguments instead, such as a total and a
    unit, with `count`), redrawn each second by a timer thread (one step, such as a prefill
    chunk on a CPU, can take tens of seconds), shown once the command has run `delay` seconds
    (DELAY_S unless given) and only where stderr is a terminal (None: tqdm's own test) unless
    `enabled` says. `echo` prints a line of output above it. `poll()`, where given, is asked
    at each draw for a text shown after the rest (where a step is inside itself: a prefill
    chunk's MoE layer). At close the line is cleared, or with `leave` kept as last drawn."""

    DELAY_S = 2.0

    def __init__(
        self,
        file=None,
        enabled: bool | None = None,
        delay: float | None = None,
        leave: bool = False,
        poll=None,
        **bar,
    ):
        from tqdm import tqdm

        self.delay = self.DELAY_S if delay is None else delay
        self.leave = leave
        self.poll = poll
        self.bar = tqdm(
            **{"bar_format": "{desc} [{elapsed}]", **bar},
            file=file or sys.stderr,
            delay=self.delay,
            leave=False,
            disable=None if enabled is None else not enabled,
        )
        self.done = threading.Event()
        self.thread = None
        self.shown = False  # (tqdm's own close clears only a bar its updates drew)
        if not self.bar.disable:
            self.thread = threading.Thread(target=self._redraw, daemon=True)
            self.thread.start()

    def set(self, text: str) -> None:
        self.bar.set_description_str(text, refresh=False)

    def count(self, n: int) -> None:
        """The steps done (a bar with a total), drawn now once its delay has passed."""
        if self.bar.disable:
            return
        with self.bar.get_lock():
            self.bar.n = n
            self._draw()

    def echo(self, line: str) -> None:
        import typer

        if self.bar.disable:
            typer.echo(line)
            return
        with self.bar.get_lock():
            if self.shown:
                self.bar.clear(nolock=True)
            typer.echo(line)
            self._draw()

    def _draw(self) -> None:
        if self.bar.desc and not self.done.is_set() and time_since(self.bar) >= self.delay:
            if self.poll is not None:
                self.bar.set_postfix_str(self.poll(), refresh=False)
            self.bar.refresh(nolock=True)
            self.shown = True

    def _redraw(self) -> None:
        while not self.done.wait(1.0):
            with self.bar.get_lock():
                self._draw()

    def close(self) -> None:
        if self.done.is_set():
            return
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        if self.leave and not self.bar.disable and time_since(self.bar) >= self.delay:
            self.shown = True  # (past its delay: kept, drawn or not yet by the timer)
        if self.shown and self.leave:  # tqdm's close draws it a last time and keeps it, if it
            self.bar.leave = True  # thinks it was drawn (the timer's draws are not counted)
            self.bar.last_print_t = time.time()  # (tqdm's clock)
        elif self.shown:
            self.bar.clear()
        self.bar.close()


@contextmanager
def ticking(desc: str, enabled: bool = True):
    """A line for one long step that reports nothing as it goes (gguf-py's header parse:
    seconds for a tokenizer of 49 K entries): `desc` and its elapsed time, shown from 1 s on
    (a quick step prints nothing, so an error after it stays one line) and kept at the end,
    as conversion's bars are; on any stderr, as they are."""
    line = StatusLine(enabled=enabled, delay=1.0, leave=True, desc=desc,
                      bar_format="{desc}: {elapsed}")  # fmt: skip
    try:
        yield
    finally:
        line.close()


def time_since(bar) -> float:
    """Seconds since `bar` (a tqdm, whose clock is time.time) started."""
    return time.time() - bar.start_t
