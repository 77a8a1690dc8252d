r"""Solver ``"admm"``: $k$ steps of ADMM on the dual $\min_S \|\hat G + WS\|_*$, products only, warm-startable.

Split $\Omega = \hat G + WS$ with the multiplier $\Lambda$ of that equality, which is the primal direction
(the Lagrangian's dual in $\Lambda$ is $\max \langle \hat G, \Lambda\rangle$ over tangent $\Lambda$ with
$\|\Lambda\|_{\mathrm{op}} \le 1$). With threshold $t = 1/\rho$, one step is

$$S = N_W(\Omega - \hat G - t\Lambda),\quad B = \hat G + WS + t\Lambda,\quad
\Omega = \operatorname{svt}_t(B),\quad \Lambda = (B - \Omega)/t,$$

$N_W$ the normal multiplier (`geomtrain.optim.products.normal_multiplier`: $WN_W(U)$ is the least-squares
fit of $U$ by $\{WS\}$) and $\operatorname{svt}_t$ singular-value soft-thresholding by two msigns (Buchanan's
form): $\operatorname{svt}_t(B) = (B - tQ_B)\,\tfrac12\big(I + \operatorname{msign}(B^\top B - t^2 I)\big)$,
$Q_B = \operatorname{msign}(B)$, the second an $n \times n$ symmetric sign; $\Lambda = (B - \Omega)/t$ is then
the projection of $B/t$ onto the unit spectral ball. Start from the warm multiplier $S$ (``dual=``):
$Y = \hat G + WS$, $\Lambda = \operatorname{msign}(Y)$, $\Omega = Y$, $t = \tau\,\langle Y, \Lambda\rangle/n$
(``threshold`` $\tau$ times the mean singular value of $Y$: scale-invariant). The first $S$-update is then
the `geomtrain.optim.dual_ascent` step with $\eta = \tau$. The direction is $\Lambda$ made feasible
(`geomtrain.optim.products.feasible_direction`); the new state is the $S$-update at the last iterate. Cost:
$1 + 2k$ msigns ($k$ of them $n \times n$; ``steps=1``: the 3-msign budget).
"""

from __future__ import annotations

import torch

from manifolds import GramManifold

from .baselines import MSIGN_OPTIONS, msign_with
from .numerics import normalise
from .products import (
    carried_multiplier,
    check_products_kind,
    feasible_direction,
    feasible_stats,
    mean_singular_value,
    normal_multiplier,
)
from .solver import POSITIVE, Solver, StateSlot

__all__ = ["OPTIONS", "SOLVER", "admm_direction", "solve_admm", "singular_value_threshold"]

OPTIONS = {"steps": 1, "threshold": 3.0, **MSIGN_OPTIONS}


def singular_value_threshold(B: torch.Tensor, t: torch.Tensor, opts: dict) -> torch.Tensor:
    r"""$U(\Sigma - t)_+V^\top$ of a tall ``B`` by two msigns: $(B - tQ_B)\tfrac12(I + \operatorname{msign}(B^\top B -
    t^2 I))$; ``t`` broadcasts as ``(..., 1, 1)``."""
    n = B.shape[-1]
    eye = torch.eye(n, dtype=B.dtype, device=B.device)
    above = 0.5 * (eye + msign_with(B.mT @ B - t.square() * eye, opts).to(B.dtype))
    return (B - t * msign_with(B, opts).to(B.dtype)) @ above


def admm_direction(
    manifold: GramManifold,
    W: torch.Tensor,
    G: torch.Tensor,
    S: torch.Tensor | None,
    opts: dict,
    bound: str = "schatten",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(A, S)`` for tall ``(..., m, n)``: ``opts["steps"]`` ADMM steps from the multiplier ``S``
    (None: the tangent start $-N_W(\hat G)$, $Y = P_T(\hat G)$); ``bound`` goes to the final scaling
    (`geomtrain.optim.products.scale_to_ball`).
    A matrix with $G = 0$ gets $A = 0$ exactly and its $S$ back unchanged."""
    Gn, zero = normalise(G)
    S_in = -normal_multiplier(manifold, W, Gn) if S is None else S  # cold: the tangent start, Y = P_T(G)
    Y = Gn + W @ S_in.to(W.dtype)
    Lam = msign_with(Y, opts).to(W.dtype)
    t = float(opts["threshold"]) * mean_singular_value(Y, Lam)
    t = torch.where(t > 0, t, torch.ones_like(t))  # G = 0 and S = 0: nothing to threshold (A is 0 below)
    Omega = Y
    for _ in range(int(opts["steps"])):
        S = normal_multiplier(manifold, W, Omega - Gn - t * Lam)
        B = Gn + W @ S + t * Lam
        Omega = singular_value_threshold(B, t, opts)
        Lam = (B - Omega) / t
    S = normal_multiplier(manifold, W, Omega - Gn - t * Lam)
    A = feasible_direction(manifold, W, Lam, bound)
    return torch.where(zero, torch.zeros_like(A), A), torch.where(zero, S_in.to(S), S)


def solve_admm(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, state: dict | None, opts: dict
) -> tuple[torch.Tensor, dict, dict]:
    """The solver's entry (``(B, m, n)`` tall batches): direction, statistics, new state ``{"dual": S}``."""
    check_products_kind(manifold, "admm")
    A, S = admm_direction(manifold, T, G, carried_multiplier(state, T), opts)
    return A, feasible_stats(manifold, T, G, A, 1 + 2 * int(opts["steps"]), opts), {"dual": S}


SOLVER = Solver(
    name="admm",
    solve=solve_admm,
    options=OPTIONS,
    rules={"threshold": (POSITIVE, "a finite number > 0")},
    state=(StateSlot("dual", "dual", "matrix"),),
    warm_starts=True,
    summary="products only: `steps` ADMM steps on the dual from the carried multiplier S (1 + 2 steps msigns)",
)
