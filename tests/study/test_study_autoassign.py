"""geomtrain.study.autoassign: the policy's helpers and guard, and the probe search on a tiny model."""

import math

import pytest

from geomtrain.config import make_config
from geomtrain.study.autoassign import Policy, groups_for, matching_preset, propose, rules_for, saturation_guard


def test_autoassign_policy_helpers():
    g = groups_for("layer", 2)
    assert list(g) == ["h0.attention", "h1.attention", "h0.mlp", "h1.mlp"]
    assert rules_for({"attention": "stiefel", "mlp": "dgram"}, groups_for("module", 2)) == [
        "*.attn.c_attn.weight=stiefel",
        "*.attn.c_proj.weight=stiefel",
        "*.mlp.c_fc.weight=dgram",
        "*.mlp.c_proj.weight=dgram",
    ]
    assert matching_preset({"attention": "stiefel", "mlp": "dgram"}) == "hetero"
    assert matching_preset({"attention": "dgram", "mlp": "dgram"}) == "all-dgram"
    assert (
        matching_preset({"h0.attention": "dgram", "h1.attention": "stiefel", "h0.mlp": "dgram", "h1.mlp": "dgram"})
        is None
    )
    ref = {"mean_entropy": [2.0, 2.0], "max_abs_logit": [10.0, 10.0]}
    assert saturation_guard({"mean_entropy": [1.9, 1.6], "max_abs_logit": [12.0, 19.0]}, ref, Policy())[0]
    ok, why = saturation_guard({"mean_entropy": [1.9, 1.4], "max_abs_logit": [12.0, 12.0]}, ref, Policy())
    assert not ok and "layer 1: attention entropy" in why
    ok, why = saturation_guard({"mean_entropy": [1.9, 1.9], "max_abs_logit": [25.0, 12.0]}, ref, Policy())
    assert not ok and "layer 0: max |logit|" in why


@pytest.mark.slow
def test_autoassign_on_a_tiny_model(data_dir, tmp_path):
    base = dict(
        model="tiny",
        data_dir=data_dir,
        max_iters=8,
        warmup_iters=1,
        eval_interval=2,
        eval_iters=1,
        batch_size=4,
        block_size=32,
        diag_batch_size=2,
        log_interval=1,
    )
    result = propose(base, tmp_path / "probes", seed=0, probe_iters=3, print_fn=lambda *a: None)
    assert result["probe_iters"] == 4  # rounded up to end on an evaluation
    assert [p["name"] for p in result["probes"]] == ["all-stiefel", "attention-dgram", "mlp-dgram"]
    assert all(p["val_loss"] is None or math.isfinite(p["val_loss"]) for p in result["probes"])
    assert set(result["choice"]) == {"attention", "mlp"} and set(result["choice"].values()) <= {"stiefel", "dgram"}
    assert len(result["decisions"]) == 2 and all(d["reason"] for d in result["decisions"])
    assert result["matches_preset"] == matching_preset(result["choice"])
    make_config({**base, "preset": "adamw", "rules": result["rules"]})  # the rules are a valid config
    again = propose(base, tmp_path / "probes", seed=0, probe_iters=3, print_fn=lambda *a: None)  # probes are reused
    assert again["choice"] == result["choice"] and [p["val_loss"] for p in again["probes"]] == [
        p["val_loss"] for p in result["probes"]
    ]
