"""geomtrain.study.plan: suites and sweeps, the dry run, every run config validated up front."""

import pytest

from geomtrain.study import StudyError, plan, sweep_variants
from geomtrain.study import main as study_main
from geomtrain.study.plan import format_value, parse_seeds, parse_sweep, preset_variants, references_of


def test_sweep_variants_and_dry_run(data_dir, tmp_path, capsys):
    assert (
        study_main(
            [
                "--model",
                "tiny",
                "--data-dir",
                data_dir,
                "--out",
                str(tmp_path / "s"),
                "--presets",
                "hetero,hetero-inv",
                "--sweep",
                "muon_lr=0.02,0.1",
                "--dry-run",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "4 variants" in text and "hetero-inv__muon_lr-0.1" in text and not (tmp_path / "s").exists()
    assert "  hetero-inv: preset hetero-inv" in text  # the shared value keeps the plain name
    assert (
        study_main(
            [
                "--model",
                "tiny",
                "--data-dir",
                data_dir,
                "--out",
                str(tmp_path / "b"),
                "--suite",
                "bounded",
                "--bounds",
                "1.5",
                "--dry-run",
            ]
        )
        == 0
    )
    assert "bdgram@1.5" in capsys.readouterr().out


def test_sweep_keeps_the_plain_name_at_the_shared_value():
    swept = sweep_variants(preset_variants(["hetero"]), "muon_lr", [0.02, 0.1], base_value=0.02)
    assert [v.name for v in swept] == ["hetero", "hetero__muon_lr-0.1"]
    assert [v.overrides for v in swept] == [{"muon_lr": 0.02}, {"muon_lr": 0.1}] and swept[1].base == "hetero"
    assert swept[1].label == "hetero, muon_lr=0.1" and swept[1].sweep == {"key": "muon_lr", "value": 0.1}


def test_a_swept_list_names_its_folder_without_brackets():
    key, values = parse_sweep("muon_solver_options=max_iter=2,max_iter=4")
    swept = sweep_variants(preset_variants(["all-dgram"]), key, values)
    assert [v.name for v in swept] == [
        "all-dgram__muon_solver_options-max_iter=2",
        "all-dgram__muon_solver_options-max_iter=4",
    ]
    assert swept[0].overrides == {"muon_solver_options": ["max_iter=2"]}
    assert format_value(["max_iter=2", "tol=1e-05"]) == "max_iter=2,tol=1e-05"


def test_config_text_goes_through_the_one_parser():
    assert parse_sweep("muon-lr=0.02,0.1") == ("muon_lr", [0.02, 0.1])
    assert parse_sweep("batch_size=4,8") == ("batch_size", [4, 8]) and parse_sweep(None) is None
    with pytest.raises(ValueError, match="bad value 'fast' for muon_lr"):
        parse_sweep("muon_lr=fast")
    with pytest.raises(StudyError, match="must look like KEY=V1,V2"):
        parse_sweep("muon_lr")
    assert parse_seeds("3") == [0, 1, 2] and parse_seeds("0,5,7") == [0, 5, 7]
    with pytest.raises(StudyError, match="repeats a seed"):
        parse_seeds("1,1")
    with pytest.raises(StudyError, match="list of seeds >= 0"):  # the data order and init need seeds >= 0
        parse_seeds("-1,0")


def test_plan_validates_every_run_before_training(tmp_path):
    base = {"model": "tiny", "data_dir": "nowhere", "max_iters": 4}
    study = plan(tmp_path / "s", suite="bounded", bounds=[1.5], presets=["hetero"], seeds=[0, 1], base=base)
    assert [v.name for v in study.variants] == ["hetero", "bdgram1.5+stiefel", "bdgram1.5+dgram"]
    assert study.config(study.variants[1], 1).rules == [
        "*.attn.c_attn.weight=bdgram@1.5",
        "*.attn.c_proj.weight=bdgram@1.5",
    ]
    assert not (tmp_path / "s").exists()  # planning writes nothing
    with pytest.raises(StudyError, match="variant nope: unknown preset 'nope'"):
        plan(tmp_path / "s", presets=["adamw", "nope"], base=base)
    with pytest.raises(StudyError, match="^unknown model 'huge'"):
        plan(tmp_path / "s", base={**base, "model": "huge"})
    with pytest.raises(StudyError, match="does not combine with --suite autoassign"):
        plan(tmp_path / "s", suite="autoassign", sweep=("muon_lr", [0.1]), base=base)


def test_a_given_reference_must_pair_an_arm_the_default_need_not(tmp_path):
    """Every comma-separated part of ``reference`` pairs some arm, or the plan fails before any run (a study
    would otherwise train for hours and end without comparisons); without one nothing is checked."""
    base = {"model": "tiny", "data_dir": "nowhere", "max_iters": 4}
    two = dict(presets=["hetero", "all-stiefel"], base=base, solvers=["default", "exact"])
    study = plan(tmp_path / "s", options={"reference": "+exact,all-stiefel"}, **two)
    assert references_of([v.name for v in study.variants], "+exact,all-stiefel") == [
        ("hetero", "hetero+exact"),
        ("all-stiefel", "all-stiefel+exact"),
        ("hetero", "all-stiefel"),
        ("hetero+exact", "all-stiefel"),
        ("all-stiefel+exact", "all-stiefel"),
    ]
    plan(tmp_path / "s", options={}, **two)  # no unconstrained arm, no reference given: no comparisons, no error
    with pytest.raises(StudyError, match=r"^--reference '\+tangent' pairs no arm of this study; valid: one of hetero,"):
        plan(tmp_path / "s", options={"reference": "+exact,+tangent"}, **two)
