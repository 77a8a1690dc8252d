"""The overhead suite: the step time of every preset and Manifold Muon solver, measured
interleaved in one process by the project's one timing loop
(`geomtrain.bench.training.measure_step_times`), which a busy shared machine distorts far less
than per-run timings. ``geomtrain study overhead`` writes ``overhead.json``, ``overhead.md``
and ``overhead_solvers.png``.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .._io import atomic_write_json, atomic_write_text
from .collect import round_sig
from .plan import PRESET_ORDER, StudyError

__all__ = [
    "NO_SOLVER_PRESETS",
    "overhead_configs",
    "measure_overhead",
    "format_overhead_table",
    "write_overhead",
    "overhead_solvers",
]

NO_SOLVER_PRESETS = ("adamw", "unconstrained")  # no manifold, so no Manifold Muon solver to vary


def overhead_configs(
    base: dict,
    presets: Sequence[str] = PRESET_ORDER,
    solvers: Sequence[str | None] = (None,),
    steps: int = 20,
    warmup: int = 3,
    seed: int = 0,
    out_dir: str = "unused",
) -> dict:
    """``{(preset, solver): TrainConfig}`` of every configuration timed (``solver`` ``None``: the
    optimizer's default; :data:`NO_SOLVER_PRESETS` once each); ``StudyError`` on a bad value."""
    from ..config import make_config

    out = {}
    for p in presets:
        for solver in (None,) if p in NO_SOLVER_PRESETS else solvers:
            values = {
                **base,
                "preset": p,
                "rules": [],
                "seed": seed,
                "out_dir": f"{out_dir}/{p}-{solver}",
                "progress": False,
                "diagnostics": False,
                "max_iters": max(int(base.get("max_iters", 1)), warmup + steps),
            }
            if solver is not None:
                values["muon_solver"] = solver
            try:
                out[(p, solver)] = make_config(values)
            except (ValueError, TypeError) as exc:
                raise StudyError(f"preset {p}, solver {solver or 'default'}: {exc}") from None
    return out


def measure_overhead(
    base: dict,
    presets: Sequence[str] = PRESET_ORDER,
    solvers: Sequence[str | None] = (None,),
    steps: int = 20,
    warmup: int = 3,
    seed: int = 0,
) -> list[dict]:
    """Median ms per full training step (forward, backward, clipping, AdamW, Manifold Muon) of each
    (preset, Muon solver), measured **interleaved**: one step of every configuration in turn, so a
    shared machine's slow drift hits them all alike. ``adamw`` and ``unconstrained`` do not use a
    manifold solver and are measured once. Rows carry the p10 / p90 step times and the ratios to
    ``adamw`` and ``unconstrained``."""
    from ..bench.training import measure_step_times

    with tempfile.TemporaryDirectory() as tmp:  # the trainers write nothing; a folder that is surely free
        configs = overhead_configs(base, presets, solvers, steps, warmup, seed, out_dir=tmp)
        labels = {key: f"{key[0]}/{key[1] or 'default'}" for key in configs}
        times = measure_step_times({labels[key]: cfg for key, cfg in configs.items()}, steps, warmup)
    rows = []
    for (p, solver), label in labels.items():
        t = times[label]
        rows.append(
            {
                "preset": p,
                "solver": solver or ("-" if p in NO_SOLVER_PRESETS else "default"),
                "ms_per_step": round_sig(1000 * statistics.median(t)),
                "ms_p10": round_sig(1000 * float(np.percentile(t, 10))),
                "ms_p90": round_sig(1000 * float(np.percentile(t, 90))),
            }
        )
    ref = {r["preset"]: r["ms_per_step"] for r in rows if r["preset"] in NO_SOLVER_PRESETS}
    for r in rows:
        r["vs_adamw"] = round_sig(r["ms_per_step"] / ref["adamw"], 4) if ref.get("adamw") else None
        r["vs_unconstrained"] = (
            round_sig(r["ms_per_step"] / ref["unconstrained"], 4) if ref.get("unconstrained") else None
        )
    return rows


def format_overhead_table(rows: list[dict]) -> str:
    """:func:`measure_overhead` rows as Markdown."""
    head = ["preset", "Muon solver", "ms/step (median)", "p10-p90", "vs AdamW", "vs unconstrained Muon"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['solver']} | {r['ms_per_step']:.0f} | {r['ms_p10']:.0f}-{r['ms_p90']:.0f} | "
            + (f"{r['vs_adamw']:.2f}x" if r.get("vs_adamw") else "-")
            + " | "
            + (f"{r['vs_unconstrained']:.2f}x" if r.get("vs_unconstrained") else "-")
            + " |"
        )
    return "\n".join(lines)


def write_overhead(record: dict, out: str | Path) -> list[Path]:
    """``overhead.json`` (``record``: command, config, steps, warmup, rows, ...), ``overhead.md``
    and ``overhead_solvers.png`` into ``out``."""
    from . import figures

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "overhead.json", record)
    steps, warmup = record["steps"], record["warmup"]
    atomic_write_text(
        out / "overhead.md",
        f"# Step time per assignment and solver\n\nCommand: `{record['command']}`\n\n"
        f"{steps} timed steps per configuration after {warmup} untimed ones, "
        "interleaved round-robin in one process.\n\n" + format_overhead_table(record["rows"]) + "\n",
    )
    title = f"model {record['base_config']['model']}, {steps} interleaved steps"
    figures.save(overhead_solvers(record["rows"], title=title), out / "overhead_solvers.png")
    return [out / "overhead.json", out / "overhead.md", out / "overhead_solvers.png"]


def overhead_solvers(rows: Sequence[dict], title: str = ""):
    """Grouped bars from :func:`geomtrain.study.overhead.measure_overhead`: ms per step per preset, one bar
    per Muon solver, with the p10-p90 range and the ratio to ``adamw`` on top."""
    from matplotlib.figure import Figure

    from . import figures

    presets = list(dict.fromkeys(r["preset"] for r in rows))
    solvers = list(dict.fromkeys(r["solver"] for r in rows if r["solver"] != "-"))
    fig = Figure(figsize=(max(7, 1.6 * len(presets) + 2), 4.5), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(solvers))
    hatches = ["", "//", "..", "xx"]
    for i, p in enumerate(presets):
        mine = [r for r in rows if r["preset"] == p]
        for r in mine:
            j = 0 if r["solver"] == "-" else solvers.index(r["solver"])
            x = i if r["solver"] == "-" else i - 0.4 + width * (j + 0.5)
            w = 0.8 if r["solver"] == "-" else width
            ax.bar(
                x,
                r["ms_per_step"],
                width=w,
                color=figures.PRESET_COLORS.get(p, "#777777"),
                hatch=hatches[j % 4],
                edgecolor="white",
                yerr=[[r["ms_per_step"] - r["ms_p10"]], [r["ms_p90"] - r["ms_per_step"]]],
                error_kw={"lw": 0.8},
            )
            if r.get("vs_adamw"):
                ax.annotate(f"{r['vs_adamw']:.1f}x", (x, r["ms_p90"]), ha="center", va="bottom", fontsize=7)
    for j, solver in enumerate(solvers):
        ax.bar(np.nan, np.nan, color="#bbbbbb", hatch=hatches[j % 4], edgecolor="white", label=f"solver {solver}")
    ax.set_xticks(range(len(presets)), presets)
    ax.set(
        ylabel="ms per training step (median; bars p10-p90)",
        title="step time per assignment and Muon solver (ratio to AdamW on top)" + (f"\n{title}" if title else ""),
    )
    figures.add_legend(ax, fontsize=8)
    ax.margins(y=0.15)
    return fig
