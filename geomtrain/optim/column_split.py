r"""The split $W = UH_0$ of a tall point that `filled_split` builds its direction on: $U$ an orthonormal basis of the
span of $W$, $H_0 = U^\top W$. A direction $A = UK + B$ with $U^\top B = 0$ has $A^\top A = K^\top K + B^\top B$, and
the tangent constraint falls on $K$ alone: $L_W(UK) = P(H_0^\top K + K^\top H_0)$, the square problem at $H_0$.

- **Stiefel, DGram** (orthogonal columns): $U = WD^{-1}$, $H_0 = D = \operatorname{diag}(\|w_i\|)$, and the normal
  multiplier has a closed form (`manifolds.GramManifold.closed_normal_multiplier`).
- **Any other mask**: $U = X_0 F$, $X_0 = WD^{-1}$, $F \approx (X_0^\top X_0)^{-1/2}$ by products
  (`orthonormalising_factor`); the normal multiplier is conjugate gradients with $H_0^\top H_0$, so $UK$ is tangent
  whatever the rounding of $F$, and `filled_split` ends with a tangent projection (`tangent_fix`).
"""

from __future__ import annotations

import torch

from manifolds import GramManifold

from .numerics import normalise, sym
from .products import gram_msign_factor

__all__ = ["ColumnSplit", "FACTOR_STEPS", "POLISH_STEPS", "orthonormalising_factor"]

FACTOR_STEPS, POLISH_STEPS = 6, 2  # F ~ A0^(-1/2): Polar Express steps, then Newton-Schulz polish steps


def orthonormalising_factor(A0: torch.Tensor) -> torch.Tensor:
    r"""$F \approx A_0^{-1/2}$ for a Gram matrix $A_0 = X_0^\top X_0$, so $X_0 F$ has nearly orthonormal columns; each
    polish step is kept per matrix only where it reduces $\|FA_0F - I\|_F$."""
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
    r"""$W = UH_0$ for a tall ``(..., m, n)`` ``W``: ``U``, and ``d`` where $H_0 = \operatorname{diag}(d)$, else ``H0``
    and ``gram`` $= H_0^\top H_0$ (the others None)."""

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
        r"""The normal multiplier from $C = W^\top Y$ ``(..., n, n)``: $S = P(S)$ symmetric with $P(H_0^\top H_0 S +
        S H_0^\top H_0) = P(C + C^\top)$, so that $Y - WS$ is tangent."""
        if self.d is not None:
            return self.manifold.closed_normal_multiplier(self.d * self.d, C)
        return self.manifold.solve_normal(self.gram, C + C.mT)

    def square_tangent(self, X: torch.Tensor) -> torch.Tensor:
        r"""$X - H_0 S$, $S$ = `normal` of $H_0^\top X$: the tangent projection at the square point $H_0$."""
        return X - self.left(self.normal(self.left_t(X)))


def tangent_fix(manifold: GramManifold, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    r"""$A - WS$ with $P(W^\top W S + S W^\top W) = L_W(A)$: the tangent projection of a generic direction."""
    return A - W @ manifold.normal_multiplier(W, A)
