r"""The Gram-space dual of the spectral direction problem.

For a tall point $W$ ($m \ge n$), a normalised gradient $\hat G$ ($\|\hat G\|_F = 1$) and a
symmetric multiplier $S = P(S)$, the dual point is $Y(S) = \hat G + W S$ and everything the
solvers need lives in $n \times n$ matrices: with $C = \hat G^\top \hat G$, $K = W^\top \hat G$ and
$\Gamma = W^\top W$,

$$M(S) = Y^\top Y = C + K^\top S + S K + S \Gamma S,\qquad R = (\max(M, \tau^2) + \varphi)^{-1/2},\qquad
A = Y R,\qquad L_W(A) = P(Z R + R Z^\top),\ Z = W^\top Y = K + \Gamma S.$$

On the manifold $\Gamma$ is known: $I$ for Stiefel, $\operatorname{diag}$ of the squared column
norms for DGram (and its subclasses), used in float32; float64 solves and other masks form
$W^\top W$ (a float32 point is on the manifold only to $\sim 10^{-7}$, which float64 would resolve).
With $\Gamma$ known, $M = Z^\top\Gamma^{-1}Z + N$, $N = C - K^\top\Gamma^{-1}K$ (formed once), costs one
$n^3$ product instead of two. So the $m \times n$ work of a
solve is two Gram products ($C$, $K$) and the final $A = (\hat G + W S) R$: the rest is
$n \times n$.

**Smoothing.** $R = \big(\max(M, \tau^2) + \varphi\big)^{-1/2}$ on the eigenvalues of $M$
(`inverse_sqrt_weights`): a Huber-type smoothing of the nuclear norm. Singular values of $Y$ above
$\tau$ are mapped to exactly 1, those below to $\sigma/\tau$, so the smoothed problem differs
from the exact one only in directions where $Y$ is (nearly) singular, and its optimum loses at most
$\tau/4$ of the objective per singular value below $\tau$, none above. $\tau = s\,n^{-1/2}$ with $s$
the ``smoothing`` option ($\sigma_{\mathrm{rms}}(\hat G) = n^{-1/2}$). The earlier smoothing
$(M + \mu^2)^{-1/2}$ cost $\mu^2/(2\sigma)$ on *every* singular value, so it had to be tiny, and the
tiny singular values of degenerate duals (training gradients) then made the iteration stiff.
$\varphi = 4\,\varepsilon\,\lambda_{\max}(M)$, with $\varepsilon$ the unit roundoff of the compute
dtype, is the rounding floor: $M$ is known only to about $\varepsilon \lambda_{\max}$, and with
$\varphi$ above that error $\|A\|_{\mathrm{op}}$ stays at $1 + O(10^{-5})$ (without it an eigenvalue
computed just above $\tau^2$ can give a singular value of $A$ of up to $1.12$). In float64
$\varphi$ is negligible; in float32 it costs up to $\varphi/(2\sigma)$ per singular value.

**Certificate.** For every symmetric positive definite $X$,
$\|Y\|_* \le \tfrac12(\operatorname{tr}(X^{-1} Y^\top Y) + \operatorname{tr} X)$ (equality at
$X = (Y^\top Y)^{1/2}$; the difference is $\|X^{-1/2}N - X^{1/2}\|_F^2 / 2$ with $N = (Y^\top Y)^{1/2}$).
With $X = R^{-1}$ this is $\tfrac12(\langle YR, Y\rangle + \operatorname{tr} R^{-1})$, evaluated on the
matrices actually formed, so errors of the eigendecomposition only loosen it; with weak duality
$\mathrm{OPT} \le \|Y(S)\|_*$ it bounds the optimum from above.
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
    """Low-rank factor ``L`` (B, n, k) with ``A ~ L L^T`` for a batch of PSD matrices (greedy pivoting).

    An entry whose largest remaining pivot is at most ``tol`` times the mean diagonal gets zero columns
    from then on (in place of stopping the loop, which would synchronise with the host at every rank)."""
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


# phi = ROUNDING_FLOOR * eps * lambda_max: the eigenvalues of a Gram matrix formed in a dtype of unit roundoff
# eps are known to ~eps * lambda_max, and R = (max(M, tau^2) + phi)^(-1/2) with phi above that error keeps
# ||A||_op at 1 + O(1e-5). Measured in float32 (then as mu^2 of (M + mu^2)^(-1/2)) on power-law gradients
# (1536x512, 384x128, 128x128, Stiefel and DGram): floor 1 -> ||A||_op up to 1.0002; 4 -> ||A||_op <= 1 + 1e-5,
# cost <= 5e-5; 64 -> cost up to 8e-4.
ROUNDING_FLOOR = 4.0

# The smoothing of the certificate's R (relative to sigma_rms): the bound exceeds ||Y||_* by up to tau/2 per
# (near-)zero singular value of Y, so it is evaluated at a smaller tau than the solver iterates with (float64
# solves, where the eigenvectors resolve it; 1e-4 was the solver's own smoothing before the Huber form).
CERTIFICATE_SMOOTHING = 1e-4

# Rank of the Cauchy-matrix factor in the exact DGram step: on 24 DGram matrices captured from `mini` training
# (steps 102-103) ranks 10, 6, 4 and 2 needed 550, 549, 553 and 599 evaluations; N's assembly costs one n^3
# product per rank, so 6 (10% less time than 10, measured side by side).
DGRAM_STEP_RANK = 6

# The frozen-R step of a DGram dual is computed in float32 even where the evaluation is float64. The step only
# steers the iteration: its fixed point (H = 0) and the stop test are the float64 evaluation's, so a step
# rounded at 1e-7 changes the path, not the solution. On 28 tall DGram momenta captured from `mini` runs
# (all-dgram steps 41 and 151, hetero-inv step 43; warm, float64) it took the same evaluations as the float64
# step, entry by entry, with the same directions to 5 digits, and the all-dgram training step got 15% faster
# (docs/training.md): a float64 n^3 product costs 4.5x a float32 one at n = 128 on this CPU.
DGRAM_STEP_DTYPE = torch.float32


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
    r"""RMS of $L_W(A)$ over the constrained entries of the Gram matrix, per matrix (batch shape).

    Zero for Euclidean (no constraints). For Oblique it averages over the $n$ diagonal entries,
    for Stiefel over all $n^2$, for DGram over the $n^2 - n$ off-diagonal ones.
    """
    H = manifold.tangent_constraint(W, A)
    count = manifold.constraint_count(H.shape[-1], H)
    if count == 0:
        return torch.zeros(H.shape[:-2], dtype=H.dtype, device=H.device)
    return (H.square().sum(dim=(-2, -1)) / count).sqrt()


@dataclass
class Evaluation:
    """The dual at one multiplier ``S`` per batch entry: eigenpairs of $M$, $R$, residual.

    Stiefel evaluations keep the residual matrix in the eigenbasis of $M$ (``Ht`` $= V^\top H V$) and
    do not form ``R`` or ``H`` (None): the step needs only ``Ht``, and `weights` forms $R$ when asked."""

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
        # On the manifold W^T W is I (Stiefel) or diag(d) (DGram) to the rounding of W. In float32 that is
        # the rounding of everything else; in float64 (e.g. a float32 point solved in float64) the
        # mismatch with C and K would be amplified by R in near-null directions: form W^T W there.
        known = dtype == torch.float32
        if self.form is MaskForm.FULL and known:
            self.d, self.Gw = torch.ones(T.shape[0], self.n, dtype=dtype, device=T.device), None
        elif self.form is MaskForm.OFF_DIAGONAL and known:
            self.d, self.Gw = self.Td.square().sum(-2), None
        else:
            self.Gw = self.Td.mT @ self.Td
            self.d = self.Gw.diagonal(dim1=-2, dim2=-1)
        # Known diagonal Gamma: M = Z^T Gamma^{-1} Z + N with N = C - K^T Gamma^{-1} K, one n^3 product per
        # evaluation instead of two (N is formed once; both forms round at ~eps * lambda_max(M)).
        self.N = None if self.Gw is not None else sym(self.C - (self.K / self.d.unsqueeze(-1)).mT @ self.K)
        # a custom mask is applied as the entrywise product with its 0/1 mask (what check_mask verified it is), not
        # by calling the user's project_gram at every operator application (which may rebuild the mask each time)
        mask = manifold.gram_mask(self.n, self.C) if self.form is MaskForm.CUSTOM else None
        self.P = manifold.project_gram if mask is None else (lambda X: X * mask)
        self.count = manifold.constraint_count(self.n, self.C)
        self.tau2 = float(smoothing) ** 2 / self.n  # tau = smoothing * sigma_rms(G_hat), sigma_rms^2 = 1/n
        self.floor = ROUNDING_FLOOR * torch.finfo(dtype).eps
        self.cg_iters, self.cg_tol = int(cg_iters), float(cg_tol)
        # per matrix: residuals are multiplied by it (``relative_tol``: 1 / the RMS column norm), else None
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

    # -------------------------------------------------------------- Gram-space maps
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
        r"""$M(S) = Y^\top Y$ and $Z = W^\top Y = K + \Gamma S$.

        With $\Gamma$ formed: $M = C + K^\top S + SK + S\Gamma S$. With $\Gamma = \operatorname{diag}(d)$
        known: $Y = W\Gamma^{-1}Z + (I - W\Gamma^{-1}W^\top)\hat G$, so $M = Z^\top\Gamma^{-1}Z + N$."""
        if self.Gw is None:
            Z = self.K + self.d.unsqueeze(-1) * S
            return sym((Z / self.d.unsqueeze(-1)).mT @ Z + self.N), Z
        KtS = self.K.mT @ S
        GS = self.Gw @ S
        return sym(self.C + KtS + KtS.mT + S @ GS), self.K + GS

    def conditioning(self, S: torch.Tensor) -> torch.Tensor:
        r"""$\lambda_{\min}(M)/\lambda_{\max}(M)$ at ``S`` from eigenvalues only (measured: half to 0.6 of an
        evaluation at n = 128 and 768)."""
        lam = eigvalsh_psd(self.gram(S)[0])
        return lam[..., 0] / lam[..., -1].clamp_min(torch.finfo(lam.dtype).tiny)

    def evaluate(self, S: torch.Tensor) -> Evaluation:
        r"""One eigendecomposition of $M(S)$: $R$ and the tangent residual of $YR$, $H = P(ZR + RZ^\top)$.

        Stiefel ($P = I$): in the eigenbasis, $V^\top H V = \tilde Z \operatorname{diag}(r) +
        \operatorname{diag}(r)\tilde Z^\top$ with $\tilde Z = V^\top Z V$, and $\|H\|_F = \|V^\top H V\|_F$:
        two $n^3$ products instead of four (measured ~16% of an evaluation at $n = 768$)."""
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

    # -------------------------------------------------------------- direction and certificate
    def direction(self, S: torch.Tensor, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""$Y = \hat G + W S$ and $A = Y R$ (the only $m \times n$ products after the Grams)."""
        Y = torch.baddbmm(self.Gd, self.Td, S)
        return Y, Y @ R

    def upper_bound(self, Y: torch.Tensor, A: torch.Tensor, S: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        r"""$\tfrac12(\langle A, Y\rangle + \operatorname{tr} R^{-1}) \ge \|Y\|_*$ for $A = YR$ (``r``: the
        eigenvalues $R$ was formed from), plus a margin for the rounding of $Y = \hat G + WS$ itself
        ($\varepsilon\, n \|W\|_F \|S\|_F$), in float64."""
        tr_RM = (A.double() * Y.double()).sum(dim=(-2, -1))
        tr_Rinv = r.double().reciprocal().sum(-1)
        eps = torch.finfo(self.C.dtype).eps
        margin = eps * self.n * self.d.double().sum(-1).sqrt() * S.double().norm(dim=(-2, -1))
        return 0.5 * (tr_RM + tr_Rinv) + margin

    def certify(
        self, S: torch.Tensor, R: torch.Tensor, r: torch.Tensor, V: torch.Tensor, lam: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""$(Y, A, U)$ at the multiplier ``S`` of an evaluation (``R``, its eigenvalues ``r``, eigenpairs
        ``V``, ``lam`` of $M$): $A = YR$ and the smaller of `upper_bound` at $R$ and, in float64, at
        $R' = V(\max(\Lambda, \tau_c^2) + \varphi)^{-1/2}V^\top$ with $\tau_c = $ ``CERTIFICATE_SMOOTHING``
        $\cdot\, n^{-1/2}$: the solver's larger $\tau$ would loosen the bound by up to $\tau/2$ per
        (near-)zero singular value of $Y$ (measured on a rank-3 gradient: 1.5e-3 against 2.3e-4). Both are
        valid bounds; float32 eigenvectors are not accurate enough for the small $\tau_c$."""
        Y, A = self.direction(S, R)
        U = self.upper_bound(Y, A, S, r)
        if self.C.dtype == torch.float64:
            r_c = inverse_sqrt_weights(lam, CERTIFICATE_SMOOTHING**2 / self.n, self.floor)
            A_c = Y @ ((V * r_c.unsqueeze(-2)) @ V.mT)
            U = torch.minimum(U, self.upper_bound(Y, A_c, S, r_c))
        return Y, A, U

    # -------------------------------------------------------------- frozen-R Gauss-Newton step
    def step(self, ev: Evaluation) -> torch.Tensor:
        r"""$\Delta$ with $\tfrac12 P(\Gamma\Delta R + R\Delta\Gamma) = -\tfrac12 H$ ($R$ frozen).

        Stiefel: exact in the eigenbasis of $R$, $\tilde\Delta_{ij} = -\tilde H_{ij}/(r_i + r_j)$.
        DGram: `_dgram_step` in float32, `_dgram_step_exact` for float64 evaluations (the ill-conditioned
        duals), computed in ``DGRAM_STEP_DTYPE``.
        Oblique: an $n \times n$ solve with $\Gamma \circ R$. Other masks: preconditioned CG.
        """
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
        r"""Frozen step for $P = \mathrm{Off}$, $\Gamma = D$ diagonal, with the diagonal constraint dropped.

        With $E = D^{1/2}\Delta D^{1/2}$ and $R' = D^{-1/2} R D^{-1/2} = U \operatorname{diag}(\rho) U^\top$ the
        system is $\mathrm{Off}(E R' + R' E) = -D^{-1/2} H D^{-1/2}$, $\operatorname{diag} E = 0$. Solving
        $ER' + R'E = F$ in the eigenbasis of $R'$ and zeroing the diagonal afterwards is one
        eigendecomposition and four products. Enforcing the zero diagonal exactly (a Schur
        complement of size $n$, about twenty more products) gave the same evaluation counts at
        768x256, 1024x256 and 2304x768; the Stiefel-basis shortcut ($R'$ replaced by $R$) needed
        2-4x more evaluations (measured). ``d``: the squared column norms (the diagonal of $D$).
        """
        scale, rho, U = scaled_eigenbasis(R, d)
        E = U @ ((U.mT @ (-H * scale) @ U) / (rho[..., :, None] + rho[..., None, :])) @ U.mT
        return self.P(sym(E)) * scale

    def _dgram_step_exact(self, H: torch.Tensor, R: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        r"""`_dgram_step` with the zero diagonal enforced by a Schur complement.

        $E = B^{-1}(F + \operatorname{diag}\nu)$ with $B(E) = ER' + R'E$ inverted in the eigenbasis
        $U$ of $R'$ and $N\nu = -\operatorname{diag}B^{-1}F$, $N_{kl} = \sum_{ij} U_{ki}U_{kj}\Gamma_{ij}U_{li}U_{lj}$,
        $\Gamma_{ij} = 1/(\rho_i + \rho_j)$, assembled from a rank-$\le 6$ pivoted Cholesky factor of $\Gamma$
        (``DGRAM_STEP_RANK``).
        About twenty more $n^3$ products than `_dgram_step`; on the nearly low-rank gradients of the
        ``mini`` model (solved in float64) it needed 18-19 instead of 24-32 evaluations (384x128) and
        13-15 instead of 15-18 (512x128), at equal or lower time; on Gaussian gradients the same count.
        Computed in the dtype of ``H``, ``R`` and the squared column norms ``d`` (`step` passes
        ``DGRAM_STEP_DTYPE``); the small solve for $\nu$ is done in float64.
        """
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

    # -------------------------------------------------------------- Douglas-Rachford pieces
    # Matrices F = G_hat a + W b are held as coefficient pairs Z = (a, b), shape (B, 2, n, n).
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
