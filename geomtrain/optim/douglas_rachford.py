r"""Douglas-Rachford splitting for degenerate duals (square and near-square DGram, custom masks).

Below aspect ratio 2 the dual optimum is typically degenerate ($Y^\star$ loses rank; the optimal
$A$ is not unique) and dual iterations crawl. Douglas-Rachford works on the primal instead,
between the tangent space and the unit spectral ball, in the Gram-space coefficients of
`GramDual`: with $\rho = \sigma_{\mathrm{rms}}(\hat G) = n^{-1/2}$ and relaxation $\lambda = 1.5$,

$$x = \Pi_T(z + \hat G/\rho),\qquad y = \Pi_{\mathrm{ball}}(2x - z),\qquad z \leftarrow z + \lambda (y - x),$$

started at the fixed point implied by the current dual iterate, $z_0 = A - Y/\rho$, and
Anderson-accelerated (depth 2) with a safeguard on the fixed-point residual $\|y - x\|_F$.
At a fixed point $z^\star$, $-\rho S_F(z^\star + \hat G/\rho)$ is a dual optimum.
"""

from __future__ import annotations

import math

import torch

from .gram import GramDual
from .numerics import Anderson, Trace, WorkingSet, safeguarded_mix

__all__ = ["douglas_rachford", "DR_RELAX", "DR_ANDERSON"]

DR_RELAX = 1.5  # over-relaxed Douglas-Rachford: 10-20% fewer evaluations than 1.0 (measured)
DR_ANDERSON = 2  # deeper Anderson histories destabilise Douglas-Rachford on these problems (measured)


def douglas_rachford(
    dual: GramDual,
    S: torch.Tensor,
    R: torch.Tensor,
    tol: float,
    budget: torch.Tensor,
    depth: int,
    trace: Trace | None = None,
):
    """Run Douglas-Rachford from the dual iterate ``(S, R)`` for at most ``budget`` evaluations per entry.

    Returns ``(Z, res, S_dual, used)``: the coefficients of the best ball point $y$ (lowest tangent
    residual), its residual, the implied dual multiplier and the evaluations used.
    """
    B, n = S.shape[0], S.shape[-1]
    rho = n**-0.5
    eye = torch.eye(n, dtype=S.dtype, device=S.device).expand(B, n, n)
    Z = torch.stack([R - eye / rho, S @ R - S / rho], 1)
    G_rho = torch.stack([eye / rho, torch.zeros_like(S)], 1)
    out = {
        "best_res": torch.full((B,), math.inf, dtype=S.dtype, device=S.device),
        "best_Y": torch.zeros_like(Z),
        "anchor_x": Z.clone(),  # the point with the lowest |y - x|_F: its implied multiplier is returned
        "used": torch.zeros(B, dtype=torch.long, device=S.device),
    }
    idx = (budget > 0).nonzero().squeeze(-1)
    ws = WorkingSet(idx, {name: value[idx] for name, value in out.items()}, out)
    ws["Z"], ws["budget"], ws["anchor_F"] = Z[idx], budget[idx], torch.zeros_like(Z[idx])
    ws["best_f"] = torch.full_like(ws["best_res"], math.inf)  # safeguard of the mixing: |y - x|_F
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
