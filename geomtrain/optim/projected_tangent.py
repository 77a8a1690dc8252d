r"""Solver ``"projected_tangent"``: msigns alternated with tangent projections, products only.

$$A = \frac{X_k}{\overline{\|X_k\|}_{\mathrm{op}}},\qquad X_j = P_T(\operatorname{msign}(X_{j-1})),\quad
X_0 = P_T(\hat G),\quad \hat G = G / \|G\|_F,$$

with $k$ = ``rounds`` (default 1: one msign).
$P_T$ the closed-form tangent projection (`geomtrain.optim.products.tangent_part`, two $mn^2$ products) and
$\overline{\|\cdot\|}_{\mathrm{op}}$ a guaranteed upper bound on the spectral norm
(`geomtrain.optim.products.op_norm_upper_bound`: normalised squarings of the $n \times n$ Gram matrix), so
$A$ is feasible by construction: tangent to rounding and $\|A\|_{\mathrm{op}} \le 1$. Cost per round: one msign
and two $mn^2$ products (the projection), then the bound's few $n^3$ products; no warm-start state, no
certificate. More rounds are alternating projections between the tangent space and the matrices with unit
singular values: each round fills the spectrum that a projection thins (one round leaves the singular values of
a DGram direction at a median of about 0.75 of the largest; the exact direction's are all 1), slowly. The plain
``"tangent"`` solver stops after the first msign, whose projection it skips: its direction is not tangent.
"""

from __future__ import annotations

import torch

from manifolds import GramManifold

from .baselines import MSIGN_OPTIONS, msign_with
from .numerics import normalise
from .products import check_products_kind, feasible_direction, feasible_stats, tangent_part
from .solver import Solver, is_int

__all__ = ["OPTIONS", "SOLVER", "projected_tangent_direction", "solve_projected_tangent"]

OPTIONS = {"rounds": 1, **MSIGN_OPTIONS}


def projected_tangent_direction(
    manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, opts: dict, bound: str = "schatten"
) -> torch.Tensor:
    r"""$X_k$ (``opts["rounds"]`` rounds of $X \leftarrow P_T(\operatorname{msign}(X))$ from $P_T \hat G$) scaled into
    the unit spectral ball (`geomtrain.optim.products.scale_to_ball`, with ``bound``), for tall
    ``(..., m, n)`` (``opts``: ``rounds``, ``msign``, ``msign_steps``, ``msign_dtype``); $G = 0$ gives $A = 0$
    exactly."""
    Gn, _ = normalise(G)
    X = tangent_part(manifold, W, Gn)
    for _ in range(opts["rounds"] - 1):
        X = tangent_part(manifold, W, msign_with(X, opts))
    return feasible_direction(manifold, W, msign_with(X, opts), bound)


def solve_projected_tangent(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, state: dict | None, opts: dict
) -> tuple[torch.Tensor, dict, None]:
    """The solver's entry (``(B, m, n)`` tall batches): the direction and its statistics (``rounds`` msigns each)."""
    check_products_kind(manifold, "projected_tangent")
    A = projected_tangent_direction(manifold, T, G, opts)
    return A, feasible_stats(manifold, T, G, A, opts["rounds"], opts), None


SOLVER = Solver(
    name="projected_tangent",
    solve=solve_projected_tangent,
    options=OPTIONS,
    rules={"rounds": (lambda v: is_int(v) and v >= 1, "an integer >= 1")},
    summary="products only: P_T(msign(P_T G)) (rounds: alternated again) scaled by a spectral-norm bound; no state",
)
