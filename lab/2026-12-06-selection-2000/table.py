"""Final validation loss at 2,000 steps of the products-only candidates against the exact solver, paired by seed.

Exact, seed 0: the committed study docs/results/length-2000 (its summary.json); exact, seed 1, and the candidates:
this record's studies under runs/lab-selection-2000/ (`exact-PRESET`, `pt8-PRESET`, `tangent-PRESET`; each run's
last evaluation at step 2,000). A difference is a candidate's final val loss minus exact's on the same preset and
seed; a cell lists each seed's difference, then their mean.

    python lab/2026-12-06-selection-2000/table.py [--runs runs/lab-selection-2000] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PRESETS = ("all-stiefel", "all-dgram", "hetero", "hetero-inv")
CANDIDATES = {"pt8": "`projected_tangent`, `msign_steps=8`", "tangent": "`tangent`"}
STEPS = 2000


def final_losses(runs: Path, solver: str) -> dict[tuple[str, int], float]:
    """(preset, seed) -> val loss at step STEPS, from runs/SOLVER-PRESET/runs/PRESET/sSEED/metrics.jsonl."""
    out = {}
    for metrics in sorted(runs.glob(f"{solver}-*/runs/*/s*/metrics.jsonl")):
        evals = [json.loads(line) for line in metrics.read_text().splitlines() if '"eval"' in line]
        if evals and evals[-1]["step"] == STEPS:
            out[(metrics.parts[-3], int(metrics.parts[-2][1:]))] = evals[-1]["val_loss"]
    return out


def cell(cand: dict, exact: dict, preset: str) -> str:
    diffs = {k[1]: v - exact[k] for k, v in sorted(cand.items()) if k[0] == preset and k in exact}
    if not diffs:
        return "-"
    each = ", ".join(f"s{seed} {d:+.4f}" for seed, d in diffs.items())
    return f"{each}; mean {statistics.mean(diffs.values()):+.4f}" if len(diffs) > 1 else each


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/lab-selection-2000")
    ap.add_argument("--out")
    args = ap.parse_args()
    runs = Path(args.runs)
    committed = json.loads(Path("docs/results/length-2000/summary.json").read_text())["runs"]
    exact = {(r["variant"], r["seed"]): r["final_val"] for r in committed if r.get("final_val") is not None}
    exact.update(final_losses(runs, "exact"))
    lines = ["| solver | " + " | ".join(PRESETS) + " |", "|---" * (len(PRESETS) + 1) + "|"]
    lines.append(
        "| exact (final val loss) | "
        + " | ".join(
            ", ".join(f"s{k[1]} {v:.4f}" for k, v in sorted(exact.items()) if k[0] == p) or "-" for p in PRESETS
        )
        + " |"
    )
    for name, label in CANDIDATES.items():
        found = final_losses(runs, name)
        lines.append(f"| {label} | " + " | ".join(cell(found, exact, p) for p in PRESETS) + " |")
    text = f"Final val loss at step {STEPS}, minus exact's on the same preset and seed.\n\n" + "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
