"""The baseline solvers (baselines.py): tangent and published."""

import torch
from optim_cases import problem

from geomtrain.optim import spectral_direction
from manifolds import DGram, Stiefel


def test_square_stiefel_tangent_projection_is_already_optimal():
    # At a square orthogonal W the tangent space is {W Omega}, closed under msign: every solver
    # agrees with the exact msign of the projected G.
    W, G = problem(Stiefel(), (10, 10), seed=6, dtype=torch.float64)
    A, st = spectral_direction(Stiefel(), W, G)
    B, _ = spectral_direction(Stiefel(), W, G / G.norm(), solver="tangent", msign="svd")
    assert int(st.evaluations) == 1
    assert float((A - B).abs().max()) < 1e-6  # the smoothing (1e-4 sigma_rms) is the only difference


def test_published_first_iterate_is_the_tangent_solution_on_stiefel():
    W, G = problem(Stiefel(), (16, 8), seed=7, dtype=torch.float64)
    opts = {"msign": "svd", "msign_steps": 5, "msign_dtype": None}
    A, st = spectral_direction(Stiefel(), W, G, solver="published", steps=1, **opts)
    B, _ = spectral_direction(Stiefel(), W, G, solver="tangent", **opts)
    assert int(st.evaluations) == 1
    assert float((A - B).abs().max()) < 1e-10


def test_gram_newton_is_scale_invariant_and_published_is_not():
    W, G = problem(DGram(), (24, 8), seed=8, dtype=torch.float64)
    A1, s1 = spectral_direction(DGram(), W, G)
    A2, s2 = spectral_direction(DGram(), W, 1e-3 * G)
    assert float((A1 - A2).abs().max()) < 1e-9 and int(s1.evaluations) == int(s2.evaluations)
    opts = {"msign_dtype": torch.float32, "tol": 0.0}
    P1, _ = spectral_direction(DGram(), W, G, solver="published", **opts)
    P2, _ = spectral_direction(DGram(), W, 1e-3 * G, solver="published", **opts)
    assert float((P1 - P2).abs().max()) > 1e-3


def test_published_stop_test_fires_when_asked():
    W, G = problem(Stiefel(), (16, 8), seed=9)
    _, st = spectral_direction(Stiefel(), W, G, solver="published", tol=1.0)
    assert int(st.evaluations) == 1 and bool(st.converged)
    _, st = spectral_direction(Stiefel(), W, G, solver="published")
    assert int(st.evaluations) == 20 and not bool(st.converged)  # 1e-6 never fires (as published)
