"""The generic maps by products only (`manifolds.gram_solve`): conjugate gradients on the normal equation against a
dense solve with either preconditioner (Jacobi, congruence), the stated convergence test, the congruence factor's
math (SPD, A^(-1/2) on the upper spectrum, fewer iterations on ill-conditioned blocks), Newton with float32 and
congruence solves reaching the float64 tolerance, generic and closed forms agreeing on the built-in masks, and a
``project_gram``-only block mask at the ``mini`` model's shapes (no decomposition, a bounded cost, on the manifold)."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import manifolds.gram_solve as gram_solve
from geomtrain.bench.manifold import off_block_ratio
from geomtrain.bench.problems import BlockMask
from manifolds import DGram, GramManifold, Oblique, Stiefel
from manifolds.gram_solve import (
    CG_RTOL,
    FACTOR_STEPS,
    congruence_factor,
    gram_newton_factor,
    scaled_residual,
    solve_normal_equation,
)
from manifolds.testing import check_manifold


def _mask(kind: str, n: int) -> torch.Tensor:
    i = torch.arange(n)
    masks = {
        "block": (i[:, None] // 3) != (i[None, :] // 3),
        "parity": (i[:, None] == i[None, :]) | ((i[:, None] + i[None, :]) % 2 == 1),
        "diagonal": i[:, None] == i[None, :],
        "off": i[:, None] != i[None, :],
        "full": torch.ones(n, n, dtype=torch.bool),
    }
    return masks[kind].double()


def _dense_solve(mask: torch.Tensor, A: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """The reference: the k x k system over the masked entries on and above the diagonal (what the generic path
    solved before, and what it must never form again)."""
    n = A.shape[-1]
    i, j = torch.triu(mask).nonzero(as_tuple=True)
    cols = []
    for p, q in zip(i.tolist(), j.tolist()):
        E = torch.zeros(n, n, dtype=A.dtype)
        E[p, q] = E[q, p] = 1.0
        cols.append((mask * (A @ E + E @ A))[i, j])
    e = torch.linalg.solve(torch.stack(cols, 1), (mask * R)[i, j])
    S = torch.zeros(n, n, dtype=A.dtype)
    S[i, j] = e
    S[j, i] = e
    return S


def _spd(n: int, seed: int, dtype=torch.float64, rows: int = 14) -> torch.Tensor:
    X = torch.randn(rows, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    X = X * torch.exp(0.5 * torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1)))
    return (X.mT @ X).to(dtype)


def _sym(n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    R = torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return (R + R.mT).to(dtype)


# float64: CG stops at a relative residual of 1e-12 (CG_RTOL), and the solution's error is at most the operator's
# condition number (< 1e3 for these A: column norms spread e^(+-1), 14 rows for 7 columns) times that: 1e-9 bounds
# it. float32: 1e-6 times the same, and float32's own rounding of A (1e-7 relative): 1e-3.
SOLUTION_TOL = {torch.float64: 1e-9, torch.float32: 1e-3}


@pytest.mark.parametrize("preconditioner", ["jacobi", "congruence"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["block", "parity", "diagonal", "off", "full"])
def test_conjugate_gradients_solve_the_normal_equation(kind, dtype, preconditioner):
    # either preconditioner solves the same equation to the same stated tolerance: the congruence one is SPD for any
    # SPD factor (its float32 rounding included), so it changes the iteration count, not the solution's accuracy
    n = 7
    mask, A, R = _mask(kind, n), _spd(n, seed=1), _sym(n, seed=2)
    want = _dense_solve(mask, A, R)
    factor = congruence_factor(A.to(dtype)) if preconditioner == "congruence" else None
    got = solve_normal_equation(mask, A.to(dtype), R.to(dtype), factor=factor)
    err = float((got.solution.double() - want).norm() / want.norm())
    assert err <= SOLUTION_TOL[dtype], (kind, err)
    assert torch.equal(got.solution, got.solution.mT) and torch.equal(got.solution, mask.to(dtype) * got.solution)
    # the stated convergence test: the recursively updated residual at most CG_RTOL of the right-hand side, and
    # the true one within 10x of it (their drift: kappa * eps)
    assert float(got.residual) <= CG_RTOL[dtype]
    AS = A @ got.solution.double()
    true = float((mask * (AS + AS.mT - R)).norm() / (mask * R).norm())
    assert true <= 10 * CG_RTOL[dtype] * (1e3 if dtype == torch.float32 else 1), true


def test_a_warm_start_at_the_solution_takes_no_product_and_batches_stop_per_matrix():
    n = 9
    mask = _mask("block", n)
    A = torch.stack([_spd(n, seed=s) for s in (3, 4, 5)])
    R = torch.stack([_sym(n, seed=s) for s in (6, 7, 8)])
    cold = solve_normal_equation(mask, A, R)
    assert cold.iterations > 0 and bool((cold.residual <= CG_RTOL[torch.float64]).all())
    warm = solve_normal_equation(mask, A, R, x0=cold.solution)
    assert warm.iterations == 0 and torch.equal(warm.solution, cold.solution)
    for b in range(3):  # each matrix of the batch as if alone: the same solution to the tolerance
        alone = solve_normal_equation(mask, A[b], R[b]).solution
        assert float((alone - cold.solution[b]).norm() / alone.norm()) <= 1e-10
    zero = solve_normal_equation(mask, A, torch.zeros_like(R))
    assert zero.iterations == 0 and not bool(zero.solution.any()) and not bool(zero.residual.any())
    with pytest.raises(TypeError, match=r"^the normal equation is solved in float32 or float64; got torch.bfloat16"):
        solve_normal_equation(mask, A.bfloat16(), R.bfloat16())


def _block_diagonal_gram(n: int, block: int, kappa: float, seed: int) -> torch.Tensor:
    """A unit-diagonal Gram matrix, block diagonal along a block mask, each block with eigenvalues log-spaced over
    ``kappa`` before the diagonal scaling: a point of the block mask's manifold with ill-conditioned free blocks."""
    g = torch.Generator().manual_seed(seed)
    A = torch.zeros(n, n, dtype=torch.float64)
    for i in range(0, n, block):
        Q, _ = torch.linalg.qr(torch.randn(block, block, dtype=torch.float64, generator=g))
        A[i : i + block, i : i + block] = (Q * torch.logspace(0, -math.log10(kappa), block, dtype=torch.float64)) @ Q.mT
    d = A.diagonal().sqrt()
    return A / d[:, None] / d[None, :]


def test_the_congruence_factor_is_symmetric_positive_definite_and_near_the_inverse_square_root():
    # B = sym(Z)/sqrt(c), Z a polynomial in A positive on every eigenvalue t = lambda/c in (-eps, 3): SPD whatever
    # the conditioning, A^(-1/2) within 1% on t >= 2.25^(2 - steps) (the scalar iteration), at most 1.5^steps / sqrt(c)
    for A in (_spd(7, seed=1), _block_diagonal_gram(32, 8, 1e3, seed=3), _block_diagonal_gram(32, 8, 1e12, seed=4)):
        B = congruence_factor(A)
        assert B.dtype == torch.float32 and torch.equal(B, B.mT)
        lam, V = torch.linalg.eigh(A)
        eig_B = torch.linalg.eigvalsh(B.double())
        assert float(eig_B.min()) > 0 and float(eig_B.max()) <= 1.5**FACTOR_STEPS / math.sqrt(float(lam.max()) / 2.5)
        # on the top eigenvectors (t >= 2.25^(2 - steps), c about 1.1 lambda_max here) B acts as A^(-1/2)
        top = lam >= 1.1 * float(lam.max()) / 2.25 ** (FACTOR_STEPS - 2)
        z = ((V.mT @ B.double() @ V).diagonal()) * lam.sqrt()
        assert float((z[top] - 1).abs().max()) <= 0.01, z[top]
    # the preconditioner r -> P(B r B)/2 is self-adjoint and positive on the masked symmetric matrices
    mask, B = _mask("block", 7), congruence_factor(_spd(7, seed=1)).double()
    r, s_ = mask * _sym(7, seed=5), mask * _sym(7, seed=6)
    assert abs(float((s_ * (mask * (B @ r @ B))).sum() - (r * (mask * (B @ s_ @ B))).sum())) <= 1e-12 * float(
        r.norm() * s_.norm() * B.norm() ** 2
    )
    assert float((r * (mask * (B @ r @ B))).sum()) > 0


def test_the_congruence_preconditioner_cuts_the_iterations_on_ill_conditioned_blocks():
    # A block diagonal along the mask with in-block condition number 1e3: Jacobi's preconditioned operator has a
    # condition number of about kappa, the congruence one's about sqrt(kappa)/2 (module docstring); measured 304
    # against 97 iterations (float64) and 167 against 49 (float32), the same solution within CG_RTOL times kappa
    n, block = 32, 8
    i = torch.arange(n)
    mask = ((i[:, None] // block) != (i[None, :] // block)).double()
    A, R = _block_diagonal_gram(n, block, 1e3, seed=0), _sym(n, seed=1)
    for dtype in (torch.float64, torch.float32):
        jac = solve_normal_equation(mask, A.to(dtype), R.to(dtype))
        con = solve_normal_equation(mask, A.to(dtype), R.to(dtype), factor=congruence_factor(A))
        assert float(jac.residual) <= CG_RTOL[dtype] and float(con.residual) <= CG_RTOL[dtype]
        assert 2.5 * con.iterations <= jac.iterations, (dtype, jac.iterations, con.iterations)
        diff = float((jac.solution.double() - con.solution.double()).norm() / jac.solution.double().norm())
        assert diff <= 1e3 * CG_RTOL[dtype] * 10, (dtype, diff)


@pytest.mark.parametrize("tol", [1e-13, 1e-9])
def test_newton_with_float32_and_congruence_solves_reaches_the_float64_tolerance(tol, monkeypatch):
    # a square block-mask retraction: G0 the Gram matrix of unit columns of W + t U at an ill-conditioned point (the
    # solves need the congruence factor), with each step's loose solves in float32: Newton, whose residual is
    # measured in float64, still reaches the float64 target, by products only
    n, block = 48, 8
    i = torch.arange(n)
    mask = ((i[:, None] // block) != (i[None, :] // block)).double()
    g = torch.Generator().manual_seed(7)
    A = _block_diagonal_gram(n, block, 1e4, seed=8)
    lam, V = torch.linalg.eigh(A)
    W = (V * lam.clamp_min(0).sqrt()) @ V.mT  # W^T W = A: square, on the manifold
    X = W + 0.05 * torch.randn(n, n, dtype=torch.float64, generator=g) / math.sqrt(n)
    X0 = X / X.norm(dim=0)
    G0 = X0.mT @ X0
    built, solved_in = [], set()
    factor, solve = gram_solve.congruence_factor, gram_solve.solve_normal_equation
    monkeypatch.setattr(gram_solve, "congruence_factor", lambda A_: built.append(1) or factor(A_))
    monkeypatch.setattr(
        gram_solve, "solve_normal_equation", lambda m, A_, *a, **k: solved_in.add(A_.dtype) or solve(m, A_, *a, **k)
    )
    with _Forbidden() as forbidden:
        C, steps = gram_newton_factor(mask, G0, tol, 30)
    assert not forbidden.seen, forbidden.seen
    Y = C.mT @ G0 @ C
    assert float(scaled_residual(mask * (Y - torch.eye(n, dtype=Y.dtype)), Y).max()) <= tol
    assert built and torch.float32 in solved_in, (len(built), solved_in)  # both paths taken
    assert steps <= 8


# Generic against closed forms: proju is the same orthogonal projection, so they agree to the CG tolerance times
# the operator's conditioning (float64: 1e-12 * 1e2 << 1e-9) or float32's rounding of the products (~1e-6); the
# retractions differ (DGram keeps diag(Q^T X), the generic one the column norms of X): they agree on the manifold
# exactly and to second order along a tangent.
AGREE_TOL = {torch.float64: 1e-9, torch.float32: 2e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("manifold", [Stiefel(), DGram(), Oblique()], ids=lambda m: type(m).__name__)
def test_generic_and_closed_form_paths_agree_on_the_built_in_masks(manifold, dtype):
    g = torch.Generator().manual_seed(9)
    W = manifold.random(3, 40, 12, dtype=torch.float64, generator=g).to(dtype)
    W = manifold.projx(W) if dtype == torch.float32 else W
    Z = torch.randn(3, 40, 12, dtype=torch.float64, generator=g).to(dtype)
    closed, generic = manifold.proju(W, Z), GramManifold.proju(manifold, W, Z)  # the base class's: forced generic
    assert float((closed - generic).abs().max() / Z.abs().max()) <= AGREE_TOL[dtype]
    assert torch.equal(GramManifold.projx(manifold, W), W)  # a point of the manifold, unchanged
    U = manifold.proju(W, Z)
    U = U / U.norm(dim=(-2, -1), keepdim=True) * W.norm(dim=(-2, -1), keepdim=True)

    def gap(t: float) -> float:
        return float((GramManifold.retr(manifold, W, t * U) - manifold.retr(W, t * U)).norm() / W.norm())

    if dtype == torch.float64:
        assert gap(0.02) <= 0.3 * gap(0.04) + 1e-12 and gap(0.04) <= 50 * 0.04**2  # O(t^2)
    Y = GramManifold.retr(manifold, W, 0.1 * U)
    assert manifold.check_point_on_manifold(Y)
    if isinstance(manifold, Oblique):  # both normalise the columns: the same map
        assert float((Y - manifold.retr(W, 0.1 * U)).abs().max()) <= AGREE_TOL[dtype]


class _Forbidden(TorchDispatchMode):
    """Records every decomposition or dense solve dispatched inside it."""

    NAMES = ("linalg_eigh", "_linalg_eigh", "linalg_svd", "_linalg_svd", "linalg_qr", "linalg_solve")
    NAMES += ("_linalg_solve_ex", "linalg_cholesky_ex", "cholesky", "linalg_eig", "linalg_inv_ex", "linalg_lstsq")

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.NAMES:
            self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# The generic maps of a block mask of 16 at the mini model's shapes cost, in matmul flops (exact counts, not times):
# measured 0.30-0.32 Gflop for projx from GPT-2's initialisation, 0.08 for proju and 0.19-0.21 for a retraction
# (384x128, 512x128); the dense solve they replace cost k^3/3 = 1.2e11 flops per system (k = 7168 masked entries).
# 1 Gflop leaves room for 3x more CG iterations and is 120x below one dense system.
FLOP_BOUND = 1e9


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(384, 128), (512, 128)], ids=str)
def test_a_block_mask_at_model_shapes_is_products_only_and_lands_on_the_manifold(shape):
    M, g = BlockMask(16), torch.Generator().manual_seed(10)
    X = 0.02 * torch.randn(*shape, generator=g)
    Z = torch.randn(*shape, generator=g)
    with _Forbidden() as forbidden, FlopCounterMode(display=False) as flops:
        W = M.projx(X)
        projx_flops = flops.get_total_flops()
        U = M.proju(W, Z)
    step = -0.02 * U / torch.linalg.matrix_norm(U.double(), ord=2).float()  # a Manifold Muon step at lr = 0.02
    with _Forbidden() as retr_forbidden, FlopCounterMode(display=False) as retr_flops:
        Y = M.retr(W, step)
    assert not forbidden.seen | retr_forbidden.seen, forbidden.seen | retr_forbidden.seen
    assert projx_flops <= FLOP_BOUND and flops.get_total_flops() <= FLOP_BOUND
    assert retr_flops.get_total_flops() <= FLOP_BOUND, retr_flops.get_total_flops()
    # the test: cross-block entries of W^T W at most 1e-4 of the diagonal (measured ~1e-8: float32 rounding)
    assert off_block_ratio(M, W) <= 1e-6 and off_block_ratio(M, Y) <= 1e-6
    # tangent: L_W(U) at the rounding of float32 products of O(1) entries (n * 6e-8 ~ 1e-5 relative)
    assert float(M.tangent_constraint(W, U).abs().max()) <= 1e-5 * float(W.norm(dim=-2).max() * U.norm(dim=-2).max())


@pytest.mark.slow
def test_the_contract_kit_passes_for_a_block_mask_of_16():
    # shapes with several blocks of 16 (tall, wide, square, batched); every scale 1e-3..1e3, float32 and float64
    shapes = ((64, 40), (40, 64), (36, 36), (2, 48, 20))
    check_manifold(BlockMask(16), shapes=shapes, max_examples=10)
