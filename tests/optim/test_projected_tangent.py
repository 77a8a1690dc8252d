"""Solver ``projected_tangent``: feasible by construction, near the exact optimum, products only."""

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

from geomtrain.optim.baselines import MSIGN_OPTIONS
from geomtrain.optim.projected_tangent import OPTIONS, projected_tangent_direction

# float32: L_W(A) is a sum of m products of O(1/sqrt(m)) entries, rounding ~ sqrt(m) * 6e-8 < 1e-6 at m <= 96;
# 1e-5 leaves a factor 10. ||A||_op: the bound's margin covers rounding; 1e-6 is float32 SVD's own error.
TANGENT_TOL, OP_TOL = 1e-5, 1e-6


@pytest.mark.parametrize("kind", list(MANIFOLDS))
@pytest.mark.parametrize("shape", SHAPES)
def test_feasible_and_near_optimum(kind, shape):
    W, G = problem(kind, *shape, seed=sum(shape))
    A = projected_tangent_direction(MANIFOLDS[kind](), W, G, dict(OPTIONS))
    residual, op = feasibility(kind, W, A)
    assert residual < TANGENT_TOL and op <= 1 + OP_TOL, (residual, op)
    opt, gap = exact_optimum(kind, W, G)
    ratio = objective_ratio(G, A, opt)
    # feasible, so never above the certified optimum; 5 Polar Express steps on log-spread spectra measured
    # 0.85-0.90 of OPT (8 steps: 0.88-0.99): 0.75 catches a broken projection or scale (then < 0.5)
    assert 0.75 <= ratio <= 1 + gap + 1e-5, ratio


def test_op_norm_is_at_most_one_at_every_msign_accuracy():
    W, G = problem("stiefel", 64, 16, seed=3)
    for steps in (1, 2, 5, 12):  # msign from very rough (sigma up to ~2) to exact
        A = projected_tangent_direction(MANIFOLDS["stiefel"](), W, G, {**OPTIONS, "msign_steps": steps})
        assert feasibility("stiefel", W, A)[1] <= 1 + OP_TOL


@pytest.mark.parametrize("kind", list(MANIFOLDS))
def test_zero_gradient_gives_zero(kind):
    W, _ = problem(kind, 48, 16, seed=1)
    A = projected_tangent_direction(MANIFOLDS[kind](), W, torch.zeros_like(W), dict(OPTIONS))
    assert torch.equal(A, torch.zeros_like(W))


def test_batched_equals_one_by_one():
    pairs = [problem("dgram", 40, 8, seed=s) for s in range(3)]
    W, G = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    A = projected_tangent_direction(MANIFOLDS["dgram"](), W, G, dict(OPTIONS))
    for i, (Wi, Gi) in enumerate(pairs):
        Ai = projected_tangent_direction(MANIFOLDS["dgram"](), Wi, Gi, dict(OPTIONS))
        assert torch.allclose(A[i], Ai, atol=1e-6)


@pytest.mark.parametrize("kind", list(MANIFOLDS))
def test_products_only(kind):
    W, G = problem(kind, 96, 32, seed=5)
    with count_operators() as counts:
        projected_tangent_direction(MANIFOLDS[kind](), W, G, dict(MSIGN_OPTIONS))
    assert not set(counts) & set(FORBIDDEN), counts
    assert counts["bmm"] + counts["mm"] > 0  # the counter sees the solve
