"""geomtrain plot: every series is visible, a run with a single evaluation included."""

import json

import matplotlib.pyplot as plt

from geomtrain.plot import MODULE_KINDS, plot_runs


def test_a_series_of_one_point_is_drawn_with_a_marker(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in ({"kind": "train", "step": 1, "loss": 5.0}, {"kind": "eval", "step": 1, "val_loss": 5.1})
        )
    )
    diagnostics = {
        "step": 1,
        "matrices": [{"kind": kind, "sigma_max": 1.0 + i} for i, kind in enumerate(MODULE_KINDS)],
        "attention": [{"max_abs_logit": 3.0, "mean_entropy": 1.0}],
    }
    (run / "diagnostics.jsonl").write_text(json.dumps(diagnostics) + "\n")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure plot_runs draws, to look at it
    plot_runs([run], tmp_path / "runs.png")
    monkeypatch.undo()
    (figure,) = figures
    lines = [line for ax in figure.axes for line in ax.get_lines()]
    plt.close(figure)
    # train and val loss, sigma_max of each module kind, the attention logit and entropy: one point each
    assert len(lines) == 2 + len(MODULE_KINDS) + 2
    for line in lines:  # a line through one point draws nothing: each needs a marker to be seen
        assert len(line.get_xdata()) == 1 and line.get_marker() not in (None, "", " ", "None", "none"), line


def test_a_rules_run_is_labelled_by_its_rules_not_by_the_preset_it_overrides(tmp_path):
    # issue 53: the README's rules run was shown as `hetero`, the preset its rules fall back to
    from geomtrain.assign import assignment_label
    from geomtrain.plot import read_curves

    assert assignment_label("hetero") == "hetero"
    rules = ["*.attn.*=stiefel", "*.mlp.*=euclidean"]
    assert assignment_label("hetero", rules) == "*.attn.*=stiefel *.mlp.*=euclidean, rest hetero"
    names = {}
    for folder, preset, run_rules in [("rules", "hetero", rules), ("mini-all-stiefel-s1", "all-stiefel", [])]:
        run = tmp_path / folder
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 1, "val_loss": 5.0}) + "\n")
        (run / "config.json").write_text(json.dumps({"preset": preset, "rules": run_rules}))
        names[folder] = read_curves(run)["name"]
    assert names == {
        "rules": "rules (*.attn.*=stiefel *.mlp.*=euclidean, rest hetero)",
        "mini-all-stiefel-s1": "mini-all-stiefel-s1",  # the folder name already says it
    }
