"""geomtrain bench manifold: the project_gram-only mask against DGram, side by side (a table and JSON rows with
the times, their ratio and where the generic results land), and bad input as one line with exit code 2."""

import json

import pytest

from geomtrain.cli import main as cli_main


@pytest.mark.slow
def test_bench_manifold_prints_ratios_and_writes_rows(tmp_path, capsys):
    out = tmp_path / "manifold.json"
    argv = ["bench", "manifold", "--shapes", "48x16", "--block", "4", "--repeats", "1", "--steps", "1"]
    assert cli_main([*argv, "--warmup", "1", "--solvers", "exact", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "against DGram" in table and "ratio" in table
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["projx", "proju", "retr", "step", "step (exact)"]
    for r in rows:
        assert r["shape"] == [48, 16] and r["generic_ms"] > 0 and r["dgram_ms"] > 0
        assert abs(r["ratio"] - r["generic_ms"] / r["dgram_ms"]) <= 1e-6 * r["ratio"]
        if r["op"] != "proju":  # on the manifold: float32 rounding (~1e-7), far below the 1e-4
            assert r["off_block"] <= 1e-5, r
    step = {r["op"]: r for r in rows}
    assert step["step"]["dgram_solver"] == "filled_split" and step["step (exact)"]["solver"] == "exact"


def test_bench_manifold_bad_input_is_one_line(capsys):
    for argv, want in (
        (["--shapes", "48by16"], "bad shape '48by16': use ROWSxCOLS"),
        (["--solvers", "exakt"], "unknown solver 'exakt'"),
    ):
        assert cli_main(["bench", "manifold", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err, err
