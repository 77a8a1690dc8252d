"""Solver ``split_tangent``: feasible by construction, optimal where the split is, products only."""

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
from geomtrain.optim.products import BOUNDS, scale_to_ball
from geomtrain.optim.projected_tangent import projected_tangent_direction
from geomtrain.optim.split_tangent import OPTIONS, split_tangent_direction

# as for projected_tangent (test_projected_tangent.py): float32 rounding of L_W(A) is < 1e-6 at m <= 96, so
# 1e-5 leaves a factor 10; ||A||_op <= 1 up to float32 SVD's own error
TANGENT_TOL, OP_TOL = 1e-5, 1e-6
SPLIT = ("stiefel", "dgram")
EXACT_MSIGN = {**OPTIONS, "msign": "svd"}  # the msigns exact: what is left is the construction's own gap
# and the spectral-norm bound's slack where every singular value is 1: 1/4 of n^(1/512) - 1 on beta, so about
# 1e-3 on the length at these n (scale_to_ball's near_unit bound); 2e-3 allows it twice
SLACK = 2e-3


@pytest.mark.parametrize("kind", SPLIT)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sub_steps", [0, 2])
def test_feasible_and_near_optimum(kind, shape, sub_steps):
    W, G = problem(kind, *shape, seed=sum(shape))
    A = split_tangent_direction(MANIFOLDS[kind](), W, G, {**OPTIONS, "sub_steps": sub_steps})
    residual, op = feasibility(kind, W, A)
    assert residual < TANGENT_TOL and op <= 1 + OP_TOL, (residual, op)
    opt, gap = exact_optimum(kind, W, G)
    # feasible, so never above the certified optimum; on these log-spread problems the default 6 Polar Express
    # steps measured 0.90-0.99 of OPT: 0.8 catches a broken split, angle or scale
    assert 0.8 <= objective_ratio(G, A, opt) <= 1 + gap + 1e-5


@pytest.mark.parametrize("shape", [(64, 64), (24, 24)])
def test_square_stiefel_is_the_optimum(shape):
    # square: no complement, and msign(skew(W^T G)) is skew, so W msign(skew(W^T G)) is the exact direction
    W, G = problem("stiefel", *shape, seed=2)
    W, G = W.double(), G.double()
    A = split_tangent_direction(MANIFOLDS["stiefel"](), W, G, EXACT_MSIGN)
    opt, gap = exact_optimum("stiefel", W, G)
    assert 1 - SLACK <= objective_ratio(G, A, opt) <= 1 + gap + 1e-6


@pytest.mark.parametrize("kind", SPLIT)
def test_a_gradient_in_the_complement_is_solved(kind):
    # G = (I - U U^T) Z: the square part is zero, and msign of the rest is the optimum (its nuclear norm is the
    # dual bound at a zero multiplier)
    W, Z = problem(kind, 48, 12, seed=4)
    W, Z = W.double(), Z.double()
    U = W / W.norm(dim=-2, keepdim=True)
    G = Z - U @ (U.mT @ Z)
    A = split_tangent_direction(MANIFOLDS[kind](), W, G, EXACT_MSIGN)
    opt, gap = exact_optimum(kind, W, G)
    assert 1 - SLACK <= objective_ratio(G, A, opt) <= 1 + gap + 1e-6


@pytest.mark.parametrize("kind", SPLIT)
def test_longer_than_projected_tangent_on_tall_matrices(kind):
    # the point of the split: the complement's msign is not cut by a projection, so the direction keeps
    # more of the spectral budget (its Frobenius norm) and more of the objective than one projection does
    W, G = problem(kind, 96, 24, seed=6)
    opts = {**OPTIONS, "msign_steps": 8}
    A = split_tangent_direction(MANIFOLDS[kind](), W, G, opts)
    P = projected_tangent_direction(MANIFOLDS[kind](), W, G, opts)  # the same 8 msign steps
    assert A.norm() > P.norm() and (G * A).sum() > (G * P).sum()


@pytest.mark.parametrize("kind", SPLIT)
def test_zero_gradient_gives_zero(kind):
    W, _ = problem(kind, 48, 16, seed=1)
    A = split_tangent_direction(MANIFOLDS[kind](), W, torch.zeros_like(W), dict(OPTIONS))
    assert torch.equal(A, torch.zeros_like(W))


def test_batched_equals_one_by_one():
    pairs = [problem("dgram", 40, 8, seed=s) for s in range(3)]
    W, G = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    A = split_tangent_direction(MANIFOLDS["dgram"](), W, G, dict(OPTIONS))
    for i, (Wi, Gi) in enumerate(pairs):
        Ai = split_tangent_direction(MANIFOLDS["dgram"](), Wi, Gi, dict(OPTIONS))
        assert torch.allclose(A[i], Ai, atol=1e-6)


@pytest.mark.parametrize("kind", list(MANIFOLDS))
@pytest.mark.parametrize("sub_steps", [0, 2])
def test_products_only(kind, sub_steps):
    W, G = problem(kind, 96, 32, seed=5)
    with count_operators() as counts:
        spectral_direction(MANIFOLDS[kind](), W, G, solver="split_tangent", sub_steps=sub_steps)
    assert not set(counts) & set(FORBIDDEN), counts
    assert counts["bmm"] + counts["mm"] > 0  # the counter sees the solve


def test_oblique_is_projected_tangent():
    W, G = problem("oblique", 40, 10, seed=8)
    A, stats = spectral_direction(MANIFOLDS["oblique"](), W, G, solver="split_tangent", msign_steps=6)
    B, _ = spectral_direction(MANIFOLDS["oblique"](), W, G, solver="projected_tangent", msign_steps=6)
    assert torch.equal(A, B) and int(stats.evaluations) == 1


@pytest.mark.parametrize("spectrum", ["ones", "zeros and ones", "spread"])
def test_scale_to_ball_bounds_are_upper_bounds_and_near_unit_is_tight_at_ones(spectrum):
    # near_unit: sigma_max^2 <= (1 + sqrt(1 + 4 beta)) / 2 from lambda(lambda - 1) <= beta; tight (0.2%) where the
    # singular values are 0 or 1 +- 1e-4, where the Schatten bound alone is loose by ~1%; loose where spread
    g = torch.Generator().manual_seed(0)
    n = 128
    Q, _ = torch.linalg.qr(torch.randn(2 * n, n, dtype=torch.float64, generator=g))
    s = {
        "ones": 1 + 1e-4 * torch.randn(n, dtype=torch.float64, generator=g),
        "zeros and ones": torch.cat([torch.zeros(n // 4), 1 + 1e-4 * torch.rand(3 * n // 4, generator=g)]).double(),
        "spread": torch.logspace(0, -3, n, dtype=torch.float64),
    }[spectrum]
    X = (Q * s) @ torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))[0]
    scaled = {b: float(torch.linalg.matrix_norm(scale_to_ball(X, b), ord=2)) for b in BOUNDS}
    assert all(v <= 1 + 1e-12 for v in scaled.values()), scaled
    if spectrum == "spread":
        assert scaled["both"] == pytest.approx(scaled["schatten"])
    else:
        assert scaled["near_unit"] >= 0.998 and scaled["both"] >= 0.998 and scaled["schatten"] < 0.995, scaled


def test_scale_to_ball_names_its_bounds():
    with pytest.raises(ValueError, match="valid: schatten, near_unit, both"):
        scale_to_ball(torch.ones(3, 2), "tight")


def test_sub_steps_count_their_msigns_on_dgram_only():
    for kind, square in (("dgram", 1 + 2 * 3), ("stiefel", 1)):  # Stiefel's square part is solved by one msign
        W, G = problem(kind, 48, 12, seed=9)
        _, stats = spectral_direction(MANIFOLDS[kind](), W, G, solver="split_tangent", sub_steps=3)
        assert int(stats.evaluations) == square + 1, kind


@pytest.mark.parametrize("kind", SPLIT)
def test_gram_space_complement_is_the_tall_one(kind):
    # space="gram" computes msign(R) as R F(R^T R) from the n x n Gram matrix: in float64 the same iteration
    # reordered (measured 1e-12 relative; 1e-10 leaves a factor 100); in float32 within 1e-2 (3e-3 measured on
    # a log-spread spectrum: the Gram matrix squares the small singular values' rounding), as tangent as the
    # tall path (the span of W is projected out of B explicitly in both)
    W, G = problem(kind, 96, 24, seed=16, dtype=torch.float64)
    A = split_tangent_direction(MANIFOLDS[kind](), W, G, dict(OPTIONS))
    B = split_tangent_direction(MANIFOLDS[kind](), W, G, {**OPTIONS, "space": "tall"})
    assert float((A - B).norm() / B.norm()) < 1e-10
    A32 = split_tangent_direction(MANIFOLDS[kind](), W.float(), G.float(), dict(OPTIONS))
    residual, op = feasibility(kind, W.float(), A32)
    assert residual < TANGENT_TOL and op <= 1 + OP_TOL, (residual, op)
    assert float((A32.double() - B).norm() / B.norm()) < 1e-2


def test_space_is_validated():
    W, G = problem("stiefel", 24, 8, seed=9)
    with pytest.raises(ValueError, match="one of gram, tall"):
        spectral_direction(MANIFOLDS["stiefel"](), W, G, solver="split_tangent", space="wide")
