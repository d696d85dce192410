"""Prefill chunk times of two codes, from their `bench --json` files, side by side.

Each file is named CODE-NAME-ROUND.json (CODE "old" or "new"; NAME the store or stage; ROUND
anything without a dash): prints, per (NAME, policy, phase), each code's median ms/chunk with
its range and new / old; a variant only the new code has ("lookahead:ov0", "demand:loop:nv")
stands against the old code's policy without it ("lookahead", "demand:loop"). Used by
benchmarks/prefill_vs_commit.sh and gpu_session.sh:
    python benchmarks/old_vs_new.py OUT/old-*.json OUT/new-*.json
"""

from __future__ import annotations

import json
import statistics as st
import sys
from pathlib import Path

NEW_ONLY = {"ov0", "ov1", "nv"}  # bench variants the old code (36960f5^) does not have


def main(paths: list[str]) -> None:
    rows: dict[tuple, dict[str, list[float]]] = {}
    for p in paths:
        code, name = Path(p).stem.split("-", 1)
        name = name.rsplit("-", 1)[0]
        for r in json.loads(Path(p).read_text())["runs"]:
            key = (name, r["policy"], r["phase"])
            rows.setdefault(key, {}).setdefault(code, []).append(r["chunk_ms"])
    for (name, pol, ph), c in rows.items():  # a variant of this code's against the old policy
        base = rows.get((name, ":".join(v for v in pol.split(":") if v not in NEW_ONLY), ph), {})
        if "old" not in c and "old" in base:
            c["old"] = base["old"]
    print(
        "| store | policy | phase | old ms/chunk median (range) | new median (range) | new / old |"
    )
    print("|---|---|---|---|---|---|")
    for (name, pol, ph), c in sorted(rows.items()):
        o, n = c.get("old", []), c.get("new", [])
        if o and n:
            print(
                f"| {name} | {pol} | {ph} | {st.median(o):.1f} ({min(o):.1f}-{max(o):.1f}) | "
                f"{st.median(n):.1f} ({min(n):.1f}-{max(n):.1f}) | {st.median(n) / st.median(o):.2f} |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
