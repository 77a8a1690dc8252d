r"""Solver ``"projected_tangent"``: one msign between two tangent projections, products only.

$$A = \frac{P_T(Q)}{\overline{\|P_T(Q)\|}_{\mathrm{op}}},\qquad Q = \operatorname{msign}(P_T(\hat G)),\quad
\hat G = G / \|G\|_F,$$

$P_T$ the closed-form tangent projection (`geomtrain.optim.products.tangent_part`, two $mn^2$ products) and
$\overline{\|\cdot\|}_{\mathrm{op}}$ a guaranteed upper bound on the spectral norm
(`geomtrain.optim.products.op_norm_upper_bound`: normalised squarings of the $n \times n$ Gram matrix), so
$A$ is feasible by construction: tangent to rounding and $\|A\|_{\mathrm{op}} \le 1$. Cost: one msign, four
$mn^2$ products and $k$ $n^3$ products; no warm-start state, no certificate. The plain ``"tangent"`` solver
stops after $Q$, whose second projection it skips: $Q$ is not tangent.
"""

from __future__ import annotations

import torch

from manifolds import GramManifold

from .baselines import MSIGN_OPTIONS, msign_with
from .numerics import normalise
from .products import check_products_kind, feasible_direction, feasible_stats, tangent_part
from .solver import Solver

__all__ = ["OPTIONS", "SOLVER", "projected_tangent_direction", "solve_projected_tangent"]

OPTIONS = dict(MSIGN_OPTIONS)


def projected_tangent_direction(manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, opts: dict) -> torch.Tensor:
    r"""$P_T(\operatorname{msign}(P_T \hat G))$ scaled into the unit spectral ball, for tall ``(..., m, n)``
    (``opts``: ``msign``, ``msign_steps``, ``msign_dtype``); $G = 0$ gives $A = 0$ exactly."""
    Gn, _ = normalise(G)
    return feasible_direction(manifold, W, msign_with(tangent_part(manifold, W, Gn), opts))


def solve_projected_tangent(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, state: dict | None, opts: dict
) -> tuple[torch.Tensor, dict, None]:
    """The solver's entry (``(B, m, n)`` tall batches): the direction and its statistics (one msign each)."""
    check_products_kind(manifold, "projected_tangent")
    A = projected_tangent_direction(manifold, T, G, opts)
    return A, feasible_stats(manifold, T, G, A, 1, opts), None


SOLVER = Solver(
    name="projected_tangent",
    solve=solve_projected_tangent,
    options=OPTIONS,
    summary="products only: P_T(msign(P_T G)) scaled by a guaranteed spectral-norm bound; feasible, no state",
)
