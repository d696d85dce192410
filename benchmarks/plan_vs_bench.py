"""`strata-mlx plan` against `strata-mlx bench`, on the tests' tiny stores or on any store.

    python benchmarks/plan_vs_bench.py [--families qwen3_moe,qwen3_next] [-p 64] [-g 32]
        [--prefill-step-size 16] [--slots-share 0.3] [--out DIR] [--json FILE]
    python benchmarks/plan_vs_bench.py --store PATH|builtin [--arena-gb A] [--rounds N] ...

Each family's store is built as tests/conftest.py builds it (transformers' tiny model, random
weights, converted with a 64-token calibration), or taken from DIR/FAMILY if it is there; plan
and bench then run on it with the same arena (`--slots-share` of the experts), chunk, prompt and
decode length, and plan.compare's rows are printed as a docs/benchmarks.md table. --json keeps
{"cases": [{"name", "plan", "bench", "within"}]} as tests/data/plan_vs_bench.json holds them.

`--store` takes one store in place of the families ("builtin": the built-in model, with its
arena unless --arena-gb is given; any other store takes `--slots-share` of its experts unless
--arena-gb is given). `--rounds N` runs plan then bench N times in a row (plan from this
machine's cached calibration after the first) and prints each round's rows, then the median of
each figure's ratio over the rounds, and plan's wall time each round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def tiny_store(family: str, out: Path) -> Path:
    store = out / family
    if (store / "manifest.json").is_file():
        return store
    import torch

    sys.path.insert(0, str(HERE.parent / "tests"))
    from conftest import _hf_model, _randomize_norms

    from strata_mlx.convert.hf import convert_hf

    hf = out / f"hf_{family}"
    m = _hf_model(family).to(torch.float32).eval()
    _randomize_norms(m)
    m.save_pretrained(hf)
    convert_hf(hf, store, progress=False, calibration_tokens=64)
    return store


def stores(a: argparse.Namespace) -> list[tuple[str, Path, float]]:
    """[(name, store, arena GiB)] to compare on."""
    from strata_mlx.format.store import load_manifest

    if a.store:
        if a.store == "builtin":
            from strata_mlx.apps.default_model import default_arena_gb, default_store

            store = default_store()
            arena = a.arena_gb if a.arena_gb is not None else default_arena_gb(store)
            return [("built-in model", store, arena)]
        targets = [(Path(a.store).name, Path(a.store))]
    else:
        targets = [(f, tiny_store(f, a.out)) for f in a.families.split(",")]
    out = []
    for name, store in targets:
        m = load_manifest(store)
        n = m.num_experts * len(m.moe_layers)
        if a.arena_gb is not None:
            out.append((name, store, a.arena_gb))
            continue
        slots = max(1, round(a.slots_share * n))
        out.append((f"{name} ({slots}/{n} slots)", store, slots * m.layout.record_bytes / 1024**3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="qwen3_moe,qwen3_next")
    ap.add_argument("--store", help="a store, or 'builtin' (in place of --families)")
    ap.add_argument("--arena-gb", type=float)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=64)
    ap.add_argument("-g", "--gen-tokens", type=int, default=32)
    ap.add_argument("--prefill-step-size", type=int, default=16)
    ap.add_argument("--slots-share", type=float, default=0.3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/plan_vs_bench"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from strata_mlx.apps import plan
    from strata_mlx.apps.bench import bench

    a.out.mkdir(parents=True, exist_ok=True)
    cases = []
    print("| store | round | figure | forecast | measured | measured / forecast | within +-25 % |")
    print("|---|---|---|---|---|---|---|")
    for name, store, arena_gb in stores(a):
        ratios: dict[str, list[float]] = {}
        plan_s = []
        for r in range(a.rounds):
            t = time.perf_counter()
            f = plan.plan(
                store,
                arena_gb=arena_gb,
                prefill_step_size=a.prefill_step_size,
                prompt_tokens=a.prompt_tokens,
                gen_tokens=a.gen_tokens,
            )
            plan_s.append(time.perf_counter() - t)
            print("\n".join(f.lines()), file=sys.stderr)
            b = bench(
                store,
                prompt_tokens=a.prompt_tokens,
                gen_tokens=a.gen_tokens,
                prefill_step_size=a.prefill_step_size,
                arena_gb=arena_gb,
                policies=("lookahead",),
                probe_seconds=0.5,
                log=lambda s: print(s, file=sys.stderr),
            )
            rows = plan.compare(f, b)
            for row in rows:
                ratios.setdefault(row["figure"], []).append(row["ratio"])
                print(
                    f"| {name} | {r + 1} | {row['figure']} | {row['forecast']:.3g} | "
                    f"{row['measured']:.3g} | {row['ratio']:.2f} | "
                    f"{'yes' if row['within'] else 'no'} |",
                    flush=True,
                )
            cases.append(
                {
                    "name": name,
                    "plan": asdict(f),
                    "bench": b,
                    "within": [row["figure"] for row in rows if row["within"]],
                }
            )
        if a.rounds > 1:
            for figure, rs in ratios.items():
                med = statistics.median(rs)
                within = "yes" if abs(med - 1) <= plan.forecasting.TOLERANCE else "no"
                each = "/".join(f"{x:.2f}" for x in rs)
                print(f"| {name} | median | {figure} | | | {med:.2f} ({each}) | {within} |")
        print(f"plan's wall time a round: {', '.join(f'{s:.1f} s' for s in plan_s)}")
    if a.json:
        a.json.write_text(json.dumps({"cases": cases}, indent=1, default=str))


if __name__ == "__main__":
    main()
