"""Solver ``filled_split``: feasible by construction, near the exact optimum, the whole spectral budget."""

from __future__ import annotations

import math

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
from geomtrain.optim.certificate import certify
from geomtrain.optim.filled_split import (
    OPTIONS,
    chebyshev_matrix,
    chebyshev_moments,
    filled_split_direction,
    gram_filled_split_direction,
    sqrt_coefficients,
    unsplit_direction,
)

# float32 rounding of L_W(A) is < 1e-6 at these sizes, so 1e-5 leaves a factor 10; ||A||_op <= 1 up to float32
# SVD's own error
TANGENT_TOL, OP_TOL = 1e-5, 1e-6
SPLIT = ("stiefel", "dgram")
EXACT_MSIGN = {**OPTIONS, "msign": "svd"}
COLD = {**OPTIONS, "carry": False}  # the joint square part from N(G), then the fill


def symmetric_spectrum(n: int, low: float, high: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(M, eigenvalues, eigenvectors)``: a float64 symmetric ``n x n`` matrix, eigenvalues spread in [low, high]."""
    g = torch.Generator().manual_seed(seed)
    V, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))
    lam = low + (high - low) * torch.rand(n, dtype=torch.float64, generator=g)
    return (V * lam) @ V.mT, lam, V


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 0.9])
def test_the_fill_is_the_matrix_square_root(alpha):
    # Chebyshev interpolation of sqrt(1 - a^2 (x+1)/2) on [-1, 1]: the branch point sits at b = 2/a^2 - 1 (1.47
    # at a = 0.9), inside a Bernstein ellipse of radius rho = b + sqrt(b^2 - 1) >= 2.5, so degree 24 is exact to
    # about rho^-24 <= 2e-10 (measured on a grid: 5e-13); checked against the eigendecomposition's square root
    n = 24
    M, lam, V = symmetric_spectrum(n, 0.0, 1.0, seed=1)
    X = 2 * M - torch.eye(n, dtype=torch.float64)
    P = chebyshev_matrix(X, sqrt_coefficients(torch.tensor(alpha, dtype=torch.float64), 24))
    want = (V * (1 - alpha**2 * lam).sqrt()) @ V.mT
    assert torch.allclose(P, want, atol=1e-10)


def test_the_fill_at_alpha_one_is_close():
    # a = 1: the branch point is the interval's end; degree 8 is then accurate to 0.06 only (measured), near
    # eigenvalue 1, where the direction's final bound absorbs it
    M, lam, V = symmetric_spectrum(16, 0.0, 1.0, seed=2)
    X = 2 * M - torch.eye(16, dtype=torch.float64)
    P = chebyshev_matrix(X, sqrt_coefficients(torch.tensor(1.0, dtype=torch.float64), 8))
    assert torch.allclose(P, (V * (1 - lam).clamp_min(0).sqrt()) @ V.mT, atol=0.1)


def test_moments_are_traces_of_chebyshev_polynomials():
    # tr(S T_j(X)) with T_j(cos t) = cos(j t), through X's eigendecomposition
    n, degree = 20, 7
    M, lam, V = symmetric_spectrum(n, -1.0, 1.0, seed=3)
    S, _, _ = symmetric_spectrum(n, 0.0, 2.0, seed=4)
    mu = chebyshev_moments(S, M, degree)
    t = torch.arccos(lam.clamp(-1, 1))
    want = torch.stack([torch.trace(S @ ((V * torch.cos(j * t)) @ V.mT)) for j in range(degree + 1)])
    assert mu.shape == (degree + 1,) and torch.allclose(mu, want, atol=1e-10)


def test_coefficients_are_batched_per_alpha():
    alphas = torch.tensor([[0.1, 0.7], [0.3, 1.0]], dtype=torch.float64)
    table = sqrt_coefficients(alphas, 6)
    assert table.shape == (2, 2, 7)
    assert torch.allclose(table[1, 0], sqrt_coefficients(torch.tensor(0.3, dtype=torch.float64), 6))
    # at a = 0 the function is 1: the constant term alone
    assert torch.allclose(sqrt_coefficients(torch.tensor(0.0), 6), torch.eye(7, dtype=torch.float64)[0], atol=1e-14)


@pytest.mark.parametrize("kind", SPLIT)
@pytest.mark.parametrize("shape", SHAPES)
def test_feasible_and_at_least_the_unsplit_direction(kind, shape):
    # P_T(msign(P_T G)) scaled into the ball spends its budget on one msign of the whole tangent part; the split
    # fills what the square part leaves, so it reaches at least that objective up to the grid's spacing and the
    # fill's interpolation (2e-3); measured 0.89-1.00 of OPT here
    W, G = problem(kind, *shape, seed=sum(shape))
    A, alpha, _ = filled_split_direction(MANIFOLDS[kind](), W, G, COLD)
    residual, op = feasibility(kind, W, A)
    assert residual < TANGENT_TOL and op <= 1 + OP_TOL, (residual, op)
    opt, gap = exact_optimum(kind, W, G)
    unsplit = objective_ratio(G, unsplit_direction(MANIFOLDS[kind](), W, G, dict(OPTIONS)), opt)
    assert unsplit - 2e-3 <= objective_ratio(G, A, opt) <= 1 + gap + 1e-5
    assert 0.0 <= float(alpha) <= 1.0


@pytest.mark.parametrize("kind", SPLIT)
def test_every_singular_value_near_one_on_tall_matrices(kind):
    # A^T A = a^2 K^T K + P Q^T Q P = I where the complement has full column rank (m - n >= n here): with exact
    # msigns the only shortfall is the fill's interpolation (< 1e-3 at degree 8 for a <= 0.9) and the bound's
    # slack (~1e-3), so every singular value is within 1% of 1
    W, G = problem(kind, 96, 24, seed=6)
    W, G = W.double(), G.double()
    A, alpha, _ = filled_split_direction(MANIFOLDS[kind](), W, G, EXACT_MSIGN)
    s = torch.linalg.svdvals(A)
    assert float(alpha) < 0.95 and s.min() > 0.99 and s.max() <= 1 + 1e-12, (float(alpha), s.min(), s.max())


@pytest.mark.parametrize("kind", SPLIT)
def test_square_is_the_square_part_alone(kind):
    # no complement: the whole budget is the square part's, one msign, feasible by the tight bound
    W, G = problem(kind, 32, 32, seed=7)
    A, alpha, _ = filled_split_direction(MANIFOLDS[kind](), W, G, dict(OPTIONS))
    assert float(alpha) == 1.0
    residual, op = feasibility(kind, W, A)
    assert residual < TANGENT_TOL and op <= 1 + OP_TOL, (residual, op)
    assert int(spectral_direction(MANIFOLDS[kind](), W, G, solver="filled_split")[1].evaluations) == 1


@pytest.mark.parametrize("kind", SPLIT)
def test_zero_gradient_gives_zero(kind):
    W, _ = problem(kind, 48, 16, seed=1)
    A, _, _ = filled_split_direction(MANIFOLDS[kind](), W, torch.zeros_like(W), dict(OPTIONS))
    assert torch.equal(A, torch.zeros_like(W))


def test_batched_equals_one_by_one():
    pairs = [problem("dgram", 40, 8, seed=s) for s in range(3)]
    W, G = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    A, alpha, _ = filled_split_direction(MANIFOLDS["dgram"](), W, G, dict(OPTIONS))
    assert alpha.shape == (3,)
    for i, (Wi, Gi) in enumerate(pairs):
        Ai, ai, _ = filled_split_direction(MANIFOLDS["dgram"](), Wi, Gi, dict(OPTIONS))
        assert torch.allclose(A[i], Ai, atol=1e-6) and math.isclose(float(alpha[i]), float(ai))


@pytest.mark.parametrize("kind", list(MANIFOLDS))
def test_products_only(kind):
    W, G = problem(kind, 96, 32, seed=5)
    with count_operators() as counts:
        _, stats = spectral_direction(MANIFOLDS[kind](), W, G, solver="filled_split")
    assert not set(counts) & set(FORBIDDEN), counts
    assert counts["bmm"] + counts["mm"] > 0  # the counter sees the solve
    # msigns: the joint one (the square part's) and the complement's; Oblique: the unsplit direction's one
    assert int(stats.evaluations) == (1 if kind == "oblique" else 2)


def test_oblique_is_the_unsplit_direction():
    W, G = problem("oblique", 40, 10, seed=8)
    A, _ = spectral_direction(MANIFOLDS["oblique"](), W, G, solver="filled_split", msign_steps=6)
    B = unsplit_direction(MANIFOLDS["oblique"](), W, G, {**OPTIONS, "msign_steps": 6})
    assert torch.equal(A, B)
    residual, op = feasibility("oblique", W, A)
    assert residual < TANGENT_TOL and op <= 1 + OP_TOL, (residual, op)


def test_options_are_validated_and_retired_ones_name_their_commit():
    W, G = problem("dgram", 24, 8, seed=9)
    with pytest.raises(ValueError, match="degree"):
        spectral_direction(MANIFOLDS["dgram"](), W, G, solver="filled_split", degree=1)
    for retired in ({"square": "split"}, {"refine": 1}, {"carry_step": 0.25}, {"rounds": 2}, {"sub_steps": 1}):
        with pytest.raises(ValueError, match=r"retired from the product: run what names it from a checkout of \w+"):
            spectral_direction(MANIFOLDS["dgram"](), W, G, solver="filled_split", **retired)


@pytest.mark.parametrize("kind", SPLIT)
@pytest.mark.parametrize("shape", SHAPES)
def test_joint_square_part_is_feasible_and_near_optimum(kind, shape):
    # K is the tangent projection of the joint msign's span part, scaled into the ball, so the direction stays
    # feasible by construction; measured 0.89-1.00 of OPT on these problems (0.8 catches a broken projection or
    # fill)
    W, G = problem(kind, *shape, seed=sum(shape))
    A, _, _ = filled_split_direction(MANIFOLDS[kind](), W, G, dict(OPTIONS))
    residual, op = feasibility(kind, W, A)
    assert residual < TANGENT_TOL and op <= 1 + OP_TOL, (residual, op)
    opt, gap = exact_optimum(kind, W, G)
    assert 0.8 <= objective_ratio(G, A, opt) <= 1 + gap + 1e-5


@pytest.mark.parametrize("kind", SPLIT)
def test_joint_is_products_only_and_counts_its_msigns(kind):
    W, G = problem(kind, 96, 32, seed=5)
    with count_operators() as counts:
        _, stats = spectral_direction(MANIFOLDS[kind](), W, G, solver="filled_split")
    assert not set(counts) & set(FORBIDDEN), counts
    assert int(stats.evaluations) == 2  # the joint msign and the complement's


# The Gram-space path against the tall reference: in float64 the same computation reordered (the msigns from the
# Gram matrices, the ridge 2e-16), measured 1.0-1.3e-12 apart relative; 1e-10 leaves a factor 75
GRAM_TOL = 1e-10


@pytest.mark.parametrize("kind", SPLIT)
@pytest.mark.parametrize("carry", [False, True])
def test_gram_path_is_the_tall_reference(kind, carry):
    W, G = problem(kind, 96, 24, seed=11, dtype=torch.float64)
    opts = {**OPTIONS, "carry": carry}
    A, alpha, _ = filled_split_direction(MANIFOLDS[kind](), W, G, opts)
    B, beta, _ = gram_filled_split_direction(MANIFOLDS[kind](), W, G, opts)
    assert torch.equal(alpha, beta)
    assert float((A - B).norm() / A.norm()) < GRAM_TOL


@pytest.mark.parametrize("kind", SPLIT)
def test_gram_path_in_float32_is_feasible_and_near_the_reference(kind):
    # float32: the Gram matrices square the rounding of the small singular values and the ridge eps maps them
    # below 1 (measured: 3e-3 from the float64 reference at 512x128, the tall float32 path 2e-4); 1e-2 leaves a
    # factor 3; the certified gaps of the two paths on a trained GPT checkpoint agree to 1e-4
    W, G = problem(kind, 192, 48, seed=12, dtype=torch.float64)
    ref, _, _ = filled_split_direction(MANIFOLDS[kind](), W, G, dict(OPTIONS))
    A, _, _ = gram_filled_split_direction(MANIFOLDS[kind](), W.float(), G.float(), dict(OPTIONS))
    residual, op = feasibility(kind, W.float(), A)
    assert residual < TANGENT_TOL and op <= 1 + OP_TOL, (residual, op)
    assert float((A.double() - ref).norm() / ref.norm()) < 1e-2


def test_gram_path_keeps_a_half_precision_dtype():
    # the Gram work runs in float32 (a bf16 Gram matrix would lose the small singular values); A comes back in bf16
    W, G = problem("dgram", 64, 16, seed=13)
    A, _, _ = gram_filled_split_direction(MANIFOLDS["dgram"](), W.bfloat16(), G.bfloat16(), dict(OPTIONS))
    B, _, _ = gram_filled_split_direction(
        MANIFOLDS["dgram"](), W.bfloat16().float(), G.bfloat16().float(), dict(OPTIONS)
    )
    assert A.dtype == torch.bfloat16 and torch.equal(A, B.bfloat16())


@pytest.mark.parametrize("kind", SPLIT)
def test_space_tall_and_svd_take_the_reference_path(kind):
    W, G = problem(kind, 48, 16, seed=14)
    for options in ({"space": "tall"}, {"msign": "svd"}):  # svd has no Gram form
        A, _ = spectral_direction(MANIFOLDS[kind](), W, G, solver="filled_split", **options)
        B, _, _ = filled_split_direction(MANIFOLDS[kind](), W, G, {**OPTIONS, **options})
        assert torch.equal(A, B), options
    with pytest.raises(ValueError, match="one of gram, tall"):
        spectral_direction(MANIFOLDS[kind](), W, G, solver="filled_split", space="wide")


@pytest.mark.parametrize("shape", [(512, 128), (384, 128)])
def test_default_costs_at_most_three_msigns(shape):
    # issue 42's budget, in matmul FLOPs (exact counts, not times): the default solve of a tall matrix of the
    # model's shapes (m = 3n and 4n), statistics included, against one 5-step Polar Express msign of it.
    # Measured 2.42 (4n) and 2.92 (3n); at m = 2n it is 3.8 (the n x n work weighs more there)
    from torch.utils.flop_counter import FlopCounterMode

    from manifolds import msign

    W, G = problem("dgram", *shape, seed=15)

    def flops(fn):
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    unit = flops(lambda: msign(G, "polar_express", steps=5))
    assert flops(lambda: spectral_direction(MANIFOLDS["dgram"](), W, G, solver="filled_split")) <= 3 * unit


@pytest.mark.parametrize("kind", SPLIT)
def test_gram_path_stays_tangent_on_a_low_rank_gradient(kind):
    # a rank-deficient complement R: F(R^T R) is up to Polar Express's slope at 0 (~1900/||R||_F) on R's null
    # space, and R F's rounding there is not all removed by the U^T R correction; measured RMS tangent residual
    # 4e-5 on DGram 512x128 of rank 32, 2e-5 at 10x6 (the tall path: 1e-6); 1e-4 is the bound the docs state
    W, _ = problem(kind, 192, 48, seed=17)
    g = torch.Generator().manual_seed(17)
    G = torch.randn(192, 6, generator=g) @ torch.randn(6, 48, generator=g)
    A, _, _ = gram_filled_split_direction(MANIFOLDS[kind](), W, G, dict(OPTIONS))
    residual, op = feasibility(kind, W, A)
    assert residual < 1e-4 and op <= 1 + OP_TOL, (residual, op)


# ---- carry=True: the multiplier carried from one solve to the next ----


def carried_solves(kind, W, G, count, direction=None, **options):
    """``count`` solves of one problem, each starting from the correction the previous one returned: the
    directions and the corrections."""
    direction = direction or gram_filled_split_direction
    opts, carried, out = {**OPTIONS, "carry": True, **options}, None, []
    for _ in range(count):
        A, _, carried = direction(MANIFOLDS[kind](), W, G, opts, carried)
        out.append((A, carried))
    return out


@pytest.mark.parametrize("kind", SPLIT)
def test_carry_in_gram_space_is_the_tall_path(kind):
    # float64: the same carried iteration on both paths, directions and corrections, to rounding (as without carry)
    W, G = problem(kind, 96, 32, seed=21, dtype=torch.float64)
    gram = carried_solves(kind, W, G, 3)
    tall = carried_solves(kind, W, G, 3, filled_split_direction)
    for (A, S), (B, T) in zip(gram, tall):
        assert torch.allclose(A, B, atol=1e-10) and torch.allclose(S, T, atol=1e-10)
        assert torch.equal(S, S.mT) and S.shape == (32, 32)


@pytest.mark.parametrize("kind", SPLIT)
def test_carry_starts_as_the_default_and_off_ignores_the_state(kind):
    W, G = problem(kind, 64, 16, seed=22)
    A0, off = spectral_direction(MANIFOLDS[kind](), W, G, solver="filled_split", carry=False)
    A1, stats = spectral_direction(MANIFOLDS[kind](), W, G, solver="filled_split")  # carry=True, the default
    assert torch.equal(A0, A1) and stats.state["correction"].shape == (16, 16)  # cold: Lambda = N(G), as without
    assert off.state is None
    C = stats.state["correction"]
    A2, off = spectral_direction(MANIFOLDS[kind](), W, G, solver="filled_split", carry=False, correction=C)
    assert torch.equal(A0, A2) and off.state is None  # carry=False: a correction given is not used, none is returned
    A3, _ = spectral_direction(
        MANIFOLDS[kind](), W, G, solver="filled_split", carry=True, correction=stats.state["correction"]
    )
    assert not torch.equal(A0, A3)  # carried: the next solve starts elsewhere


@pytest.mark.parametrize("kind", SPLIT)
def test_carried_solves_approach_the_optimum(kind):
    # the dual step's fixed point is the optimum's condition (the joint msign tangent): on a fixed problem the
    # certified gap of the carried solves falls; measured here 0.011 -> 0.006 (Stiefel) and 0.013 -> 0.007 (DGram)
    # over 12 solves, level after (20 solves: the same); 3/4 of the first gap catches a step of the wrong sign or
    # scale (the gap then grows)
    W, G = problem(kind, 192, 48, seed=7, dtype=torch.float64)
    solves = carried_solves(kind, W, G, 12)
    first, last = (
        float(certify(MANIFOLDS[kind](), W[None], G[None], A[None])[0][0]) for A in (solves[0][0], solves[-1][0])
    )
    assert last < 0.75 * first, (first, last)


@pytest.mark.parametrize("kind", SPLIT)
def test_carry_stays_feasible_whatever_the_correction(kind):
    W, G = problem(kind, 64, 16, seed=24)
    g = torch.Generator().manual_seed(24)
    # the carried correction is in the units of G / ||G||_F, where the default's start N(G) has norm 0.34 here; at
    # 65x that (scale 1) float32 rounding stays under the tangent tolerance (measured 1.3e-6), at 6500x (scale 100)
    # the tangent part is a difference of large numbers: measured 1.1e-4 (float64: 4e-9); the spectral bound holds
    for scale, tol in ((0.0, TANGENT_TOL), (1.0, TANGENT_TOL), (100.0, 1e-3)):
        S = scale * torch.randn(16, 16, generator=g)
        S = MANIFOLDS[kind]().project_gram(S + S.mT)
        A, _, carried = gram_filled_split_direction(MANIFOLDS[kind](), W, G, {**OPTIONS, "carry": True}, S)
        residual, op = feasibility(kind, W, A)
        assert residual < tol and op <= 1 + OP_TOL and torch.isfinite(carried).all(), (scale, residual, op)


@pytest.mark.slow  # about 1.7 s under load (the FLOP counter's first use)
def test_carry_costs_no_product_more():
    # the dual step reuses the joint msign's N(J) and <M, F>: the same matmul FLOPs (exact counts)
    from torch.utils.flop_counter import FlopCounterMode

    W, G = problem("dgram", 128, 32, seed=25)
    flops = []
    for options in ({}, {"carry": True}):
        with FlopCounterMode(display=False) as counter:
            spectral_direction(MANIFOLDS["dgram"](), W, G, solver="filled_split", **options)
        flops.append(counter.get_total_flops())
    assert flops[0] == flops[1] > 0


def test_carry_options_are_validated():
    W, G = problem("dgram", 24, 8, seed=26)
    with pytest.raises(ValueError, match="carry"):
        spectral_direction(MANIFOLDS["dgram"](), W, G, solver="filled_split", carry="yes")


def test_a_non_finite_correction_is_refused_by_its_name():
    W, G = problem("dgram", 24, 8, seed=27)
    C = torch.zeros(8, 8)
    C[0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"correction has non-finite entries.*correction=None"):
        spectral_direction(MANIFOLDS["dgram"](), W, G, solver="filled_split", correction=C)
