"""geomtrain.study.stats: the t quantile, the paired interval, the verdict rule, steps to a target."""

import math

import pytest

from geomtrain.study.stats import compare_arms, paired_interval, steps_to_target, t_quantile_975, verdict


def test_t_quantile_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in [1, 2, 3, 5, 10, 29, 30, 31, 40, 100, 1000]:
        # the table has 3 decimals; the expansion beyond 30 is within 1e-3 of the exact quantile
        assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_975(0)


def test_paired_interval_on_constructed_data():
    iv = paired_interval([-0.003, -0.001, -0.002])  # mean -0.002, sd 0.001, se 0.001/sqrt(3)
    half = 4.303 * 0.001 / math.sqrt(3)
    assert iv["n"] == 3 and iv["mean"] == pytest.approx(-0.002)
    assert iv["low"] == pytest.approx(-0.002 - half) and iv["high"] == pytest.approx(-0.002 + half)
    assert paired_interval([0.01])["low"] is None and paired_interval([])["mean"] is None


@pytest.mark.parametrize(
    "diffs, expected",
    [
        ([-0.010, -0.011, -0.009], "better"),  # interval below 0
        ([0.010, 0.011, 0.009], "worse"),  # interval above 0
        ([-0.001, 0.001, 0.0005], "level"),  # interval inside ±0.005, containing 0
        ([-0.0022, 0.0, -0.0044], "unresolved"),  # the project's own hetero case: [-0.0077, +0.0033]
        ([-0.02, 0.02, 0.0], "unresolved"),  # wide
        ([-0.01], "unresolved"),  # one seed: no interval
    ],
)
def test_verdict_rule(diffs, expected):
    assert verdict(paired_interval(diffs), delta=0.005) == expected


def test_one_sided_divergence_decides():
    iv = paired_interval([-0.001, 0.001])
    assert verdict(iv, arm_only_diverged=1) == "worse"
    assert verdict(iv, ref_only_diverged=1) == "better"
    assert verdict(iv, arm_only_diverged=1, ref_only_diverged=1) == "unresolved"


def test_steps_to_target_interpolates_between_evaluations():
    assert steps_to_target([0, 100, 200], [5.0, 4.0, 3.0], 3.5) == pytest.approx(150.0)
    assert steps_to_target([0, 100, 200], [5.0, 4.0, 3.0], 5.0) == 0.0
    assert steps_to_target([0, 100, 200], [5.0, 4.0, 3.0], 2.0) is None
    assert steps_to_target([0, 100, 200], [5.0, None, 3.0], 3.0) == 200.0  # a gap restarts the interpolation


def _run(variant, seed, final, curve=(6.0, 5.0), status="finished"):
    return {
        "variant": variant,
        "seed": seed,
        "status": status,
        "final_val": final,
        "eval": {"step": [0, 50, 100], "val": [*curve, final]},
        "ms_per_step": 200.0,
    }


def test_compare_arms_pairs_by_seed():
    runs = [_run("ref", s, 4.0 + 0.01 * s) for s in range(3)]
    runs += [_run("arm", s, 3.99 + 0.01 * s, curve=(6.0, 4.0 + 0.01 * s)) for s in range(3)]
    runs.append(_run("arm", 7, 3.0))  # a seed the reference lacks: not paired
    row = compare_arms("arm", "ref", runs)
    assert row["seeds"] == [0, 1, 2] and row["mean"] == pytest.approx(-0.01)
    assert row["verdict"] == "better"  # the differences are equal: a zero-width interval below 0
    assert row["steps_to_target"] == pytest.approx(50.0) and row["seconds_to_target"] == pytest.approx(10.0)
    runs[3]["status"], runs[3]["final_val"] = "diverged", None  # the arm diverged on seed 0
    row = compare_arms("arm", "ref", runs)
    assert row["verdict"] == "worse" and row["arm_only_diverged"] == 1 and row["per_seed"][0]["diff"] is None


def test_compare_arms_names_the_commits_of_its_paired_runs():
    runs = [{**_run("ref", s, 4.0), "commit": "aaaaaaa"} for s in range(3)]
    runs += [{**_run("arm", s, 3.9 + 0.01 * s), "commit": "aaaaaaa"} for s in range(3)]
    runs.append({**_run("arm", 7, 3.0), "commit": "ccccccc"})  # unpaired: its commit does not count
    assert compare_arms("arm", "ref", runs)["commits"] == ["aaaaaaa"]
    runs[4]["commit"] = "bbbbbbb"  # the arm's seed 1 trained by newer code (a study resumed at another commit)
    assert compare_arms("arm", "ref", runs)["commits"] == ["aaaaaaa", "bbbbbbb"]
    assert compare_arms("arm", "ref", [{k: v for k, v in r.items() if k != "commit"} for r in runs])["commits"] == []


def test_compare_arms_leaves_out_a_seed_whose_run_has_not_ended():
    """A study part way: an interrupted or missing run is no evidence; only a divergence decides."""
    runs = [_run("ref", s, 4.0 + 0.01 * s) for s in range(3)]
    runs += [_run("arm", s, 3.99 + 0.01 * s) for s in range(3)]
    for status in ("running", "interrupted", "missing"):
        runs[0]["status"], runs[0]["final_val"] = status, None  # the reference's seed 0 not done
        row = compare_arms("arm", "ref", runs)
        assert row["verdict"] == "better" and row["reference_only_diverged"] == 0  # seeds 1, 2 still decide
        assert row["per_seed"][0] == {"seed": 0, "diff": None, "unfinished": True}
        assert row["n"] == 2
    runs[1]["status"], runs[1]["final_val"] = "interrupted", None  # one finished pair left: no verdict yet
    assert compare_arms("arm", "ref", runs)["verdict"] == "unresolved"
    runs[2]["status"], runs[2]["final_val"] = "diverged", None  # the reference diverged: that decides
    assert compare_arms("arm", "ref", runs)["verdict"] == "better"
