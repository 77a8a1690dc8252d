r"""The Stiefel manifold: orthonormal columns.

$$\mathrm{St}(m, n) = \{ W \in \mathbb R^{m \times n} : W^\top W = I \}, \qquad P = \mathrm{id}.$$

All singular values equal 1 (spectral control). Tangent space
$T_W = \{A : W^\top A + A^\top W = 0\}$; orthogonal projection
$\operatorname{proju}(W, U) = U - W \operatorname{sym}(W^\top U)$; retraction by the polar factor
$R(X) = X (X^\top X)^{-1/2} = \operatorname{msign}(X)$, the nearest point of the manifold.
Wide matrices are constrained on their rows ($W W^\top = I$).
"""

from __future__ import annotations

import torch

from .base import GramManifold, MaskForm, from_tall, size_tuple, sym, to_tall
from .matrix_sign import polar, polar_near_orthogonal

__all__ = ["Stiefel"]


class Stiefel(GramManifold):
    r"""$W^\top W = I$ (rows for wide $W$)."""

    name = "Stiefel"
    mask_form = MaskForm.FULL

    def project_gram(self, M: torch.Tensor) -> torch.Tensor:
        return M

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""$U - W \operatorname{sym}(W^\top U)$."""
        T = to_tall(x)
        return u - from_tall(T @ sym(T.mT @ to_tall(u, like=x)), like=x)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        r"""Polar factor $X (X^\top X)^{-1/2}$ (``polar_method="auto"``: by Newton-Schulz where $X$ is
        nearly orthonormal, as after a retraction step, else the SVD; `polar_near_orthogonal`)."""
        self._validate(x)
        if self.polar_method == "auto":
            return polar_near_orthogonal(x)
        return polar(x, self.polar_method)

    def random(self, *size, dtype=None, device=None, generator=None):
        """Polar factor of a Gaussian matrix (Haar-distributed)."""
        size = size_tuple(size)
        return polar(torch.randn(*size, dtype=dtype, device=device, generator=generator), "svd")
