"""geomtrain.study.collect / report / figures: the table and every figure from a synthetic
summary, and a committed study folder re-reported to the same bytes."""

import shutil
from pathlib import Path

import pytest

from geomtrain.study import figures, make_table, report

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _fake_run(variant, seed, status, n=6, grow=1.0):
    steps = list(range(10, 10 * n + 1, 10))
    sig = [[1.0 * grow**i, 0.9 * grow**i] for i in range(n)]
    att = {
        "max_abs_logit": [[5 * grow ** (2 * i)] * 2 for i in range(n)],
        "mean_entropy": [[2.0 / grow**i] * 2 for i in range(n)],
        "saturated_frac": [[min(1.0, 0.1 * i * (grow - 1))] * 2 for i in range(n)],
        "jacobian_norm": [[0.3 / grow ** (2 * i)] * 2 for i in range(n)],
    }
    kinds = {k: sig for k in ("attn_in", "attn_q", "attn_k", "attn_out", "mlp_in", "mlp_out")}
    return {
        "variant": variant,
        "seed": seed,
        "status": status,
        "step": steps[-1],
        "diverged_step": steps[-1] if status == "diverged" else None,
        "final_val": 4.0 + 0.01 * seed if status == "finished" else None,
        "best_val": 4.0,
        "ms_per_step": 10.0 * grow,
        "attn": "dgram" if grow > 1 else "stiefel",
        "mlp": "dgram",
        "eval": {"step": steps, "val": [5.0 - 0.1 * i if grow == 1 else 5.0 - 0.1 * i + (i > 3) * 3 for i in range(n)]},
        "train": {"step": steps, "loss": [5.0] * n},
        "diag": {"step": steps, "sigma_max": kinds, "grad_norm": kinds, "attention": att},
    }


@pytest.mark.slow
def test_figures_from_a_synthetic_summary(tmp_path):
    variants = [
        {"name": "hetero", "preset": "hetero", "base": "hetero"},
        {
            "name": "hetero-inv__muon_lr-0.1",
            "preset": "hetero-inv",
            "base": "hetero-inv",
            "sweep": {"key": "muon_lr", "value": 0.1},
            "attn": "dgram",
        },
        {
            "name": "hetero-inv__muon_lr-0.02",
            "preset": "hetero-inv",
            "base": "hetero-inv",
            "sweep": {"key": "muon_lr", "value": 0.02},
            "attn": "dgram",
        },
    ]
    runs = [_fake_run("hetero", s, "finished") for s in (0, 1)]
    runs += [_fake_run("hetero-inv__muon_lr-0.1", s, "diverged", grow=1.8) for s in (0, 1)]
    runs += [_fake_run("hetero-inv__muon_lr-0.02", 0, "finished", grow=1.1)]
    summary = {
        "study": {"base_config": {"model": "tiny", "max_iters": 60, "muon_lr": 0.02}, "seeds": [0, 1]},
        "variants": variants,
        "runs": runs,
        "table": make_table(variants, runs),
    }
    assert summary["table"][1]["status"] == "diverged 2/2 (step 60, 60)"
    written = {p.name for p in figures.write_all(summary, tmp_path)}
    assert written == {"val_loss.png", "sigma_max.png", "attention.png", "overhead.png", "mechanism.png", "sweep.png"}
    assert figures.mechanism({**summary, "variants": variants[:1]}) is None  # no DGram attention: nothing to explain


STUDIES = sorted(p.parent.name for p in RESULTS.glob("*/summary.json"))
COMPARISONS = sorted(p.parent.name for p in RESULTS.glob("*/compare.json"))


@pytest.mark.slow
@pytest.mark.parametrize("name", STUDIES)
def test_a_committed_study_re_reports_to_the_same_bytes(tmp_path, name):
    # Without its runs, `report` rebuilds the table from summary.json: the committed tables and
    # summary must come back byte for byte (the results of the docs cannot drift with the code).
    folder = tmp_path / name
    shutil.copytree(RESULTS / name, folder)
    report(folder, runs_dir=tmp_path / "no-runs-here", print_fn=lambda *a: None)
    for file in ("results.md", "results.csv", "summary.json"):
        assert (folder / file).read_bytes() == (RESULTS / name / file).read_bytes(), file


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPARISONS)
def test_a_committed_comparison_rebuilds_to_the_same_bytes(tmp_path, name, monkeypatch):
    # compare.json names its studies relative to the repository root, as the docs' commands run
    from geomtrain.study.compare import rebuild

    monkeypatch.chdir(RESULTS.parent.parent)
    folder = tmp_path / name
    shutil.copytree(RESULTS / name, folder)
    rebuild(folder, print_fn=lambda *a: None)
    for file in ("compare.md", "compare.csv", "compare.json"):
        assert (folder / file).read_bytes() == (RESULTS / name / file).read_bytes(), file


def test_the_committed_results_are_found():
    assert {"main", "main-exact", "ablation-tangent"} <= set(STUDIES) and "compare-solvers" in COMPARISONS


def test_report_on_a_json_that_is_no_study_summary_is_one_line_and_exit_2(tmp_path, capsys):
    # A results folder may hold other JSON (an experiment's own table): `report` names the problem
    # instead of failing with a TypeError deep in the table code.
    from geomtrain.cli import main as cli_main

    (tmp_path / "summary.json").write_text('[{"arm": "k2", "final_val": 5.25}]\n')
    assert cli_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a study summary" in err and len(err.splitlines()) == 1


def test_run_record_counts_the_polished_directions_per_matrix(tmp_path):
    # Manifold Muon names the matrices whose direction was polished (last_stats["unconverged"]); a run's record
    # counts, per matrix, the logged steps where that happened (steps logged before the names existed count in
    # unconverged_steps only).
    import json

    from geomtrain.study.collect import read_run

    base = {"msign_calls": 40, "residual_max": 5e-5, "dual_gap_max": 1e-3}
    rows = [
        {"kind": "train", "step": 1, "muon": {**base, "n_unconverged": 1, "unconverged": ["h.0.attn.c_proj.weight"]}},
        {"kind": "train", "step": 2, "muon": {**base, "n_unconverged": 0, "unconverged": []}},
        {
            "kind": "train",
            "step": 3,
            "muon": {
                **base,
                "n_unconverged": 2,
                "unconverged": ["h.0.attn.c_proj.weight", "h.1.attn.c_proj.weight"],
            },
        },
        {"kind": "train", "step": 4, "muon": {**base, "n_unconverged": 1}},  # an older log: a count, no names
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    solver = read_run(tmp_path)["solver"]
    assert solver["unconverged_steps"] == 3
    assert solver["unconverged_matrices"] == {"h.0.attn.c_proj.weight": 2, "h.1.attn.c_proj.weight": 1}


def test_a_comparison_across_commits_is_marked_and_the_commits_listed():
    from geomtrain.study.report import format_comparisons, results_markdown
    from geomtrain.study.stats import compare_arms

    def run(variant, seed, final, commit):
        evals = {"step": [50, 100], "val": [5.0, final]}
        return {
            "variant": variant,
            "seed": seed,
            "status": "finished",
            "final_val": final,
            "eval": evals,
            "commit": commit,
        }

    runs = [run("ref", s, 4.0, "aaaaaaa") for s in range(3)]
    runs += [run("arm", s, 3.9 + 0.01 * s, "aaaaaaa") for s in range(3)]
    runs.append(run("arm", 7, 3.0, "ccccccc"))  # unpaired
    assert "across commits" not in format_comparisons([compare_arms("arm", "ref", runs)])
    runs[4]["commit"] = "bbbbbbb"
    row = compare_arms("arm", "ref", runs)
    assert "better (across commits aaaaaaa, bbbbbbb)" in format_comparisons([row])
    summary = {"study": {}, "table": [], "runs": runs, "comparisons": [row]}
    assert "more than one commit (paired rows across them are marked): aaaaaaa: ref, arm; bbbbbbb: arm; " in (
        results_markdown(summary)
    )


def test_a_study_part_way_shows_its_unfinished_seeds_and_judges_the_rest():
    from geomtrain.study.report import format_comparisons
    from geomtrain.study.stats import compare_arms

    def run(variant, seed, final, status="finished"):
        return {
            "variant": variant,
            "seed": seed,
            "status": status,
            "final_val": final,
            "eval": {"step": [100], "val": [final]},
        }

    runs = [run("ref", 0, 4.0), run("ref", 1, 4.1), run("ref", 2, None, "interrupted")]
    runs += [run("arm", 0, 3.9), run("arm", 1, 4.0), run("arm", 2, 3.5), run("arm", 3, None, "diverged")]
    table = format_comparisons([compare_arms("arm", "ref", runs)])
    assert "| arm | ref | 3 | -0.1000, -0.1000, unfinished | -0.1000 | [-0.1000, -0.1000] | better |" in table
