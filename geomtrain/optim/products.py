r"""Products-only kernels of the ``filled_split`` solver (and of `geomtrain.optim.column_split`): no decomposition.

**Spectral-norm upper bound** (`op_norm_upper_bound`): $k$ normalised squarings of $N_0 = X^\top X / \|X^\top X\|_F$
give $\sigma_{\max}(X)^2 \le \|X^\top X\|_F \prod_{j=1}^k f_j^{2^{-j}}$, $f_j = \|N_{j-1}^2\|_F$ (the Schatten-$2^{k+2}$
norm of $X$): guaranteed, loose by at most $n^{1/2^{k+2}}$, tight where the top singular value stands apart.

**msign in Gram space** (`gram_msign_factor`): an msign iteration $X_{k+1} = X_k\,q_k(X_k^\top X_k)$ keeps $X_k = X F_k$
with $F_k$ a polynomial in $M = X^\top X$: $F_{k+1} = F_k\,q_k(M_k)$, $M_{k+1} = M_k\,q_k(M_k)^2$.
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

BOUND_SQUARINGS = 7  # n^3 each; the bound is within n^(1/512) of sigma_max
NEAR_UNIT_SQUARINGS = BOUND_SQUARINGS + 1  # one more for (P - I/2)^2 (`near_unit_bound`)
GRAM_MSIGNS = ("polar_express", "newton_schulz", "keller_jordan")  # the msigns with a Gram-space form


def tangent_part(manifold: GramManifold, W: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    r"""$P_T(U) = U - W S$, $S$ = `manifolds.GramManifold.normal_multiplier`: the orthogonal tangent projection."""
    return U - W @ manifold.normal_multiplier(W, U)


def op_norm_upper_bound(X: torch.Tensor, squarings: int = BOUND_SQUARINGS) -> torch.Tensor:
    r"""An upper bound on $\|X\|_{\mathrm{op}}$ per matrix of a tall ``(..., m, n)`` (module docstring; 0 for 0)."""
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
    are 0 or near 1 (an msign's output): each eigenvalue $\lambda$ of $P = X^\top X$ has $\lambda(\lambda - 1) \le
    \beta = \bar\lambda_{\max}((P - \tfrac12 I)^2) - \tfrac14$, so $\|X\|_{\mathrm{op}}^2 \le
    (1 + \sqrt{1 + 4\beta})/2$."""
    return _near_unit_bound(X.mT @ X, squarings)


def _near_unit_bound(P: torch.Tensor, squarings: int) -> torch.Tensor:
    """`near_unit_bound` from the Gram matrix $P = X^\top X$."""
    E = P - 0.5 * torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
    log_e, zero = log_eigenvalue_bound(E @ E, squarings)
    beta = (torch.where(zero, torch.zeros_like(log_e), log_e.exp()) - 0.25).clamp_min(-0.25)
    return ((1 + (1 + 4 * beta).sqrt()) / 2).sqrt()


def rounding_margin(m: int, n: int, dtype: torch.dtype, squarings: int = BOUND_SQUARINGS) -> float:
    r"""$1 + (m + k n)\,\epsilon$ for a tall $m \times n$ matrix of ``dtype``: the first-order worst-case relative
    rounding of the bound's products (a length-$m$ dot product, then $k$ length-$n$ ones)."""
    return 1.0 + (m + squarings * n) * torch.finfo(dtype).eps


def feasible_direction(
    manifold: GramManifold, W: torch.Tensor, X: torch.Tensor, bound: str = "schatten"
) -> torch.Tensor:
    r"""$A$ = `scale_to_ball` of $P_T(X)$: tangent, $\|A\|_{\mathrm{op}} \le 1$; $X = 0$ gives $A = 0$ exactly."""
    return scale_to_ball(tangent_part(manifold, W, X.to(W.dtype)), bound)


BOUNDS = ("schatten", "near_unit", "both")


def scale_to_ball(X: torch.Tensor, bound: str = "schatten") -> torch.Tensor:
    r"""$X / \bar\sigma$, $\bar\sigma \ge \|X\|_{\mathrm{op}}$ times `rounding_margin`, by ``bound`` of `BOUNDS`
    (`op_norm_upper_bound`, `near_unit_bound` or the smaller); $X = 0$ stays 0."""
    return X * ball_factor(X.mT @ X, X.shape[-2], bound)[..., None, None]  # one Gram product, either bound


def ball_factor(P: torch.Tensor, m: int, bound: str = "schatten") -> torch.Tensor:
    r"""$1/\bar\sigma$ per matrix of `scale_to_ball` from $P = X^\top X$ ``(..., n, n)`` of a tall $X$ with ``m`` rows
    (1 where $X = 0$)."""
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
    """The multiplier a warm start carries (``state[key]``) as ``(B, n, n)`` in ``T``'s dtype, or None."""
    dual = (state or {}).get(key)
    return None if dual is None else dual.reshape(-1, T.shape[-1], T.shape[-1]).to(T)


def feasible_stats(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, A: torch.Tensor, evaluations: int, opts: dict
):
    """The statistics of a products-only solve: ``evaluations`` msigns each, the tangent residual of ``A`` on its
    device, always converged (feasible by construction)."""
    res = tangent_residual(manifold, T, A).double()
    trace = None
    if opts.get("trace"):
        trace = Trace()
        trace.add(res[0], first_objective(G, A))
    B = T.shape[0]
    stats = {"evaluations": torch.full((B,), evaluations, dtype=torch.long), "residual": res}
    return {**stats, "converged": torch.ones(B, dtype=torch.bool), "trace": trace}


def gram_msign_factor(M: torch.Tensor, method: str, steps: int) -> torch.Tensor:
    r"""$F$ ``(..., n, n)`` with $\operatorname{msign}(X) \approx XF$ from $M = X^\top X$ (float32 or float64) alone:
    `manifolds.msign`'s ``method`` and ``steps``, each step $q(Y) = aI + bY + cY^2$ giving $F \leftarrow Fq$,
    $Y \leftarrow Yq^2$ from $Y = M/\operatorname{tr} M + \epsilon I$ (the ridge keeps rounding-negative eigenvalues,
    which a step would grow by $q(0)^2$, positive)."""
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
