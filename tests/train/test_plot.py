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
