"""Each preset's tuned gap to `unconstrained` against width, with its paired 95% interval (issue 52's figure).

Four panels: the Muon arms with `muon_lr` alone tuned (their AdamW part at the shared `lr`; docs/results/tuned-w64,
-w128) and with both rates tuned (docs/results/tuned-lr-w64, -lr-w128), both selected at half the horizon; both rates
tuned and selected at the whole horizon (docs/results/tuned-whole-w64, -w128, -w256; lab/2026-12-07-whole-horizon);
and `adamw` against `unconstrained` at that equal tuning, on its own axis (its gap is several times the presets').
Reads the `summary.json` of every suite present, writes docs/results/tuned-widths.png and prints the table it plots.
Run from the repository root:

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

WHOLE = {64: "tuned-whole-w64", 128: "tuned-whole-w128", 256: "tuned-whole-w256"}  # both rates, whole horizon
ARMS = ("all-stiefel", "hetero", "hetero-inv", "all-dgram", "adamw")
PANELS = {  # title: (width -> study folder, the arms drawn; adamw against Muon only at equal tuning)
    "muon_lr tuned, half-horizon selection": ({64: "tuned-w64", 128: "tuned-w128"}, ARMS[:-1]),
    "both rates tuned, half-horizon selection": ({64: "tuned-lr-w64", 128: "tuned-lr-w128"}, ARMS[:-1]),
    "both rates tuned, whole-horizon selection": (WHOLE, ARMS[:-1]),
    "adamw, both rates, whole horizon": (WHOLE, ARMS[-1:]),
}
WIDTHS = (64, 128, 256)
RESULTS = Path("docs/results")


def finals(study: Path) -> dict[tuple[str, int], float]:
    """Final validation loss per (arm, confirmation seed); selection runs and unfinished runs left out."""
    runs = json.loads((study / "summary.json").read_text())["runs"]
    return {
        (r["variant"], r["seed"]): r["final_val"]
        for r in runs
        if not r["variant"].startswith("select-") and r.get("status") == "finished" and r.get("final_val") is not None
    }


def gaps(suites: dict[int, str], arms: tuple[str, ...]) -> dict[str, list[tuple[int, dict]]]:
    """Per arm, ``(width, paired interval of arm - unconstrained)`` over the confirmation seeds both have."""
    out: dict[str, list[tuple[int, dict]]] = {arm: [] for arm in arms}
    for width, name in suites.items():
        if not (RESULTS / name / "summary.json").exists():
            continue
        f = finals(RESULTS / name)
        for arm in arms:
            seeds = sorted(s for a, s in f if a == arm and ("unconstrained", s) in f)
            if seeds:
                out[arm].append((width, paired_interval([f[arm, s] - f["unconstrained", s] for s in seeds])))
    return out


def draw(ax, title: str, data: dict[str, list[tuple[int, dict]]]) -> None:
    """One panel: each arm's gap against width (log scale), a small offset per arm so the bars do not overlap."""
    print(title)
    for k, (arm, points) in enumerate(data.items()):
        colour = f"C{ARMS.index(arm)}"
        xs = [w * (1 + 0.03 * (k - 2)) for w, _ in points]
        ys = [p["mean"] for _, p in points]
        err = [[p["mean"] - p["low"] for _, p in points], [p["high"] - p["mean"] for _, p in points]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=arm, color=colour)
        for w, p in points:
            print(f"  {arm:12s} n_embd {w:4d}: {p['mean']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}] (n = {p['n']})")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(WIDTHS), [str(w) for w in WIDTHS])
    ax.set_xlim(WIDTHS[0] / 1.25, WIDTHS[-1] * 1.25)  # every panel the same widths, however many it has points at
    ax.set_xlabel("n_embd (mini: 4 layers, context 64)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(19, 4))
    for ax, (title, (suites, arms)) in zip(axes, PANELS.items()):
        draw(ax, title, gaps(suites, arms))
    axes[0].set_ylabel("final val loss − unconstrained (paired, 95% CI)")
    fig.suptitle("Tuned gap to unconstrained Muon, by width (below 0: better)")
    fig.tight_layout()
    fig.savefig(RESULTS / "tuned-widths.png", dpi=120)
    print(f"wrote {RESULTS / 'tuned-widths.png'}")


if __name__ == "__main__":
    main()
