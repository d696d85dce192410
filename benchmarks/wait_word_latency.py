"""How late `reader.wait_word` sees a word another thread stores, and what its waits cost.

Gated decode's checks wait in `wait_word` for the routing board's word (the device stores it
into mapped host memory): polled for 100 us, then between 5 us sleeps, which the OS's timer
slack may stretch (Linux's default: 50 us). A word seen late is time on the chain through the
gates (docs/benchmarks.md, "Gated decode"). Here a host thread stands in for the device: it
stores the word after a random 0.2-2 ms (decode's layers are ~0.3-1 ms apart), and the waiter
times from the store to its return, for each timer slack asked (Linux's
prctl(PR_SET_TIMERSLACK) on the waiting thread; 0: the thread's default), with the waiter's
CPU time a wait.

    python benchmarks/wait_word_latency.py [--waits 300] [--slack-ns 0,1000,5000]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time

import numpy as np

from strata_mlx.stream.reader import wait_word

PR_SET_TIMERSLACK = 29


def set_slack(ns: int) -> None:
    """This thread's timer slack (Linux); 0 keeps the default."""
    if ns > 0 and ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0):
        raise OSError("prctl(PR_SET_TIMERSLACK) failed")


def run(waits: int, slack_ns: int) -> tuple[float, float, float]:
    """(median and 90th percentile us from a store to wait_word's return, the waiter's CPU
    us a wait)."""
    word = np.zeros(1, dtype=np.int32)
    seen: list[int] = []
    cpu: list[float] = []
    ready = threading.Event()

    failed: list[BaseException] = []

    def waiter() -> None:
        try:
            set_slack(slack_ns)
            c0 = time.thread_time()
            for i in range(1, waits + 1):
                ready.set()
                if wait_word(word.ctypes.data, i, 5.0) is None:
                    raise RuntimeError("a word not seen in 5 s")
                seen.append(time.perf_counter_ns())
            cpu.append(time.thread_time() - c0)
        except (OSError, RuntimeError) as e:  # (raised by the main thread, which waits on it)
            failed.append(e)
            ready.set()

    rng = np.random.default_rng(0)
    stores = []
    t = threading.Thread(target=waiter)
    t.start()
    for i in range(1, waits + 1):
        ready.wait()
        ready.clear()
        if failed:
            raise failed[0]
        delay, t0 = rng.uniform(0.2e-3, 2e-3), time.perf_counter()
        while time.perf_counter() - t0 < delay:  # (a busy wait: the waiter is in wait_word)
            pass
        stores.append(time.perf_counter_ns())
        word[0] = i
        while len(seen) < i and not failed:  # (asleep: the waiter takes the GIL back at once)
            time.sleep(0.0005)
        if failed:
            raise failed[0]
    t.join()
    late = (np.array(seen) - np.array(stores)) / 1e3
    return float(np.median(late)), float(np.percentile(late, 90)), cpu[0] / waits * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waits", type=int, default=300)
    ap.add_argument("--slack-ns", default="0,1000", help="timer slacks, ns (0: the default)")
    a = ap.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("wait_word_latency.py: the timer slack is Linux's (prctl)")
    for ns in (int(v) for v in a.slack_ns.split(",")):
        try:
            med, p90, cpu = run(a.waits, ns)
        except (OSError, RuntimeError) as e:
            sys.exit(f"wait_word_latency.py: timer slack {ns} ns: {e}")
        name = "default" if ns == 0 else f"{ns} ns"
        print(
            f"timer slack {name}: seen {med:.1f} us after the store (p90 {p90:.1f}); "
            f"the waiter's CPU {cpu:.0f} us a wait"
        )


if __name__ == "__main__":
    main()
