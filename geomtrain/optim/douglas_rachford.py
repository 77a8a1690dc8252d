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
from .numerics import Anderson, Trace

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
    best_res = torch.full((B,), math.inf, dtype=S.dtype, device=S.device)
    best_Y = torch.zeros_like(Z)
    best_f = torch.full_like(best_res, math.inf)  # safeguard of the mixing: |y - x|_F
    best_Z, best_F = Z.clone(), torch.zeros_like(Z)
    used = torch.zeros(B, dtype=torch.long, device=S.device)
    mixer = Anderson(depth, Z)
    active = (budget > 0).nonzero().squeeze(-1)
    while active.numel():
        sub = dual.sub(active)
        Za = Z[active]
        X = sub.proj_tangent(Za + G_rho[active])
        Y, res, prim = sub.proj_ball(2 * X - Za)
        F = Y - X
        fn = sub.frobenius(F)
        used[active] += 1
        if trace is not None and int(active[0]) == 0:
            trace.add(res[0], prim[0])
        imp = res < best_res[active]
        j = active[imp]
        best_res[j], best_Y[j] = res[imp], Y[imp]
        ok = fn <= best_f[active]
        j = active[ok]
        best_f[j], best_Z[j], best_F[j] = fn[ok], Za[ok], F[ok]
        go = (res > tol) & (used[active] < budget[active])
        Znext = mixer.mix(active, Za, DR_RELAX * F)
        if bool((~ok).any()):  # the mixed point did worse: forget the history, plain step from the best
            jw = active[~ok]
            mixer.reset(jw)
            Znext[~ok] = best_Z[jw] + DR_RELAX * best_F[jw]
        Z[active] = Znext
        active = active[go]
    S_dual = dual.implied_dual(best_Z + G_rho, rho)
    return best_Y, best_res, S_dual, used
