"""geomtrain.study.collect: a study folder read into a summary and its table."""

import json
import math

import pytest

from geomtrain.study import StudyError
from geomtrain.study.collect import collect, load_summary, make_table, read_run, round_sig, study_and_runs


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_collect_reads_every_run_of_the_study(tiny_study_folder):
    summary = collect(tiny_study_folder)
    assert [v["name"] for v in summary["variants"]] == ["adamw", "hetero"]
    assert [(r["variant"], r["seed"], r["status"]) for r in summary["runs"]] == [
        ("adamw", 0, "finished"),
        ("hetero", 0, "finished"),
    ]
    for r in summary["runs"]:
        logged = metrics(tiny_study_folder / "runs" / r["variant"] / "s0")
        evals = [m for m in logged if m["kind"] == "eval"]
        assert r["eval"] == {"step": [3, 6], "val": [round_sig(m["val_loss"]) for m in evals]}
        assert r["final_val"] == r["eval"]["val"][-1]
        assert r["train"]["step"] == [1, 2, 3, 4, 5, 6]
        env = json.loads((tiny_study_folder / "runs" / r["variant"] / "s0" / "env.json").read_text())
        assert r["commit"] == (((env.get("git") or {}).get("commit") or "")[:7] or None)  # the code that trained it
    hetero = summary["runs"][1]
    assert (hetero["attn"], hetero["mlp"]) == ("stiefel", "dgram")
    assert len(hetero["diag"]["sigma_max"]["attn_q"]) == 2  # one per evaluation
    assert summary == json.loads((tiny_study_folder / "summary.json").read_text())  # what the report wrote


def test_the_table_has_one_row_per_variant_with_its_timing_ratio(tiny_study_folder):
    summary = collect(tiny_study_folder)
    rows = {row["variant"]: row for row in summary["table"]}
    assert rows["adamw"]["vs_adamw"] == 1.0 and rows["adamw"]["status"] == "stable 1/1"
    ratio = rows["hetero"]["ms_per_step"] / rows["adamw"]["ms_per_step"]
    assert rows["hetero"]["vs_adamw"] == pytest.approx(ratio, rel=1e-3)  # both rounded to 4-5 digits
    assert rows["hetero"]["final_val_mean"] == summary["runs"][1]["final_val"]


def fake_run(variant, status, final=None, best=None, ms=100.0, diverged=None):
    return {
        "variant": variant,
        "status": status,
        "final_val": final,
        "best_val": best,
        "ms_per_step": ms,
        "diverged_step": diverged,
        "attn": "stiefel",
        "mlp": "dgram",
        "diag": {},
    }


def test_make_table_means_and_sample_std_over_seeds_and_counts_divergences():
    variants = [{"name": "adamw"}, {"name": "hetero"}]
    runs = [
        fake_run("adamw", "finished", 2.0, 2.0, ms=100.0),
        fake_run("adamw", "finished", 4.0, 3.0, ms=100.0),
        fake_run("hetero", "finished", 3.0, 3.0, ms=250.0),
        fake_run("hetero", "diverged", None, 5.0, ms=350.0, diverged=7),
    ]
    adamw, hetero = make_table(variants, runs)
    assert (adamw["final_val_mean"], adamw["final_val_std"]) == (3.0, round_sig(math.sqrt(2)))  # ddof = 1
    assert adamw["status"] == "stable 2/2" and adamw["seeds"] == 2
    assert hetero["status"] == "diverged 1/2 (step 7)" and hetero["diverged_steps"] == [7]
    assert hetero["final_val_mean"] == 3.0 and hetero["final_val_std"] is None  # one finished seed
    assert hetero["vs_adamw"] == 3.0  # mean 300 ms against 100 ms


def test_round_sig_keeps_significant_digits_and_drops_non_finite():
    assert round_sig(1.23456789) == 1.2346 and round_sig(123456.7, 3) == 123000.0
    assert round_sig([0.000123456, [float("nan"), math.inf]]) == [0.00012346, [None, None]]
    assert round_sig(None) is None and round_sig(7) == 7


def test_a_missing_run_folder_reads_as_missing(tmp_path):
    run = read_run(tmp_path / "never-ran")
    assert run["status"] == "missing" and run["eval"] == {"step": [], "val": []}


def test_folders_that_are_not_studies_are_refused_naming_them(tmp_path, tiny_study_folder):
    with pytest.raises(StudyError, match=rf"{tmp_path} holds no study.json"):
        study_and_runs(tmp_path)
    with pytest.raises(StudyError, match="pass --runs-dir"):
        study_and_runs(tiny_study_folder, runs_dir=tmp_path / "elsewhere")
    with pytest.raises(StudyError, match=r"summary.json not found or not JSON"):
        load_summary(tmp_path)
    (tmp_path / "summary.json").write_text('{"table": []}')
    with pytest.raises(StudyError, match="is not a study summary"):
        load_summary(tmp_path)
    assert load_summary(tiny_study_folder)["variants"][0]["name"] == "adamw"
