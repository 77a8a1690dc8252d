r"""Paired statistics of a study: each arm against a reference arm, seed by seed, with a verdict.

For an arm $A$ and its reference $R$ trained on the same seeds (same initialisation, same
batches), the paired differences of final validation loss $d_s = L_A(s) - L_R(s)$ give the mean
$\bar d$, the standard error $\mathrm{se} = \mathrm{sd}(d)/\sqrt n$ and the 95% interval
$\bar d \pm t_{0.975,\,n-1}\,\mathrm{se}$. The verdict (:data:`VERDICT_RULE`, stated in every
study record before its runs) is

- ``better`` when the interval lies below 0, ``worse`` when it lies above 0;
- ``level`` when it lies inside $[-\delta, \delta]$ (``delta``, default :data:`DEFAULT_DELTA`);
- ``unresolved`` otherwise, or with fewer than two paired seeds.

A seed on which the arm diverged and the reference finished makes the verdict ``worse``; a seed
on which only the reference diverged, ``better``; a seed on which both diverged is left out. A
seed where either run has not ended (still training, interrupted, or not started: a study part
way) is left out and counted as ``unfinished``: it is no evidence either way.

Beside final loss: the steps the arm takes to reach the reference's final loss on the same seed
(linear between evaluations) and the time that is at the arm's median step time. Each row also
names the commits that trained its paired runs: a study resumed at a newer commit can pair runs of
two code versions, and the report marks such a row *across commits*.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .plan import TERMINAL_STATUSES

__all__ = [
    "DEFAULT_DELTA",
    "VERDICT_RULE",
    "t_quantile_975",
    "paired_interval",
    "verdict",
    "steps_to_target",
    "compare_arms",
]

DEFAULT_DELTA = 0.005  # nats: "level" means the whole interval within ±0.005 of the reference
VERDICT_RULE = (
    "paired differences d = arm - reference in final val loss over the seeds both ran (a tuned study's "
    "confirmation seeds); "
    "95% interval mean ± t(0.975, n-1)·sd/√n; better: interval < 0; worse: interval > 0; "
    "level: interval within ±delta; else unresolved (also with n < 2). A seed where only the arm "
    "diverged makes it worse, only the reference, better; both diverged: the seed is left out."
)  # a seed whose pair has not ended is left out too (`compare_arms`): only a study part way has one

# Two-sided 95% quantiles t(0.975, df) of Student's t, df = 1..30 (standard tables; a test checks
# them against scipy.stats.t.ppf to 1e-3).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile_975(df: int) -> float:
    r"""$t_{0.975}$ of Student's t with ``df`` degrees of freedom: the table up to 30, then the
    Cornish-Fisher expansion $z + (z^3 + z)/(4\,df) + (5z^5 + 16z^3 + 3z)/(96\,df^2)$, $z = 1.95996$."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1; got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def paired_interval(diffs: Sequence[float]) -> dict:
    """``{"n", "mean", "se", "low", "high"}`` of paired differences (se and interval None for n < 2)."""
    n = len(diffs)
    if n == 0:
        return {"n": 0, "mean": None, "se": None, "low": None, "high": None}
    mean = sum(diffs) / n
    if n < 2:
        return {"n": 1, "mean": mean, "se": None, "low": None, "high": None}
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    se = sd / math.sqrt(n)
    half = t_quantile_975(n - 1) * se
    return {"n": n, "mean": mean, "se": se, "low": mean - half, "high": mean + half}


def verdict(
    interval: dict, delta: float = DEFAULT_DELTA, arm_only_diverged: int = 0, ref_only_diverged: int = 0
) -> str:
    """The verdict of :data:`VERDICT_RULE` for a `paired_interval` and the one-sided divergences."""
    if arm_only_diverged and not ref_only_diverged:
        return "worse"
    if ref_only_diverged and not arm_only_diverged:
        return "better"
    low, high = interval.get("low"), interval.get("high")
    if low is None or high is None or arm_only_diverged:
        return "unresolved"
    if high < 0:
        return "better"
    if low > 0:
        return "worse"
    if -delta <= low and high <= delta:
        return "level"
    return "unresolved"


def steps_to_target(steps: Sequence[int], losses: Sequence[float | None], target: float) -> float | None:
    """The first step at which the evaluation curve reaches ``target`` (linear between the two
    evaluations around the crossing); None when it never does."""
    prev = None
    for s, v in zip(steps, losses):
        if v is None or not math.isfinite(v):
            prev = None
            continue
        if v <= target:
            if prev is None or prev[1] == v:
                return float(s)
            (s0, v0) = prev
            return s0 + (s - s0) * (v0 - target) / (v0 - v)
        prev = (s, v)
    return None


def _final(run: dict) -> float | None:
    return run.get("final_val") if run.get("status") == "finished" else None


def _ended(run: dict) -> bool:
    return run.get("status") in TERMINAL_STATUSES


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def compare_arms(arm: str, reference: str, runs: Sequence[dict], delta: float = DEFAULT_DELTA) -> dict:
    """One comparison row: ``arm`` against ``reference`` over the seeds both were run on (``runs``:
    a summary's runs, each with ``variant``, ``seed``, ``status``, ``final_val``, ``eval`` and
    ``ms_per_step``)."""
    mine = {r["seed"]: r for r in runs if r["variant"] == arm}
    ref = {r["seed"]: r for r in runs if r["variant"] == reference}
    seeds = sorted(set(mine) & set(ref))
    diffs, per_seed, steps, seconds = [], [], [], []
    arm_only = ref_only = 0
    for s in seeds:
        if not (_ended(mine[s]) and _ended(ref[s])):
            per_seed.append({"seed": s, "diff": None, "unfinished": True})  # no evidence either way
            continue
        a, b = _final(mine[s]), _final(ref[s])
        if a is None and b is not None:
            arm_only += 1
        elif b is None and a is not None:
            ref_only += 1
        if a is None or b is None:
            per_seed.append({"seed": s, "diff": None})
            continue
        diffs.append(a - b)
        reach = steps_to_target(mine[s]["eval"]["step"], mine[s]["eval"]["val"], b)
        ms = mine[s].get("ms_per_step")
        per_seed.append({"seed": s, "diff": a - b, "steps_to_target": reach})
        if reach is not None:
            steps.append(reach)
            if ms:
                seconds.append(reach * ms / 1000)
    interval = paired_interval(diffs)
    commits = {r.get("commit") for s in seeds for r in (mine[s], ref[s])} - {None}
    return {
        "arm": arm,
        "reference": reference,
        "seeds": seeds,
        "per_seed": per_seed,
        **interval,
        "verdict": verdict(interval, delta, arm_only, ref_only),
        "delta": delta,
        "arm_only_diverged": arm_only,
        "reference_only_diverged": ref_only,
        "reached_target": f"{len(steps)}/{len(diffs)}",
        "steps_to_target": _mean(steps),
        "seconds_to_target": _mean(seconds),
        "commits": sorted(commits),  # of the paired runs; more than one: the pairs span code versions
    }
