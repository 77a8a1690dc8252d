"""Paired final validation losses of split_tangent against the exact solver (issue 42, point 4), with the
500-step selection's projected_tangent and tangent beside it.

Exact: the committed study docs/results/main-exact (its summary.json); split_tangent: this record's studies under
runs/lab-split-tangent/ (each run's last evaluation at step 500; per manifold kind: `split` on all-stiefel,
exact on all-dgram, `stiefel-split` on hetero, `stiefel-split-inv` on hetero-inv); projected_tangent (8 Polar
Express steps) and tangent: lab/2026-12-05-solver-selection/results/table.md, quoted. A difference is a final
val loss minus exact's on the same preset and seed; each cell gives the mean, the sample standard deviation and
the seeds paired.

    python lab/2026-12-06-split-tangent/table.py [--runs runs/lab-split-tangent] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PRESETS = ("all-stiefel", "all-dgram", "hetero", "hetero-inv")
STEPS = 500


def finals(study: Path) -> dict[tuple[str, int], float]:
    """(preset, seed) -> val loss at step STEPS, from STUDY/runs/PRESET/sSEED/metrics.jsonl."""
    out = {}
    for metrics in sorted(study.glob("runs/*/s*/metrics.jsonl")):
        evals = [json.loads(line) for line in metrics.read_text().splitlines() if '"eval"' in line]
        if evals and evals[-1]["step"] == STEPS:
            out[(metrics.parts[-3], int(metrics.parts[-2][1:]))] = evals[-1]["val_loss"]
    return out


def paired(cand: dict, exact: dict, preset: str) -> str:
    diffs = [v - exact[k] for k, v in sorted(cand.items()) if k[0] == preset and k in exact]
    if not diffs:
        return "-"
    sd = f" ± {statistics.stdev(diffs):.4f}" if len(diffs) > 1 else ""
    return f"{statistics.mean(diffs):+.4f}{sd} ({len(diffs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/lab-split-tangent")
    ap.add_argument("--out")
    args = ap.parse_args()
    runs = json.loads(Path("docs/results/main-exact/summary.json").read_text())["runs"]
    exact = {(r["variant"], r["seed"]): r["final_val"] for r in runs if r.get("final_val") is not None}
    lines = ["| solver (study) | " + " | ".join(PRESETS) + " |", "|---" * (len(PRESETS) + 1) + "|"]
    found = {p.name: finals(p) for p in sorted(Path(args.runs).iterdir()) if p.is_dir()}
    for name in ("split", "split-sub2"):
        if name in found:
            cells = " | ".join(paired(found[name], exact, p) for p in PRESETS)
            lines.append(f"| split_tangent ({name}) | {cells} |")
    # per manifold kind: split_tangent on the Stiefel matrices, exact on the DGram ones (all-dgram is exact itself)
    kind = {k: v for k, v in found.get("split", {}).items() if k[0] == "all-stiefel"}
    kind.update({k: v for k, v in exact.items() if k[0] == "all-dgram"})
    for name in ("stiefel-split", "stiefel-split-inv"):
        kind.update(found.get(name, {}))
    cells = " | ".join(paired(kind, exact, p) for p in PRESETS)
    lines.append(f"| split_tangent on Stiefel, exact on DGram (split, stiefel-split, stiefel-split-inv) | {cells} |")
    earlier = Path("lab/2026-12-05-solver-selection/results/table.md").read_text().splitlines()
    quoted = [line for line in earlier if line.startswith(("| tangent", "| pt8 |"))]
    lines += [line.replace("| pt8 |", "| projected_tangent (pt8) |") for line in quoted]
    text = "Final val loss minus exact's, same preset and seed: mean ± sd (seeds).\n\n" + "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
