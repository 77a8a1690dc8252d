r"""Figures of a study (matplotlib, headless): every function takes a study summary and returns a
:class:`matplotlib.figure.Figure` (or ``None`` when the study has nothing to draw for it).

The figures are built on ``matplotlib.figure.Figure`` directly, never through ``pyplot``: no
global state, no GUI backend, safe under ``Agg`` and in threads; :func:`save` writes a PNG. In a
notebook, ``display(fig)`` (or leaving ``fig`` as the last expression with the inline backend)
shows one.

A *summary* is what :func:`geomtrain.study.collect.collect` returns (and ``summary.json`` holds):
``{"variants": [...], "runs": [...], "table": [...], "study": {...}}``; each run has its eval
curve, training loss and the per-evaluation diagnostics as per-layer lists (see
:mod:`geomtrain.study.collect`). Conventions used below:

- the "attention Q/K" spectral norm of a layer is $\max(\sigma_{\max}(W_Q), \sigma_{\max}(W_K))$,
  and the logit bound uses the product $\sigma_{\max}(W_Q)\,\sigma_{\max}(W_K)$;
- a quantity "over layers" is the max (spectral norms, logits, saturated fraction) or the min
  (entropy, softmax Jacobian norm) over the layers: the worst layer, where saturation starts;
- thin lines are single seeds, thick lines the mean over the seeds that are still running at
  that step; a cross marks a divergence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from .._io import atomic_write_bytes

__all__ = [
    "PRESET_COLORS",
    "color_of",
    "png_bytes",
    "save",
    "val_loss",
    "sigma_max",
    "attention",
    "overhead",
    "mechanism",
    "sweep",
    "write_all",
    "add_legend",
    "mark_empty",
]

PRESET_COLORS = {
    "adamw": "#7f7f7f",
    "unconstrained": "#222222",
    "all-stiefel": "#1f77b4",
    "all-dgram": "#d62728",
    "hetero": "#2ca02c",
    "hetero-inv": "#ff7f0e",
}
_EXTRA = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#393b79", "#637939", "#843c39"]

KIND_PANELS = (
    ("attn_qk", "attention Q/K part"),
    ("attn_out", "attention output (c_proj)"),
    ("mlp_in", "MLP in (c_fc)"),
    ("mlp_out", "MLP out (c_proj)"),
)


# ----------------------------------------------------------------------------- helpers
def color_of(variant: dict, variants: Sequence[dict]) -> str:
    """Fixed colours for the six presets; a swept variant takes its family's (``base``) colour;
    other families cycle through a palette."""
    family = variant.get("base") or variant["name"]
    if family in PRESET_COLORS:
        return PRESET_COLORS[family]
    others = list(
        dict.fromkeys(
            (v.get("base") or v["name"]) for v in variants if (v.get("base") or v["name"]) not in PRESET_COLORS
        )
    )
    return _EXTRA[others.index(family) % len(_EXTRA)] if family in others else "#000000"


def _linestyle(variant: dict, variants: Sequence[dict]) -> str:
    """Swept variants of one family: solid, dashed, dotted, dash-dot by increasing value."""
    sw = variant.get("sweep")
    if not sw:
        return "-"
    family = variant.get("base") or variant["name"]
    values = sorted(
        {v["sweep"]["value"] for v in variants if v.get("sweep") and (v.get("base") or v["name"]) == family}
    )
    return ["-", "--", ":", "-."][values.index(sw["value"]) % 4]


def _label(variant: dict) -> str:
    return variant.get("label") or variant["name"]


def png_bytes(fig: Figure, dpi: int = 90, compact: bool = True) -> bytes:
    """``fig`` as PNG bytes; ``compact`` quantises to a 256-colour palette (Pillow): line plots
    look the same and the file is about 3x smaller. In a notebook,
    ``IPython.display.Image(data=png_bytes(fig))`` shows a figure without storing a full-size PNG."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    if not compact:
        return buf.getvalue()
    from PIL import Image

    buf.seek(0)
    out = io.BytesIO()
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, format="png", optimize=True)
    return out.getvalue()


def save(fig: Figure | None, path: str | Path, dpi: int = 90, compact: bool = True) -> Path | None:
    """Write ``fig`` as a PNG (parent folders created, see :func:`png_bytes`); ``None`` passes through."""
    if fig is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, png_bytes(fig, dpi=dpi, compact=compact))
    return path


def _runs_of(summary: dict, name: str) -> list[dict]:
    return [r for r in summary["runs"] if r["variant"] == name]


def mean_curve(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Mean over seeds at the steps every seed reached (curves share their evaluation steps)."""
    curves = [(x, y) for x, y in curves if len(x)]
    if not curves:
        return np.array([]), np.array([])
    n = min(len(x) for x, _ in curves)
    x = curves[0][0][:n]
    return x, np.mean(np.stack([y[:n] for _, y in curves]), axis=0)


def _layer_reduce(rows: list, how: str) -> np.ndarray:
    """Reduce a list (over evaluations) of per-layer lists to one value per evaluation."""
    out = []
    for row in rows:
        vals = [v for v in (row or []) if v is not None and math.isfinite(v)]
        out.append(
            (max(vals) if how == "max" else min(vals) if how == "min" else float(np.mean(vals))) if vals else np.nan
        )
    return np.asarray(out, dtype=float)


def _series(run: dict, key: str, how: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of a diagnostic of a run, reduced over layers.

    ``key``: ``attn_qk`` (max of Q and K sigma_max), ``qk_product`` (sigma_Q * sigma_K per layer),
    ``sigma:<kind>``, ``grad:<kind>`` (``grad:attn_qk`` = sqrt(|g_Q|^2 + |g_K|^2)), or an
    attention statistic (``max_abs_logit``, ``mean_entropy``, ``saturated_frac``, ``jacobian_norm``)."""
    d = run.get("diag") or {}
    steps = np.asarray(d.get("step", []), dtype=float)
    if not len(steps):
        return steps, steps
    sig, grad, att = d.get("sigma_max", {}), d.get("grad_norm", {}), d.get("attention", {})

    def combine(a, b, fn):
        return [
            [fn(x, y) if x is not None and y is not None else None for x, y in zip(ra or [], rb or [])]
            for ra, rb in zip(a, b)
        ]

    if key in ("attn_qk", "sigma:attn_qk"):
        rows = combine(sig.get("attn_q", []), sig.get("attn_k", []), max)
    elif key == "qk_product":
        rows = combine(sig.get("attn_q", []), sig.get("attn_k", []), lambda x, y: x * y)
    elif key == "grad:attn_qk":
        rows = combine(grad.get("attn_q", []), grad.get("attn_k", []), lambda x, y: math.hypot(x, y))
    elif key.startswith("sigma:"):
        rows = sig.get(key[6:], [])
    elif key.startswith("grad:"):
        rows = grad.get(key[5:], [])
    else:
        rows = att.get(key, [])
    if not rows:
        return np.array([]), np.array([])
    n = min(len(steps), len(rows))
    return steps[:n], _layer_reduce(rows[:n], how)


def _plot_variant_series(ax, summary, variant, getter, mark_divergence=True, label=True):
    """Thin line per seed, thick mean; returns whether anything was drawn."""
    variants = summary["variants"]
    c, ls = color_of(variant, variants), _linestyle(variant, variants)
    curves, drawn = [], False
    for run in _runs_of(summary, variant["name"]):
        x, y = getter(run)
        if not len(x) or not np.isfinite(y).any():
            continue
        curves.append((x, y))
        ax.plot(x, y, color=c, ls=ls, lw=0.8, alpha=0.35)
        drawn = True
        if mark_divergence and run.get("status") == "diverged":
            finite = np.isfinite(y)
            ax.plot(x[finite][-1], y[finite][-1], marker="x", color=c, ms=8, mew=2)
    if drawn:
        mx, my = mean_curve(curves)
        if len(mx):
            ax.plot(mx, my, color=c, ls=ls, lw=2.0, label=_label(variant) if label else None)
    return drawn


def add_legend(ax, **kw) -> None:
    """A legend on ``ax`` when it has labelled artists."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, **kw)


def mark_empty(ax, text="no data") -> None:
    """Say in a panel that it has nothing to draw."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5")


def _positive(ax) -> bool:
    """Switch to a log y-axis when every plotted value is positive and they span > 10x."""
    ys = np.concatenate([np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()] or [np.array([])])
    ys = ys[np.isfinite(ys)]
    if len(ys) and ys.min() > 0 and ys.max() / ys.min() > 10:
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.set_yscale("log")
        plain = FuncFormatter(lambda y, _: f"{y:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain if ys.max() / ys.min() < 30 else NullFormatter())
        return True
    return False


def _title(summary: dict) -> str:
    st = summary.get("study", {})
    cfg = st.get("base_config", {})
    seeds = st.get("seeds", [])
    bits = [f"model {cfg.get('model', '?')}", f"{cfg.get('max_iters', '?')} iters", f"{len(seeds)} seed(s)"]
    if cfg.get("muon_lr") is not None:
        bits.append(f"muon lr {cfg['muon_lr']:g}")
    return ", ".join(bits)


# ----------------------------------------------------------------------------- figures
def _eval_curve(run):
    ev = run.get("eval") or {}
    return np.asarray(ev.get("step", []), dtype=float), np.asarray(
        [np.nan if v is None else v for v in ev.get("val", [])], dtype=float
    )


def val_loss(summary: dict, zoom_from: float = 0.4) -> Figure:
    """Validation loss of every variant: all of training (left) and zoomed on the stable runs
    over the last ``1 - zoom_from`` of training (right), as in the paper's figure."""
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax_full, ax_zoom = fig.subplots(1, 2)
    stable_vals, max_step = [], 0
    for v in summary["variants"]:
        _plot_variant_series(ax_full, summary, v, _eval_curve)
        runs = _runs_of(summary, v["name"])
        for r in runs:
            x, _ = _eval_curve(r)
            if len(x):
                max_step = max(max_step, x.max())
        if runs and all(r.get("status") == "finished" for r in runs):
            _plot_variant_series(ax_zoom, summary, v, _eval_curve, label=False)
            for r in runs:
                x, y = _eval_curve(r)
                stable_vals.append((x, y))
    ax_full.set(xlabel="step", ylabel="validation loss (nats)", title="validation loss")
    add_legend(ax_full, fontsize=8)
    ax_zoom.set(xlabel="step", title=f"stable runs, last {100 * (1 - zoom_from):.0f}% of training")
    if stable_vals and max_step:
        lo_x = zoom_from * max_step
        tail = np.concatenate([y[x >= lo_x] for x, y in stable_vals if (x >= lo_x).any()] or [np.array([])])
        tail = tail[np.isfinite(tail)]
        if len(tail):
            pad = 0.05 * max(tail.max() - tail.min(), 1e-3)
            ax_zoom.set_xlim(lo_x, max_step * 1.01)
            ax_zoom.set_ylim(tail.min() - pad, tail.max() + pad)
    else:
        mark_empty(ax_zoom, "no stable runs")
    fig.suptitle(_title(summary))
    return fig


def sigma_max(summary: dict) -> Figure:
    r"""$\sigma_{\max}$ (max over layers) during training per module type and variant."""
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for ax, (kind, title) in zip(axes, KIND_PANELS):
        key = "attn_qk" if kind == "attn_qk" else f"sigma:{kind}"
        drawn = False
        for v in summary["variants"]:
            drawn |= _plot_variant_series(ax, summary, v, lambda r, key=key: _series(r, key, "max"))
        if not drawn:
            mark_empty(ax, "no Muon-managed matrices")
        _positive(ax)
        ax.set(xlabel="step", ylabel=r"$\sigma_{\max}$ (max over layers)", title=title)
    add_legend(axes[0], fontsize=8)
    fig.suptitle(r"largest singular value per module type  -  " + _title(summary))
    return fig


def attention(summary: dict) -> Figure:
    """Attention saturation during training: max |logit|, mean row entropy, saturated rows and
    softmax Jacobian norm (worst layer)."""
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    panels = (
        ("max_abs_logit", "max", "max |attention logit|"),
        ("mean_entropy", "min", "mean row entropy (nats), min over layers"),
        ("saturated_frac", "max", "fraction of rows with max p > 0.99"),
        ("jacobian_norm", "min", "softmax Jacobian norm, min over layers"),
    )
    for ax, (key, how, title) in zip(axes, panels):
        drawn = False
        for v in summary["variants"]:
            drawn |= _plot_variant_series(ax, summary, v, lambda r, key=key, how=how: _series(r, key, how))
        if not drawn:
            mark_empty(ax)
        if key == "max_abs_logit":
            _positive(ax)
        ax.set(xlabel="step", title=title)
    add_legend(axes[0], fontsize=8)
    fig.suptitle("attention saturation  -  " + _title(summary))
    return fig


def overhead(summary: dict) -> Figure:
    """Median ms per training step per variant (mean over seeds), with the ratio to ``adamw`` and
    to ``unconstrained`` Muon when those ran."""
    rows = [r for r in summary.get("table", []) if r.get("ms_per_step") is not None]
    fig = Figure(figsize=(max(6, 1.1 * len(rows) + 2), 4.2), layout="constrained")
    ax = fig.subplots()
    if not rows:
        mark_empty(ax, "no timings")
        return fig
    names = [r["variant"] for r in rows]
    ms = [r["ms_per_step"] for r in rows]
    by_name = {v["name"]: v for v in summary["variants"]}
    colors = [color_of(by_name[n], summary["variants"]) if n in by_name else "#000000" for n in names]
    bars = ax.bar(range(len(names)), ms, color=colors)
    for bar, r in zip(bars, rows):
        bits = []
        if r.get("vs_adamw") is not None:
            bits.append(f"{r['vs_adamw']:.2f}x AdamW")
        if r.get("vs_unconstrained") is not None:
            bits.append(f"{r['vs_unconstrained']:.2f}x Muon")
        ax.annotate(
            "\n".join(bits), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7
        )
    ax.set_xticks(
        range(len(names)),
        [by_name[n].get("label", n) if n in by_name else n for n in names],
        rotation=20,
        ha="right",
        fontsize=8,
    )
    ax.set(ylabel="ms per training step (median)", title="step time per assignment  -  " + _title(summary))
    ax.margins(y=0.2)
    return fig


def _dgram_attention(variant: dict) -> bool:
    return "dgram" in str(variant.get("attn") or "")


def _jacobian_against_logit(ax, summary: dict, chosen: list[dict]) -> None:
    """Every (layer, evaluation) of every run of ``chosen``: softmax Jacobian norm against max |logit|."""
    allv = summary["variants"]
    for v in chosen:
        xs, ys = [], []
        for run in _runs_of(summary, v["name"]):
            att = (run.get("diag") or {}).get("attention", {})
            for lrow, jrow in zip(att.get("max_abs_logit", []), att.get("jacobian_norm", [])):
                for lv, jv in zip(lrow or [], jrow or []):
                    if lv is not None and jv is not None:
                        xs.append(lv)
                        ys.append(jv)
        if xs:
            marker = {"-": "o", "--": "s", ":": "^", "-.": "D"}[_linestyle(v, allv)]
            ax.scatter(xs, ys, s=8, alpha=0.5, color=color_of(v, allv), marker=marker, label=_label(v))
    ax.set(
        xlabel="max |logit| of a layer", ylabel="softmax Jacobian norm of the layer", title="all layers and evaluations"
    )
    if ax.collections:
        xs_all = np.concatenate([np.asarray(c.get_offsets())[:, 0] for c in ax.collections])
        if len(xs_all) and xs_all.min() > 0 and xs_all.max() / xs_all.min() > 10:
            ax.set_xscale("log")
    else:
        mark_empty(ax)


def mechanism(summary: dict, variants: Iterable[str] | None = None) -> Figure | None:
    r"""The paper's chain, measured: $\sigma_Q\sigma_K$ grows -> max |logit| grows -> entropy and
    softmax Jacobian fall -> the gradient reaching $W_Q, W_K$ shrinks; last panel, every
    (layer, evaluation) of every run: softmax Jacobian norm against max |logit|.

    Default variants: those with (unbounded or bounded) DGram attention plus ``hetero`` and
    ``all-stiefel`` as references; ``None`` when no run has DGram attention."""
    allv = summary["variants"]
    if variants is None:
        chosen = [v for v in allv if _dgram_attention(v)]
        if not chosen:
            return None
        refs = [v for v in allv if (v.get("base") or v["name"]) in ("hetero", "all-stiefel", "unconstrained")]
        swept = [v["sweep"]["value"] for v in refs if v.get("sweep")]
        if swept:  # references at the shared value and at the largest swept value
            refs = [
                v for v in refs if not v.get("sweep") or v["name"] == v.get("base") or v["sweep"]["value"] == max(swept)
            ]
        chosen += [v for v in refs if v not in chosen]
    else:
        wanted = set(variants)
        chosen = [v for v in allv if v["name"] in wanted]
    sub = {**summary, "variants": chosen}
    fig = Figure(figsize=(17, 8), layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    panels = (
        ("qk_product", "max", r"$\sigma_{\max}(W_Q)\,\sigma_{\max}(W_K)$ (max over layers)"),
        ("max_abs_logit", "max", "max |attention logit|"),
        ("mean_entropy", "min", "mean row entropy, min over layers"),
        ("jacobian_norm", "min", "softmax Jacobian norm, min over layers"),
        ("grad:attn_qk", "mean", r"$\|\nabla_{W_Q, W_K} L\|_F$ (before clipping), mean over layers"),
    )
    for ax, (key, how, title) in zip(axes, panels):
        drawn = False
        for v in chosen:
            drawn |= _plot_variant_series(ax, sub, v, lambda r, key=key, how=how: _series(r, key, how))
        if not drawn:
            mark_empty(ax)
        if key in ("qk_product", "max_abs_logit", "grad:attn_qk"):
            _positive(ax)
        ax.set(xlabel="step", title=title)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    _jacobian_against_logit(axes[5], summary, chosen)
    fig.suptitle(
        "mechanism: spectral growth -> logit growth -> saturation -> vanishing attention gradients  -  "
        + _title(summary)
    )
    return fig


def sweep(summary: dict) -> Figure | None:
    """For a swept hyperparameter, per family (a preset or a custom variant): final validation loss
    of the finished runs, best validation loss of all runs (x = diverged) and the max |attention
    logit| at the last evaluation, against the value; ``None`` when the study has no sweep.

    Three panels filled in one pass over the families, hence the length."""
    sw = [v for v in summary["variants"] if v.get("sweep")]
    if not sw:
        return None
    key = sw[0]["sweep"]["key"]
    fig = Figure(figsize=(13, 4.5), layout="constrained")
    ax_final, ax_best, ax_logit = fig.subplots(1, 3)
    families = list(dict.fromkeys(v.get("base") or v["preset"] for v in sw))
    values = sorted({v["sweep"]["value"] for v in sw})
    for fam in families:
        group = sorted([v for v in sw if (v.get("base") or v["preset"]) == fam], key=lambda v: v["sweep"]["value"])
        color = color_of(group[0], summary["variants"])
        xs, finals, bests, logits = [], [], [], []
        for v in group:
            runs = _runs_of(summary, v["name"])
            if not runs:
                continue
            x = v["sweep"]["value"]
            fin, best, lg = [], [], []
            for r in runs:
                if r.get("status") == "finished" and r.get("final_val") is not None:
                    fin.append(r["final_val"])
                    ax_final.plot(x, r["final_val"], "o", color=color, alpha=0.4, ms=4)
                if r.get("best_val") is not None:
                    best.append(r["best_val"])
                    diverged = r.get("status") in ("diverged", "failed")
                    ax_best.plot(
                        x,
                        r["best_val"],
                        "x" if diverged else "o",
                        color=color,
                        alpha=0.9 if diverged else 0.4,
                        ms=8 if diverged else 4,
                        mew=2,
                    )
                _, y = _series(r, "max_abs_logit", "max")
                if len(y) and np.isfinite(y[-1]):
                    lg.append(y[-1])
                    ax_logit.plot(x, y[-1], "o", color=color, alpha=0.4, ms=4)
            xs.append(x)
            finals.append(float(np.mean(fin)) if fin else np.nan)
            bests.append(float(np.mean(best)) if best else np.nan)
            logits.append(float(np.mean(lg)) if lg else np.nan)
        if xs:
            label = fam if not group[0].get("label") else group[0]["label"].rsplit(",", 1)[0]
            ax_final.plot(xs, finals, "-", color=color, label=label)
            ax_best.plot(xs, bests, "-", color=color)
            ax_logit.plot(xs, logits, "-", color=color)
    for ax in (ax_final, ax_best, ax_logit):
        ax.set_xscale("log")
        ax.set_xticks(values, [f"{v:g}" for v in values])
        ax.minorticks_off()
        ax.set_xlabel(key)
    ax_final.set(ylabel="final validation loss", title="finished runs")
    ax_best.set(ylabel="best validation loss", title="best validation loss (x = diverged run)")
    ax_logit.set(ylabel="max |logit|, worst layer", title="attention logits at the last evaluation")
    _positive(ax_logit)
    add_legend(ax_final, fontsize=8)
    fig.suptitle(f"sweep of {key}  -  " + _title(summary))
    return fig


def write_all(summary: dict, out_dir: str | Path) -> list[Path]:
    """Every figure that applies to the study, as PNGs in ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    figures = {
        "val_loss.png": val_loss(summary),
        "sigma_max.png": sigma_max(summary),
        "attention.png": attention(summary),
        "overhead.png": overhead(summary),
        "mechanism.png": mechanism(summary),
        "sweep.png": sweep(summary),
    }
    written = []
    for name, fig in figures.items():
        path = save(fig, out / name)
        if path is not None:
            written.append(path)
        elif (out / name).exists():  # a stale figure from an earlier report of another study
            (out / name).unlink()
    return written
