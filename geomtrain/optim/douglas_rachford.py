r"""Douglas-Rachford splitting for degenerate duals (near-square DGram, custom masks), where dual iterations crawl.

It works on the primal, between the tangent space and the unit spectral ball, in the Gram-space coefficients of
`GramDual` ($\rho = n^{-1/2}$, relaxation $\lambda$ = ``DR_RELAX``, Anderson-accelerated and safeguarded):

$$x = \Pi_T(z + \hat G/\rho),\qquad y = \Pi_{\mathrm{ball}}(2x - z),\qquad z \leftarrow z + \lambda (y - x),$$

from $z_0 = A_0 - Y/\rho$ at the dual iterate; at a fixed point, $-\rho S_F(z^\star + \hat G/\rho)$ is a dual optimum.

**The start's conditioning.** $A_0 = Y R_0$, $R_0 = V\min(r, \kappa\, r_{\min})V^\top$, $\kappa = \max(10,
\tfrac14\,\mathrm{tol}/\varepsilon)$: near a degenerate optimum $R$ has eigenvalues up to $1/\tau$, and the rounding
$\varepsilon/\tau$ of $z_0$'s cancelling coefficients would floor the residual; capped, it stays below ``tol``/4.
"""

from __future__ import annotations

import math

import torch

from .gram import GramDual
from .numerics import Anderson, Trace, WorkingSet, safeguarded_mix, start_safeguard

__all__ = ["douglas_rachford", "start_weights", "DR_RELAX", "DR_ANDERSON"]

DR_RELAX = 1.5  # over-relaxation
DR_ANDERSON = 2  # the largest Anderson depth (deeper histories destabilise the iteration)
DR_START_MIN_CAP = 10.0  # the start's condition number cap is max(DR_START_MIN_CAP, tol / (4 eps))


def start_weights(r: torch.Tensor, tol: float) -> torch.Tensor:
    r"""$\min(r, \kappa\, r_{\min})$ for the eigenvalues $r$ of the iterate's $R$ (*the start's conditioning*)."""
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
    """From the dual iterate ``S`` (``V``, ``r`` of its evaluation), at most ``budget`` evaluations per entry: ``(Z,
    res, S_dual, used)``, the ball point of lowest residual, its residual, the implied multiplier, evaluations."""
    B, n = S.shape[0], S.shape[-1]
    rho = n**-0.5
    eye = torch.eye(n, dtype=S.dtype, device=S.device).expand(B, n, n)
    R = (V * start_weights(r, tol).unsqueeze(-2)) @ V.mT
    Z = torch.stack([R - eye / rho, S @ R - S / rho], 1)
    G_rho = torch.stack([eye / rho, torch.zeros_like(S)], 1)
    out = {
        "best_res": torch.full((B,), math.inf, dtype=S.dtype, device=S.device),
        "best_Y": torch.zeros_like(Z),
        # the safeguard's anchor: its implied multiplier is returned
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
