"""Every bad input of issue 11's table: one line on stderr (``geomtrain CMD: error: ...``, naming
the file, key or valid choices), exit code 2, nothing written or changed; or, where that is what
a user expects, it works (README rules train; a resume before the first checkpoint starts clean;
a torn last log line is cut with a warning; an allowed config change is recorded)."""

import json
import sys

import pytest
import torch
from fault_helpers import (
    CHECKPOINT_EVERY,
    MAX_ITERS,
    assert_log_whole,
    assert_one_line_error,
    assert_same_run,
    cli,
    records,
    run_args,
    snapshot,
)

pytest_plugins = ["fault_helpers"]


def _short(data_dir, out, *extra):
    """A 2-step run (for inputs that should work at all)."""
    return run_args(data_dir, out, "--max-iters", "2", "--eval-interval", "2", "--no-diagnostics", *extra)


# ----------------------------------------------------------------------------- manifold rules
def test_readme_rules_command_trains_with_vectors_left_to_adamw(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code, out, err = cli(_short(data_dir, run, "--rule", "*.attn.*=stiefel", "--rule", "*.mlp.*=euclidean"), capsys)
    assert code == 0, err[-3000:]
    table = {a["name"]: a for a in json.loads((run / "assignment.json").read_text())}
    assert table["transformer.h.0.attn.c_attn.weight"]["manifold"] == "stiefel"
    assert table["transformer.h.1.mlp.c_fc.weight"]["manifold"] == "euclidean"  # not hetero's DGram MLP
    biases = [a for name, a in table.items() if ".attn." in name and name.endswith(".bias")]
    assert biases and all(a["optimizer"] == "adamw" for a in biases)
    assert "transformer.h.0.attn.c_attn.bias" in out  # the printed table shows it


def test_rule_that_matches_nothing_is_one_line(data_dir, tmp_path, capsys):
    code, _, err = cli(_short(data_dir, tmp_path / "run", "--rule", "*.nothing.*=stiefel"), capsys)
    assert_one_line_error(code, err, "*.nothing.*")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- config values
@pytest.mark.parametrize("text", ['max_iters = "five"', "max_iters = 5.7"])
def test_toml_with_a_wrongly_typed_value_is_one_line(text, data_dir, tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(text + "\n")
    code, _, err = cli(_strip_max_iters(_short(data_dir, tmp_path / "run")) + ["--config", path], capsys)
    assert_one_line_error(code, err, "max_iters", "int")
    assert not (tmp_path / "run").exists()


def test_invalid_toml_is_one_line_naming_the_file(data_dir, tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text("max_iters 5\n")
    code, _, err = cli(_short(data_dir, tmp_path / "run") + ["--config", path], capsys)
    assert_one_line_error(code, err, str(path), "line 1")


def _strip_max_iters(argv):
    while "--max-iters" in argv:
        i = argv.index("--max-iters")
        argv = argv[:i] + argv[i + 2 :]
    return argv


@pytest.mark.parametrize(
    "device, needles",
    [
        pytest.param(
            "cuda",
            ("cuda", "not available", "cpu"),
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here"),
        ),
        ("gpu", ("'gpu'", "auto, cpu, cuda")),
        ("cuda:99", ("cuda:99",)),
    ],
)
def test_unusable_device_is_one_line(device, needles, data_dir, tmp_path, capsys):
    code, _, err = cli(_short(data_dir, tmp_path / "run", "--device", device), capsys)
    assert_one_line_error(code, err, *needles)


def test_bad_out_dir_placeholder_is_one_line(data_dir, tmp_path, capsys):
    argv = _short(data_dir, tmp_path / "run")
    argv[argv.index("--out-dir") + 1] = str(tmp_path / "{modle}-{seed}")
    code, _, err = cli(argv, capsys)
    assert_one_line_error(code, err, "{modle}", "{model}, {preset}, {seed}")


def test_bad_flag_value_is_one_line(data_dir, tmp_path, capsys):
    code, _, err = cli(_short(data_dir, tmp_path / "run", "--lr", "fast"), capsys)
    assert_one_line_error(code, err, "--lr", "'fast'")


@pytest.mark.parametrize(
    "flag, value, needles",
    [  # each names the one key that is wrong and its value (before: one message for all three keys)
        ("--lr", "-1", ["lr must be a finite number > 0; got -1.0"]),
        ("--lr", "0", ["lr must be a finite number > 0; got 0.0"]),
        ("--warmup-iters", "-1", ["warmup_iters must be >= 0; got -1"]),
        ("--muon-lr", "-1", ["muon_lr must be a finite number >= 0; got -1.0"]),
    ],
)
def test_out_of_range_learning_rate_or_warmup_is_one_line_naming_the_key(
    flag, value, needles, data_dir, tmp_path, capsys
):
    code, _, err = cli(_short(data_dir, tmp_path / "run", flag, value), capsys)
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "entry, needles",
    [
        ("max_iters=x", ["max_iters=x", "tol", "max_iter"]),
        ("compute_dtype=f8", ["f8", "float32", "float64"]),
        ("tol=0", ["tol=0", "> 0"]),
        ("anderson=-1", ["anderson=-1", ">= 0"]),
    ],
)
def test_bad_solver_option_is_one_line_naming_the_valid_ones(entry, needles, data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = cli(_short(data_dir, run, "--muon-solver", "exact", "--muon-solver-options", entry), capsys)
    assert_one_line_error(code, err, *needles)
    assert not run.exists()


def test_solver_options_without_a_solver_are_one_line_naming_the_default(data_dir, tmp_path, capsys):
    # the default solver is per mask, so options alone belong to no one solver
    code, _, err = cli(_short(data_dir, tmp_path / "run", "--muon-solver-options", "tol=1e-5"), capsys)
    assert_one_line_error(code, err, "need a solver", "filled_split on Stiefel", "muon_solver=exact")
    assert not (tmp_path / "run").exists()


def test_unknown_preset_is_one_line_with_the_choices(data_dir, tmp_path, capsys):
    from geomtrain.assign import PRESETS

    code, _, err = cli(_short(data_dir, tmp_path / "run", "--preset", "hetero2"), capsys)
    assert_one_line_error(code, err, "hetero2", *PRESETS)


def test_sample_top_k_zero_is_one_line(tmp_path, capsys):
    code, _, err = cli(["sample", tmp_path, "--top-k", "0"], capsys)
    assert_one_line_error(code, err, "--top-k", "'0'")


def test_prepare_openwebtext_without_datasets_names_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    code, _, err = cli(["prepare", "--dataset", "openwebtext", "--out", tmp_path / "owt"], capsys)
    assert_one_line_error(code, err, "datasets", "pip install")
    assert not (tmp_path / "owt").exists()


# ----------------------------------------------------------------------------- run folders
@pytest.mark.slow
def test_rerun_into_a_run_folder_is_refused_and_changes_nothing(data_dir, stopped_run, capsys):
    before = snapshot(stopped_run)
    code, _, err = cli(run_args(data_dir, stopped_run), capsys)
    assert_one_line_error(code, err, str(stopped_run), "already holds a run", "--resume", "--overwrite")
    assert snapshot(stopped_run) == before


@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
def test_a_run_folder_in_use_by_a_live_process_is_refused(flag, data_dir, stopped_run, capsys):
    import socket
    import subprocess

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        status = json.loads((stopped_run / "status.json").read_text())
        status.update(status="running", pid=other.pid, host=socket.gethostname())
        (stopped_run / "status.json").write_text(json.dumps(status))
        before = snapshot(stopped_run)
        code, _, err = cli(run_args(data_dir, stopped_run, flag), capsys)
    finally:
        other.kill()
        other.wait()
    assert_one_line_error(code, err, str(stopped_run), "in use", f"pid {other.pid}")
    assert snapshot(stopped_run) == before


def test_resume_and_overwrite_together_are_refused(data_dir, stopped_run, capsys):
    before = snapshot(stopped_run)
    code, _, err = cli(run_args(data_dir, stopped_run, "--resume", "--overwrite"), capsys)
    assert_one_line_error(code, err, "--resume", "--overwrite")
    assert snapshot(stopped_run) == before


@pytest.mark.slow
def test_overwrite_starts_over_without_duplicates(data_dir, reference, stopped_run, capsys):
    code, _, err = cli(run_args(data_dir, stopped_run, "--overwrite"), capsys)
    assert code == 0, err[-3000:]
    assert_same_run(stopped_run, reference)


@pytest.mark.slow
def test_resume_before_the_first_checkpoint_starts_clean(data_dir, reference, tmp_path, monkeypatch, capsys):
    from geomtrain.checkpoint import Checkpoint

    run = tmp_path / "run"

    def no_checkpoint(self, state):
        raise KeyboardInterrupt  # the run dies at its first checkpoint, before writing it

    monkeypatch.setattr(Checkpoint, "save", no_checkpoint)
    code, _, err = cli(run_args(data_dir, run), capsys)
    assert (code, err.splitlines()[-1]) == (130, "geomtrain train: interrupted")  # one line, no traceback
    monkeypatch.undo()
    assert len(records(run, "train")) == CHECKPOINT_EVERY and not (run / "ckpt.pt").exists()
    code, out, err = cli(run_args(data_dir, run, "--resume"), capsys)
    assert code == 0, err[-3000:]
    assert "no checkpoint" in out and "starting from step 0" in out
    assert_same_run(run, reference)  # steps 1..12 once each: the first attempt's lines are gone


@pytest.mark.parametrize(
    "flag, value, key",
    [
        ("--model", "mini", "model"),
        ("--block-size", "8", "block_size"),
        ("--seed", "4", "seed"),
        ("--lr", "0.001", "lr"),
        ("--data-dir", None, "data_dir"),  # another vocabulary / data folder
    ],
)
def test_resume_with_a_changed_run_defining_key_is_refused(flag, value, key, data_dir, stopped_run, tmp_path, capsys):
    if value is None:  # the same files under another name: still another data_dir
        (tmp_path / "other-data").symlink_to(data_dir, target_is_directory=True)
        value = str(tmp_path / "other-data")
    before = snapshot(stopped_run)
    code, _, err = cli(run_args(data_dir, stopped_run, "--resume", flag, value), capsys)
    assert_one_line_error(code, err, f"{key}:", "--allow-config-change")
    assert snapshot(stopped_run) == before


@pytest.mark.slow
def test_allowed_config_change_is_recorded_never_overwritten(data_dir, stopped_run, capsys):
    old = json.loads((stopped_run / "config.json").read_text())
    code, out, err = cli(
        run_args(data_dir, stopped_run, "--resume", "--lr", "0.001", "--seed", "4", "--allow-config-change"), capsys
    )
    assert code == 0, err[-3000:]
    assert f"from step {CHECKPOINT_EVERY}" in out
    history = [json.loads(line) for line in (stopped_run / "config_history.jsonl").read_text().splitlines()]
    assert len(history) == 1 and history[0]["step"] == CHECKPOINT_EVERY
    assert history[0]["changes"] == {"lr": {"old": old["lr"], "new": 0.001}, "seed": {"old": old["seed"], "new": 4}}
    new = json.loads((stopped_run / "config.json").read_text())
    assert new["lr"] == 0.001 and new["seed"] == 4
    assert_log_whole(stopped_run)


def test_allowed_change_of_the_model_is_still_one_line_and_not_recorded(data_dir, stopped_run, capsys):
    before = snapshot(stopped_run)
    argv = run_args(data_dir, stopped_run, "--resume", "--block-size", "8", "--allow-config-change")
    code, _, err = cli(argv, capsys)
    assert_one_line_error(code, err, "block_size")
    assert snapshot(stopped_run) == before  # no config_history.jsonl for a change that never happened


# ----------------------------------------------------------------------------- torn logs
@pytest.mark.slow
def test_torn_last_metrics_line_then_resume(data_dir, reference, stopped_run, capsys):
    with open(stopped_run / "metrics.jsonl", "a") as fh:
        fh.write('{"kind": "train", "step": 5, "lo')  # the process died in the middle of a line
    with pytest.warns(RuntimeWarning, match="torn last line"):
        code, out, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    assert code == 0, err[-3000:]
    assert f"from step {CHECKPOINT_EVERY}" in out
    assert_same_run(stopped_run, reference)  # no torn line, no duplicate


def test_bad_line_inside_metrics_is_one_line_naming_file_and_line(data_dir, stopped_run, capsys):
    lines = (stopped_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = "{not json\n"
    (stopped_run / "metrics.jsonl").write_text("".join(lines))
    before = snapshot(stopped_run)
    code, _, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    assert_one_line_error(code, err, str(stopped_run / "metrics.jsonl"), "line 2")
    assert snapshot(stopped_run) == before


@pytest.mark.slow
def test_finished_run_resumed_again_adds_nothing(data_dir, reference, stopped_run, capsys):
    assert cli(run_args(data_dir, stopped_run, "--resume"), capsys)[0] == 0
    before = records(stopped_run, "train")
    code, out, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    assert code == 0 and f"from step {MAX_ITERS}" in out, err[-3000:]
    assert records(stopped_run, "train") == before
    assert_same_run(stopped_run, reference)


def test_ctrl_c_in_a_command_without_its_own_handling_is_one_line_exit_130(monkeypatch, capsys):
    import geomtrain.bench.training as training

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "measure_training_speed", interrupted)
    code, _, err = cli(["bench", "train", "--model", "tiny", "--steps", "1"], capsys)
    assert (code, err) == (130, "geomtrain bench train: interrupted\n")


# ----------------------------------------------------------------------------- names and data folders (issue 40)
def test_misspelt_flag_is_one_line_under_its_command_with_the_closest_flag(capsys):
    code, _, err = cli(["train", "--max-itres", "3"], capsys)
    line = assert_one_line_error(code, err, "--max-itres (did you mean '--max-iters'?)")
    assert line.startswith("geomtrain train: error: unrecognized arguments:")  # before: `geomtrain: error:`


def test_unknown_set_key_names_the_closest_key(data_dir, tmp_path, capsys):
    argv = ["study", "--model", "tiny", "--data-dir", data_dir, "--out", tmp_path / "x", "--dry-run"]
    code, _, err = cli([*argv, "--set", "max_iter=3"], capsys)
    assert_one_line_error(code, err, "unknown config key 'max_iter' (did you mean 'max_iters'?)")


def test_misspelt_manifold_names_the_closest_and_how_to_bring_your_own(data_dir, tmp_path, capsys):
    code, _, err = cli(_short(data_dir, tmp_path / "run", "--rule", "*.attn.*=stifel"), capsys)
    assert_one_line_error(code, err, "unknown manifold 'stifel' (did you mean 'stiefel'?)", "--manifolds MODULE")
    assert not (tmp_path / "run").exists()


def _data_with_short_split(data_dir, tmp_path, split, n_tokens):
    """A copy of the prepared folder whose ``split`` holds only its first ``n_tokens`` tokens, the manifest
    saying so (it verifies: the file is what the manifest says)."""
    import hashlib
    import shutil
    from pathlib import Path

    import numpy as np

    from geomtrain.data import TOKEN_DTYPE

    out = tmp_path / "data"
    out.mkdir()
    for name in ("train.bin", "val.bin", "manifest.json"):
        shutil.copy(Path(data_dir) / name, out / name)
    raw = (out / f"{split}.bin").read_bytes()[: n_tokens * np.dtype(TOKEN_DTYPE).itemsize]
    (out / f"{split}.bin").write_bytes(raw)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["splits"][split].update(tokens=n_tokens, sha256=hashlib.sha256(raw).hexdigest())
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize("split", ["train", "val"])
def test_empty_token_file_is_one_line_naming_it(split, data_dir, tmp_path, capsys):
    data = _data_with_short_split(data_dir, tmp_path, split, 0)
    code, _, err = cli(_short(data, tmp_path / "run"), capsys)
    assert_one_line_error(code, err, str(data / f"{split}.bin"), "empty (0 tokens)")  # before: cannot mmap ...
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("split", ["train", "val"])
def test_split_shorter_than_a_batch_row_is_refused_before_a_run_folder_is_made(split, data_dir, tmp_path, capsys):
    data = _data_with_short_split(data_dir, tmp_path, split, 16)  # _short's block_size 16 needs 17 tokens
    code, _, err = cli(_short(data, tmp_path / "run"), capsys)
    assert_one_line_error(code, err, str(data / f"{split}.bin"), "holds 16 tokens", "block_size 16")
    assert not (tmp_path / "run").exists()  # before (train): a run folder with status `failed`


def test_split_of_exactly_one_batch_row_trains(data_dir, tmp_path, capsys):
    data = _data_with_short_split(data_dir, tmp_path, "train", 17)
    code, _, err = cli(_short(data, tmp_path / "run"), capsys)
    assert code == 0, err[-3000:]


@pytest.mark.parametrize(
    "typo, needles",
    [
        ("data/clasics", ["data folder data/clasics does not exist (did you mean 'data/classics'?)"]),
        (
            "data/nope",
            ["data folder data/nope does not exist", "prepared folders: data/classics", "`geomtrain prepare`"],
        ),
    ],
)
def test_data_dir_that_does_not_exist_points_to_the_prepared_folders(
    typo, needles, data_dir, tmp_path, monkeypatch, capsys
):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "classics").symlink_to(data_dir, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(_short(typo, tmp_path / "run"), capsys)
    line = assert_one_line_error(code, err, *needles)
    assert f"--out {typo}" not in line  # before: `geomtrain prepare --out data/nope --force`, preparing into the typo
    assert not (tmp_path / "run").exists()
