r"""Several study folders side by side: one table, the ordering in each, and (for studies of
different lengths) the gap to ``unconstrained`` against the number of steps.

A comparison folder holds ``compare.json`` (its inputs: a label and a study folder each, and the
command), and what `compare` writes from the inputs' ``summary.json``: ``compare.md``,
``compare.csv``, ``val_curves.png`` (mean validation curve of each variant in each study) and
``gap_vs_steps.png`` (when the studies differ in ``max_iters``; then ``compare.md`` also fits each
variant's gap as a line in the log of the cumulative Muon step and extrapolates it to the
published schedule's, `length_trend`).
``geomtrain report FOLDER`` rebuilds it, so every number comes from committed study outputs.

Per variant and study: final val loss (mean ± std over the finished seeds), final train loss
(mean over seeds of the logged training losses in the last 10% of steps: single batches, so
noisy), both as gaps to the same study's ``unconstrained`` mean, the status, the end-of-training
largest $\sigma_{\max}$ of $W_Q$ and $W_K$ (over layers) and max |logit|, ms per step, and the cumulative Muon step
$\sum_t \eta_t$ of the schedule (`geomtrain.train.lr_at` scaled to ``muon_lr``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from .._io import atomic_write_json, atomic_write_text, read_json
from .collect import load_summary, make_table
from .plan import StudyError
from .stats import DEFAULT_DELTA, VERDICT_RULE, compare_arms

__all__ = [
    "COMPARE_FILE",
    "best_of_sweep",
    "compare",
    "compare_rows",
    "load_study",
    "cumulative_muon_step",
    "length_trend",
    "trend_lines",
    "paper_cumulative_step",
    "ordering",
    "rebuild",
    "is_comparison",
    "study_commits",
    "check_commits",
]

COMPARE_FILE = "compare.json"
REFERENCE = "unconstrained"
TRAIN_TAIL = 0.1  # final train loss: the logged losses of the last 10% of steps


def cumulative_muon_step(base_config: dict, overrides: dict | None = None) -> float:
    r"""$\sum_{t < T} \eta_t$ with $\eta_t$ = ``muon_lr * lr_at(t) / lr`` of the run's config."""
    from ..config import make_config
    from ..train import lr_at

    cfg = make_config({**base_config, **(overrides or {})})
    return sum(cfg.muon_lr * lr_at(t, cfg) / cfg.lr for t in range(cfg.max_iters))


@functools.cache  # a constant of the gpt2 defaults: a 50,000-step sum, computed once
def paper_cumulative_step() -> float:
    """The cumulative Muon step of the published schedule: the ``gpt2`` defaults (the paper's:
    50,000 steps, 1,000 warmup, cosine to 0.1 of the peak, ``muon_lr`` 0.02), about 549."""
    return cumulative_muon_step({"model": "gpt2"})


def _line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``(a, b)`` of ``y = a + b x``; None with fewer than two distinct ``x``."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def _at(fit: tuple[float, float] | None, x: float) -> float | None:
    return None if fit is None else fit[0] + fit[1] * x


def length_trend(rows: Sequence[dict]) -> list[dict]:
    r"""Per variant (not ``unconstrained``) of studies that differ in length: the gaps to
    ``unconstrained`` as a straight line in $\log_{10}\sum_t\eta_t$ (least squares over the studies),
    its slope per decade, its value at the published schedule's cumulative step
    (`paper_cumulative_step`, an extrapolation), the steps between which the val gap changed sign,
    and where the fitted val line crosses zero ahead of the longest run (in cumulative step, and in
    steps of the longest run's schedule). Empty when all studies have the same length."""
    if len({r["max_iters"] for r in rows}) < 2:
        return []
    x_paper = math.log10(paper_cumulative_step())
    out = []
    for v in dict.fromkeys(r["variant"] for r in rows):
        if v == REFERENCE:
            continue
        mine = sorted((r for r in rows if r["variant"] == v and r["cumulative_step"]), key=lambda r: r["max_iters"])
        fits = {}
        for key in ("val_gap", "train_gap"):
            fits[key] = _line_fit([(math.log10(r["cumulative_step"]), r[key]) for r in mine if r[key] is not None])
        if fits["val_gap"] is None:
            continue
        a, b = fits["val_gap"]
        gaps = [(r["max_iters"], r["val_gap"]) for r in mine if r["val_gap"] is not None]
        flips = [(s0, s1) for (s0, g0), (s1, g1) in zip(gaps, gaps[1:]) if (g0 < 0) != (g1 < 0)]
        longest = mine[-1]
        crossing = None
        if b != 0 and (gaps[-1][1] > 0) == (b < 0):  # the fitted gap moves towards zero
            x0 = -a / b
            if x0 > math.log10(longest["cumulative_step"]):
                crossing = 10**x0
        out.append(
            {
                "variant": v,
                "points": len(gaps),
                "val_fit": (a, b),  # intercept and slope in log10 of the cumulative step
                "val_slope_per_decade": b,
                "val_gap_at_paper": _at(fits["val_gap"], x_paper),
                "train_slope_per_decade": fits["train_gap"][1] if fits["train_gap"] else None,
                "train_gap_at_paper": _at(fits["train_gap"], x_paper),
                "sign_flips_between_steps": flips,
                "zero_crossing_cumulative_step": crossing,
                "zero_crossing_steps": None
                if crossing is None
                else crossing * longest["max_iters"] / longest["cumulative_step"],
            }
        )
    return out


def trend_lines(trend: Sequence[dict]) -> list[str]:
    """Markdown lines for `length_trend`."""
    if not trend:
        return []
    paper = paper_cumulative_step()
    lines = [
        "",
        f"Gap to `{REFERENCE}` against training length: a least-squares line in log10 of the cumulative "
        f"Muon step per variant, extrapolated to the published schedule's {paper:.0f} (an extrapolation, "
        "not a measurement; with two lengths the line has no error estimate).",
        "",
        "| variant | lengths | val gap slope per decade | val gap at the paper's step | train gap slope "
        "| train gap at the paper's step | val gap changed sign | fitted val gap reaches 0 at |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in trend:
        flips = ", ".join(f"{a}-{b} steps" for a, b in t["sign_flips_between_steps"]) or "no"
        cross = (
            "-"
            if t["zero_crossing_cumulative_step"] is None
            else f"Σ η ≈ {t['zero_crossing_cumulative_step']:.3g} (≈ {t['zero_crossing_steps']:,.0f} steps)"
        )
        lines.append(
            f"| `{t['variant']}` | {t['points']} | {t['val_slope_per_decade']:+.4f} | {t['val_gap_at_paper']:+.4f} | "
            f"{_fmt(t['train_slope_per_decade'], '+.4f')} | {_fmt(t['train_gap_at_paper'], '+.4f')} | {flips} | "
            f"{cross} |"
        )
    return lines


def _final_train(runs: list[dict], max_iters: int) -> float | None:
    values = []
    for run in runs:
        if run.get("status") != "finished":
            continue
        pairs = [(s, v) for s, v in zip(run["train"]["step"], run["train"]["loss"]) if v is not None]
        tail = [v for s, v in pairs if s >= (1 - TRAIN_TAIL) * max_iters]
        if tail and all(math.isfinite(v) for v in tail):
            values.append(sum(tail) / len(tail))
    return sum(values) / len(values) if values else None


def load_study(folder: str | Path) -> dict:
    """A study folder's ``summary.json`` with its table rebuilt (`make_table`)."""
    folder = Path(folder)
    if not (folder / "summary.json").exists():
        raise StudyError(f"{folder} has no summary.json (run the study, or `geomtrain report {folder}` first)")
    summary = load_summary(folder)
    summary["table"] = make_table(summary["variants"], summary["runs"])
    return summary


def compare_rows(studies: Sequence[tuple[str, str | Path, dict]]) -> list[dict]:
    """One row per (study, variant) of ``(label, folder, summary)`` triples (summaries from
    `load_study`), in the order of the studies and of each study's table."""
    rows = []
    for label, folder, summary in studies:
        base = summary.get("study", {}).get("base_config", {})
        iters = int(base.get("max_iters", 0))
        by_name = {r["variant"]: r for r in summary["table"]}
        overrides = {v["name"]: v.get("overrides", {}) for v in summary["variants"]}
        bases = {v["name"]: v.get("base") or v["name"] for v in summary["variants"]}
        runs_by: dict[str, list[dict]] = {}
        for run in summary["runs"]:
            runs_by.setdefault(run["variant"], []).append(run)
        ref = by_name.get(REFERENCE, {}).get("final_val_mean")
        ref_train = _final_train(runs_by.get(REFERENCE, []), iters) if REFERENCE in by_name else None
        for row in summary["table"]:
            name = row["variant"]
            train_loss = _final_train(runs_by.get(name, []), iters)
            val = row.get("final_val_mean")
            rows.append(
                {
                    "study": label,
                    "folder": str(folder),
                    "variant": name,
                    "base": bases.get(name, name),
                    "max_iters": iters,
                    "seeds": row.get("seeds"),
                    "status": row.get("status"),
                    "final_val_mean": val,
                    "final_val_std": row.get("final_val_std"),
                    "val_gap": None if val is None or ref is None else val - ref,
                    "final_train_mean": train_loss,
                    "train_gap": None if train_loss is None or ref_train is None else train_loss - ref_train,
                    "end_sigma_qk": row.get("end_sigma_qk"),
                    "end_max_logit": row.get("end_max_logit"),
                    "ms_per_step": row.get("ms_per_step"),
                    "cumulative_step": cumulative_muon_step(base, overrides.get(name)) if base else None,
                    "final_by_seed": {
                        str(r["seed"]): r["final_val"] for r in runs_by.get(name, []) if r.get("final_val") is not None
                    },
                    "seed_runs": runs_by.get(name, []),  # every run, diverged and unfinished too: the pairing
                }
            )
    return rows


def ordering(rows: Sequence[dict], study: str) -> str:
    """The variants of one study by final val loss, best first (``a < b < c``); unfinished last."""
    mine = [r for r in rows if r["study"] == study]
    done = sorted((r for r in mine if r["final_val_mean"] is not None), key=lambda r: r["final_val_mean"])
    rest = [r["variant"] for r in mine if r["final_val_mean"] is None]
    return " < ".join(f"`{r['variant']}`" for r in done) + (f" (no finished run: {', '.join(rest)})" if rest else "")


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def compare_markdown(rows: Sequence[dict], command: str) -> str:
    labels = list(dict.fromkeys(r["study"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cell = {(r["study"], r["variant"]): r for r in rows}
    head = ["variant"] + [f"{lab}: val (gap)" for lab in labels]
    lines = [
        "# Studies compared",
        "",
        f"Command: `{command}`",
        "",
        "Final val loss, mean ± std over finished seeds, and in brackets its gap to the same study's "
        f"`{REFERENCE}` (negative: better than it). Train: mean of the logged training losses over "
        "the last 10% of steps (single batches).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for v in variants:
        cells = [f"`{v}`"]
        for lab in labels:
            r = cell.get((lab, v))
            if r is None:
                cells.append("")
            elif r["final_val_mean"] is None:
                cells.append(r["status"] or "-")
            else:
                std = f" ± {r['final_val_std']:.4f}" if r["final_val_std"] is not None else ""
                cells.append(f"{r['final_val_mean']:.4f}{std} ({_fmt(r['val_gap'], '+.4f')})")
        lines.append("| " + " | ".join(cells) + " |")
    cols = (
        "study",
        "variant",
        "steps",
        "cumulative step",
        "status",
        "train (gap)",
        "max σ(W_Q), σ(W_K)",
        "max logit",
        "ms/step",
    )
    lines += ["", "| " + " | ".join(cols) + " |"]
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['study']} | `{r['variant']}` | {r['max_iters']} | {_fmt(r['cumulative_step'], '.2f')} | "
            f"{r['status']} | {_fmt(r['final_train_mean'], '.4f')} ({_fmt(r['train_gap'], '+.4f')}) | "
            f"{_fmt(r['end_sigma_qk'], '.3g')} | {_fmt(r['end_max_logit'], '.3g')} | {_fmt(r['ms_per_step'], '.0f')} |"
        )
    lines += paired_lines(rows)
    lines += trend_lines(length_trend(rows))
    lines += ["", "Ordering by final val loss, best first:", ""]
    lines += [f"- {lab}: {ordering(rows, lab)}" for lab in labels]
    for lab in labels:
        best = best_of_sweep(rows, lab)
        if best is not None:
            lines += ["", f"{lab}, each preset at its best swept value: {ordering(best, lab)}"]
            lines += [f"  - `{r['base']}`: best `{r['best_variant']}` ({r['final_val_mean']:.4f})" for r in best]
    return "\n".join(lines) + "\n"


def _left_out(c: dict) -> str:
    """The seeds of a pair that gave no difference, and why (one diverged side decides the verdict)."""
    parts = [
        (c["arm_only_diverged"], "diverged in this study only"),
        (c["reference_only_diverged"], "diverged in the first study only"),
        (sum(bool(p.get("unfinished")) for p in c["per_seed"]), "unfinished"),
    ]
    both = len(c["per_seed"]) - sum(p["diff"] is not None for p in c["per_seed"]) - sum(n for n, _ in parts)
    parts.append((both, "diverged in both"))
    text = "; ".join(f"{n} {why}" for n, why in parts if n)
    return f" ({text})" if text else ""


def paired_lines(rows: Sequence[dict], delta: float = DEFAULT_DELTA) -> list[str]:
    """Markdown lines: per variant, each study's final val loss minus the first study's, seed by seed
    (the same seed shares data order, validation batches and initial weights): mean ± std over the
    seeds both finished, on how many the other study is lower, the 95% interval and the verdict of
    `geomtrain.study.stats.compare_arms` (the study report's rule, divergence on one side included).
    Empty without shared seeds."""
    labels = list(dict.fromkeys(r["study"] for r in rows))
    cell = {(r["study"], r["variant"]): r for r in rows}
    out = []
    for lab in labels[1:]:
        for v in dict.fromkeys(r["variant"] for r in rows):
            a, b = cell.get((labels[0], v)), cell.get((lab, v))
            if a is None or b is None:
                continue
            pair = [{**r, "variant": "arm"} for r in b["seed_runs"]]
            pair += [{**r, "variant": "reference"} for r in a["seed_runs"]]
            c = compare_arms("arm", "reference", pair, delta)
            if not c["seeds"]:
                continue
            d = [p["diff"] for p in c["per_seed"] if p["diff"] is not None]
            spread = "" if c["se"] is None else f" ± {c['se'] * math.sqrt(c['n']):.4f}"  # the sample sd
            mean = "-" if c["mean"] is None else f"{c['mean']:+.4f}{spread}"
            interval = "-" if c["low"] is None else f"[{c['low']:+.4f}, {c['high']:+.4f}]"
            out.append(
                f"| `{v}` | {lab} − {labels[0]} | {mean}{_left_out(c)} | {sum(x < 0 for x in d)}/{len(d)} "
                f"| {interval} | {c['verdict']} |"
            )
    if not out:
        return []
    head = [
        "",
        f"Paired by seed (same data order, validation batches and initial weights); delta = {delta:g}: {VERDICT_RULE}",
        "",
    ]
    return (
        head
        + [
            "| variant | difference | final val, mean ± std | seeds lower | 95% interval | verdict |",
            "|---|---|---|---|---|---|",
        ]
        + out
    )


def study_commits(summary: dict) -> list[str]:
    """The git commits a study's invocations ran at (short; ``?`` where none was recorded)."""
    st = summary.get("study", {})
    top = st.get("environment") or {}
    envs = [i.get("environment") or top for i in st.get("invocations", [])] or [top]
    commits = [((e.get("git") or {}).get("commit") or "?")[:7] for e in envs]
    return sorted(set(commits))


def check_commits(labels: Sequence[str], summaries: Sequence[dict]) -> None:
    """``StudyError`` naming each study's commits when they differ: paired runs must come from one
    code (pass ``across_commits`` to pair them anyway)."""
    commits = [study_commits(s) for s in summaries]
    if len({tuple(c) for c in commits}) > 1 or any(len(c) > 1 for c in commits):
        which = "; ".join(f"{lab} at {', '.join(c)}" for lab, c in zip(labels, commits))
        raise StudyError(
            f"the studies ran at different commits ({which}): their runs may differ for that reason alone; "
            "pass --across-commits to pair them anyway"
        )


def best_of_sweep(rows: Sequence[dict], study: str) -> list[dict] | None:
    """For a study with swept variants: per base preset, its variant of lowest final val loss
    (relabelled by the base); None when the study has no sweep."""
    mine = [r for r in rows if r["study"] == study]
    if all(r["base"] == r["variant"] for r in mine):
        return None
    best: dict[str, dict] = {}
    for r in mine:
        if r["final_val_mean"] is not None and (
            r["base"] not in best or r["final_val_mean"] < best[r["base"]]["final_val_mean"]
        ):
            best[r["base"]] = r
    return [{**r, "variant": r["base"], "best_variant": r["variant"]} for r in best.values()]


def compare_csv(rows: Sequence[dict]) -> str:
    keys = [k for k in rows[0] if k not in ("final_by_seed", "seed_runs")] if rows else []  # per seed: compare.md
    out = [",".join(keys)]
    for r in rows:
        out.append(",".join("" if r[k] is None else str(r[k]) for k in keys))
    return "\n".join(out) + "\n"


def gap_figure(rows: Sequence[dict]):
    """Gap to ``unconstrained`` (val and train) against steps and against the cumulative Muon step,
    one line per variant (with its `length_trend` line, dashed, to the published schedule's step);
    None when all studies have the same length."""
    if len({r["max_iters"] for r in rows}) < 2:
        return None
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    from .figures import add_legend

    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 3)
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if v != REFERENCE]
    paper = paper_cumulative_step()
    fits = {t["variant"]: t["val_fit"] for t in length_trend(rows)}
    for v in variants:
        mine = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["max_iters"])
        for ax, x_key, y_key in ((axes[0], "max_iters", "val_gap"), (axes[1], "max_iters", "train_gap")):
            pts = [(r[x_key], r[y_key]) for r in mine if r[y_key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=v)
        pts = [(r["cumulative_step"], r["val_gap"]) for r in mine if r["val_gap"] is not None and r["cumulative_step"]]
        if pts:
            (line,) = axes[2].plot(*zip(*pts), marker="o", label=v)
            if v in fits:  # the length_trend line, extended to the published schedule
                xs = [min(x for x, _ in pts), paper]
                axes[2].plot(xs, [_at(fits[v], math.log10(x)) for x in xs], ls="--", lw=0.8, color=line.get_color())
    axes[2].axvline(paper, color="0.3", ls=":", lw=0.8)
    axes[2].text(paper, axes[2].get_ylim()[1], " paper", fontsize=7, va="top", ha="right", rotation=90)
    titles = (
        "val loss gap to unconstrained",
        "train loss gap (last 10% of steps)",
        "val gap vs cumulative Muon step (dashed: fit)",
    )
    for ax, title, xlabel in zip(axes, titles, ("steps", "steps", r"$\sum_t \eta_t$")):
        ax.set_xscale("log")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
    steps = sorted({r["max_iters"] for r in rows})
    for ax in axes[:2]:  # the studies' lengths as the ticks, without log-scale minor labels
        ax.set_xticks(steps, [f"{n:,}" for n in steps])
        ax.xaxis.set_minor_formatter(NullFormatter())
    add_legend(axes[0], fontsize=7)
    fig.tight_layout()
    return fig


def curves_figure(studies: Sequence[tuple[str, dict]]):
    """Mean validation curve (over the seeds, at the steps all of them reached) of each variant that
    two or more studies share, in each study: one panel per variant, one line per study; None for
    one study."""
    if len(studies) < 2:
        return None
    import numpy as np
    from matplotlib.figure import Figure

    from .figures import add_legend, mean_curve

    counts: dict[str, int] = {}
    for _, summary in studies:
        for name in dict.fromkeys(r["variant"] for r in summary["runs"]):
            counts[name] = counts.get(name, 0) + 1
    shared = [v for v, c in counts.items() if c > 1]
    variants = shared or list(counts)  # the variants two studies have, else all
    cols = min(3, len(variants))
    rows_n = math.ceil(len(variants) / cols)
    fig = Figure(figsize=(4 * cols, 2.8 * rows_n))
    axes = np.atleast_1d(fig.subplots(rows_n, cols, squeeze=False)).ravel()
    for ax, name in zip(axes, variants):
        for label, summary in studies:
            curves = [
                (np.asarray(r["eval"]["step"], float), np.asarray(r["eval"]["val"], float))
                for r in summary["runs"]
                if r["variant"] == name and r["eval"]["step"]
            ]
            x, y = mean_curve(curves)
            if len(x):
                ax.plot(x, y, label=label, lw=1.2)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("val loss", fontsize=8)
        finite = [ln.get_ydata() for ln in ax.get_lines()]
        if finite:
            lows = [float(np.nanmin(v)) for v in finite]
            ends = [float(v[-1]) for v in finite]
            ax.set_ylim(min(lows) - 0.05, max(ends) + 0.6)  # zoom on the second half of training
        add_legend(ax, fontsize=7)
    for ax in axes[len(variants) :]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def compare(
    out: str | Path,
    studies: Sequence[tuple[str, str | Path]],
    command: str = "",
    print_fn: Callable = print,
    across_commits: bool = False,
) -> list[dict]:
    """Write the comparison of ``studies`` (``(label, folder)`` pairs) into ``out``; returns its rows.
    Studies made at different commits are refused (`check_commits`) unless ``across_commits``; then
    ``compare.md`` names each study's commits."""
    from .figures import save

    if len(studies) < 1:
        raise StudyError("compare needs at least one LABEL=FOLDER")
    labels = [lab for lab, _ in studies]
    if len(set(labels)) != len(labels):
        raise StudyError(f"compare labels must differ; got {', '.join(labels)}")
    out = Path(out)
    summaries = [load_study(f) for _, f in studies]
    if not across_commits:
        check_commits(labels, summaries)
    rows = compare_rows([(lab, f, summary) for (lab, f), summary in zip(studies, summaries)])
    markdown = compare_markdown(rows, command)
    commits = ", ".join(f"{lab} at {', '.join(study_commits(s))}" for lab, s in zip(labels, summaries))
    markdown += f"\nCommits: {commits}" + (" (paired across commits, as asked)" if across_commits else "") + ".\n"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"command": command, "studies": [[lab, str(f)] for lab, f in studies], "across_commits": across_commits}
    atomic_write_json(out / COMPARE_FILE, spec)
    atomic_write_text(out / "compare.md", markdown)
    atomic_write_text(out / "compare.csv", compare_csv(rows))
    written = [out / COMPARE_FILE, out / "compare.md", out / "compare.csv"]
    for name, fig in (
        ("gap_vs_steps.png", gap_figure(rows)),
        ("val_curves.png", curves_figure(list(zip(labels, summaries)))),
    ):
        if fig is not None:
            written.append(save(fig, out / name))
    print_fn(markdown)
    print_fn(f"compare: {', '.join(p.name for p in written)} in {out}")
    return rows


def is_comparison(folder: str | Path) -> bool:
    return (Path(folder) / COMPARE_FILE).exists()


def rebuild(folder: str | Path, print_fn: Callable = print) -> list[dict]:
    """Rewrite a comparison folder from its ``compare.json`` (what ``geomtrain report`` does)."""
    spec = read_json(Path(folder) / COMPARE_FILE)
    if not spec or "studies" not in spec:
        raise StudyError(f"{folder}/{COMPARE_FILE} is not a comparison record")
    studies = [tuple(s) for s in spec["studies"]]
    return compare(folder, studies, spec.get("command", ""), print_fn, spec.get("across_commits", False))
