"""Each preset's tuned gap to `unconstrained` against width, with its paired 95% interval (issue 52's figure).

Reads the `summary.json` of every finished width suite (docs/results/tuned-w64, -w128, -w256 where present) and
writes docs/results/tuned-widths.png and prints the table it plots. Run from the repository root:

    .venv/bin/python lab/2026-12-06-tuned-widths/plot_widths.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from geomtrain.study.stats import paired_interval  # noqa: E402

SUITES = {64: "tuned-w64", 128: "tuned-w128", 256: "tuned-w256"}
ARMS = ("all-stiefel", "hetero", "hetero-inv", "all-dgram")
RESULTS = Path("docs/results")


def finals(study: Path) -> dict[tuple[str, int], float]:
    """Final validation loss per (arm, confirmation seed); selection runs and unfinished runs left out."""
    runs = json.loads((study / "summary.json").read_text())["runs"]
    return {
        (r["variant"], r["seed"]): r["final_val"]
        for r in runs
        if not r["variant"].startswith("select-") and r.get("status") == "finished" and r.get("final_val") is not None
    }


def gaps() -> dict[str, list[tuple[int, dict]]]:
    out: dict[str, list[tuple[int, dict]]] = {arm: [] for arm in ARMS}
    for width, name in SUITES.items():
        if not (RESULTS / name / "summary.json").exists():
            continue
        f = finals(RESULTS / name)
        for arm in ARMS:
            seeds = sorted(s for a, s in f if a == arm and ("unconstrained", s) in f)
            if seeds:
                out[arm].append((width, paired_interval([f[arm, s] - f["unconstrained", s] for s in seeds])))
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    data = gaps()
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, (arm, points) in enumerate(data.items()):
        xs = [w * (1 + 0.03 * (k - 1.5)) for w, _ in points]  # a small offset per arm so the bars do not overlap
        ys = [p["mean"] for _, p in points]
        err = [[p["mean"] - p["low"] for _, p in points], [p["high"] - p["mean"] for _, p in points]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=arm)
        for w, p in points:
            print(f"{arm:12s} n_embd {w:4d}: {p['mean']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}] (n = {p['n']})")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(SUITES), [str(w) for w in SUITES])
    ax.set_xlabel("n_embd (mini: 4 layers, context 64)")
    ax.set_ylabel("final val loss − unconstrained (paired, 95% CI)")
    ax.set_title("Tuned gap to unconstrained Muon, by width (below 0: better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "tuned-widths.png", dpi=120)
    print(f"wrote {RESULTS / 'tuned-widths.png'}")


if __name__ == "__main__":
    main()
