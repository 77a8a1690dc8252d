"""Final validation loss of filled_split with its multiplier carried (carry=True) against the exact solver, paired
by seed: at 500 steps against docs/results/main-exact (mean ± sd over the seeds), at 2,000 steps on `hetero` against
docs/results/length-2000 (seed 0) and lab/2026-12-06-selection-2000's results/exact-hetero (seed 1).

The studies: this record's results/<name>/summary.json (copied by `run.sh compare`), else the live study under
runs/lab-carried/<name>; the main study with the new default: results/main-carry (runs/main-carry). Beside them,
the cold start (training's previous default, docs/results/main-products before this record: its copy
results/main-products-a3054e8) and lab/2026-12-06-default-2000's runs.

    python lab/2026-12-06-carried-multiplier/table.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

HERE = Path("lab/2026-12-06-carried-multiplier")
PRESETS = ("all-stiefel", "all-dgram", "hetero", "hetero-inv")
ROWS_500 = (  # (label, study name)
    ("cold start (`carry=False`; the previous default, main study at a3054e8)", "main-products-a3054e8"),
    ("the multiplier itself carried, `carry_step=0.5` (612600b)", "hetero-absolute"),
    ("the multiplier itself carried, `carry_step=0.25` (612600b)", "hetero-absolute-step025"),
    ("**the correction to N(G) carried** (`carry=True`, `carry_step=0.5`; 884932a)", "hetero"),
    ("**the main study with `carry=True` the default** (515c93a)", "main-carry"),
)
ROWS_2000 = (
    ("cold start (lab/2026-12-06-default-2000)", Path("lab/2026-12-06-default-2000/results/default-hetero")),
    ("`refine=1` (lab/2026-12-06-default-2000)", Path("lab/2026-12-06-default-2000/results/refine1-hetero")),
    ("**`carry=True`**", HERE / "results" / "long-hetero"),
)


def finals(summary: Path) -> dict[tuple[str, int], float]:
    """(preset, seed) -> final val loss of a study summary (empty if it does not exist)."""
    if not summary.exists():
        return {}
    runs = json.loads(summary.read_text())["runs"]
    return {(r["variant"], r["seed"]): r["final_val"] for r in runs if r.get("final_val") is not None}


def study(name: str) -> dict[tuple[str, int], float]:
    found = finals(HERE / "results" / name / "summary.json")
    return (
        found
        or finals(Path("runs/lab-carried") / name / "summary.json")
        or finals(Path("runs") / name / "summary.json")
    )


def paired(cand: dict, exact: dict, preset: str) -> str:
    diffs = [v - exact[k] for k, v in sorted(cand.items()) if k[0] == preset and k in exact]
    if not diffs:
        return ""
    sd = f" ± {statistics.stdev(diffs):.4f}" if len(diffs) > 1 else ""
    by_seed = " / ".join(f"{d:+.4f}" for d in diffs)
    return f"{statistics.mean(diffs):+.4f}{sd} ({by_seed})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    exact = finals(Path("docs/results/main-exact/summary.json"))
    lines = ["500 steps, minus exact (`docs/results/main-exact`), mean ± sd (by seed):", ""]
    lines += ["| solver | " + " | ".join(PRESETS) + " |", "|---" * (len(PRESETS) + 1) + "|"]
    for label, name in ROWS_500:
        cand = study(name)
        if cand:
            lines.append(f"| {label} | " + " | ".join(paired(cand, exact, p) for p in PRESETS) + " |")
    exact = finals(Path("docs/results/length-2000/summary.json"))
    exact.update(finals(Path("lab/2026-12-06-selection-2000/results/exact-hetero/summary.json")))
    lines += ["", "2,000 steps, `hetero`, minus exact (seed 0: `length-2000`, seed 1: `selection-2000`):", ""]
    lines += ["| solver | hetero |", "|---|---|"]
    for label, path in ROWS_2000:
        cand = finals(path / "summary.json") or finals(Path("runs/lab-carried") / path.name / "summary.json")
        if cand:
            lines.append(f"| {label} | {paired(cand, exact, 'hetero')} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
