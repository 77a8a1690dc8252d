r"""The spectral steepest-descent direction on a Gram-space manifold.

For a point $W$ of $\mathcal M_P$ (tall form, $m \ge n$) and a gradient or momentum $G$,
Manifold Muon moves along

$$A^\star = \arg\max_A \ \langle G, A\rangle \quad\text{s.t.}\quad \|A\|_{\mathrm{op}} \le 1,\quad
L_W(A) = P(W^\top A + A^\top W) = 0 .$$

**Dual.** With a symmetric multiplier $S = P(S)$ and the dual point $Y(S) = G + W S$ (the
range of $L_W^*$ is $\{W S\}$), $\langle G, A\rangle = \langle Y, A\rangle$ for every tangent
$A$, so $\langle G, A\rangle \le \|Y(S)\|_*$ for every feasible $A$ and every $S$:

$$\mathrm{OPT} = \min_S\ \|G + W S\|_*, \qquad A = \operatorname{msign}(Y(S^\star)).$$

The gradient of the dual in $S$ is $\tfrac12 L_W(\operatorname{msign}(Y))$: the dual is solved
exactly when the direction is tangent. Any $S$ certifies a *duality gap*
$\|Y(S)\|_* - \langle G, A\rangle$.

**Gram-space reduction** (solver ``"gram_newton"``). Everything the dual needs lives in
$n \times n$ matrices: with $C = G^\top G$, $K = W^\top G$, $\Gamma = W^\top W$,

$$M(S) = Y^\top Y = C + K^\top S + S K + S \Gamma S,\quad R = (M + \mu^2 I)^{-1/2},\quad
A = Y R,\quad L_W(A) = P(Z R + R Z^\top),\ Z = W^\top Y = K + \Gamma S,$$

$\|Y\|_* = \operatorname{tr} M^{1/2}$ and $\langle G, A\rangle = \operatorname{tr}((C + K^\top S) R)$.
One symmetric eigendecomposition of $M$ in float64 is an *exact* polar factor at any
conditioning (no Newton-Schulz accuracy floor): it is what ``msign_calls`` counts for this
solver. The $m \times n$ work is three Gram products and the final $A = (G + W S) R$.
$\mu = 10^{-4}\,\sigma_{\mathrm{rms}}(G)$ (``smoothing``) smooths the nuclear norm to
$\operatorname{tr}(M + \mu^2)^{1/2}$; it keeps the dual differentiable where $Y$ loses rank and
makes $\|A\|_{\mathrm{op}} < 1$ hold exactly, at a cost of at most $\mu$ per singular value in
the objective.

**Step.** Freezing $R$ linearises the stationarity condition $L_W(A) = 0$ in $S$:
$J(\Delta) = \tfrac12 P(\Gamma \Delta R + R \Delta \Gamma)$, $\Delta = -J^{-1}(\tfrac12 L_W(A))$
(a Gauss-Newton step). $J$ is inverted exactly: in the eigenbasis of $R$ for Stiefel
($\tilde\Delta_{ij} = -\tilde H_{ij}/(r_i + r_j)$), by an $n \times n$ solve with $\Gamma \circ R$
for Oblique, in the eigenbasis of $D^{-1/2} R D^{-1/2}$ with a Schur complement for the zero
diagonal for DGram; other masks use preconditioned CG. Anderson mixing over the last steps
accelerates the fixed point; a mixed step that doubles the residual is replaced by the plain
step from the best point. The iterate with the lowest residual is returned.

**Degenerate duals.** Below aspect ratio 2 the dual optimum is typically degenerate ($Y^\star$
loses rank; the optimal $A$ is not unique) and dual iterations crawl. DGram and custom masks
with $m < 2n$, and entries whose residual stalls, continue with Douglas-Rachford splitting
between the tangent space and the unit spectral ball, also in Gram space. If ``max_iter`` runs
out, the best direction is projected onto the tangent space and scaled by its exact spectral
norm (one more $n\times n$ eigenvalue problem): every returned direction is tangent to rounding
with $\|A\|_{\mathrm{op}} \le 1$; ``converged`` says whether the dual was solved to ``tol`` and
``dual_gap`` bounds the suboptimality.

The stop test is the tangent residual $\mathrm{RMS}(L_W(A)) \le$ ``tol``, on exactly the $A$
that is returned. $G$ is normalised to $\|G\|_F = 1$ first: the argmax does not change and every
solver except ``"published"`` is scale-invariant. ``stats["dual"]`` holds the dual correction
$S^\star - S_T$ relative to the tangent-projection start $S_T$ (for the normalised $G$); passed
back as ``dual=`` it warm-starts the next call.
"""
from __future__ import annotations

import math

import torch

from manifolds import DGram, Euclidean, GramManifold, Oblique, Stiefel, msign
from manifolds.base import from_tall, to_tall

__all__ = ["spectral_direction", "SOLVERS", "DEFAULT_SOLVER", "SOLVER_OPTIONS", "tangent_residual", "mask_kind"]

SOLVERS = ("gram_newton", "tangent", "published")
DEFAULT_SOLVER = "gram_newton"

_MSIGN_OPTIONS = {"msign": "polar_express", "msign_steps": 5, "msign_dtype": None, "trace": False}
SOLVER_OPTIONS: dict[str, dict] = {
    "gram_newton": {
        "tol": 1e-4, "max_iter": 50, "anderson": 5, "smoothing": 1e-4, "compute_dtype": torch.float64,
        "cg_iters": 10, "cg_tol": 1e-2, "dual": None, **_MSIGN_OPTIONS,
    },
    "tangent": dict(_MSIGN_OPTIONS),
    "published": {
        "steps": 20, "alpha": 0.1, "tol": 1e-6, "dual": None,
        "msign": "polar_express", "msign_steps": 5, "msign_dtype": torch.bfloat16, "trace": False,
    },
}


# ---------------------------------------------------------------------------------------- helpers
def _sym(X: torch.Tensor) -> torch.Tensor:
    return 0.5 * (X + X.mT)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched Frobenius inner product, shape (..., 1, 1)."""
    return (a * b).sum(dim=(-2, -1), keepdim=True)


def mask_kind(manifold: GramManifold) -> str:
    """Which closed forms apply: ``stiefel``, ``dgram``, ``oblique``, ``euclidean`` or ``generic``
    (decided by the mask, so subclasses that keep a built-in ``project_gram`` share its solver)."""
    pg = type(manifold).project_gram
    for kind, cls in (("euclidean", Euclidean), ("stiefel", Stiefel), ("dgram", DGram), ("oblique", Oblique)):
        if pg is cls.project_gram:
            return kind
    return "generic"


def _constraint_count(manifold: GramManifold, n: int, like: torch.Tensor) -> float:
    return float(manifold.gram_mask(n, like).sum())


def tangent_residual(manifold: GramManifold, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    r"""RMS of $L_W(A)$ over the constrained entries of the Gram matrix, per matrix (batch shape).

    Zero for Euclidean (no constraints). For Oblique it averages over the $n$ diagonal entries,
    for Stiefel over all $n^2$, for DGram over the $n^2 - n$ off-diagonal ones.
    """
    H = manifold.tangent_constraint(W, A)
    count = _constraint_count(manifold, H.shape[-1], H)
    if count == 0:
        return torch.zeros(H.shape[:-2], dtype=H.dtype, device=H.device)
    return (H.square().sum(dim=(-2, -1)) / count).sqrt()


def _msign(X: torch.Tensor, opts: dict) -> torch.Tensor:
    return msign(X, opts["msign"], steps=opts["msign_steps"], compute_dtype=opts["msign_dtype"])


def _normalise(G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """G / ||G||_F per matrix (robust to tiny and huge scales) and a mask of zero matrices."""
    amax = G.abs().amax(dim=(-2, -1), keepdim=True)
    zero = amax == 0
    Gs = G / torch.where(zero, torch.ones_like(amax), amax)
    nrm = Gs.norm(dim=(-2, -1), keepdim=True)
    return Gs / torch.where(zero, torch.ones_like(nrm), nrm), zero


# ---------------------------------------------------------------------------------------- entry
def spectral_direction(manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, *, solver: str = DEFAULT_SOLVER,
                       **options: object) -> tuple[torch.Tensor, dict]:
    r"""Unit-spectral-norm tangent direction maximising $\langle G, A\rangle$ at ``W``.

    Args:
        manifold: a :class:`manifolds.GramManifold` (any mask; built-in masks get closed forms).
        W: point(s) on the manifold, ``(..., m, n)``; wide matrices are constrained on rows.
        G: gradient or momentum, shaped like ``W``, finite.
        solver: ``"gram_newton"`` (default: converged, scale-invariant, warm-startable),
            ``"tangent"`` (one msign of the tangent-projected $G$) or ``"published"`` (the
            paper's dual ascent as published: not scale-invariant, 20 bf16 msign calls).
        **options: solver options; see ``SOLVER_OPTIONS[solver]`` for names and defaults.
            ``gram_newton``: ``tol`` (RMS tangent residual to stop at), ``max_iter``
            (eigendecompositions at most), ``anderson`` (mixing depth, 0 = off), ``smoothing``
            ($\mu / \sigma_{\mathrm{rms}}(G)$), ``compute_dtype`` (of the $n \times n$ solve),
            ``cg_iters``/``cg_tol`` (inner CG for custom masks), ``dual`` (warm start: a previous
            ``stats["dual"]``), ``trace`` (record residual and objective after every evaluation
            of the first matrix in ``stats["trace"]``). ``msign``/``msign_steps``/``msign_dtype`` set the
            matrix sign used by ``tangent``, ``published`` and, for Euclidean, by every solver.

    Returns:
        ``(A, stats)``: ``A`` shaped like ``W``, in ``W``'s dtype; ``stats`` a dict with per-matrix
        tensors (batch shape) ``msign_calls``, ``residual`` (RMS of $L_W(A)$ over constrained
        entries), ``converged`` and, where known, ``dual_gap`` (relative:
        $(\|Y\|_* - \langle \hat G, A\rangle) / \|Y\|_*$ for $\hat G = G/\|G\|_F$), plus ``dual``
        (the dual variable, for warm starts) and ``solver``.

    Euclidean (no constraint) returns ``msign(G)`` with the configured msign: plain Muon, for
    every solver. A zero ``G`` gives ``A = 0``.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; valid: {', '.join(SOLVERS)}")
    if not isinstance(manifold, GramManifold):
        raise TypeError(f"spectral_direction needs a manifolds.GramManifold; got {type(manifold).__name__}")
    unknown = set(options) - set(SOLVER_OPTIONS[solver])
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))} for solver {solver!r}; "
                         f"valid: {', '.join(SOLVER_OPTIONS[solver])}")
    opts = {**SOLVER_OPTIONS[solver], **options}
    if W.shape != G.shape or W.dim() < 2:
        raise ValueError(f"W and G must have the same shape (..., m, n); got {tuple(W.shape)} and {tuple(G.shape)}")
    if not bool(torch.isfinite(G).all()):
        raise ValueError("G has non-finite entries (NaN or Inf); skip this update instead")
    T, Gt = to_tall(W), to_tall(G, like=W)
    batch = T.shape[:-2]
    m, n = T.shape[-2:]
    T3, G3 = T.reshape(-1, m, n), Gt.reshape(-1, m, n)

    if mask_kind(manifold) == "euclidean":
        A3 = _msign(G3, opts)
        B = T3.shape[0]
        stats = {"msign_calls": torch.ones(B, dtype=torch.long), "residual": torch.zeros(B, dtype=torch.float64),
                 "converged": torch.ones(B, dtype=torch.bool), "dual": None}
    elif solver == "tangent":
        A3 = _msign(manifold.proju(T3, G3), opts)
        B = T3.shape[0]
        stats = {"msign_calls": torch.ones(B, dtype=torch.long),
                 "residual": tangent_residual(manifold, T3, A3).double().cpu(),
                 "converged": torch.ones(B, dtype=torch.bool), "dual": None}
        if opts["trace"]:
            stats["trace"] = _Trace()
            stats["trace"].add(stats["residual"][0], _objective0(G3, A3))
    elif solver == "published":
        A3, stats = _published(manifold, T3, G3, opts)
    else:
        A3, stats = _gram_newton(manifold, T3, G3, opts)
    stats["solver"] = solver
    if "trace" in stats:
        stats["trace"] = stats["trace"].as_dict()
    for key, val in list(stats.items()):
        if isinstance(val, torch.Tensor) and key != "dual":
            stats[key] = val.reshape(batch)
    if stats.get("dual") is not None:
        stats["dual"] = stats["dual"].reshape(*batch, n, n)
    return from_tall(A3.reshape(T.shape), like=W), stats


# ---------------------------------------------------------------------------------------- published
def _published(manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, opts: dict):
    r"""The published dual ascent, as published: no normalisation of $G$,
    $\Lambda_0 = -P(W^\top G + G^\top W)/4$, $A = \operatorname{msign}(G + L^*(\Lambda))$,
    $\Lambda \leftarrow \Lambda - \alpha (1 - k/K) L(A)$, stop when $\|L(A)\|_F/n < $ tol."""
    steps, alpha, tol = int(opts["steps"]), float(opts["alpha"]), float(opts["tol"])
    n = T.shape[-1]
    Lam = -0.25 * manifold.tangent_constraint(T, G) if opts["dual"] is None else opts["dual"].reshape(-1, n, n).to(T)
    calls = 0
    A = H = None
    trace = _Trace() if opts["trace"] else None
    count = _constraint_count(manifold, n, T)
    for k in range(max(steps, 1)):
        A = _msign(G + manifold.tangent_constraint_adjoint(T, Lam), opts)
        calls += 1
        H = manifold.tangent_constraint(T, A)
        if trace is not None:
            trace.add((H[0].square().sum() / max(count, 1.0)).sqrt(), _objective0(G, A))
        if float(H.norm(dim=(-2, -1)).max()) / n < tol:  # RMS over all n^2 entries, as published
            break
        Lam = Lam - alpha * (1 - k / steps) * H
    B = T.shape[0]
    res = (H.square().sum(dim=(-2, -1)) / max(count, 1.0)).sqrt()
    out = {"msign_calls": torch.full((B,), calls, dtype=torch.long), "residual": res.double().cpu(),
           "converged": (H.norm(dim=(-2, -1)) / n < tol).cpu(), "dual": Lam}
    if trace is not None:
        out["trace"] = trace
    return A, out


class _Trace:
    """Per-evaluation history of the first matrix of a batch (option ``trace=True``)."""

    def __init__(self):
        self.residual, self.objective, self.dual_bound = [], [], []

    def add(self, residual, objective, dual_bound=None) -> None:
        self.residual.append(float(residual))
        self.objective.append(float(objective))
        self.dual_bound.append(None if dual_bound is None else float(dual_bound))

    def as_dict(self) -> dict:
        return {"residual": self.residual, "objective": self.objective, "dual_bound": self.dual_bound}


def _objective0(G: torch.Tensor, A: torch.Tensor) -> float:
    r"""$\langle G/\|G\|_F, A\rangle$ of the first matrix of a batch."""
    G0, A0 = G[0].double(), A[0].double()
    nrm = float(G0.norm())
    return float((G0 * A0).sum()) / nrm if nrm > 0 else 0.0


# ---------------------------------------------------------------------------------------- gram_newton
class _GramDual:
    """The Gram-space dual of a batch of tall problems: data, evaluation and the frozen-R step."""

    def __init__(self, manifold: GramManifold, T: torch.Tensor, Gh: torch.Tensor, opts: dict):
        cd = opts["compute_dtype"]
        if cd not in (torch.float32, torch.float64):
            raise ValueError(f"compute_dtype must be torch.float32 or torch.float64; got {cd}")
        self.manifold, self.kind = manifold, mask_kind(manifold)
        self.Td, self.Gd = T.to(cd), Gh.to(cd)
        self.C, self.K, self.Gw = self.Gd.mT @ self.Gd, self.Td.mT @ self.Gd, self.Td.mT @ self.Td
        self.n = T.shape[-1]
        self.P = manifold.project_gram
        self.count = _constraint_count(manifold, self.n, self.C)
        self.mu2 = float(opts["smoothing"]) ** 2 / self.n  # sigma_rms(G_hat)^2 = 1/n
        self.cg_iters, self.cg_tol = int(opts["cg_iters"]), float(opts["cg_tol"])
        self.d = self.Gw.diagonal(dim1=-2, dim2=-1)
        # the step only steers the iteration (residuals are always evaluated in compute_dtype)
        self.step_dtype = torch.float32

    def sub(self, idx: torch.Tensor) -> "_GramDual":
        """The same dual restricted to batch entries ``idx`` (itself when ``idx`` is every entry)."""
        if len(idx) == self.C.shape[0] and bool((idx == torch.arange(len(idx), device=idx.device)).all()):
            return self
        out = object.__new__(_GramDual)
        out.__dict__.update(self.__dict__)
        for k in ("C", "K", "Gw", "d", "Td", "Gd"):
            setattr(out, k, getattr(self, k)[idx])
        return out

    def normal_coords(self, H: torch.Tensor) -> torch.Tensor:
        r"""$S = P(S)$ symmetric with $P(\Gamma S + S \Gamma) = H$ (the solve inside ``proju``)."""
        d = self.d
        if self.kind == "stiefel":
            return H / 2
        if self.kind == "dgram":
            return H / (d[..., :, None] + d[..., None, :])
        if self.kind == "oblique":
            return torch.diag_embed(H.diagonal(dim1=-2, dim2=-1) / (2 * d))
        op = lambda X: self.P(self.Gw @ X + X @ self.Gw)  # noqa: E731
        pre = lambda X: self.P(X / (d[..., :, None] + d[..., None, :]))  # noqa: E731
        return _pcg(op, H, pre, 4 * self.cg_iters, 1e-8)

    def evaluate(self, S: torch.Tensor) -> dict:
        KtS = self.K.mT @ S
        SG = S @ self.Gw
        M = _sym(self.C + KtS + KtS.mT + SG @ S)
        lam, V = torch.linalg.eigh(M)
        lam = lam.clamp_min(0)
        sq = (lam + self.mu2).sqrt()
        R = (V / sq.unsqueeze(-2)) @ V.mT
        ZR = (self.K + SG.mT) @ R
        H = self.P(ZR + ZR.mT)
        res = (H.square().sum(dim=(-2, -1)) / self.count).sqrt()
        dual = lam.sqrt().sum(-1)
        prim = ((self.C + KtS) * R).sum(dim=(-2, -1))
        return {"S": S, "V": V, "r": 1 / sq, "R": R, "H": H, "res": res, "dual": dual, "prim": prim}

    # -------------------------------------------------------- Douglas-Rachford (degenerate duals)
    # Matrices F = G_hat a + W b are held as coefficient pairs Z = (a, b), shape (B, 2, n, n).
    def proj_tangent(self, Z: torch.Tensor) -> torch.Tensor:
        a, b = Z[:, 0], Z[:, 1]
        X = self.K @ a + self.Gw @ b  # W^T F
        return torch.stack([a, b - self.normal_coords(self.P(X + X.mT))], 1)

    def proj_ball(self, Z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Spectral-norm ball projection F h(F^T F), with its tangent residual and objective."""
        a, b = Z[:, 0], Z[:, 1]
        X1, X2 = self.C @ a + self.K.mT @ b, self.K @ a + self.Gw @ b  # G^T F, W^T F
        lam, V = torch.linalg.eigh(_sym(a.mT @ X1 + b.mT @ X2))
        h = (V * lam.clamp_min(1.0).rsqrt().unsqueeze(-2)) @ V.mT
        WtY = X2 @ h
        H = self.P(WtY + WtY.mT)
        res = (H.square().sum(dim=(-2, -1)) / self.count).sqrt()
        return torch.stack([a @ h, b @ h], 1), res, (X1 * h).sum(dim=(-2, -1))

    def polish(self, Z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""$A \to \Pi_T(A) / \max(1, \|\Pi_T(A)\|_{\mathrm{op}})$ on coefficients; returns the new
        coefficients, their tangent residual and $\langle \hat G, A\rangle$."""
        Z = self.proj_tangent(Z)
        a, b = Z[:, 0], Z[:, 1]
        X1, X2 = self.C @ a + self.K.mT @ b, self.K @ a + self.Gw @ b
        top = torch.linalg.eigvalsh(_sym(a.mT @ X1 + b.mT @ X2))[..., -1].clamp_min(0).sqrt()
        scale = 1 / top.clamp_min(1.0)
        Z = Z * scale[:, None, None, None]
        WtA = X2 * scale[:, None, None]
        H = self.P(WtA + WtA.mT)
        res = (H.square().sum(dim=(-2, -1)) / self.count).sqrt()
        prim = X1.diagonal(dim1=-2, dim2=-1).sum(-1) * scale
        return Z, res, prim

    def frobenius(self, Z: torch.Tensor) -> torch.Tensor:
        r"""$\|G a + W b\|_F$ of coefficient pairs."""
        a, b = Z[:, 0], Z[:, 1]
        sq = (a * (self.C @ a + self.K.mT @ b)).sum(dim=(-2, -1)) + (b * (self.K @ a + self.Gw @ b)).sum(dim=(-2, -1))
        return sq.clamp_min(0).sqrt()

    def dual_value(self, S: torch.Tensor) -> torch.Tensor:
        r"""$\|G + W S\|_*$: an upper bound on the optimum for any admissible $S$."""
        KtS = self.K.mT @ S
        M = _sym(self.C + KtS + KtS.mT + S @ self.Gw @ S)
        return torch.linalg.eigvalsh(M).clamp_min(0).sqrt().sum(-1)

    def step(self, ev: dict) -> torch.Tensor:
        r"""$\Delta$ with $\tfrac12 P(\Gamma\Delta R + R\Delta\Gamma) = -\tfrac12 H$ (frozen $R$)."""
        H, V, r, R = ev["H"], ev["V"], ev["r"], ev["R"]
        if self.kind == "stiefel":
            Vs, Hs = V.to(self.step_dtype), H.to(self.step_dtype)
            rr = (r[..., :, None] + r[..., None, :]).to(self.step_dtype)
            return (-Vs @ ((Vs.mT @ Hs @ Vs) / rr) @ Vs.mT).to(H.dtype)
        if self.kind == "oblique":
            s = torch.linalg.solve(self.Gw * R, -0.5 * H.diagonal(dim1=-2, dim2=-1))
            return torch.diag_embed(s)
        if self.kind == "dgram":
            return self._dgram_step(H, R)
        op = lambda X: 0.5 * self.P(self.Gw @ X @ R + R @ X @ self.Gw)  # noqa: E731
        dbar = self.d.mean(-1)[..., None, None]
        Gam = 2 / (dbar * (r[..., :, None] + r[..., None, :]))
        pre = lambda X: self.P(_sym(V @ ((V.mT @ self.P(X) @ V) * Gam) @ V.mT))  # noqa: E731
        return _pcg(op, -0.5 * H, pre, self.cg_iters, self.cg_tol)

    def _dgram_step(self, H: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
        r"""Exact frozen step for $P = \mathrm{Off}$, $\Gamma = D$ diagonal.

        With $E = D^{1/2}\Delta D^{1/2}$ and $R' = D^{-1/2} R D^{-1/2} = U \operatorname{diag}(\rho) U^\top$
        the system is $\mathrm{Off}(E R' + R' E) = F := -D^{-1/2} H D^{-1/2}$, $\operatorname{diag} E = 0$.
        $B(E) = ER' + R'E$ is inverted in the eigenbasis of $R'$; the zero diagonal is enforced by a
        Schur complement: $E = B^{-1}(F + \operatorname{diag}\nu)$ with $N\nu = -\operatorname{diag}B^{-1}F$,
        $N_{kl} = \sum_{ij} U_{ki}U_{kj}\,\Gamma_{ij}\,U_{li}U_{lj}$, $\Gamma_{ij} = 1/(\rho_i + \rho_j)$,
        assembled from a low-rank factor $\Gamma \approx LL^\top$ (pivoted Cholesky) as
        $N \approx \sum_q (U \operatorname{diag}(L_q) U^\top)^{\circ 2}$.
        """
        sd = self.step_dtype
        isd = self.d.clamp_min(torch.finfo(self.d.dtype).tiny).rsqrt()
        scale = isd[..., :, None] * isd[..., None, :]
        rho, U = torch.linalg.eigh((R * scale).to(sd))
        Gam = 1 / (rho[..., :, None] + rho[..., None, :])
        L = _pivoted_cholesky(Gam, tol=1e-3, max_rank=10)
        N = torch.zeros_like(Gam)
        for q in range(L.shape[-1]):
            N = N + ((U * L[..., q].unsqueeze(-2)) @ U.mT).square()
        eye = torch.eye(self.n, dtype=N.dtype, device=N.device)
        N = N + 1e-6 * N.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye
        F = (-self.P(H) * scale).to(sd)
        E0 = U @ ((U.mT @ F @ U) * Gam)
        nu = torch.linalg.solve(N, -(E0 * U).sum(-1))  # diag(E0 U^T) = diag(B^{-1} F)
        E = (U @ ((U.mT @ (F + torch.diag_embed(nu)) @ U) * Gam) @ U.mT).to(H.dtype)
        return self.P(_sym(E)) * scale


def _pivoted_cholesky(A: torch.Tensor, tol: float, max_rank: int) -> torch.Tensor:
    """Low-rank factor L (B, n, k) with A ~ L L^T for a batch of PSD matrices (greedy pivoting)."""
    B, n, _ = A.shape
    d = A.diagonal(dim1=-2, dim2=-1).clone()
    total = d.sum(-1, keepdim=True)
    cols = []
    ar = torch.arange(B, device=A.device)
    for _ in range(min(max_rank, n)):
        piv = d.argmax(-1)
        dp = d[ar, piv]
        if bool((dp <= tol * total.squeeze(-1) / n).all()):
            break
        c = A[ar, :, piv].clone()
        for l in cols:
            c = c - l * l[ar, piv].unsqueeze(-1)
        c = c / dp.clamp_min(torch.finfo(A.dtype).tiny).sqrt().unsqueeze(-1)
        c = torch.where((dp > 0).unsqueeze(-1), c, torch.zeros_like(c))
        cols.append(c)
        d = (d - c.square()).clamp_min(0)
    if not cols:
        return torch.zeros(B, n, 1, dtype=A.dtype, device=A.device)
    return torch.stack(cols, -1)


def _pcg(op, b: torch.Tensor, pre, iters: int, rtol: float) -> torch.Tensor:
    """Batched preconditioned CG for an SPD operator on (B, n, n) tensors; per-entry stopping."""
    x = torch.zeros_like(b)
    r = b.clone()
    bnorm = _dot(b, b).sqrt()
    done = bnorm == 0
    z = pre(r)
    p = z.clone()
    rz = _dot(r, z)
    for _ in range(iters):
        Ap = op(p)
        pAp = _dot(p, Ap)
        ok = (~done) & (pAp > 0) & (rz > 0)
        if not bool(ok.any()):
            break
        alpha = torch.where(ok, rz / torch.where(ok, pAp, torch.ones_like(pAp)), torch.zeros_like(pAp))
        x = x + alpha * p
        r = r - alpha * Ap
        done = done | ~ok | (_dot(r, r).sqrt() <= rtol * bnorm)
        if bool(done.all()):
            break
        z = pre(r)
        rz_new = _dot(r, z)
        beta = torch.where(ok & (rz > 0), rz_new / torch.where(rz > 0, rz, torch.ones_like(rz)), torch.zeros_like(rz))
        p = z + beta * p
        rz = rz_new
    return x


# An entry stops when its best residual fell by less than this factor over this many evaluations:
# where the dual optimum is degenerate (square DGram/Oblique: Y loses rank) progress becomes slow.
_STALL_WINDOW, _STALL_FACTOR = 4, 0.7
_DR_ASPECT = 2.0
_FLOOR = 1e-6  # residuals below this are at the rounding floor of float32 weights
_DR_RELAX = 1.5  # over-relaxed Douglas-Rachford: 10-20% fewer evaluations than 1.0 (measured)
_DR_ANDERSON = 2  # deeper Anderson histories destabilise Douglas-Rachford on these problems (measured)


class _Anderson:
    """Type-II Anderson mixing of the fixed point x -> x + f(x), one history per batch entry.

    The last ``depth`` differences of iterates and steps are kept in a ring buffer (their order
    does not matter to the least-squares fit); ``reset`` forgets an entry's history.
    """

    def __init__(self, depth: int, like: torch.Tensor):
        self.depth = depth
        B, N = like.shape[0], like[0].numel()
        kw = {"dtype": torch.float64, "device": like.device}  # the least-squares fit needs float64
        self.dX = torch.zeros(B, max(depth, 1), N, **kw)
        self.dF = torch.zeros(B, max(depth, 1), N, **kw)
        self.count = torch.zeros(B, dtype=torch.long, device=like.device)  # differences stored so far
        self.prev_x = torch.zeros(B, N, **kw)
        self.prev_f = torch.zeros(B, N, **kw)
        self.has_prev = torch.zeros(B, dtype=torch.bool, device=like.device)

    def reset(self, idx: torch.Tensor) -> None:
        self.count[idx] = 0
        self.has_prev[idx] = False

    def mix(self, idx: torch.Tensor, X: torch.Tensor, F: torch.Tensor) -> torch.Tensor:
        """Next iterate for entries ``idx`` at points X with plain steps F (shapes (len(idx), ...))."""
        if self.depth == 0:
            return X + F
        b = len(idx)
        x, f = X.reshape(b, -1).double(), F.reshape(b, -1).double()
        hp = self.has_prev[idx]
        if bool(hp.any()):
            j = idx[hp]
            pos = self.count[j] % self.depth
            self.dX[j, pos] = x[hp] - self.prev_x[j]
            self.dF[j, pos] = f[hp] - self.prev_f[j]
            self.count[j] += 1
        self.prev_x[idx], self.prev_f[idx], self.has_prev[idx] = x, f, True
        k = self.count[idx].clamp(max=self.depth)
        out = x + f
        use = k > 0
        if bool(use.any()):
            j = idx[use]
            whole = len(j) == self.dX.shape[0] and bool((j == torch.arange(len(j), device=j.device)).all())
            dX, dF = (self.dX, self.dF) if whole else (self.dX[j], self.dF[j])  # avoid copying the history
            valid = (torch.arange(self.depth, device=k.device)[None, :] < k[use][:, None]).to(x.dtype)
            Gm = (dF @ dF.mT) * (valid[:, :, None] * valid[:, None, :])
            reg = 1e-10 * Gm.diagonal(dim1=-2, dim2=-1).amax(-1, keepdim=True) + 1e-300
            Gm = Gm + torch.diag_embed(valid * reg + (1 - valid))
            gam = torch.linalg.solve(Gm, (dF @ f[use].unsqueeze(-1)).squeeze(-1) * valid)
            out[use] = out[use] - ((dX + dF) * gam.unsqueeze(-1)).sum(1)
        return out.reshape(X.shape).to(X.dtype)


def _gram_newton(manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, opts: dict):
    tol, max_iter = float(opts["tol"]), int(opts["max_iter"])
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1; got {max_iter}")
    B, m, n = T.shape
    Gh, zero = _normalise(G)
    dual = _GramDual(manifold, T, Gh, opts)
    cd = dual.C.dtype
    # Start at the tangent projection, S_T: Y = G_hat + W S_T = proju(W, G_hat). A warm start adds the
    # previous solve's correction S - S_T (that is what ``stats["dual"]`` holds): the correction
    # moves slowly between optimizer steps, and it is exactly zero where S_T is optimal (square Stiefel).
    S_T = -dual.normal_coords(dual.P(dual.K + dual.K.mT))
    S = S_T.clone()
    if opts["dual"] is not None:
        S = S + dual.P(_sym(opts["dual"].reshape(B, n, n).to(device=T.device, dtype=cd)))
    S = torch.where(zero, torch.zeros_like(S), S)

    calls = torch.zeros(B, dtype=torch.long)
    best_res = torch.full((B,), math.inf, dtype=cd, device=T.device)
    best_S, best_R = torch.zeros_like(S), torch.zeros_like(S)
    best_D = torch.zeros_like(S)
    best_dual = torch.zeros(B, dtype=cd, device=T.device)
    best_prim = torch.zeros_like(best_dual)
    active = (~zero.view(B)).nonzero().squeeze(-1)
    mixer = _Anderson(int(opts["anderson"]), S)
    trace = _Trace() if opts["trace"] else None
    history: list[torch.Tensor] = []  # best residual after each evaluation, for the stagnation test
    # Below aspect ratio 2 the DGram dual optimum is typically degenerate (Y* loses rank): the
    # Gauss-Newton iteration crawls there, so such problems go to Douglas-Rachford after one step.
    frozen_budget = 1 if dual.kind in ("dgram", "generic") and m < _DR_ASPECT * n else max_iter
    for _ in range(frozen_budget):
        if active.numel() == 0:
            break
        ev = dual.sub(active).evaluate(S[active])
        calls[active.cpu()] += 1
        res = ev["res"]
        if trace is not None and int(active[0]) == 0:
            trace.add(res[0], ev["prim"][0], ev["dual"][0])
        improved = res < best_res[active]
        worse = res > 2 * best_res[active]  # a bad (mixed) step: restart from the best point
        upd = active[improved]
        best_res[upd], best_S[upd], best_R[upd] = res[improved], ev["S"][improved], ev["R"][improved]
        best_dual[upd], best_prim[upd] = ev["dual"][improved], ev["prim"][improved]
        history.append(best_res.clone())
        conv = res <= tol
        if len(history) > _STALL_WINDOW:  # stop entries whose best residual stalls (degenerate duals)
            conv = conv | (best_res[active] > _STALL_FACTOR * history[-1 - _STALL_WINDOW][active])
        if bool(conv.all()):
            break
        go = ~conv
        idx, ev = active[go], {k: v[go] for k, v in ev.items()}
        res, worse, improved = res[go], worse[go], improved[go]
        D = dual.sub(idx).step(ev)
        best_D[idx[improved]] = D[improved]
        Snext = ev["S"].clone()
        if bool(worse.any()):
            mixer.reset(idx[worse])
            Snext[worse] = best_S[idx[worse]] + best_D[idx[worse]]
        ok = ~worse
        if bool(ok.any()):
            Snext[ok] = dual.P(_sym(mixer.mix(idx[ok], ev["S"][ok], D[ok])))
        S[idx] = Snext
        active = idx

    # The direction as Gram-space coefficients A = G_hat a + W b: A = Y R gives (a, b) = (R, S R).
    coef = torch.stack([best_R, best_S @ best_R], 1)
    out_dual = best_S.clone()
    # Douglas-Rachford for entries that stalled on a degenerate dual; not for those that stalled
    # at the rounding floor (a float32 W is only on the manifold to ~1e-7): those are polished below.
    stalled = (best_res > max(tol, _FLOOR)) & (calls.to(best_res.device) < max_iter) & ~zero.view(B)
    if bool(stalled.any()):
        idx = stalled.nonzero().squeeze(-1)
        coef_dr, res_dr, prim_dr, S_dr, n_dr = _douglas_rachford(dual.sub(idx), best_S[idx], best_R[idx], tol,
                                                                 max_iter - calls[idx.cpu()].to(idx.device),
                                                                 min(int(opts["anderson"]), _DR_ANDERSON),
                                                                 trace if int(idx[0]) == 0 else None)
        calls[idx.cpu()] += n_dr.cpu()
        better = res_dr < best_res[idx]
        j = idx[better]
        coef[j], best_res[j], best_prim[j], out_dual[j] = coef_dr[better], res_dr[better], prim_dr[better], S_dr[better]
        best_dual[j] = torch.minimum(best_dual[j], dual.sub(j).dual_value(out_dual[j]))
        calls[j.cpu()] += 1  # that eigenvalue problem is an evaluation too
    converged = best_res <= tol
    final_res = best_res.clone()
    polish = ~converged & ~zero.view(B)
    if bool(polish.any()):
        # Not converged within max_iter (degenerate duals): project onto the tangent space and scale
        # into the unit ball, by the exact spectral norm (an n x n eigenvalue problem), so the
        # direction is still feasible; its suboptimality is bounded by the reported dual gap.
        j = polish.nonzero().squeeze(-1)
        coef[j], final_res[j], best_prim[j] = dual.sub(j).polish(coef[j])
        calls[j.cpu()] += 1
        if trace is not None and int(j[0]) == 0:
            trace.add(final_res[0], best_prim[0], best_dual[0])
    A = dual.Gd @ coef[:, 0] + dual.Td @ coef[:, 1]
    A = torch.where(zero, torch.zeros_like(A), A).to(T.dtype)
    z = zero.view(B).cpu()
    res = torch.where(z, torch.zeros(B, dtype=torch.float64), final_res.double().cpu())
    gap = (best_dual - best_prim) / best_dual.clamp_min(torch.finfo(cd).tiny)
    gap = torch.where(z, torch.zeros(B, dtype=torch.float64), gap.double().cpu())
    conv = converged.cpu() | z
    out_dual = torch.where(zero, torch.zeros_like(out_dual), out_dual - S_T)
    out = {"msign_calls": calls, "residual": res, "converged": conv, "dual_gap": gap, "dual": out_dual}
    if trace is not None:
        out["trace"] = trace
    return A, out


def _douglas_rachford(dual: _GramDual, S: torch.Tensor, R: torch.Tensor, tol: float, budget: torch.Tensor, depth: int,
                      trace: "_Trace | None" = None):
    r"""Anderson-accelerated Douglas-Rachford splitting between the tangent space and the unit
    spectral ball, in Gram-space coefficients, for entries whose dual is degenerate.

    $x = \Pi_T(z + \hat G/\rho)$, $y = \Pi_{\mathrm{ball}}(2x - z)$, $z \leftarrow z + \lambda (y - x)$,
    $\lambda = 1.5$, $\rho = \sigma_{\mathrm{rms}}(\hat G) = n^{-1/2}$, started at the fixed point implied by the
    current dual iterate, $z_0 = A - Y/\rho$. Returns the coefficients of $A = y$ (in the ball), its residual,
    $\langle \hat G, A\rangle$, the implied dual variable $-\rho S_F$ and the evaluations used.
    """
    B, n = S.shape[0], S.shape[-1]
    rho = n ** -0.5
    eye = torch.eye(n, dtype=S.dtype, device=S.device).expand(B, n, n)
    Z = torch.stack([R - eye / rho, S @ R - S / rho], 1)
    G_rho = torch.stack([eye / rho, torch.zeros_like(S)], 1)
    best_res = torch.full((B,), math.inf, dtype=S.dtype, device=S.device)
    best_Y, best_prim = torch.zeros_like(Z), torch.zeros_like(best_res)
    # safeguard of the mixing: the fixed-point residual |y - x|_F (a matrix norm, from the Grams)
    best_f = torch.full_like(best_res, math.inf)
    best_Z, best_F = Z.clone(), torch.zeros_like(Z)
    used = torch.zeros(B, dtype=torch.long, device=S.device)
    mixer = _Anderson(depth, Z)
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
        best_res[j], best_Y[j], best_prim[j] = res[imp], Y[imp], prim[imp]
        ok = fn <= best_f[active]
        j = active[ok]
        best_f[j], best_Z[j], best_F[j] = fn[ok], Za[ok], F[ok]
        go = (res > tol) & (used[active] < budget[active])
        Znext = mixer.mix(active, Za, _DR_RELAX * F)
        if bool((~ok).any()):  # the mixed point did worse: forget the history, plain step from the best
            jw = active[~ok]
            mixer.reset(jw)
            Znext[~ok] = best_Z[jw] + _DR_RELAX * best_F[jw]
        Z[active] = Znext
        active = active[go]
    Fa, Fb = best_Z[:, 0] + eye / rho, best_Z[:, 1]
    Xf = dual.K @ Fa + dual.Gw @ Fb
    S_dual = -rho * dual.normal_coords(dual.P(Xf + Xf.mT))
    return best_Y, best_res, best_prim, S_dual, used
