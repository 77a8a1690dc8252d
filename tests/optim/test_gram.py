"""gram.py: the smoothed polar weights, the certified dual gap, the float32 DGram step."""

import pytest
import torch
from conftest import BlockGram
from optim_cases import objective, problem, seeded

from geomtrain.optim import spectral_direction
from manifolds import DGram, Stiefel


def test_smoothed_polar_weights_clip_singular_values_below_tau():
    # R = (max(M, tau^2))^(-1/2) (floor 0, float64): singular values of Y R are exactly min(sigma / tau, 1),
    # so singular values above tau are not smoothed at all (the Huber form of the nuclear norm).
    from geomtrain.optim.gram import inverse_sqrt_weights

    gen = seeded(90)
    Q1, _ = torch.linalg.qr(torch.randn(20, 8, dtype=torch.float64, generator=gen))
    Q2, _ = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64, generator=gen))
    sigma = torch.tensor([1.0, 0.5, 0.2, 1e-2, 3e-3, 1e-3, 1e-4, 0.0], dtype=torch.float64)
    Y = Q1 @ torch.diag(sigma) @ Q2.T
    tau = 2e-3
    lam, V = torch.linalg.eigh(Y.T @ Y)
    r = inverse_sqrt_weights(lam, tau**2, 0.0)
    sv = torch.linalg.svdvals(Y @ (V * r) @ V.T)
    expected = torch.sort(torch.clamp(sigma / tau, max=1.0), descending=True).values
    assert torch.allclose(sv, expected, atol=1e-9)  # float64 eigh of Y^T Y: ~1e-16 * sigma_max^2 / tau^2


def _dual_value_exact(W, G, S):
    r"""||G_hat + W S||_* by an exact float64 SVD at the reported multiplier S."""
    W, G = W.double(), G.double()
    Gh = G / G.norm()
    return float(torch.linalg.matrix_norm(Gh + W @ S.double(), ord="nuc")), Gh


@pytest.mark.parametrize(
    "manifold, shape",
    [(Stiefel(), (24, 8)), (DGram(), (24, 8)), (DGram(), (16, 16)), (DGram(), (20, 16)), (BlockGram(), (12, 8))],
    ids=["stiefel-tall", "dgram-tall", "dgram-square", "dgram-near-square", "blockgram"],
)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_certified_gap_is_a_true_upper_bound(manifold, shape, dtype):
    # The reported gap must bound (1) the gap at the returned dual, evaluated exactly (slack: float64
    # rounding, 1e-10; float32 inputs are solved in float32, whose Gram products round at ~1e-7
    # relative: 1e-6), and (2) the relative suboptimality against a float64 reference optimum (slack
    # 1e-8 more: the reference is feasible to 1e-9 only, so its objective may overshoot OPT by ~1e-9).
    slack = 1e-10 if dtype == torch.float64 else 1e-6
    for seed in range(3):
        W, G = problem(manifold, shape, seed=40 + seed, dtype=dtype)
        A, st = spectral_direction(manifold, W, G, tol=1e-8 if dtype == torch.float64 else 1e-4)
        S = st.multiplier  # an admissible multiplier: symmetric, P(S) = S
        assert torch.equal(manifold.project_gram(S), S) and float((S - S.mT).abs().max()) <= 1e-6 * float(S.abs().max())
        U, Gh = _dual_value_exact(W, G, st.multiplier)
        prim = float((Gh * A.double()).sum())
        assert float(st.dual_gap) >= (U - prim) / U - slack
        ref, ref_st = spectral_direction(manifold, W.double(), G.double(), tol=1e-9, max_iter=400, smoothing=1e-6)
        if bool(ref_st.converged):  # (square DGram references may stop unconverged: no OPT to compare with)
            opt = float(objective(G, ref))
            assert float(st.dual_gap) >= (opt - prim) / opt - slack - 1e-8
        assert float(st.dual_gap) < 1e-2  # and it is informative, not a vacuous bound


@pytest.mark.parametrize("manifold", [Stiefel(), DGram()], ids=lambda m: type(m).__name__)
def test_centred_gradients_are_solved_exactly_with_a_tight_certificate(manifold):
    # Training gradients of matrices fed by (or feeding) a LayerNorm have an exact null vector, the ones
    # vector: the dual optimum is degenerate (Y* loses rank there). The Huber smoothing loses at most
    # tau/4 = smoothing / (4 sqrt(n)) = 4e-5 of the objective per such singular value (here 1, against an
    # objective of ~3): the direction must be within 1e-4 of a float64 reference (tolerance 1e-4 of the
    # residual included), and the certificate, taken at a smaller tau in float64, within 2x (+1e-5) of the
    # exact dual gap at the returned multiplier (the solver's tau would add up to tau/2 per zero singular value);
    # slack 1e-6 below it: the float32 input is normalised in float32 (as in test_certified_gap_is_a_true_upper_bound).
    n = 32
    W = manifold.random(96, n, generator=seeded(91))
    G = torch.randn(96, n, generator=seeded(92)) @ torch.diag(torch.logspace(0, -3, n))
    G = G - G.mean(dim=1, keepdim=True)  # G 1 = 0, as after a LayerNorm
    A, st = spectral_direction(manifold, W, G)
    # the reference (float64, tau 1e-6) may end polished on this degenerate dual: its certified gap bounds it
    ref, ref_st = spectral_direction(manifold, W.double(), G.double(), tol=1e-9, max_iter=400, smoothing=1e-6)
    assert float(ref_st.dual_gap) <= 1e-5
    opt, prim = float(objective(G, ref)), float(objective(G, A))
    assert bool(st.converged) and abs(opt - prim) <= 1e-4 * opt
    U, Gh = _dual_value_exact(W, G, st.multiplier)
    exact_gap = (U - float((Gh * A.double()).sum())) / U
    assert exact_gap - 1e-6 <= float(st.dual_gap) <= 2 * exact_gap + 1e-5


def test_dgram_float64_solves_take_float32_steps_at_the_same_cost(monkeypatch):
    # The frozen-R step only steers the iteration (its fixed point and the stop test are the float64
    # evaluation's), so rounding it to float32 must cost no evaluations on the ill-conditioned duals that
    # are solved in float64. A step that is off by a factor of 2 costs 1-5 more per entry here (checked).
    from geomtrain.bench.optimizer import synthetic_gradient
    from geomtrain.optim import gram

    gen = torch.Generator().manual_seed(7)
    W = DGram().random(4, 192, 64, generator=gen, dtype=torch.float64)
    G = torch.stack([synthetic_gradient((192, 64), "layernorm", gen, torch.float64, "cpu") for _ in range(4)])
    assert gram.DGRAM_STEP_DTYPE == torch.float32
    A32, st32 = spectral_direction(DGram(), W, G)
    monkeypatch.setattr(gram, "DGRAM_STEP_DTYPE", torch.float64)
    A64, st64 = spectral_direction(DGram(), W, G)
    assert bool(st32.converged.all()) and bool(st64.converged.all())
    assert int(st64.evaluations.min()) >= 8  # the iteration is exercised, not solved at the start
    assert bool(((st32.evaluations - st64.evaluations).abs() <= 1).all())
    # both stop at residual <= tol = 1e-4: their objectives agree to the accuracy the stop test fixes
    assert torch.allclose(objective(G, A32), objective(G, A64), rtol=1e-4)
