r"""Matrix sign / polar factor.

For a matrix $X = U \Sigma V^\top$ (thin SVD) the polar factor, or matrix sign, is

$$\operatorname{msign}(X) = U V^\top = X (X^\top X)^{-1/2}.$$

It is the nearest matrix with orthonormal columns (rows, if $X$ is wide) to $X$, the Stiefel
retraction, and the steepest-descent direction of Muon. Three methods are provided:

- ``"svd"``: exact thin SVD, in float64 or float32. Singular values within ~10 ulp of 1
  (float32: 1.4e-6 measured) at any conditioning; a rank-deficient input gets an arbitrary
  orthonormal completion.
- ``"polar_express"``: odd quintic iteration with the optimal per-step coefficients of Amsel et
  al. (2025), then the fixed $(15/8, -10/8, 3/8)$ map. 5 steps (Muon's choice) leave singular
  values in about $[0.86, 1.14]$ for $\sigma/\|X\|_F \ge 10^{-3}$; 12 steps in float32 give
  $|\sigma-1| \lesssim 10^{-5}$.
- ``"keller_jordan"``: Keller Jordan's quintic $(a, b, c) = (3.4445, -4.7750, 2.0315)$ at every
  step, after scaling by $\|X\|_F$ (clamped at $10^{-7}$): exactly the orthogonaliser of
  ``torch.optim.Muon`` (and of KellerJordan/Muon), which runs it in bfloat16. It does not converge
  to 1: singular values end in about $[0.7, 1.2]$, by design. With ``compute_dtype`` given, the
  arithmetic is done in exactly that dtype, also bfloat16 on CPU (slow there: emulated).
- ``"newton_schulz"``: the classical cubic $X \leftarrow \tfrac32 X - \tfrac12 X X^\top X$;
  quadratic convergence once $\sigma \in (0, \sqrt 3)$, slow for small $\sigma$.

Iterative methods compute in ``compute_dtype`` (default: the input's, but at least float32 on
CPU; ``torch.bfloat16`` is allowed and is what Muon uses on GPUs for *directions*). They converge
only for singular values above roughly ``1e-3 * ||X||_F`` in the given number of steps: use
``"svd"`` where exactness matters (retractions on CPU, reference solutions).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "msign",
    "polar",
    "polar_near_orthogonal",
    "newton_schulz_polar",
    "newton_schulz_steps",
    "newton_schulz_where_near",
    "NEAR_ORTHOGONAL",
    "POLAR_EXPRESS_COEFFICIENTS",
    "KELLER_JORDAN_COEFFICIENTS",
    "KELLER_JORDAN_EPS",
    "MSIGN_METHODS",
]

MSIGN_METHODS = ("svd", "polar_express", "newton_schulz", "keller_jordan")

# Keller Jordan's Muon coefficients and norm floor, as torch.optim.Muon has them (torch/optim/_muon.py,
# from https://kellerjordan.github.io/posts/muon/): the same at every one of the 5 steps.
KELLER_JORDAN_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
KELLER_JORDAN_EPS = 1e-7

# Optimal degree-5 coefficients (a, b, c) of p(x) = a x + b x^3 + c x^5 for singular values in
# [1e-3, 1], from "The Polar Express" (Amsel, Persson, Musco, Gower, 2025), each but the last
# divided by a 1.01 safety factor as the paper recommends for low precision.
_PE_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
)
POLAR_EXPRESS_COEFFICIENTS = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _PE_RAW) + (
    (1.875, -1.25, 0.375),
)

_DEFAULT_STEPS = {"polar_express": 5, "newton_schulz": 30, "keller_jordan": 5}


def _check_matrix(X: torch.Tensor, name: str = "X") -> None:
    if X.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., m, n); got shape {tuple(X.shape)}")
    if not torch.is_floating_point(X):
        raise TypeError(f"{name} must be a floating tensor; got {X.dtype}")


# Largest entry of U^T U - I accepted from a float32 SVD: a correct one leaves ~1e-6 (retractions in
# training: 1.2-2.9e-6 after the polar factor), a broken one O(1); 1e-4 sits far from both.
SVD_ORTHONORMALITY_TOL = 1e-4


def _orthonormal(U: torch.Tensor) -> bool:
    """Whether the columns of (batched) ``U`` are orthonormal to `SVD_ORTHONORMALITY_TOL`."""
    eye = torch.eye(U.shape[-1], dtype=U.dtype, device=U.device)
    return bool(((U.mT @ U) - eye).abs().amax() <= SVD_ORTHONORMALITY_TOL)


def _svd_factors(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Thin-SVD factors ``U, Vh`` of ``X``; a float32 factorisation that fails is redone in float64.

    LAPACK's float32 divide-and-conquer SVD (``sgesdd``, MKL in torch's CPU wheel) can break down
    on matrices whose singular values are all nearly equal, exactly the near-orthogonal inputs of a
    Stiefel retraction. Seen in training on 128 x 128 ``W + dW`` with every singular value in
    [1.0000, 1.0002]: either it raises (fails to converge) or, worse, it returns NaN in ``U`` and
    ``V`` with finite singular values. Both are detected here and that batch is factorised again in
    float64 (which succeeds on those matrices); the float64 factors are returned. A float64 input
    that fails raises ``torch.linalg.LinAlgError``.

    A third failure returns finite factors that are not orthonormal: seen once in a 2,000-step
    ``all-stiefel`` run on a 512 x 128 ``W + dW``, whose "polar factor" then had singular values
    from 3.5 down to 3e-6, so the weight left the manifold and the next step's direction solve
    (which takes $W^\top W = I$ as given) returned $\|A\|_{\mathrm{op}} = 2058$. So float32
    factors are also checked, $\max|U^\top U - I|$ and $\max|V^\top V - I|$ at most
    `SVD_ORTHONORMALITY_TOL`, and redone in float64 otherwise (one more $mn^2$ product).
    """
    try:
        U, _, Vh = torch.linalg.svd(X, full_matrices=False)
        if bool(torch.isfinite(U).all() and torch.isfinite(Vh).all()) and (
            X.dtype == torch.float64 or _orthonormal(U) and _orthonormal(Vh.mT)
        ):
            return U, Vh
        if X.dtype == torch.float64:
            raise torch.linalg.LinAlgError("linalg.svd returned non-finite singular vectors for a finite float64 input")
    except torch.linalg.LinAlgError:
        if X.dtype == torch.float64:
            raise
    U, _, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    return U, Vh


def _polar_express(X: torch.Tensor, steps: int) -> torch.Tensor:
    """Odd quintic iteration on a wide matrix X (rows <= cols), already scaled to ||X||_op <= 1."""
    for k in range(steps):
        a, b, c = POLAR_EXPRESS_COEFFICIENTS[min(k, len(POLAR_EXPRESS_COEFFICIENTS) - 1)]
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X


def _keller_jordan(X: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic of torch.optim.Muon on a wide matrix, operation for operation (addmm/baddbmm)."""
    a, b, c = KELLER_JORDAN_COEFFICIENTS
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=KELLER_JORDAN_EPS)
    mm = torch.addmm if X.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        A = X @ X.mT
        B = mm(A, A, A, beta=b, alpha=c)
        X = mm(X, B, X, beta=a)
    return X


def _newton_schulz(X: torch.Tensor, steps: int) -> torch.Tensor:
    """Cubic Newton-Schulz on a wide matrix X scaled to ||X||_op <= 1 (converges for sigma < sqrt(3))."""
    for _ in range(steps):
        X = 1.5 * X - 0.5 * (X @ X.mT) @ X
    return X


def msign(
    X: torch.Tensor,
    method: str = "polar_express",
    steps: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    r"""Polar factor $\operatorname{msign}(X) = U V^\top$ of a (batched) matrix.

    Args:
        X: tensor of shape ``(..., m, n)``.
        method: one of ``"svd"``, ``"polar_express"``, ``"newton_schulz"``.
        steps: iterations for the iterative methods (default 5 for Polar Express, as in Muon,
            and 30 for Newton-Schulz). Ignored by ``"svd"``.
        compute_dtype: dtype of the arithmetic (default: ``X.dtype``, promoted to float32 for
            half types on CPU). The result is returned in ``X.dtype``.

    Returns:
        A tensor of the shape and dtype of ``X``. A zero matrix maps to zero.
    """
    _check_matrix(X)
    if method not in MSIGN_METHODS:
        raise ValueError(f"unknown msign method {method!r}; valid: {', '.join(MSIGN_METHODS)}")
    out_dtype = X.dtype
    if compute_dtype is None:
        compute_dtype = X.dtype
        if compute_dtype in (torch.float16, torch.bfloat16) and (X.device.type == "cpu" or method == "svd"):
            compute_dtype = torch.float32
    if method == "svd":
        if compute_dtype not in (torch.float32, torch.float64):
            compute_dtype = torch.float32
        Xc = X.to(compute_dtype)
        U, Vh = _svd_factors(Xc)
        is_zero = Xc.abs().amax(dim=(-2, -1), keepdim=True) == 0
        return torch.where(is_zero, torch.zeros_like(Xc), (U @ Vh).to(compute_dtype)).to(out_dtype)

    n_steps = _DEFAULT_STEPS[method] if steps is None else int(steps)
    if n_steps < 0:
        raise ValueError(f"steps must be >= 0; got {n_steps}")
    Y = X.to(compute_dtype)
    tall = Y.shape[-2] > Y.shape[-1]
    if tall:  # iterate on the wide form so that X X^T is the smaller Gram matrix
        Y = Y.mT
    if method == "keller_jordan":
        lead = Y.shape[:-2]
        Y = _keller_jordan(Y.reshape(-1, *Y.shape[-2:]) if len(lead) > 1 else Y, n_steps).reshape(*lead, *Y.shape[-2:])
        return (Y.mT if tall else Y).to(out_dtype)
    # Frobenius scaling puts every singular value in [0, 1]; the 1.01 matches the safety factor.
    Y = Y / (Y.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-7)
    Y = _polar_express(Y, n_steps) if method == "polar_express" else _newton_schulz(Y, n_steps)
    if tall:
        Y = Y.mT
    return Y.to(out_dtype)


def polar(X: torch.Tensor, method: str = "auto") -> torch.Tensor:
    r"""Accurate polar factor for retractions: $X (X^\top X)^{-1/2}$.

    ``method="auto"`` uses the exact SVD on CPU and, on accelerators, 12 Polar Express steps in
    float32 (at least float32 whatever the input), which leaves $|\sigma - 1| \lesssim 10^{-5}$
    for well-conditioned inputs (retractions are always applied near the manifold).
    """
    if method == "auto":
        method = "svd" if X.device.type == "cpu" else "polar_express"
    if method == "svd":
        return msign(X, "svd")
    compute = torch.float64 if X.dtype == torch.float64 else torch.float32
    return msign(X, method, steps=12 if method == "polar_express" else 40, compute_dtype=compute)


# ||X^T X - I||_F (tall form) up to which `polar_near_orthogonal` uses Newton-Schulz: from 0.1 the bound
# d -> 1.5 d^2 + 0.5 d^3 on |sigma - 1| reaches float64 rounding in 5 steps (float32: 4), two mn^2 products
# each. A Manifold Muon retraction starts at ||X^T X - I||_F = lr^2 ||A^T A||_F <= lr^2 sqrt(n): <= 4.5e-3 at
# lr 0.02 and n = 128, 2 steps in float32; at lr 0.1 and n = 768 it can exceed 0.1 and go to the SVD.
NEAR_ORTHOGONAL = 0.1


def newton_schulz_steps(bound: float, dtype: torch.dtype) -> int:
    r"""Newton-Schulz steps (at most 6) that take every $|\sigma - 1| \le$ ``bound`` to the rounding of
    ``dtype``: a step maps the bound $d$ to $\tfrac32 d^2 + \tfrac12 d^3$. Host arithmetic only."""
    eps, steps = torch.finfo(dtype).eps, 0
    while True:
        steps += 1
        bound = 1.5 * bound**2 + 0.5 * bound**3
        if bound <= eps or steps >= 6:
            return steps


def newton_schulz_polar(Y: torch.Tensor, P: torch.Tensor, steps: int) -> torch.Tensor:
    r"""``steps`` Newton-Schulz steps $Y \leftarrow \tfrac12 Y (3I - Y^\top Y)$ on tall ``(..., m, n)`` matrices,
    given $P = Y^\top Y$: matrix products only, no host read (the count comes from `newton_schulz_steps`)."""
    eye = torch.eye(Y.shape[-1], dtype=Y.dtype, device=Y.device)
    for k in range(steps):
        if k:
            P = Y.mT @ Y
        Y = 0.5 * Y @ (3 * eye - P)
    return Y


def newton_schulz_where_near(
    Y: torch.Tensor, P: torch.Tensor, dev: list[float], far_polar: Callable[[list[int]], torch.Tensor]
) -> torch.Tensor:
    r"""Polar factors of a tall batch ``(B, m, n)`` given $P = Y^\top Y$ and each matrix's deviation ``dev`` (read on
    the host, a bound on $|\sigma - 1|$): `newton_schulz_polar` where it is at most ``NEAR_ORTHOGONAL``, its step
    count from the largest of those; ``far_polar(indices)`` for the others (NaN included). No host read here."""
    near = [i for i, d in enumerate(dev) if d <= NEAR_ORTHOGONAL]
    if len(near) == len(dev):  # the usual case after a retraction step: no index copies
        return newton_schulz_polar(Y, P, newton_schulz_steps(max(dev, default=0.0), Y.dtype))
    far = [i for i, d in enumerate(dev) if not d <= NEAR_ORTHOGONAL]
    out = torch.empty_like(Y)
    out[far] = far_polar(far)
    if near:
        out[near] = newton_schulz_polar(Y[near], P[near], newton_schulz_steps(max(dev[i] for i in near), Y.dtype))
    return out


def polar_near_orthogonal(X: torch.Tensor, method: str = "auto") -> torch.Tensor:
    r"""Polar factor of a matrix with nearly orthonormal columns (rows, if wide), by Newton-Schulz.

    $X \leftarrow X(3I - X^\top X)/2$ maps a singular value $1 + \delta$ to
    $1 - \tfrac32\delta^2 - \tfrac12\delta^3$, so from $\|X^\top X - I\|_F \le$ ``NEAR_ORTHOGONAL`` (which
    bounds every $|\sigma^2 - 1|$) a few steps reach the dtype's rounding: the same polar factor as
    `polar`, for two $mn^2$ products a step instead of an SVD (a Stiefel retraction $W - \eta A$ with
    $A$ tangent has $X^\top X = I + \eta^2 A^\top A$). The number of steps is fixed in advance from that
    bound, read with the batch's deviations in one host transfer. Matrices of the batch further from
    orthonormal go to ``polar(X, method)``.
    """
    _check_matrix(X)
    tall = X.shape[-2] >= X.shape[-1]
    T = X if tall else X.mT
    lead, (m, n) = T.shape[:-2], T.shape[-2:]
    T3 = T.reshape(-1, m, n)
    P = T3.mT @ T3
    eye = torch.eye(n, dtype=T3.dtype, device=T3.device)
    dev = (P - eye).norm(dim=(-2, -1)).tolist()  # the one host read: |sigma - 1| <= ||X^T X - I||_F
    out = newton_schulz_where_near(T3, P, dev, lambda far: polar(T3[far], method))
    out = out.reshape(*lead, m, n)
    return out if tall else out.mT
