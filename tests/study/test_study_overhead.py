"""geomtrain.study.overhead: `geomtrain study overhead` times every (preset, solver) interleaved
through the project's one timing loop, and refuses a bad solver before any work."""

import json

import pytest

from geomtrain.cli import main as cli_main


@pytest.mark.slow
def test_overhead_measures_interleaved_step_times(data_dir, tmp_path, capsys):
    assert (
        cli_main(
            [
                "study",
                "overhead",
                "--model",
                "tiny",
                "--data-dir",
                data_dir,
                "--presets",
                "adamw,unconstrained,hetero",
                "--solvers",
                "tangent,default",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--set",
                "batch_size=4",
                "--set",
                "block_size=32",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "overhead.json").read_text())
    rows = record["rows"]
    assert [(r["preset"], r["solver"]) for r in rows] == [
        ("adamw", "-"),
        ("unconstrained", "-"),
        ("hetero", "tangent"),
        ("hetero", "default"),
    ]
    assert rows[0]["vs_adamw"] == 1.0 and rows[1]["vs_unconstrained"] == 1.0 and all(r["ms_per_step"] > 0 for r in rows)
    assert all(r["ms_p10"] <= r["ms_per_step"] <= r["ms_p90"] for r in rows)
    assert record["command"].startswith("geomtrain study overhead --model tiny --presets adamw,unconstrained,hetero")
    assert (tmp_path / "overhead_solvers.png").exists() and "| hetero | tangent |" in (
        tmp_path / "overhead.md"
    ).read_text()
    capsys.readouterr()
    assert cli_main(["study", "overhead", "--out", str(tmp_path), "--solvers", "magic"]) == 2
    assert "unknown solver 'magic'; valid: default, " in capsys.readouterr().err
    # an --out that cannot be a folder (a file in its path) is refused before any step is timed
    (tmp_path / "a_file").write_text("")
    blocked = str(tmp_path / "a_file" / "out")
    argv = ["study", "overhead", "--model", "tiny", "--data-dir", data_dir, "--presets", "adamw"]
    assert cli_main([*argv, "--steps", "1", "--warmup", "0", "--out", blocked]) == 2
    out, err = capsys.readouterr()
    assert err == f"geomtrain study overhead: error: cannot make this folder: a file is in its path: {blocked}\n"
    assert out == ""
