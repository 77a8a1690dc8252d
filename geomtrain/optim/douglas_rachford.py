r"""Douglas-Rachford splitting for degenerate duals (square and near-square DGram, custom masks).

Below aspect ratio 2 the dual optimum is typically degenerate ($Y^\star$ loses rank; the optimal
$A$ is not unique) and dual iterations crawl. Douglas-Rachford works on the primal instead,
between the tangent space and the unit spectral ball, in the Gram-space coefficients of
`GramDual`: with $\rho = \sigma_{\mathrm{rms}}(\hat G) = n^{-1/2}$ and relaxation $\lambda = 1.5$,

$$x = \Pi_T(z + \hat G/\rho),\qquad y = \Pi_{\mathrm{ball}}(2x - z),\qquad z \leftarrow z + \lambda (y - x),$$

started at the fixed point implied by the current dual iterate, $z_0 = A_0 - Y/\rho$, and
Anderson-accelerated (depth 2) with a safeguard on the fixed-point residual $\|y - x\|_F$.
At a fixed point $z^\star$, $-\rho S_F(z^\star + \hat G/\rho)$ is a dual optimum.

**The start's conditioning.** $A_0 = Y R_0$ with $R_0 = V\min(r, \kappa\, r_{\min})V^\top$, the
smoothed $M^{-1/2}$ of the dual iterate with its condition number capped at
$\kappa = \max(10, \tfrac14\,\mathrm{tol}/\varepsilon)$ ($\varepsilon$ the unit roundoff). Near a degenerate
optimum (a warm start) $R$ has eigenvalues up to $1/\tau$, and $z_0$'s coefficients then grow like
$1/\tau$ while the matrix they stand for stays of norm about 1; the rounding of that cancellation,
$\varepsilon/\tau$, is a floor on the residual (in float32 about $2.5\cdot10^{-4}$ at $n = 128$:
the iteration never reached ``tol``). With the cap the rounding stays below a quarter of ``tol``;
any start is a valid one for Douglas-Rachford, and float64 ($\kappa \approx 10^{11}$) is unchanged.
"""

from __future__ import annotations

import math

import torch

from .gram import GramDual
from .numerics import Anderson, Trace, WorkingSet, safeguarded_mix, start_safeguard

__all__ = ["douglas_rachford", "start_weights", "DR_RELAX", "DR_ANDERSON"]

DR_RELAX = 1.5  # over-relaxed Douglas-Rachford: 10-20% fewer evaluations than 1.0 (measured)
DR_ANDERSON = 2  # deeper Anderson histories destabilise Douglas-Rachford on these problems (measured)
# The start's condition number is capped at max(DR_START_MIN_CAP, tol / (4 eps)) (module docstring). Measured,
# float32 near-square DGram (48x32, 96x64, 192x128, batches of 4) warm-started from the multiplier of the same
# problem: caps of 1000 and none never converged (52 evaluations, polished); 100 and 300 took 15-21, fewer
# than cold; 10 converged too, with 22% more evaluations than 100-300. At a gradient changed by 5% or 30% every
# cap took the same evaluations.
DR_START_MIN_CAP = 10.0


def start_weights(r: torch.Tensor, tol: float) -> torch.Tensor:
    r"""The eigenvalues $r$ of the iterate's $R$ with the condition number capped (the module's *start's
    conditioning*): $\min(r, \kappa\, r_{\min})$, $\kappa = \max(10, \tfrac14\,\mathrm{tol}/\varepsilon)$."""
    cap = max(DR_START_MIN_CAP, 0.25 * tol / torch.finfo(r.dtype).eps)
    return torch.minimum(r, cap * r.amin(-1, keepdim=True))


def douglas_rachford(
    dual: GramDual,
    S: torch.Tensor,
    V: torch.Tensor,
    r: torch.Tensor,
    tol: float,
    budget: torch.Tensor,
    depth: int,
    trace: Trace | None = None,
):
    """Run Douglas-Rachford from the dual iterate ``S`` (``V``, ``r``: the eigenvectors of its $M$ and the
    eigenvalues of its $R$) for at most ``budget`` evaluations per entry.

    Returns ``(Z, res, S_dual, used)``: the coefficients of the best ball point $y$ (lowest tangent
    residual), its residual, the implied dual multiplier and the evaluations used.
    """
    B, n = S.shape[0], S.shape[-1]
    rho = n**-0.5
    eye = torch.eye(n, dtype=S.dtype, device=S.device).expand(B, n, n)
    R = (V * start_weights(r, tol).unsqueeze(-2)) @ V.mT
    Z = torch.stack([R - eye / rho, S @ R - S / rho], 1)
    G_rho = torch.stack([eye / rho, torch.zeros_like(S)], 1)
    out = {
        "best_res": torch.full((B,), math.inf, dtype=S.dtype, device=S.device),
        "best_Y": torch.zeros_like(Z),
        # the safeguard's anchor (the lowest |y - x|_F, but for a plain step accepted at the rounding floor):
        # its implied multiplier is returned
        "anchor_x": Z.clone(),
        "used": torch.zeros(B, dtype=torch.long, device=S.device),
    }
    idx = (budget > 0).nonzero().squeeze(-1)
    ws = WorkingSet(idx, {name: value[idx] for name, value in out.items()}, out)
    ws["Z"], ws["budget"] = Z[idx], budget[idx]
    start_safeguard(ws, ws["Z"])  # the safeguard of the mixing, on |y - x|_F
    sub, G_sub, mixer = dual.sub(idx), G_rho[idx], Anderson(depth, ws["Z"])
    while len(ws):
        Za = ws["Z"]
        X = sub.proj_tangent(Za + G_sub)
        Y, res, prim = sub.proj_ball(2 * X - Za)
        F = Y - X
        fn = sub.frobenius(F)
        ws["used"] = ws["used"] + 1
        if trace is not None and int(ws.idx[0]) == 0:
            trace.add(res[0], prim[0])
        imp = res < ws["best_res"]
        ws["best_res"] = torch.where(imp, res, ws["best_res"])
        ws["best_Y"] = torch.where(imp[:, None, None, None], Y, ws["best_Y"])
        ws["Z"] = safeguarded_mix(mixer, ws, Za, F, fn, DR_RELAX)
        keep = ws.shrink((res > tol) & (ws["used"] < ws["budget"]))  # the iteration's one host synchronisation
        if keep is not None:
            sub, G_sub = sub.sub(keep), G_sub[keep]
            mixer.compact(keep)
    best_res, best_Y, best_Z, used = out["best_res"], out["best_Y"], out["anchor_x"], out["used"]
    S_dual = dual.implied_dual(best_Z + G_rho, rho)
    return best_Y, best_res, S_dual, used
