"""Does training need the exact direction? An evaluation budget for the default solver, in training.

Trains `mini` at the settings of the `length-500` suite (context 64, `classics+austen`, 500 steps)
with Manifold Muon's default `gram_newton` solver capped at ``max_iter=K`` polar evaluations per
matrix and step (warm-started from the previous step's multiplier; an unconverged direction is
polished: projected onto the tangent space and scaled to unit spectral norm, so it stays feasible
and carries an honest, larger, certified gap), beside the exact solve, the one-shot `tangent`
approximation and `unconstrained` Muon. One run at a time, one thread; rerunning skips finished
runs and resumes stopped ones. Then writes the table beside this script (results.md, arms.json, runs/):

    python lab/2026-12-03-solver-budget/solver_budget.py run [--arms NAME ...]   # train what is missing
    python lab/2026-12-03-solver-budget/solver_budget.py report                    # the table only

Each arm is one ``geomtrain train`` command (printed before it runs); its folder records the
config, the environment and the seed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from geomtrain.study.collect import read_run

ROOT = Path(__file__).resolve().parents[2]  # the repository root
RUNS = ROOT / "runs" / "solver-budget"
OUT = Path(__file__).resolve().parent  # this record
DATA = "data/classics+austen-bpe4k"
# The length-500 suite's settings (lab/2026-12-01-study-suites/study_suites.sh): its unconstrained run is
# reproduced to the digit.
COMMON = ["--model", "mini", "--data-dir", DATA, "--block-size", "64", "--max-iters", "500"]
COMMON += ["--warmup-iters", "50", "--checkpoint-interval", "50", "--no-progress"]
ARMS = {  # name: (seed, flags)
    "unconstrained": (0, ["--preset", "unconstrained"]),
    "dgram-tangent": (0, ["--preset", "all-dgram", "--muon-solver", "tangent"]),
    "dgram-k2": (0, ["--preset", "all-dgram", "--muon-solver-options", "max_iter=2"]),
    "dgram-k4": (0, ["--preset", "all-dgram", "--muon-solver-options", "max_iter=4"]),
    "dgram-k8": (0, ["--preset", "all-dgram", "--muon-solver-options", "max_iter=8"]),
    "dgram-exact": (0, ["--preset", "all-dgram"]),
    "unconstrained-s1": (1, ["--preset", "unconstrained"]),
    "dgram-tangent-s1": (1, ["--preset", "all-dgram", "--muon-solver", "tangent"]),
    "dgram-k2-s1": (1, ["--preset", "all-dgram", "--muon-solver-options", "max_iter=2"]),
    "dgram-exact-s1": (1, ["--preset", "all-dgram"]),
    "hetero-tangent": (0, ["--preset", "hetero", "--muon-solver", "tangent"]),
    "hetero-k2": (0, ["--preset", "hetero", "--muon-solver-options", "max_iter=2"]),
    "hetero-exact": (0, ["--preset", "hetero"]),
}
KEPT = ("config.json", "env.json", "assignment.txt", "metrics.jsonl", "status.json")  # what the report keeps


def command(name: str) -> list[str]:
    seed, flags = ARMS[name]
    return ["geomtrain", "train", *COMMON, "--seed", str(seed), *flags, "--out-dir", str(RUNS / name)]


def train(names: list[str]) -> None:
    prepare = ["geomtrain", "prepare", "--dataset", "classics+austen", "--tokenizer", "bpe4k"]
    subprocess.run(prepare, check=True, cwd=ROOT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in names:
        status = RUNS / name / "status.json"
        if status.exists() and json.loads(status.read_text()).get("status") == "finished":
            continue
        cmd = command(name) + (["--resume"] if (RUNS / name / "ckpt.pt").exists() else [])
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)


def summarise(name: str) -> dict | None:
    """Final validation loss, median step time, and the solver's per-step record after warmup."""
    folder = RUNS / name if (RUNS / name).is_dir() else OUT / "runs" / name
    if not (folder / "status.json").exists():
        return None
    run = read_run(folder)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    muon = [m["muon"] for m in records if m.get("kind") == "train" and m["step"] > 50 and m.get("muon")]
    gaps = [m["dual_gap_max"] for m in muon if m.get("dual_gap_max") is not None]
    calls = [m["msign_calls"] for m in muon if m.get("msign_calls") is not None]
    return {
        "arm": name,
        "seed": ARMS[name][0],
        "command": " ".join(command(name)),
        "status": run["status"],
        "final_val": run["final_val"],
        "ms_per_step": run["ms_per_step"],
        "evals_per_step": round(statistics.mean(calls), 1) if calls else None,
        "gap_max_median": statistics.median(gaps) if gaps else None,
        "gap_max_worst": max(gaps) if gaps else None,
        "polished_steps": sum(1 for m in muon if (m.get("n_unconverged") or 0) > 0),
        "logged_steps": len(muon),
    }


def report() -> None:
    rows = [r for r in map(summarise, ARMS) if r is not None]
    base = {r["seed"]: r["ms_per_step"] for r in rows if r["arm"].startswith("unconstrained")}
    lines = [
        "# Solver budget in training (`solver_budget.py`)",
        "",
        "`mini`, context 64, `classics+austen-bpe4k`, 500 steps; one run at a time, one thread, beside "
        "another single-threaded job on the 2-core CPU (ratios are to `unconstrained` run the same way). "
        "Certified gap: the largest over the 16 matrices of a logged step (every 10th, after step 50); "
        "median and worst over the run. Commands: `arms.json`.",
        "",
        "| arm | seed | final val loss | ms/step | x unconstrained | evaluations/step "
        "| certified gap, median / worst | polished steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["ms_per_step"] / base[r["seed"]] if base.get(r["seed"]) else None
        gap = f"{r['gap_max_median']:.1e} / {r['gap_max_worst']:.1e}" if r["gap_max_median"] is not None else "-"
        lines.append(
            f"| {r['arm']} | {r['seed']} | {r['final_val']:.4f} | {r['ms_per_step']:.0f} | "
            + (f"{ratio:.2f}" if ratio else "-")
            + f" | {r['evals_per_step'] if r['evals_per_step'] is not None else '-'} | {gap} | "
            + f"{r['polished_steps']}/{r['logged_steps']} |"
        )
    OUT.mkdir(parents=True, exist_ok=True)
    for r in rows:  # the small files of every run, so the table can be checked without the checkpoints
        if (RUNS / r["arm"]).is_dir():
            dest = OUT / "runs" / r["arm"]
            dest.mkdir(parents=True, exist_ok=True)
            for f in KEPT:
                if (RUNS / r["arm"] / f).exists():
                    shutil.copyfile(RUNS / r["arm"] / f, dest / f)
    (OUT / "arms.json").write_text(json.dumps(rows, indent=1) + "\n")
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["run", "report"])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), metavar="NAME")
    args = p.parse_args(argv)
    if args.action == "run":
        train(args.arms)
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
