"""Collecting a study: every run folder read into one compact *summary*, and the results table.

A summary (what :func:`collect` returns and ``summary.json`` holds) is
``{"format", "study", "variants", "runs", "table"}``: ``study`` is ``study.json`` without its
variants; each run has its status, losses, ms/step, eval curve, a thinned training-loss curve and
the per-evaluation diagnostics as per-layer lists; ``table`` has one row per variant
(:func:`make_table`). Figures and tables are rebuilt from a summary alone.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np

from .._io import read_json, read_jsonl
from .plan import SUMMARY_FORMAT, StudyError, references_of

__all__ = [
    "MATRIX_KINDS",
    "round_sig",
    "read_run",
    "make_table",
    "collect",
    "load_summary",
    "resolve_runs_dir",
    "study_and_runs",
    "comparisons",
]

MATRIX_KINDS = ("attn_in", "attn_q", "attn_k", "attn_out", "mlp_in", "mlp_out")
ATTENTION_STATS = ("max_abs_logit", "mean_entropy", "saturated_frac", "jacobian_norm")
_KEPT_KINDS = {"sigma_max": ("attn_q", "attn_k", "attn_out", "mlp_in", "mlp_out"), "grad_norm": ("attn_q", "attn_k")}


def round_sig(x, digits: int = 5):
    """``x`` (a number or nested lists of numbers) to ``digits`` significant digits; non-finite to ``None``."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return [round_sig(v, digits) for v in x]
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        return float(f"{x:.{digits}g}")
    return x


def _manifold_of(assignment: list[dict], suffix: str) -> str | None:
    for a in assignment or []:
        if a["name"].endswith(suffix):
            return a.get("manifold") or a.get("optimizer")
    return None


def _n_layer(diag_records: list[dict]) -> int:
    n = 0
    for d in diag_records:
        for m in d.get("matrices", []):
            if m.get("layer") is not None:
                n = max(n, m["layer"] + 1)
        n = max(n, len(d.get("attention", [])))
    return n


def _diag_series(diag_records: list[dict]) -> dict:
    """Per evaluation: sigma_max and gradient norm per matrix kind and layer, and the attention
    statistics per layer, to 4 significant digits; only the kinds the figures use."""
    n_layer = _n_layer(diag_records)
    diag = {
        "step": [],
        "sigma_max": {k: [] for k in MATRIX_KINDS},
        "grad_norm": {k: [] for k in MATRIX_KINDS},
        "attention": {k: [] for k in ATTENTION_STATS},
    }
    for d in diag_records:
        diag["step"].append(d["step"])
        per = {k: {f: [None] * n_layer for f in ("sigma_max", "grad_norm")} for k in MATRIX_KINDS}
        for m in d.get("matrices", []):
            k, layer = m.get("kind"), m.get("layer")
            if k in per and layer is not None:
                for f in ("sigma_max", "grad_norm"):
                    per[k][f][layer] = m.get(f)
        for k in MATRIX_KINDS:
            for f in ("sigma_max", "grad_norm"):
                diag[f][k].append(round_sig(per[k][f], 4))
        att = sorted(d.get("attention", []), key=lambda a: a.get("layer", 0))
        for f in diag["attention"]:
            diag["attention"][f].append(round_sig([a.get(f) for a in att], 4))
    for f in ("sigma_max", "grad_norm"):  # what the figures and tables use (keeps summary.json small)
        diag[f] = {
            k: v
            for k, v in diag[f].items()
            if k in _KEPT_KINDS[f] and any(any(x is not None for x in row) for row in v)
        }
    return diag


def _solver_record(muon: list[dict]) -> dict | None:
    """The direction solver over a run's logged steps: Manifold Muon's polar evaluations per step
    (``msign_calls``, all matrices; plain Muon counts one per matrix), the largest RMS tangent
    residual and certified dual gap, the steps where some direction did not converge to ``tol`` (it
    was polished instead) and, per matrix, on how many logged steps that one was (``unconverged``
    names, logged since they exist). ``None`` for a run without Muon statistics."""
    calls = [m["msign_calls"] for m in muon if m.get("msign_calls") is not None]
    if not calls:
        return None

    def worst(key):
        vals = [m[key] for m in muon if m.get(key) is not None]
        return round_sig(max(vals), 3) if vals else None

    return {
        "logged_steps": len(calls),
        "evals_per_step": round_sig(float(np.mean(calls)), 4),
        "evals_first_tenth": round_sig(float(np.mean(calls[: max(1, len(calls) // 10)])), 4),
        "evals_last_tenth": round_sig(float(np.mean(calls[-max(1, len(calls) // 10) :])), 4),
        "residual_max": worst("residual_max"),
        "dual_gap_max": worst("dual_gap_max"),
        "unconverged_steps": sum(1 for m in muon if (m.get("n_unconverged") or 0) > 0),
        "unconverged_matrices": dict(Counter(name for m in muon for name in m.get("unconverged") or [])),
    }


def read_run(run_dir: Path, max_train_points: int = 100) -> dict:
    """Everything the report needs from one run folder, compact (losses to 5 significant digits,
    diagnostics to 4)."""
    status = read_json(run_dir / "status.json", {}) or {}
    assignment = read_json(run_dir / "assignment.json", [])
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = [m for m in metrics if m.get("kind") == "eval"]
    trains = [m for m in metrics if m.get("kind") == "train"]
    stride = max(1, math.ceil(len(trains) / max_train_points))
    ms = [m["ms_per_step"] for m in trains if m.get("ms_per_step") is not None]
    st = status.get("status", "missing")
    muon = [m["muon"] for m in trains if isinstance(m.get("muon"), dict)]
    diverged_step = {"diverged": status.get("diverged_step"), "failed": status.get("failed_step")}.get(st)
    commit = ((read_json(run_dir / "env.json", {}) or {}).get("git") or {}).get("commit")
    return {
        "status": st,
        "commit": commit[:7] if commit else None,  # the code that trained it (paired runs should share it)
        "step": status.get("step"),
        "diverged_step": diverged_step,
        "reason": status.get("reason"),
        "final_val": round_sig(status.get("final_val_loss")) if st == "finished" else None,
        "best_val": round_sig(status.get("best_val_loss")),
        "last_val": round_sig(status.get("last_val_loss")),
        "ms_per_step": round_sig(float(np.median(ms)) if ms else status.get("ms_per_step")),
        "skipped_updates": max((m.get("n_skipped_nonfinite_total") or 0 for m in muon), default=None),
        "attn": _manifold_of(assignment, "attn.c_attn.weight"),
        "mlp": _manifold_of(assignment, "mlp.c_fc.weight"),
        "eval": {"step": [m["step"] for m in evals], "val": round_sig([m.get("val_loss") for m in evals])},
        "train": {
            "step": [m["step"] for m in trains[::stride]],
            "loss": round_sig([m.get("loss") for m in trains[::stride]]),
        },
        "diag": _diag_series(read_jsonl(run_dir / "diagnostics.jsonl")),
        "solver": _solver_record(muon),
    }


def resolve_runs_dir(out: Path, study: dict) -> Path | None:
    """The runs folder of a study: as given on its command line (relative to the current folder),
    as an absolute path, or ``OUT/runs``; ``None`` when none exists."""
    candidates = []
    if study.get("runs_dir"):
        candidates.append(Path(study["runs_dir"]))
    if study.get("runs_dir_abs"):
        candidates.append(Path(study["runs_dir_abs"]))
    candidates.append(out / "runs")
    for c in candidates:
        if c.is_dir():
            return c
    return None


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None, None
    return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else None)


def _status_text(rs: list[dict], fin: list[dict], div: list[dict]) -> str:
    if not rs:
        return "not run"
    if div:
        steps = ", ".join(str(r.get("diverged_step")) for r in div)
        text = f"diverged {len(div)}/{len(rs)} (step {steps})"
        return text + (" [failed: exception]" if any(r["status"] == "failed" for r in div) else "")
    if len(fin) == len(rs):
        return f"stable {len(fin)}/{len(rs)}"
    return f"incomplete ({len(fin)}/{len(rs)} finished)"


def _row(v: dict, rs: list[dict]) -> dict:
    fin = [r for r in rs if r["status"] == "finished"]
    div = [r for r in rs if r["status"] in ("diverged", "failed")]
    final_mean, final_std = _mean_std([r["final_val"] for r in fin])
    best_mean, best_std = _mean_std([r["best_val"] for r in rs])
    ms = [r["ms_per_step"] for r in rs if r.get("ms_per_step") is not None]
    skipped = [r.get("skipped_updates") for r in rs]
    return {
        "variant": v["name"],
        "label": v.get("label") or v["name"],
        "attention": next((r["attn"] for r in rs if r.get("attn")), None),
        "mlp": next((r["mlp"] for r in rs if r.get("mlp")), None),
        "seeds": len(rs),
        "finished": len(fin),
        "diverged": len(div),
        "diverged_steps": [r.get("diverged_step") for r in div],
        "final_val_mean": round_sig(final_mean),
        "final_val_std": round_sig(final_std),
        "best_val_mean": round_sig(best_mean),
        "best_val_std": round_sig(best_std),
        "ms_per_step": round_sig(float(np.mean(ms)) if ms else None),
        "status": _status_text(rs, fin, div),
        "sweep": v.get("sweep"),
        "skipped_updates": sum(s or 0 for s in skipped) if any(s is not None for s in skipped) else None,
        **_end_of_training(rs),
        **_solver_row(rs),
    }


def _solver_row(runs: list[dict]) -> dict:
    """`_solver_record` over the seeds: evaluations per step as the mean, the rest the worst;
    empty for summaries written before runs carried it (so their report stays as it was)."""
    recs = [r["solver"] for r in runs if r.get("solver")]
    if not recs:
        return {}

    def worst(key):
        vals = [x[key] for x in recs if x.get(key) is not None]
        return max(vals) if vals else None

    return {
        "solver_evals_per_step": round_sig(float(np.mean([x["evals_per_step"] for x in recs])), 4),
        "solver_evals_first_tenth": round_sig(float(np.mean([x["evals_first_tenth"] for x in recs])), 4),
        "solver_evals_last_tenth": round_sig(float(np.mean([x["evals_last_tenth"] for x in recs])), 4),
        "solver_residual_max": worst("residual_max"),
        "solver_dual_gap_max": worst("dual_gap_max"),
        "solver_unconverged_steps": sum(x["unconverged_steps"] for x in recs),
        "solver_logged_steps": sum(x["logged_steps"] for x in recs),
    }


def make_table(variants: list[dict], runs: list[dict]) -> list[dict]:
    """One row per variant: final and best val loss (mean, std over seeds), stable / diverged
    (with steps), ms per step and its ratio to the ``adamw`` and ``unconstrained`` rows (at the
    same sweep value, when swept) when present, and the attention state at the last evaluation."""
    rows = [_row(v, [r for r in runs if r["variant"] == v["name"]]) for v in variants]
    by = {r["variant"]: r for r in rows}
    for r, v in zip(rows, variants):
        for ref, col in (("adamw", "vs_adamw"), ("unconstrained", "vs_unconstrained")):
            ref_name = ref
            base = v.get("base") or ""
            if v.get("sweep") and base and v["name"].startswith(base):
                ref_name = ref + v["name"][len(base) :]  # the reference at the same value
            other = by.get(ref_name) or by.get(ref)
            ok = other and other.get("ms_per_step") and r.get("ms_per_step")
            r[col] = round_sig(r["ms_per_step"] / other["ms_per_step"], 4) if ok else None
    return rows


def _last_row(rows: list) -> list:
    return [x for x in (rows[-1] if rows else []) if x is not None]


def _end_of_training(runs: list[dict]) -> dict:
    """Attention-side state at each run's last evaluation, mean over runs: the largest
    sigma_max of W_Q / W_K, max |logit|, smallest mean row entropy, largest saturated fraction."""
    cols = {"end_sigma_qk": [], "end_max_logit": [], "end_min_entropy": [], "end_saturated": []}
    for r in runs:
        d = r.get("diag") or {}
        sig, att = d.get("sigma_max", {}), d.get("attention", {})
        qk = _last_row(sig.get("attn_q", [])) + _last_row(sig.get("attn_k", []))
        if qk:
            cols["end_sigma_qk"].append(max(qk))
        for key, col, fn in (
            ("max_abs_logit", "end_max_logit", max),
            ("mean_entropy", "end_min_entropy", min),
            ("saturated_frac", "end_saturated", max),
        ):
            vals = _last_row(att.get(key, []))
            if vals:
                cols[col].append(fn(vals))
    return {k: round_sig(float(np.mean(v))) if v else None for k, v in cols.items()}


def study_and_runs(out: str | Path, runs_dir: str | Path | None = None) -> tuple[dict, Path]:
    """``OUT/study.json`` and the study's runs folder (``runs_dir``, else `resolve_runs_dir`);
    ``StudyError`` when either is missing."""
    out = Path(out)
    study = read_json(out / "study.json")
    if study is None:
        raise StudyError(f"{out} holds no study.json (not a study folder)")
    rdir = Path(runs_dir) if runs_dir else resolve_runs_dir(out, study)
    if rdir is None or not rdir.is_dir():
        raise StudyError(f"runs of {out} not found (looked for {study.get('runs_dir')}); pass --runs-dir")
    return study, rdir


def collect(out: str | Path, runs_dir: str | Path | None = None) -> dict:
    """Read ``OUT/study.json`` and every run folder into a summary (see the module docstring)."""
    out = Path(out)
    study, rdir = study_and_runs(out, runs_dir)
    variants = [dict(v) for v in study["variants"] if v.get("role") != "select"]
    runs = []
    for v in variants:
        for seed in v.get("seeds") or study["seeds"]:
            rd = rdir / v["name"] / f"s{seed}"
            if not (rd / "config.json").exists():
                continue
            run = {"variant": v["name"], "seed": seed, **read_run(rd)}
            run["wall_s"] = round_sig(study.get("timing", {}).get("runs", {}).get(f"{v['name']}/s{seed}"))
            runs.append(run)
        rs = [r for r in runs if r["variant"] == v["name"]]
        v["attn"] = next((r["attn"] for r in rs if r.get("attn")), None)
        v["mlp"] = next((r["mlp"] for r in rs if r.get("mlp")), None)
    study_light = {k: v for k, v in study.items() if k not in ("variants",)}
    return {
        "format": SUMMARY_FORMAT,
        "study": study_light,
        "variants": variants,
        "runs": runs,
        "table": make_table(variants, runs),
        "comparisons": comparisons(variants, runs, study.get("options") or {}),
    }


def comparisons(variants: list[dict], runs: list[dict], options: dict) -> list[dict]:
    """Each arm against its reference (``options["reference"]``, default ``unconstrained``),
    paired by seed with the verdict rule of `geomtrain.study.stats` at ``options["delta"]``."""
    from .stats import DEFAULT_DELTA, compare_arms

    names = [v["name"] for v in variants]
    delta = options.get("delta") or DEFAULT_DELTA
    pairs = references_of(names, options.get("reference") or "unconstrained")
    return [compare_arms(arm, ref, runs, delta) for arm, ref in pairs]


def load_summary(path: str | Path) -> dict:
    """A ``summary.json`` (or a study folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    data = read_json(path)
    if data is None:
        raise StudyError(f"{path} not found or not JSON (run `geomtrain report` on the study folder)")
    if not isinstance(data, dict) or not {"variants", "runs"} <= set(data):
        raise StudyError(f"{path} is not a study summary (it has no 'variants' and 'runs')")
    return data
