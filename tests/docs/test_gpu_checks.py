"""scripts/gpu_checks.sh in its CPU smoke mode: the `recipe` part (scripts/recipe_steps.py) runs every
preset of the `tiny` model and reports tokens/s, MFU, the optimizer's share of a step and peak memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from geomtrain.assign import PRESETS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_checks_smoke_mode_reports_the_recipe_for_every_preset(data_dir, tmp_path):
    out = tmp_path / "checks"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3 = this interpreter
        "OMP_NUM_THREADS": "1",
        "MODEL": "tiny",
        "DEVICE": "cpu",
        "DATA": str(data_dir),
        "STEPS": "1",
        "PARTS": "recipe",
        "OUT": str(out),
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_checks.sh"), "0.5"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    rows = json.loads((out / "recipe.json").read_text())["rows"]
    assert [r["preset"] for r in rows] == list(PRESETS)
    for r in rows:
        assert r["steps_timed"] == 1 and r["tokens_per_s"] > 0
        assert r["mfu"] is None and r["peak_memory_gib"] is None  # CPU: no peak FLOP/s, no CUDA memory
        assert 0 < r["optimizer_share"] < 1
        assert (r["evaluations_per_step"] > 0) == (r["preset"] not in ("adamw",))
    log = (out / "gpu_checks.log").read_text()
    assert "| preset | steps | ms/step | tokens/s | MFU | optimizer share |" in log
    assert "gpu_checks: done" in log
