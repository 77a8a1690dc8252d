r"""The DGram manifold: mutually orthogonal columns with free norms.

$$\mathrm{DGram}(m, n) = \{ W : \operatorname{Off}(W^\top W) = 0 \}, \qquad P = \operatorname{Off}$$

($\operatorname{Off}$ zeroes the diagonal). Writing $W^\top W = \operatorname{diag}(d)$, the
singular values of $W$ are the column norms $\sqrt{d_i}$: orthogonal structure without a bound on
scale. It is a manifold where every $d_i > 0$ (full column rank); points with a zero column are
**refused** (``check_point`` fails, ``projx``/``retr`` raise ``ValueError``), because there the
tangent projection below divides by $d_i + d_j = 0$.

Tangent space $T_W = \{A : \operatorname{Off}(W^\top A + A^\top W) = 0\}$. Orthogonal projection
$U - W S$ with $S_{ii} = 0$ and
$$S_{ij} = \frac{(W^\top U + U^\top W)_{ij}}{d_i + d_j}, \quad i \ne j.$$

Retraction: $R(X) = Q \operatorname{diag}(\operatorname{diag}(Q^\top X))$, $Q = \operatorname{msign}(X)$.
Since $Q^\top X = (X^\top X)^{1/2}$ is positive definite, the new column norms are
$\operatorname{diag}((X^\top X)^{1/2}) > 0$. On DGram, $W = Q D$ and $R(W) = W$ exactly. The published SVD-based map
$(U V^\top) \operatorname{diag}(\sigma)$ hands the singular values to the columns in sorted
order: it moves every DGram point whose column norms are not already decreasing, and where two
norms cross it is only first order in one direction (it is not a retraction there).
"""

from __future__ import annotations

import math

import torch

from .base import SUPPORTED_DTYPES, GramManifold, MaskForm, from_tall, size_tuple, to_tall
from .matrix_sign import newton_schulz_where_near, polar

__all__ = ["DGram"]


def _off(M: torch.Tensor) -> torch.Tensor:
    return M - torch.diag_embed(M.diagonal(dim1=-2, dim2=-1))


class DGram(GramManifold):
    r"""$\operatorname{Off}(W^\top W) = 0$ with nonzero columns (rows for wide $W$)."""

    name = "DGram"
    mask_form = MaskForm.OFF_DIAGONAL

    def project_gram(self, M: torch.Tensor) -> torch.Tensor:
        return _off(M)

    def column_norms(self, x: torch.Tensor) -> torch.Tensor:
        """Norms of the constrained columns (rows of a wide ``x``): its singular values on DGram."""
        return to_tall(x).norm(dim=-2)

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""$U - W S$, $S_{ij} = (W^\top U + U^\top W)_{ij} / (d_i + d_j)$ off the diagonal."""
        T = to_tall(x)
        d = (T * T).sum(dim=-2)
        S = self.tangent_constraint(x, u) / (d[..., :, None] + d[..., None, :])
        return u - from_tall(T @ S, like=x)

    @property
    def polar_fallbacks(self) -> int:
        """How many matrices `projx` sent to the exact polar factor (far from DGram) instead of Newton-Schulz."""
        return getattr(self, "_polar_fallbacks", 0)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        r"""$Q \operatorname{diag}(\operatorname{diag}(Q^\top X))$ with $Q = \operatorname{msign}(X)$; with
        ``polar_method="auto"``, near DGram $Q$ is the polar factor of the column-normalised $X D^{-1}$ by products
        (`near_dgram_polar`), counted in `polar_fallbacks` where it is not."""
        self._validate(x)
        T = to_tall(x)
        Q = self.near_dgram_polar(T) if self.polar_method == "auto" else polar(T, self.polar_method)
        norms = (Q * T).sum(dim=-2, keepdim=True)
        tiny = torch.finfo(x.dtype).eps * T.shape[-1] * norms.abs().amax(dim=-1, keepdim=True)
        if bool((norms <= tiny).any()):
            raise ValueError(
                "DGram needs full column rank: the input has a (near-)zero column after projection; "
                "DGram points must have nonzero columns"
            )
        return from_tall(Q * norms, like=x)

    def near_dgram_polar(self, T: torch.Tensor) -> torch.Tensor:
        r"""For tall ``(..., m, n)``: $\operatorname{polar}(T D^{-1})$, $D$ the column norms, by Newton-Schulz
        (`newton_schulz_where_near`: matrix products only, its step count from one host read of the batch) for
        each matrix whose normalised Gram matrix has $\|D^{-1}T^\top T D^{-1} - I\|_F \le$ ``NEAR_ORTHOGONAL``
        (a retraction step from DGram: its off-diagonal entries are $O(\eta^2)$); every other matrix (or one
        with a zero column) gets $\operatorname{msign}(T)$ from `polar` (``"auto"``: the exact SVD on CPU) and
        adds one to `polar_fallbacks`. Both give $Q$ with $Q^\top T$ positive definite, and on DGram
        $Q\operatorname{diag}(\operatorname{diag}(Q^\top T)) = T$; they differ by $O(\eta^2)$ off it (both are
        first-order retractions)."""
        m, n = T.shape[-2:]
        T3 = T.reshape(-1, m, n)
        norms = T3.norm(dim=-2, keepdim=True)
        X0 = T3 / torch.where(norms == 0, torch.ones_like(norms), norms)
        P = X0.mT @ X0
        dev = (P - torch.eye(n, dtype=T3.dtype, device=T3.device)).norm(dim=(-2, -1))
        dev = torch.where((norms > 0).all(dim=-1).squeeze(-1), dev, math.inf).tolist()  # the one host read

        def far_polar(far: list[int]) -> torch.Tensor:  # counted in polar_fallbacks
            self._polar_fallbacks = self.polar_fallbacks + len(far)
            return polar(T3[far], "auto")

        return newton_schulz_where_near(X0, P, dev, far_polar).reshape(T.shape)

    def _check_point_on_manifold(self, x, *, atol=None, rtol=None):
        ok, reason = super()._check_point_on_manifold(x, atol=atol, rtol=rtol)
        if ok and x.dtype in SUPPORTED_DTYPES and x.numel() and bool((self.column_norms(x) == 0).any()):
            return False, "DGram point has a zero column (not a manifold point)"
        return ok, reason

    def random(self, *size, dtype=None, device=None, generator=None):
        """Polar factor of a Gaussian with log-normal column norms ``exp(N(0, 0.5^2))``."""
        size = size_tuple(size)
        Q = polar(torch.randn(*size, dtype=dtype, device=device, generator=generator), "svd")
        T = to_tall(Q)
        log_norms = torch.randn(*T.shape[:-2], 1, T.shape[-1], dtype=T.dtype, device=device, generator=generator)
        d = torch.exp(0.5 * log_norms)
        return from_tall(T * d, like=Q)
