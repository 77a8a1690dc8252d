r"""The spectral steepest-descent direction on a Gram-space manifold: the entry point.

For a point $W$ of $\mathcal M_P$ (tall form, $m \ge n$) and a gradient or momentum $G$,
Manifold Muon moves along

$$A^\star = \arg\max_A \ \langle G, A\rangle \quad\text{s.t.}\quad \|A\|_{\mathrm{op}} \le 1,\quad
L_W(A) = P(W^\top A + A^\top W) = 0 .$$

**Dual.** With a symmetric multiplier $S = P(S)$ and $Y(S) = G + W S$ (the range of $L_W^*$ is
$\{W S\}$), $\langle G, A\rangle = \langle Y, A\rangle$ for every tangent $A$, so
$\langle G, A\rangle \le \|Y(S)\|_*$ for every feasible $A$ and every $S$:
$\mathrm{OPT} = \min_S \|G + W S\|_*$ and $A = \operatorname{msign}(Y(S^\star))$. The gradient of
the dual in $S$ is $\tfrac12 L_W(\operatorname{msign}(Y))$: the dual is solved exactly when the
direction is tangent. Any $S$ certifies a duality gap.

Solvers (one module each): ``"gram_newton"`` (default; `geomtrain.optim.gram_newton`, on the
Gram-space dual of `geomtrain.optim.gram`, with `geomtrain.optim.douglas_rachford` for degenerate
duals), ``"tangent"`` and ``"published"`` (`geomtrain.optim.baselines`). $G$ is normalised to
$\|G\|_F = 1$ first by every solver except ``"published"``: the argmax does not change.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from manifolds import GramManifold
from manifolds.base import from_tall, to_tall
from manifolds.matrix_sign import MSIGN_METHODS

from . import gram_newton
from .baselines import MSIGN_OPTIONS, PUBLISHED_OPTIONS, TANGENT_OPTIONS, msign_with, solve_published, solve_tangent
from .gram import mask_kind, tangent_residual
from .numerics import Trace, host_values

__all__ = [
    "spectral_direction",
    "DirectionStats",
    "SOLVERS",
    "DEFAULT_SOLVER",
    "SOLVER_OPTIONS",
    "check_solver_options",
    "solver_option_rule",
    "on_manifold_probe",
    "tangent_residual",
    "mask_kind",
]

SOLVERS = ("gram_newton", "tangent", "published")
DEFAULT_SOLVER = "gram_newton"
SOLVER_OPTIONS: dict[str, dict] = {
    "gram_newton": {**gram_newton.OPTIONS, **MSIGN_OPTIONS},
    "tangent": TANGENT_OPTIONS,
    "published": PUBLISHED_OPTIONS,
}
_SOLVE = {"gram_newton": gram_newton.solve_gram_newton, "tangent": solve_tangent, "published": solve_published}


@dataclass
class DirectionStats:
    r"""What a solve reports, per matrix (tensors of the batch shape, on the CPU).

    Attributes:
        solver: the solver's name.
        evaluations: polar evaluations (eigendecompositions for ``gram_newton``, msign calls for
            the others).
        residual: RMS of $L_W(A)$ over the constrained Gram entries, of the returned $A$ (divided by the
            RMS column norm of $W$ with ``relative_tol``).
        converged: residual at most ``tol`` (``tangent``: always True).
        dual_gap: ``gram_newton`` only: $(U - \langle \hat G, A\rangle)/U$ with $U \ge \mathrm{OPT}$ a dual
            value, $\hat G = G/\|G\|_F$: an upper bound on the relative suboptimality of $A$.
        dual: the warm-start state, shape ``(..., n, n)``, to pass back as ``dual=`` on the next call
            (``gram_newton``: the multiplier $S$, as ``multiplier``, or for square DGram the
            Douglas-Rachford iterate; ``published``: its $\Lambda$), or None.
        multiplier: ``gram_newton`` only: the multiplier $S$ (tall form, ``(..., n, n)``) at which
            ``dual_gap`` is certified: $\|\hat G + WS\|_* \ge \mathrm{OPT}$.
        escalated: ``gram_newton`` only: bool, solved in float64 although the input is float32 (an
            ill-conditioned dual); pass it back as ``escalate=`` with ``dual=`` to skip the float32 probe.
        trace: with ``trace=True``: per-evaluation ``residual``, ``objective`` and ``dual_bound``
            lists of the first matrix.
    """

    solver: str
    evaluations: torch.Tensor
    residual: torch.Tensor
    converged: torch.Tensor
    dual_gap: torch.Tensor | None = None
    dual: torch.Tensor | None = None
    multiplier: torch.Tensor | None = None
    trace: dict | None = None
    escalated: torch.Tensor | None = None


# What each scalar option may be: (test, what the error says it must be). Tensor options (dual, escalate) are
# checked against the problem's shape in spectral_direction.
def _finite_above(low: float, inclusive: bool):
    return lambda v: _is_real(v) and math.isfinite(v) and (v >= low if inclusive else v > low)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)  # numbers.*: NumPy scalars count too


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


_OPTION_RULES = {
    "tol": (_finite_above(0.0, False), "a finite number > 0"),
    "max_iter": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "anderson": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0: no mixing)"),
    "smoothing": (_finite_above(0.0, True), "a finite number >= 0"),
    "compute_dtype": (lambda v: v in (None, torch.float32, torch.float64), "None, torch.float32 or torch.float64"),
    "warm_reset": (lambda v: _is_real(v) and v > 0, "a number > 0 (inf: never restart cold)"),
    "cg_iters": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "cg_tol": (_finite_above(0.0, False), "a finite number > 0"),
    "relative_tol": (lambda v: isinstance(v, bool), "True or False"),
    "trace": (lambda v: isinstance(v, bool), "True or False"),
    "msign": (lambda v: v in MSIGN_METHODS, f"one of {', '.join(MSIGN_METHODS)}"),
    "msign_steps": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "msign_dtype": (
        lambda v: v is None or (isinstance(v, torch.dtype) and v.is_floating_point),
        "None or a floating torch dtype",
    ),
    "steps": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "alpha": (_finite_above(0.0, False), "a finite number > 0"),
}
_PUBLISHED_RULES = {"tol": (_finite_above(0.0, True), "a finite number >= 0 (0: always run every step)")}


def check_solver_options(solver: str, options: dict) -> None:
    """Raise a one-line ``ValueError`` naming the valid choices for an unknown solver, an unknown option or
    a value out of range (``tol=0``, ``anderson=-1``, ``msign="foo"``, ...); the tensor options ``dual`` and
    ``escalate`` are checked against the problem by `spectral_direction`."""
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; valid: {', '.join(SOLVERS)}")
    unknown = set(options) - set(SOLVER_OPTIONS[solver])
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(sorted(unknown))} for solver {solver!r}; "
            f"valid: {', '.join(SOLVER_OPTIONS[solver])}"
        )
    for name, value in options.items():
        must = solver_option_rule(name, value, solver)
        if must is not None:
            raise ValueError(f"bad solver option {name}={value!r} for solver {solver!r}: must be {must}")


def solver_option_rule(name: str, value, solver: str = DEFAULT_SOLVER) -> str | None:
    """None where ``value`` is valid for the scalar option ``name`` of ``solver``, else what it must be (e.g.
    ``"an integer >= 1"``). The tensor options ``dual`` and ``escalate`` are always None here."""
    if name in ("dual", "escalate"):
        return None
    valid, must = (_PUBLISHED_RULES if solver == "published" else {}).get(name, _OPTION_RULES[name])
    return None if valid(value) else must


def _check_state_shape(name: str, value, shape: tuple, dtype_ok, what: str) -> None:
    """A warm-start tensor option (``dual``, ``escalate``) must come from a solve of this problem: ``shape``."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor) or not dtype_ok(value) or value.numel() != math.prod(shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} must be {what} of shape {shape} (from a previous solve of this problem); got {got}")


# spectral_direction refuses a W whose probe error (below) is above this: far above a float32 point's (~1e-6) or a
# float16 one's (~1e-3), far below a raw weight's (the cosines between Gaussian columns are ~ m^-1/2, so the probe
# error is ~ (n/m)^1/2: 0.58 at 24x8, 0.12 at 50257x768).
ON_MANIFOLD_PROBE_TOL = 1e-2


def on_manifold_probe(T: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    r"""$\|C w - w\|/\|w\|$ per matrix of a tall ``T``, for a fixed $\pm 1$ vector $w$: $C = T^\top T$
    (Stiefel: ``s`` None) or, given the column norms ``s`` (DGram), the column cosines $S^{-1}T^\top T S^{-1}$;
    both are $I$ on the manifold. Two matrix-vector products instead of the $m n^2$ Gram matrix: it catches
    a weight that was never projected, not a small drift."""
    n = T.shape[-1]
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    X = T if T.dtype in (torch.float32, torch.float64) else T.float()
    w = signs.to(device=X.device, dtype=X.dtype)
    if s is None:
        y = (X.mT @ (X @ w.unsqueeze(-1))).squeeze(-1)
    else:
        s = s.to(X.dtype)
        y = (X.mT @ (X @ (w / s).unsqueeze(-1))).squeeze(-1) / s
    return (y - w).norm(dim=-1) / n**0.5


def _check(manifold, W: torch.Tensor, G: torch.Tensor, solver: str, options: dict) -> tuple[dict, torch.Tensor, bool]:
    r"""The options with their defaults, the per-matrix mask $G \ne 0$ (batch shape) and whether it is all True
    (read with the input checks: one host read); raises a one-line ``ValueError`` on bad input."""
    check_solver_options(solver, options)
    if not isinstance(manifold, GramManifold):
        raise TypeError(f"spectral_direction needs a manifolds.GramManifold; got {type(manifold).__name__}")
    if W.shape != G.shape or W.dim() < 2:
        raise ValueError(f"W and G must have the same shape (..., m, n); got {tuple(W.shape)} and {tuple(G.shape)}")
    if not (W.is_floating_point() and G.is_floating_point()):
        raise ValueError(f"W and G must be floating-point tensors; got {W.dtype} and {G.dtype}")
    batch, n, dual = tuple(W.shape[:-2]), min(W.shape[-2:]), options.get("dual")
    _check_state_shape("dual", dual, (*batch, n, n), lambda t: t.is_floating_point(), "a float tensor")
    _check_state_shape("escalate", options.get("escalate"), batch, lambda t: t.dtype == torch.bool, "a bool tensor")
    true = torch.ones((), dtype=torch.bool, device=G.device)
    kind, T = mask_kind(manifold), to_tall(W)
    if kind == "generic":  # a user's project_gram: the solves below assume an entrywise 0/1 mask
        manifold.check_mask(n)
    probe, columns = None, true
    if kind == "stiefel":
        probe = on_manifold_probe(T).amax()
    elif kind == "dgram":  # the probe divides by the column norms: only where none is zero
        s = T.norm(dim=-2)
        columns = (s > 0).all()
        probe = torch.where(columns, on_manifold_probe(T, s).amax(), torch.zeros((), device=W.device))
    nonzero = G.flatten(-2).ne(0).any(-1)  # per matrix: G != 0
    g_finite, w_finite, columns, dual_finite, on_manifold, all_nonzero = host_values(  # one read per device
        [
            torch.isfinite(G).all(),
            torch.isfinite(W).all(),
            columns,
            torch.isfinite(dual).all() if dual is not None else true,
            probe <= ON_MANIFOLD_PROBE_TOL if probe is not None else true,
            nonzero.all(),
        ]
    )
    if not g_finite:
        raise ValueError("G has non-finite entries (NaN or Inf); skip this update instead")
    if not w_finite:
        raise ValueError("W has non-finite entries (NaN or Inf): not a point of the manifold")
    if not columns:
        raise ValueError(f"W has a zero column: not a point of {type(manifold).__name__} (its columns are nonzero)")
    if not dual_finite:
        raise ValueError("dual has non-finite entries (NaN or Inf); pass dual=None for a cold start")
    if not on_manifold:
        raise ValueError(
            f"W is not on {type(manifold).__name__} (probe error {float(probe):.3g} > {ON_MANIFOLD_PROBE_TOL:g}); "
            "project it first: W = manifold.projx(W)"
        )
    return {**SOLVER_OPTIONS[solver], **options}, nonzero, all_nonzero


def spectral_direction(
    manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, *, solver: str = DEFAULT_SOLVER, **options: object
) -> tuple[torch.Tensor, DirectionStats]:
    r"""Unit-spectral-norm tangent direction maximising $\langle G, A\rangle$ at ``W``.

    Args:
        manifold: a :class:`manifolds.GramManifold` (any mask; built-in masks get closed forms).
        W: point(s) on the manifold, ``(..., m, n)``; wide matrices are constrained on rows.
        G: gradient or momentum, shaped like ``W``, finite.
        solver: ``"gram_newton"`` (default: converged, scale-invariant, warm-startable, certified),
            ``"tangent"`` (one msign of the tangent-projected $G$) or ``"published"`` (the
            paper's dual ascent as published: not scale-invariant, 20 bf16 msign calls).
        **options: solver options; see ``SOLVER_OPTIONS[solver]`` for names and defaults.
            ``gram_newton``: ``tol`` (RMS tangent residual to stop at: absolute, in the units of $W$, so a
            DGram matrix with column norms $c$ is solved to about ``tol``$/c$ relative), ``max_iter``
            (evaluations at most), ``anderson`` (mixing depth, 0 = off), ``smoothing``
            ($\tau / \sigma_{\mathrm{rms}}(G)$: singular values of the dual point below $\tau$ are
            smoothed, Huber form), ``compute_dtype`` (of the $n \times n$ work; default
            float64 for float64 inputs, else float32), ``warm_reset`` (a warm start whose first
            residual is above this restarts cold), ``cg_iters``/``cg_tol`` (inner CG for custom
            masks), ``dual`` (warm start: a previous ``stats.dual``), ``escalate`` (bool per matrix: a
            previous ``stats.escalated``; those float32 problems go to float64 without the float32
            probe), ``relative_tol`` (residuals divided by the RMS column norm of $W$: the same accuracy
            at any scale of $W$), ``trace`` (record residual
            and objective after every evaluation of the first matrix). ``msign``/``msign_steps``/
            ``msign_dtype`` set the matrix sign of ``tangent``, ``published`` and, for Euclidean,
            of every solver.

    Returns:
        ``(A, stats)``: ``A`` shaped like ``W``, in ``W``'s dtype, and a `DirectionStats`.

    Euclidean (no constraint) returns ``msign(G)`` with the configured msign: plain Muon, for
    every solver. **Zero gradients**: a matrix with ``G = 0`` gets exactly ``A = 0`` without a solve (no
    evaluation, residual 0, converged, gap 0, its ``dual``/``escalate`` state passed through unchanged, else a
    zero multiplier), and the matrices with ``G != 0`` are solved as a batch of only them; ``trace`` follows
    the first of those.
    """
    opts, nonzero, all_nonzero = _check(manifold, W, G, solver, options)
    T, Gt = to_tall(W), to_tall(G, like=W)
    batch = T.shape[:-2]
    m, n = T.shape[-2:]
    T3, G3 = T.reshape(-1, m, n), Gt.reshape(-1, m, n)
    solve = _solve_euclidean if mask_kind(manifold) == "euclidean" else _SOLVE[solver]
    if all_nonzero:
        A3, raw = solve(manifold, T3, G3, opts)
    else:
        A3, raw = _solve_nonzero(solve, manifold, T3, G3, opts, nonzero.reshape(-1))
    gap, dual, trace, mult = raw.get("dual_gap"), raw.get("dual"), raw.get("trace"), raw.get("multiplier")
    stats = DirectionStats(
        solver=solver,
        evaluations=raw["evaluations"].reshape(batch),
        residual=raw["residual"].reshape(batch),
        converged=raw["converged"].reshape(batch),
        dual_gap=None if gap is None else gap.reshape(batch),
        dual=None if dual is None else dual.reshape(*batch, n, n),
        multiplier=None if mult is None else mult.reshape(*batch, n, n),
        trace=None if trace is None else trace.as_dict(),
        escalated=None if raw.get("escalated") is None else raw["escalated"].reshape(batch),
    )
    return from_tall(A3.reshape(T.shape), like=W), stats


def _solve_euclidean(manifold, T: torch.Tensor, G: torch.Tensor, opts: dict) -> tuple[torch.Tensor, dict]:
    r"""No constraint: $A = \operatorname{msign}(G)$ with the configured msign (plain Muon), one call per matrix."""
    B = T.shape[0]
    return msign_with(G, opts), {
        "evaluations": torch.ones(B, dtype=torch.long),
        "residual": torch.zeros(B, dtype=torch.float64),
        "converged": torch.ones(B, dtype=torch.bool),
    }


def _solve_nonzero(solve, manifold, T: torch.Tensor, G: torch.Tensor, opts: dict, nonzero: torch.Tensor):
    r"""``solve`` on the matrices of ``(B, m, n)`` with $G \ne 0$ only (``nonzero``, shape ``(B,)``), as a batch
    of exactly those; the others get $A = 0$ and the statistics of an empty solve: no evaluation, residual 0,
    converged, gap 0, ``dual``/``escalated`` the state passed in (``dual``/``escalate``) unchanged, else a zero
    multiplier and False. The statistics are those ``solve`` reports (also when no matrix is solved)."""
    B, n = T.shape[0], T.shape[-1]
    idx = nonzero.nonzero().squeeze(-1)
    given = {"dual": opts.get("dual"), "escalated": opts.get("escalate")}
    given = {k: None if v is None else v.reshape(B, *((n, n) if k == "dual" else ())) for k, v in given.items()}
    sub = dict(opts)
    for key, name in (("dual", "dual"), ("escalated", "escalate")):
        if given[key] is not None:
            sub[name] = given[key][idx.to(given[key].device)]
    if len(idx):
        A_part, part = solve(manifold, T[idx], G[idx], sub)
    else:  # nothing to solve: the statistics the solver reports, empty
        A_part = torch.zeros_like(T[:0])
        part = {key: _EMPTY_STATS[key](T, n) for key in ("evaluations", "residual", "converged", *_REPORTS[solve])}
        part["trace"] = Trace() if opts.get("trace") else None
    A = A_part.new_zeros((B, *T.shape[1:]))
    A[idx.to(A.device)] = A_part
    raw = {}
    for key, value in part.items():
        if not isinstance(value, torch.Tensor):  # the trace: of the first matrix solved
            raw[key] = value
            continue
        full = value.new_zeros((B, *value.shape[1:]))
        if key == "converged":
            full.fill_(True)
        elif given.get(key) is not None:  # the warm-start state of a zero G passes through
            full.copy_(given[key].to(full))
        full[idx.to(full.device)] = value
        raw[key] = full
    return A, raw


# The statistics beyond evaluations/residual/converged that each solver reports, and empty ones (no matrix solved).
_REPORTS = {
    gram_newton.solve_gram_newton: ("dual_gap", "dual", "multiplier", "escalated"),
    solve_tangent: (),
    solve_published: ("dual",),
    _solve_euclidean: (),
}
_EMPTY_STATS = {
    "evaluations": lambda T, n: torch.zeros(0, dtype=torch.long),
    "residual": lambda T, n: torch.zeros(0, dtype=torch.float64),
    "converged": lambda T, n: torch.zeros(0, dtype=torch.bool),
    "dual_gap": lambda T, n: torch.zeros(0, dtype=torch.float64),
    "escalated": lambda T, n: torch.zeros(0, dtype=torch.bool),
    "dual": lambda T, n: T.new_zeros((0, n, n)),
    "multiplier": lambda T, n: T.new_zeros((0, n, n)),
}
