"""geomtrain.study.toy: softmax saturation in one attention layer, and `geomtrain study toy`."""

import json

import numpy as np
import pytest

from geomtrain.cli import main as cli_main
from geomtrain.study import toy_attention


def test_toy_attention_saturates(tmp_path):
    r = toy_attention(scales=(0.5, 1, 2, 4, 8, 16), n_tokens=32, d_model=32, d_head=8)
    std = np.asarray(r["logit_std"])
    assert np.allclose(std / std[0], (np.asarray(r["scale"]) / 0.5) ** 2, rtol=1e-9)  # logits scale as s^2
    assert r["mean_entropy"][-1] < 0.1 * r["mean_entropy"][0] and r["saturated_frac"][-1] > 0.8
    jac = r["jacobian_norm"]
    assert jac[-1] < 0.1 * max(jac)
    # per row: the Jacobian norm is ~2 exp(-gap) once a row is saturated
    gaps, rows = np.concatenate(r["row_gap"]), np.concatenate(r["row_jacobian"])
    sel = (gaps > 3) & (gaps < 15)
    slope = np.polyfit(gaps[sel], np.log(rows[sel]), 1)[0]
    assert sel.sum() > 10 and slope == pytest.approx(-1.0, abs=0.15)  # exponential decay in the gap
    excess = np.log(rows[sel]) - (np.log(2) - gaps[sel])  # 2 exp(-gap) with one competitor, more with several
    assert excess.min() > -0.1 and excess.max() < np.log(32)
    assert cli_main(["study", "toy", "--out", str(tmp_path), "--scales", "1,4"]) == 0
    assert (tmp_path / "toy_saturation.png").exists() and json.loads((tmp_path / "toy.json").read_text())["scale"] == [
        1.0,
        4.0,
    ]
    assert cli_main(["study", "toy", "--out", str(tmp_path), "--scales", "-1"]) == 2
