"""geomtrain.study.figures: the figures draw the summary's numbers; colours, PNGs, stale files."""

import numpy as np
import pytest

from geomtrain.study import figures
from geomtrain.study.collect import load_summary

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def summary(tiny_study_folder):
    return load_summary(tiny_study_folder)


def test_val_loss_draws_each_run_s_evaluations(summary):
    fig = figures.val_loss(summary)
    full = fig.axes[0]
    drawn = [(list(line.get_xdata()), list(line.get_ydata())) for line in full.get_lines()]
    for run in summary["runs"]:
        assert (run["eval"]["step"], run["eval"]["val"]) in drawn, run["variant"]
    assert {t.get_text() for t in full.get_legend().get_texts()} == {"adamw", "hetero"}


@pytest.mark.slow
def test_write_all_writes_what_applies_and_removes_a_stale_figure(summary, tmp_path):
    (tmp_path / "mechanism.png").write_bytes(PNG)  # left by a report of a study with DGram attention
    written = figures.write_all(summary, tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["attention.png", "overhead.png", "sigma_max.png", "val_loss.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # mechanism: no DGram attention; sweep: none
    for p in written:
        assert p.read_bytes()[:8] == PNG


def test_compact_png_is_smaller_and_save_passes_none_through(summary, tmp_path):
    fig = figures.sigma_max(summary)
    full, compact = figures.png_bytes(fig, compact=False), figures.png_bytes(fig)
    assert full[:8] == compact[:8] == PNG and len(compact) < len(full)
    assert figures.save(None, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    assert figures.save(fig, tmp_path / "sub" / "s.png").read_bytes()[:8] == PNG


def test_colours_are_fixed_for_presets_shared_by_a_sweep_and_distinct_for_other_families():
    variants = [
        {"name": "hetero"},
        {"name": "hetero-lr1", "base": "hetero", "sweep": {"value": 1}},
        {"name": "mine"},
        {"name": "yours"},
    ]
    colours = [figures.color_of(v, variants) for v in variants]
    assert colours[0] == colours[1] == figures.PRESET_COLORS["hetero"]
    assert len({colours[0], colours[2], colours[3]}) == 3


def test_mean_curve_averages_seeds_over_the_steps_all_reached():
    seeds = [(np.array([1, 2, 3]), np.array([1.0, 2.0, 3.0])), (np.array([1, 2]), np.array([3.0, 4.0]))]
    x, y = figures.mean_curve(seeds)
    assert x.tolist() == [1, 2] and y.tolist() == [2.0, 3.0]
    x, y = figures.mean_curve([(np.array([]), np.array([]))])
    assert len(x) == len(y) == 0
