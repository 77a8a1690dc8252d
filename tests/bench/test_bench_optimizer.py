"""geomtrain bench optimizer: the tables, the JSON, the estimate and bad input."""

import json
import re

import pytest

from geomtrain.bench.optimizer import estimate_seconds, solver_arms
from geomtrain.cli import main as cli_main


def run_bench(argv: list[str]) -> int:
    """``geomtrain bench ARGV``: the exit code."""
    return cli_main(["bench", *argv])


def test_bench_optimizer_cli_writes_tables_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = run_bench(
        [
            "optimizer",
            "--shapes",
            "24x8",
            "8x8",
            "--manifolds",
            "stiefel",
            "dgram",
            "--scales",
            "1e-3",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "Per matrix" in captured.out and "Per layer" in captured.out and "x muon" in captured.out
    assert "estimated" in captured.err  # said before the run starts
    result = json.loads(out.read_text())
    assert result["command"].startswith("geomtrain bench optimizer")
    rows = {(r["manifold"], r["solver"]): r for r in result["layers"]}
    assert set(rows) == {(m, s) for m in ("stiefel", "dgram") for s in solver_arms()}
    for m in ("stiefel", "dgram"):
        assert rows[m, "muon"]["x_muon"] == 1.0
        for s in ("cold", "warm"):
            assert rows[m, s]["residual"] <= 1e-4 and rows[m, s]["opnorm"] <= 1 + 1e-2
        assert abs(rows[m, "cold"]["gap"]) < 1e-3
        assert rows[m, "cold"]["dual_gap"] >= rows[m, "cold"]["gap"] - 1e-6  # the certificate bounds the gap
        assert rows[m, "published"]["evaluations"] >= 2
        # the products-only default is an arm too, feasible by construction: float32 rounding of L_W(A) and of
        # the spectral-norm bound (the tolerances of tests/optim/test_filled_split.py)
        assert rows[m, "filled_split"]["residual"] <= 1e-5 and rows[m, "filled_split"]["opnorm"] <= 1 + 1e-6
    assert len(result["matrices"]) == 4 and "cpu" in result["machine"]
    for r in result["matrices"]:
        assert r["solvers"]["muon"]["x_muon"] == 1.0 and r["reference"]["residual"] <= 1e-6


def test_quick_mode_skips_the_reference_and_estimates_less(tmp_path, capsys):
    out = tmp_path / "quick.json"
    assert (
        run_bench(["optimizer", "--quick", "--shapes", "16x8", "--manifolds", "stiefel", "--quiet", "--out", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert result["config"]["scales"] == [1e-3] and result["config"]["reference"] is False
    assert all(r["reference"] is None and "gap" not in r["solvers"]["cold"] for r in result["matrices"])
    args = (["stiefel", "dgram"], [1e-3], 1, solver_arms(), (("a", (2304, 768)),))
    quick, _ = estimate_seconds(*args, reference=False, repeats=1, gflops=50.0)  # one rate: no timing noise
    full, _ = estimate_seconds(*args, reference=True, repeats=1, gflops=50.0)
    assert 0 < quick < full


def test_bench_cli_rejects_bad_input(capsys):
    assert run_bench(["optimizer", "--shapes", "24by8"]) == 2
    assert "OUTxIN" in capsys.readouterr().err
    assert run_bench(["optimiser"]) == 2  # one-line error, exit 2
    assert "invalid choice" in capsys.readouterr().err
    # counts and scales that ran nothing (layers 0 or below), or ended in a traceback (repeats 0: no time
    # kept; scale 0: a zero gradient; threads -1: torch refuses it), refused before anything runs
    for flag, bad, says in (
        ("--layers", "0", "invalid integer >= 1 value: '0'"),
        ("--layers", "-2", "invalid integer >= 1 value: '-2'"),
        ("--repeats", "0", "invalid integer >= 1 value: '0'"),
        ("--scales", "0", "invalid finite number > 0 value: '0'"),
        ("--scales", "nan", "invalid finite number > 0 value: 'nan'"),
        ("--threads", "-1", "invalid integer >= 0 value: '-1'"),
    ):
        assert run_bench(["optimizer", "--quick", "--shapes", "8x4", flag, bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"argument {flag}: {says}" in err, err


def test_bench_optimizer_checks_its_out_path_before_timing(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    bad = tmp_path / "a_file" / "bench.json"
    assert run_bench(["optimizer", "--quick", "--shapes", "8x4", "--out", str(bad)]) == 2
    err = capsys.readouterr().err  # the error alone: not even the time estimate was printed
    assert err == f"geomtrain bench optimizer: error: cannot make this folder: a file is in its path: {bad.parent}\n"
    good = tmp_path / "made" / "bench.json"
    assert run_bench(["optimizer", "--quick", "--shapes", "8x4", "--quiet", "--out", str(good)]) == 0
    assert json.loads(good.read_text())["matrices"]


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"layers": 0}, "layers must be an integer >= 1; got 0"),
        ({"repeats": 0}, "repeats must be an integer >= 1; got 0"),
        ({"scales": ()}, "scales must be finite numbers > 0"),
        ({"scales": (1e-3, -1.0)}, "scales must be finite numbers > 0"),
    ],
)
def test_bench_optimizer_refuses_empty_or_negative_counts(kwargs, says):
    from geomtrain.bench.optimizer import bench_optimizer

    with pytest.raises(ValueError, match=re.escape(says)):
        bench_optimizer(shapes=(("a", (8, 4)),), reference=False, log=lambda s: None, **kwargs)


def test_layernorm_spectrum_plants_the_null_direction_of_training_gradients():
    # Tall (reads a LayerNorm): G 1 = 0; wide and square (write into the residual stream): 1^T G = 0; the
    # decaying spectrum of "powerlaw" otherwise (float32 rounding: 1e-5 of the entries' RMS of 1).
    import torch

    from geomtrain.bench.problems import synthetic_gradient

    for shape in ((24, 8), (8, 24), (8, 8)):
        G = synthetic_gradient(shape, "layernorm", torch.Generator().manual_seed(0), torch.float32, "cpu")
        side = G.sum(dim=1) if shape[0] > shape[1] else G.sum(dim=0)
        assert float(side.abs().max()) <= 1e-5 * shape[0] * shape[1]
        sv = torch.linalg.svdvals(G.double())
        assert float(sv[-1] / sv[0]) <= 1e-6 and float(sv[-2] / sv[0]) >= 1e-3  # exactly one null direction


def test_custom_mask_twin_takes_the_generic_path_and_solves_the_same_problem(tmp_path, capsys):
    # The twin has the built-in geometry (same mask output) but its own project_gram, so the solver must
    # use its generic path; --custom-mask runs the benchmark on it and is as accurate (against the
    # built-in float64 reference) and records the option.
    import torch

    from geomtrain.bench.problems import custom_mask_twin
    from manifolds import DGram, MaskForm, Stiefel

    for man in (Stiefel(), DGram()):
        twin = custom_mask_twin(man)
        assert (
            isinstance(twin, type(man)) and twin.mask_form is MaskForm.CUSTOM and man.mask_form is not MaskForm.CUSTOM
        )
        M = torch.randn(6, 6, generator=torch.Generator().manual_seed(1))
        assert torch.equal(twin.project_gram(M), man.project_gram(M))
    out = tmp_path / "custom.json"
    argv = ["optimizer", "--shapes", "24x8", "--manifolds", "dgram", "--scales", "1e-3", "--quiet"]
    assert run_bench([*argv, "--custom-mask", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["custom_mask"] is True
    rows = {r["solver"]: r for r in result["layers"]}
    assert rows["cold"]["residual"] <= 1e-4 and abs(rows["cold"]["gap"]) < 1e-3
    # every product solver takes a custom mask (filled_split's split holds for any mask, through the products-only
    # normal equation)
    assert set(rows) == set(solver_arms())
    args = (["dgram"], [1e-3], 1, solver_arms(), (("a", (2304, 768)),))
    plain, _ = estimate_seconds(*args, reference=False, repeats=1, gflops=50.0)
    custom, _ = estimate_seconds(*args, reference=False, repeats=1, gflops=50.0, custom_mask=True)
    assert custom > plain


def test_arms_and_solvers_choices_are_read_from_the_solver_registry(tmp_path, capsys):
    # A solver registered after import is an arm at once (before: a fixed tuple of five): in the default arms,
    # in --solvers' choices, timed with muon's msign options; the default solver's arms stay cold and warm.
    import dataclasses

    from geomtrain.optim import REFERENCE_SOLVER, get_solver, register_solver, solver_names, unregister_solver

    assert solver_arms() == ("muon", *[s for s in solver_names() if s != REFERENCE_SOLVER], "cold", "warm")
    register_solver(dataclasses.replace(get_solver("tangent"), name="bench_probe", aliases=()))
    try:
        assert solver_arms()[-3:] == ("bench_probe", "cold", "warm")
        out = tmp_path / "probe.json"
        argv = ["optimizer", "--quick", "--shapes", "16x8", "--manifolds", "stiefel", "--quiet"]
        assert run_bench([*argv, "--solvers", "muon", "bench_probe", "tangent", "--out", str(out)]) == 0
        probe, tangent = (json.loads(out.read_text())["matrices"][0]["solvers"][s] for s in ("bench_probe", "tangent"))
        assert probe["residual"] == tangent["residual"] and probe["opnorm"] == tangent["opnorm"]  # the same solve
    finally:
        unregister_solver("bench_probe")
    capsys.readouterr()
    assert run_bench([*argv, "--solvers", "muon", "bench_probe"]) == 2
    assert "invalid choice: 'bench_probe'" in capsys.readouterr().err


def test_solver_options_reach_the_cold_and_warm_solves(tmp_path, capsys):
    argv = ["optimizer", "--quick", "--shapes", "48x16", "--manifolds", "dgram", "--quiet"]
    assert run_bench([*argv, "--solver-options", "max_iter=1", "--out", str(tmp_path / "one.json")]) == 0
    result = json.loads((tmp_path / "one.json").read_text())
    assert result["config"]["solver_options"] == {"max_iter": "1"}
    solvers = result["matrices"][0]["solvers"]
    # one evaluation, then the polish (one more eigenvalue problem, counted): never the full solve
    assert solvers["cold"]["evaluations"] <= 2 and solvers["warm"]["evaluations"] <= 2
    assert run_bench([*argv, "--solver-options", "compute_dtype=float64", "--out", str(tmp_path / "f64.json")]) == 0
    f64 = json.loads((tmp_path / "f64.json").read_text())["matrices"][0]["solvers"]
    assert f64["cold"]["residual"] <= 1e-4 and f64["cold"]["opnorm"] <= 1 + 1e-6  # float64: no rounding floor
    capsys.readouterr()
    for bad, says in (("bogus=1", "KEY one of tol"), ("compute_dtype=int8", "valid: float32, float64")):
        assert run_bench([*argv, "--solver-options", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and "estimated" not in err  # refused before any work


def test_init_points_are_gpt2_initial_weights_on_the_manifold(tmp_path, capsys):
    # --points init: GPT-2's initial weight (std 0.02, c_proj 0.02 / sqrt(24)) projected onto the manifold,
    # so DGram columns are orthogonal with nearly equal norms (the chi spread of n Gaussian entries), where
    # --points random spreads them log-normally. A bad value is refused before any work.
    import math

    import torch

    from geomtrain.bench.problems import benchmark_point
    from manifolds import DGram

    gen = torch.Generator().manual_seed(0)
    for name, std in (("c_fc", 0.02), ("attn.c_proj", 0.02 / math.sqrt(24))):
        W = benchmark_point(DGram(), name, (512, 128), "init", gen)
        gram = W.double().mT @ W.double()
        off = gram - torch.diag(gram.diagonal())
        assert float(off.abs().max()) <= 1e-5 * float(gram.diagonal().max())  # on the manifold
        s = W.norm(dim=0)
        assert abs(float(s.mean()) / (std * math.sqrt(512)) - 1) < 0.05 and float(s.max() / s.min()) < 1.5
    R = benchmark_point(DGram(), "c_fc", (512, 128), "random", gen).norm(dim=0)
    assert float(R.max() / R.min()) > 3
    out = tmp_path / "init.json"
    argv = ["optimizer", "--quick", "--shapes", "16x16", "--manifolds", "dgram", "--quiet"]
    assert run_bench([*argv, "--points", "init", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["points"] == "init"
    assert result["layers"][-1]["residual"] <= 1e-4
    capsys.readouterr()
    assert run_bench([*argv, "--points", "trained"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice" in err and "init" in err


def test_reference_solve_finds_the_square_stiefel_optimum_and_measures_gaps_against_it():
    # At an orthogonal W the tangent directions are A = W Omega (Omega skew, ||A||_op = ||Omega||_op), so the
    # optimum of <G, A> is A* = W msign(skew(W^T G)) (msign of a skew matrix is skew), from an SVD in float64.
    # Gaps of A*, A*/2 and 1.1 A* (infeasible: overshoots) are 0, 1/2 and -1/10 up to 1e-9: float64 rounding
    # (~1e-13 here) and the smoothing 1e-6 * RMS, far below the smallest singular value of skew(W^T G) (~1e-2).
    import torch

    from geomtrain.bench.problems import reference_solve
    from manifolds import Stiefel

    gen = torch.Generator().manual_seed(0)
    W = torch.linalg.qr(torch.randn(2, 8, 8, generator=gen, dtype=torch.float64))[0]  # a batch of two
    G = torch.randn(2, 8, 8, generator=gen)  # float32: solved in float64
    S = W.mT @ G.double()
    U, s, Vh = torch.linalg.svd((S - S.mT) / 2)
    assert float(s.min()) > 1e-3
    best = W @ U @ Vh
    for scale in (1.0, 1024.0):  # the scale of G cancels (a power of 2: exact in float32)
        ref, stats, gaps = reference_solve(
            Stiefel(), W, scale * G, [best, 0.5 * best, 1.1 * best], tol=1e-10, max_iter=50, smoothing=1e-6
        )
        assert ref.dtype == torch.float64 and float((ref - best).abs().max()) < 1e-9
        assert stats.residual.shape == (2,) and bool(stats.converged.all())
        for gap, expected in zip(gaps, (0.0, 0.5, -0.1)):
            assert gap.shape == (2,) and float((gap - expected).abs().max()) < 1e-9


@pytest.mark.slow
def test_bench_never_imports_the_cli():
    # The CLI registers the benchmarks (geomtrain.cli imports geomtrain.bench), so no module of the bench
    # package may import geomtrain.cli back, not even lazily inside a function: a cycle. Only __main__.py,
    # the entry script of `python -m geomtrain.bench`, which nothing imports, calls the CLI.
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import geomtrain.bench

    package = Path(geomtrain.bench.__file__).parent
    for path in sorted(package.glob("*.py")):
        if path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
                absolute = node.module if node.level == 0 else None
                assert "cli" not in names and absolute != "geomtrain.cli", f"{path.name} imports the CLI"
            elif isinstance(node, ast.Import):
                assert all(alias.name != "geomtrain.cli" for alias in node.names), f"{path.name} imports the CLI"
    modules = ", ".join(f"geomtrain.bench.{p.stem}" for p in sorted(package.glob("*.py")) if p.stem[0] != "_")
    check = f"import sys, {modules}; assert 'geomtrain.cli' not in sys.modules, 'geomtrain.cli was imported'"
    subprocess.run([sys.executable, "-c", check], check=True)


@pytest.mark.slow
def test_python_m_geomtrain_bench_is_geomtrain_bench():
    # The entry script runs the CLI's `bench` command: its one-line error and exit code 2 on bad input.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "geomtrain.bench", "optimizer", "--shapes", "24by8"], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("geomtrain bench optimizer: error: --shapes")
