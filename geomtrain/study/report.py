"""The report of a study: ``summary.json``, ``results.csv``, ``results.md`` and the figures.

:func:`report` rebuilds it from the runs (or, when they are gone, from ``summary.json`` alone);
:func:`format_table` and :func:`format_attention_table` are the Markdown tables it holds.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path

from .._io import atomic_write_json, atomic_write_text, read_json
from .collect import collect, comparisons, load_summary, make_table, resolve_runs_dir
from .plan import StudyError

__all__ = [
    "CSV_COLUMNS",
    "format_table",
    "format_attention_table",
    "format_solver_table",
    "format_comparisons",
    "format_tuning",
    "tuning_section",
    "results_csv",
    "results_markdown",
    "write_report",
    "report",
]

CSV_COLUMNS = (
    "variant",
    "label",
    "attention",
    "mlp",
    "seeds",
    "finished",
    "diverged",
    "diverged_steps",
    "final_val_mean",
    "final_val_std",
    "best_val_mean",
    "best_val_std",
    "ms_per_step",
    "vs_adamw",
    "vs_unconstrained",
    "status",
    "end_sigma_qk",
    "end_max_logit",
    "end_min_entropy",
    "end_saturated",
    "skipped_updates",
)


def _pm(mean, std) -> str:
    if mean is None:
        return "-"
    return f"{mean:.4f} ± {std:.4f}" if std is not None else f"{mean:.4f}"


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def format_table(rows: list[dict]) -> str:
    """The results table (one row per variant of :func:`geomtrain.study.make_table`) as Markdown."""
    head = [
        "assignment",
        "attention",
        "MLP",
        "final val loss",
        "best val loss",
        "status",
        "ms/step",
        "vs AdamW",
        "vs Muon",
    ]
    return _markdown(
        head,
        [
            [
                r["label"],
                r.get("attention") or "-",
                r.get("mlp") or "-",
                _pm(r["final_val_mean"], r["final_val_std"]),
                _pm(r["best_val_mean"], r["best_val_std"]),
                r["status"],
                f"{r['ms_per_step']:.0f}" if r.get("ms_per_step") else "-",
                f"{r['vs_adamw']:.2f}x" if r.get("vs_adamw") else "-",
                f"{r['vs_unconstrained']:.2f}x" if r.get("vs_unconstrained") else "-",
            ]
            for r in rows
        ],
    )


def format_attention_table(rows: list[dict]) -> str:
    """Attention at the last evaluation (mean over seeds) as Markdown."""
    head = [
        "assignment",
        "attention",
        "max σ(W_Q), σ(W_K)",
        "max \\|logit\\|",
        "min mean entropy (nats)",
        "max saturated rows",
    ]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    return _markdown(
        head,
        [
            [
                r["label"],
                r.get("attention") or "-",
                f(r.get("end_sigma_qk"), ".3g"),
                f(r.get("end_max_logit"), ".3g"),
                f(r.get("end_min_entropy"), ".3f"),
                f(r.get("end_saturated"), ".3f"),
            ]
            for r in rows
        ],
    )


def format_solver_table(rows: list[dict]) -> str:
    """The direction solver over the logged steps (the ``solver_*`` keys of the table rows) as Markdown."""

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    head = [
        "assignment",
        "evaluations per step",
        "first / last tenth",
        "largest residual",
        "largest dual gap",
        "steps with a polished direction",
    ]
    body = [
        [
            r["label"],
            f(r.get("solver_evals_per_step"), ".1f"),
            f"{f(r.get('solver_evals_first_tenth'), '.1f')} / {f(r.get('solver_evals_last_tenth'), '.1f')}",
            f(r.get("solver_residual_max"), ".2e"),
            f(r.get("solver_dual_gap_max"), ".2e"),
            f"{r.get('solver_unconverged_steps', 0)} of {r.get('solver_logged_steps', 0)}",
        ]
        for r in rows
        if r.get("solver_evals_per_step") is not None
    ]
    return _markdown(head, body)


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _across_commits(commits: list[str]) -> str:
    return f" (across commits {', '.join(commits)})" if len(commits) > 1 else ""


def _commits_line(runs: list[dict]) -> str | None:
    """Which arms each commit trained, when a study's runs come from more than one commit (else ``None``)."""
    by_commit: dict[str, list[str]] = {}
    for r in runs:
        if r.get("commit"):
            arms = by_commit.setdefault(r["commit"], [])
            if r["variant"] not in arms:
                arms.append(r["variant"])
    if len(by_commit) < 2:
        return None
    return (
        "Runs trained at more than one commit (paired rows across them are marked): "
        + "; ".join(f"{c}: {', '.join(arms)}" for c, arms in sorted(by_commit.items()))
        + "."
    )


def _seed_difference(p: dict) -> str:
    if p.get("unfinished"):
        return "unfinished"
    return "div." if p["diff"] is None else f"{p['diff']:+.4f}"


def format_comparisons(rows: list[dict]) -> str:
    """Paired comparisons (`geomtrain.study.stats.compare_arms` rows) as Markdown."""
    head = ["arm", "reference", "seeds", "differences per seed", "mean", "95% interval", "verdict", "steps to target"]
    body = []
    for c in rows:
        diffs = ", ".join(_seed_difference(p) for p in c["per_seed"])
        interval = "-" if c["low"] is None else f"[{c['low']:+.4f}, {c['high']:+.4f}]"
        steps = _num(c.get("steps_to_target"), ".0f")
        if c.get("seconds_to_target") is not None:
            steps += f" ({c['seconds_to_target']:.0f} s)"
        body.append(
            [
                c["arm"],
                c["reference"],
                str(len(c["seeds"])),
                diffs or "-",
                _num(c.get("mean"), "+.4f"),
                interval,
                c["verdict"] + _across_commits(c.get("commits") or []),
                f"{steps}, {c['reached_target']} reached",
            ]
        )
    return _markdown(head, body)


def format_tuning(tuning: dict) -> str:
    """Each arm's selection: its grid with the score at every value, the choice and where it lay."""
    head = ["arm", "key", "grid: mean final val loss on the selection seeds", "chosen", "where"]
    body = []
    for arm, record in (tuning.get("arms") or {}).items():
        for t in record.get("stages", [record]):  # several keys: one row each, in search order
            scores = ", ".join(
                f"{v}: {'div.' if s is not None and s == float('inf') else _num(s, '.4f')}"
                for v, s in t["scores"].items()
            )
            fixed = ", ".join(f"{k}={v:g}" for k, v in (t.get("fixed") or {}).items())
            chosen = "-" if t.get("best") is None else f"{t['best']:g}"
            where = t.get("where") or "-"
            if t.get("extended"):
                where += f" (grid grown by {t['extended']})"
            key = t["key"] + (f", pass {t['pass']}" if t.get("pass") else "") + (f" (at {fixed})" if fixed else "")
            body.append([arm, key, scores, chosen, where])
    for arm in tuning.get("untuned") or []:
        body.append([arm, "-", "untuned (no grid applies)", "-", "-"])
    return _markdown(head, body)


def tuning_section(tuning: dict) -> list[str]:
    """The tuning paragraph of ``results.md``: the protocol in words, then `format_tuning`."""
    p = tuning.get("protocol", {})
    several = any("stages" in t for t in (tuning.get("arms") or {}).values())
    order = "An arm with several keys searches them in turn, the keys before at their chosen values" + (
        f"; then again, each about its choice with the others at theirs, until no key moves (at most "
        f"{p['max_passes']} passes). "
        if p.get("max_passes", 1) > 1
        else ". "
    )
    searched = [st for t in (tuning.get("arms") or {}).values() for st in t.get("stages") or [t]]
    tunes_lr = any(st.get("key") == "lr" for st in searched)
    floor = f"A tuned lr {'moves min_lr with it' if p.get('scale_min_lr') else 'keeps the study min_lr'}. "
    return [
        f"Tuning (selection runs, not in the table above): seeds {', '.join(map(str, p.get('select_seeds', [])))} "
        f"at {p.get('fraction')} of the horizon; a best value at a grid end grows the grid (at most "
        f"{p.get('max_extend')} points). {order if several else ''}{floor if tunes_lr else ''}Each arm is then "
        "confirmed at its chosen value on the seeds above.",
        "",
        format_tuning(tuning),
        "",
    ]


def results_csv(rows: list[dict]) -> str:
    """The table as CSV (:data:`CSV_COLUMNS`; lists space-separated, ``None`` empty)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        w.writerow(
            [
                "" if r.get(c) is None else (" ".join(map(str, r[c])) if isinstance(r.get(c), list) else r[c])
                for c in CSV_COLUMNS
            ]
        )
    return buf.getvalue()


def results_markdown(summary: dict) -> str:
    """``results.md``: the command, seeds, shared config, how to read the table, both tables."""
    st = summary.get("study", {})
    skipped = ", ".join(f"{r['variant']} {r['skipped_updates']}" for r in summary["table"] if r.get("skipped_updates"))
    md = [
        f"# Study results: suite `{st.get('suite')}`",
        "",
        f"Command: `{st.get('command')}`",
        "",
        f"Seeds: {', '.join(map(str, st.get('seeds', [])))}. Shared config: "
        + ", ".join(f"{k}={v}" for k, v in sorted(st.get("base_config", {}).items()))
        + ".",
        "",
        "Final val loss: mean ± sample std over the seeds whose run finished (diverged runs left out); "
        "best val loss: over all runs (for a diverged run, its best before the divergence). "
        "ms/step: median step time of each run, mean over seeds; ratios to `adamw` / `unconstrained`. "
        "Matrix updates ManifoldMuon skipped as non-finite (all seeds): " + (skipped or "none") + ".",
        "",
        format_table(summary["table"]),
        "",
        "Attention at the last evaluation (mean over seeds; per run the worst layer):",
        "",
        format_attention_table(summary["table"]),
        "",
    ]
    if st.get("tuning"):
        md += tuning_section(st["tuning"])
    if summary.get("comparisons"):
        from .stats import VERDICT_RULE

        delta = summary["comparisons"][0]["delta"]
        md += [
            f"Paired comparisons (delta = {delta:g}): {VERDICT_RULE} Steps to target: the steps the arm "
            "takes to reach the reference's final val loss on the same seed (mean over seeds that reach it; "
            "time at the arm's median step time).",
            "",
            format_comparisons(summary["comparisons"]),
            "",
        ]
        md += [line, ""] if (line := _commits_line(summary["runs"])) else []
    if any(r.get("solver_evals_per_step") is not None for r in summary["table"]):
        md += [
            "Direction solver over the logged steps (all seeds): polar evaluations per step summed over "
            "the matrices (mean; plain Muon: one per matrix), the largest RMS tangent residual and "
            "certified dual gap of any direction, and the steps where a direction missed `tol` and "
            "was polished:",
            "",
            format_solver_table(summary["table"]),
            "",
        ]
    return "\n".join(md)


def write_report(summary: dict, out: str | Path) -> list[Path]:
    """``summary.json``, ``results.csv``, ``results.md`` and the figures into ``out``."""
    from . import figures

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "summary.json", summary, compact=True)
    atomic_write_text(out / "results.csv", results_csv(summary["table"]))
    atomic_write_text(out / "results.md", results_markdown(summary))
    return [out / "summary.json", out / "results.csv", out / "results.md", *figures.write_all(summary, out)]


def report(out: str | Path, runs_dir: str | Path | None = None, print_fn: Callable = print) -> dict:
    """Rebuild the report of a study folder from its runs, or from ``summary.json`` without them."""
    out = Path(out)
    if not out.is_dir():
        raise StudyError(f"{out} is not a folder")
    study = read_json(out / "study.json")
    if study is None and not (out / "summary.json").exists():
        raise StudyError(f"{out} is not a study folder (no study.json or summary.json)")
    rdir = Path(runs_dir) if runs_dir else (resolve_runs_dir(out, study) if study else None)
    if rdir is not None and rdir.is_dir():
        summary = collect(out, rdir)
    else:
        summary = load_summary(out)
        summary["table"] = make_table(summary["variants"], summary["runs"])
        options = summary["study"].get("options") or {}
        summary["comparisons"] = comparisons(summary["variants"], summary["runs"], options)
        print_fn(f"runs folder not found: rebuilt from {out / 'summary.json'}")
    written = write_report(summary, out)
    print_fn(format_table(summary["table"]))
    print_fn(f"report: {', '.join(p.name for p in written)} in {out}")
    return summary
