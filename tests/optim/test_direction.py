"""spectral_direction, the entry point: every solver, Euclidean, wide/batched/zero inputs, input and option checks."""

import re

import geoopt
import pytest
import torch
from optim_cases import CONSTRAINED, objective, opnorm, problem, reference, seeded

from geomtrain.optim import SOLVER_OPTIONS, SOLVERS, spectral_direction
from manifolds import DGram, Euclidean, Stiefel, msign


@pytest.mark.parametrize("solver", SOLVERS)
def test_euclidean_is_plain_muon_for_every_solver(solver):
    W, G = problem(Euclidean(), (16, 8), seed=2)
    A, st = spectral_direction(Euclidean(), W, G, solver=solver)
    # plain Muon's msign with the solver's msign settings: 5 Polar Express steps, except published's bf16 and
    # split_tangent's 6 steps
    opts = SOLVER_OPTIONS[solver]
    expect = msign(G, "polar_express", steps=opts["msign_steps"], compute_dtype=opts["msign_dtype"])
    assert torch.equal(A, expect)
    assert int(st.evaluations) == 1 and float(st.residual) == 0.0


@pytest.mark.parametrize("manifold", CONSTRAINED, ids=lambda m: type(m).__name__)
def test_every_solver_returns_a_reasonable_direction(manifold):
    W, G = problem(manifold, (24, 8), seed=5)
    ref, _ = reference(manifold, W, G)
    opt = float(objective(G, ref))
    for solver in SOLVERS:
        A, st = spectral_direction(manifold, W, G, solver=solver)
        assert opnorm(A) < 1.25  # 5-step Polar Express is only roughly unitary
        assert float(objective(G, A)) > 0.8 * opt
        assert float(st.residual) < 0.2
        assert int(st.evaluations) >= 1


def test_wide_is_the_transpose_of_tall_and_batches_match_singles():
    W, G = problem(DGram(), (3, 10, 6), seed=12)
    A, st = spectral_direction(DGram(), W, G)
    At, _ = spectral_direction(DGram(), W.mT, G.mT)
    assert float((At - A.mT).abs().max()) < 1e-6
    for i in range(3):
        Ai, sti = spectral_direction(DGram(), W[i], G[i])
        assert float((Ai - A[i]).abs().max()) < 1e-6
        assert int(sti.evaluations) == int(st.evaluations[i])


def test_zero_gradient_gives_zero_direction():
    W, G = problem(Stiefel(), (2, 12, 4), seed=13)
    G[0] = 0
    A, st = spectral_direction(Stiefel(), W, G)
    assert torch.equal(A[0], torch.zeros(12, 4)) and float(A[1].abs().max()) > 0
    assert float(st.residual[0]) == 0 and int(st.evaluations[0]) == 0


def test_spectral_direction_errors_name_the_choices():
    W, G = problem(Stiefel(), (8, 4))
    with pytest.raises(ValueError, match="valid: exact, tangent, published"):
        spectral_direction(Stiefel(), W, G, solver="no_such_solver")
    with pytest.raises(ValueError, match="valid: .*tol"):
        spectral_direction(Stiefel(), W, G, tolerance=1e-3)
    with pytest.raises(ValueError, match="non-finite"):
        spectral_direction(Stiefel(), W, G * float("nan"))
    with pytest.raises(ValueError, match="same shape"):
        spectral_direction(Stiefel(), W, G.T)
    with pytest.raises(ValueError, match="W has non-finite"):
        spectral_direction(Stiefel(), W * float("nan"), G)
    Wd = DGram().random(8, 4, generator=seeded(4))
    Wd[:, 2] = 0
    with pytest.raises(ValueError, match="zero column"):  # before: a LinAlgError from inside eigh
        spectral_direction(DGram(), Wd, G)
    with pytest.raises(ValueError, match="zero column"):  # wide: the constraint is on the rows
        spectral_direction(DGram(), Wd.T.contiguous(), G.T.contiguous())

    # a W that was never projected is refused (before: a DGram direction at a raw point came back "converged")
    raw = torch.randn(3, 40, 8, generator=seeded(5))
    Graw = torch.randn(3, 40, 8, generator=seeded(6))
    for man in (Stiefel(), DGram()):
        with pytest.raises(ValueError, match=f"W is not on {type(man).__name__} .*projx"):
            spectral_direction(man, raw, Graw)
        A, st = spectral_direction(man, man.projx(raw), Graw)  # projected: solved
        assert bool(st.converged.all())
        A, st = spectral_direction(man, man.projx(raw).half(), Graw.half())  # float16 rounding is not "off"
        assert bool(torch.isfinite(A).all())
    with pytest.raises(ValueError, match="floating-point"):
        spectral_direction(Stiefel(), W.long(), G)
    with pytest.raises(TypeError, match="GramManifold"):
        spectral_direction(geoopt.Sphere(), W, G)


@pytest.mark.parametrize(
    "solver, option, value, must",
    [
        ("exact", "tol", 0.0, "> 0"),
        ("exact", "tol", float("nan"), "finite"),
        ("exact", "max_iter", 0, ">= 1"),
        ("exact", "anderson", -1, ">= 0"),
        ("exact", "anderson", 2.5, "integer"),
        ("exact", "smoothing", -1e-3, ">= 0"),
        ("exact", "compute_dtype", torch.float16, "torch.float32 or torch.float64"),
        ("exact", "warm_reset", -1.0, "> 0"),
        ("exact", "cg_iters", 0, ">= 1"),
        ("exact", "relative_tol", "yes", "True or False"),
        ("exact", "msign", "foo", "polar_express"),  # also checked where only Euclidean would use it
        ("tangent", "msign_steps", 0, ">= 1"),
        ("published", "alpha", 0.0, "> 0"),
        ("published", "tol", -1.0, ">= 0"),
    ],
)
def test_bad_option_values_are_one_line_errors_before_any_work(solver, option, value, must):
    # before: tol <= 0 or NaN ran to max_iter and polished every direction, anderson=-1 raised from deep inside
    # torch, msign="foo" and smoothing < 0 were taken without a word
    W, G = problem(DGram(), (8, 4))
    with pytest.raises(ValueError, match=rf"{option}=.*{solver}.*must be .*{re.escape(must)}") as err:
        spectral_direction(DGram(), W, G, solver=solver, **{option: value})
    assert "\n" not in str(err.value)


def test_warm_start_state_of_another_problem_or_non_finite_is_refused():
    W, G = problem(DGram(), (3, 8, 4))
    _, st = spectral_direction(DGram(), W, G)
    with pytest.raises(ValueError, match=r"dual must be a float tensor of shape \(3, 4, 4\).*got \(2, 4, 4\)"):
        spectral_direction(DGram(), W, G, dual=st.dual[:2])
    with pytest.raises(ValueError, match=r"escalate must be a bool tensor of shape \(3,\)"):
        spectral_direction(DGram(), W, G, dual=st.dual, escalate=st.escalated.float())
    bad = st.dual.clone()
    bad[1, 0, 1] = float("nan")
    with pytest.raises(ValueError, match="dual has non-finite entries.*dual=None"):
        spectral_direction(DGram(), W, G, dual=bad)
    A, st2 = spectral_direction(DGram(), W, G, dual=st.dual, escalate=st.escalated)  # its own state is fine
    assert bool(st2.converged.all())


@pytest.mark.parametrize(
    "manifold, shape, solver",
    [
        (DGram(), (16, 16), "gram_newton"),
        (DGram(), (24, 8), "gram_newton"),
        (Stiefel(), (24, 8), "gram_newton"),
        (Stiefel(), (24, 8), "published"),
    ],
    ids=["dgram-square", "dgram-tall", "stiefel-tall", "published"],
)
def test_warm_start_state_passed_in_is_not_modified(manifold, shape, solver):
    # A caller's tensor is never written to: the square DGram solver iterates on its warm-start state.
    W, G = problem(manifold, shape, seed=96)
    _, st = spectral_direction(manifold, W, G, solver=solver)
    W2, G2 = W, G + 0.3 * torch.randn(shape, generator=seeded(97))
    dual = st.dual.clone()
    spectral_direction(manifold, W2, G2, solver=solver, dual=dual)
    assert torch.equal(dual, st.dual)
