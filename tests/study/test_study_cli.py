"""geomtrain.study.cli: bad input is one line and exit 2; the parsers register on any
``geomtrain`` command registry and dispatch the sub-modes."""

import argparse

import pytest

from geomtrain.cli import main as cli_main
from geomtrain.study import add_report_parser, add_study_parser


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--presets", "adamw,nope"], "unknown preset 'nope'; valid: adamw, unconstrained"),
        (["--suite", "everything"], "unknown suite 'everything'; valid: presets, lr-sweep, bounded, autoassign"),
        (["--model", "huge"], "unknown model 'huge'; valid:"),
        (["--set", "colour=red"], "unknown config key 'colour'; valid: model,"),
        (["--set", "muon_lr=fast"], "bad value 'fast' for muon_lr"),
        (["--seeds", "0"], "--seeds '0'"),
        (["--granularity", "atom"], "unknown granularity 'atom'; valid: module, kind, layer"),
        (["--jobs", "0"], "--jobs must be >= 1; got 0"),
        (["--suite", "bounded", "--bounds", "0"], "--bounds must be numbers > 0"),
        (["--tokenizer", "morse"], "argument --tokenizer: invalid choice: 'morse'"),
        (["--reference", "nope"], "--reference 'nope' pairs no arm of this study; valid: one of adamw, unconstrained"),
        (["--presets", "hetero,all-stiefel", "--reference", "+exact"], "--reference '+exact' pairs no arm"),
        (
            ["--presets", "hetero", "--tune", "all-dgram:muon_lr=0.01,0.02,0.04"],
            "--tune all-dgram:...: all-dgram is not an arm of this study; its presets: hetero",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(data_dir, tmp_path, capsys, argv, needle):
    code = cli_main(
        ["study", "--model", "tiny", "--data-dir", data_dir, "--out", str(tmp_path / "x"), "--dry-run", *argv]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_parsers_register_and_dispatch_the_modes():
    root = argparse.ArgumentParser(prog="geomtrain")
    sub = root.add_subparsers(dest="command", required=True)
    add_study_parser(sub)
    add_report_parser(sub)
    study = root.parse_args(["study", "--model", "tiny", "--out", "o", "--set", "lr=1e-3", "--dry-run"])
    overhead = root.parse_args(["study", "overhead", "--out", "o", "--solvers", "tangent", "--steps", "2"])
    toy = root.parse_args(["study", "toy", "--out", "o"])
    rep = root.parse_args(["report", "o"])
    assert [a.handler.__name__ for a in (study, overhead, toy, rep)] == [
        "run_study_command",
        "run_overhead_command",
        "run_toy_command",
        "run_report_command",
    ]
    assert overhead.solvers == "tangent" and overhead.steps == 2 and rep.out == ["o"]
    from geomtrain.study.cli import command_argv

    # the command line study.json records: every non-default option, in the parser's order
    assert command_argv(study) == ["--model", "tiny", "--out", "o", "--set", "lr=1e-3", "--dry-run"]
    assert command_argv(overhead) == ["--solvers", "tangent", "--steps", "2", "--out", "o"]


def test_a_tuned_study_records_its_protocol_flags_at_any_value():
    """A tuned study's recorded command names the selection protocol even at its defaults, so it
    replays (and resumes) unchanged after a default moves (``--tune-fraction`` went 0.5 -> 1)."""
    from geomtrain.study.cli import TUNE_PROTOCOL, command_argv

    root = argparse.ArgumentParser(prog="geomtrain")
    add_study_parser(root.add_subparsers(dest="command", required=True))
    tuned = root.parse_args(["study", "--out", "o", "--tune", "muon_lr=0.01,0.02,0.04"])
    argv = command_argv(tuned, always=TUNE_PROTOCOL)
    assert argv == ["--tune", "muon_lr=0.01,0.02,0.04", "--select-seeds", "1", "--tune-fraction", "1.0"] + [
        "--tune-max-extend",
        "2",
        "--tune-passes",
        "3",
        "--out",
        "o",
    ]
    assert root.parse_args(["study", *argv]).tune_fraction == tuned.tune_fraction
    plain = root.parse_args(["study", "--out", "o"])  # without --tune the protocol flags stay out
    assert command_argv(plain) == ["--out", "o"]


def test_study_without_out_is_an_error(capsys):
    assert cli_main(["study", "--model", "tiny", "--dry-run"]) == 2
    assert "required: --out" in capsys.readouterr().err
