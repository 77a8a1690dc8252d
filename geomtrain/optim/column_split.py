r"""The split $W = UH_0$ of a tall point that `filled_split` builds its direction on, for every mask.

The split writes a direction as $A = UK + B$ with $U$ an orthonormal basis of the span of $W$ and $U^\top B = 0$:
then $A^\top A = K^\top K + B^\top B$, and the tangent constraint falls on $K$ alone,
$L_W(UK) = P(H_0^\top K + K^\top H_0)$ with $H_0 = U^\top W$: the square problem at the $n \times n$ point $H_0$,
whose Gram matrix is $H_0^\top H_0 = W^\top W$. Its tangent projection is $K = X - H_0 S$ with
$P(H_0^\top H_0 S + S H_0^\top H_0) = P(H_0^\top X + X^\top H_0)$ (`ColumnSplit.normal`).

- **Stiefel, DGram** (and subclasses keeping their mask): the columns are orthogonal, $U = WD^{-1}$ and
  $H_0 = D = \operatorname{diag}(\|w_i\|)$; the normal multiplier is the closed form
  $P(C + C^\top) \oslash (d_i^2 + d_j^2)$ (`manifolds.GramManifold.closed_normal_multiplier`).
- **Any other mask** (a user's ``project_gram``, where columns need not be orthogonal): $U = X_0 F$ with $X_0 = WD^{-1}$
  (unit columns: the Gram matrix $A_0 = X_0^\top X_0$ has a unit diagonal, better conditioned than $W^\top W$) and
  $F \approx A_0^{-1/2}$ by products (`orthonormalising_factor`), so $U \approx \operatorname{msign}(X_0)$, and
  $H_0 = U^\top W$ (one $mn^2$ product); the normal multiplier is conjugate gradients on the normal equation with
  $A = H_0^\top H_0$ (`manifolds.GramManifold.solve_normal`), which makes $UK$ tangent whatever the rounding of
  $F$. Where $U^\top U \ne I$ (an ill-conditioned $A_0$ that the factor does not resolve) the complement keeps a
  part in the span of $W$: `filled_split` ends a generic direction with a tangent projection (`tangent_fix`).
"""

from __future__ import annotations

import torch

from manifolds import GramManifold

from .numerics import normalise, sym
from .products import gram_msign_factor

__all__ = ["ColumnSplit", "FACTOR_STEPS", "POLISH_STEPS", "orthonormalising_factor"]

# F ~ A0^(-1/2): Polar Express steps from A0, then Newton-Schulz steps F <- F (3I - A0 F^2)/2. On block-mask points
# (384x128, blocks of 16; in-block condition numbers 2.4-2.7) 6 Polar Express steps leave ||F A0 F - I||_F at
# 2.5e-2 and two Newton-Schulz steps 2e-6, float32's floor (measured); a polish step that does not reduce the error
# of a matrix is not taken (float32 rounding of an ill-conditioned A0 would make it diverge)
FACTOR_STEPS, POLISH_STEPS = 6, 2


def orthonormalising_factor(A0: torch.Tensor) -> torch.Tensor:
    r"""$F \approx A_0^{-1/2}$ ``(..., n, n)`` for a Gram matrix $A_0 = X_0^\top X_0$ (float32 at least): $X_0 F$
    has nearly orthonormal columns. `FACTOR_STEPS` Polar Express steps in Gram space (`gram_msign_factor`), then up
    to `POLISH_STEPS` Newton-Schulz steps, each kept per matrix only where it reduces $\|FA_0F - I\|_F$. Products
    only, no host read."""
    eye = torch.eye(A0.shape[-1], dtype=A0.dtype, device=A0.device)
    F = gram_msign_factor(A0, "polar_express", FACTOR_STEPS)
    err = (F @ A0 @ F - eye).norm(dim=(-2, -1))
    for _ in range(POLISH_STEPS):
        F_new = sym(F @ (1.5 * eye - 0.5 * (A0 @ F @ F)))
        err_new = (F_new @ A0 @ F_new - eye).norm(dim=(-2, -1))
        better = err_new < err  # False for NaN
        F, err = torch.where(better[..., None, None], F_new, F), torch.where(better, err_new, err)
    return F


class ColumnSplit:
    r"""$W = UH_0$ for a tall ``(..., m, n)`` point ``W`` of ``manifold`` (module docstring).

    Attributes: ``U`` (the basis, ``W``'s shape), ``d`` (the column norms where $H_0 = \operatorname{diag}(d)$, else
    None), ``H0`` (``(..., n, n)`` where it is not diagonal, else None) and ``gram`` ($H_0^\top H_0$ there)."""

    def __init__(self, manifold: GramManifold, W: torch.Tensor):
        self.manifold = manifold
        d = W.norm(dim=-2)
        X0 = W / torch.where(d == 0, torch.ones_like(d), d)[..., None, :]
        if manifold.mask_form.orthogonal_columns:  # U = W D^-1
            self.U, self.d, self.H0, self.gram = X0, d, None, None
        else:
            self.U = X0 @ orthonormalising_factor(X0.mT @ X0)
            self.d, self.H0 = None, self.U.mT @ W
            self.gram = sym(self.H0.mT @ self.H0)

    @property
    def generic(self) -> bool:
        """Whether $H_0$ is a full matrix (a custom mask), not the diagonal of column norms."""
        return self.d is None

    def basis(self, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""``(Ĝ, U, H)``: $\hat G = G / \|G\|_F$, the basis and $H = U^\top \hat G$."""
        Gn, _ = normalise(G)
        return Gn, self.U, self.U.mT @ Gn

    def point(self) -> torch.Tensor:
        r"""The square problem's point $H_0$ ``(..., n, n)`` (``diag(d)`` on Stiefel and DGram)."""
        return torch.diag_embed(self.d) if self.d is not None else self.H0

    def left(self, X: torch.Tensor) -> torch.Tensor:
        r"""$H_0 X = U^\top W X$."""
        return self.d[..., :, None] * X if self.d is not None else self.H0 @ X

    def left_t(self, X: torch.Tensor) -> torch.Tensor:
        r"""$H_0^\top X = W^\top U X$: the $C = W^\top Y$ of $Y = UX$, for `normal`."""
        return self.d[..., :, None] * X if self.d is not None else self.H0.mT @ X

    def normal(self, C: torch.Tensor) -> torch.Tensor:
        r"""The normal multiplier from $C = W^\top Y$ ``(..., n, n)``: $S = P(S)$ symmetric with
        $P(H_0^\top H_0 S + S H_0^\top H_0) = P(C + C^\top)$, so that $Y - WS$ is tangent (closed form on Stiefel and
        DGram; conjugate gradients otherwise)."""
        if self.d is not None:
            return self.manifold.closed_normal_multiplier(self.d * self.d, C)
        return self.manifold.solve_normal(self.gram, C + C.mT)

    def square_tangent(self, X: torch.Tensor) -> torch.Tensor:
        r"""$X - H_0 S$, $S$ = `normal` of $H_0^\top X$: the tangent projection at the square point $H_0$."""
        return X - self.left(self.normal(self.left_t(X)))


def tangent_fix(manifold: GramManifold, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    r"""$A - WS$ with $P(W^\top W S + S W^\top W) = L_W(A)$: the tangent projection of a generic direction
    (`manifolds.GramManifold.normal_multiplier`; two $mn^2$ products and a solve), before its final bound."""
    return A - W @ manifold.normal_multiplier(W, A)
