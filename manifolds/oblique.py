r"""The oblique manifold: unit-norm columns.

$$\mathrm{Ob}(m, n) = \{ W : \operatorname{diag}(W^\top W) = 1 \}, \qquad P = \operatorname{Diag}.$$

A product of spheres, one per column (row, for wide $W$); singular values are free. Tangent
space $T_W = \{A : \operatorname{diag}(W^\top A) = 0\}$; projection
$U - W \operatorname{Diag}(W^\top U)$ (column-wise sphere projection); retraction normalises each
column. A zero column cannot be normalised and is refused with ``ValueError``.
"""

from __future__ import annotations

import torch

from .base import GramManifold, MaskForm, from_tall, size_tuple, to_tall

__all__ = ["Oblique"]


class Oblique(GramManifold):
    r"""$\operatorname{diag}(W^\top W) = 1$ (rows for wide $W$)."""

    name = "Oblique"
    mask_form = MaskForm.DIAGONAL

    def project_gram(self, M: torch.Tensor) -> torch.Tensor:
        return torch.diag_embed(M.diagonal(dim1=-2, dim2=-1))

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""$U - W \operatorname{Diag}(W^\top U)$ (valid on the manifold, where $\|w_i\| = 1$)."""
        T, V = to_tall(x), to_tall(u, like=x)
        return from_tall(V - T * (T * V).sum(dim=-2, keepdim=True), like=x)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        r"""Normalise columns: $w_i / \|w_i\|$."""
        self._validate(x)
        T = to_tall(x)
        norms = T.norm(dim=-2, keepdim=True)
        if bool((norms == 0).any()):
            raise ValueError("Oblique cannot normalise a zero column; Oblique points have unit columns")
        return from_tall(T / norms, like=x)

    def random(self, *size, dtype=None, device=None, generator=None):
        """Gaussian matrix with normalised columns (uniform on each sphere)."""
        size = size_tuple(size)
        return self.projx(torch.randn(*size, dtype=dtype, device=device, generator=generator))
