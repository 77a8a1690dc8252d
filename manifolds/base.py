r"""Gram-space matrix manifolds on geoopt's ``Manifold`` interface.

A Gram-space manifold is fixed by a self-adjoint entrywise projector $P$ (a symmetric 0/1 mask)
acting on symmetric $n \times n$ matrices:

$$\mathcal M_P = \{ W \in \mathbb R^{m \times n} : P(W^\top W - I) = 0 \}.$$

**Orientation.** A ``torch.nn.Linear`` weight is ``(out, in)``. As in the paper's code, the
constraint acts on the *smaller* Gram matrix: on $W^\top W$ (columns) when $m \ge n$ and on
$W W^\top$ (rows) when $W$ is wide. Internally a wide matrix is transposed to its tall form $T$,
every formula below is applied to $T$, and results are transposed back. Leading (batch)
dimensions are allowed everywhere.

**Tangent space** at $W$ (tall form): $T_W = \{A : P(W^\top A + A^\top W) = 0\}$, the kernel of
the constraint map $L_W(A) = P(W^\top A + A^\top W)$, whose adjoint under the Frobenius inner
product is $L_W^*(\Lambda) = W P(\Lambda + \Lambda^\top)$.

**Orthogonal tangent projection**: $\operatorname{proju}(W, U) = U - W S$, with $S = P(S)$
symmetric solving $P(GS + SG) = L_W(U)$, $G = W^\top W$ (that is
$U - L_W^*(L_W L_W^*)^{-1} L_W U$).

**Retraction** (generic): $R(X) = X_0 C D_f$ where $X_0$ is $X$ with unit columns (so any input scale works),
$C$ solves $P(C^\top X_0^\top X_0 C - I) = 0$ by Newton's method from $C = I$ with updates $C \leftarrow C(I + E)$,
$E = P(E)$ symmetric (in float64, then checked in the input's dtype), and $D_f$ gives the columns whose norm $P$
leaves free their norms back. Points on the manifold are returned unchanged (and $R_W(0) = W$ bitwise); along a
tangent $X = W + tU$ the residual is $O(t^2)$, so $C - I = O(t^2)$ and the retraction is first order. Stiefel is
contained in every $\mathcal M_P$.

A subclass defines a manifold by implementing `project_gram` only. The generic maps are products only
(`manifolds.gram_solve`): every solve is conjugate gradients on the normal equation $P(AS + SA) = R$, whose
operator costs one $n \times n$ product, never a system in the $k$ masked entries; at $n = 128$ a projection,
tangent projection or retraction takes milliseconds (``geomtrain bench manifold``). Override
``proju``/``projx``/``retr`` with closed forms where they exist, as the built-in manifolds do.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections.abc import Iterator

import geoopt
import torch

from .gram_solve import cosine_residual, gram_newton_factor, scaled_residual, solve_normal_equation
from .matrix_sign import MSIGN_METHODS, polar

__all__ = ["GramManifold", "MaskForm", "to_tall", "from_tall", "size_tuple", "sym", "POLAR_METHODS", "SUPPORTED_DTYPES"]

# What `polar` accepts: "auto" (SVD on CPU, Polar Express elsewhere) or any msign method.
POLAR_METHODS = ("auto",) + MSIGN_METHODS

# Manifold operations run in these dtypes only: half precision cannot meet the tolerances below.
SUPPORTED_DTYPES = (torch.float32, torch.float64)
# Default tolerances of the on-manifold / on-tangent checks, per dtype. float32 rounding of a
# Gram product of O(1) entries is ~n * 6e-8; 1e-5 leaves room for n up to a few hundred.
_CHECK_ATOL = {torch.float32: 1e-5, torch.float64: 1e-10}
# A point whose constraint residual relative to its columns (cosine_residual) is below this is on the manifold: the
# generic projx returns it unchanged.
_NEWTON_TOL = {torch.float32: 2e-6, torch.float64: 1e-13}
# The generic projection's Newton (in float64) stops at this scaled residual, per dtype of the result: for float64
# the tolerance above; a float32 result is rounded at ~1e-7 relative when cast (a scaled residual of ~1e-8 at
# n = 128, measured), so solving beyond 1e-9 buys nothing and costs the last Newton step, the dearest one.
_NEWTON_TARGET = {torch.float32: 1e-9, torch.float64: 1e-13}


def is_wide(x: torch.Tensor) -> bool:
    """True when the last two dims are (m, n) with m < n: the constraint then acts on rows."""
    return x.shape[-2] < x.shape[-1]


def to_tall(x: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """Tall form: ``x`` transposed when ``like`` (default ``x``) is wide, else ``x`` itself."""
    return x.mT if is_wide(x if like is None else like) else x


def from_tall(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_tall` for the orientation of ``like``."""
    return t.mT if is_wide(like) else t


def size_tuple(size: tuple) -> tuple:
    """``random(3, 4)`` and ``random((3, 4))`` both mean shape ``(3, 4)``."""
    return tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)


def sym(M: torch.Tensor) -> torch.Tensor:
    r"""Symmetric part $\tfrac12 (M + M^\top)$ of a (batched) square matrix."""
    return 0.5 * (M + M.mT)


class MaskForm(enum.Enum):
    r"""The closed form of a mask $P$, declared by the manifold class that defines its `project_gram`
    (`GramManifold.mask_form`). Solvers specialise on it; a mask without one is ``CUSTOM``, whose every map is
    by products (`manifolds.gram_solve`)."""

    ZERO = "Euclidean"  # P = 0: no constraint
    FULL = "Stiefel"  # P = id: W^T W = I
    OFF_DIAGONAL = "DGram"  # P = Off: orthogonal columns, free norms
    DIAGONAL = "Oblique"  # P = Diag: unit columns, free angles
    CUSTOM = "custom-mask"  # a user's project_gram

    @property
    def label(self) -> str:
        """How messages name the matrices of this mask: the built-in manifold that has it, or ``custom-mask``."""
        return self.value

    @property
    def orthogonal_columns(self) -> bool:
        r"""Whether every point has orthogonal columns ($W^\top W$ diagonal), so that $W = U\operatorname{diag}(d)$
        with $U = WD^{-1}$ orthonormal: Stiefel and DGram."""
        return self in (MaskForm.FULL, MaskForm.OFF_DIAGONAL)

    def constraint_count(self, n: int) -> int | None:
        """The number of constrained Gram entries at size ``n`` (the mask's sum), None for ``CUSTOM``."""
        return {MaskForm.ZERO: 0, MaskForm.FULL: n * n, MaskForm.OFF_DIAGONAL: n * n - n, MaskForm.DIAGONAL: n}.get(
            self
        )


class GramManifold(geoopt.Manifold, metaclass=abc.ABCMeta):
    r"""Base class of $\{W : P(W^\top W - I) = 0\}$; subclasses implement `project_gram`.

    Args:
        polar_method: how retractions compute polar factors: ``"auto"`` (exact SVD on CPU,
            12 float32 Polar Express steps on accelerators), ``"svd"`` or ``"polar_express"``.
        max_newton_steps: iteration cap of the generic Newton retraction.
    """

    name = "Gram"
    ndim = 2
    reversible = False
    #: The closed form of this class's mask (`MaskForm`): each built-in declares its own. A subclass that defines
    #: `project_gram` again gets ``CUSTOM`` unless it declares one too (`__init_subclass__`), so it never inherits
    #: closed forms that belong to its parent's mask.
    mask_form: MaskForm = MaskForm.CUSTOM

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "project_gram" in vars(cls) and "mask_form" not in vars(cls):
            cls.mask_form = MaskForm.CUSTOM

    @property
    def unconstrained(self) -> bool:
        """No constraint ($P = 0$, Euclidean): Manifold Muon's direction is the msign of the gradient (Muon)."""
        return self.mask_form is MaskForm.ZERO

    def __init__(self, polar_method: str = "auto", max_newton_steps: int = 30):
        if polar_method not in POLAR_METHODS:
            raise ValueError(f"unknown polar_method {polar_method!r}; valid: {', '.join(POLAR_METHODS)}")
        if isinstance(max_newton_steps, bool) or not isinstance(max_newton_steps, int) or max_newton_steps < 1:
            raise ValueError(f"max_newton_steps must be an integer >= 1; got {max_newton_steps!r}")
        super().__init__()
        self.polar_method = polar_method
        self.max_newton_steps = max_newton_steps

    def key(self) -> tuple:
        """Hashable identity of the geometry: the class and every public scalar setting.

        Two manifolds with equal keys act identically (optimizers batch their matrices together);
        ``BoundedDGram(1.0)`` and ``BoundedDGram(2.0)`` differ by ``bound``. A subclass whose
        behaviour depends on non-scalar state overrides this. (``__eq__`` stays identity, as for
        every ``nn.Module``.)
        """
        scalars = (bool, int, float, str, type(None))
        settings = tuple(
            sorted(
                (k, v)
                for k, v in vars(self).items()
                if not k.startswith("_") and k != "training" and isinstance(v, scalars)
            )
        )
        return (type(self), settings)

    # ------------------------------------------------------------------ the extension point
    @abc.abstractmethod
    def project_gram(self, M: torch.Tensor) -> torch.Tensor:
        r"""Apply the entrywise projector $P$ to a (batched) symmetric $n \times n$ tensor."""

    # ------------------------------------------------------------------ Gram-space maps
    def gram(self, W: torch.Tensor) -> torch.Tensor:
        r"""The constrained Gram matrix $T^\top T$ of the tall form $T$ of ``W``: ``(..., n, n)``."""
        T = to_tall(W)
        return T.mT @ T

    def gram_mask(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """The 0/1 mask of $P$ for size ``n``: ``project_gram`` of the all-ones matrix."""
        return self.project_gram(torch.ones(n, n, dtype=like.dtype, device=like.device))

    def check_mask(self, n: int) -> None:
        r"""Raise ``ValueError`` unless ``project_gram`` at size ``n`` is what every solve here assumes: an
        entrywise projection $P(X) = B \odot X$ by a symmetric 0/1 mask $B$ (checked on one random
        symmetric $X$, in float64 on the CPU). A projection that mixes entries (onto matrices with zero
        row sums, say) is not one: the residuals and steps would be meaningless."""
        mask = self.gram_mask(n, torch.empty(0, dtype=torch.float64))
        X = torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        X = X + X.mT
        problem = None
        if mask.shape != (n, n) or not torch.isfinite(mask).all():
            problem = (
                f"its mask, project_gram of the all-ones matrix, has shape {tuple(mask.shape)} or non-finite entries"
            )
        elif not ((mask == 0) | (mask == 1)).all():
            problem = "its mask, project_gram of the all-ones matrix, has entries other than 0 and 1"
        elif not torch.equal(mask, mask.mT):
            problem = "its mask is not symmetric"
        elif not torch.allclose(self.project_gram(X), mask * X, rtol=0, atol=1e-12 * float(X.abs().max())):
            problem = "it is not the mask times its input: it mixes entries"
        if problem is not None:
            raise ValueError(
                f"{type(self).__name__}.project_gram is not an entrywise 0/1 mask at n = {n}: {problem} "
                "(a GramManifold's P must be one; see manifolds/base.py)"
            )

    def constraint_residual(self, W: torch.Tensor) -> torch.Tensor:
        r"""$P(W^\top W - I)$ in tall form: zero exactly on the manifold."""
        G = self.gram(W)
        eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
        return self.project_gram(G - eye)

    def tangent_constraint(self, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        r"""Constraint map $L_W(A) = P(W^\top A + A^\top W)$ (tall form), ``(..., n, n)``."""
        M = to_tall(W).mT @ to_tall(A, like=W)
        return self.project_gram(M + M.mT)

    def tangent_constraint_adjoint(self, W: torch.Tensor, Lam: torch.Tensor) -> torch.Tensor:
        r"""Adjoint map $L_W^*(\Lambda) = W P(\Lambda + \Lambda^\top)$, shaped like ``W``."""
        return from_tall(to_tall(W) @ self.project_gram(Lam + Lam.mT), like=W)

    # ------------------------------------------------------------------ generic solves
    def solve_normal(self, A: torch.Tensor, R: torch.Tensor, *, x0: torch.Tensor | None = None) -> torch.Tensor:
        r"""$S = P(S)$ symmetric with $P(AS + SA) = P(R)$ for a symmetric positive definite Gram matrix ``A`` and a
        symmetric ``R`` (``(..., n, n)``): the one solve every generic map needs. Generic: conjugate gradients in
        the dtype of ``A`` (`manifolds.gram_solve.solve_normal_equation`: $n \times n$ products only, to
        `manifolds.gram_solve.CG_RTOL` of the dtype), from ``x0`` where given (a warm start). A subclass with a
        closed form overrides it, and the generic maps and the direction solvers use it."""
        return solve_normal_equation(self.gram_mask(A.shape[-1], A), A, R, x0=x0).solution

    def normal_multiplier(self, W: torch.Tensor, U: torch.Tensor, *, x0: torch.Tensor | None = None) -> torch.Tensor:
        r"""$S = P(S)$ symmetric with $P(AS + SA) = L_W(U)$, $A = W^\top W$ (tall forms, ``(..., n, n)``): $U - WS$ is
        the tangent projection of ``U``. A built-in mask at a point of its manifold: `closed_normal_multiplier`
        (two products, no solve); a custom mask: `solve_normal`, from ``x0`` where given."""
        T, V = to_tall(W), to_tall(U, like=W)
        if self.mask_form is not MaskForm.CUSTOM:
            return self.closed_normal_multiplier((T * T).sum(dim=-2), T.mT @ V)
        M = T.mT @ V
        return self.solve_normal(T.mT @ T, M + M.mT, x0=x0)

    def closed_normal_multiplier(self, d: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        r"""$S = P(C + C^\top) \oslash (d_i + d_j)$ from $C = W^\top U$ ``(..., n, n)`` and the squared column
        norms ``d`` ``(..., n)``: the normal multiplier of a built-in mask at a point of its manifold, where the
        masked part of $W^\top W$ is diagonal, so $P(W^\top W S + S W^\top W)_{ij} = (d_i + d_j) S_{ij}$ (Stiefel,
        DGram; on Oblique $S$ is diagonal; Euclidean's is 0). Not valid for a custom mask (see `normal_multiplier`)."""
        return self.project_gram(C + C.mT) / (d[..., :, None] + d[..., None, :])

    def constraint_count(self, n: int, like: torch.Tensor) -> float:
        r"""The number of constrained Gram entries at size ``n``: `MaskForm.constraint_count` (host arithmetic) for
        a built-in mask, a host read of the mask's sum for a custom one."""
        closed = self.mask_form.constraint_count(n)
        return float(closed) if closed is not None else float(self.gram_mask(n, like).sum())

    def _newton_projection(self, X: torch.Tensor) -> torch.Tensor:
        r"""Generic projection $X_0 C D_f$ of ``X``, computed in float64 whatever its dtype (tall form).

        The columns are normalised first, $X_0 = X D^{-1}$ with $D = \operatorname{diag}(\|x_i\|)$: a
        column scaled by $c$ keeps its angles (so every masked off-diagonal entry stays zero or not) and
        changes its norm, which only the masked diagonal entries fix, to 1. From $X_0$ (unit columns, any
        input scale) Newton finds $C$ with $P(C^\top G_0 C - I) = 0$, $G_0 = X_0^\top X_0$, by products only
        (`manifolds.gram_solve.gram_newton_factor`: $C \leftarrow C(I + E)$, each $E$ a conjugate-gradient solve
        of the normal equation). Last, the columns of $Y = X_0 C$ whose norm $P$ leaves free are scaled back to
        the norms of ``X`` ($D_f$), which keeps the point on $\mathcal M_P$.
        Raises ``ValueError`` (one line: the manifold, the dtype, the residual reached) where the
        result, cast back to the dtype of ``X``, is not on the manifold.
        """
        name, dtype = type(self).__name__, X.dtype
        T = to_tall(X).to(torch.float64)
        mask = self.gram_mask(T.shape[-1], T)
        fixed_norm = mask.diagonal() > 0
        norms = T.norm(dim=-2, keepdim=True)
        if bool(((norms == 0) & fixed_norm).any()):
            raise ValueError(f"{name}.projx cannot normalise a zero column whose norm P fixes to 1 ({dtype} input)")
        X0 = T / torch.where(norms == 0, 1.0, norms)
        C, steps = gram_newton_factor(mask, X0.mT @ X0, _NEWTON_TARGET[dtype], self.max_newton_steps)
        Y = X0 @ C
        restore = norms / Y.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(Y.dtype).tiny)
        out = from_tall((Y * torch.where(fixed_norm, 1.0, restore)).to(dtype), like=X)
        atol = _CHECK_ATOL[dtype]
        ok, _ = self.check_point_on_manifold(out, explain=True, atol=atol)
        if not ok:
            reached = float(self.constraint_violation(out).max()) if torch.isfinite(out).all() else float("nan")
            raise ValueError(
                f"{name}.projx could not reach the manifold from this {dtype} input: the scaled residual "
                f"P(W^T W - I) is {reached:.3g} after {steps} Newton steps (in float64), above atol={atol:g}; "
                "a rank-deficient input has no nearby point (override projx with a closed form for such inputs)"
            )
        return out

    # ------------------------------------------------------------------ validation
    def _validate(self, x: torch.Tensor, name: str = "x") -> None:
        if x.dim() < 2:
            raise ValueError(f"{type(self).__name__} needs (..., m, n) matrices; got {name} of shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{type(self).__name__} operations need float32 or float64; got {name} of dtype {x.dtype} "
                "(keep parameters in float32 and autocast the forward pass, or call .float())"
            )
        if not getattr(self, "_inputs_checked", False) and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{type(self).__name__}: {name} has non-finite entries (NaN or Inf)")

    @contextlib.contextmanager
    def inputs_checked(self) -> Iterator[GramManifold]:
        """Inside it, `projx` and `retr` skip their finite checks (a host read each; shape and dtype are still
        checked): for a caller that has read its inputs finite itself, as ManifoldMuon's guards do for every
        direction, and whose weights are finite (it writes none that is not)."""
        previous = getattr(self, "_inputs_checked", False)
        self._inputs_checked = True
        try:
            yield self
        finally:
            self._inputs_checked = previous

    # ------------------------------------------------------------------ geoopt interface
    def inner(self, x, u, v=None, *, keepdim=False):
        r"""Euclidean (Frobenius) metric $\langle u, v \rangle = \operatorname{tr}(u^\top v)$."""
        v = u if v is None else v
        return (u * v).sum(dim=(-2, -1), keepdim=keepdim)

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Orthogonal projection onto $T_x$: $u - x S$, $S$ = `normal_multiplier` (generic: conjugate gradients)."""
        return u - from_tall(to_tall(x) @ self.normal_multiplier(x, u), like=x)

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Riemannian gradient of the embedded metric: the tangent projection of ``u``."""
        return self.proju(x, u)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        r"""A point of $\mathcal M_P$ near ``x``, from any nonzero scale (generic: normalised columns, then
        Newton for $x_0 C$; see `_newton_projection`). A point already on $\mathcal M_P$ is returned unchanged:
        its residual relative to its columns' scale (`manifolds.gram_solve.cosine_residual`: the cosines of the
        masked pairs, at any column norm) below `_NEWTON_TOL` of its dtype."""
        self._validate(x)
        self.check_mask(min(x.shape[-2:]))
        if x.numel() == 0:
            return x.clone()
        G = self.gram(x)
        eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
        if float(cosine_residual(self.project_gram(G - eye), G).max()) <= _NEWTON_TOL[x.dtype]:
            return x.clone()
        return self._newton_projection(x)

    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Retraction $R_x(u) = \operatorname{projx}(x + u)$: first order, and $R_x(0) = x$ bitwise (per
        matrix of a batch: where ``u`` is all zero, ``x`` is returned as it is, whatever ``projx`` would
        round)."""
        self._validate(u, "u")
        moved = self.projx(x + u)
        still = (u == 0).flatten(-2).all(dim=-1)[..., None, None]
        return torch.where(still, x, moved)

    def expmap(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Equal to `retr` (a first-order approximation of the exponential map)."""
        return self.retr(x, u)

    def transp(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vector transport by projection: ``proju(y, v)``."""
        return self.proju(y, v)

    def random(self, *size, dtype=None, device=None, generator: torch.Generator | None = None):
        r"""A random point: the polar factor of a Gaussian, columns rescaled, then retracted.

        Generic points of $\mathcal M_P$ come from $\operatorname{projx}(Q D)$ ($Q$ polar of a
        Gaussian, $D$ diagonal with log-normal entries) moved along a random tangent direction.
        """
        size = size_tuple(size)
        dtype = dtype or torch.get_default_dtype()
        Q = polar(torch.randn(*size, dtype=dtype, device=device, generator=generator), "svd")
        k = min(size[-2], size[-1])
        d = torch.exp(0.3 * torch.randn(*size[:-2], 1, k, dtype=dtype, device=device, generator=generator))
        x = self.projx(from_tall(to_tall(Q) * d, like=Q))
        u = self.proju(x, 0.2 * torch.randn(*size, dtype=dtype, device=device, generator=generator))
        return self.retr(x, u)

    def origin(self, *size, dtype=None, device=None, seed=42):
        """A deterministic point: the rectangular identity (on every Gram-space manifold)."""
        size = size_tuple(size)
        eye = torch.eye(size[-2], size[-1], dtype=dtype or torch.get_default_dtype(), device=device)
        return eye.expand(*size).clone()

    # ------------------------------------------------------------------ checks
    def constraint_violation(self, x: torch.Tensor) -> torch.Tensor:
        r"""Entrywise $|P(G - I)_{ij}| / \max(1, \sqrt{G_{ii} G_{jj}})$: a scale-aware distance from
        the manifold (0 on it; for DGram, the cosines between constrained columns)."""
        return scaled_residual(self.constraint_residual(x), self.gram(x))

    def _check_point_on_manifold(self, x, *, atol=None, rtol=None):
        if x.dim() < 2:
            return False, f"expected (..., m, n) matrices, got shape {tuple(x.shape)}"
        if not bool(torch.isfinite(x).all()):
            return False, "point has non-finite entries"
        atol = _CHECK_ATOL.get(x.dtype, 1e-5) if atol is None else atol
        err = float(self.constraint_violation(x.detach()).max()) if x.numel() else 0.0
        if err > atol:
            return False, f"`P(W^T W - I)` is {err:.3g} (scaled), above atol={atol:g}"
        return True, None

    def _check_vector_on_tangent(self, x, u, *, atol=None, rtol=None):
        atol = _CHECK_ATOL.get(x.dtype, 1e-5) if atol is None else atol
        scale = float(x.norm(dim=(-2, -1)).max() * u.norm(dim=(-2, -1)).max()) if u.numel() else 0.0
        err = float(self.tangent_constraint(x, u).abs().max()) if u.numel() else 0.0
        if err > atol * max(1.0, scale):
            return False, f"`P(W^T U + U^T W)` is {err:.3g}, above atol={atol:g} (x scale {scale:.3g})"
        return True, None

    def extra_repr(self) -> str:
        return f"polar_method={self.polar_method!r}"
