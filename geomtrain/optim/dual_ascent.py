r"""Solver ``"dual_ascent"``: a streaming (amortised) dual ascent on $\min_S \|\hat G + WS\|_*$, products only.

The multiplier $S = P(S)$ (symmetric, ``(..., n, n)``) is carried from one training step to the next
(``dual=``, the optimizer's warm-start state, checkpointed with it); each solve takes ``steps`` normalised
descent steps on the dual and returns a feasible direction:

$$Y = \hat G + WS,\quad Q = \operatorname{msign}(Y),\quad S \leftarrow S - \eta\, \bar\sigma(Y)\, N_W(Q),
\qquad A = \operatorname{fix}\big(\operatorname{msign}(\hat G + WS)\big).$$

$N_W(Q)$ is the dual gradient $P(\operatorname{sym}(W^\top Q))$ preconditioned by the Gram metric, the
multiplier of the normal part of $Q$ ($W N_W(Q) = Q - P_T(Q)$, `geomtrain.optim.products.normal_multiplier`),
and $\bar\sigma(Y) = \langle Y, Q\rangle / n$ the mean singular value of $Y$: where the spectrum of $Y$ is
flat, $Y \approx \bar\sigma Q$, the step with $\eta = 1$ moves $Y$ to $\bar\sigma P_T(Q)$ (scale-invariant:
$\hat G = G/\|G\|_F$). fix is `geomtrain.optim.products.feasible_direction` (tangent projection, then a
guaranteed spectral-norm rescale), so every returned $A$ is feasible whatever the state of $S$. Cost: ``steps``
$+ 1$ msigns (default 2; ``steps=2`` is the 3-msign budget) and a few $mn^2$ products. The dual ascent of
Bernstein's manifold Muon, with a Gram-metric step instead of a fixed rate, run one step per training step.
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

__all__ = ["OPTIONS", "SOLVER", "dual_ascent_direction", "solve_dual_ascent"]

OPTIONS = {"steps": 1, "eta": 0.25, **MSIGN_OPTIONS}


def dual_ascent_direction(
    manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, S: torch.Tensor | None, opts: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(A, S)`` for tall ``(..., m, n)``: ``opts["steps"]`` dual steps from ``S``
    (None: the tangent start $-N_W(\hat G)$, $Y = P_T(\hat G)$), then the fixed
    $\operatorname{msign}(\hat G + WS)$. A matrix with $G = 0$ gets $A = 0$ exactly and its $S$ back unchanged."""
    Gn, zero = normalise(G)
    S_in = -normal_multiplier(manifold, W, Gn) if S is None else S  # cold: the tangent start, Y = P_T(G)
    S = S_in.to(W.dtype)
    eta = float(opts["eta"])
    for _ in range(int(opts["steps"])):
        Y = Gn + W @ S
        Q = msign_with(Y, opts).to(W.dtype)
        S = S - eta * mean_singular_value(Y, Q) * normal_multiplier(manifold, W, Q)
    A = feasible_direction(manifold, W, msign_with(Gn + W @ S, opts))
    return torch.where(zero, torch.zeros_like(A), A), torch.where(zero, S_in.to(S), S)


def solve_dual_ascent(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, state: dict | None, opts: dict
) -> tuple[torch.Tensor, dict, dict]:
    """The solver's entry (``(B, m, n)`` tall batches): direction, statistics, new state ``{"dual": S}``."""
    check_products_kind(manifold, "dual_ascent")
    A, S = dual_ascent_direction(manifold, T, G, carried_multiplier(state, T), opts)
    return A, feasible_stats(manifold, T, G, A, int(opts["steps"]) + 1, opts), {"dual": S}


SOLVER = Solver(
    name="dual_ascent",
    solve=solve_dual_ascent,
    options=OPTIONS,
    rules={"eta": (POSITIVE, "a finite number > 0")},
    state=(StateSlot("dual", "dual", "matrix"),),
    warm_starts=True,
    summary="products only: `steps` Gram-metric dual steps on the carried multiplier S, then feasible msign(G + WS)",
)
