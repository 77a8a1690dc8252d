"""`ManifoldMuon(certify_every=N)`: the exact float64 dual gap of the direction the configured solver returned,
on steps N, 2N, ... only (`geomtrain.optim.certificate.certify`)."""

import pytest
import torch

from geomtrain.optim import ManifoldMuon
from geomtrain.optim.certificate import certify
from manifolds import DGram, Stiefel


def _optimizer(solver, certify_every, dtype=torch.float64, **options):
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(Stiefel().random(2, 24, 8, dtype=dtype, generator=gen))]
    params.append(torch.nn.Parameter(DGram().random(32, 8, dtype=dtype, generator=gen)))
    groups = [dict(params=[params[0]], manifold=Stiefel()), dict(params=[params[1]], manifold=DGram())]
    return params, ManifoldMuon(groups, lr=0.01, solver=solver, solver_options=options, certify_every=certify_every)


def _step(params, opt, gen):
    for p in params:
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
    opt.step()
    return opt.last_stats


def test_the_tangent_solvers_direction_has_a_positive_finite_gap():
    params, opt = _optimizer("tangent", 1)
    stats = _step(params, opt, torch.Generator().manual_seed(0))
    gap, residual = stats["certified_gap_max"], stats["certified_residual_max"]
    # tangent is neither tangent nor optimal on these tall matrices: both are well above rounding
    assert 1e-3 < gap < 1 and 1e-3 < residual < 10


def test_the_exact_solvers_gap_is_within_its_tolerance():
    # the default tol (RMS tangent residual) also bounds the gap on these tall problems: the projection onto the
    # tangent space moves the objective by about the residual; float64 rounding (~1e-13) is far below
    tol = 1e-4
    params, opt = _optimizer("exact", 1, tol=tol)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # cold, then warm-started
        stats = _step(params, opt, gen)
        assert 0 <= stats["certified_residual_max"] <= tol
        assert -tol <= stats["certified_gap_max"] <= tol


def test_the_certificate_runs_on_steps_n_2n_only_and_resumes_the_count():
    params, opt = _optimizer("tangent", 3, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    certified = [_step(params, opt, gen)["certified_gap_max"] is not None for _ in range(7)]
    assert certified == [False, False, True, False, False, True, False]
    again = _optimizer("tangent", 3, dtype=torch.float32)[1]
    again.load_state_dict(opt.state_dict())
    assert again.step_count == 7
    params_off, off = _optimizer("tangent", 0)
    assert _step(params_off, off, gen)["certified_gap_max"] is None


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_certify_every_must_be_a_non_negative_integer(bad):
    with pytest.raises(ValueError, match="certify_every must be an integer >= 0"):
        _optimizer("tangent", bad)


def test_the_certificate_bounds_the_true_gap_of_any_feasible_direction():
    # a feasible A (tangent, unit operator norm) below the optimum: the certified gap is at least its true gap
    # against the exact optimum (both float64; 1e-10 covers the exact solve's tolerance times its scale)
    gen = torch.Generator().manual_seed(4)
    W = Stiefel().random(3, 24, 8, dtype=torch.float64, generator=gen)
    G = torch.randn(W.shape, dtype=torch.float64, generator=gen)
    A = Stiefel().proju(W, torch.randn(W.shape, dtype=torch.float64, generator=gen))
    A = A / torch.linalg.matrix_norm(A, ord=2)[:, None, None]
    gap, residual = certify(Stiefel(), W, G, A)
    Gh = G / G.norm(dim=(-2, -1), keepdim=True)
    from geomtrain.optim import spectral_direction

    A_star = spectral_direction(Stiefel(), W, G, tol=1e-9)[0]
    true = ((A_star - A) * Gh).sum(dim=(-2, -1)) / (A_star * Gh).sum(dim=(-2, -1))
    # |<G_hat, A>| <= OPT <= U for a feasible A, so the gap lies in [0, 2]
    assert bool((residual < 1e-12).all()) and bool((gap >= true - 1e-6).all()) and bool((gap <= 2).all())
