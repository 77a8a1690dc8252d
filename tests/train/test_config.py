"""Config files mean what they say (issue 40): a TOML file's top-level keys and its ``[train]`` table
both apply, and anything the file could mean two ways is one line (exit 2) naming the file."""

import json

import pytest
from fault_helpers import assert_one_line_error, cli

from geomtrain.config import make_config


def _toml(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def _train_args(data_dir, out, config):
    """A seconds-long ``train`` whose model, length and seed come from the config file only."""
    return [
        "train",
        "--config",
        config,
        "--data-dir",
        data_dir,
        "--out-dir",
        out,
        "--block-size",
        "16",
        "--batch-size",
        "2",
        "--eval-iters",
        "1",
        "--no-diagnostics",
        "--no-progress",
    ]


def test_top_level_keys_and_the_train_table_both_apply(data_dir, tmp_path, capsys):
    # before: the [train] table replaced the whole file, so this trained `mini` for 300 steps
    path = _toml(tmp_path, 'model = "tiny"\nmax_iters = 3\n[train]\nseed = 5\n')
    code, _, err = cli(_train_args(data_dir, tmp_path / "run", path), capsys)
    assert code == 0, err[-3000:]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["model"], saved["max_iters"], saved["seed"]) == ("tiny", 3, 5)
    assert json.loads((tmp_path / "run" / "status.json").read_text())["step"] == 3


def test_flags_win_over_both_parts_of_the_file(tmp_path):
    path = _toml(tmp_path, 'model = "tiny"\nmax_iters = 3\n[train]\nseed = 5\n')
    cfg = make_config({"max_iters": 4, "seed": 6}, toml_path=path)
    assert (cfg.model, cfg.max_iters, cfg.seed, cfg.batch_size) == ("tiny", 4, 6, 8)  # batch 8: tiny's default


@pytest.mark.parametrize(
    "text, needles",
    [
        ("seed = 1\n[train]\nseed = 5\n", ["sets seed both at the top level and in [train]"]),
        ("[model]\nn_layer = 2\n", ["table [model]", "[train]"]),
        ('model = "tiny"\n[optim.muon]\nlr = 0.1\n', ["table [optim]"]),
        ("[trian]\nseed = 5\n", ["table [trian]", "(did you mean 'train'?)"]),
        ("train = 5\n", ["train", "must be a table"]),
        ("max_iter = 3\n", ["unknown config key 'max_iter' (did you mean 'max_iters'?)"]),
        ("[train]\nmax_iter = 3\nlrr = 0.1\n", ["'lrr' (did you mean 'lr'?), 'max_iter' (did you mean 'max_iters'?)"]),
    ],
)
def test_a_file_that_could_mean_two_things_is_one_line_naming_it(text, needles, data_dir, tmp_path, capsys):
    path = _toml(tmp_path, text)
    code, _, err = cli(_train_args(data_dir, tmp_path / "run", path), capsys)
    assert_one_line_error(code, err, str(path), *needles)
    assert not (tmp_path / "run").exists()


def test_did_you_mean_names_only_a_close_choice():
    from geomtrain.config import did_you_mean

    assert did_you_mean("max_iter", ["max_iters", "seed"]) == " (did you mean 'max_iters'?)"
    assert did_you_mean("colour", ["max_iters", "seed"]) == ""
    assert did_you_mean("max-itres", {"max-iters": "--max-iters"}) == " (did you mean '--max-iters'?)"
