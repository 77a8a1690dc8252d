r"""BoundedDGram: DGram with every constrained column norm kept at or below a bound.

$$\mathrm{BDGram}_b(m, n) = \{ W : \operatorname{Off}(W^\top W) = 0,\ \|w_i\| \le b \ \forall i \}$$

On DGram the singular values *are* the column norms, so the bound is a bound on the spectral
norm: $\sigma_{\max}(W) \le b$. It is the "scale control" the paper leaves open: DGram's
freedom to rescale columns, without letting attention logits grow without limit. With $b = 1$
the set is DGram intersected with the unit spectral-norm ball (it contains Stiefel).

By name: ``manifolds.get_manifold("bdgram@1.5")`` is ``BoundedDGram(1.5)`` (the registry's
``bdgram@B``; ``bdgram`` alone means ``B = 1``). It is written through the public extension
point, as a user would: a subclass of :class:`manifolds.DGram` that

- keeps DGram's tangent maps (``proju``, ``tangent_constraint``, its adjoint), so
  :class:`geomtrain.optim.ManifoldMuon` computes the same spectral direction as on DGram;
- overrides :meth:`BoundedDGram.projx` (and so ``retr``, which is ``projx(x + u)``): the DGram
  retraction, then every column longer than $b$ is scaled back to norm $b$. Scaling columns keeps
  them orthogonal, so the result is on DGram and inside the bound;
- counts a column norm above the bound as a constraint violation (on the diagonal of
  :meth:`BoundedDGram.constraint_violation`, which DGram's off-diagonal mask leaves free), so
  ``check_point_on_manifold`` and the trainer's ``manifold_distance`` diagnostic see it;
- draws :meth:`BoundedDGram.random` points strictly inside the bound.

**What the contract kit can check, and what it cannot.** The set is a manifold *with boundary*
(with corners). At an interior point (every norm $< b$) it is locally DGram: the tangent space,
the projection and the first-order retraction are DGram's, and every property of
:func:`manifolds.testing.check_manifold` holds; the kit draws its points with ``random``, which
stays in the interior, so that is what it verifies. At a boundary point (some $\|w_i\| = b$) the
feasible directions form a *cone*,
$\{A \in T_W\mathrm{DGram} : \langle w_i, a_i\rangle \le 0 \text{ for every } i \text{ at the bound}\}$:
``proju`` still returns the DGram tangent vector (a superset of the cone, which is what the
optimizer needs: the clip in ``projx`` then acts as a projection onto the feasible set), and the
retraction is first order only along the cone. Along an outward direction the clip moves the
point by $O(t)$, not $O(t^2)$; that is the boundary, not a bug, and the kit's
``retr_is_first_order`` would (rightly) fail there. :meth:`BoundedDGram.project_cone` gives the
Euclidean projection onto the cone for users who want a feasible direction; the tests check the
boundary behaviour separately (first order along the cone, clipped but on the set outside it).
"""

from __future__ import annotations

import torch

from .base import from_tall, to_tall
from .dgram import DGram

__all__ = ["BoundedDGram"]


class BoundedDGram(DGram):
    r"""DGram with column norms (= singular values) at most ``bound``.

    Args:
        bound: the largest allowed column norm (spectral norm), > 0.
        polar_method: passed to :class:`manifolds.DGram`.
    """

    name = "BoundedDGram"

    def __init__(self, bound: float = 1.0, polar_method: str = "auto"):
        try:
            value = float(bound)
        except (TypeError, ValueError):
            value = float("nan")
        if not 0 < value < float("inf"):  # also refuses NaN
            raise ValueError(f"bound must be a finite number > 0; got {bound!r}")
        bound = value
        super().__init__(polar_method=polar_method)
        self.bound = bound

    # ------------------------------------------------------------------ the overrides
    def clip(self, x: torch.Tensor) -> torch.Tensor:
        """Scale every constrained column longer than the bound back to norm ``bound`` (others untouched)."""
        T = to_tall(x)
        norms = T.norm(dim=-2, keepdim=True)
        factor = torch.clamp(self.bound / norms.clamp_min(torch.finfo(T.dtype).tiny), max=1.0)
        return from_tall(T * factor, like=x)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        r"""DGram retraction $Q \operatorname{diag}(\operatorname{diag}(Q^\top X))$, then :meth:`clip`."""
        return self.clip(super().projx(x))

    def constraint_violation(self, x: torch.Tensor) -> torch.Tensor:
        r"""DGram's scaled off-diagonal residual, plus $\max(0, \|w_i\| - b) / b$ on the diagonal."""
        viol = super().constraint_violation(x)
        excess = torch.clamp(self.column_norms(x) - self.bound, min=0.0) / self.bound
        return viol + torch.diag_embed(excess)

    def random(self, *size, dtype=None, device=None, generator=None):
        """A DGram random point scaled (as a whole) so its largest column norm is at most 0.9 * bound."""
        x = super().random(*size, dtype=dtype, device=device, generator=generator)
        top = self.column_norms(x).amax(dim=-1)[..., None, None]
        return x * torch.clamp(0.9 * self.bound / top, max=1.0)

    # ------------------------------------------------------------------ boundary helpers
    def at_bound(self, x: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
        """Boolean mask (..., n) of the constrained columns whose norm is at the bound (within ``rtol``)."""
        rtol = (1e-5 if x.dtype == torch.float32 else 1e-10) if rtol is None else rtol
        return self.column_norms(x) >= self.bound * (1 - rtol)

    def project_cone(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Euclidean projection of ``u`` onto the feasible cone at ``x``.

        First the DGram tangent projection, then for every column at the bound the outward radial
        part is removed: $a_i \leftarrow a_i - \max(0, \langle w_i, a_i\rangle)\, w_i / \|w_i\|^2$.
        The radial directions $w_i e_i^\top$ are tangent to DGram (columns are orthogonal) and
        mutually orthogonal, and each cone constraint involves one of them only, so clipping them
        one by one is the exact projection and the result stays tangent."""
        a = self.proju(x, u)
        mask = self.at_bound(x)
        if not bool(mask.any()):
            return a
        T, A = to_tall(x), to_tall(a, like=x)
        radial = (T * A).sum(dim=-2) / (T * T).sum(dim=-2)
        coef = torch.where(mask, radial.clamp_min(0.0), torch.zeros_like(radial))
        return from_tall(A - T * coef[..., None, :], like=x)

    def extra_repr(self) -> str:
        return f"bound={self.bound:g}, polar_method={self.polar_method!r}"
