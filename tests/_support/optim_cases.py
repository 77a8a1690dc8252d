"""Shared cases of the optimizer tests: manifolds, random problems, a float64 reference solve."""

import torch

from geomtrain.optim import spectral_direction
from manifolds import DGram, Euclidean, Oblique, Stiefel

MANIFOLDS = [Stiefel(), DGram(), Oblique(), Euclidean()]
CONSTRAINED = MANIFOLDS[:3]
SHAPES = [(16, 8), (8, 16), (12, 12), (3, 10, 6)]


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def problem(manifold, shape, seed=0, dtype=torch.float32, scale=1.0):
    W = manifold.random(*shape, dtype=dtype, generator=seeded(seed))
    G = scale * torch.randn(*shape, dtype=dtype, generator=seeded(seed + 100))
    return W, G


def opnorm(A):
    return float(torch.linalg.matrix_norm(A.double(), ord=2).max())


def reference(manifold, W, G):
    """High-accuracy solution: float64, tolerance 1e-9, smoothing 1e-6 (at most ~1e-6 of the objective).

    Degenerate (square DGram) duals may stop at ``max_iter`` polished onto the tangent space: then the
    certified gap (a true upper bound) must be below 1e-6."""
    A, st = spectral_direction(manifold, W.double(), G.double(), tol=1e-9, max_iter=400, smoothing=1e-6)
    assert bool((st.converged | (st.dual_gap < 1e-6)).all()), st
    return A, st


def objective(G, A):
    """<G/|G|_F, A> per matrix."""
    G = G.double()
    return (G * A.double()).sum((-2, -1)) / G.norm(dim=(-2, -1))
