"""Paired final validation losses of the candidate solvers against the exact solver (issue 42, point 4).

Exact: the committed study docs/results/main-exact (its summary.json); tangent: docs/results/ablation-tangent
plus this record's `tangent-hetero-inv` study; the candidates: this record's studies under
runs/lab-solver-selection/ (their run folders' last evaluation at the final step). A difference is a
candidate's final val loss minus exact's on the same preset and seed; the table gives its mean, the sample
standard deviation and the seeds paired.

    python lab/2026-12-05-solver-selection/table.py [--runs runs/lab-solver-selection] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PRESETS = ("all-stiefel", "all-dgram", "hetero", "hetero-inv")
STEPS = 500


def summary_finals(path: Path) -> dict[tuple[str, int], float]:
    runs = json.loads(path.read_text())["runs"]
    return {(r["variant"], r["seed"]): r["final_val"] for r in runs if r.get("final_val") is not None}


def run_finals(study: Path) -> dict[tuple[str, int], float]:
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
    ap.add_argument("--runs", default="runs/lab-solver-selection")
    ap.add_argument("--out")
    args = ap.parse_args()
    exact = summary_finals(Path("docs/results/main-exact/summary.json"))
    arms = {"tangent": summary_finals(Path("docs/results/ablation-tangent/summary.json"))}
    runs = Path(args.runs)
    if (runs / "tangent-hetero-inv").is_dir():
        arms["tangent"].update(run_finals(runs / "tangent-hetero-inv"))
    for study in sorted(p for p in runs.iterdir() if p.is_dir() and p.name != "tangent-hetero-inv"):
        arms[study.name] = run_finals(study)
    lines = ["| solver (study) | " + " | ".join(PRESETS) + " |", "|---" * (len(PRESETS) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(paired(f, exact, p) for p in PRESETS) + " |" for name, f in arms.items()]
    text = "Final val loss minus exact's, same preset and seed: mean ± sd (seeds).\n\n" + "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
