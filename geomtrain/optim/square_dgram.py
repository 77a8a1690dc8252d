r"""Square DGram: the whole problem in $n \times n$ matrices, solved by Douglas-Rachford with a warm start.

For $W = Q\,\operatorname{diag}(s)$ ($Q$ orthogonal) every direction is $A = QC$, and with $K = Q^\top \hat G$ the
problem is $\max_C \langle K, C\rangle$ s.t. $\|C\|_{\mathrm{op}} \le 1$, $\operatorname{Off}(sC + C^\top s) = 0$, whose
dual is typically degenerate. Douglas-Rachford ($\rho = n^{-1/2}$, relaxation $\lambda$ = ``SQUARE_RELAX``, Anderson):

$$x = \Pi_T(z + K/\rho),\quad y = \Pi_{\mathrm{ball}}(2x - z),\quad z \leftarrow z + \lambda\,(y - x),$$

$\Pi_T(F) = F - s\Lambda$, $\Lambda_{ij} = \operatorname{Off}(sF + F^\top s)_{ij} / (s_i^2 + s_j^2)$, and
$\Pi_{\mathrm{ball}}(F) = F\,h(F^\top F)$, $h(\lambda) = \min(1, \lambda^{-1/2})$. $z$ carries the solution
($S = -\rho\Lambda(z + K/\rho)$ is the dual multiplier) and is the warm-start state. $C$ is the ball point $y$ of
lowest tangent residual; the certificate is `geomtrain.optim.gram`'s bound at $S$.
"""

from __future__ import annotations

import math

import torch

from .gram import CERTIFICATE_SMOOTHING, ROUNDING_FLOOR, inverse_sqrt_weights
from .numerics import Anderson, Trace, WorkingSet, eigh_psd, safeguarded_mix, spectral_norm_estimate, start_safeguard

__all__ = ["solve_square_dgram", "SquareFrame", "SQUARE_RELAX", "SQUARE_ANDERSON"]

SQUARE_RELAX = 1.5  # over-relaxation of the Douglas-Rachford step
SQUARE_ANDERSON = 4  # Anderson depth (the solver's ``anderson`` option caps it)
START_POWER_ITERS = 10  # the cold start's scale ||Pi_T(K)||_op: any start is valid, so an estimate does


def _off(M: torch.Tensor) -> torch.Tensor:
    return M - torch.diag_embed(M.diagonal(dim1=-2, dim2=-1))


class SquareFrame:
    r"""The square problem in the frame $Q$: $K = Q^\top\hat G$, the column norms $s$ and the two projections, for a
    batch ``(B, n, n)`` or one ``(n, n)`` problem (``T`` the point, ``Gh`` the normalised gradient)."""

    def __init__(self, T: torch.Tensor, Gh: torch.Tensor, res_scale: torch.Tensor | None = None):
        s = T.norm(dim=-2)
        self.s = s.clamp_min(torch.finfo(T.dtype).tiny)
        self.Q = T / self.s.unsqueeze(-2)
        self.K = self.Q.mT @ Gh
        d = self.s.square()
        self.den = d[..., :, None] + d[..., None, :]
        self.n = T.shape[-1]
        self.res_scale = None if res_scale is None else res_scale.to(T)

    def sub(self, idx: torch.Tensor) -> SquareFrame:
        out = object.__new__(SquareFrame)
        out.__dict__.update(self.__dict__)
        for k in ("s", "Q", "K", "den", "res_scale"):
            v = getattr(self, k)
            setattr(out, k, None if v is None else v[idx])
        return out

    def multiplier(self, F: torch.Tensor) -> torch.Tensor:
        r"""$\Lambda$ with $F - s\Lambda \in T$."""
        s = self.s
        return _off(s[..., :, None] * F + F.mT * s[..., None, :]) / self.den

    def proj_tangent(self, F: torch.Tensor) -> torch.Tensor:
        return F - self.s[..., :, None] * self.multiplier(F)

    def residual(self, C: torch.Tensor) -> torch.Tensor:
        s = self.s
        H = _off(s[..., :, None] * C + C.mT * s[..., None, :])
        rms = (H.square().sum(dim=(-2, -1)) / (self.n * self.n - self.n)).sqrt()
        return rms if self.res_scale is None else rms * self.res_scale

    def proj_ball(self, F: torch.Tensor) -> torch.Tensor:
        lam, V = eigh_psd(F.mT @ F)
        return F @ ((V * lam.clamp_min(1.0).rsqrt().unsqueeze(-2)) @ V.mT)

    def upper_bound(self, S: torch.Tensor) -> torch.Tensor:
        r"""$\tfrac12(\langle XR, X\rangle + \operatorname{tr}R^{-1}) \ge \|K + sS\|_* = \|\hat G + WS\|_*$, in float64,
        with $R$ smoothed at $\tau = $ ``CERTIFICATE_SMOOTHING`` $\cdot\, n^{-1/2}$."""
        X = (self.K + self.s[..., :, None] * S).double()
        lam, V = eigh_psd(X.mT @ X)
        r = inverse_sqrt_weights(lam, CERTIFICATE_SMOOTHING**2 / self.n, ROUNDING_FLOOR * torch.finfo(X.dtype).eps)
        XR = X @ ((V * r.unsqueeze(-2)) @ V.mT)
        eps = torch.finfo(self.K.dtype).eps
        margin = eps * self.n * self.s.double().norm(dim=-1) * S.double().norm(dim=(-2, -1))
        return 0.5 * ((XR * X).sum(dim=(-2, -1)) + r.reciprocal().sum(-1)) + margin


def solve_square_dgram(
    T: torch.Tensor,
    Gh: torch.Tensor,
    live: torch.Tensor,
    tol: float,
    stop: float,
    max_iter: int,
    z0: torch.Tensor | None,
    trace: Trace | None,
    res_scale: torch.Tensor | None = None,
    depth: int = SQUARE_ANDERSON,
):
    """Square DGram problems ``(B, n, n)``: ``(A, raw statistics)``, the Douglas-Rachford state as ``dual``. The
    iteration and the certificate share their per-entry state: one function, longer than 60 lines on purpose."""
    B, n = T.shape[0], T.shape[-1]
    fr = SquareFrame(T, Gh, res_scale)
    rho = n**-0.5
    if z0 is None:  # the fixed point implied by the tangent projection: z = x - K/rho, x = Pi_T(K) scaled
        x = fr.proj_tangent(fr.K)
        top = spectral_norm_estimate(x, START_POWER_ITERS).clamp_min(torch.finfo(x.dtype).tiny)
        z = x / top[:, None, None] - fr.K / rho
    else:
        z = z0.reshape(B, n, n).to(fr.K, copy=True)  # the iteration writes into z: never into the caller's tensor
    out = {
        "best_res": torch.full((B,), math.inf, dtype=z.dtype, device=z.device),
        "best_y": torch.zeros_like(z),
        "best_z": z.clone(),
        "used": torch.zeros(B, dtype=torch.long, device=z.device),
    }
    idx = live.nonzero().squeeze(-1)
    ws = WorkingSet(idx, {name: value[idx] for name, value in out.items()}, out)
    ws["z"] = z[idx]
    start_safeguard(ws, ws["z"])
    sub, mixer = fr.sub(idx), Anderson(depth, ws["z"])
    while len(ws):
        za = ws["z"]
        x = sub.proj_tangent(za + sub.K / rho)
        y = sub.proj_ball(2 * x - za)
        F = y - x
        res = sub.residual(y)
        ws["used"] = ws["used"] + 1
        if trace is not None and int(ws.idx[0]) == 0:
            trace.add(res[0], (sub.K[0] * y[0]).sum())
        imp = res < ws["best_res"]
        ws["best_res"] = torch.where(imp, res, ws["best_res"])
        ws["best_y"] = torch.where(imp[:, None, None], y, ws["best_y"])
        ws["best_z"] = torch.where(imp[:, None, None], za, ws["best_z"])
        ws["z"] = safeguarded_mix(mixer, ws, za, F, F.norm(dim=(-2, -1)), SQUARE_RELAX)
        keep = ws.shrink((res > stop) & (ws["used"] < max_iter))  # the iteration's one host synchronisation
        if keep is not None:
            sub = sub.sub(keep)
            mixer.compact(keep)
    best_res, best_y, best_z, used = out["best_res"], out["best_y"], out["best_z"], out["used"]
    S = -rho * fr.multiplier(best_z + fr.K / rho)
    U = fr.upper_bound(S)
    used += 1  # the certificate's eigendecomposition
    C, res = best_y, best_res
    converged = res <= tol
    polish = ~converged & live
    j = polish.nonzero().squeeze(-1)
    if j.numel():  # not converged in max_iter: onto the tangent space, then into the ball
        Cj = fr.sub(j).proj_tangent(C[j])
        top = torch.linalg.matrix_norm(Cj.double(), ord=2).clamp_min(1.0).to(Cj.dtype)
        C[j] = Cj / top[:, None, None]
        res[j] = fr.sub(j).residual(C[j])
        used[j] += 1
    A = fr.Q @ C
    prim = (A.double() * Gh.double()).sum(dim=(-2, -1))
    gap = (U - prim) / U.clamp_min(torch.finfo(torch.float64).tiny)
    zero = ~live
    return A, {
        "evaluations": torch.where(zero, torch.zeros_like(used), used).cpu(),
        "residual": torch.where(zero, torch.zeros_like(res), res).double().cpu(),
        "converged": (converged | zero).cpu(),
        "dual_gap": torch.where(zero, torch.zeros_like(gap), gap).cpu(),
        "dual": torch.where(zero[:, None, None], torch.zeros_like(best_z), best_z),
        "multiplier": torch.where(zero[:, None, None], torch.zeros_like(S), S),
        "escalated": torch.zeros(B, dtype=torch.bool),
        "trace": trace,
    }
