"""The measurement scripts of scripts/, each run in this process at a tiny size, with checks of what they print."""

import collections
import itertools
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def run_script(monkeypatch, capsys):
    """``run_script(NAME, *ARGV)``: ``python scripts/NAME ARGV`` from the repository root, in this process;
    returns the lines it printed. The scripts set torch's thread count: it is restored."""
    threads = torch.get_num_threads()

    def run(name: str, *argv: str) -> list[str]:
        monkeypatch.setattr(sys, "argv", [name, *argv])
        monkeypatch.chdir(ROOT)
        capsys.readouterr()
        runpy.run_path(str(ROOT / "scripts" / name), run_name="__main__")
        return capsys.readouterr().out.splitlines()

    yield run
    torch.set_num_threads(threads)


def test_square_dgram_spread_prints_a_row_per_spread_with_true_gaps(run_script):
    # True gap bounds: at most the certified gap (an upper bound on the suboptimality) plus 1e-6 for the
    # reference's own error (solved to tol 1e-10); at least -1e-3: a direction tangent only to the default tol
    # 1e-4 may overshoot the optimum by about that relative amount, not more.
    lines = run_script("square_dgram_spread.py", "--n", "16", "--spreads", "0", "0.3", "--reference")
    assert lines[0].startswith("n = 16, seed 0, plain Muon") and lines[1].split()[-2:] == ["true", "gap"]
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["0", "0.3"] and all(len(row) == 8 for row in rows)
    for _, evaluations, converged, certified, x_muon, unit, near, true in rows:
        assert int(evaluations) >= 1 and converged in ("True", "False") and float(x_muon) > 0
        assert 0 <= int(unit) + int(near) <= 16
        assert -1e-3 <= float(true) <= float(certified) + 1e-6 and float(certified) < 1e-2


def test_square_dgram_spread_takes_a_tall_point_and_another_spectrum(run_script):
    lines = run_script(
        "square_dgram_spread.py", "--n", "8", "--rows", "24", "--spectrum", "layernorm", "--spreads", "0", "0.3"
    )
    assert lines[0].startswith("24 x 8, seed 0") and lines[0].endswith("layernorm gradient")
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["0", "0.3"]
    for _, evaluations, converged, certified, _, unit, near in rows:
        # a tall problem of a centred gradient: solved to tol, with at most n unit singular values
        assert int(evaluations) >= 1 and converged == "True" and float(certified) < 1e-3
        assert 0 <= int(unit) + int(near) <= 8


def test_inverse_sqrt_iterations_counts_newton_schulz_iterations(run_script):
    # Float64 reaches the 1e-3 tolerance on every problem, in more iterations the worse M is conditioned;
    # float32 may stop at the cap of 200 instead (the momentum problem has kappa ~3e5).
    lines = run_script("inverse_sqrt_iterations.py", "--shape", "96", "32")
    assert lines[0].split() == ["problem", "dtype", "kappa", "iterations", "products", "error"]
    rows = [
        re.match(r"(.+?)\s+(float32|float64)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\S+)$", line).groups() for line in lines[1:]
    ]
    names = ["96x32 gaussian", "96x32 layernorm", "mini momentum 384x128"]
    assert [(name, dtype) for name, dtype, *_ in rows] == [(n, d) for n in names for d in ("float32", "float64")]
    float64 = []
    for _, dtype, kappa, iterations, products, error in rows:
        assert int(products) == 3 * int(iterations) and float(kappa) >= 1
        assert float(error) <= 1e-3 or (dtype == "float32" and int(iterations) == 200)
        if dtype == "float64":
            float64.append((float(kappa), int(iterations)))
    assert all(k < 200 for _, k in float64)
    assert [k for _, k in sorted(float64)] == sorted(k for _, k in float64)  # more iterations at larger kappa


def test_newton_schulz_iterations_against_a_known_spectrum():
    # M = diag(1, ..., 100): kappa of M + tau^2 I is (100 + tau^2) / (1 + tau^2); one iteration is too few.
    ns = runpy.run_path(str(ROOT / "scripts" / "inverse_sqrt_iterations.py"))["newton_schulz_iterations"]
    M = torch.diag(torch.linspace(1, 100, 16, dtype=torch.float64))
    k, kappa, err = ns(M, 1e-2, torch.float64)
    assert 1 < k < 200 and abs(kappa - 100.01 / 1.01) < 1e-9 and err <= 1e-3
    assert ns(M, 1e-2, torch.float64, cap=1)[0] == 1 and ns(M, 1e-2, torch.float64, cap=1)[2] > 1e-3


@pytest.mark.slow
def test_profile_solves_groups_the_solves_and_checks_them_against_float64(run_script, data_dir, monkeypatch):
    # The hetero preset on the tiny model (2 layers): Stiefel attention (c_attn 192x64, attn.c_proj 64x64),
    # DGram MLP (c_fc 256x64, mlp.c_proj 64x256 solved in its tall form), all warm at step 1. The script's
    # reference solves (tol 1e-9, at most 3,000 evaluations) run to their cap on these momenta (~25 s): here
    # they are capped at 300 evaluations, still far more accurate than the float32 directions they check.
    import geomtrain.bench.optimizer as bench_optimizer
    import geomtrain.optim.muon as muon

    monkeypatch.setattr(muon, "spectral_direction", muon.spectral_direction)  # the script replaces it: restore
    solve = bench_optimizer.reference_solve
    settings = []

    def capped(manifold, W, G, directions=(), **options):
        settings.append(options)
        return solve(manifold, W, G, directions, **{**options, "max_iter": 300})

    monkeypatch.setattr(bench_optimizer, "reference_solve", capped)
    argv = ["hetero", "--model", "tiny", "--data-dir", data_dir, "--first", "1", "--last", "1", "--reference"]
    lines = run_script("profile_solves.py", *argv)
    assert settings and all(s == {"tol": 1e-9, "max_iter": 3000, "smoothing": 1e-6} for s in settings)
    assert re.fullmatch(r"hetero: \d+ ms/step over steps 1-1 \(including the untimed reference solves\)", lines[0])
    groups, i = {}, 1
    while i < len(lines):
        group = re.fullmatch(
            r"  (\w+) (\d+x\d+) (cold|warm): \d+ ms/step, ([\d.]+) evaluations/step over (\d+) matrices", lines[i]
        )
        gaps = re.fullmatch(
            r"    gap to the float64 optimum: largest (\S+), median (\S+); largest certified gap (\S+)", lines[i + 1]
        )
        assert group and gaps, lines[i : i + 2]
        manifold, shape, start, evaluations, matrices = group.groups()
        groups[manifold, shape, start] = int(matrices)
        largest, median, certified = map(float, gaps.groups())
        # the certificate bounds every true gap (1e-6: the reference's own error); an overshoot stays small
        assert float(evaluations) >= 1 and -1e-4 <= median <= largest <= certified + 1e-6
        i += 2
    assert groups == {("Stiefel", "192x64", "warm"): 2, ("Stiefel", "64x64", "warm"): 2, ("DGram", "256x64", "warm"): 4}


def test_profile_solves_variants_solve_each_problem_again_beside_the_run(run_script, data_dir, monkeypatch):
    # hetero on the tiny model, steps 2-3 warm: every warm group gets a line per variant that applies to it
    # (stiefel: DGram groups only; extrapolated: from step 2 on, two earlier states exist) and the moves of
    # its warm-start state, which are relative changes (>= 0; 2 would be a sign flip, far beyond training's).
    import geomtrain.optim.muon as muon

    monkeypatch.setattr(muon, "spectral_direction", muon.spectral_direction)  # the script replaces it: restore
    argv = ["hetero", "--model", "tiny", "--data-dir", data_dir, "--first", "2", "--last", "3"]
    variants = ("cold", "extrapolated", "anderson=0", "stiefel", "frozen-r", "continuation")
    lines = run_script("profile_solves.py", *argv, "--variants", *variants)
    assert re.fullmatch(r"hetero: \d+ ms/step over steps 2-3 \(including the untimed variant solves\)", lines[0])
    group_line = r"  (\w+) (\d+x\d+) (cold|warm): \d+ ms/step, [\d.]+ evaluations/step over \d+ matrices"
    moved_line = r"    warm-start state moved ([\d.]+)-([\d.]+) \(median ([\d.]+)\) between steps"
    groups, current = {}, None
    for line in lines[1:]:
        if group := re.fullmatch(group_line, line):
            current = group.groups()
            groups[current] = {}
        elif variant := re.fullmatch(r"    variant (\S+): \d+ ms/step, ([\d.]+) evaluations/step", line):
            groups[current][variant.group(1)] = float(variant.group(2))
        else:
            if cosine := re.fullmatch(r"    momentum cosine with the previous step (\S+)-(\S+) \(median (\S+)\)", line):
                low, high, median = map(float, cosine.groups())
                assert -1 <= low <= median <= high <= 1 + 1e-12
                groups[current]["cosine"] = median
                continue
            if turned := re.fullmatch(r"    direction moved (\S+)-(\S+) \(median (\S+)\) between steps", line):
                low, high, median = map(float, turned.groups())
                # |A_k - A_(k-1)|_F / |A_k|_F <= 1 + sqrt(n) = 9 at n = 64: |A|_op = 1 <= |A|_F <= sqrt(n)
                assert 0 <= low <= median <= high <= 9
                groups[current]["turned"] = median
                continue
            moved = re.fullmatch(moved_line, line)
            assert moved, line
            low, high, median = map(float, moved.groups())
            assert 0 <= low <= median <= high < 2
            groups[current]["moved"] = median
    assert set(groups) == {("Stiefel", "192x64", "warm"), ("Stiefel", "64x64", "warm"), ("DGram", "256x64", "warm")}
    for (manifold, shape, _), row in groups.items():
        expected = {"cold", "extrapolated", "anderson=0", "moved", "cosine", "turned"}
        expected |= {"stiefel"} if manifold == "DGram" else set()
        expected |= {"frozen-r", "continuation"} if shape != "64x64" else set()  # tall problems only
        assert set(row) == expected and all(row[v] >= 1 for v in expected - {"moved", "cosine", "turned"}), row


def test_profile_solves_variant_options():
    # What each variant changes in one solve call; the script's own helper, run on a DGram point.
    from manifolds import DGram

    variant_options = runpy.run_path(str(ROOT / "scripts" / "profile_solves.py"))["variant_options"]
    gen = torch.Generator().manual_seed(3)
    W = DGram().random(2, 12, 5, generator=gen)
    S1, S2 = torch.randn(2, 5, 5, generator=gen), torch.randn(2, 5, 5, generator=gen)
    warm = {"dual": S2, "escalate": torch.tensor([True, False])}
    assert variant_options("cold", DGram(), W, warm, [S1, S2])[2] == {}
    assert variant_options("extrapolated", DGram(), W, warm, [S2]) is None  # one earlier state: nothing to extrapolate
    assert variant_options("extrapolated", DGram(), W, {}, [S1, S2]) is None  # a cold call stays cold
    assert torch.equal(variant_options("extrapolated", DGram(), W, warm, [S1, S2])[2]["dual"], 2 * S2 - S1)
    assert variant_options("float32", DGram(), W, warm, [])[2]["escalate"] is None
    manifold, Q, options = variant_options("stiefel", DGram(), W, warm, [])
    assert type(manifold).__name__ == "Stiefel" and options == {}
    assert torch.allclose(Q.mT @ Q, torch.eye(5).expand(2, 5, 5), atol=1e-5)  # float32: orthonormal to rounding
    assert variant_options("stiefel", DGram(), W.mT, warm, []) is None  # wide: not the tall form
    with pytest.raises(ValueError, match="unknown variant 'newton'; valid: cold, extrapolated"):
        variant_options("newton", DGram(), W, warm, [])
    # KEY=VALUE[+KEY=VALUE...]: the run's options with these solver options changed, typed by the library's parser
    _, _, options = variant_options("smoothing=0.03+compute_dtype=float32+anderson=0", DGram(), W, warm, [])
    assert options["dual"] is S2 and options["smoothing"] == 0.03 and options["anderson"] == 0
    assert options["compute_dtype"] is torch.float32
    with pytest.raises(ValueError, match="bad value 'oops' for tol in variant"):
        variant_options("tol=oops", DGram(), W, warm, [])
    with pytest.raises(ValueError, match="give KEY=VALUE with KEY one of tol, max_iter"):
        variant_options("depth=3", DGram(), W, warm, [])


@pytest.mark.parametrize("name", ["Stiefel", "DGram"])
def test_profile_solves_frozen_r_start_solves_the_frozen_system(name):
    # The frozen-r start solves P(Z R + R Z^T) = 0 for S at a fixed R. With R the optimum's own (a float64 solve to
    # 1e-10) that system holds at the optimum, and it is linear in S with a unique solution (R > 0), so from a start
    # 10% away the start lands back on the optimum, to the optimum's own residual: in one step for Stiefel (closed
    # form in the eigenbasis of R), after the repeated DGram steps (each approximates a Schur complement).
    import manifolds
    from geomtrain.optim import spectral_direction

    script = runpy.run_path(str(ROOT / "scripts" / "profile_solves.py"))
    manifold = getattr(manifolds, name)()
    gen = torch.Generator().manual_seed(7)
    W = manifold.random(3, 40, 12, generator=gen).double()
    G = torch.randn(3, 40, 12, generator=gen, dtype=torch.float64)
    _, stats = spectral_direction(manifold, W, G, tol=1e-10, max_iter=200)
    S_opt = stats.multiplier
    previous = script["optimum_weights"](manifold, W, G, {}, S_opt)
    noise = manifold.project_gram(torch.randn(3, 12, 12, generator=gen, dtype=torch.float64))
    noise = (noise + noise.mT) / 2
    noise = 0.1 * noise * S_opt.norm(dim=(-2, -1), keepdim=True) / noise.norm(dim=(-2, -1), keepdim=True)
    S = script["frozen_r_start"](manifold, W, G, {"dual": S_opt + noise}, previous)
    error = (S - S_opt).norm(dim=(-2, -1)) / S_opt.norm(dim=(-2, -1))
    assert (error <= 1e-6).all(), error  # measured 5-7e-8 (Stiefel), 2-4e-10 (DGram): the optimum's own residual


def test_profile_solves_continuation_solves_twice_and_returns_the_exact_stage():
    # Stage one at smoothing 0.1 and tol 1e-3, stage two with the run's options from its multiplier: the direction
    # is the second stage's (tangent to the default tol 1e-4, unit norm, certified gap as tight as a direct solve's),
    # the evaluations are both stages'. Square problems are left out (square DGram has no smoothing).
    from geomtrain.optim import spectral_direction, tangent_residual
    from manifolds import DGram

    script = runpy.run_path(str(ROOT / "scripts" / "profile_solves.py"))
    calls = []

    def counted(*args, **options):
        calls.append(options)
        return spectral_direction(*args, **options)

    gen = torch.Generator().manual_seed(11)
    W = DGram().random(2, 40, 12, generator=gen)
    G = torch.randn(2, 40, 12, generator=gen)
    A, stats = script["continuation_solve"](counted, DGram(), W, G, {})
    assert [c.get("smoothing") for c in calls] == [0.1, None] and calls[1]["dual"] is not None
    _, direct = spectral_direction(DGram(), W, G)
    assert (tangent_residual(DGram(), W, A) <= 1e-4).all()
    assert (torch.linalg.matrix_norm(A, ord=2) <= 1 + 1e-5).all()
    assert (stats.evaluations >= 2).all() and (stats.dual_gap <= direct.dual_gap.abs().max() + 1e-4).all()
    square = DGram().random(2, 12, 12, generator=gen)
    assert script["continuation_solve"](counted, DGram(), square, G[:, :12], {}) is None


def test_profile_solves_deflated_variant_solves_exact_nulls_deflated_and_the_rest_whole():
    # A batch of two Stiefel problems, one with LayerNorm's null direction exactly (G v = 0) and one without: the
    # first is solved deflated and completed, the second as it is; both come back tangent to the solver's tol and
    # of unit norm to float32 rounding, as good as the whole solve (certified gaps ~1e-5 at tol 1e-4).
    from geomtrain.bench.optimizer import synthetic_gradient
    from geomtrain.optim import spectral_direction, tangent_residual
    from manifolds import DGram, Stiefel

    script = runpy.run_path(str(ROOT / "scripts" / "profile_solves.py"))
    deflated_solve, null_ratio = script["deflated_solve"], script["null_ratio"]
    gen = torch.Generator().manual_seed(5)
    W = Stiefel().random(2, 24, 8, generator=gen)
    G = torch.stack(
        [synthetic_gradient((24, 8), "layernorm", gen, torch.float32, "cpu"), torch.randn(24, 8, generator=gen)]
    )
    assert float(null_ratio(G)[0]) <= script["EXACT_NULL"] < float(null_ratio(G)[1])
    A, stats = deflated_solve(spectral_direction, Stiefel(), W, G, {})
    whole, whole_stats = spectral_direction(Stiefel(), W, G)
    assert (tangent_residual(Stiefel(), W, A) <= 1e-4).all()
    assert (torch.linalg.matrix_norm(A, ord=2) <= 1 + 1e-5).all()
    # certified gaps: small, and negative by at most about tol (a direction tangent only to tol can overshoot)
    assert (stats.evaluations >= 1).all() and ((stats.dual_gap >= -1e-4) & (stats.dual_gap <= 1e-3)).all()
    Gh = G / G.norm(dim=(-2, -1), keepdim=True)
    assert ((A - whole) * Gh).sum(dim=(-2, -1)).abs().max() <= 1e-4  # the same objective, to the solver's accuracy
    assert torch.equal(A[1], whole[1])  # the entry without an exact null is solved exactly as the run solves it
    # a warm start is deflated too (U^T S U): the same problem from the whole solve's multiplier
    A_warm, _ = deflated_solve(
        spectral_direction, Stiefel(), W, G, {"dual": whole_stats.dual, "escalate": whole_stats.escalated}
    )
    assert (tangent_residual(Stiefel(), W, A_warm) <= 1e-4).all()
    # where it does not apply: DGram, square Stiefel, no exact null direction in the batch
    assert deflated_solve(spectral_direction, DGram(), DGram().random(2, 24, 8, generator=gen), G, {}) is None
    square = Stiefel().random(2, 8, 8, generator=gen)
    assert deflated_solve(spectral_direction, Stiefel(), square, G[:, :8], {}) is None
    assert deflated_solve(spectral_direction, Stiefel(), W[1:], G[1:], {}) is None


def test_profile_solves_runs_the_deflated_and_option_variants(run_script, data_dir, monkeypatch):
    # all-stiefel on the tiny model at step 2 (warm): the 256x64 group holds mlp.c_proj (exact null, tall form)
    # and c_fc, so it gets the deflated variant; every group gets the option variants. max_iter=2: at most two
    # evaluations per matrix, then the polish (one more), so at most 3 per matrix and step.
    import geomtrain.optim.muon as muon

    monkeypatch.setattr(muon, "spectral_direction", muon.spectral_direction)  # the script replaces it: restore
    argv = ["all-stiefel", "--model", "tiny", "--data-dir", data_dir, "--first", "2", "--last", "2", "--variants"]
    lines = run_script("profile_solves.py", *argv, "deflated", "max_iter=2", "smoothing=0.03+compute_dtype=float32")
    groups, current = {}, None
    group_line = r"  Stiefel (\d+x\d+) warm: \d+ ms/step, [\d.]+ evaluations/step over (\d+) matrices"
    for line in lines[1:]:
        if group := re.fullmatch(group_line, line):
            current = group.group(1)
            groups[current] = {"matrices": int(group.group(2))}
        elif variant := re.fullmatch(r"    variant (\S+): \d+ ms/step, ([\d.]+) evaluations/step", line):
            groups[current][variant.group(1)] = float(variant.group(2))
    assert set(groups) == {"256x64", "192x64", "64x64"}
    for shape, row in groups.items():
        expected = {"matrices", "max_iter=2", "smoothing=0.03+compute_dtype=float32"} | (
            {"deflated"} if shape == "256x64" else set()
        )
        assert set(row) == expected, row
        assert 1 <= row["max_iter=2"] <= 3 * row["matrices"]
        assert all(row[k] >= 1 for k in expected)
    with pytest.raises(SystemExit) as exit_info:  # a bad variant: argparse's one-line error, exit code 2
        run_script("profile_solves.py", "all-stiefel", "--variants", "tol=oops")
    assert exit_info.value.code == 2


def test_profile_solves_operator_timer_counts_only_while_on_and_sorts_by_kind():
    # Three operators of known kinds while on (a product, an eigendecomposition, an addition); products while
    # off are not counted. The kinds add up to the total.
    from geomtrain.optim.numerics import sym

    script = runpy.run_path(str(ROOT / "scripts" / "profile_solves.py"))
    timer = script["OperatorTimer"]()
    x = torch.randn(16, 16, dtype=torch.float64)
    with timer:
        x @ x
        timer.on = True
        m = x @ x.mT
        torch.linalg.eigh(m)
        m + 1
        timer.on = False
        x @ x
    assert timer.calls["mm"] == 1 and timer.calls["_linalg_eigh"] == 1 and timer.calls["add"] == 1
    # by caller: the operators above were called from here (outside geomtrain and manifolds), sym's from numerics
    assert set(timer.caller_calls) == {"elsewhere"} and timer.caller_calls.total() == timer.calls.total()
    before = timer.caller_calls["elsewhere"]
    with timer:
        timer.on = True
        sym(x)
        timer.on = False
    assert timer.caller_calls["numerics.py:sym"] >= 2 and timer.caller_calls["elsewhere"] == before  # (X + X^T) / 2
    kinds = timer.kinds()
    assert kinds["matrix products"] == timer.seconds["mm"] > 0
    assert kinds["eigendecompositions and SVDs"] == timer.seconds["_linalg_eigh"] > 0
    assert kinds["other operators"] == pytest.approx(
        sum(timer.seconds.values()) - timer.seconds["mm"] - timer.seconds["_linalg_eigh"]
    )


def test_profile_solves_ops_times_the_optimizer_step_by_operator(run_script, data_dir, monkeypatch):
    # hetero on the tiny model, steps 1-2: the step line says the timer slowed it, then the operator total,
    # three kinds whose shares add up to 100% (rounding: each share is printed to 1%), then the dearest
    # operators, among them the solver's eigendecompositions and products, then the functions calling them.
    import geomtrain.optim.muon as muon

    monkeypatch.setattr(muon, "spectral_direction", muon.spectral_direction)  # the script replaces both: restore
    monkeypatch.setattr(muon.ManifoldMuon, "step", muon.ManifoldMuon.step)
    argv = ["hetero", "--model", "tiny", "--data-dir", data_dir, "--first", "1", "--last", "2", "--ops"]
    lines = run_script("profile_solves.py", *argv)
    assert re.fullmatch(r"hetero: \d+ ms/step over steps 1-2 \(slowed by the operator timer\)", lines[0])
    start = lines.index(next(line for line in lines if line.startswith("  optimizer step")))
    total = re.fullmatch(r"  optimizer step, aten operators: (\d+) ms/step, (\d+) calls/step", lines[start])
    assert total and int(total.group(2)) > 0
    kinds = [re.fullmatch(r"    ([a-zA-Z ]+): (\d+) ms/step \((\d+)%\)", line) for line in lines[start + 1 : start + 4]]
    assert all(kinds), lines[start + 1 : start + 4]
    assert [k.group(1) for k in kinds] == ["eigendecompositions and SVDs", "matrix products", "other operators"]
    assert 97 <= sum(int(k.group(3)) for k in kinds) <= 101
    block = list(itertools.takewhile(lambda line: line.startswith("    "), lines[start + 4 :]))
    operators = [re.fullmatch(r"    (\w+): ([\d.]+) ms/step, (\d+) calls/step", line) for line in block]
    assert all(operators) and len(operators) == 8, block
    assert {"_linalg_eigh", "bmm"} <= {o.group(1) for o in operators}
    at = start + 4 + len(block)
    assert lines[at] == "  by calling function:"
    block = list(itertools.takewhile(lambda line: line.startswith("    "), lines[at + 1 :]))  # then the groups
    callers = [re.fullmatch(r"    (\w+\.py:\w+|elsewhere): [\d.]+ ms/step, \d+ operator calls/step", c) for c in block]
    assert all(callers) and len(callers) == 8, block
    assert "numerics.py:symmetric_eigen" in {c.group(1) for c in callers}  # where the solver's eigh is called
    with pytest.raises(SystemExit) as exit_info:  # --ops would count the variants' solves: refused, exit code 2
        run_script("profile_solves.py", "hetero", "--ops", "--variants", "cold")
    assert exit_info.value.code == 2
    # without --ops no dispatch mode is active in the steps (it would slow every operator the script times)
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    modes, step = [], muon.ManifoldMuon.step

    def watched(self, *args, **kwargs):
        modes.append(_get_current_dispatch_mode())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(muon.ManifoldMuon, "step", watched)
    run_script("profile_solves.py", *argv[:-1])
    assert modes and all(mode is None for mode in modes)


def test_exact_newton_step_hessian_product_matches_finite_differences():
    # The Daleckii-Krein product must be the derivative of the residual H(S) = P(ZR + RZ^T): central differences at
    # h = 1e-5 in float64, away from the clamp at tau^2 (truncation ~h^2, rounding ~1e-16 / h of |H|), and
    # symmetric (the Hessian of the smoothed dual), for a Stiefel and a DGram point.
    from geomtrain.optim.gram import GramDual
    from geomtrain.optim.numerics import sym
    from manifolds import DGram, Stiefel

    script = runpy.run_path(str(ROOT / "scripts" / "exact_newton_step.py"))
    residual = script["residual_matrix"]
    gen = torch.Generator().manual_seed(2)
    for manifold in (Stiefel(), DGram()):
        W = manifold.random(1, 20, 6, generator=gen).double()
        G = torch.randn(1, 20, 6, generator=gen, dtype=torch.float64)
        dual = GramDual(manifold, W, G / G.norm(), torch.float64, 1e-3)
        S = dual.tangent_start()
        ev = dual.evaluate(S)
        assert (ev.lam > 10 * dual.tau2).all()  # a Gaussian gradient: no eigenvalue near the clamp
        product = script["hessian_product"](dual, ev)
        a, b = (dual.P(sym(torch.randn(1, 6, 6, generator=gen, dtype=torch.float64))) for _ in range(2))
        h = 1e-5
        fd = (residual(dual.evaluate(S + h * a)) - residual(dual.evaluate(S - h * a))) / (2 * h)
        assert torch.allclose(product(a), fd, rtol=0, atol=1e-6 * float(fd.norm()))
        assert torch.isclose((product(a) * b).sum(), (a * product(b)).sum(), rtol=1e-9)
        assert float((a * product(a)).sum()) > 0
        # the Gauss-Newton solve inverts the frozen-R operator: P(Gamma D R + R D Gamma) = B (the DGram step
        # enforces the zero diagonal through a rank-6 Schur complement: accurate to about 1e-3 relative)
        B = dual.P(sym(torch.randn(1, 6, 6, generator=gen, dtype=torch.float64)))
        D = script["gauss_newton_solve"](dual, ev)(B)
        X = dual.gamma(D) @ ev.weights()
        assert torch.allclose(dual.P(X + X.mT), B, atol=1e-3 * float(B.norm()))


def test_exact_newton_step_prints_a_row_per_tall_group(run_script, data_dir, monkeypatch):
    import geomtrain.optim.muon as muon

    monkeypatch.setattr(muon, "spectral_direction", muon.spectral_direction)  # the script restores it too
    lines = run_script("exact_newton_step.py", "hetero", "--model", "tiny", "--data-dir", data_dir, "--step", "2")
    assert lines[0].startswith("hetero step 2: tangent residual RMS after one step from the warm start")
    assert lines[1].split()[:3] == ["group", "start", "gauss-newton"]
    rows = {" ".join(line.split()[:3]): [float(x) for x in line.split()[3:]] for line in lines[2:]}
    assert set(rows) == {"Stiefel 192x64 (2)", "DGram 256x64 (4)"}
    for values in rows.values():
        *residuals, iterations = values
        assert len(residuals) == 10 and all(0 < r < 1 for r in residuals) and iterations >= 1
        assert residuals[2] < residuals[0]  # the Gauss-Newton step lowers the median residual (it is the solver's)


def test_square_dgram_face_newton_reaches_the_tolerance_both_ways(run_script):
    lines = run_script("square_dgram_face_newton.py", "--n", "16", "--k0", "0", "2")
    assert lines[0].startswith("n = 16, gaussian gradient") and lines[1].split()[:2] == ["method", "eighs"]
    rows = {line[:26].strip(): line[26:].split() for line in lines[2:]}
    assert list(rows) == ["douglas-rachford", "dr x 0 + newton", "dr x 2 + newton"]
    for name, (eighs, products, residual, seconds) in rows.items():
        assert float(residual) <= 1e-4 and float(seconds) >= 0 and int(eighs) >= 1
        assert int(products) == 0 if name == "douglas-rachford" else int(products) > 0
    # Newton on the fixed point needs fewer eigendecompositions than the plain iteration (measured 7-14 against 20)
    assert all(int(rows[k][0]) < int(rows["douglas-rachford"][0]) for k in ("dr x 0 + newton", "dr x 2 + newton"))
    # warm, with inexact Newton steps: both still reach the tolerance
    lines = run_script("square_dgram_face_newton.py", "--n", "16", "--k0", "1", "--warm", "--gmres-rtol", "0.3")
    assert "warm (next step), GMRES rtol 0.3" in lines[0]
    assert [float(line.split()[-2]) <= 1e-4 for line in lines[2:]] == [True, True]
    # near-equal column norms (the hard case of docs/manifold-muon.md): measured 14 + 108 against 38
    lines = run_script("square_dgram_face_newton.py", "--n", "16", "--k0", "2", "--spread", "0.3")
    assert "column norms spread 0.3" in lines[0]
    assert [float(line.split()[-2]) <= 1e-4 for line in lines[2:]] == [True, True]


def test_square_dgram_face_newton_jacobian_matches_finite_differences():
    # Away from singular values at exactly 1 the fixed-point map is smooth: the analytic product must match a
    # central difference to O(h^2) (h = 1e-6 in float64: truncation ~1e-12, rounding ~1e-10 of |Phi|).
    ns = runpy.run_path(str(ROOT / "scripts" / "square_dgram_face_newton.py"))
    from geomtrain.optim.square_dgram import SquareFrame

    gen = torch.Generator().manual_seed(3)
    n = 8
    Q = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]
    W = Q * (0.5 + torch.rand(n, generator=gen, dtype=torch.float64))
    G = torch.randn(n, n, generator=gen, dtype=torch.float64)
    phi = ns["FixedPointMap"](SquareFrame(W, G / G.norm()))
    z, v = (torch.randn(n, n, generator=gen, dtype=torch.float64) for _ in range(2))
    F, _, svd = phi(z)
    assert (svd[1] - 1).abs().min() > 1e-3  # no singular value at the kink
    h = 1e-6
    fd = (phi(z + h * v)[0] - phi(z - h * v)[0]) / (2 * h)
    assert torch.allclose(phi.jacobian(svd)(v), fd, rtol=0, atol=1e-7 * float(fd.norm()))


def test_null_direction_deflation_completes_to_a_feasible_optimal_direction(run_script):
    lines = run_script("null_direction_deflation.py", "--shape", "24", "8", "--seeds", "2")
    assert lines[0] == "Stiefel 24 x 8, layernorm gradients (G v = 0), solves in float32"
    stiefel, dgram = [line.split() for line in lines[2:4]], [line.split() for line in lines[6:8]]
    for _, evals, res, _, _, def_evals, def_res, def_opnorm, def_gap, a, a_star, warm in stiefel:
        assert int(evals) >= 1 and int(def_evals) >= 1 and int(warm) >= 1 and float(res) <= 1e-4
        # the completed direction is tangent to the solver's tol and of unit norm to float32 rounding, and as
        # close to the float64 optimum as the whole solve (|gap| ~ tol / 10 in float32)
        assert float(def_res) <= 1e-4 and abs(float(def_opnorm) - 1) <= 1e-5 and abs(float(def_gap)) <= 1e-4
        assert abs(float(a) - float(a_star)) <= 1e-2  # the completion is the optimum's column along v
    # an approximate null direction: the completed direction stays feasible, within about |G v| of the optimum
    lines = run_script("null_direction_deflation.py", "--shape", "24", "8", "--seeds", "1", "--perturb", "1e-3")
    assert lines[0] == "Stiefel 24 x 8, layernorm gradients (|G v| = 0.001 |G|_op), solves in float32"
    _, _, _, _, _, _, def_res, def_opnorm, def_gap, _, a_star, _ = lines[2].split()
    assert float(def_res) <= 1e-4 and abs(float(def_opnorm) - 1) <= 1e-5 and 0 < float(def_gap) <= 1e-3
    assert abs(float(a_star) - 1) <= 1e-3  # the optimum is no longer degenerate: its column along v is a unit one
    for _, ratio, smallest, following, evals, _, def_evals, def_res, def_opnorm, def_gap, a, a_star in dgram:
        # at the DGram optimum S* v = 0 and Y* v = 0 (reference tol 1e-10); the next singular value is not small
        assert float(ratio) < 1e-6 and float(smallest) < 1e-6 and float(following) > 1e-2
        # the deflated DGram solve (the generic path, S v = 0), completed: feasible and optimal to the same tolerances
        assert int(evals) >= 1 and int(def_evals) >= 1
        assert float(def_res) <= 1e-4 and abs(float(def_opnorm) - 1) <= 1e-5 and abs(float(def_gap)) <= 1e-4
        assert abs(float(a) - float(a_star)) <= 1e-2


def test_profile_solves_null_census_finds_the_residual_stream_writers(run_script, data_dir, monkeypatch):
    # tiny hetero at step 1: the gradient of mlp.c_proj (writes into the residual stream, solved in its tall
    # form 256x64) has LayerNorm's null direction exactly; c_fc (reads a LayerNorm output) only nearly, and
    # so do the Stiefel attention matrices here (c_attn reads one; attn.c_proj is square, its null on the left)
    import geomtrain.optim.muon as muon

    monkeypatch.setattr(muon, "spectral_direction", muon.spectral_direction)  # the script replaces it: restore
    argv = ["hetero", "--model", "tiny", "--data-dir", data_dir, "--first", "1", "--last", "1", "--null-census"]
    lines = run_script("profile_solves.py", *argv)
    census = collections.defaultdict(dict)
    group = None
    for line in lines[1:]:
        head = re.fullmatch(r"  (\w+) (\d+x\d+) (cold|warm): .*", line)
        if head:
            group = head.group(1, 2)
            continue
        row = re.fullmatch(
            r"    (exact|no exact) null direction: (\d+) matrices, ([\d.]+) evaluations per solve \((\d+)-(\d+)\), "
            r"\|G v\| / \|G\|_op ([\d.]+e[+-]\d+)-([\d.]+e[+-]\d+)",
            line,
        )
        assert row, line
        kind, matrices, mean, low, high, r_low, r_high = row.groups()
        assert 1 <= int(low) <= float(mean) <= int(high) and float(r_low) <= float(r_high)
        assert (float(r_high) <= 1e-5) if kind == "exact" else (float(r_low) > 1e-5)
        census[group][kind] = int(matrices)
    assert census == {
        ("DGram", "256x64"): {"exact": 2, "no exact": 2},
        ("Stiefel", "192x64"): {"no exact": 2},
        ("Stiefel", "64x64"): {"no exact": 2},
    }


def test_factor_evaluation_resolves_the_small_singular_values_that_float32_m_loses():
    # F = [Zs; Rp] with singular values 1 .. 1e-6 (float64 truth). A float32 eigendecomposition of M = F^T F knows
    # its eigenvalues only to ~eps32 * lambda_max = 6e-8, so sigma = 1e-4 (lambda = 1e-8) is lost: 30-62% off
    # (seeds 0-3, n = 48; asserted: above 20%). The graded one decomposes the block below 1e-3 lambda_max again
    # from F V_k, whose entries are known to their own scale: eigenvalues down to 1e-8 to ~eps32 * 1e-3 / 1e-8
    # = 0.6%, 0.3% on sigma (measured at most 0.06% over seeds 0-3; asserted: 0.3%).
    from geomtrain.optim.numerics import eigh_psd

    script = runpy.run_path(str(ROOT / "scripts" / "factor_evaluation.py"))
    gen = torch.Generator().manual_seed(0)
    n = 48
    sigma = torch.logspace(0, -6, n, dtype=torch.float64)
    U = torch.linalg.qr(torch.randn(2 * n, n, generator=gen, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]
    F = (U * sigma) @ V.T
    Zs, Rp = F[:n].float()[None], torch.linalg.qr(F[n:], mode="r").R.float()[None]
    lam, Vg = script["graded_eigh"](Zs, Rp, Rp.mT @ Rp, 1e-3)
    resolved = sigma.flip(0) >= 1e-4
    graded = lam[0].double().sqrt()
    plain = eigh_psd(Zs.mT @ Zs + Rp.mT @ Rp)[0][0].double().clamp_min(0).sqrt()
    assert ((graded - sigma.flip(0)).abs() / sigma.flip(0))[resolved].max() < 3e-3
    assert ((plain - sigma.flip(0)).abs() / sigma.flip(0))[resolved].max() > 0.2
    assert torch.allclose(Vg[0].mT @ Vg[0], torch.eye(n), atol=1e-5)  # still orthonormal to float32 rounding
    lam_svd, V_svd = script["factor_svd"](Zs, Rp, None, 0.0)  # the float32 SVD of F resolves them as well
    assert ((lam_svd[0].double().sqrt() - sigma.flip(0)).abs() / sigma.flip(0))[resolved].max() < 3e-3
    assert (lam_svd[0].diff() >= 0).all() and torch.allclose(V_svd[0].mT @ V_svd[0], torch.eye(n), atol=1e-5)


def test_factor_evaluation_prints_both_variants_with_honest_certificates(run_script, data_dir, monkeypatch):
    import geomtrain.optim.gram_newton as gram_newton
    import geomtrain.optim.muon as muon

    monkeypatch.setattr(muon, "spectral_direction", muon.spectral_direction)  # capture restores it too
    lines = run_script(
        "factor_evaluation.py", "hetero", "--model", "tiny", "--data-dir", data_dir, "--step", "2", "--repeats", "1"
    )
    assert gram_newton.GramDual.__name__ == "GramDual"  # the patch is undone
    assert lines[0].startswith("hetero step 2: tall solves")
    assert lines[1].split()[:3] == ["group", "variant", "evaluations"]
    rows = {(" ".join(line.split()[:3]), line.split()[3]): line.split()[4:] for line in lines[2:]}
    assert set(rows) == {(g, v) for g in ("Stiefel 192x64 (2)", "DGram 256x64 (4)") for v in ("float64", "factor32")}
    for (_, variant), cells in rows.items():
        evaluations, ms, residual, excess, certified, true, factored = cells
        assert int(evaluations) >= 1 and float(ms) >= 0  # ms printed as an integer
        # the accuracy targets; the residual of the float32 A, taken in float64, may exceed the solver's
        # Gram-space one by A's rounding (measured up to 0.4% of tol: STOP_MARGIN in gram_newton)
        assert float(residual) <= 1.05e-4 and float(excess) < 1e-2
        assert float(true) <= float(certified) + 1e-7  # the certificate bounds the true gap
        if variant == "float64":
            assert int(factored) == 0  # the library's own solve makes no factored evaluation
    assert sum(int(rows[key][-1]) for key in rows if key[1] == "factor32") > 0  # the factor path was exercised
