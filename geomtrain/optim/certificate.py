r"""The exact float64 certificate of any direction. A solver's $A$ is first made feasible,
$A_f = \Pi_T(A) / \max(1, \|\Pi_T(A)\|_{\mathrm{op}})$; with $U \ge \|\hat G + WS\|_* \ge \mathrm{OPT}$
(`GramDual.certify`) at the solver's ``multiplier`` $S$ (else an ``exact`` float64 solve's), the relative gap
$(U - \langle\hat G, A_f\rangle)/U$ bounds the suboptimality of $A_f$.
"""

from __future__ import annotations

import torch

from manifolds import GramManifold

from .gram import CERTIFICATE_SMOOTHING, GramDual, tangent_residual
from .gram_newton import SOLVER as EXACT
from .numerics import normalise

__all__ = ["certify"]


def certify(
    manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, A: torch.Tensor, multiplier: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(gap, residual)`` per matrix of tall ``(B, m, n)`` inputs, float64 on the CPU: the gap of $A_f$ (0 where
    $G = 0$) and the tangent residual of ``A``; ``multiplier``: $S$ ``(B, n, n)``, else solved for here."""
    T, G64, A64 = W.double(), G.double(), A.double()
    B, n = T.shape[0], T.shape[-1]
    residual = tangent_residual(manifold, T, A64)
    gap = torch.zeros(B, dtype=torch.float64, device=T.device)
    live = G64.flatten(1).ne(0).any(1).nonzero().squeeze(-1)
    if len(live):
        T, G64, A64 = T[live], G64[live], A64[live]
        P = manifold.proju(T, A64)
        top = torch.linalg.eigvalsh(P.mT @ P)[..., -1].clamp_min(0).sqrt()
        A_f = P / top.clamp_min(1.0)[:, None, None]
        if multiplier is None:
            options = {**EXACT.options, "compute_dtype": torch.float64}
            multiplier = EXACT.solve(manifold, T, G64, None, options)[1]["multiplier"]
        else:
            multiplier = multiplier.reshape(B, n, n)[live.to(multiplier.device)]
        Gh = normalise(G64)[0]
        dual = GramDual(manifold, T, Gh, torch.float64, CERTIFICATE_SMOOTHING)
        S = multiplier.to(device=T.device, dtype=torch.float64)
        ev = dual.evaluate(S)
        U = dual.certify(S, ev.weights(), ev.r, ev.V, ev.lam)[2]
        value = (A_f * Gh).sum(dim=(-2, -1))
        gap[live] = (U - value) / U.clamp_min(torch.finfo(torch.float64).tiny)
    return gap.cpu(), residual.double().cpu()
