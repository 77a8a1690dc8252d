r"""Products-only kernels of the ``filled_split`` solver (and of `geomtrain.optim.column_split`).

Nothing here decomposes a matrix: every step is a matrix product, an entrywise operation or a norm, so it
runs in bf16/fp32 on an accelerator at the speed of its products. For the built-in masks (Stiefel,
DGram, Oblique) at a point $W$ of the manifold (tall form) with column norms squared $d_i$:

- **Normal multiplier.** $S = P(W^\top U + U^\top W) \oslash (d_i + d_j)$ is the symmetric $S = P(S)$
  with $U - WS$ tangent (the geometry's closed form, `manifolds.GramManifold.normal_multiplier`):
  $W^\top W = \operatorname{diag}(d)$ on Stiefel and DGram ($P(W^\top W S + S W^\top W)_{ij} = (d_i + d_j) S_{ij}$),
  and $S$ is diagonal on Oblique. So
  $P_T(U) = U - WS$ (`tangent_part`) costs two $mn^2$ products.
- **Spectral-norm upper bound** (`op_norm_upper_bound`): $k$ squarings of the normalised Gram matrix
  $N_0 = X^\top X / \|X^\top X\|_F$ give $\sigma_{\max}(X)^2 \le \|X^\top X\|_F \prod_{j=1}^k f_j^{2^{-j}}$,
  $f_j = \|N_{j-1}^2\|_F$ (the Schatten-$2^{k+2}$ norm of $X$): a guaranteed bound, loose by at most
  $n^{1/2^{k+2}}$ (all singular values equal; $k = 7$: 1.3% at $n = 768$), tight where the top singular
  value stands apart. A power iteration gives a lower bound only, so it cannot make a direction safe.
- **Feasibility fix** (`feasible_direction`): $A = P_T(X) / \bar\sigma$ with $\bar\sigma$ that
  bound times a rounding margin: tangent to rounding, $\|A\|_{\mathrm{op}} \le 1$ whatever $X$ was.
- **msign in Gram space** (`gram_msign_factor`): an msign iteration $X_{k+1} = X_k\,q_k(X_k^\top X_k)$ keeps
  $X_k = X F_k$ with $F_k$ a polynomial in $M = X^\top X$, so $F_{k+1} = F_k\,q_k(M_k)$,
  $M_{k+1} = M_k\,q_k(M_k)^2$: the same msign from $M$ alone, $n^3$ products instead of $mn^2$ ones.
"""

from __future__ import annotations

import torch

from manifolds import GramManifold
from manifolds.matrix_sign import KELLER_JORDAN_COEFFICIENTS, KELLER_JORDAN_EPS, POLAR_EXPRESS_COEFFICIENTS

from .gram import tangent_residual
from .numerics import Trace, first_objective, sym

__all__ = [
    "BOUND_SQUARINGS",
    "NEAR_UNIT_SQUARINGS",
    "tangent_part",
    "op_norm_upper_bound",
    "feasible_direction",
    "scale_to_ball",
    "near_unit_bound",
    "log_eigenvalue_bound",
    "BOUNDS",
    "rounding_margin",
    "mean_singular_value",
    "ball_factor",
    "gram_msign_factor",
]

# Squarings of the n x n Gram matrix in the spectral-norm bound: 7 (n^3 each, ~0.5 msign at a square shape)
# leave it within n^(1/512) of sigma_max: <= 1.3% at n = 768 when every singular value is the largest.
BOUND_SQUARINGS = 7
# The near-unit bound squares (P - I/2)^2, whose Schatten bound is loose by r^(1/2^k) of 1/4: one squaring more
# than BOUND_SQUARINGS keeps that about 0.1% on the result (`near_unit_bound`).
NEAR_UNIT_SQUARINGS = BOUND_SQUARINGS + 1
# The msign methods `gram_msign_factor` runs: each a polynomial step X <- X q(X^T X); "svd" is none
GRAM_MSIGNS = ("polar_express", "newton_schulz", "keller_jordan")


def tangent_part(manifold: GramManifold, W: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    r"""$P_T(U) = U - W S$ with $S$ = `manifolds.GramManifold.normal_multiplier` (the orthogonal tangent
    projection: the closed form on the built-in masks, conjugate gradients on a custom one; products only)."""
    return U - W @ manifold.normal_multiplier(W, U)


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


def rounding_margin(m: int, n: int, dtype: torch.dtype, squarings: int = BOUND_SQUARINGS) -> float:
    r"""$1 + (m + k n)\,\epsilon$ for a tall $m \times n$ matrix of ``dtype``: the first-order worst-case rounding of
    the bound's products (a length-$m$ dot product, then $k$ length-$n$ ones), relative; at 3072x768 in float32
    $1 + 5 \cdot 10^{-4}$."""
    return 1.0 + (m + squarings * n) * torch.finfo(dtype).eps


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
    return X * ball_factor(X.mT @ X, X.shape[-2], bound)[..., None, None]  # one Gram product, either bound


def ball_factor(P: torch.Tensor, m: int, bound: str = "schatten") -> torch.Tensor:
    r"""$1/\bar\sigma$ per matrix ``(...)`` of `scale_to_ball` from the Gram matrix $P = X^\top X$ ``(..., n, n)`` of
    a tall $X$ with ``m`` rows (1 where $X = 0$): $X$ times it is in the unit spectral ball."""
    if bound not in BOUNDS:
        raise ValueError(f"bound {bound!r}; valid: {', '.join(BOUNDS)}")
    if bound == "near_unit":
        sigma = _near_unit_bound(P, NEAR_UNIT_SQUARINGS)
    else:
        sigma = _schatten_bound(P, BOUND_SQUARINGS)
        if bound == "both":
            sigma = torch.minimum(sigma, _near_unit_bound(P, NEAR_UNIT_SQUARINGS))
    sigma = sigma * rounding_margin(m, P.shape[-1], P.dtype)
    return 1.0 / torch.where(sigma == 0, torch.ones_like(sigma), sigma)


def mean_singular_value(Y: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    r"""$\langle Y, Q\rangle / n$ with $Q \approx \operatorname{msign}(Y)$: the mean singular value of ``Y`` (its
    nuclear norm over $n$), ``(..., 1, 1)``; the scale of a multiplier step in the units of $Y$."""
    return (Y * Q).sum(dim=(-2, -1), keepdim=True) / Y.shape[-1]


def carried_multiplier(state: dict | None, T: torch.Tensor, key: str = "dual") -> torch.Tensor | None:
    """The multiplier a warm start carries (``state[key]``: ``"dual"``, the multiplier ``S``) as ``(B, n, n)`` in
    ``T``'s dtype, or None."""
    dual = (state or {}).get(key)
    return None if dual is None else dual.reshape(-1, T.shape[-1], T.shape[-1]).to(T)


def feasible_stats(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, A: torch.Tensor, evaluations: int, opts: dict
):
    """The statistics of a products-only solve of ``(B, m, n)`` batches: ``evaluations`` msign calls each,
    the tangent residual of ``A`` (rounding only: feasible by construction, so always converged; on ``A``'s
    device, for the optimizer's one host read per batch) and, with ``opts["trace"]``, a one-point trace of
    the first matrix."""
    res = tangent_residual(manifold, T, A).double()
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


def gram_msign_factor(M: torch.Tensor, method: str, steps: int) -> torch.Tensor:
    r"""$F$ ``(..., n, n)`` with $\operatorname{msign}(X) \approx XF$ for $M = X^\top X$ of a tall $X$:
    `manifolds.msign`'s ``method`` (`GRAM_MSIGNS`) and ``steps`` from $M$ alone. Its scaling $X/\|X\|_F$ is
    $M/\operatorname{tr} M$; each step $q(Y) = aI + bY + cY^2$ gives $F \leftarrow Fq$, $Y \leftarrow Yq^2$ (all
    polynomials in $M$, so symmetric and commuting: symmetrised against rounding), four $n^3$ products (the first
    step one, the last two), against two $mn^2$ ones of the tall step. ``M`` float32 or float64 (a bf16 Gram
    matrix would lose the small singular values: it squares their rounding).

    A ridge $\epsilon$ (the dtype's) is added to $M/\operatorname{tr} M$: rounding can make the smallest
    eigenvalues of $M$ negative, and a step maps $\lambda < 0$ to $\lambda q(\lambda)^2$, growing by $q(0)^2$ (68 at
    Polar Express's first step). Measured on float32 Gram matrices of rank-deficient $X$ (512x128 of rank 32 to
    3072x768 of rank 700): the smallest eigenvalue is $-4 \cdot 10^{-9}$ to $-10^{-10}$ of the trace, so
    $\epsilon = 1.2 \cdot 10^{-7}$ keeps every one positive. It maps a singular value $\sigma\|X\|_F$ to about
    $\sigma / \sqrt{\sigma^2 + \epsilon}$ of 1: 0.94 at $10^{-3}$, Polar Express's own floor."""
    if method not in GRAM_MSIGNS:
        raise ValueError(f"msign {method!r} has no Gram-space form; valid: {', '.join(GRAM_MSIGNS)}")
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    trace = M.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(0)
    if method == "keller_jordan":
        scale = 1 / trace.sqrt().clamp_min(KELLER_JORDAN_EPS)
    else:  # manifolds.msign's Frobenius scaling with Polar Express's 1.01 safety factor
        scale = 1 / (trace.sqrt() * 1.01 + 1e-7)
    Y = M * (scale * scale)[..., None, None] + torch.finfo(M.dtype).eps * eye
    F = None
    for k in range(steps):
        if method == "polar_express":
            a, b, c = POLAR_EXPRESS_COEFFICIENTS[min(k, len(POLAR_EXPRESS_COEFFICIENTS) - 1)]
        else:
            a, b, c = KELLER_JORDAN_COEFFICIENTS if method == "keller_jordan" else (1.5, -0.5, 0.0)
        q = a * eye + b * Y + (c * (Y @ Y) if c else 0.0)
        F = q * scale[..., None, None] if F is None else sym(F @ q)
        if k < steps - 1:
            Y = sym((Y @ q) @ q)
    return eye * scale[..., None, None] if F is None else F
