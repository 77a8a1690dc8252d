r"""Solver ``"filled_split"``: training's default on Stiefel, DGram and any other mask; products only.

With the split $W = U H_0$ (`geomtrain.optim.column_split.ColumnSplit`), a direction $A = UK + B$, $U^\top B = 0$, has
$A^\top A = K^\top K + B^\top B$, and the tangent constraint falls on the square part $K$ alone. The complement fills
the spectral budget that $\alpha K$ leaves:

$$A = \alpha\,UK + Q P_\alpha,\qquad Q = \operatorname{msign}(R),\quad P_\alpha = (I - \alpha^2 K^\top K)^{1/2},$$

so $A^\top A = I$ where $R = \hat G - UU^\top \hat G$ has full column rank, with $\alpha \in [0, 1]$ (of ``GRID``)
maximising $\langle \hat G, A\rangle = \alpha \langle H, K\rangle + \operatorname{tr}(S P_\alpha)$, $H = U^\top \hat G$,
$S = \operatorname{sym}(Q^\top R)$. $P_\alpha$ is a Chebyshev polynomial of degree ``degree`` in $X = 2K^\top K - I$,
so the search needs the moments $\operatorname{tr}(S\,T_j(X))$ once (`best_share`). `scale_to_ball` then guarantees
$\|A\|_{\mathrm{op}} \le 1$; on a square matrix there is no complement and $A = UK$.

$K$ is the tangent part of a joint msign of $\hat G - W\Lambda$ (`joint_square_part`), $\Lambda$ standing for the
optimum's multiplier: $N(\hat G)$ cold, plus the `carried_correction` with ``carry=True``. ``space="gram"`` runs every
$m \times n$ msign from $n \times n$ Gram matrices (`gram_filled_split_direction`); ``space="tall"``
(`filled_split_direction`) is the reference it is tested against.
"""

from __future__ import annotations

import math

import torch

from manifolds import GramManifold, MaskForm

from .baselines import MSIGN_OPTIONS, msign_with
from .column_split import ColumnSplit, tangent_fix
from .numerics import normalise, sym
from .products import (
    GRAM_MSIGNS,
    ball_factor,
    carried_multiplier,
    feasible_direction,
    feasible_stats,
    gram_msign_factor,
    mean_singular_value,
    scale_to_ball,
    tangent_part,
)
from .solver import Solver, StateSlot, is_int

__all__ = [
    "OPTIONS",
    "SOLVER",
    "GRID",
    "sqrt_coefficients",
    "chebyshev_moments",
    "chebyshev_matrix",
    "joint_square_part",
    "best_share",
    "fill",
    "filled_split_direction",
    "in_gram_space",
    "unsplit_direction",
    "carried_correction",
    "gram_joint_square_part",
    "gram_filled_split_direction",
    "solve_filled_split",
]

# degree 8: the final bound absorbs its interpolation error; 6 Polar Express steps (5 leave singular values 0.7-1.1)
OPTIONS = {**MSIGN_OPTIONS, "msign_steps": 6, "space": "gram", "degree": 8, "carry": True}
SPACES = ("gram", "tall")  # where the m x n msigns run: from the n x n Gram matrices, or on the m x n matrices
CARRY_STEP = 0.5  # the carried dual step eta: 1 oscillates between steps; 0.5 reaches the optimum's condition
GRID = 41  # shares alpha = 0, 0.025, ..., 1: the objective is flat near its maximum


def sqrt_coefficients(alpha: torch.Tensor, degree: int) -> torch.Tensor:
    r"""Chebyshev coefficients ``(..., N)``, $N$ = ``degree + 1``, of $f(x) = \sqrt{1 - \alpha^2 (x + 1)/2}$:
    $a_j = \frac{2 - \delta_{j0}}{N} \sum_i f(\cos\theta_i) \cos(j\theta_i)$, $\theta_i = \pi(i + \tfrac12)/N$."""
    N = degree + 1
    theta = (torch.arange(N, dtype=torch.float64, device=alpha.device) + 0.5) * (math.pi / N)
    f = (1 - alpha.double()[..., None] ** 2 * (theta.cos() + 1) / 2).clamp_min(0).sqrt()
    basis = torch.cos(torch.arange(N, dtype=torch.float64, device=alpha.device)[:, None] * theta)  # (j, i)
    a = f @ basis.mT * (2.0 / N)
    a[..., 0] = a[..., 0] / 2
    return a


def chebyshev_moments(S: torch.Tensor, X: torch.Tensor, degree: int) -> torch.Tensor:
    r"""$\mu_j = \operatorname{tr}(S\,T_j(X))$, $j = 0..$``degree``, ``(..., degree + 1)``, for symmetric
    ``(..., n, n)`` $S$ and $X$ (three-term recurrence $T_{j+1} = 2XT_j - T_{j-1}$: ``degree - 1`` products)."""
    eye = torch.eye(X.shape[-1], dtype=X.dtype, device=X.device).expand_as(X)
    prev, cur = eye, X
    mu = [S.diagonal(dim1=-2, dim2=-1).sum(-1), (S * X).sum(dim=(-2, -1))]
    for _ in range(degree - 1):
        prev, cur = cur, 2 * X @ cur - prev
        mu.append((S * cur).sum(dim=(-2, -1)))
    return torch.stack(mu[: degree + 1], dim=-1)


def chebyshev_matrix(X: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    r"""$\sum_j a_j T_j(X)$ for symmetric ``(..., n, n)`` $X$ and coefficients ``(..., J + 1)`` (Clenshaw: $J$
    products)."""
    eye = torch.eye(X.shape[-1], dtype=X.dtype, device=X.device)
    a = a.to(X.dtype)[..., None, None]
    b1 = b2 = torch.zeros_like(X)
    for j in range(a.shape[-3] - 1, 0, -1):
        b1, b2 = a[..., j, :, :] * eye + 2 * X @ b1 - b2, b1
    return a[..., 0, :, :] * eye + X @ b1 - b2


def joint_square_part(
    split: ColumnSplit,
    W: torch.Tensor,
    Y: torch.Tensor,
    opts: dict,
    bound: str = "schatten",
    with_step: bool = False,
):
    r"""``(K, step)``: $K$ the tangent projection at $H_0$ of $U^\top J$, $J = \operatorname{msign}(Y)$, scaled into
    the unit ball; with ``with_step`` the step $\bar\sigma(Y)\,N(J)$ of `carried_correction`, else None."""
    J = msign_with(Y, opts).to(W.dtype)
    K = scale_to_ball(split.square_tangent(split.U.mT @ J), bound=bound)
    return K, mean_singular_value(Y, J) * split.manifold.normal_multiplier(W, J) if with_step else None


def best_share(H: torch.Tensor, K: torch.Tensor, S: torch.Tensor, X: torch.Tensor, degree: int):
    r"""``(alpha, a)``: the share $\alpha$ of ``GRID`` that maximises $\alpha\langle H, K\rangle + \operatorname{tr}
    (SP_\alpha)$, $X = 2K^\top K - I$, and the Chebyshev coefficients ``(..., degree + 1)`` of its $P_\alpha$."""
    grid = torch.linspace(0.0, 1.0, GRID, dtype=torch.float64, device=K.device)
    table = sqrt_coefficients(grid, degree)  # (GRID, degree + 1)
    c = (H * K).sum(dim=(-2, -1)).double()
    value = c[..., None] * grid + chebyshev_moments(S, X, degree).double() @ table.mT  # (..., GRID)
    best = value.argmax(dim=-1)
    return grid[best].to(K.dtype), table[best]


def fill(U: torch.Tensor, H: torch.Tensor, K: torch.Tensor, Q: torch.Tensor, S: torch.Tensor, degree: int):
    r"""``(A, alpha)``: $A = \alpha UK + QP_\alpha$ at the `best_share` $\alpha$, before the final bound."""
    X = 2 * (K.mT @ K) - torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    alpha, a = best_share(H, K, S, X, degree)
    return alpha[..., None, None] * (U @ K) + Q @ chebyshev_matrix(X, a), alpha


def filled_split_direction(
    manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, opts: dict, correction: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    r"""``(A, alpha, correction)`` for tall ``(..., m, n)``: ``alpha`` the square part's share (1 on a square matrix),
    ``correction`` the new `carried_correction` with ``opts["carry"]`` on a tall matrix (else None)."""
    split = ColumnSplit(manifold, W)
    Gn, U, H = split.basis(G)
    square = W.shape[-2] == W.shape[-1]  # no complement (R is rounding): K is the direction, its bound the tight one
    base = manifold.normal_multiplier(W, Gn)  # Lambda where A = msign(P_T G)
    carry = bool(opts["carry"]) and not square
    lam = base + correction.to(W.dtype) if carry and correction is not None else base
    K, step = joint_square_part(split, W, Gn - W @ lam, opts, "both" if square else "schatten", carry)
    if square:
        A = U @ K if not split.generic else scale_to_ball(tangent_fix(manifold, W, U @ K), bound="both")
        return A, torch.ones(W.shape[:-2], dtype=W.dtype, device=W.device), None
    R = Gn - U @ H
    Q = msign_with(R, opts).to(W.dtype)
    Q = Q - U @ (U.mT @ Q)
    S = sym(Q.mT @ R)
    A, alpha = fill(U, H, K, Q, S, int(opts["degree"]))
    A = tangent_fix(manifold, W, A) if split.generic else A
    return scale_to_ball(A, bound="near_unit"), alpha, carried_correction(lam, step, base) if carry else None


def carried_correction(lam: torch.Tensor, step: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    r"""$C = \Lambda + \eta\,\bar\sigma(Y)\,N(J) - N(\hat G)$ ($\eta$ = ``CARRY_STEP``, $J = \operatorname{msign}(Y)$,
    $Y = \hat G - W\Lambda$): a dual-ascent step toward $N(J) = 0$, relative to ``base`` $= N(\hat G)$."""
    return lam + CARRY_STEP * step - base


def gram_joint_square_part(split: ColumnSplit, E: torch.Tensor, MR: torch.Tensor, opts: dict):
    r"""``(K, K^T K, step)``: `joint_square_part` of $Y = UE + R$ ($U^\top R = 0$) from $M = E^\top E + R^\top R$,
    with $U^\top \operatorname{msign}(Y) = E\,F(M)$ (`gram_msign_factor`)."""
    M = E.mT @ E + MR
    F = gram_msign_factor(M, opts["msign"], int(opts["msign_steps"]))
    J = E @ F
    NJ = split.normal(split.left_t(J))
    K = J - split.left(NJ)  # the tangent part at H0
    P = K.mT @ K
    f = ball_factor(P, K.shape[-2], "schatten")[..., None, None]
    sigma = (M * F).sum(dim=(-2, -1), keepdim=True) / M.shape[-1]  # <Y, msign(Y)> / n = tr(M F) / n
    return K * f, P * (f * f), sigma * NJ


def gram_filled_split_direction(
    manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, opts: dict, correction: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    r"""`filled_split_direction` with every msign in Gram space: after $R = \hat G - UH$, $R^\top R$ and $U^\top R$
    (four $mn^2$ products) the work is $n \times n$ (`gram_joint_square_part`, $Q = R\,F(R^\top R)$) until
    $A = U(\alpha K - U^\top R\,N) + RN$. Float32 at least; a square matrix takes the tall path."""
    if W.shape[-2] == W.shape[-1]:
        return filled_split_direction(manifold, W, G, opts, correction)
    work = torch.promote_types(W.dtype, torch.float32)
    Wf, degree = W.to(work), int(opts["degree"])
    split = ColumnSplit(manifold, Wf)
    Gn, U, H = split.basis(G.to(work))
    R = Gn - U @ H
    MR, UR = R.mT @ R, U.mT @ R  # U^T R: rounding, but F(R^T R) amplifies it where R is near rank-deficient
    FR = gram_msign_factor(MR, opts["msign"], int(opts["msign_steps"]))
    S = sym(FR @ MR)
    eye = torch.eye(W.shape[-1], dtype=work, device=W.device)
    base = split.normal(split.left_t(H))  # W^T G = H0^T H: A = msign(P_T G)'s
    carry = bool(opts["carry"])
    lam = base + correction.to(work) if carry and correction is not None else base
    E = H - split.left(lam)  # U^T (G - W Lambda)
    K, PK, tangency = gram_joint_square_part(split, E, MR, opts)
    X = 2 * PK - eye
    alpha, a = best_share(H, K, S, X, degree)
    aK, N = alpha[..., None, None] * K, FR @ chebyshev_matrix(X, a)
    A = U @ (aK - UR @ N) + R @ N  # (I - UU^T) R N: the complement's part in the complement, as the tall Q's
    A = tangent_fix(manifold, Wf, A) if split.generic else A
    correction = carried_correction(lam, tangency, base).to(W.dtype) if carry else None
    return scale_to_ball(A, bound="near_unit").to(W.dtype), alpha.to(W.dtype), correction


def is_split(manifold: GramManifold) -> bool:
    """Whether the solver splits the direction (and carries a multiplier): not on Oblique's or Euclidean's mask."""
    return manifold.mask_form not in (MaskForm.DIAGONAL, MaskForm.ZERO)


def in_gram_space(opts: dict) -> bool:
    """Whether the $m \times n$ msigns run in Gram space: ``space="gram"`` and an msign of `GRAM_MSIGNS`."""
    return opts["space"] == "gram" and opts["msign"] in GRAM_MSIGNS


def unsplit_direction(manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, opts: dict) -> torch.Tensor:
    r"""`feasible_direction` of $\operatorname{msign}(P_T\hat G)$, for Oblique and Euclidean (no split)."""
    Gn, _ = normalise(G)
    return feasible_direction(manifold, W, msign_with(tangent_part(manifold, W, Gn), opts))


def solve_filled_split(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, state: dict | None, opts: dict
) -> tuple[torch.Tensor, dict, dict | None]:
    """The solver (``(B, m, n)`` tall batches): the direction, its statistics and, with ``carry`` on a tall matrix,
    the state ``{"correction": C}``."""
    if not is_split(manifold):  # not selected by training
        A = unsplit_direction(manifold, T, G, opts)
        return A, feasible_stats(manifold, T, G, A, 1, opts), None
    direction = gram_filled_split_direction if in_gram_space(opts) else filled_split_direction
    A, _, correction = direction(
        manifold, T, G, opts, carried_multiplier(state, T, "correction") if opts["carry"] else None
    )
    tall = T.shape[-2] > T.shape[-1]  # a square matrix has no complement to fill: its square part alone
    stats = feasible_stats(manifold, T, G, A, 1 + int(tall), opts)
    return A, stats, None if correction is None else {"correction": correction}


SOLVER = Solver(
    name="filled_split",
    solve=solve_filled_split,
    options=OPTIONS,
    rules={
        "space": (lambda v: v in SPACES, f"one of {', '.join(SPACES)}"),
        "degree": (lambda v: is_int(v) and v >= 2, "an integer >= 2 (the Chebyshev degree of the fill)"),
        "carry": (lambda v: isinstance(v, bool), "True or False (carry the multiplier from step to step)"),
    },
    state=(StateSlot("correction", "correction", "matrix"),),
    warm_starts=True,
    # otherwise it returns no state and ignores the one passed in
    carries=lambda options, manifold: options["carry"] and is_split(manifold),
    summary="products only: the square part from a joint msign at its best share; the complement fills the rest",
)
