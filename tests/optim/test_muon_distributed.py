"""ManifoldMuon on 2 CPU ranks (gloo): solves split across ranks, every rank ends identical and equal to
one process."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

SUPPORT = Path(__file__).resolve().parents[1] / "_support"  # dist_optim_worker.py (a torchrun script)


def test_two_ranks_match_each_other_and_one_process(tmp_path):
    import dist_optim_worker  # tests/_support is on sys.path (tests/conftest.py)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the planted NaN gradient warns once
        ref_params, ref_state, ref_stats = dist_optim_worker.run()

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SUPPORT.parents[1])}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(SUPPORT / "dist_optim_worker.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2
    for name in ref_params:
        assert torch.equal(r0["params"][name], r1["params"][name]), name  # ranks bitwise identical
        # the owner rank runs the same computation in a smaller batch: equal up to float rounding
        assert float((r0["params"][name] - ref_params[name]).abs().max()) < 1e-6, name
    for pid, st in ref_state.items():  # momentum and dual variables agree too
        for key, val in st.items():
            assert torch.equal(r0["state"][pid][key], r1["state"][pid][key]), (pid, key)
            assert float((r0["state"][pid][key] - val).abs().max()) < 1e-5, (pid, key)
    assert r0["stats"] == r1["stats"]
    for a, b in zip(r0["stats"], ref_stats):
        assert a["n_matrices"] == b["n_matrices"] and a["n_skipped_nonfinite"] == b["n_skipped_nonfinite"]
        assert a["msign_calls"] == b["msign_calls"]
    assert ref_stats[2]["n_skipped_nonfinite"] == 1 and ref_stats[2]["n_matrices"] == 7  # 8 matrices (ob: 2), 1 skipped
