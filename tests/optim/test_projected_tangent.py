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

from geomtrain.optim import spectral_direction
from geomtrain.optim.products import scale_to_ball, tangent_part
from geomtrain.optim.projected_tangent import OPTIONS, projected_tangent_direction
from manifolds import msign

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
@pytest.mark.parametrize("rounds", [1, 3])
def test_products_only(kind, rounds):
    W, G = problem(kind, 96, 32, seed=5)
    with count_operators() as counts:
        projected_tangent_direction(MANIFOLDS[kind](), W, G, {**OPTIONS, "rounds": rounds})
    assert not set(counts) & set(FORBIDDEN), counts
    assert counts["bmm"] + counts["mm"] > 0  # the counter sees the solve


@pytest.mark.parametrize("kind", list(MANIFOLDS))
def test_rounds_stay_feasible_and_count_their_msigns(kind):
    W, G = problem(kind, 64, 16, seed=7)
    for rounds in (1, 2, 4):
        A, stats = spectral_direction(MANIFOLDS[kind](), W, G, solver="projected_tangent", rounds=rounds)
        residual, op = feasibility(kind, W, A)
        assert residual < TANGENT_TOL and op <= 1 + OP_TOL, (rounds, residual, op)
        assert int(stats.evaluations) == rounds


def test_rounds_alternate_projections():
    """With the exact polar factor (msign ``svd``: the nearest matrix with unit singular values), each round is
    one step of alternating projections, so the distance between the tangent iterate and its polar factor never
    grows: ||X_k - msign(X_k)||_F is non-increasing (up to float64 rounding)."""
    W, G = problem("dgram", 64, 16, seed=11, dtype=torch.float64)
    m = MANIFOLDS["dgram"]()
    X, gaps = tangent_part(m, W, G / G.norm()), []
    for _ in range(5):
        Q = msign(X, "svd")
        X_next = tangent_part(m, W, Q)
        gaps.append(float((X_next - Q).norm()))
        X = X_next
    assert all(b <= a + 1e-12 for a, b in zip(gaps, gaps[1:])), gaps
    assert gaps[-1] < gaps[0]  # and it does move: the first projection thins the spectrum, later rounds fill it
    opts = {**OPTIONS, "msign": "svd", "rounds": 5}  # the solver's 5 rounds are these 5 iterations, then the scale
    A = projected_tangent_direction(m, W, G, opts)
    assert torch.allclose(A, scale_to_ball(X), atol=1e-12)


def test_rounds_must_be_a_positive_integer():
    W, G = problem("stiefel", 24, 8, seed=1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rounds"):
            spectral_direction(MANIFOLDS["stiefel"](), W, G, solver="projected_tangent", rounds=bad)
