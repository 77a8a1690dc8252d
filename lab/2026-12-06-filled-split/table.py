"""Paired final validation losses of the products-only default candidate against the exact solver (issue 42, point 4):
filled_split on the DGram matrices, split_tangent (training's default) on the Stiefel ones.

Exact: the committed study docs/results/main-exact (its summary.json). The candidate: this record's studies under
runs/lab-filled-split/ (hetero: filled_split on the DGram MLP; all-dgram: everywhere; hetero-inv: on the DGram
attention) and, for all-stiefel, which has no DGram matrix, the split_tangent record's runs (its summary.json, quoted
through lab/2026-12-06-split-tangent/results/split/). Beside it, the split_tangent record's rows for split_tangent
on every matrix. A difference is a final val loss minus exact's on the same preset and seed; each cell gives the
mean, the sample standard deviation and the seeds paired.

    python lab/2026-12-06-filled-split/table.py [--runs runs/lab-filled-split] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PRESETS = ("all-stiefel", "all-dgram", "hetero", "hetero-inv")
STEPS = 500
SPLIT_RECORD = Path("lab/2026-12-06-split-tangent/results")


def summary_finals(path: Path) -> dict[tuple[str, int], float]:
    """(preset, seed) -> final val loss from a study's summary.json."""
    runs = json.loads(path.read_text())["runs"]
    return {(r["variant"], r["seed"]): r["final_val"] for r in runs if r.get("final_val") is not None}


def run_finals(study: Path) -> dict[tuple[str, int], float]:
    """(preset, seed) -> val loss at step STEPS, from STUDY/runs/PRESET/sSEED/metrics.jsonl (a study still running)."""
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


# (row, {preset: study}): the studies under --runs; "split:" marks the split_tangent record's summary instead
ROWS = (
    (
        "filled_split on DGram, 5 Polar Express steps; split_tangent (5) on Stiefel",
        {"all-stiefel": "split:split", "all-dgram": "all-dgram", "hetero": "hetero", "hetero-inv": "hetero-inv"},
    ),
    ("filled_split square=joint, 5 steps, every matrix", {"hetero": "hetero-joint"}),
    ("filled_split, 6 steps, every matrix", {"hetero": "hetero-steps6"}),
    (
        "filled_split square=joint, 6 steps, every matrix",
        {"hetero": "hetero-joint6", "all-dgram": "all-dgram-joint6", "hetero-inv": "hetero-inv-joint6"},
    ),
    ("filled_split refine=1, 6 steps, every matrix", {"hetero": "hetero-refine1"}),
)


def finals_of(study: str, runs: Path) -> dict[tuple[str, int], float]:
    """A study's finals: a committed copy under results/, else the live runs, else the split_tangent record's."""
    if study.startswith("split:"):
        return summary_finals(SPLIT_RECORD / study[len("split:") :] / "summary.json")
    record = Path("lab/2026-12-06-filled-split/results") / study / "summary.json"
    return summary_finals(record) if record.exists() else run_finals(runs / study)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/lab-filled-split")
    ap.add_argument("--out")
    args = ap.parse_args()
    exact = summary_finals(Path("docs/results/main-exact/summary.json"))
    lines = ["| solver | " + " | ".join(PRESETS) + " |", "|---" * (len(PRESETS) + 1) + "|"]
    for label, studies in ROWS:
        cand = {}
        for preset, study in studies.items():
            cand.update({k: v for k, v in finals_of(study, Path(args.runs)).items() if k[0] == preset})
        lines.append(f"| {label} | " + " | ".join(paired(cand, exact, p) for p in PRESETS) + " |")
    earlier = (SPLIT_RECORD / "table.md").read_text().splitlines()
    lines += [line for line in earlier if line.startswith(("| split_tangent", "| tangent", "| projected_tangent"))]
    text = "Final val loss minus exact's, same preset and seed: mean ± sd (seeds).\n\n" + "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
