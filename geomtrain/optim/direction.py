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

Solvers are registered (`geomtrain.optim.registry`): ``"exact"`` (default, alias ``"gram_newton"``;
`geomtrain.optim.gram_newton`, on the Gram-space dual of `geomtrain.optim.gram`, with
`geomtrain.optim.douglas_rachford` for degenerate duals), ``"tangent"`` and ``"published"``
(`geomtrain.optim.baselines`), and any registered with `register_solver`. $G$ is normalised to
$\|G\|_F = 1$ first by every built-in solver except ``"published"``: the argmax does not change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from manifolds import GramManifold, MaskForm
from manifolds.base import from_tall, to_tall

from .baselines import msign_with
from .gram import tangent_residual
from .numerics import Trace, host_values
from .registry import (
    REFERENCE_SOLVER,
    SOLVER_OPTIONS,
    SOLVERS,
    TRAINING_DEFAULTS,
    check_solver_options,
    default_solver,
    describe_default,
    get_solver,
    register_solver,
    solver_names,
    solver_option_rule,
)
from .solver import STAT_KEYS, Solver

__all__ = [
    "spectral_direction",
    "DirectionStats",
    "SOLVERS",
    "REFERENCE_SOLVER",
    "TRAINING_DEFAULTS",
    "default_solver",
    "describe_default",
    "SOLVER_OPTIONS",
    "check_solver_options",
    "solver_option_rule",
    "get_solver",
    "register_solver",
    "solver_names",
    "on_manifold_probe",
    "tangent_residual",
]


@dataclass
class DirectionStats:
    r"""What a solve reports, per matrix (tensors of the batch shape, on the CPU).

    Attributes:
        solver: the solver's registered name (``"exact"`` also where it was asked for as ``"gram_newton"``).
        evaluations: polar evaluations (eigendecompositions for ``exact``, msign calls for
            the others).
        residual: RMS of $L_W(A)$ over the constrained Gram entries, of the returned $A$ (divided by the
            RMS column norm of $W$ with ``relative_tol``).
        converged: residual at most ``tol`` (``tangent``: always True).
        dual_gap: ``exact`` (and any solver reporting it): $(U - \langle \hat G, A\rangle)/U$ with
            $U \ge \mathrm{OPT}$ a dual value, $\hat G = G/\|G\|_F$: an upper bound on the relative
            suboptimality of $A$.
        dual: ``state["dual"]``, shape ``(..., n, n)``, to pass back as ``dual=`` on the next call
            (``exact``: the multiplier $S$, as ``multiplier``, or for square DGram the
            Douglas-Rachford iterate; ``published``: its $\Lambda$), or None.
        multiplier: ``exact`` only: the multiplier $S$ (tall form, ``(..., n, n)``) at which
            ``dual_gap`` is certified: $\|\hat G + WS\|_* \ge \mathrm{OPT}$.
        escalated: ``state["escalated"]``, ``exact`` only: bool, solved in float64 although the input is float32 (an
            ill-conditioned dual); pass it back as ``escalate=`` with ``dual=`` to skip the float32 probe.
        trace: with ``trace=True``: per-evaluation ``residual``, ``objective`` and ``dual_bound``
            lists of the first matrix.
        state: the solver's whole warm-start state, ``{slot.key: tensor}`` (batch shape in front), or None:
            each entry goes back as the `StateSlot`'s option (``dual=``, ``escalate=``).
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
    state: dict | None = None


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


def _check(manifold, W: torch.Tensor, G: torch.Tensor, spec: Solver, options: dict) -> tuple[dict, torch.Tensor, bool]:
    r"""The options with their defaults, the per-matrix mask $G \ne 0$ (batch shape) and whether it is all True
    (read with the input checks: one host read); raises a one-line ``ValueError`` on bad input."""
    check_solver_options(spec, options)
    if not isinstance(manifold, GramManifold):
        raise TypeError(f"spectral_direction needs a manifolds.GramManifold; got {type(manifold).__name__}")
    if W.shape != G.shape or W.dim() < 2:
        raise ValueError(f"W and G must have the same shape (..., m, n); got {tuple(W.shape)} and {tuple(G.shape)}")
    if not (W.is_floating_point() and G.is_floating_point()):
        raise ValueError(f"W and G must be floating-point tensors; got {W.dtype} and {G.dtype}")
    batch, n = tuple(W.shape[:-2]), min(W.shape[-2:])
    dual, dual_option = None, None  # the first matrix slot given: its finite check joins the read below
    for option, slot in spec.state_options().items():
        if slot.kind == "matrix":
            _check_state_shape(
                option, options.get(option), (*batch, n, n), torch.Tensor.is_floating_point, "a float tensor"
            )
            if dual is None and options.get(option) is not None:
                dual, dual_option = options[option], option
        else:
            _check_state_shape(option, options.get(option), batch, lambda t: t.dtype == torch.bool, "a bool tensor")
    true = torch.ones((), dtype=torch.bool, device=G.device)
    form, T = manifold.mask_form, to_tall(W)
    if form is MaskForm.CUSTOM:  # a user's project_gram: the solves below assume an entrywise 0/1 mask
        manifold.check_mask(n)
    probe, columns = None, true
    if form is MaskForm.FULL:
        probe = on_manifold_probe(T).amax()
    elif form is MaskForm.OFF_DIAGONAL:  # the probe divides by the column norms: only where none is zero
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
        raise ValueError(f"{dual_option} has non-finite entries (NaN or Inf); pass {dual_option}=None for a cold start")
    if not on_manifold:
        raise ValueError(
            f"W is not on {type(manifold).__name__} (probe error {float(probe):.3g} > {ON_MANIFOLD_PROBE_TOL:g}); "
            "project it first: W = manifold.projx(W)"
        )
    return {**spec.options, **options}, nonzero, all_nonzero


def spectral_direction(
    manifold: GramManifold,
    W: torch.Tensor,
    G: torch.Tensor,
    *,
    solver: str | Solver = REFERENCE_SOLVER,
    **options: object,
) -> tuple[torch.Tensor, DirectionStats]:
    r"""Unit-spectral-norm tangent direction maximising $\langle G, A\rangle$ at ``W``.
    (Long because it is the one entry point every solver shares: checks, zero and Euclidean matrices,
    the wide-to-tall turn and batching, each a few lines, in the order they apply.)

    Args:
        manifold: a :class:`manifolds.GramManifold` (any mask; built-in masks get closed forms).
        W: point(s) on the manifold, ``(..., m, n)``; wide matrices are constrained on rows.
        G: gradient or momentum, shaped like ``W``, finite.
        solver: a registered name (`solver_names`) or a `Solver`: ``"exact"`` (default here, alias
            ``"gram_newton"``: converged, scale-invariant, warm-startable, certified; training's default is
            per mask, `default_solver`), ``"filled_split"`` (products only),
            ``"tangent"`` (one msign of the tangent-projected $G$) or ``"published"`` (the paper's dual ascent as
            published: not scale-invariant, 20 bf16 msign calls).
        **options: solver options; see ``SOLVER_OPTIONS[solver]`` for names and defaults, and the
            warm-start state (`DirectionStats.state`) under its `StateSlot` options.
            ``exact``: ``tol`` (RMS tangent residual to stop at: absolute, in the units of $W$, so a
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
    the first of those. (Over 60 lines with this docstring, which documents every built-in option.)
    """
    spec = get_solver(solver)
    opts, nonzero, all_nonzero = _check(manifold, W, G, spec, options)
    T, Gt = to_tall(W), to_tall(G, like=W)
    batch = T.shape[:-2]
    m, n = T.shape[-2:]
    T3, G3 = T.reshape(-1, m, n), Gt.reshape(-1, m, n)
    B = T3.shape[0]
    given = {}
    for option, slot in spec.state_options().items():
        value = opts.pop(option, None)
        if value is not None:
            given[slot.key] = value.reshape(B, *((n, n) if slot.kind == "matrix" else ()))
    euclidean = manifold.unconstrained
    solve = _solve_euclidean if euclidean else spec.solve
    if all_nonzero:
        A3, raw, state = solve(manifold, T3, G3, given or None, opts)
    else:
        A3, raw, state = _solve_nonzero(solve, () if euclidean else spec.state, manifold, T3, G3, opts, given, nonzero)
    state = None if state is None else {k: v.reshape((*batch, *v.shape[1:])) for k, v in state.items()}
    trace, extra = raw.get("trace"), {k: raw[k].reshape((*batch, *raw[k].shape[1:])) for k in _REPORTS if k in raw}
    stats = DirectionStats(
        solver=spec.name,
        **{k: raw[k].reshape(batch) for k in STAT_KEYS},
        **extra,
        dual=None if state is None else state.get("dual"),
        escalated=None if state is None else state.get("escalated"),
        trace=None if trace is None else trace.as_dict(),
        state=state,
    )
    return from_tall(A3.reshape(T.shape), like=W), stats


def _solve_euclidean(manifold, T: torch.Tensor, G: torch.Tensor, state, opts: dict) -> tuple[torch.Tensor, dict, None]:
    r"""No constraint: $A = \operatorname{msign}(G)$ with the configured msign (plain Muon), one call per matrix."""
    B = T.shape[0]
    return (
        msign_with(G, opts),
        {
            "evaluations": torch.ones(B, dtype=torch.long),
            "residual": torch.zeros(B, dtype=torch.float64),
            "converged": torch.ones(B, dtype=torch.bool),
        },
        None,
    )


def _solve_nonzero(solve, slots, manifold, T: torch.Tensor, G: torch.Tensor, opts: dict, given: dict, nonzero):
    r"""``solve`` on the matrices of ``(B, m, n)`` with $G \ne 0$ only (``nonzero``, batch shape), as a batch
    of exactly those; the others get $A = 0$ and the statistics of an empty solve: no evaluation, residual 0,
    converged, gap 0, their warm-start state as ``given`` (``{slot.key: (B, ...)}``) unchanged, else zero
    (False). ``slots``: the solver's `StateSlot` s (what an empty solve's state holds)."""
    B, n = T.shape[0], T.shape[-1]
    idx = nonzero.reshape(-1).nonzero().squeeze(-1)
    sub = {key: value[idx.to(value.device)] for key, value in given.items()}
    if len(idx):
        A_part, part, state = solve(manifold, T[idx], G[idx], sub or None, opts)
    else:  # nothing to solve: the statistics and state the solver reports, empty
        A_part = torch.zeros_like(T[:0])
        part = {key: _EMPTY_STATS[key](T, n) for key in (*STAT_KEYS, *_REPORTS)}
        part["trace"] = Trace() if opts.get("trace") else None
        empty = {"matrix": T.new_zeros((0, n, n)), "flag": torch.zeros(0, dtype=torch.bool)}
        state = {s.key: given[s.key][:0] if s.key in given else empty[s.kind] for s in slots}  # given: its dtype
        state = state or None
    A = A_part.new_zeros((B, *T.shape[1:]))
    A[idx.to(A.device)] = A_part
    raw = {
        key: value if not isinstance(value, torch.Tensor) else _scatter(value, idx, B, key == "converged", None)
        for key, value in part.items()
    }
    if state is not None:
        state = {key: _scatter(value, idx, B, False, given.get(key)) for key, value in state.items()}
    return A, raw, state


def _scatter(value: torch.Tensor, idx: torch.Tensor, B: int, fill: bool, base: torch.Tensor | None) -> torch.Tensor:
    """``value`` (one row per solved matrix) at rows ``idx`` of a batch of ``B``: the other rows ``base`` (the
    state passed in) where given, else True (``fill``) or zero."""
    full = value.new_zeros((B, *value.shape[1:]))
    if fill:
        full.fill_(True)
    elif base is not None:
        full.copy_(base.to(full))
    full[idx.to(full.device)] = value
    return full


# The statistics beyond evaluations/residual/converged that a solver may report (`Solver.reports`), and empty
# ones (no matrix solved).
_REPORTS = ("dual_gap", "multiplier")
_EMPTY_STATS = {
    "evaluations": lambda T, n: torch.zeros(0, dtype=torch.long),
    "residual": lambda T, n: torch.zeros(0, dtype=torch.float64),
    "converged": lambda T, n: torch.zeros(0, dtype=torch.bool),
    "dual_gap": lambda T, n: torch.zeros(0, dtype=torch.float64),
    "multiplier": lambda T, n: T.new_zeros((0, n, n)),
}
