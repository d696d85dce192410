"""`bench --plot FILE.png`: pictures of a bench run (matplotlib, the optional extra `plot`).

Owns the per-layer counters a bench run records (LayerCounts, attached beside the expert
cache, never inside it) and the figure: per layer hits / streamed-ahead / misses of the cold
prefill; per chunk the drive's GB/s against the probe, and chunk time against the floors;
decode ms/token split into exposed wait, routing sync, host Python and the rest (compute).
Never changes what the cache does: the counters are the cache's own, read around each layer.
"""

from __future__ import annotations

from pathlib import Path

from ..config import OptionError

COUNTERS = ("hits", "streamed_ahead", "misses")


class LayerCounts:
    """Hits, streamed-ahead and misses per layer: the cache's counters read before and after
    each of its per-layer entry points (run_layer, and check_deferred for pipelined decode)
    and the difference credited to that layer.

    What is counted goes to the open span until `cut(phase)` closes it under `phase`. Bench
    cuts where it snapshots the cache's own stats (after each prefill chunk, after the first
    token, after decode), so each phase's per-layer counts add up exactly to that phase's
    ExpertStats. (The cache's `decoding` flag is no such boundary: the last prompt token's
    forward runs with it off, in no chunk, and pipelined decode verifies that forward's
    layers with it on.)"""

    def __init__(self, cache):
        self.cache = cache
        self.counts: dict[str, dict[int, list[int]]] = {}
        # filled with every MoE layer up front: a reader on another thread (the dashboard)
        # then never sees the dict change size
        self._open: dict[int, list[int]] = self._empty()
        self._wrap("run_layer", lambda a: a[0])
        self._wrap("check_deferred", lambda a: a[0].layer)

    def _empty(self) -> dict[int, list[int]]:
        return {int(l): [0, 0, 0] for l in self.cache.layers}

    def _wrap(self, name: str, layer_of) -> None:
        inner = getattr(self.cache, name)

        def counted(*a, **kw):
            st = self.cache.stats
            before = [getattr(st, c) for c in COUNTERS]
            out = inner(*a, **kw)
            st = self.cache.stats  # warm() and resets replace the object
            row = self._open.setdefault(int(layer_of(a)), [0, 0, 0])
            for i, c in enumerate(COUNTERS):
                row[i] += max(getattr(st, c) - before[i], 0)
            return out

        setattr(self.cache, name, counted)

    def open(self) -> dict[int, list[int]]:
        """A copy of the counts since the last cut (all of them, where nothing cuts)."""
        return {l: list(v) for l, v in list(self._open.items())}

    def cut(self, phase: str) -> None:
        """Close the open span: its counts are added to `phase`'s."""
        rows = self.counts.setdefault(phase, {})
        for l, v in self._open.items():
            if any(v):
                row = rows.setdefault(l, [0, 0, 0])
                for i in range(len(COUNTERS)):
                    row[i] += v[i]
        self._open = self._empty()

    def take(self) -> dict[str, dict[int, list[int]]]:
        """The counts per phase cut since the last take (then zero)."""
        out, self.counts = self.counts, {}
        return out


def figures(runs, fake, ssd_gbps: float) -> list[dict]:
    """What the picture shows, per run, as plain numbers (kept in bench's JSON too)."""
    compute_floor = sum(c.wall_s for c in fake.chunks) / max(len(fake.chunks), 1)
    out = []
    for run in runs:
        d, n = run.decode, max(run.decode_tokens, 1)
        per_tok = run.decode_s / n * 1e3
        wait, sync, host = (
            d.exposed_wait_s / n * 1e3,
            d.route_sync_s / n * 1e3,
            d.host_s / n * 1e3,
        )
        out.append(
            {
                "policy": run.policy,
                "phase": run.phase,
                "layers": getattr(run, "layers", None),
                "chunks": [
                    {
                        "ms": c.wall_s * 1e3,
                        "gb_per_s": c.gb_per_s,
                        "ssd_floor_ms": c.bytes_read / (ssd_gbps * 1e9) * 1e3 if ssd_gbps else 0.0,
                        "compute_floor_ms": compute_floor * 1e3,
                    }
                    for c in run.chunks
                ],
                "decode_ms": {
                    "wait": wait,
                    "sync": sync,
                    "host": host,
                    "rest": max(per_tok - wait - sync - host, 0.0),
                },
            }
        )
    return out


def require() -> None:
    """Fail before a bench run, not after it, where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise OptionError('--plot needs matplotlib: pip install "strata-mlx[plot]"') from None


def plot_bench(result: dict, path: str | Path) -> Path:
    """Write the bench figure of `result` (bench() with its "plot" figures) to a PNG."""
    require()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["plot"]
    cold = [r for r in runs if r["phase"] == "cold"] or runs
    colour = policy_colours([r["policy"] for r in runs])
    n_chunks = max((len(r["chunks"]) for r in cold), default=1)
    fig, ax = plt.subplots(2, 2, figsize=(15, 8.5))
    fig.suptitle(
        f"{Path(result['store']).name}: {result['prompt_tokens']} tokens in chunks of "
        f"{result['prefill_step_size']}, arena {result['arena_gb']:.2f} of "
        f"{result['expert_gb']:.2f} GB of experts"
    )
    _layers_panel(ax[0][0], cold)
    _bandwidth_panel(ax[0][1], cold, result["ssd_gbps"], colour, n_chunks)
    _chunk_time_panel(ax[1][0], cold, colour, n_chunks)
    _decode_panel(ax[1][1], runs)
    fig.tight_layout()
    path = Path(path)
    from ..format.store import write_atomic

    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    finally:
        plt.close(fig)
    return path


def _layers_panel(a, cold: list[dict]) -> None:
    """Per layer, the cold prefill of the last policy that recorded layers."""
    shown = next((r for r in reversed(cold) if (r["layers"] or {}).get("prefill")), None)
    if shown is None:
        a.set_title("per layer: not recorded")
        return
    rows = shown["layers"]["prefill"]
    layers = sorted(rows, key=int)
    bottom = [0] * len(layers)
    for i, (name, color) in enumerate(
        zip(("resident", "streamed ahead", "misses"), ("tab:green", "tab:cyan", "tab:red"))
    ):
        vals = [rows[l][i] for l in layers]
        a.bar([str(l) for l in layers], vals, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a.set_title(f"per layer, cold prefill ({shown['policy']})")
    a.set_xlabel("layer")
    a.set_ylabel("expert lookups")
    _legend_beside(a)


def _bandwidth_panel(a, cold: list[dict], ssd_gbps: float, colour: dict, n_chunks: int) -> None:
    """Each cold chunk's read GB/s against the drive's probe."""
    from matplotlib.ticker import MaxNLocator

    for r in cold:
        a.plot(
            [c["gb_per_s"] for c in r["chunks"]],
            marker="o",
            markersize=8,
            label=r["policy"],
            color=colour[r["policy"]],
        )
    a.axhline(ssd_gbps, color="k", linestyle="--", label="probe-ssd")
    a.set_title("drive GB/s per chunk (cold)")
    a.set_xlabel("chunk")
    a.set_ylabel("GB/s")
    _chunk_axis(a, n_chunks, MaxNLocator)
    _legend_beside(a)


def _chunk_time_panel(a, cold: list[dict], colour: dict, n_chunks: int) -> None:
    """Each cold chunk's time against its SSD floor and the compute floor."""
    from matplotlib.ticker import MaxNLocator

    for r in cold:
        c_ = colour[r["policy"]]
        a.plot([c["ms"] for c in r["chunks"]], marker="o", markersize=8,
               label=f"{r['policy']} chunk", color=c_)  # fmt: skip
        a.plot([c["ssd_floor_ms"] for c in r["chunks"]], linestyle=":", marker="_",
               markersize=14, label=f"{r['policy']} SSD floor", color=c_)  # fmt: skip
    if cold and cold[0]["chunks"]:
        floor = cold[0]["chunks"][0]["compute_floor_ms"]
        a.axhline(floor, color="k", linestyle="--", label="compute floor")
    a.set_title("chunk time against the floors (cold)")
    a.set_xlabel("chunk")
    a.set_ylabel("ms")
    _chunk_axis(a, n_chunks, MaxNLocator)
    _legend_beside(a)


def _decode_panel(a, runs: list[dict]) -> None:
    """Each run's decode ms/token split into wait, sync, host and the rest."""
    names = [f"{r['policy']}\n{r['phase']}" for r in runs]
    bottom = [0.0] * len(runs)
    for part, color in zip(
        ("wait", "sync", "host", "rest"), ("tab:red", "tab:orange", "tab:purple", "tab:gray")
    ):
        vals = [r["decode_ms"][part] for r in runs]
        label = "compute and the rest" if part == "rest" else part
        a.bar(names, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a.set_title("decode ms/token")
    a.set_ylabel("ms/token")
    _legend_beside(a)


POLICY_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink")


def policy_colours(policies: list[str]) -> dict[str, str]:
    """One colour per policy, the same in every panel (in the order the policies first run)."""
    order = list(dict.fromkeys(policies))
    return {p: POLICY_COLOURS[i % len(POLICY_COLOURS)] for i, p in enumerate(order)}


def _chunk_axis(a, n_chunks: int, locator) -> None:
    """Chunks are whole numbers; the y axis starts at 0, so one chunk is a point on a scale
    of its own size, not a dot in the middle of a +-4 % band."""
    if n_chunks <= 20:
        a.set_xticks(range(max(n_chunks, 1)))
    else:
        a.xaxis.set_major_locator(locator(integer=True))
    a.set_xlim(-0.5, max(n_chunks, 1) - 0.5)
    top = a.get_ylim()[1]
    a.set_ylim(0, top * 1.1 if top > 0 else 1)


def _legend_beside(a) -> None:
    """The legend right of its panel, off the data."""
    a.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)
