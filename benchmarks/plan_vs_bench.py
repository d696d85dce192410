"""`strata-mlx plan` against `strata-mlx bench` on the tests' tiny stores.

    python benchmarks/plan_vs_bench.py [--families qwen3_moe,qwen3_next] [-p 64] [-g 32]
        [--prefill-step-size 16] [--slots-share 0.3] [--out DIR] [--json FILE]

Each family's store is built as tests/conftest.py builds it (transformers' tiny model, random
weights, converted with a 64-token calibration), or taken from DIR/FAMILY if it is there; plan
and bench then run on it with the same arena (`--slots-share` of the experts), chunk, prompt and
decode length, and plan.compare's rows are printed as a docs/benchmarks.md table. --json keeps
{"cases": [{"name", "plan", "bench", "within"}]} as tests/data/plan_vs_bench.json holds them.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="qwen3_moe,qwen3_next")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=64)
    ap.add_argument("-g", "--gen-tokens", type=int, default=32)
    ap.add_argument("--prefill-step-size", type=int, default=16)
    ap.add_argument("--slots-share", type=float, default=0.3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/plan_vs_bench"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from strata_mlx.apps import plan
    from strata_mlx.apps.bench import bench
    from strata_mlx.format.store import load_manifest

    a.out.mkdir(parents=True, exist_ok=True)
    cases = []
    print("| store | figure | forecast | measured | measured / forecast | within +-25 % |")
    print("|---|---|---|---|---|---|")
    for family in a.families.split(","):
        store = tiny_store(family, a.out)
        m = load_manifest(store)
        n = m.num_experts * len(m.moe_layers)
        slots = max(1, round(a.slots_share * n))
        arena_gb = slots * m.layout.record_bytes / 1024**3
        f = plan.plan(
            store,
            arena_gb=arena_gb,
            prefill_step_size=a.prefill_step_size,
            prompt_tokens=a.prompt_tokens,
            gen_tokens=a.gen_tokens,
        )
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
        name = f"{family} ({slots}/{n} slots)"
        for r in rows:
            print(
                f"| {name} | {r['figure']} | {r['forecast']:.3g} | {r['measured']:.3g} | "
                f"{r['ratio']:.2f} | {'yes' if r['within'] else 'no'} |"
            )
        cases.append(
            {
                "name": name,
                "plan": asdict(f),
                "bench": b,
                "within": [r["figure"] for r in rows if r["within"]],
            }
        )
    if a.json:
        a.json.write_text(json.dumps({"cases": cases}, indent=1, default=str))


if __name__ == "__main__":
    main()
