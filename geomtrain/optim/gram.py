r"""The Gram-space dual of the spectral direction problem.

For a tall point $W$, $\hat G = G/\|G\|_F$ and a symmetric multiplier $S = P(S)$, the dual point is
$Y(S) = \hat G + WS$; with $C = \hat G^\top \hat G$, $K = W^\top \hat G$, $\Gamma = W^\top W$ the solvers work on
$n \times n$ matrices:

$$M(S) = Y^\top Y = C + K^\top S + S K + S \Gamma S,\qquad R = (\max(M, \tau^2) + \varphi)^{-1/2},\qquad
A = Y R,\qquad L_W(A) = P(Z R + R Z^\top),\ Z = W^\top Y = K + \Gamma S.$$

In float32 $\Gamma$ is taken as known ($I$ on Stiefel, the squared column norms on DGram) and
$M = Z^\top\Gamma^{-1}Z + N$, $N = C - K^\top\Gamma^{-1}K$ formed once; float64 solves and other masks form $W^\top W$.

**Smoothing** (`inverse_sqrt_weights`, Huber-type): singular values of $Y$ above $\tau = s\,n^{-1/2}$ ($s$ the
``smoothing`` option) map to exactly 1, those below to $\sigma/\tau$, so the optimum loses at most $\tau/4$ per singular
value below $\tau$. $\varphi = 4\varepsilon\lambda_{\max}(M)$ ($\varepsilon$ the compute dtype's unit roundoff) lies
above the rounding error of $M$ and keeps $\|A\|_{\mathrm{op}}$ at $1 + O(10^{-5})$.

**Certificate.** For symmetric positive definite $X$, $\|Y\|_* \le \tfrac12(\operatorname{tr}(X^{-1} Y^\top Y) +
\operatorname{tr} X)$, with equality at $X = (Y^\top Y)^{1/2}$; at $X = R^{-1}$, evaluated on the matrices actually
formed, it is $\tfrac12(\langle YR, Y\rangle + \operatorname{tr} R^{-1}) \ge \|Y(S)\|_* \ge \mathrm{OPT}$.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manifolds import GramManifold, MaskForm

from .numerics import eigh_psd, eigvalsh_psd, pcg, sym

__all__ = [
    "GramDual",
    "Evaluation",
    "tangent_residual",
    "inverse_sqrt_weights",
    "ROUNDING_FLOOR",
    "CERTIFICATE_SMOOTHING",
]


def pivoted_cholesky(A: torch.Tensor, tol: float, max_rank: int) -> torch.Tensor:
    """``L`` (B, n, k) with ``A ~ L L^T`` for PSD ``A`` (greedy pivoting; zero columns once the largest remaining
    pivot is at most ``tol`` times the mean diagonal)."""
    B, n, _ = A.shape
    d = A.diagonal(dim1=-2, dim2=-1).clone()
    floor = tol * d.sum(-1) / n
    cols = []
    ar = torch.arange(B, device=A.device)
    for _ in range(min(max_rank, n)):
        piv = d.argmax(-1)
        dp = d[ar, piv]
        c = A[ar, :, piv].clone()
        for col in cols:
            c = c - col * col[ar, piv].unsqueeze(-1)
        c = c / dp.clamp_min(torch.finfo(A.dtype).tiny).sqrt().unsqueeze(-1)
        c = torch.where((dp > floor).unsqueeze(-1), c, torch.zeros_like(c))  # floor >= 0: also dp > 0
        cols.append(c)
        d = (d - c.square()).clamp_min(0)
    if not cols:
        return torch.zeros(B, n, 1, dtype=A.dtype, device=A.device)
    return torch.stack(cols, -1)


ROUNDING_FLOOR = 4.0  # phi / (eps lambda_max(M)): above M's rounding error (module docstring)
CERTIFICATE_SMOOTHING = 1e-4  # tau_c / sigma_rms of the certificate: tighter than the solver's tau (`GramDual.certify`)
DGRAM_STEP_RANK = 6  # rank of the Cauchy-matrix factor of the exact DGram step: one n^3 product each
DGRAM_STEP_DTYPE = torch.float32  # the frozen-R step only steers the iteration: its rounding changes the path only


def scaled_eigenbasis(R: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""$R' = D^{-1/2} R D^{-1/2} = U \operatorname{diag}(\rho) U^\top$ for $D = \operatorname{diag}(d)$: returns
    ``(scale, rho, U)`` with ``scale`` $= (d_i d_j)^{-1/2}$, so that $R' = R \circ$ ``scale`` (the DGram steps)."""
    isd = d.rsqrt()
    scale = isd[..., :, None] * isd[..., None, :]
    rho, U = eigh_psd(sym(R * scale))
    return scale, rho, U


def inverse_sqrt_weights(lam: torch.Tensor, tau2: float, floor: float) -> torch.Tensor:
    r"""Eigenvalues $r = (\max(\lambda, \tau^2) + \varphi)^{-1/2}$ of the smoothed $M^{-1/2}$, with
    $\varphi = $ ``floor`` $\cdot \lambda_{\max}$ (see the module's *Smoothing*); ``lam`` ascending, last dim."""
    lam = lam.clamp_min(0)
    return (lam.clamp_min(tau2) + floor * lam[..., -1:]).rsqrt()


def tangent_residual(manifold: GramManifold, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    r"""RMS of $L_W(A)$ over the constrained entries of the Gram matrix, per matrix (batch shape): the $n$ diagonal
    ones on Oblique, all $n^2$ on Stiefel, the $n^2 - n$ off-diagonal ones on DGram; zero on Euclidean."""
    H = manifold.tangent_constraint(W, A)
    count = manifold.constraint_count(H.shape[-1], H)
    if count == 0:
        return torch.zeros(H.shape[:-2], dtype=H.dtype, device=H.device)
    return (H.square().sum(dim=(-2, -1)) / count).sqrt()


@dataclass
class Evaluation:
    """The dual at one multiplier ``S`` per batch entry: eigenpairs of $M$, $R$, residual. Stiefel evaluations keep
    only ``Ht`` $= V^\top H V$ (``R`` and ``H`` None: the step needs only ``Ht``; `weights` forms $R$)."""

    S: torch.Tensor
    V: torch.Tensor  # eigenvectors of M
    lam: torch.Tensor  # eigenvalues of M, clamped at 0
    r: torch.Tensor  # eigenvalues of R: (max(lam, tau^2) + phi)^(-1/2)
    R: torch.Tensor | None
    H: torch.Tensor | None  # L_W(Y R)
    Ht: torch.Tensor | None  # V^T H V (Stiefel)
    res: torch.Tensor  # RMS of H over the constrained entries

    def select(self, mask: torch.Tensor) -> Evaluation:
        return Evaluation(*(None if (v := getattr(self, f)) is None else v[mask] for f in self.__dataclass_fields__))

    def weights(self) -> torch.Tensor:
        r"""$R = V \operatorname{diag}(r) V^\top$."""
        return self.R if self.R is not None else (self.V * self.r.unsqueeze(-2)) @ self.V.mT


class GramDual:
    """The Gram-space dual of a batch of tall problems ``(B, m, n)``: data, evaluation, steps."""

    _BATCHED = ("C", "K", "Gw", "d", "N", "Td", "Gd", "res_scale")

    def __init__(
        self,
        manifold: GramManifold,
        T: torch.Tensor,
        Gh: torch.Tensor,
        dtype: torch.dtype,
        smoothing: float,
        cg_iters: int = 10,
        cg_tol: float = 1e-2,
        res_scale: torch.Tensor | None = None,
    ):
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"compute_dtype must be torch.float32 or torch.float64; got {dtype}")
        self.manifold, self.form = manifold, manifold.mask_form
        self.Td, self.Gd = T.to(dtype), Gh.to(dtype)
        self.C, self.K = self.Gd.mT @ self.Gd, self.Td.mT @ self.Gd
        self.n = T.shape[-1]
        # W^T W is I (Stiefel) or diag(d) (DGram) to the rounding of W: float32's own rounding; float64 forms it
        known = dtype == torch.float32
        if self.form is MaskForm.FULL and known:
            self.d, self.Gw = torch.ones(T.shape[0], self.n, dtype=dtype, device=T.device), None
        elif self.form is MaskForm.OFF_DIAGONAL and known:
            self.d, self.Gw = self.Td.square().sum(-2), None
        else:
            self.Gw = self.Td.mT @ self.Td
            self.d = self.Gw.diagonal(dim1=-2, dim2=-1)
        self.N = None if self.Gw is not None else sym(self.C - (self.K / self.d.unsqueeze(-1)).mT @ self.K)
        # a custom mask as the entrywise product with its 0/1 mask (check_mask verified it), not project_gram calls
        mask = manifold.gram_mask(self.n, self.C) if self.form is MaskForm.CUSTOM else None
        self.P = manifold.project_gram if mask is None else (lambda X: X * mask)
        self.count = manifold.constraint_count(self.n, self.C)
        self.tau2 = float(smoothing) ** 2 / self.n  # tau = smoothing * sigma_rms(G_hat), sigma_rms^2 = 1/n
        self.floor = ROUNDING_FLOOR * torch.finfo(dtype).eps
        self.cg_iters, self.cg_tol = int(cg_iters), float(cg_tol)
        # per matrix, residuals are multiplied by it (``relative_tol``: 1 / the RMS column norm)
        self.res_scale = None if res_scale is None else res_scale.to(dtype)

    @property
    def batch(self) -> int:
        return self.C.shape[0]

    def sub(self, idx: torch.Tensor) -> GramDual:
        """The same dual restricted to batch entries ``idx`` (itself when ``idx`` is every entry)."""
        if len(idx) == self.batch and bool((idx == torch.arange(len(idx), device=idx.device)).all()):
            return self
        out = object.__new__(GramDual)
        out.__dict__.update(self.__dict__)
        for k in self._BATCHED:
            v = getattr(self, k)
            setattr(out, k, None if v is None else v[idx])
        return out

    def gamma(self, X: torch.Tensor) -> torch.Tensor:
        r"""$\Gamma X$ with $\Gamma = W^\top W$."""
        return self.d.unsqueeze(-1) * X if self.Gw is None else self.Gw @ X

    def residual(self, H: torch.Tensor) -> torch.Tensor:
        """RMS of ``H`` over the constrained entries, times ``res_scale`` where set."""
        rms = (H.square().sum(dim=(-2, -1)) / self.count).sqrt()
        return rms if self.res_scale is None else rms * self.res_scale

    def normal_coords(self, H: torch.Tensor) -> torch.Tensor:
        r"""$S = P(S)$ symmetric with $P(\Gamma S + S \Gamma) = H$ (the solve inside ``proju``)."""
        d = self.d
        if self.form is MaskForm.FULL:
            return H / 2
        if self.form is MaskForm.OFF_DIAGONAL:
            return H / (d[..., :, None] + d[..., None, :])
        if self.form is MaskForm.DIAGONAL:
            return torch.diag_embed(H.diagonal(dim1=-2, dim2=-1) / (2 * d))
        op = lambda X: self.P(self.Gw @ X + X @ self.Gw)  # noqa: E731
        pre = lambda X: self.P(X / (d[..., :, None] + d[..., None, :]))  # noqa: E731
        return pcg(op, H, pre, 4 * self.cg_iters, 1e-8)

    def tangent_start(self) -> torch.Tensor:
        r"""$S_T$ with $Y(S_T) = \operatorname{proju}(W, \hat G)$: the tangent projection."""
        return -self.normal_coords(self.P(self.K + self.K.mT))

    def gram(self, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""$M(S) = Y^\top Y$ and $Z = W^\top Y = K + \Gamma S$ (with $\Gamma = \operatorname{diag}(d)$ known,
        $M = Z^\top\Gamma^{-1}Z + N$)."""
        if self.Gw is None:
            Z = self.K + self.d.unsqueeze(-1) * S
            return sym((Z / self.d.unsqueeze(-1)).mT @ Z + self.N), Z
        KtS = self.K.mT @ S
        GS = self.Gw @ S
        return sym(self.C + KtS + KtS.mT + S @ GS), self.K + GS

    def conditioning(self, S: torch.Tensor) -> torch.Tensor:
        r"""$\lambda_{\min}(M)/\lambda_{\max}(M)$ at ``S``, from eigenvalues only."""
        lam = eigvalsh_psd(self.gram(S)[0])
        return lam[..., 0] / lam[..., -1].clamp_min(torch.finfo(lam.dtype).tiny)

    def evaluate(self, S: torch.Tensor) -> Evaluation:
        r"""One eigendecomposition of $M(S)$: $R$ and the tangent residual of $YR$, $H = P(ZR + RZ^\top)$ (Stiefel: in
        the eigenbasis, $V^\top H V = \tilde Z \operatorname{diag}(r) + \operatorname{diag}(r)\tilde Z^\top$)."""
        M, Z = self.gram(S)
        lam, V = eigh_psd(M)
        lam = lam.clamp_min(0)
        r = inverse_sqrt_weights(lam, self.tau2, self.floor)
        if self.form is MaskForm.FULL:
            Zt = V.mT @ Z @ V
            Ht = Zt * r.unsqueeze(-2) + r.unsqueeze(-1) * Zt.mT
            return Evaluation(S, V, lam, r, None, None, Ht, self.residual(Ht))
        R = (V * r.unsqueeze(-2)) @ V.mT
        ZR = Z @ R
        H = self.P(ZR + ZR.mT)
        return Evaluation(S, V, lam, r, R, H, None, self.residual(H))

    def objective(self, ev: Evaluation) -> torch.Tensor:
        r"""$\langle \hat G, YR\rangle = \langle C + K^\top S, R\rangle$ of an evaluation (for traces)."""
        return ((self.C + self.K.mT @ ev.S) * ev.weights()).sum(dim=(-2, -1))

    def direction(self, S: torch.Tensor, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""$Y = \hat G + W S$ and $A = Y R$ (the only $m \times n$ products after the Grams)."""
        Y = torch.baddbmm(self.Gd, self.Td, S)
        return Y, Y @ R

    def upper_bound(self, Y: torch.Tensor, A: torch.Tensor, S: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        r"""$\tfrac12(\langle A, Y\rangle + \operatorname{tr} R^{-1}) \ge \|Y\|_*$ for $A = YR$ (``r``: the eigenvalues
        of $R$), plus $\varepsilon\, n \|W\|_F \|S\|_F$ for the rounding of $Y$, in float64."""
        tr_RM = (A.double() * Y.double()).sum(dim=(-2, -1))
        tr_Rinv = r.double().reciprocal().sum(-1)
        eps = torch.finfo(self.C.dtype).eps
        margin = eps * self.n * self.d.double().sum(-1).sqrt() * S.double().norm(dim=(-2, -1))
        return 0.5 * (tr_RM + tr_Rinv) + margin

    def certify(
        self, S: torch.Tensor, R: torch.Tensor, r: torch.Tensor, V: torch.Tensor, lam: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""$(Y, A, U)$ at the multiplier ``S`` of an evaluation: $A = YR$ and the smaller of `upper_bound` at $R$ and,
        in float64, at $R$ smoothed at $\tau_c = $ ``CERTIFICATE_SMOOTHING`` $\cdot\, n^{-1/2}$."""
        Y, A = self.direction(S, R)
        U = self.upper_bound(Y, A, S, r)
        if self.C.dtype == torch.float64:
            r_c = inverse_sqrt_weights(lam, CERTIFICATE_SMOOTHING**2 / self.n, self.floor)
            A_c = Y @ ((V * r_c.unsqueeze(-2)) @ V.mT)
            U = torch.minimum(U, self.upper_bound(Y, A_c, S, r_c))
        return Y, A, U

    def step(self, ev: Evaluation) -> torch.Tensor:
        r"""$\Delta$ with $\tfrac12 P(\Gamma\Delta R + R\Delta\Gamma) = -\tfrac12 H$ ($R$ frozen): exact in the
        eigenbasis of $R$ on Stiefel, `_dgram_step` (float64: `_dgram_step_exact`) on DGram, a solve on Oblique, else
        CG."""
        H, V, r, R = ev.H, ev.V, ev.r, ev.R
        if self.form is MaskForm.FULL:
            rr = r[..., :, None] + r[..., None, :]
            return -V @ (ev.Ht / rr) @ V.mT
        if self.form is MaskForm.OFF_DIAGONAL:
            if H.dtype != torch.float64:
                return self._dgram_step(H, R, self.d)
            dt = DGRAM_STEP_DTYPE
            return self._dgram_step_exact(H.to(dt), R.to(dt), self.d.to(dt)).to(H.dtype)
        if self.form is MaskForm.DIAGONAL:
            s = torch.linalg.solve(self.Gw * R, -0.5 * H.diagonal(dim1=-2, dim2=-1))
            return torch.diag_embed(s)
        op = lambda X: 0.5 * self.P(self.Gw @ X @ R + R @ X @ self.Gw)  # noqa: E731
        dbar = self.d.mean(-1)[..., None, None]
        Gam = 2 / (dbar * (r[..., :, None] + r[..., None, :]))
        pre = lambda X: self.P(sym(V @ ((V.mT @ self.P(X) @ V) * Gam) @ V.mT))  # noqa: E731
        return pcg(op, -0.5 * H, pre, self.cg_iters, self.cg_tol)

    def _dgram_step(self, H: torch.Tensor, R: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        r"""Frozen step for $P = \mathrm{Off}$, $\Gamma = D = \operatorname{diag}($``d``$)$: $ER' + R'E = -D^{-1/2} H
        D^{-1/2}$ in the eigenbasis of $R' = D^{-1/2} R D^{-1/2}$, $E = D^{1/2}\Delta D^{1/2}$, then diagonal zeroed."""
        scale, rho, U = scaled_eigenbasis(R, d)
        E = U @ ((U.mT @ (-H * scale) @ U) / (rho[..., :, None] + rho[..., None, :])) @ U.mT
        return self.P(sym(E)) * scale

    def _dgram_step_exact(self, H: torch.Tensor, R: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        r"""`_dgram_step` with the zero diagonal enforced by a Schur complement: $E = B^{-1}(F +
        \operatorname{diag}\nu)$, $B(E) = ER' + R'E$ inverted in the eigenbasis $U$ of $R'$, and
        $N\nu = -\operatorname{diag}B^{-1}F$, $N_{kl} = \sum_{ij} U_{ki}U_{kj}\Gamma_{ij}U_{li}U_{lj}$,
        $\Gamma_{ij} = 1/(\rho_i + \rho_j)$, from a rank-``DGRAM_STEP_RANK`` pivoted Cholesky factor."""
        scale, rho, U = scaled_eigenbasis(R, d)
        Gam = 1 / (rho[..., :, None] + rho[..., None, :])
        L = pivoted_cholesky(Gam, tol=1e-3, max_rank=DGRAM_STEP_RANK)
        N = torch.zeros_like(Gam)
        for q in range(L.shape[-1]):
            N = N + ((U * L[..., q].unsqueeze(-2)) @ U.mT).square()
        eye = torch.eye(self.n, dtype=N.dtype, device=N.device)
        N = N + 1e-6 * N.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye  # keeps N invertible
        F = -self.P(H) * scale
        E0 = U @ ((U.mT @ F @ U) * Gam)
        nu = torch.linalg.solve_ex(N.double(), -(E0 * U).sum(-1).double())[0].to(N.dtype)  # _ex: no host sync
        E = U @ ((U.mT @ (F + torch.diag_embed(nu)) @ U) * Gam) @ U.mT
        return self.P(sym(E)) * scale

    # Douglas-Rachford pieces: F = G_hat a + W b held as coefficient pairs Z = (a, b), shape (B, 2, n, n)
    def proj_tangent(self, Z: torch.Tensor) -> torch.Tensor:
        a, b = Z[:, 0], Z[:, 1]
        X = self.K @ a + self.gamma(b)  # W^T F
        return torch.stack([a, b - self.normal_coords(self.P(X + X.mT))], 1)

    def proj_ball(self, Z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Spectral-norm ball projection F h(F^T F), with its tangent residual and objective."""
        a, b = Z[:, 0], Z[:, 1]
        X1, X2 = self.C @ a + self.K.mT @ b, self.K @ a + self.gamma(b)  # G^T F, W^T F
        lam, V = eigh_psd(sym(a.mT @ X1 + b.mT @ X2))
        h = (V * lam.clamp_min(1.0).rsqrt().unsqueeze(-2)) @ V.mT
        WtY = X2 @ h
        H = self.P(WtY + WtY.mT)
        return torch.stack([a @ h, b @ h], 1), self.residual(H), (X1 * h).sum(dim=(-2, -1))

    def frobenius(self, Z: torch.Tensor) -> torch.Tensor:
        r"""$\|\hat G a + W b\|_F$ of coefficient pairs."""
        a, b = Z[:, 0], Z[:, 1]
        sq = (a * (self.C @ a + self.K.mT @ b)).sum(dim=(-2, -1)) + (b * (self.K @ a + self.gamma(b))).sum(dim=(-2, -1))
        return sq.clamp_min(0).sqrt()

    def implied_dual(self, Z: torch.Tensor, rho: float) -> torch.Tensor:
        r"""The multiplier $-\rho S_F$ of the tangent projection of $F = z + \hat G/\rho$ (coefficients $Z$)."""
        X = self.K @ Z[:, 0] + self.gamma(Z[:, 1])
        return -rho * self.normal_coords(self.P(X + X.mT))

    def polish(self, Z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""$A \to \Pi_T(A) / \max(1, \|\Pi_T(A)\|_{\mathrm{op}})$ on coefficients (exact spectral norm from
        one $n \times n$ eigenvalue problem); returns the new coefficients and their tangent residual."""
        Z = self.proj_tangent(Z)
        a, b = Z[:, 0], Z[:, 1]
        X1, X2 = self.C @ a + self.K.mT @ b, self.K @ a + self.gamma(b)
        top = torch.linalg.eigvalsh(sym(a.mT @ X1 + b.mT @ X2).double())[..., -1].clamp_min(0).sqrt()
        scale = (1 / top.clamp_min(1.0)).to(Z.dtype)
        WtA = X2 * scale[:, None, None]
        return Z * scale[:, None, None, None], self.residual(self.P(WtA + WtA.mT))

    def combine(self, Z: torch.Tensor) -> torch.Tensor:
        r"""$\hat G a + W b$ from coefficient pairs."""
        return torch.baddbmm(self.Gd @ Z[:, 0], self.Td, Z[:, 1])
