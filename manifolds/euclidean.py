r"""The Euclidean "manifold": no constraint ($P = 0$).

$\mathcal M_0 = \mathbb R^{m \times n}$; the tangent space is everything, every projection is
the identity and the retraction is $R_W(U) = W + U$. Manifold Muon on it is plain Muon.
"""

from __future__ import annotations

import torch

from .base import GramManifold, MaskForm, size_tuple

__all__ = ["Euclidean"]


class Euclidean(GramManifold):
    """No constraint: identity maps, ``retr(x, u) = x + u``."""

    name = "Euclidean"
    mask_form = MaskForm.ZERO

    def project_gram(self, M: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(M)

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return u

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        self._validate(x)
        return x

    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        self._validate(u, "u")
        return self.projx(x + u)

    def random(self, *size, dtype=None, device=None, generator=None):
        """A standard Gaussian matrix."""
        size = size_tuple(size)
        return torch.randn(*size, dtype=dtype, device=device, generator=generator)
