"""The products-only solvers that carry a multiplier, ``dual_ascent`` and ``admm``: feasible whatever
the multiplier, near the exact optimum, warm-startable, products only."""

from __future__ import annotations

import pytest
import torch
from products_checks import (
    FORBIDDEN,
    MANIFOLDS,
    SHAPES,
    count_operators,
    exact_optimum,
    feasibility,
    objective_ratio,
    problem,
)

from geomtrain.optim import admm, dual_ascent

# (solve(manifold, W, G, S, options) -> (A, S), default options) of each solver
SOLVERS = {
    "dual_ascent": (dual_ascent.dual_ascent_direction, dual_ascent.OPTIONS),
    "admm": (admm.admm_direction, admm.OPTIONS),
}

# float32: L_W(A) is a sum of m products of O(1/sqrt(m)) entries, rounding ~ sqrt(m) * 6e-8 < 1e-6 at m <= 96;
# 1e-5 leaves a factor 10. ||A||_op: the bound's margin covers rounding; 1e-6 is float32 SVD's own error.
TANGENT_TOL, OP_TOL = 1e-5, 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("solver", list(SOLVERS))
@pytest.mark.parametrize("kind", list(MANIFOLDS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("steps", [1, 2])
def test_feasible_and_near_optimum(solver, kind, shape, steps):
    solve, options = SOLVERS[solver]
    W, G = problem(kind, *shape, seed=sum(shape))
    A, S = solve(MANIFOLDS[kind](), W, G, None, {**options, "steps": steps})
    residual, op = feasibility(kind, W, A)
    assert residual < TANGENT_TOL and op <= 1 + OP_TOL, (residual, op)
    assert S.shape == (shape[1], shape[1]) and torch.isfinite(S).all() and torch.equal(S, S.mT)
    opt, gap = exact_optimum(kind, W, G)
    ratio = objective_ratio(G, A, opt)
    # feasible, so never above the certified optimum; measured 0.80-0.92 of OPT with 5 Polar Express steps on
    # these log-spread spectra: 0.7 catches a wrong sign or scale of the multiplier step (then < 0.5)
    assert 0.7 <= ratio <= 1 + gap + 1e-5, ratio


@pytest.mark.parametrize("solver", list(SOLVERS))
@pytest.mark.parametrize("kind", ["stiefel", "dgram"])
def test_carried_multiplier_stays_feasible_and_finite(solver, kind):
    solve, options = SOLVERS[solver]
    W, G = problem(kind, 64, 16, seed=11)
    S = None
    for step in range(8):  # the streaming use: the state of one solve starts the next, G drifting
        G = G + 0.2 * torch.randn(G.shape, generator=torch.Generator().manual_seed(step))
        A, S = solve(MANIFOLDS[kind](), W, G, S, dict(options))
        residual, op = feasibility(kind, W, A)
        assert residual < TANGENT_TOL and op <= 1 + OP_TOL and torch.isfinite(S).all()
    opt, _ = exact_optimum(kind, W, G)
    assert objective_ratio(G, A, opt) >= 0.7


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_zero_gradient_gives_zero_and_keeps_the_multiplier(solver):
    solve, options = SOLVERS[solver]
    W, G = problem("dgram", 48, 16, seed=1)
    _, S = solve(MANIFOLDS["dgram"](), W, G, None, dict(options))
    Wb, Gb, Sb = torch.stack([W, W]), torch.stack([G, torch.zeros_like(G)]), torch.stack([S, S])
    A, S_new = solve(MANIFOLDS["dgram"](), Wb, Gb, Sb, dict(options))
    assert torch.equal(A[1], torch.zeros_like(W)) and torch.equal(S_new[1], S)
    assert A[0].abs().max() > 0 and not torch.equal(S_new[0], S)


@pytest.mark.parametrize("solver", list(SOLVERS))
@pytest.mark.parametrize("kind", list(MANIFOLDS))
def test_products_only(solver, kind):
    solve, options = SOLVERS[solver]
    W, G = problem(kind, 96, 32, seed=5)
    with count_operators() as counts:
        solve(MANIFOLDS[kind](), W, G, None, {**options, "steps": 2})
    assert not set(counts) & set(FORBIDDEN), counts
    assert counts["bmm"] + counts["mm"] > 0  # the counter sees the solve
