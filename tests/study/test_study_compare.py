"""`geomtrain study compare`: several study folders side by side, rebuilt by `geomtrain report`."""

import json
import math
import shutil
from pathlib import Path

import pytest

from geomtrain.cli import main as cli_main
from geomtrain.study.compare import compare, cumulative_muon_step, length_trend, paper_cumulative_step

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def test_compare_reads_the_gaps_and_the_ordering_off_the_summaries(tmp_path):
    rows = compare(tmp_path / "cmp", [("tangent", RESULTS / "main")], "test", print_fn=lambda *a: None)
    table = {r["variant"]: r for r in json.loads((RESULTS / "main" / "summary.json").read_text())["table"]}
    ref = table["unconstrained"]["final_val_mean"]
    for r in rows:
        assert r["final_val_mean"] == table[r["variant"]]["final_val_mean"]
        assert r["val_gap"] == pytest.approx(table[r["variant"]]["final_val_mean"] - ref)
    md = (tmp_path / "cmp" / "compare.md").read_text()
    best_first = sorted(table.values(), key=lambda r: r["final_val_mean"])
    assert "- tangent: " + " < ".join(f"`{r['variant']}`" for r in best_first) in md
    runs = json.loads((RESULTS / "main" / "summary.json").read_text())["runs"]
    seed0 = {r["variant"]: r["final_val"] for r in runs if r["seed"] == 0}
    assert rows[0]["final_by_seed"]["0"] == seed0[rows[0]["variant"]]
    # 500 steps, 50 warmup, cosine to min_lr / lr = 0.1 of muon_lr 0.02: the documented 5.47
    assert rows[0]["cumulative_step"] == pytest.approx(5.47, abs=0.01)
    assert not (tmp_path / "cmp" / "gap_vs_steps.png").exists()  # one length: no figure
    assert not (tmp_path / "cmp" / "val_curves.png").exists()  # one study: nothing to overlay


@pytest.mark.slow
def test_studies_of_different_lengths_get_the_gap_figure_and_report_rebuilds_them(tmp_path):
    longer = tmp_path / "longer"
    shutil.copytree(RESULTS / "main", longer)
    summary = json.loads((longer / "summary.json").read_text())
    summary["study"]["base_config"]["max_iters"] = 1000
    (longer / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "cmp"
    assert cli_main(["study", "compare", "--out", str(out), f"short={RESULTS / 'main'}", f"long={longer}"]) == 0
    for name in ("gap_vs_steps.png", "val_curves.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "compare.md").read_text()
    assert "| `hetero` | long − short | +0.0000 ± 0.0000 | 0/3 |" in md  # the same runs, paired by seed
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix != ".png"}
    for p in out.iterdir():
        if p.name != "compare.json":
            p.unlink()
    assert cli_main(["report", str(out)]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.suffix != ".png"} == before
    assert (out / "gap_vs_steps.png").exists()
    assert "val gap slope per decade" in md  # the same gaps at both lengths: a flat trend
    assert "| `hetero` | 2 | +0.0000 |" in md


def _row(variant, steps, cumulative, val_gap, train_gap=None):
    return {
        "variant": variant,
        "max_iters": steps,
        "cumulative_step": cumulative,
        "val_gap": val_gap,
        "train_gap": train_gap,
    }


def test_length_trend_fits_the_gap_in_log_cumulative_step():
    # gap = 0.05 - 0.02 log10(sum eta): slope -0.02 per decade, zero at sum eta = 10**2.5
    lengths = [(500, 5.0), (2000, 20.0), (8000, 80.0)]
    rows = [_row("unconstrained", n, c, 0.0, 0.0) for n, c in lengths]
    rows += [_row("hetero", n, c, 0.05 - 0.02 * math.log10(c), 0.03) for n, c in lengths]
    rows += [_row("all-dgram", n, c, g) for (n, c), g in zip(lengths, (0.01, -0.01, -0.02))]
    trend = {t["variant"]: t for t in length_trend(rows)}
    assert set(trend) == {"hetero", "all-dgram"}
    h = trend["hetero"]
    assert h["points"] == 3 and h["val_slope_per_decade"] == pytest.approx(-0.02)
    assert h["val_gap_at_paper"] == pytest.approx(0.05 - 0.02 * math.log10(paper_cumulative_step()))
    assert h["train_slope_per_decade"] == pytest.approx(0.0) and h["train_gap_at_paper"] == pytest.approx(0.03)
    assert h["zero_crossing_cumulative_step"] == pytest.approx(10**2.5)
    assert h["zero_crossing_steps"] == pytest.approx(10**2.5 * 8000 / 80.0)  # the longest run's schedule
    assert h["sign_flips_between_steps"] == []
    d = trend["all-dgram"]
    assert d["sign_flips_between_steps"] == [(500, 2000)]
    assert d["zero_crossing_cumulative_step"] is None  # already below zero and falling: no crossing ahead
    assert d["train_gap_at_paper"] is None
    assert length_trend([r for r in rows if r["max_iters"] == 500]) == []  # one length: no trend


def test_paper_cumulative_step_is_the_published_schedule():
    # 1,000 warmup steps (mean 0.5), then a cosine from 1 to 0.1 over 49,000 (mean 0.55), times 0.02
    assert paper_cumulative_step() == pytest.approx(0.02 * (1000 * 0.5 + 49000 * 0.55), rel=1e-3)


def test_cumulative_step_follows_the_schedule():
    base = {"max_iters": 100, "warmup_iters": 10, "lr": 1e-3, "min_lr": 1e-3, "muon_lr": 0.05}
    assert cumulative_muon_step(base) == pytest.approx(0.05 * (sum((t + 1) / 10 for t in range(10)) + 90))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["study", "compare", "--out", "x", "nolabel"], "LABEL=FOLDER"),
        (["study", "compare", "--out", "x", "a=/nonexistent"], "no summary.json"),
    ],
)
def test_bad_compare_input_is_one_line_exit_2(argv, message, capsys, tmp_path):
    argv = [a if a != "x" else str(tmp_path / "x") for a in argv]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_duplicate_labels_are_refused(tmp_path, capsys):
    main = str(RESULTS / "main")
    assert cli_main(["study", "compare", "--out", str(tmp_path / "c"), f"a={main}", f"a={main}"]) == 2
    assert "labels must differ" in capsys.readouterr().err


def _copy_at_commit(src: Path, dst: Path, commit: str) -> Path:
    shutil.copytree(src, dst)
    summary = json.loads((dst / "summary.json").read_text())
    for inv in summary["study"].get("invocations", []):
        inv.setdefault("environment", {})["git"] = {"commit": commit, "dirty": False}
    summary["study"]["environment"] = {"git": {"commit": commit, "dirty": False}}
    (dst / "summary.json").write_text(json.dumps(summary))
    return dst


def test_compare_refuses_to_pair_across_commits_unless_told(tmp_path, capsys):
    a = _copy_at_commit(RESULTS / "main", tmp_path / "a", "a" * 40)
    b = _copy_at_commit(RESULTS / "main", tmp_path / "b", "b" * 40)
    args = ["study", "compare", "--out", str(tmp_path / "cmp"), f"one={a}", f"two={b}"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "different commits (one at aaaaaaa; two at bbbbbbb)" in err and "--across-commits" in err
    assert not (tmp_path / "cmp").exists()
    assert cli_main([*args[:4], "--across-commits", *args[4:]]) == 0
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "Commits: one at aaaaaaa, two at bbbbbbb (paired across commits, as asked)." in md
    assert "| 95% interval | verdict |" in md and "| level |" in md  # a study against itself: all zero, level
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["across_commits"] is True
    assert cli_main(["report", str(tmp_path / "cmp")]) == 0  # the rebuild keeps the permission


def test_compare_applies_the_rule_to_a_seed_that_diverged_in_one_study(tmp_path):
    """The report's rule across folders: a seed lost to divergence on one side decides, it is not dropped."""
    other = tmp_path / "other"
    shutil.copytree(RESULTS / "main", other)
    summary = json.loads((other / "summary.json").read_text())
    for r in summary["runs"]:
        if r["variant"] == "hetero" and r["seed"] == 0:
            r["status"], r["final_val"] = "diverged", None
        if r["variant"] == "all-stiefel" and r["seed"] == 1:
            r["status"], r["final_val"] = "interrupted", None
    (other / "summary.json").write_text(json.dumps(summary))
    compare(tmp_path / "cmp", [("one", RESULTS / "main"), ("two", other)], "test", print_fn=lambda *a: None)
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| `hetero` | two − one | +0.0000 ± 0.0000 (1 diverged in this study only) | 0/2 |" in md
    assert md.split("| `hetero` | two − one |")[1].split("\n")[0].endswith("| worse |")
    row = md.split("| `all-stiefel` | two − one |")[1].split("\n")[0]
    assert "(1 unfinished)" in row and row.endswith("| level |")  # the two finished seeds, identical
