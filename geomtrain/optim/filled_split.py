r"""Solver ``"filled_split"``: training's default on Stiefel, DGram and any other mask; products only.

Split a tall $W$ as $W = U H_0$ (`geomtrain.optim.column_split.ColumnSplit`: $U$ orthonormal, $H_0$ square) and a
direction as $A = UK + B$ with $U^\top B = 0$: then $A^\top A = K^\top K + B^\top B$ and the tangent constraint
falls on the square part $K$ alone. The complement takes all of the spectral budget the square part $\alpha K$
leaves:

$$A = \alpha\,UK + Q P_\alpha,\qquad Q = \operatorname{msign}(R),\quad P_\alpha = (I - \alpha^2 K^\top K)^{1/2},$$

so $A^\top A = \alpha^2 K^\top K + P_\alpha Q^\top Q P_\alpha = I$ where $R$ has full column rank: every singular value
is 1, as the exact direction's. $\alpha \in [0, 1]$ maximises the objective

$$\langle \hat G, A\rangle = \alpha c + \operatorname{tr}(S P_\alpha),\qquad c = \langle H, K\rangle,\quad
S = \operatorname{sym}(Q^\top R) \approx (R^\top R)^{1/2},$$

over ``GRID`` values. $P_\alpha$ is a Chebyshev polynomial of degree ``degree`` in $X = 2K^\top K - I$ (spectrum in
$[-1, 1]$), interpolating $\sqrt{1 - \alpha^2 (x + 1)/2}$; its objective term is
$\sum_j a_j(\alpha)\,\mu_j$ with the moments $\mu_j = \operatorname{tr}(S\,T_j(X))$, so the search costs ``degree``
$n^3$ products once and a scalar table per grid value, and $P_\alpha$ itself (Clenshaw) ``degree`` more. Finally
`geomtrain.optim.products.scale_to_ball` guarantees $\|A\|_{\mathrm{op}} \le 1$ against the polynomial's and the
msign's rounding. Tangent to rounding (the constraint sees only $K$); on a square matrix there is no complement and
$A = UK$, `split_tangent`'s direction; on Oblique it is ``projected_tangent``'s. Cost: `split_tangent`'s msigns,
$2\,$``degree`` $n \times n$ products, two $mn^2$ ones more. No certificate; the state is ``carry``'s (below).

The square part $K$ comes from the joint msign of the tangent part, $P_{T_D}(U^\top \operatorname{msign}(\hat G -
W\Lambda))$ (`joint_square_part`), $\Lambda$ a multiplier of the optimum $A^\star = \operatorname{msign}(\hat G -
W\Lambda^\star)$: $\Lambda = N(\hat G)$ (the geometry's `manifolds.GramManifold.normal_multiplier`) cold. ``carry=True``
(the default) amortises the search for $\Lambda^\star$ over training: each step's joint msign starts from $\Lambda =
N(\hat G) + C$, $C$ the correction its previous step left (state ``correction``, $n \times n$ per tall matrix), and the
solve ends with one dual step toward that msign's tangency (`carried_correction`), at no product more. A call without a
``correction`` is the cold start, ``carry=False``'s direction.

``space="gram"`` (the default, `gram_filled_split_direction`) runs every $m \times n$ msign from $n \times n$ Gram
matrices (`geomtrain.optim.products.gram_msign_factor`): four $mn^2$ products before and three after, the rest
$n \times n$; 2.5 msign-equivalents of products at 512x128, 3.0 at 384x128, against 4.3 and 4.5 on the tall
matrices (``space="tall"``, `filled_split_direction`, the reference it is tested against).
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

# Degree 8: on a DGram MLP (512x128) the square part's share is 0.7-0.9, where degree 8 interpolates
# sqrt(1 - a^2 (x+1)/2) on [-1, 1] to 1e-7-7e-6 (at share 1 to 0.06); the final bound absorbs the interpolation
# error. 6 Polar Express steps: 5 leave singular values up to 1.1 and down to 0.7, which the bounds then cut.
OPTIONS = {**MSIGN_OPTIONS, "msign_steps": 6, "space": "gram", "degree": 8, "carry": True}
SPACES = ("gram", "tall")  # where the m x n msigns run: from the n x n Gram matrices, or on the m x n matrices
CARRY_STEP = 0.5  # the carried dual step eta: 1 oscillates between steps; 0.5 reaches the optimum's condition
GRID = 41  # shares alpha = 0, 0.025, ..., 1: the objective is flat near its maximum (+-0.05 moves the gap by < 0.003)


def sqrt_coefficients(alpha: torch.Tensor, degree: int) -> torch.Tensor:
    r"""Chebyshev coefficients ``(..., degree + 1)`` of $x \mapsto \sqrt{1 - \alpha^2 (x + 1)/2}$ on $[-1, 1]$ per
    ``alpha`` ``(...)``: interpolation at the $N$ = ``degree + 1`` Chebyshev points,
    $a_j = \frac{2 - \delta_{j0}}{N} \sum_i f(x_i) \cos(j\theta_i)$, $x_i = \cos\theta_i$,
    $\theta_i = \pi(i + \tfrac12)/N$."""
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
    r"""``(K, step)``: $K$ from a joint msign, the tangent projection at the square point $H_0$ of ``split``
    (`ColumnSplit`; $D$ on Stiefel and DGram) of $U^\top J$, $J = \operatorname{msign}(Y)$, scaled into the unit
    ball (one $m \times n$ msign): the span's share of a direction whose complement is solved with it, not apart;
    with ``with_step``, the multiplier step toward $J$'s tangency, $\bar\sigma(Y)\,N(J)$ (`carried_correction`;
    two $mn^2$ products more on this tall path), else None."""
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
    r"""``(A, alpha)``: $A = \alpha UK + QP_\alpha$ at the `best_share` $\alpha$ (module docstring), before the final
    bound."""
    X = 2 * (K.mT @ K) - torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    alpha, a = best_share(H, K, S, X, degree)
    return alpha[..., None, None] * (U @ K) + Q @ chebyshev_matrix(X, a), alpha


def filled_split_direction(
    manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, opts: dict, correction: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    r"""``(A, alpha, correction)`` above for tall ``(..., m, n)``, ``alpha`` the square part's share ``(...)`` (1 on a
    square matrix). ``opts["carry"]``: the joint msign starts from $\Lambda = N(\hat G) + C$, $C$ = ``correction``
    carried from the previous step (None: 0), and the returned ``correction`` is
    $\Lambda + \eta\,\bar\sigma N(J) - N(\hat G)$ for its msign $J$ (`carried_correction`); None without it and on a
    square matrix."""
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
    # the fill makes A's singular values 1: the tight bound
    return scale_to_ball(A, bound="near_unit"), alpha, carried_correction(lam, step, base) if carry else None


def carried_correction(lam: torch.Tensor, step: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    r"""The state ``carry`` keeps: $C = \Lambda + \eta\,\bar\sigma(Y)\,N(J) - N(\hat G)$, $\eta$ =
    ``CARRY_STEP``, for the last joint msign $J = \operatorname{msign}(Y)$, $Y = \hat G - W\Lambda$, and
    ``base`` $= N(\hat G)$, the start without it. A dual-ascent step: where $Y \approx \bar\sigma J$, $\eta = 1$
    removes the normal part $W\,\bar\sigma N(J)$ of $Y$; its fixed point $N(J) = 0$ is the optimum's condition,
    $J$ tangent. Carried as the correction to
    $N(\hat G)$, which the next step recomputes for its own $W$ and $G$; no product more (the joint msign's $N(J)$
    is $K$'s own)."""
    return lam + CARRY_STEP * step - base


def gram_joint_square_part(split: ColumnSplit, E: torch.Tensor, MR: torch.Tensor, opts: dict):
    r"""``(K, K^T K, step)``: `joint_square_part` of $Y = UE + R$ ($U^\top R = 0$) from $n \times n$ matrices:
    $M = Y^\top Y = E^\top E + R^\top R$ and $U^\top \operatorname{msign}(Y) = E\,F(M)$ (`gram_msign_factor`),
    tangent at the square point $H_0$ of ``split`` ($D = \operatorname{diag}(d)$ on Stiefel and DGram), scaled by the
    Schatten bound (the spectrum of $K$ is spread); ``step`` $= \bar\sigma(Y)\,N(J)$ with $W^\top J = H_0^\top EF$
    and $\bar\sigma = \langle M, F\rangle / n$ (no product more)."""
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
    r"""`filled_split_direction` with every msign in Gram space: after $H = U^\top \hat G$, $R = \hat G - UH$,
    $R^\top R$ and $U^\top R$ (four $mn^2$ products) the work is $n \times n$, and
    $A = U(\alpha K - U^\top R\,N) + RN$ (the complement's rounding in the span of $U$ removed, as the tall path's
    $Q - UU^\top Q$) costs two more, the final bound one. $Q = R\,F(R^\top R)$ and
    $S = \operatorname{sym}(F(R^\top R)\,R^\top R)$; the joint msign of $\hat G - W\Lambda = UE + R$,
    $E = H - D\Lambda$, is `gram_joint_square_part`. The same direction
    as the tall path to rounding (tested), at 35-60% of its products; $A$'s final bound is
    ``"near_unit"`` (the fill makes its singular values 1). ``correction`` and ``opts["carry"]`` as there (no product
    more: $W^\top J = DEF$). Works in float32 at least; a square matrix (no complement) takes the tall path."""
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


def in_gram_space(opts: dict) -> bool:
    """Whether the $m \times n$ msigns run in Gram space: ``space="gram"`` with a polynomial msign (`GRAM_MSIGNS`;
    ``"svd"`` has no Gram form and takes the tall path)."""
    return opts["space"] == "gram" and opts["msign"] in GRAM_MSIGNS


def unsplit_direction(manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, opts: dict) -> torch.Tensor:
    r"""$P_T(\operatorname{msign}(P_T\hat G))$ scaled into the unit spectral ball (`feasible_direction`), for masks
    whose columns need not be orthogonal (Oblique), where no split exists; $G = 0$ gives $A = 0$ exactly."""
    Gn, _ = normalise(G)
    return feasible_direction(manifold, W, msign_with(tangent_part(manifold, W, Gn), opts))


def solve_filled_split(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, state: dict | None, opts: dict
) -> tuple[torch.Tensor, dict, dict | None]:
    """The solver's entry (``(B, m, n)`` tall batches): the direction, its statistics (one joint $m \times n$ msign,
    one more for the complement of a tall matrix) and, with ``carry`` on a tall matrix, the new state
    ``{"correction": C}``; on Oblique (and Euclidean) matrices `unsplit_direction`, no state."""
    if manifold.mask_form in (MaskForm.DIAGONAL, MaskForm.ZERO):  # no split there (not selected by training)
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
    carries=lambda options: options["carry"],  # otherwise it returns no state and ignores the one passed in
    summary="products only: the square part from a joint msign at its best share; the complement fills the rest",
)
