"""The decode gate's kernel: a layer's experts wait on the device until their records land.

One thread per (token, expert) pair of a decode layer reads its expert's word in the gate
table (strata_mlx.stream.gate: the slot once the record is in place, -1 until then), polling
it while it is -1, and writes the slot for the expert kernels after it (dispatch.pairs). The
table is host memory mapped into the device's address space, read with volatile loads (each
poll reaches the host's memory, never a cached copy), so a store by a reader thread is seen
within a poll. A pair still waiting after `timeout_us` gives up: it writes slot 0 and sets
`late[0]`, which the decoder reads once a token and answers by recomputing the layer through
the per-layer handshake (its output is then never used): a bug or a stuck read costs time,
never a wrong token. `late[1]` is the longest any pair waited, in microseconds: the time the
device stood still at this gate, read with the flag. A word marked as no read coming (-2: the
table closed; -3: its read failed, or its token was abandoned) gives up at once, and so does
every pair waiting while the table's stop word is set (the reader's watcher sets it while a
device copy is held behind the device: strata_mlx.stream.gate).

CUDA only (MLX's cuda_kernel; `%globaltimer` for the timeout, `__nanosleep` between polls:
sm_70 and later). Metal has no such kernel yet: there the gate is the host's (the check runs
before the layer's experts are queued, and waits for their reads).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx

# A pair waits this long before it gives up (STRATA_MLX_GATE_TIMEOUT_MS): far above a miss's
# read (~0.3-0.6 ms a 1 MB record on a laptop drive, tens of ms behind a queue of prefill
# reads), low enough that a stuck layer costs seconds, not a hang.
TIMEOUT_MS = 5000

# The device's clock and pause (the body below calls only these beyond plain C++).
HEADER = r"""
__device__ __forceinline__ unsigned long long sk_now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void sk_pause() { __nanosleep(200); }
"""

BODY = r"""
  const uint32_t j = threadIdx.x;
  if (j == 0) {  // (one block: `late` zeroed before any pair writes it, no fill kernel)
    late[0] = 0;
    late[1] = 0;
  }
  __syncthreads();
  if (j < K) {
    volatile const int* row = reinterpret_cast<volatile const int*>(row_at[0]);
    volatile const int* stop = reinterpret_cast<volatile const int*>(row_at[1]);
    const int e = (int)ids[j];
    int s = row[e];
    if (s == -1) {
      const unsigned long long t0 = sk_now_ns();
      while (*stop == 0 && sk_now_ns() - t0 <= (unsigned long long)TIMEOUT_US * 1000ull) {
        sk_pause();
        if ((s = row[e]) != -1) break;
      }
      const unsigned long long waited_us = (sk_now_ns() - t0) / 1000ull;
      atomicMax(&late[1], (int)(waited_us < 2147483647ull ? waited_us : 2147483647ull));
    }
    if (s < 0) {  // still -1 (past the timeout, or stopped), closed (-2) or failed (-3)
      late[0] = 1;
      s = 0;
    }
    slots[j] = (uint32_t)s;
  }
"""

_KERNEL: Callable | None = None
LATE_WORDS = 2  # a gate's `late`: its give-up flag, then its longest wait in microseconds


def timeout_ms() -> int:
    """The gate's timeout (TIMEOUT_MS, or STRATA_MLX_GATE_TIMEOUT_MS where set)."""
    env = os.environ.get("STRATA_MLX_GATE_TIMEOUT_MS")
    if env is None:
        return TIMEOUT_MS
    if not env.isdigit() or not 0 < int(env) < 2**31 // 1000:
        raise ValueError(f"STRATA_MLX_GATE_TIMEOUT_MS={env!r}: a whole number of ms, 1 to 2147482")
    return int(env)


def gate(ids: mx.array, row_at: mx.array, timeout: int | None = None) -> tuple[mx.array, mx.array]:
    """ids [k] (one token's routed experts), row_at uint64 [2] (the device addresses of their
    layer's gate-table row and of the table's stop word: GateTable.gate_at) -> (slots uint32
    [k], late int32 [2]: 1 if a pair gave up, then the longest any pair waited in
    microseconds)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.cuda_kernel(
            name="strata_gate",
            input_names=["ids", "row_at"],
            output_names=["slots", "late"],
            source=BODY,
            header=HEADER,
            ensure_row_contiguous=True,
        )
    k = ids.size
    width = -(-k // 32) * 32
    if width > 1024:
        raise ValueError(f"{k} pairs in one gate; at most 1024")
    check_row_at(row_at)
    slots, late = _KERNEL(
        inputs=[ids, row_at],
        grid=(width, 1, 1),
        threadgroup=(width, 1, 1),
        output_shapes=[(k,), (LATE_WORDS,)],
        output_dtypes=[mx.uint32, mx.int32],
        # (MLX's CUDA backend keys a compiled kernel by its name and template arguments
        # only, not its inputs' dtypes: the ids' dtype goes in as one)
        template=[("I", ids.dtype), ("K", k), ("TIMEOUT_US", (timeout or timeout_ms()) * 1000)],
    )
    return slots, late


def check_row_at(row_at: mx.array) -> None:
    """A gate's addresses: the row's, then the stop word's (the kernel reads both)."""
    if row_at.dtype != mx.uint64 or row_at.shape != (2,):
        raise ValueError(f"row_at: uint64 [2] (row, stop word), got {row_at.dtype} {row_at.shape}")


# The routing board's kernel: a layer's ids (its routing, and lookahead's predictions joined to
# it) stored into its board row in mapped host memory, then, once they are visible to the
# host (a system-wide fence), the row's sequence number; the ids also come out as an array,
# which the layer's gate takes as its own, so that the device runs this kernel before the gate
# that waits for the check that reads the board.
BOARD_BODY = r"""
  const uint32_t j = threadIdx.x;
  volatile int* row = reinterpret_cast<volatile int*>(board_at[0]);
  if (j < N) {
    out[j] = ids[j];
    row[1 + j] = (int)ids[j];
  }
  __threadfence_system();
  __syncthreads();
  if (j == 0) {
    __threadfence_system();
    row[0] = seq[0];
  }
"""

BOARD_IDS = 63  # ids a board row holds after its sequence number (stream.gate.BOARD_WIDTH)
_BOARD: Callable | None = None


def board(ids: mx.array, board_at: mx.array, seq: mx.array) -> mx.array:
    """ids [n] (n <= BOARD_IDS), board_at uint64 [1] (the device address of a board row),
    seq int32 [1] -> ids again [n], once written into the row with `seq` after them."""
    global _BOARD
    if _BOARD is None:
        _BOARD = mx.fast.cuda_kernel(
            name="strata_board",
            input_names=["ids", "board_at", "seq"],
            output_names=["out"],
            source=BOARD_BODY,
            ensure_row_contiguous=True,
        )
    n = ids.size
    if n > BOARD_IDS:
        raise ValueError(f"{n} ids for one board row; at most {BOARD_IDS}")
    width = -(-n // 32) * 32
    (out,) = _BOARD(
        inputs=[ids, board_at, seq],
        grid=(width, 1, 1),
        threadgroup=(width, 1, 1),
        output_shapes=[(n,)],
        output_dtypes=[ids.dtype],
        template=[("I", ids.dtype), ("N", n)],
    )
    return out


# The board and the gate as one kernel: a layer's ids (the routing first, lookahead's
# predictions joined after it) into its board row, the sequence number after them, then the
# routing's gate, in one launch a gated layer instead of two (and no slice of the board's
# output between them): the host's build of a gated token does one call less a layer.
BOARD_GATE_BODY = r"""
  const uint32_t j = threadIdx.x;
  volatile int* brow = reinterpret_cast<volatile int*>(board_at[0]);
  if (j == 0) {
    late[0] = 0;
    late[1] = 0;
  }
  if (j < N) brow[1 + j] = (int)ids[j];
  __threadfence_system();
  __syncthreads();
  if (j == 0) {
    __threadfence_system();
    brow[0] = seq[0];
  }
""" + BODY.split("__syncthreads();", 1)[1]

_BOARD_GATE: Callable | None = None


def board_gate(
    ids: mx.array, k: int, board_at: mx.array, seq: mx.array, row_at: mx.array,
    timeout: int | None = None,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """`gate(board(ids, board_at, seq)[:k], row_at)` in one kernel: ids [n] (n <= BOARD_IDS,
    the routing's k first) written into the board row with `seq` after them, then the first
    k gated -> (slots uint32 [k], late int32 [2])."""
    global _BOARD_GATE
    if _BOARD_GATE is None:
        _BOARD_GATE = mx.fast.cuda_kernel(
            name="strata_board_gate",
            input_names=["ids", "board_at", "seq", "row_at"],
            output_names=["slots", "late"],
            source=BOARD_GATE_BODY,
            header=HEADER,
            ensure_row_contiguous=True,
        )
    n = ids.size
    if not 0 < k <= n <= BOARD_IDS:
        raise ValueError(f"{n} ids, {k} of them gated, for one board row of {BOARD_IDS}")
    check_row_at(row_at)
    width = -(-n // 32) * 32
    return tuple(_BOARD_GATE(
        inputs=[ids, board_at, seq, row_at],
        grid=(width, 1, 1),
        threadgroup=(width, 1, 1),
        output_shapes=[(k,), (LATE_WORDS,)],
        output_dtypes=[mx.uint32, mx.int32],
        template=[("I", ids.dtype), ("N", n), ("K", k),
                  ("TIMEOUT_US", (timeout or timeout_ms()) * 1000)],
    ))  # fmt: skip
