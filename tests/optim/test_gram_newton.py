"""The exact solver (gram_newton.py): accuracy, warm starts, float64 escalation, trace, relative_tol, host syncs."""

import pathlib

import pytest
import torch
from conftest import BlockGram
from optim_cases import CONSTRAINED, MANIFOLDS, SHAPES, objective, opnorm, problem, reference, seeded

from geomtrain.optim import spectral_direction, tangent_residual
from manifolds import BoundedDGram, DGram, Euclidean, Stiefel, msign


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_default_solver_is_tangent_unit_norm_and_converged(manifold, shape):
    W, G = problem(manifold, shape, seed=1)
    A, st = spectral_direction(manifold, W, G)
    assert A.shape == W.shape and A.dtype == W.dtype
    assert st.residual.shape == W.shape[:-2]
    res = tangent_residual(manifold, W.double(), A.double())
    assert float(res.max()) <= 1.5e-4, res  # the stop test (1e-4) holds on the returned A
    assert float((res - st.residual).abs().max()) < 1e-5  # and the reported residual is the true one
    # converged to tol, or (degenerate near-square duals, max_iter reached) polished onto the
    # tangent space and into the unit ball, with a small certified gap
    unconv = ~st.converged.reshape(-1)
    if bool(unconv.any()):
        assert float(st.residual.reshape(-1)[unconv].max()) < 1e-6
        assert float(st.dual_gap.reshape(-1)[unconv].max()) < 1e-2
    if isinstance(manifold, Euclidean):  # plain Muon: 5 Polar Express steps, roughly unitary
        assert torch.equal(A, msign(G, "polar_express", steps=5))
        assert 0.7 < opnorm(A) < 1.2
    else:
        # float32 inputs are solved in float32: the polar factors come from float32 eigendecompositions of
        # n x n Grams. Measured over 64 matrices per shape (seeds 0-3, batches of 2-16): sigma_max - 1 <= 2.2e-6
        # for n >= 8, but up to 1.5e-3 at 10x6, where M's smallest eigenvalues at the optimum fall to ~1e-4
        # lambda_max (not escalated: the first evaluation is better conditioned) and the rounding of M couples
        # them with weights r_i r_j ~ 1/lambda that the floor phi does not cover. So: the 1e-2 below
        # n = 8, 1e-4 from n = 8.
        assert opnorm(A) <= 1 + (1e-2 if min(W.shape[-2:]) < 8 else 1e-4)
        assert opnorm(A) >= 1 - 1e-3  # unit spectral norm, not a shrunken direction


@pytest.mark.parametrize("manifold", CONSTRAINED + [BlockGram(), BoundedDGram(2.0)], ids=lambda m: type(m).__name__)
def test_default_solver_matches_a_high_accuracyreference(manifold):
    W, G = problem(manifold, (24, 8), seed=3, dtype=torch.float64)
    A, st = spectral_direction(manifold, W, G)
    ref, ref_st = reference(manifold, W, G)
    opt = float(objective(G, ref))
    assert abs(float(objective(G, A)) - opt) <= 1e-3 * opt  # objective within 0.1%
    assert float(ref_st.dual_gap) < 1e-6  # the reference certifies itself
    # the gap bounds the suboptimality of a feasible A; A is feasible to 1e-4 only, so it may dip below 0
    assert -1e-5 <= float(st.dual_gap) < 1e-3


@pytest.mark.parametrize("manifold", CONSTRAINED, ids=lambda m: type(m).__name__)
def test_weak_duality_bounds_every_feasible_direction(manifold):
    # ||G + W S||_* >= <G, A> for every S and every feasible A: the reference optimum is below any
    # dual value, and a feasible direction (projected, scaled into the ball) is below the optimum.
    W, G = problem(manifold, (20, 6), seed=4, dtype=torch.float64)
    ref, _ = reference(manifold, W, G)
    Gh = G / G.norm()
    opt = float((Gh * ref).sum())
    mask = manifold.gram_mask(6, W)
    for seed in range(5):
        S = torch.randn(6, 6, dtype=torch.float64, generator=seeded(seed))
        S = 0.3 * (S + S.T) * mask
        assert float(torch.linalg.matrix_norm(Gh + W @ S, ord="nuc")) >= opt - 1e-9
    B = manifold.proju(W, torch.randn(20, 6, dtype=torch.float64, generator=seeded(9)))
    B = B / opnorm(B)
    assert float((Gh * B).sum()) <= opt + 1e-9


def test_square_stiefel_training_momenta_are_solved_in_float64_with_a_tight_certificate():
    # A centred gradient with singular values down to 1e-5 (like the attn.c_proj momenta of `mini`): in float32
    # the smoothing floor 4 eps lambda_max gives up 2.1e-4 of the objective (measured), so the entry is redone
    # in float64 (2 evaluations). The optimum is exact: ||skew(W^T G_hat)||_* by a float64 SVD. The returned
    # direction must be within 1e-4 of it (the Huber tau costs ~3e-5 here), and the certificate (float64, at
    # the small tau_c) must bound the true gap from above, within 1e-6: the certificate is for ||Z||_*, exact
    # up to the orthogonality of the float32 W (~1e-7), and within 2x + 1e-6 of it.
    n = 64
    gen = seeded(93)
    W = Stiefel().random(n, n, generator=gen)
    G = torch.randn(n, n, generator=gen) @ torch.diag(torch.logspace(0, -5, n))
    G = G - G.mean(dim=1, keepdim=True)
    A, st = spectral_direction(Stiefel(), W, G)
    Gh = G.double() / G.double().norm()
    K = W.double().T @ Gh
    opt = float(torch.linalg.svdvals(0.5 * (K - K.T)).sum())
    true_gap = (opt - float((A.double() * Gh).sum())) / opt
    assert int(st.evaluations) == 2 and A.dtype == torch.float32
    assert true_gap <= 1e-4
    assert true_gap - 1e-6 <= float(st.dual_gap) <= 2 * true_gap + 1e-6
    A32, _ = spectral_direction(Stiefel(), W, G, compute_dtype=torch.float32)  # what float32 alone gives
    assert (opt - float((A32.double() * Gh).sum())) / opt > 1e-4


@pytest.mark.parametrize("manifold", CONSTRAINED, ids=lambda m: type(m).__name__)
def test_warm_start_from_the_returned_dual(manifold):
    W, G = problem(manifold, (24, 8), seed=10)
    _, st = spectral_direction(manifold, W, G)
    A, st2 = spectral_direction(manifold, W, G, dual=st.dual)
    assert int(st2.evaluations) == 1 and float(st2.residual) <= 1e-4
    # a nearby problem (the next optimizer step) needs fewer evaluations than a cold start
    W2 = manifold.retr(W, -0.01 * A)
    G2 = G + 0.05 * torch.randn(24, 8, generator=seeded(11))
    _, cold = spectral_direction(manifold, W2, G2)
    _, warm = spectral_direction(manifold, W2, G2, dual=st.dual)
    assert float(warm.residual) <= 1e-4
    assert int(warm.evaluations) <= int(cold.evaluations)


def test_warm_start_from_the_multiplier_on_consecutive_training_momenta():
    # Two consecutive steps (30, 31) of one 384x128 `c_attn` matrix of an all-stiefel `mini` run (block 64,
    # seed 0): in training the multiplier S* moves less than the tangent start S_T (the Nesterov momentum moves
    # ~17% per step), so the warm start begins at the previous S*, not at S_T plus the previous S* - S_T.
    # Measured on this pair: cold 13 evaluations, the correction start 12, the multiplier start 9.
    import numpy as np

    from geomtrain.optim.gram import GramDual
    from geomtrain.optim.numerics import normalise

    f = np.load(pathlib.Path(__file__).parents[1] / "fixtures" / "stiefel_momenta_384x128_steps30_31.npz")
    W0, G0, W1, G1 = (torch.from_numpy(f[k]) for k in ("W0", "G0", "W1", "G1"))

    def tangent_start(W, G):
        return GramDual(Stiefel(), W.double(), normalise(G.double())[0], torch.float64, 1e-3).tangent_start()

    _, prev = spectral_direction(Stiefel(), W0, G0)
    assert torch.equal(prev.dual, prev.multiplier)  # the warm-start state is the multiplier itself
    _, cold = spectral_direction(Stiefel(), W1, G1)
    A, warm = spectral_direction(Stiefel(), W1, G1, dual=prev.dual)
    corrected = prev.multiplier.double() - tangent_start(W0, G0) + tangent_start(W1, G1)
    _, old = spectral_direction(Stiefel(), W1, G1, dual=corrected.float())
    assert bool(warm.converged) and float(tangent_residual(Stiefel(), W1.double(), A.double())) <= 1e-4
    assert int(warm.evaluations) <= int(old.evaluations) - 2
    assert int(warm.evaluations) <= int(cold.evaluations) - 3


@pytest.mark.parametrize(
    "manifold, shape",
    [(Stiefel(), (48, 16)), (Stiefel(), (16, 16)), (DGram(), (48, 16)), (DGram(), (16, 16)), (DGram(), (16, 48))],
    ids=["stiefel-tall", "stiefel-square", "dgram-tall", "dgram-square", "dgram-wide"],
)
def test_every_step_of_a_warm_started_run_meets_the_targets(manifold, shape):
    # The targets on every matrix, every step (float32): residual RMS <= 1e-4, ||A||_op <= 1 + 1e-2.
    W, G = problem(manifold, shape, seed=50)
    dual = None
    gen = seeded(51)
    for _ in range(8):
        A, st = spectral_direction(manifold, W, G, dual=dual)
        assert float(tangent_residual(manifold, W.double(), A.double())) <= 1e-4
        assert opnorm(A) <= 1 + 1e-2
        dual = st.dual
        W = manifold.retr(W, -0.05 * A)
        G = 0.9 * G + 0.1 * torch.randn(shape, generator=gen)


def test_warm_start_far_from_the_problem_restarts_cold():
    # the residual monitor: a multiplier from an unrelated problem must not cost more than a few evaluations
    W, G = problem(Stiefel(), (48, 16), seed=60)
    _, cold = spectral_direction(Stiefel(), W, G)
    bad = 50 * torch.randn(16, 16, generator=seeded(61))
    A, warm = spectral_direction(Stiefel(), W, G, dual=bad + bad.T)
    assert float(warm.residual) <= 1e-4
    assert int(warm.evaluations) <= int(cold.evaluations) + 1


@pytest.mark.parametrize("manifold", [Stiefel(), DGram()], ids=lambda m: type(m).__name__)
def test_low_rank_float32_gradients_are_solved_as_well_as_in_float64(manifold):
    # Training gradients are nearly low rank: M = Y^T Y then has eigenvalues below float32's resolution,
    # and the solver must escalate to float64 rather than stall or return a loose certificate.
    W = manifold.random(96, 32, generator=seeded(80))
    U, V = torch.randn(96, 3, generator=seeded(81)), torch.randn(32, 3, generator=seeded(82))
    G = U @ V.T + 1e-4 * torch.randn(96, 32, generator=seeded(83))
    A, st = spectral_direction(manifold, W, G)
    A64, st64 = spectral_direction(manifold, W.double(), G.double())
    assert bool(st.converged) and float(tangent_residual(manifold, W.double(), A.double())) <= 1e-4
    assert opnorm(A) <= 1 + 1e-4
    assert abs(float(objective(G, A)) - float(objective(G, A64))) <= 1e-4 * float(objective(G, A64))
    assert float(st.dual_gap) <= 1e-3


@pytest.mark.parametrize(
    "manifold, shape",
    [(Stiefel(), (96, 32)), (DGram(), (96, 32)), (Stiefel(), (32, 32))],
    ids=["stiefel-tall", "dgram-tall", "stiefel-square"],
)
def test_escalation_flag_sends_the_next_solve_to_float64_without_the_probe(monkeypatch, manifold, shape):
    # A nearly low-rank float32 gradient (as in training) escalates to float64. Passed back with the warm start,
    # stats.escalated skips the float32 probe of the next step's solve: the same float64 solve from the same
    # start (so the same direction), one or two evaluations fewer, no float32 dual formed.
    from geomtrain.optim import gram_newton

    m, n = shape
    W = manifold.random(m, n, generator=seeded(80))
    U, V = torch.randn(m, 3, generator=seeded(81)), torch.randn(n, 3, generator=seeded(82))
    G = U @ V.T + 1e-4 * torch.randn(m, n, generator=seeded(83))
    A, st = spectral_direction(manifold, W, G)
    assert st.escalated.dtype == torch.bool and bool(st.escalated)
    W2 = manifold.retr(W, -0.02 * A)
    G2 = G + 0.1 * (torch.randn(m, 3, generator=seeded(84)) @ V.T)  # the next step: same structure
    A_probe, probed = spectral_direction(manifold, W2, G2, dual=st.dual)
    dtypes, real = [], gram_newton.GramDual

    def spy(manifold, T, Gh, dtype, *args):
        dtypes.append(dtype)
        return real(manifold, T, Gh, dtype, *args)

    monkeypatch.setattr(gram_newton, "GramDual", spy)
    A_hint, hinted = spectral_direction(manifold, W2, G2, dual=st.dual, escalate=st.escalated)
    assert all(dt == torch.float64 for dt in dtypes)  # (square Stiefel forms no GramDual at all)
    assert torch.equal(A_hint, A_probe) and bool(hinted.escalated)
    assert int(probed.evaluations) - 2 <= int(hinted.evaluations) < int(probed.evaluations)


def test_well_conditioned_problems_are_not_flagged_and_a_false_flag_changes_nothing():
    W, G = problem(Stiefel(), (48, 16), seed=85)
    A, st = spectral_direction(Stiefel(), W, G)
    assert not bool(st.escalated)
    A2, st2 = spectral_direction(Stiefel(), W, G, dual=st.dual, escalate=st.escalated)
    A3, st3 = spectral_direction(Stiefel(), W, G, dual=st.dual)
    assert torch.equal(A2, A3) and int(st2.evaluations) == int(st3.evaluations)


def test_precision_is_judged_at_the_tangent_start_for_warm_starts(monkeypatch):
    # A warm start sits near the (degenerate) optimum, where lambda_min(M) is small for every problem: the
    # float64 escalation must be decided by the problem (at S_T), else well-conditioned problems are solved
    # in float64 at every warm-started step. The benchmark's "layernorm" gradients (a power law with the
    # null direction of LayerNorm) are solved in float32 cold; judged at the warm start they were escalated.
    import geomtrain.optim.gram_newton as gram_newton
    from geomtrain.bench.optimizer import synthetic_gradient

    dtypes = []
    real = gram_newton.GramDual

    def spy(manifold, T, Gh, dtype, *args):
        dtypes.append(dtype)
        return real(manifold, T, Gh, dtype, *args)

    for manifold in (Stiefel(), DGram()):
        gen = seeded(98)
        W = manifold.random(96, 32, generator=gen)
        G = synthetic_gradient((96, 32), "layernorm", gen, torch.float32, "cpu")
        fresh = synthetic_gradient((96, 32), "layernorm", gen, torch.float32, "cpu")
        A, cold = spectral_direction(manifold, W, G)
        W2, G2 = manifold.retr(W, -0.02 * A), 0.95 * G + 0.05 * fresh
        monkeypatch.setattr(gram_newton, "GramDual", spy)
        dtypes.clear()
        A2, warm = spectral_direction(manifold, W2, G2, dual=cold.dual)
        monkeypatch.setattr(gram_newton, "GramDual", real)
        assert dtypes == [torch.float32]  # not escalated
        assert bool(warm.converged) and float(tangent_residual(manifold, W2.double(), A2.double())) <= 1e-4
        assert float(warm.dual_gap) <= 1e-3


@pytest.mark.parametrize("manifold", [Stiefel(), DGram()], ids=lambda m: type(m).__name__)
def test_trace_records_every_evaluation_of_the_first_matrix(manifold):
    # trace=True: residual and objective after each evaluation of the first matrix. The returned direction is
    # the evaluation of lowest residual, so (float64, tall: no polish) the smallest traced residual is the
    # reported one and the objective traced there is <G_hat, A> of the returned A (both to rounding, 1e-10).
    W, G = problem(manifold, (2, 48, 16), seed=95, dtype=torch.float64)
    A, st = spectral_direction(manifold, W, G, trace=True)
    tr = st.trace
    assert len(tr["residual"]) == len(tr["objective"]) == int(st.evaluations[0])
    best = min(range(len(tr["residual"])), key=tr["residual"].__getitem__)
    assert abs(tr["residual"][best] - float(st.residual[0])) <= 1e-10
    assert abs(tr["objective"][best] - float(objective(G[0], A[0]))) <= 1e-10
    assert tr["residual"][0] > 10 * tr["residual"][best]  # it iterated: the trace is not one point


@pytest.mark.parametrize("shape", [(48, 16), (16, 16)], ids=["dgram-tall", "dgram-square"])
def test_relative_tol_makes_the_solve_invariant_to_the_scale_of_w(shape):
    # The DGram tangent space does not change when W is scaled, but L_W(A) does: with the default absolute tol a
    # matrix with column norms c is solved to about tol / c relative. relative_tol measures RMS(L_W(A)) / c
    # (c = RMS column norm): the same evaluations and the same direction (to the tolerance) at any scale, and the
    # reported residual is the true one divided by c.
    from geomtrain.config import parse_solver_options

    W, G = problem(DGram(), shape, seed=70)
    results = []
    for scale in (1.0, 0.05, 20.0):
        Ws = W * scale
        A, st = spectral_direction(DGram(), Ws, G, relative_tol=True)
        c = float(Ws.norm()) / min(shape) ** 0.5
        assert abs(float(tangent_residual(DGram(), Ws.double(), A.double())) / c - float(st.residual)) <= 1e-6
        assert bool(st.converged) and float(st.residual) <= 1e-4
        results.append((A, int(st.evaluations)))
    for A, evaluations in results[1:]:
        assert abs(evaluations - results[0][1]) <= 1
        assert float((A - results[0][0]).abs().max()) <= 1e-3
    _, absolute = spectral_direction(DGram(), 0.05 * W, G)
    assert int(absolute.evaluations) < results[1][1]  # the absolute test stops sooner on small weights
    assert parse_solver_options(["relative_tol=true"], "exact") == {"relative_tol": True}


def _training_like_gradient(shape, gen):
    # the power-law spectrum and the centred rows of training momenta (see bench optimizer --spectrum layernorm)
    B, m, n = shape
    U = torch.linalg.qr(torch.randn(B, m, n, generator=gen))[0]
    V = torch.linalg.qr(torch.randn(B, n, n, generator=gen))[0]
    G = (U * torch.arange(1, n + 1, dtype=torch.float32) ** -1.0) @ V.mT
    return G - G.mean(-1, keepdim=True)


@pytest.mark.parametrize(
    "manifold, shape, gradient",
    [
        (Stiefel(), (3, 96, 32), "gaussian"),
        (DGram(), (3, 96, 32), "gaussian"),
        (DGram(), (2, 40, 32), "gaussian"),  # near-square: the Douglas-Rachford fallback
        (DGram(), (3, 32, 32), "gaussian"),  # square: solve_square_dgram
        (Stiefel(), (2, 128, 32), "training"),
        (DGram(), (2, 48, 32), "training"),
    ],
    ids=["stiefel", "dgram", "dgram-near-square", "dgram-square", "stiefel-training", "dgram-near-square-training"],
)
def test_solver_loops_synchronise_with_the_host_about_once_per_evaluation(manifold, shape, gradient):
    # On a GPU every tensor read on the host (bool(), float(), nonzero, a boolean-mask index) waits for the
    # queued kernels. The iterations keep their batch compact and decide which entries go on with one
    # nonzero per iteration; on this CPU the float32 eigendecomposition adds one finiteness check each
    # (evaluations, plus the certificate's and the polish's). A batch whose precision differs per entry is
    # solved in two parts, each with its own loop, so the bound counts the evaluations of the whole batch:
    # 2 per evaluation plus 30 once-per-solve reads (input check, precision probe, fallback, polish, and the
    # statistics' copies to the host: 5-11 .cpu() calls, counted since the counter sees .cpu(); measured at most
    # 25 beyond 2 per evaluation, on the warm Stiefel training case).
    # Before the compact loops these twelve solves took 18-913 (6-30 per evaluation of the batch: a boolean
    # index per update of each piece of state); now 5-118.
    from geomtrain.bench.syncs import count_host_syncs

    gen = seeded(7)
    W = manifold.random(*shape, generator=gen)
    G = torch.randn(*shape, generator=gen) if gradient == "gaussian" else _training_like_gradient(shape, gen)
    stats = None
    for warm in (False, True):
        options = {"dual": stats.dual, "escalate": stats.escalated} if warm else {}
        with count_host_syncs() as counts:
            A, stats = spectral_direction(manifold, W, G, **options)
        evaluations = int(stats.evaluations.sum())
        assert sum(counts.values()) <= 2 * evaluations + 30, (warm, evaluations, dict(counts))
        assert float(tangent_residual(manifold, W.double(), A.double()).max()) <= 1.5e-4
