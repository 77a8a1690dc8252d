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

**Preconditioner.** The diagonal of $\mathcal L_A$, $S_{ij} \mapsto (a_i + a_j) S_{ij}$ with $a = \operatorname{diag}
A$ (Jacobi): exact where $A$ is diagonal (DGram's and Oblique's points, Stiefel's), and for a block mask at a point
of its manifold ($A$ block diagonal) the condition number is that of the column-normalised blocks.

**Convergence test.** Per matrix of a batch, the recursively updated residual $r_k = R - \mathcal L_A(S_k)$ has
$\|r_k\|_F \le \mathrm{rtol}\,\|R\|_F$, with ``rtol`` `CG_RTOL` of the dtype the solve runs in (below). The
iteration also stops, with what it has, after ``max_iter`` products or where a step would divide by zero (a
singular $A$): `CGResult` reports the relative residual reached, and callers check what they need (the
projection onto the manifold checks the point it returns).

**Projection onto the manifold** (`gram_newton_factor`): Newton's method on $F(C) = P(C^\top G_0 C - I)$ with
updates $C \leftarrow C(I + E)$, $E = P(E)$ symmetric: at $A = C^\top G_0 C$ the linearisation is
$F + \mathcal L_A(E)$, so each step is one normal equation (inexact: CG to a tolerance that shrinks with the
residual, `newton_rtol`), and every quantity is $n \times n$; a step that does not reduce $\|F\|_F$ is halved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "CG_RTOL",
    "CG_MAX_ITER",
    "CGResult",
    "normal_operator",
    "jacobi",
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


def _dot(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    return (X * Y).sum(dim=(-2, -1))


def solve_normal_equation(
    mask: torch.Tensor,
    A: torch.Tensor,
    R: torch.Tensor,
    *,
    x0: torch.Tensor | None = None,
    rtol: float | None = None,
    max_iter: int = CG_MAX_ITER,
) -> CGResult:
    r"""$S = P(S)$ symmetric with $P(AS + SA) = P(R)$ for symmetric positive definite ``A`` and symmetric ``R``
    (``(..., n, n)``, the same dtype), $P$ the entrywise product with the 0/1 ``mask`` (``(n, n)``, or batched; the
    `GramManifold.gram_mask`): Jacobi-preconditioned conjugate gradients from ``x0`` (default 0), per matrix until
    its relative residual is at most ``rtol`` (default `CG_RTOL` of the dtype), at most ``max_iter`` products.
    One host read per iteration (whether every matrix is done)."""
    if A.dtype not in CG_RTOL:
        raise TypeError(f"the normal equation is solved in float32 or float64; got {A.dtype} (cast the point first)")
    rtol = CG_RTOL[A.dtype] if rtol is None else float(rtol)
    mask = mask.to(A)
    op, inv = normal_operator(mask, A), jacobi(mask, A)
    b = mask * R
    bnorm = _dot(b, b).sqrt()
    x = torch.zeros_like(b) if x0 is None else mask * x0.to(b)
    r = b if x0 is None else b - op(x)
    done = _dot(r, r).sqrt() <= rtol * bnorm
    z = inv * r
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
        z = inv * r
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


def gram_newton_factor(
    mask: torch.Tensor, G0: torch.Tensor, tol: float, max_steps: int, halvings: int = 20
) -> tuple[torch.Tensor, int]:
    r"""``(C, steps)``: $C$ ``(..., n, n)`` with $P(C^\top G_0 C - I) \approx 0$ (scaled residual, `scaled_residual`,
    at most ``tol`` where Newton gets there within ``max_steps``), from $C = I$, for a Gram matrix ``G0`` of unit
    columns and the 0/1 ``mask`` of $P$ (module docstring; float64 advised). Damped: a step $E$ is halved up to
    ``halvings`` times until $\|F\|_F$ decreases, and a matrix that no halving improves stops where it is. The
    caller checks the result."""
    eye = torch.eye(G0.shape[-1], dtype=G0.dtype, device=G0.device)
    mask = mask.to(G0)
    C, A = eye.expand_as(G0).clone(), G0
    F = mask * (A - eye)
    steps = 0
    while steps < max_steps:
        res = scaled_residual(F, A).amax(dim=(-2, -1))
        active = res > tol
        if not bool(active.any()):
            break
        steps += 1
        E = solve_normal_equation(mask, A, -F, rtol=newton_rtol(res.max(), tol)).solution
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
        C = torch.where(take, C @ step, C)
        A = torch.where(take, C.mT @ G0 @ C, A)  # from C, not the update: no drift over the steps
        F = mask * (A - eye)
    return C, steps
