"""Final validation loss at 2,000 steps of training's default against the exact solver on `hetero`, paired by seed.

Exact, seed 0: the committed study docs/results/length-2000; seed 1: lab/2026-12-06-selection-2000's
results/exact-hetero (both at the same settings). The default and the runner-up (one refinement step): this
record's results/default-hetero and results/refine1-hetero.

    python lab/2026-12-06-default-2000/table.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

HERE = Path("lab/2026-12-06-default-2000")


def finals(summary: Path) -> dict[int, float]:
    """seed -> final val loss of the `hetero` runs of a study summary."""
    runs = json.loads(summary.read_text())["runs"]
    return {r["seed"]: r["final_val"] for r in runs if r["variant"] == "hetero" and r.get("final_val") is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    exact = finals(Path("docs/results/length-2000/summary.json"))
    exact.update(finals(Path("lab/2026-12-06-selection-2000/results/exact-hetero/summary.json")))
    lines = ["| solver | seed | exact | solver's | − exact |", "|---|---|---|---|---|"]
    for name, label in (("default-hetero", "default"), ("refine1-hetero", "`refine=1`")):
        path = HERE / "results" / name / "summary.json"
        if not path.exists():
            continue
        runs = finals(path)
        diffs = {seed: runs[seed] - exact[seed] for seed in sorted(runs) if seed in exact}
        lines += [f"| {label} | {s} | {exact[s]:.4f} | {runs[s]:.4f} | {d:+.4f} |" for s, d in diffs.items()]
        if diffs:
            lines.append(f"| {label} | mean | | | {statistics.mean(diffs.values()):+.4f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
