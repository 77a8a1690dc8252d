r"""Products-only Gram-space solves for any mask: what `GramManifold`'s generic maps are built from.

For a tall $W$ with Gram matrix $A = W^\top W$ and an entrywise 0/1 mask $P$, every generic map needs the
**normal equation**

$$\mathcal L_A(S) = P(AS + SA) = R,\qquad S = S^\top = P(S),$$

(the tangent projection: $R = L_W(U)$; a Newton step onto the manifold: $R = -P(A - I)$). $\mathcal L_A$ is
self-adjoint on the masked symmetric matrices and positive definite where $A$ is
($\langle S, \mathcal L_A S\rangle = 2\operatorname{tr}(SAS)$), and one application is one $n \times n$ product
($AS + SA = AS + (AS)^\top$ for symmetric $S$). So `solve_normal_equation` runs conjugate gradients on it: no
matrix is formed in the $k$ masked entries (a dense solve would cost $k^3/3$, $1.2 \cdot 10^{11}$ flops at
$n = 128$ with blocks of 16), and a solve costs a few dozen $n \times n$ products.

**Preconditioners** (any symmetric positive definite map on the masked symmetric matrices keeps CG exact; they
differ in how many products a solve takes):

- *Jacobi* (the default): the diagonal of $\mathcal L_A$, $S_{ij} \mapsto (a_i + a_j) S_{ij}$ with $a =
  \operatorname{diag} A$: exact where $A$ is diagonal (DGram's and Oblique's points, Stiefel's), and for a block
  mask at a point of its manifold ($A$ block diagonal) the condition number is that of the column-normalised
  blocks. One product an iteration.
- *Congruence* (``factor`` $B$, `congruence_factor`): $z = \tfrac12 P(B r B)$ with $B \approx A^{-1/2}$ symmetric
  positive definite. It is SPD on the masked symmetric matrices for **any** SPD $B$:
  $\langle s, P(BrB) \rangle = \operatorname{tr}(sBrB) = \langle r, P(BsB) \rangle$ and
  $\langle r, P(BrB) \rangle = \|B^{1/2} r B^{1/2}\|_F^2 > 0$ for $r \ne 0$; so an approximate $B$ costs
  iterations, never accuracy. Where $A$ is block diagonal along the mask and $B = A^{-1/2}$, the preconditioned
  operator has the eigenvalues $(\lambda_i + \mu_j) / (2\sqrt{\lambda_i \mu_j}) \ge 1$ over the eigenvalues of
  two blocks: condition number about $\sqrt{\kappa}/2$ where Jacobi's is about $\kappa$ (the in-block conditioning,
  in the hundreds on a square attention matrix: 128x128, blocks of 16). Three products an iteration (the two of
  $BrB$ in $B$'s dtype, float32: the rounding of $B$ and of $BrB$ changes the preconditioner, not the equation, whose
  residual CG updates in the solve's dtype).

`congruence_factor` builds $B$ by products: $c \ge \lambda_{\max}(A)/2.5$ from a few power-iteration matrix-vector
products (and $\|A\|_\infty$), then coupled Newton-Schulz steps $T = \tfrac32 I - \tfrac12 ZY$, $Y \leftarrow YT$,
$Z \leftarrow TZ$ from $Y = A/c$, $Z = I$. Each is a polynomial in $A$, and on an eigenvalue $t = \lambda/c \in
(-\epsilon, 3)$ of $A/c$ the scalar iteration $t \leftarrow t(3 - t)^2/4$, $z \leftarrow z(3 - t)/2$ keeps $z > 0$;
after $k$ steps $z\sqrt{t}$ is within 1% of 1 where $t \ge 2.25^{2-k}$, and $z \le 1.5^k$ everywhere. So
$B = \operatorname{sym}(Z)/\sqrt c$ is SPD, $A^{-1/2}$ on the upper part of the spectrum and bounded on the lower,
which keeps a nearly singular block (a free block of nearly dependent columns) from dominating.

**Convergence test.** Per matrix of a batch, the recursively updated residual $r_k = R - \mathcal L_A(S_k)$ has
$\|r_k\|_F \le \mathrm{rtol}\,\|R\|_F$, with ``rtol`` `CG_RTOL` of the dtype the solve runs in (below). The
iteration also stops, with what it has, after ``max_iter`` products or where a step would divide by zero (a
singular $A$): `CGResult` reports the relative residual reached, and callers check what they need (the
projection onto the manifold checks the point it returns).

**Projection onto the manifold** (`gram_newton_factor`): Newton's method on $F(C) = P(C^\top G_0 C - I)$ with
updates $C \leftarrow C(I + E)$, $E = P(E)$ symmetric: at $A = C^\top G_0 C$ the linearisation is
$F + \mathcal L_A(E)$, so each step is one normal equation (inexact: CG to a tolerance that shrinks with the
residual, `newton_rtol`), and every quantity is $n \times n$; a step that does not reduce $\|F\|_F$ is halved.
$C$, $A$ and $F$ stay in $G_0$'s dtype (float64 from the projection): the residual is what decides. Each step's solve

- runs in float32 where its tolerance is at least `FLOAT32_SOLVE_RTOL` (products at about a third of float64's cost
  on a CPU, more on a GPU): float32 CG reaches a relative residual of $10^{-4}$ at the operator condition numbers
  met here (its residual drifts from the true one by about $\kappa \cdot 6 \cdot 10^{-8}$), and a step that falls
  short costs one more Newton step, since $F$ is measured in $G_0$'s dtype after it;
- starts with Jacobi for at most `JACOBI_ITERATIONS` iterations (enough for a well-conditioned $A$: a tall matrix at
  GPT-2's initialisation, 384x128, needs 3-8); where that does not converge, it builds `congruence_factor` of the
  current $A$ and continues from the iterate reached with the congruence preconditioner, and the later steps of the
  same projection build it at once (each from its own $A$: a projection from a raw initialisation moves $A$ far
  from $G_0$).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "CG_RTOL",
    "CG_MAX_ITER",
    "FLOAT32_SOLVE_RTOL",
    "JACOBI_ITERATIONS",
    "FACTOR_STEPS",
    "CGResult",
    "normal_operator",
    "jacobi",
    "congruence_factor",
    "solve_normal_equation",
    "newton_rtol",
    "gram_newton_factor",
    "scaled_residual",
    "cosine_residual",
]

# Relative residual at which CG stops, per dtype of the solve: about 10 unit roundoffs of float32 (its
# recursively updated residual drifts from the true one by ~kappa * eps, so 1e-6 is the floor for kappa ~ 10),
# and 1e-12 in float64, where the contract kit's tolerance is 1e-9 and the Newton projection's 1e-13 is reached
# by the quadratic step after it.
CG_RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
# At most this many operator products per solve: at n = 128 (float64) about 0.1 s on one CPU thread. The
# Jacobi-preconditioned operator at GPT-2's initialisation (blocks of 16) needs 10-20 to 1e-12.
CG_MAX_ITER = 500
# A Newton step of `gram_newton_factor` whose CG tolerance is at least this solves in float32 (module docstring).
FLOAT32_SOLVE_RTOL = 1e-4
# A Newton step's solve starts with at most this many Jacobi iterations before it builds the congruence factor: a
# well-conditioned A (384x128 at GPT-2's initialisation, in-block condition numbers 2-3) needs 3-8 to the Newton
# tolerances; a square 128x128 attention matrix (in-block condition numbers 1e2-1e9) 40-100, 12-25 with the factor.
JACOBI_ITERATIONS = 8
# Newton-Schulz steps of `congruence_factor` (3 products each, in float32): on square 128x128 attention matrices
# with blocks of 16, 3 steps cut the CG iterations 2.5x against Jacobi, 5 steps 3.5x; 5 give the fastest solve.
FACTOR_STEPS = 5
# Matrix-vector products of the power iteration that scales `congruence_factor`.
_POWER_ITERATIONS = 8


class CGResult(NamedTuple):
    """A CG solve: ``solution`` ``(..., n, n)``, ``iterations`` (operator products, an int) and ``residual``
    (``(...)``: the relative residual $\\|r\\|_F / \\|R\\|_F$ reached, 0 where $R = 0$)."""

    solution: torch.Tensor
    iterations: int
    residual: torch.Tensor


def normal_operator(mask: torch.Tensor, A: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    r"""$S \mapsto B \odot (AS + SA)$ for symmetric $S$ and the 0/1 ``mask`` $B$ of $P$: one $n \times n$ product."""

    def apply(S: torch.Tensor) -> torch.Tensor:
        AS = A @ S
        return mask * (AS + AS.mT)

    return apply


def jacobi(mask: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    r"""The inverse of $\mathcal L_A$'s diagonal on the mask, $B_{ij} / (a_i + a_j)$, $a = \operatorname{diag} A$
    (0 off the mask and where $a_i + a_j = 0$): the preconditioner is the entrywise product with it."""
    a = A.diagonal(dim1=-2, dim2=-1)
    den = a[..., :, None] + a[..., None, :]
    return torch.where(den > 0, mask / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))


def congruence_factor(A: torch.Tensor, steps: int = FACTOR_STEPS) -> torch.Tensor:
    r"""$B \approx A^{-1/2}$ ``(..., n, n)``, float32, symmetric positive definite, for a symmetric positive
    (semi)definite ``A``: the factor of the congruence preconditioner $z = \tfrac12 P(BrB)$ (module docstring).
    Products only: `_POWER_ITERATIONS` matrix-vector products for the scale $c$, then ``steps`` coupled
    Newton-Schulz steps (3 products each); no host read."""
    A = A.to(torch.float32)
    tiny = torch.finfo(A.dtype).tiny
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    v = torch.ones(*A.shape[:-1], 1, dtype=A.dtype, device=A.device)
    for _ in range(_POWER_ITERATIONS):
        v = A @ v
        v = v / v.norm(dim=-2, keepdim=True).clamp_min(tiny)
    rayleigh = (v * (A @ v)).sum(dim=(-2, -1))  # <= lambda_max
    bound = A.abs().sum(dim=-1).amax(dim=-1)  # >= lambda_max: c >= lambda_max / 2.5, so every t = lambda / c < 3
    c = torch.maximum(1.1 * rayleigh, 0.4 * bound).clamp_min(tiny)[..., None, None]
    Y, Z = A / c, eye.expand_as(A)
    for _ in range(steps):
        T = 1.5 * eye - 0.5 * (Z @ Y)
        Y, Z = Y @ T, T @ Z
    return (Z + Z.mT) / (2 * c.sqrt())


def _dot(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vecdot(X.flatten(-2), Y.flatten(-2))


def solve_normal_equation(
    mask: torch.Tensor,
    A: torch.Tensor,
    R: torch.Tensor,
    *,
    x0: torch.Tensor | None = None,
    rtol: float | None = None,
    max_iter: int = CG_MAX_ITER,
    factor: torch.Tensor | None = None,
) -> CGResult:
    r"""$S = P(S)$ symmetric with $P(AS + SA) = P(R)$ for symmetric positive definite ``A`` and symmetric ``R``
    (``(..., n, n)``, the same dtype), $P$ the entrywise product with the 0/1 ``mask`` (``(n, n)``, or batched; the
    `GramManifold.gram_mask`): preconditioned conjugate gradients from ``x0`` (default 0), per matrix until its
    relative residual is at most ``rtol`` (default `CG_RTOL` of the dtype), at most ``max_iter`` products.
    Preconditioner: Jacobi, or with ``factor`` $B$ (``(..., n, n)``, symmetric positive definite, any float dtype:
    `congruence_factor`) the congruence $z = \tfrac12 P(BrB)$, computed in $B$'s dtype (module docstring).
    One host read per iteration (whether every matrix is done)."""
    if A.dtype not in CG_RTOL:
        raise TypeError(f"the normal equation is solved in float32 or float64; got {A.dtype} (cast the point first)")
    rtol = CG_RTOL[A.dtype] if rtol is None else float(rtol)
    mask = mask.to(A)
    op = normal_operator(mask, A)
    if factor is None:
        inv = jacobi(mask, A)

        def precondition(r: torch.Tensor) -> torch.Tensor:
            return inv * r

    else:
        fmask = mask.to(factor.dtype)

        def precondition(r: torch.Tensor) -> torch.Tensor:
            M = factor @ r.to(factor.dtype) @ factor
            return (fmask * (M + M.mT)).to(r.dtype) * 0.25  # P(sym(B r B)) / 2: exactly symmetric

    b = mask * R
    bnorm = _dot(b, b).sqrt()
    x = torch.zeros_like(b) if x0 is None else mask * x0.to(b)
    r = b if x0 is None else b - op(x)
    done = _dot(r, r).sqrt() <= rtol * bnorm
    z = precondition(r)
    p, rz = z, _dot(r, z)
    iterations = 0
    while iterations < max_iter and not bool(done.all()):
        Ap = op(p)
        iterations += 1
        pAp = _dot(p, Ap)
        ok = ~done & (pAp > 0) & (rz > 0)
        alpha = torch.where(ok, rz / torch.where(ok, pAp, torch.ones_like(pAp)), torch.zeros_like(pAp))
        x = x + alpha[..., None, None] * p
        r = r - alpha[..., None, None] * Ap
        done = done | ~ok | (_dot(r, r).sqrt() <= rtol * bnorm)
        z = precondition(r)
        rz_new = _dot(r, z)
        beta = torch.where(ok, rz_new / torch.where(rz > 0, rz, torch.ones_like(rz)), torch.zeros_like(rz))
        p, rz = z + beta[..., None, None] * p, rz_new
    rel = _dot(r, r).sqrt() / torch.where(bnorm > 0, bnorm, torch.ones_like(bnorm))
    return CGResult(x, iterations, rel)


def scaled_residual(F: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    r"""$|F_{ij}| / \max(1, \sqrt{A_{ii} A_{jj}})$: a constraint residual $F$ relative to the Gram matrix $A$."""
    d = A.diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt()
    return F.abs() / torch.clamp(d[..., :, None] * d[..., None, :], min=1.0)


def cosine_residual(F: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    r"""$|F_{ij}| / \sqrt{A_{ii} A_{jj}}$ off the diagonal (the cosine between columns $i$ and $j$ where $F$ is $A$'s
    off-diagonal part) and $|F_{ii}| / \max(1, A_{ii})$ on it: a residual relative to the columns' own scale at
    every scale (`scaled_residual` is absolute below unit norms); entries of zero columns are taken as they are."""
    d = A.diagonal(dim1=-2, dim2=-1).clamp_min(0)
    den = d.sqrt()[..., :, None] * d.sqrt()[..., None, :]
    den = den - torch.diag_embed(den.diagonal(dim1=-2, dim2=-1)) + torch.diag_embed(d.clamp_min(1.0))
    return F.abs() / torch.where(den > 0, den, torch.ones_like(den))


def newton_rtol(residual: torch.Tensor, tol: float) -> float:
    r"""The CG tolerance of a Newton step at scaled residual ``residual`` (the batch's largest) toward ``tol``:
    $\eta = \max(\min(10^{-2}, \mathrm{res}),\ 0.1\,\mathrm{tol}/\mathrm{res})$. An inexact step leaves a
    residual $\eta\,\mathrm{res} + O(\mathrm{res}^2)$: the first term keeps the convergence quadratic without
    solving far steps exactly, the second asks no more than a tenth of ``tol`` of the last step (a residual at
    rounding level cannot be solved to a relative tolerance)."""
    res = float(residual)
    return min(0.5, max(min(1e-2, res), 0.1 * tol / max(res, 1e-300)))


def _newton_solve(
    mask: torch.Tensor, A: torch.Tensor, R: torch.Tensor, rtol: float, ill_conditioned: bool
) -> tuple[torch.Tensor, bool]:
    """One Newton step's solve (module docstring): ``(E, ill_conditioned)``, $E$ in ``A``'s dtype; Jacobi first
    unless ``ill_conditioned`` (an earlier step of the projection needed the congruence factor), and whether this
    solve needed it."""
    if rtol >= FLOAT32_SOLVE_RTOL and A.dtype != torch.float32:
        mask, A_s, R_s = mask.float(), A.float(), R.float()
    else:
        A_s, R_s = A, R
    x0, spent = None, 0
    if not ill_conditioned:
        jac = solve_normal_equation(mask, A_s, R_s, rtol=rtol, max_iter=JACOBI_ITERATIONS)
        if not bool((jac.residual > rtol).any()):
            return jac.solution.to(A.dtype), False
        x0, spent = jac.solution, jac.iterations
    out = solve_normal_equation(
        mask, A_s, R_s, x0=x0, rtol=rtol, max_iter=CG_MAX_ITER - spent, factor=congruence_factor(A)
    )
    return out.solution.to(A.dtype), True


def gram_newton_factor(
    mask: torch.Tensor, G0: torch.Tensor, tol: float, max_steps: int, halvings: int = 20
) -> tuple[torch.Tensor, int]:
    r"""``(C, steps)``: $C$ ``(..., n, n)`` with $P(C^\top G_0 C - I) \approx 0$ (scaled residual, `scaled_residual`,
    at most ``tol`` where Newton gets there within ``max_steps``), from $C = I$, for a Gram matrix ``G0`` of unit
    columns and the 0/1 ``mask`` of $P$ (module docstring; float64 advised: each step's solve runs in float32 where
    its tolerance allows, `FLOAT32_SOLVE_RTOL`, the rest in ``G0``'s dtype). Damped: a step $E$ is halved up to
    ``halvings`` times until $\|F\|_F$ decreases, and a matrix that no halving improves stops where it is. The
    caller checks the result."""
    eye = torch.eye(G0.shape[-1], dtype=G0.dtype, device=G0.device)
    mask = mask.to(G0)
    C, A = eye.expand_as(G0).clone(), G0
    F = mask * (A - eye)
    steps, ill_conditioned = 0, False
    while steps < max_steps:
        res = scaled_residual(F, A).amax(dim=(-2, -1))
        active = res > tol
        if not bool(active.any()):
            break
        steps += 1
        # once a step needed the congruence factor, the later ones build theirs (from their own A) at once
        E, ill_conditioned = _newton_solve(mask, A, -F, newton_rtol(res.max(), tol), ill_conditioned)
        before, alpha = F.norm(dim=(-2, -1)), torch.ones_like(res)
        for _ in range(halvings):
            step = eye + alpha[..., None, None] * E
            A_try = step.mT @ A @ step
            F_try = mask * (A_try - eye)
            better = F_try.norm(dim=(-2, -1)) < before  # False for NaN
            retry = active & ~better
            if not bool(retry.any()):
                break
            alpha = torch.where(retry, 0.5 * alpha, alpha)
        take = (active & better)[..., None, None]
        if not bool(take.any()):
            break
        if steps == 1:  # C = I: C @ step is step and C^T G0 C is A_try, bitwise (G0 = A); two products saved
            C, A = torch.where(take, step, C), torch.where(take, A_try, A)
        else:
            C = torch.where(take, C @ step, C)
            A = torch.where(take, C.mT @ G0 @ C, A)  # from C, not the update: no drift over the steps
        F = mask * (A - eye)
    return C, steps
