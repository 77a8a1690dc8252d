"""geomtrain.optim.products: the spectral-norm bounds that make a products-only direction feasible."""

from __future__ import annotations

import pytest
import torch
from products_checks import MANIFOLDS, feasibility, problem

from geomtrain.optim.filled_split import OPTIONS, unsplit_direction
from geomtrain.optim.products import BOUNDS, scale_to_ball

OP_TOL = 1e-6  # float32 SVD's own error on ||A||_op


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


@pytest.mark.parametrize("kind", list(MANIFOLDS))
def test_the_bound_holds_at_every_msign_accuracy(kind):
    # the guaranteed bound, not the msign, makes ||A||_op <= 1: from a very rough msign (sigma up to ~2) to exact
    W, G = problem(kind, 64, 16, seed=3)
    for steps in (1, 2, 5, 12):
        A = unsplit_direction(MANIFOLDS[kind](), W, G, {**OPTIONS, "msign_steps": steps})
        assert feasibility(kind, W, A)[1] <= 1 + OP_TOL, steps
    assert torch.equal(unsplit_direction(MANIFOLDS[kind](), W, torch.zeros_like(G), dict(OPTIONS)), torch.zeros_like(W))
