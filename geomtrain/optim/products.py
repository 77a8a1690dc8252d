r"""Products-only kernels shared by the solvers ``projected_tangent``, ``dual_ascent`` and ``admm``.

Nothing here decomposes a matrix: every step is a matrix product, an entrywise operation or a norm, so it
runs in bf16/fp32 on an accelerator at the speed of its products. For the built-in masks (Stiefel,
DGram, Oblique) at a point $W$ of the manifold (tall form) with column norms squared $d_i$:

- **Normal multiplier.** $S = P(W^\top U + U^\top W) \oslash (d_i + d_j)$ is the symmetric $S = P(S)$
  with $U - WS$ tangent (`normal_multiplier`): $W^\top W = \operatorname{diag}(d)$ on Stiefel and DGram
  ($P(W^\top W S + S W^\top W)_{ij} = (d_i + d_j) S_{ij}$), and $S$ is diagonal on Oblique. So
  $P_T(U) = U - WS$ (`tangent_part`) costs two $mn^2$ products.
- **Spectral-norm upper bound** (`op_norm_upper_bound`): $k$ squarings of the normalised Gram matrix
  $N_0 = X^\top X / \|X^\top X\|_F$ give $\sigma_{\max}(X)^2 \le \|X^\top X\|_F \prod_{j=1}^k f_j^{2^{-j}}$,
  $f_j = \|N_{j-1}^2\|_F$ (the Schatten-$2^{k+2}$ norm of $X$): a guaranteed bound, loose by at most
  $n^{1/2^{k+2}}$ (all singular values equal; $k = 7$: 1.3% at $n = 768$), tight where the top singular
  value stands apart. A power iteration gives a lower bound only, so it cannot make a direction safe.
- **Feasibility fix** (`feasible_direction`): $A = P_T(X) / \bar\sigma$ with $\bar\sigma$ that
  bound times a rounding margin: tangent to rounding, $\|A\|_{\mathrm{op}} \le 1$ whatever $X$ was.
"""

from __future__ import annotations

import torch

from manifolds import GramManifold

from .gram import mask_kind, tangent_residual
from .numerics import Trace, first_objective

__all__ = [
    "PRODUCT_KINDS",
    "BOUND_SQUARINGS",
    "NEAR_UNIT_SQUARINGS",
    "check_products_kind",
    "normal_multiplier",
    "tangent_part",
    "op_norm_upper_bound",
    "feasible_direction",
    "scale_to_ball",
    "near_unit_bound",
    "log_eigenvalue_bound",
    "BOUNDS",
    "rounding_margin",
    "mean_singular_value",
]

# The masks whose normal multiplier has the closed form above (Euclidean has no constraint at all).
PRODUCT_KINDS = ("stiefel", "dgram", "oblique", "euclidean")
# Squarings of the n x n Gram matrix in the spectral-norm bound: 7 (n^3 each, ~0.5 msign at a square shape)
# leave it within n^(1/512) of sigma_max: <= 1.3% at n = 768 when every singular value is the largest.
BOUND_SQUARINGS = 7
# The near-unit bound squares (P - I/2)^2, whose Schatten bound is loose by r^(1/2^k) of 1/4: one squaring more
# than BOUND_SQUARINGS keeps that about 0.1% on the result (`near_unit_bound`).
NEAR_UNIT_SQUARINGS = BOUND_SQUARINGS + 1


def check_products_kind(manifold: GramManifold, solver: str) -> str:
    """The mask kind of ``manifold``; a one-line ``ValueError`` for a custom mask (no products-only multiplier)."""
    kind = mask_kind(manifold)
    if kind not in PRODUCT_KINDS:
        raise ValueError(
            f"solver {solver!r} needs a built-in mask (Stiefel, DGram, Oblique, Euclidean or subclasses keeping "
            f"their project_gram); {type(manifold).__name__} has a custom one: use solver 'exact'"
        )
    return kind


def normal_multiplier(manifold: GramManifold, W: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    r"""$S = P(W^\top U + U^\top W) \oslash (d_i + d_j)$, $d = \operatorname{diag}(W^\top W)$, for tall ``(..., m, n)``:
    the symmetric $S = P(S)$ with $U - WS$ tangent at $W$ (built-in masks; two products, no solve)."""
    d = (W * W).sum(dim=-2)
    C = W.mT @ U
    return manifold.project_gram(C + C.mT) / (d[..., :, None] + d[..., None, :])


def tangent_part(manifold: GramManifold, W: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    r"""$P_T(U) = U - W S$ with $S$ = `normal_multiplier` (the orthogonal tangent projection, products only)."""
    return U - W @ normal_multiplier(manifold, W, U)


def op_norm_upper_bound(X: torch.Tensor, squarings: int = BOUND_SQUARINGS) -> torch.Tensor:
    r"""An upper bound on $\|X\|_{\mathrm{op}}$ per matrix of a tall ``(..., m, n)`` (0 for $X = 0$), by
    ``squarings`` normalised squarings of $X^\top X$ (see the module docstring); batch-shaped, ``X``'s dtype."""
    return _schatten_bound(X.mT @ X, squarings)


def _schatten_bound(P: torch.Tensor, squarings: int) -> torch.Tensor:
    """`op_norm_upper_bound` from the Gram matrix $P = X^\top X$."""
    log_bound, zero = log_eigenvalue_bound(P, squarings)
    return torch.where(zero, torch.zeros_like(log_bound), (0.5 * log_bound).exp())


def log_eigenvalue_bound(M: torch.Tensor, squarings: int = BOUND_SQUARINGS) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(log b, zero)``: $b \ge \lambda_{\max}(M)$ for symmetric positive semi-definite ``(..., n, n)`` $M$, from
    ``squarings`` normalised squarings (its Schatten-$2^k$ norm), and the mask of $M = 0$ (where log b is 0)."""
    c = M.norm(dim=(-2, -1))
    zero = c == 0
    N = M / torch.where(zero, torch.ones_like(c), c)[..., None, None]
    log_bound = torch.where(zero, torch.zeros_like(c), c).log()
    for j in range(1, squarings + 1):
        N = N @ N
        f = N.norm(dim=(-2, -1))
        f = torch.where(zero, torch.ones_like(f), f)
        N = N / f[..., None, None]
        log_bound = log_bound + f.log() / 2**j
    return log_bound, zero


def near_unit_bound(X: torch.Tensor, squarings: int = NEAR_UNIT_SQUARINGS) -> torch.Tensor:
    r"""An upper bound on $\|X\|_{\mathrm{op}}$ per matrix of a tall ``(..., m, n)``, tight where the singular values
    are 0 or near 1 (an msign's output, of a matrix of any rank): each eigenvalue $\lambda$ of $P = X^\top X$ has
    $\lambda(\lambda - 1) \le \beta = \bar\lambda_{\max}(E) - \tfrac14$, $E = P^2 - P + \tfrac14 I = (P - \tfrac12 I)^2$
    (positive semi-definite; `log_eigenvalue_bound`), so $\|X\|_{\mathrm{op}}^2 \le (1 + \sqrt{1 + 4\beta})/2$. Where
    every $\lambda$ is 0 or 1 the Schatten bound on $E$ is loose by $r^{1/2^k}$ of $\tfrac14$: about 0.1% on the
    result at $k = 8$ (one squaring more than `op_norm_upper_bound`, whose bound on $X$ is loose by up to
    $r^{1/2^{k+2}}$ there: 1% at $r = 128$). Loose where the
    spectrum is spread (all singular values 1/2 give 1): there use `op_norm_upper_bound`."""
    return _near_unit_bound(X.mT @ X, squarings)


def _near_unit_bound(P: torch.Tensor, squarings: int) -> torch.Tensor:
    """`near_unit_bound` from the Gram matrix $P = X^\top X$."""
    E = P - 0.5 * torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
    log_e, zero = log_eigenvalue_bound(E @ E, squarings)
    beta = (torch.where(zero, torch.zeros_like(log_e), log_e.exp()) - 0.25).clamp_min(-0.25)
    return ((1 + (1 + 4 * beta).sqrt()) / 2).sqrt()


def rounding_margin(X: torch.Tensor, squarings: int = BOUND_SQUARINGS) -> float:
    r"""$1 + (m + k n)\,\epsilon$: the first-order worst-case rounding of the bound's products (a length-$m$ dot
    product, then $k$ length-$n$ ones), relative; at 3072x768 in float32 $1 + 5 \cdot 10^{-4}$."""
    m, n = X.shape[-2:]
    return 1.0 + (m + squarings * n) * torch.finfo(X.dtype).eps


def feasible_direction(
    manifold: GramManifold, W: torch.Tensor, X: torch.Tensor, bound: str = "schatten"
) -> torch.Tensor:
    r"""$A = P_T(X) / \bar\sigma$ with $\bar\sigma \ge \|P_T(X)\|_{\mathrm{op}}$ (`scale_to_ball` with ``bound``):
    tangent, $\|A\|_{\mathrm{op}} \le 1$ and within the bound's slack of 1; $X = 0$ gives $A = 0$ exactly."""
    return scale_to_ball(tangent_part(manifold, W, X.to(W.dtype)), bound)


BOUNDS = ("schatten", "near_unit", "both")


def scale_to_ball(X: torch.Tensor, bound: str = "schatten") -> torch.Tensor:
    r"""$X / \bar\sigma$ with $\bar\sigma \ge \|X\|_{\mathrm{op}}$ times `rounding_margin`: on or just inside the unit
    spectral ball; $X = 0$ stays 0. ``bound``: ``"schatten"`` (`op_norm_upper_bound`: any spectrum, loose by up
    to 1% where many singular values are the largest), ``"near_unit"`` (`near_unit_bound`: an msign's output, to
    0.1%), ``"both"`` (the smaller of the two: for a spectrum of either kind)."""
    if bound not in BOUNDS:
        raise ValueError(f"bound {bound!r}; valid: {', '.join(BOUNDS)}")
    P = X.mT @ X  # one Gram product for either bound, or both
    if bound == "near_unit":
        sigma = _near_unit_bound(P, NEAR_UNIT_SQUARINGS)
    else:
        sigma = _schatten_bound(P, BOUND_SQUARINGS)
        if bound == "both":
            sigma = torch.minimum(sigma, _near_unit_bound(P, NEAR_UNIT_SQUARINGS))
    sigma = sigma * rounding_margin(X)
    return X / torch.where(sigma == 0, torch.ones_like(sigma), sigma)[..., None, None]


def mean_singular_value(Y: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    r"""$\langle Y, Q\rangle / n$ with $Q \approx \operatorname{msign}(Y)$: the mean singular value of ``Y`` (its
    nuclear norm over $n$), ``(..., 1, 1)``; the scale of a multiplier step in the units of $Y$."""
    return (Y * Q).sum(dim=(-2, -1), keepdim=True) / Y.shape[-1]


def carried_multiplier(state: dict | None, T: torch.Tensor) -> torch.Tensor | None:
    """The multiplier ``S`` a warm start carries (``state["dual"]``) as ``(B, n, n)`` in ``T``'s dtype, or None."""
    dual = (state or {}).get("dual")
    return None if dual is None else dual.reshape(-1, T.shape[-1], T.shape[-1]).to(T)


def feasible_stats(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, A: torch.Tensor, evaluations: int, opts: dict
):
    """The statistics of a products-only solve of ``(B, m, n)`` batches: ``evaluations`` msign calls each,
    the tangent residual of ``A`` (rounding only: feasible by construction, so always converged) and,
    with ``opts["trace"]``, a one-point trace of the first matrix."""
    res = tangent_residual(manifold, T, A).double().cpu()
    trace = None
    if opts.get("trace"):
        trace = Trace()
        trace.add(res[0], first_objective(G, A))
    B = T.shape[0]
    return {
        "evaluations": torch.full((B,), evaluations, dtype=torch.long),
        "residual": res,
        "converged": torch.ones(B, dtype=torch.bool),
        "trace": trace,
    }
