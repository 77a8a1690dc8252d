"""Manifold Muon: the spectral direction (all solvers) and the ManifoldMuon optimizer."""
import io
import json
import math
import warnings

import geoopt
import pytest
import scipy.linalg
import torch

from geomtrain.optim import SOLVERS, ManifoldMuon, spectral_direction, tangent_residual
from manifolds import BoundedDGram, DGram, Euclidean, GramManifold, Oblique, Stiefel, msign

MANIFOLDS = [Stiefel(), DGram(), Oblique(), Euclidean()]
CONSTRAINED = MANIFOLDS[:3]
SHAPES = [(16, 8), (8, 16), (12, 12), (3, 10, 6)]


class BlockGram(GramManifold):
    """A user mask (the generic solver path): columns orthogonal across blocks of 2."""

    def project_gram(self, M):
        block = torch.arange(M.shape[-1], device=M.device) // 2
        return M * (block[:, None] != block[None, :]).to(M.dtype)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _problem(manifold, shape, seed=0, dtype=torch.float32, scale=1.0):
    W = manifold.random(*shape, dtype=dtype, generator=_gen(seed))
    G = scale * torch.randn(*shape, dtype=dtype, generator=_gen(seed + 100))
    return W, G


def _opnorm(A):
    return float(torch.linalg.matrix_norm(A.double(), ord=2).max())


def _reference(manifold, W, G):
    """High-accuracy solution: float64, tolerance 1e-9, smoothing 1e-6 (at most ~1e-6 of the objective)."""
    A, st = spectral_direction(manifold, W.double(), G.double(), tol=1e-9, max_iter=400, smoothing=1e-6)
    assert bool(st["converged"].all()), st
    return A, st


def _objective(G, A):
    """<G/|G|_F, A> per matrix."""
    G = G.double()
    return ((G * A.double()).sum((-2, -1)) / G.norm(dim=(-2, -1)))


# ============================================================================ spectral_direction
@pytest.mark.parametrize("manifold", MANIFOLDS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_default_solver_is_tangent_unit_norm_and_converged(manifold, shape):
    W, G = _problem(manifold, shape, seed=1)
    A, st = spectral_direction(manifold, W, G)
    assert A.shape == W.shape and A.dtype == W.dtype
    assert st["residual"].shape == W.shape[:-2]
    res = tangent_residual(manifold, W.double(), A.double())
    assert float(res.max()) <= 1.5e-4, res  # the stop test (1e-4) holds on the returned A
    assert float((res - st["residual"]).abs().max()) < 1e-5  # and the reported residual is the true one
    # converged to tol, or (degenerate near-square duals, max_iter reached) polished onto the
    # tangent space and into the unit ball, with a small certified gap
    unconv = ~st["converged"].reshape(-1)
    if bool(unconv.any()):
        assert float(st["residual"].reshape(-1)[unconv].max()) < 1e-6
        assert float(st["dual_gap"].reshape(-1)[unconv].max()) < 1e-2
    if isinstance(manifold, Euclidean):  # plain Muon: 5 Polar Express steps, roughly unitary
        assert torch.equal(A, msign(G, "polar_express", steps=5))
        assert 0.7 < _opnorm(A) < 1.2
    else:
        assert _opnorm(A) <= 1 + 1e-5
        assert _opnorm(A) >= 1 - 1e-3  # unit spectral norm, not a shrunken direction


@pytest.mark.parametrize("solver", SOLVERS)
def test_euclidean_is_plain_muon_for_every_solver(solver):
    W, G = _problem(Euclidean(), (16, 8), seed=2)
    A, st = spectral_direction(Euclidean(), W, G, solver=solver)
    opts = {"msign_dtype": torch.bfloat16} if solver == "published" else {}
    expect = msign(G, "polar_express", steps=5, compute_dtype=opts.get("msign_dtype"))
    assert torch.equal(A, expect)
    assert int(st["msign_calls"]) == 1 and float(st["residual"]) == 0.0


@pytest.mark.parametrize("manifold", CONSTRAINED + [BlockGram(), BoundedDGram(2.0)], ids=lambda m: type(m).__name__)
def test_default_solver_matches_a_high_accuracy_reference(manifold):
    W, G = _problem(manifold, (24, 8), seed=3, dtype=torch.float64)
    A, st = spectral_direction(manifold, W, G)
    ref, ref_st = _reference(manifold, W, G)
    opt = float(_objective(G, ref))
    assert abs(float(_objective(G, A)) - opt) <= 1e-3 * opt  # objective within 0.1%
    assert float(ref_st["dual_gap"]) < 1e-6  # the reference certifies itself
    # the gap bounds the suboptimality of a feasible A; A is feasible to 1e-4 only, so it may dip below 0
    assert -1e-5 <= float(st["dual_gap"]) < 1e-3


@pytest.mark.parametrize("manifold", CONSTRAINED, ids=lambda m: type(m).__name__)
def test_weak_duality_bounds_every_feasible_direction(manifold):
    # ||G + W S||_* >= <G, A> for every S and every feasible A: the reference optimum is below any
    # dual value, and a feasible direction (projected, scaled into the ball) is below the optimum.
    W, G = _problem(manifold, (20, 6), seed=4, dtype=torch.float64)
    ref, _ = _reference(manifold, W, G)
    Gh = G / G.norm()
    opt = float((Gh * ref).sum())
    mask = manifold.gram_mask(6, W)
    for seed in range(5):
        S = torch.randn(6, 6, dtype=torch.float64, generator=_gen(seed))
        S = 0.3 * (S + S.T) * mask
        assert float(torch.linalg.matrix_norm(Gh + W @ S, ord="nuc")) >= opt - 1e-9
    B = manifold.proju(W, torch.randn(20, 6, dtype=torch.float64, generator=_gen(9)))
    B = B / _opnorm(B)
    assert float((Gh * B).sum()) <= opt + 1e-9


@pytest.mark.parametrize("manifold", CONSTRAINED, ids=lambda m: type(m).__name__)
def test_every_solver_returns_a_reasonable_direction(manifold):
    W, G = _problem(manifold, (24, 8), seed=5)
    ref, _ = _reference(manifold, W, G)
    opt = float(_objective(G, ref))
    for solver in SOLVERS:
        A, st = spectral_direction(manifold, W, G, solver=solver)
        assert _opnorm(A) < 1.25  # 5-step Polar Express is only roughly unitary
        assert float(_objective(G, A)) > 0.8 * opt
        assert float(st["residual"]) < 0.2
        assert int(st["msign_calls"]) >= 1


def test_square_stiefel_tangent_projection_is_already_optimal():
    # At a square orthogonal W the tangent space is {W Omega}, closed under msign: every solver
    # agrees with the exact msign of the projected G.
    W, G = _problem(Stiefel(), (10, 10), seed=6, dtype=torch.float64)
    A, st = spectral_direction(Stiefel(), W, G)
    B, _ = spectral_direction(Stiefel(), W, G / G.norm(), solver="tangent", msign="svd")
    assert int(st["msign_calls"]) == 1
    assert float((A - B).abs().max()) < 1e-6  # the smoothing (1e-4 sigma_rms) is the only difference


def test_published_first_iterate_is_the_tangent_solution_on_stiefel():
    W, G = _problem(Stiefel(), (16, 8), seed=7, dtype=torch.float64)
    opts = {"msign": "svd", "msign_steps": 5, "msign_dtype": None}
    A, st = spectral_direction(Stiefel(), W, G, solver="published", steps=1, **opts)
    B, _ = spectral_direction(Stiefel(), W, G, solver="tangent", **opts)
    assert int(st["msign_calls"]) == 1
    assert float((A - B).abs().max()) < 1e-10


def test_gram_newton_is_scale_invariant_and_published_is_not():
    W, G = _problem(DGram(), (24, 8), seed=8, dtype=torch.float64)
    A1, s1 = spectral_direction(DGram(), W, G)
    A2, s2 = spectral_direction(DGram(), W, 1e-3 * G)
    assert float((A1 - A2).abs().max()) < 1e-9 and int(s1["msign_calls"]) == int(s2["msign_calls"])
    opts = {"msign_dtype": torch.float32, "tol": 0.0}
    P1, _ = spectral_direction(DGram(), W, G, solver="published", **opts)
    P2, _ = spectral_direction(DGram(), W, 1e-3 * G, solver="published", **opts)
    assert float((P1 - P2).abs().max()) > 1e-3


def test_published_stop_test_fires_when_asked():
    W, G = _problem(Stiefel(), (16, 8), seed=9)
    _, st = spectral_direction(Stiefel(), W, G, solver="published", tol=1.0)
    assert int(st["msign_calls"]) == 1 and bool(st["converged"])
    _, st = spectral_direction(Stiefel(), W, G, solver="published")
    assert int(st["msign_calls"]) == 20 and not bool(st["converged"])  # 1e-6 never fires (as published)


@pytest.mark.parametrize("manifold", CONSTRAINED, ids=lambda m: type(m).__name__)
def test_warm_start_from_the_returned_dual(manifold):
    W, G = _problem(manifold, (24, 8), seed=10)
    _, st = spectral_direction(manifold, W, G)
    A, st2 = spectral_direction(manifold, W, G, dual=st["dual"])
    assert int(st2["msign_calls"]) == 1 and float(st2["residual"]) <= 1e-4
    # a nearby problem (the next optimizer step) needs fewer evaluations than a cold start
    W2 = manifold.retr(W, -0.01 * A)
    G2 = G + 0.05 * torch.randn(24, 8, generator=_gen(11))
    _, cold = spectral_direction(manifold, W2, G2)
    _, warm = spectral_direction(manifold, W2, G2, dual=st["dual"])
    assert float(warm["residual"]) <= 1e-4
    assert int(warm["msign_calls"]) <= int(cold["msign_calls"])


def test_wide_is_the_transpose_of_tall_and_batches_match_singles():
    W, G = _problem(DGram(), (3, 10, 6), seed=12)
    A, st = spectral_direction(DGram(), W, G)
    At, _ = spectral_direction(DGram(), W.mT, G.mT)
    assert float((At - A.mT).abs().max()) < 1e-6
    for i in range(3):
        Ai, sti = spectral_direction(DGram(), W[i], G[i])
        assert float((Ai - A[i]).abs().max()) < 1e-6
        assert int(sti["msign_calls"]) == int(st["msign_calls"][i])


def test_zero_gradient_gives_zero_direction():
    W, G = _problem(Stiefel(), (2, 12, 4), seed=13)
    G[0] = 0
    A, st = spectral_direction(Stiefel(), W, G)
    assert torch.equal(A[0], torch.zeros(12, 4)) and float(A[1].abs().max()) > 0
    assert float(st["residual"][0]) == 0 and int(st["msign_calls"][0]) == 0


def test_spectral_direction_errors_name_the_choices():
    W, G = _problem(Stiefel(), (8, 4))
    with pytest.raises(ValueError, match="valid: gram_newton, tangent, published"):
        spectral_direction(Stiefel(), W, G, solver="admm")
    with pytest.raises(ValueError, match="valid: .*tol"):
        spectral_direction(Stiefel(), W, G, tolerance=1e-3)
    with pytest.raises(ValueError, match="non-finite"):
        spectral_direction(Stiefel(), W, G * float("nan"))
    with pytest.raises(ValueError, match="same shape"):
        spectral_direction(Stiefel(), W, G.T)
    with pytest.raises(TypeError, match="GramManifold"):
        spectral_direction(geoopt.Sphere(), W, G)


# ============================================================================ ManifoldMuon
def _loss_linear(W, C):
    return (W * C).sum()


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("shape", [(16, 8), (8, 16), (12, 12), (3, 10, 6)], ids=str)
def test_step_is_tangent_with_spectral_norm_lr(manifold, shape):
    lr = 1e-3
    W0, C = _problem(manifold, shape, seed=20)
    W = torch.nn.Parameter(W0.clone())
    opt = ManifoldMuon([{"params": [W], "manifold": manifold}], lr=lr, momentum=0.0, shape_scale="none")
    _loss_linear(W, C).backward()
    opt.step()
    D = (W.detach() - W0).double()
    if isinstance(manifold, Euclidean):  # plain Muon: 5 Polar Express steps leave sigma in ~[0.7, 1.2]
        assert 0.7 * lr <= _opnorm(D) <= 1.2 * lr
    else:
        assert _opnorm(D) <= lr * (1 + 1e-4) + 5 * lr**2  # the retraction adds O(lr^2)
        assert _opnorm(D) >= lr * 0.99  # it did move by lr
    # tangent to first order: the constraint map of the step is O(lr^2) (retraction), far below lr
    L = manifold.tangent_constraint(W0.double(), D)
    assert float(L.abs().max()) <= 1e-4 * lr + 10 * lr**2
    assert opt.last_stats["residual_max"] <= 1e-4
    assert opt.last_stats["off_manifold_max"] <= 1e-5
    assert opt.last_stats["n_matrices"] == 1


@pytest.mark.parametrize("manifold", CONSTRAINED, ids=lambda m: type(m).__name__)
def test_parameters_stay_on_the_manifold_for_1000_steps(manifold):
    W = torch.nn.Parameter(manifold.random(2, 10, 4, generator=_gen(21)))
    opt = ManifoldMuon([{"params": [W], "manifold": manifold}], lr=0.05)
    gen = _gen(22)
    worst = 0.0
    for _ in range(1000):
        W.grad = torch.randn(2, 10, 4, generator=gen)
        opt.step()
        worst = max(worst, opt.last_stats["off_manifold_max"])
    ok, reason = manifold.check_point_on_manifold(W.detach(), explain=True)
    assert ok, reason
    assert worst <= 1e-5
    assert float(manifold.constraint_violation(W.detach()).max()) <= 1e-5


@pytest.mark.parametrize("solver", SOLVERS)
def test_stiefel_trace_minimisation_reaches_the_eigenvalue_optimum(solver):
    m, n = 16, 4
    Q = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=_gen(30)))[0]
    evals = torch.linspace(-1.0, 2.0, m, dtype=torch.float64)
    C = (Q * evals) @ Q.T
    optimum = float(scipy.linalg.eigh(C.numpy(), eigvals_only=True)[:n].sum())
    W = torch.nn.Parameter(Stiefel().random(m, n, dtype=torch.float64, generator=_gen(31)))
    opt = ManifoldMuon([{"params": [W], "manifold": Stiefel()}], lr=0.1, momentum=0.9, solver=solver)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.97**k)
    for _ in range(250):
        opt.zero_grad()
        loss = torch.trace(W.T @ C @ W)
        loss.backward()
        opt.step()
        sched.step()
    final = float(torch.trace(W.T @ C @ W).detach())
    assert final - optimum <= 1e-3 * abs(optimum), (final, optimum)
    ok, reason = Stiefel().check_point_on_manifold(W.detach(), explain=True)
    assert ok, reason


def test_dgram_toy_problem_converges():
    # fit a DGram target B (orthogonal columns of norms 0.5..2): the optimum is W = B, loss 0
    B = DGram().random(12, 4, dtype=torch.float64, generator=_gen(40))
    W = torch.nn.Parameter(DGram().random(12, 4, dtype=torch.float64, generator=_gen(41)))
    opt = ManifoldMuon([{"params": [W], "manifold": DGram()}], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.97**k)
    start = float(0.5 * (W - B).square().sum().detach())
    for _ in range(250):
        opt.zero_grad()
        loss = 0.5 * (W - B).square().sum()
        loss.backward()
        opt.step()
        sched.step()
    final = float(0.5 * (W - B).square().sum().detach())
    assert final < 1e-4 * start, (start, final)
    ok, reason = DGram().check_point_on_manifold(W.detach(), explain=True)
    assert ok, reason


def test_euclidean_update_is_muon_with_decoupled_weight_decay_and_shape_scale():
    lr, wd, beta = 0.02, 0.1, 0.95
    W0 = torch.randn(12, 4, generator=_gen(50))
    g = torch.randn(12, 4, generator=_gen(51))
    W = torch.nn.Parameter(W0.clone())
    opt = ManifoldMuon([W], lr=lr, momentum=beta, weight_decay=wd)
    W.grad = g.clone()
    opt.step()
    buf = (1 - beta) * g
    u = (1 - beta) * g + beta * buf
    expect = W0 * (1 - lr * wd) - lr * math.sqrt(12 / 4) * msign(u, "polar_express", steps=5)
    assert float((W.detach() - expect).abs().max()) < 1e-6
    assert opt.last_stats["msign_calls"] == 1 and opt.last_stats["dual_gap_max"] is None


def test_manifold_from_geoopt_parameter_and_from_group():
    P = geoopt.ManifoldParameter(Stiefel().random(10, 4, generator=_gen(60)), manifold=Stiefel())
    E = geoopt.ManifoldParameter(torch.randn(6, 3, generator=_gen(61)))  # geoopt.Euclidean: plain Muon
    T = torch.nn.Parameter(Oblique().random(9, 3, generator=_gen(62)))
    opt = ManifoldMuon([{"params": [P, E]}, {"params": [T], "manifold": Oblique()}], lr=0.05)
    for k in range(5):
        for p in (P, E, T):
            p.grad = torch.randn(p.shape, generator=_gen(70 + k))
        opt.step()
    assert Stiefel().check_point_on_manifold(P.detach().as_subclass(torch.Tensor))
    assert Oblique().check_point_on_manifold(T.detach())
    assert not Stiefel().check_point_on_manifold(E.detach().as_subclass(torch.Tensor))
    assert opt.last_stats["n_matrices"] == 3


def test_batched_same_shape_solves_equal_separate_optimizers():
    ps = [torch.nn.Parameter(DGram().random(10, 4, generator=_gen(80 + i))) for i in range(3)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    together = ManifoldMuon([{"params": ps, "manifold": DGram()}], lr=0.05)
    apart = [ManifoldMuon([{"params": [q], "manifold": DGram()}], lr=0.05) for q in qs]
    for k in range(4):
        for i, (p, q) in enumerate(zip(ps, qs)):
            p.grad = torch.randn(10, 4, generator=_gen(90 + 10 * k + i))
            q.grad = p.grad.clone()
        together.step()
        for o in apart:
            o.step()
    for p, q in zip(ps, qs):
        assert float((p - q).detach().abs().max()) < 1e-6


def _make_model(seed=0):
    gen = _gen(seed)
    return {
        "st": torch.nn.Parameter(Stiefel().random(12, 6, generator=gen)),
        "dg": torch.nn.Parameter(DGram().random(6, 12, generator=gen)),
        "ob": torch.nn.Parameter(Oblique().random(2, 8, 4, generator=gen)),
        "eu": torch.nn.Parameter(torch.randn(8, 8, generator=gen)),
    }


def _make_opt(model):
    return ManifoldMuon([
        {"params": [model["st"]], "manifold": Stiefel()},
        {"params": [model["dg"]], "manifold": DGram(), "solver_options": {"tol": 1e-5}},
        {"params": [model["ob"]], "manifold": Oblique(), "solver": "tangent"},
        {"params": [model["eu"]], "weight_decay": 0.1},
    ], lr=0.03)


def _train(model, opt, steps, seed):
    gen = _gen(seed)
    for _ in range(steps):
        for p in model.values():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_state_dict_round_trip_is_exact():
    a = _make_model()
    opt_a = _make_opt(a)
    _train(a, opt_a, 5, seed=1)
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    b = {k: torch.nn.Parameter(v.detach().clone()) for k, v in a.items()}
    opt_b = _make_opt(b)
    buf.seek(0)
    opt_b.load_state_dict(torch.load(buf, weights_only=True))
    assert "dual" in opt_b.state[b["st"]] and "momentum_buffer" in opt_b.state[b["eu"]]
    _train(a, opt_a, 5, seed=2)
    _train(b, opt_b, 5, seed=2)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    for p in sa["state"]:
        for key in sa["state"][p]:
            assert torch.equal(sa["state"][p][key], sb["state"][p][key])


def test_load_state_dict_refuses_a_different_manifold():
    a = _make_model()
    opt_a = _make_opt(a)
    _train(a, opt_a, 1, seed=3)
    sd = opt_a.state_dict()
    sd["param_groups"][0]["manifold"] = "DGram"
    with pytest.raises(ValueError, match="manifold"):
        _make_opt(_make_model()).load_state_dict(sd)


def test_nonfinite_gradient_is_skipped_counted_and_warned_once():
    model = _make_model()
    opt = _make_opt(model)
    _train(model, opt, 2, seed=4)
    before = {k: v.detach().clone() for k, v in model.items()}
    mom = opt.state[model["dg"]]["momentum_buffer"].clone()
    for p in model.values():
        p.grad = torch.randn(p.shape, generator=_gen(5))
    model["dg"].grad[0, 0] = float("nan")
    model["eu"].grad[1, 1] = float("inf")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert torch.equal(model["dg"].detach(), before["dg"]) and torch.equal(model["eu"].detach(), before["eu"])
    assert torch.equal(opt.state[model["dg"]]["momentum_buffer"], mom)
    assert not torch.equal(model["st"].detach(), before["st"])  # the others moved
    assert opt.last_stats["n_skipped_nonfinite"] == 2 and opt.last_stats["n_matrices"] == 2
    for p in model.values():
        assert bool(torch.isfinite(p).all())
    for p in model.values():
        p.grad = torch.randn(p.shape, generator=_gen(6))
    model["dg"].grad = torch.full_like(model["dg"].grad, float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        opt.step()
    assert opt.last_stats["n_skipped_nonfinite"] == 1 and opt.last_stats["n_skipped_nonfinite_total"] == 3


def test_last_stats_are_json_ready_and_lr_schedulers_work():
    model = _make_model()
    opt = _make_opt(model)
    _train(model, opt, 1, seed=6)
    keys = {"n_matrices", "msign_calls", "iterations_max", "residual_max", "residual_mean", "dual_gap_max",
            "n_unconverged", "off_manifold_max", "n_skipped_nonfinite", "n_skipped_nonfinite_total"}
    assert keys <= set(opt.last_stats) and json.loads(json.dumps(opt.last_stats))
    assert opt.last_stats["n_matrices"] == 4 and opt.last_stats["n_unconverged"] == 0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 if k == 0 else 0.0)
    before = {k: v.detach().clone() for k, v in model.items()}
    _train(model, opt, 1, seed=7)
    mid = {k: v.detach().clone() for k, v in model.items()}
    assert all(not torch.equal(before[k], mid[k]) for k in model)
    sched.step()  # lr = 0 from now on: nothing moves
    _train(model, opt, 1, seed=9)
    assert all(torch.equal(mid[k], model[k].detach()) for k in model)


def test_optimizer_errors_name_the_choices():
    W = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match="valid: gram_newton, tangent, published"):
        ManifoldMuon([W], solver="adam")
    with pytest.raises(ValueError, match="valid: muon, none"):
        ManifoldMuon([W], shape_scale="moonlight")
    with pytest.raises(ValueError, match="valid: tol"):
        ManifoldMuon([W], solver_options={"tolerance": 1})
    with pytest.raises(ValueError, match="AdamW"):
        ManifoldMuon([torch.nn.Parameter(torch.randn(4))])
    with pytest.raises(TypeError, match="GramManifold"):
        ManifoldMuon([geoopt.ManifoldParameter(torch.randn(4, 3), manifold=geoopt.Sphere())])
    with pytest.raises(TypeError, match="GramManifold"):
        ManifoldMuon([{"params": [W], "manifold": "stiefel"}])


# ============================================================================ benchmark CLI
def test_bench_optimizer_cli_writes_table_and_json(tmp_path, capsys):
    from geomtrain import bench

    out = tmp_path / "bench.json"
    code = bench.main(["optimizer", "--shapes", "24x8", "8x8", "--manifolds", "stiefel", "dgram", "--scales", "1e-3",
                       "--quiet", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "gram_newton_warm" in text and "x muon" in text
    result = json.loads(out.read_text())
    assert result["command"].startswith("geomtrain bench optimizer")
    rows = {(r["manifold"], r["solver"]): r for r in result["rows"]}
    assert set(rows) == {(m, s) for m in ("stiefel", "dgram") for s in bench.OPT_SOLVERS}
    for m in ("stiefel", "dgram"):
        assert rows[m, "muon"]["x_muon"] == 1.0
        assert rows[m, "gram_newton"]["residual"] <= 1e-4
        assert abs(rows[m, "gram_newton"]["gap"]) < 1e-3
        assert rows[m, "published"]["msign_calls"] >= 2
    assert len(result["matrices"]) == 4 and "cpu" in result["machine"]


def test_bench_cli_rejects_bad_input(capsys):
    from geomtrain import bench

    assert bench.main(["optimizer", "--shapes", "24by8"]) == 2
    assert "OUTxIN" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["optimiser"])
    assert "invalid choice" in capsys.readouterr().err
