"""``last_stats["length_mean"]``/``["length_min"]``: the RMS singular value of the step's directions."""

from __future__ import annotations

import torch

from geomtrain.optim import ManifoldMuon, spectral_direction
from geomtrain.optim.muon_step import direction_length
from manifolds import DGram, Oblique, Stiefel
from manifolds.base import to_tall


def test_direction_length_is_the_rms_singular_value():
    A = torch.randn(3, 40, 12, dtype=torch.float64)
    rms = torch.linalg.svdvals(A).square().mean(-1).sqrt()
    assert torch.allclose(direction_length(A), rms, rtol=1e-12)


def _step(solver: str, manifold, shapes=((48, 16), (16, 48), (48, 16))) -> tuple[dict, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(manifold.random(*s, dtype=torch.float64, generator=gen)) for s in shapes]
    grads = [torch.randn(*s, dtype=torch.float64, generator=gen) for s in shapes]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    W0 = [p.detach().clone() for p in params]
    opt = ManifoldMuon([{"params": params, "manifold": manifold}], solver=solver, momentum=0.0, nesterov=False)
    opt.step()
    return opt.last_stats, [spectral_direction(manifold, w, g, solver=solver)[0] for w, g in zip(W0, grads)]


def test_exact_directions_use_the_whole_spectral_budget():
    # Gaussian gradients: the optimum is non-degenerate, every singular value of A is 1 up to the solver's
    # tolerance (1e-4 residual), so the RMS singular value is 1 to well within 1e-3
    for manifold in (Stiefel(), DGram()):
        stats, _ = _step("exact", manifold)
        assert abs(stats["length_mean"] - 1) < 1e-3 and abs(stats["length_min"] - 1) < 1e-3, stats


def test_unsplit_lengths_are_those_of_its_directions():
    # the statistic is the mean and the minimum over the matrices of ||A||_F / sqrt(n) of the directions the
    # solver returns (the same solves repeated outside the optimizer, float64: equal to rounding)
    stats, directions = _step("filled_split", Oblique())  # Oblique: the projected, rescaled unsplit direction
    lengths = [float(direction_length(to_tall(a)[None])[0]) for a in directions]
    assert abs(stats["length_mean"] - sum(lengths) / len(lengths)) < 1e-9
    assert abs(stats["length_min"] - min(lengths)) < 1e-9
    assert stats["length_mean"] < 0.99  # a projected, rescaled direction does not fill the ball


def test_no_matrix_solved_gives_none():
    p = torch.nn.Parameter(Stiefel().random(12, 4))
    opt = ManifoldMuon([{"params": [p], "manifold": Stiefel()}])
    opt.step()  # no gradient: nothing solved
    assert opt.last_stats["length_mean"] is None and opt.last_stats["length_min"] is None
