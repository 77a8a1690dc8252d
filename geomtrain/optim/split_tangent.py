r"""Solver ``"split_tangent"``: the direction solved apart in the span of $W$ and in its complement, products only.

On Stiefel and DGram the columns of $W$ are orthogonal: $W = UD$, $U^\top U = I$, $D = \operatorname{diag}(d)$ the
column norms. Every $A$ splits as $A = U K + B$ with $K = U^\top A$ ($n \times n$) and $U^\top B = 0$; then
$A^\top A = K^\top K + B^\top B$, the constraint $L_W(A) = P(DK + K^\top D) = 0$ falls on $K$ alone (it is the
square problem's at the diagonal point $D$) and $B$ is free. Each part gets the unit spectral ball on its own,

$$K = \mathrm{PT}_D(H),\quad H = U^\top \hat G,\qquad B = \operatorname{msign}(\hat G - UH),$$

($\mathrm{PT}_D$ the ``projected_tangent`` direction of the square problem at $D$, ``rounds`` rounds; on
Stiefel, $D = I$, it is $\operatorname{msign}(\operatorname{skew} H)$, already the square problem's optimum; with
``sub_steps`` $k \ge 1$, on DGram, $k$ steps of `geomtrain.optim.admm` there instead, $1 + 2k$ $n \times n$
msigns: closer to the square optimum), and
they share the budget at the angle that maximises $\langle \hat G, A\rangle$:

$$A = \frac{c\,UK + fB}{\sqrt{c^2 + f^2}},\qquad c = \langle H, K\rangle,\ f = \langle \hat G - UH, B\rangle,$$

so $A^\top A = (c^2 K^\top K + f^2 B^\top B)/(c^2 + f^2) \preceq I$: every singular value of $A$ is 1 where both
parts have full rank. `geomtrain.optim.products.scale_to_ball` keeps $\|K\|_{\mathrm{op}}, \|B\|_{\mathrm{op}} \le 1$
against the msigns' rounding (``"near_unit"``: tight where the singular values are 0 or 1; on DGram's $K$,
whose spectrum is spread, the smaller of both bounds), hence $\|A\|_{\mathrm{op}} \le 1$. Feasible by
construction (tangent to rounding); suboptimal only through the shared angle (one $\theta$ for all directions,
where the optimum couples $K$ and $B$ direction by direction) and through $\mathrm{PT}_D$ on DGram. Cost: one
$m \times n$ msign, ``rounds`` $n \times n$ ones, a few $mn^2$ products and the bounds' $n^3$ ones. No state,
no certificate. On Oblique, whose columns are not orthogonal, it is ``projected_tangent``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from manifolds import GramManifold

from .admm import admm_direction
from .baselines import MSIGN_OPTIONS, msign_with
from .gram import mask_kind
from .numerics import normalise
from .products import GRAM_MSIGNS, check_products_kind, feasible_stats, gram_msign_factor, scale_to_ball
from .projected_tangent import projected_tangent_direction
from .solver import Solver, is_int

__all__ = [
    "OPTIONS",
    "SOLVER",
    "SplitParts",
    "split_basis",
    "square_part",
    "square_msigns",
    "split_parts",
    "split_tangent_direction",
    "in_gram_space",
    "complement_msign",
    "solve_split_tangent",
]

# 6 Polar Express steps: 5 leave singular values up to 1.1 and down to 0.7, which the bounds then cut (a 15%
# certified gap on training's matrices); 6 reach the gap of 8 (5% on Stiefel's c_attn, 8% on a DGram MLP)
OPTIONS = {"rounds": 1, "sub_steps": 0, **MSIGN_OPTIONS, "msign_steps": 6, "space": "gram"}
SPACES = ("gram", "tall")  # where the m x n msigns run: from the n x n Gram matrices, or on the m x n matrices
SUB_THRESHOLD = 3.0  # the ADMM threshold of the square part: the `admm` solver's default
KINDS = ("stiefel", "dgram")  # orthogonal columns: the split above holds


def square_by_admm(kind: str, opts: dict) -> bool:
    """Whether the square part is solved by ``sub_steps`` ADMM steps: on DGram only (on Stiefel the projection
    already gives the square optimum)."""
    return bool(opts["sub_steps"]) and kind == "dgram"


def square_msigns(kind: str, opts: dict) -> int:
    """The msigns of the square part (`square_part`): ``1 + 2 sub_steps`` by ADMM, else ``rounds``."""
    return 1 + 2 * opts["sub_steps"] if square_by_admm(kind, opts) else opts["rounds"]


class SplitParts(NamedTuple):
    r"""The split of $\hat G$ at $W = UD$: ``U``, $H = U^\top \hat G$, the square part's direction $K$ (tangent at
    $D$, $\|K\|_{\mathrm{op}} \le 1$) and the complement $R = \hat G - UH$."""

    U: torch.Tensor
    H: torch.Tensor
    K: torch.Tensor
    R: torch.Tensor


def split_basis(W: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``(Ĝ, U, H)`` for tall ``(..., m, n)`` $W = UD$ with orthogonal columns: $\hat G = G / \|G\|_F$, the unit
    columns $U$ (a zero column stays zero) and $H = U^\top \hat G$."""
    Gn, _ = normalise(G)
    d = W.norm(dim=-2)
    U = W / torch.where(d == 0, torch.ones_like(d), d)[..., None, :]
    return Gn, U, U.mT @ Gn


def square_part(
    manifold: GramManifold, W: torch.Tensor, H: torch.Tensor, opts: dict, point: torch.Tensor | None = None
) -> torch.Tensor:
    r"""$K$, the square problem's direction at $D = \operatorname{diag}(\|w_i\|)$ (or at ``point``, the $H_0$ of
    `geomtrain.optim.column_split.ColumnSplit` for a custom mask) for $H$: ``sub_steps`` ADMM steps on DGram, else
    its ``projected_tangent`` direction (``rounds`` rounds)."""
    D, kind = torch.diag_embed(W.norm(dim=-2)) if point is None else point, mask_kind(manifold)
    if square_by_admm(kind, opts):
        sub = {**opts, "steps": opts["sub_steps"], "threshold": SUB_THRESHOLD}
        return admm_direction(manifold, D, H, None, sub, bound="both")[0]
    # on Stiefel K = msign(skew H), the square optimum: its singular values are 0 or 1
    return projected_tangent_direction(manifold, D, H, opts, bound="near_unit" if kind == "stiefel" else "both")


def split_parts(manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, opts: dict) -> SplitParts:
    """`SplitParts` for tall ``(..., m, n)`` on Stiefel or DGram (`split_basis`, `square_part`)."""
    Gn, U, H = split_basis(W, G)
    return SplitParts(U, H, square_part(manifold, W, H, opts), Gn - U @ H)


def in_gram_space(opts: dict) -> bool:
    """Whether the $m \times n$ msigns run in Gram space: ``space="gram"`` with a polynomial msign (`GRAM_MSIGNS`;
    ``"svd"`` has no Gram form and takes the tall path)."""
    return opts["space"] == "gram" and opts["msign"] in GRAM_MSIGNS


def complement_msign(R: torch.Tensor, opts: dict) -> torch.Tensor:
    r"""$\operatorname{msign}(R)$ of the complement ``(..., m, n)`` as ``opts`` ask: ``space="gram"`` (with a Polar
    Express, Newton-Schulz or Keller Jordan msign) as $R\,F(R^\top R)$ (`gram_msign_factor`: two $mn^2$ products
    and $n^3$ ones, in float32 at least), else on $R$ itself."""
    if in_gram_space(opts):
        Rw = R.to(torch.promote_types(R.dtype, torch.float32))
        return (Rw @ gram_msign_factor(Rw.mT @ Rw, opts["msign"], int(opts["msign_steps"]))).to(R.dtype)
    return msign_with(R, opts).to(R.dtype)


def split_tangent_direction(manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, opts: dict) -> torch.Tensor:
    r"""$A$ above for tall ``(..., m, n)`` on Stiefel or DGram (``opts``: ``rounds``, ``msign``, ``msign_steps``,
    ``msign_dtype``)."""
    U, H, K, R = split_parts(manifold, W, G, opts)
    if W.shape[-2] > W.shape[-1]:
        B = complement_msign(R, opts)
        B = scale_to_ball(B - U @ (U.mT @ B), bound="near_unit")
    else:  # square: no complement (R is rounding)
        B = torch.zeros_like(R)
    c = (H * K).sum(dim=(-2, -1), keepdim=True)
    f = (R * B).sum(dim=(-2, -1), keepdim=True)
    r = torch.sqrt(c * c + f * f)
    r = torch.where(r == 0, torch.ones_like(r), r)
    return (c / r) * (U @ K) + (f / r) * B  # A^T A = (c^2 K^T K + f^2 B^T B) / r^2: ||A||_op <= 1 as K's, B's


def solve_split_tangent(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, state: dict | None, opts: dict
) -> tuple[torch.Tensor, dict, None]:
    """The solver's entry (``(B, m, n)`` tall batches): the direction and its statistics (``rounds`` + 1 msigns, a
    square matrix ``rounds``); on Oblique (and Euclidean) matrices, whose columns need not be orthogonal,
    ``projected_tangent``'s."""
    kind = check_products_kind(manifold, "split_tangent")
    if kind not in KINDS:  # Oblique: columns not orthogonal, no split
        A = projected_tangent_direction(manifold, T, G, opts)
        return A, feasible_stats(manifold, T, G, A, opts["rounds"], opts), None
    A = split_tangent_direction(manifold, T, G, opts)
    tall = T.shape[-2] > T.shape[-1]  # a square matrix has no complement: no msign for it
    return A, feasible_stats(manifold, T, G, A, square_msigns(kind, opts) + int(tall), opts), None


SOLVER = Solver(
    name="split_tangent",
    solve=solve_split_tangent,
    options=OPTIONS,
    rules={
        "rounds": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
        "sub_steps": (lambda v: is_int(v) and v >= 0, "an integer >= 0 (0: projected_tangent on the square part)"),
        "space": (lambda v: v in SPACES, f"one of {', '.join(SPACES)}"),
    },
    summary="products only, Stiefel/DGram: an msign in the span of W, one in its complement, at the best angle",
)
