"""Figures of single runs side by side (``geomtrain plot RUN [RUN ...]``).

One PNG with four panels, one line colour per run:

1. loss: validation loss (solid, markers) and training loss (thin) against the step;
2. ``sigma_max`` per module type (``attn_q``, ``attn_k``, ``attn_out``, ``mlp_in``, ``mlp_out``):
   the largest over layers, one line style per type;
3. attention ``max_abs_logit``, the largest over layers;
4. attention ``mean_entropy``, the mean over layers (nats).

Runs are read through `geomtrain.runfolder.RunFolder` (metrics.jsonl, diagnostics.jsonl, config.json);
a run without diagnostics shows only its losses. A run is named by its folder and, where the folder name
does not say it, its assignment (`geomtrain.assign.assignment_label`: manifold rules by the rules).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ._io import atomic_write_bytes
from .assign import assignment_label
from .runfolder import RunFolder

__all__ = ["read_curves", "plot_runs", "MODULE_KINDS"]

MODULE_KINDS = ("attn_q", "attn_k", "attn_out", "mlp_in", "mlp_out")
_STYLES = dict(zip(MODULE_KINDS, ("-", "--", "-.", ":", (0, (5, 1, 1, 1)))))


def read_curves(run_dir: str | Path) -> dict:
    """Step-indexed curves of one run: losses, sigma_max per module kind, attention statistics."""
    folder = RunFolder(run_dir)
    if not folder.holds_run():
        raise ValueError(f"{run_dir} is not a run folder (no config.json, metrics.jsonl or ckpt.pt)")
    metrics = folder.read_metrics()
    cfg = folder.read_config()
    curves: dict = {
        "name": _legend_name(Path(run_dir).name, cfg),
        "train": [],
        "val": [],
        "sigma_max": {k: [] for k in MODULE_KINDS},
        "max_abs_logit": [],
        "mean_entropy": [],
    }
    for r in metrics:
        if r.get("kind") == "train" and r.get("loss") is not None:
            curves["train"].append((r["step"], r["loss"]))
        elif r.get("kind") == "eval" and r.get("val_loss") is not None:
            curves["val"].append((r["step"], r["val_loss"]))
    for d in folder.read_diagnostics():
        for kind in MODULE_KINDS:
            values = [
                m["sigma_max"]
                for m in d.get("matrices", [])
                if m.get("kind") == kind and m.get("sigma_max") is not None
            ]
            if values:
                curves["sigma_max"][kind].append((d["step"], max(values)))
        attention = d.get("attention") or []
        logits = [a["max_abs_logit"] for a in attention if a.get("max_abs_logit") is not None]
        entropy = [a["mean_entropy"] for a in attention if a.get("mean_entropy") is not None]
        if logits:
            curves["max_abs_logit"].append((d["step"], max(logits)))
        if entropy:
            curves["mean_entropy"].append((d["step"], float(np.mean(entropy))))
    return curves


def _legend_name(folder: str, cfg: dict | None) -> str:
    """The run's folder name, and its assignment where the name does not say it (`assignment_label`: a
    rules run by its rules, not by the preset it overrides)."""
    if cfg is None:
        return folder
    label = assignment_label(cfg.get("preset"), cfg.get("rules") or ())
    return folder if f"-{label}-" in f"-{folder}-" else f"{folder} ({label})"


def _line(ax, points, **kw) -> None:
    """``points`` as a line; a single point (a run with one evaluation) as a marker, since a line
    through one point draws nothing."""
    if points:
        x, y = zip(*points)
        if len(points) == 1 and kw.get("marker") in (None, "", "None", "none"):
            kw = {**kw, "marker": "o", "ms": 4}
        ax.plot(x, y, **kw)


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, dpi: int = 100) -> Path:
    """Write the four-panel PNG comparing ``run_dirs`` to ``out``; returns its path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("give at least one run folder")
    runs = [read_curves(r) for r in run_dirs]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c = colours[i % len(colours)]
        _line(axes[0, 0], run["train"], color=c, lw=0.7, alpha=0.5)
        _line(axes[0, 0], run["val"], color=c, marker="o", ms=3, label=run["name"])
        for kind in MODULE_KINDS:
            _line(
                axes[0, 1],
                run["sigma_max"][kind],
                color=c,
                ls=_STYLES[kind],
                label=f"{run['name']}: {kind}" if len(runs) == 1 or i == 0 else None,
            )
        _line(axes[1, 0], run["max_abs_logit"], color=c, marker="o", ms=3, label=run["name"])
        _line(axes[1, 1], run["mean_entropy"], color=c, marker="o", ms=3, label=run["name"])
    titles = (
        "loss (val: markers, train: thin)",
        "sigma_max per module type (max over layers)",
        "attention max |logit| (max over layers)",
        "attention mean row entropy (nats, mean over layers)",
    )
    for ax, title in zip(axes.flat, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
    return out
