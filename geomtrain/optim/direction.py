r"""The spectral steepest-descent direction on a Gram-space manifold: the entry point.

For a point $W$ of $\mathcal M_P$ (tall form, $m \ge n$) and a gradient or momentum $G$, Manifold Muon moves along

$$A^\star = \arg\max_A \ \langle G, A\rangle \quad\text{s.t.}\quad \|A\|_{\mathrm{op}} \le 1,\quad
L_W(A) = P(W^\top A + A^\top W) = 0 .$$

With a symmetric multiplier $S = P(S)$, $\langle G, A\rangle = \langle G + WS, A\rangle \le \|G + W S\|_*$ for every
feasible $A$: $\mathrm{OPT} = \min_S \|G + W S\|_*$, $A^\star = \operatorname{msign}(G + WS^\star)$, and any $S$
certifies a duality gap. The solvers are registered (`geomtrain.optim.registry`).
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
from .registry import REFERENCE_SOLVER, check_solver_options, get_solver
from .solver import STAT_KEYS, Solver

__all__ = ["spectral_direction", "DirectionStats", "on_manifold_probe", "tangent_residual"]


@dataclass
class DirectionStats:
    r"""What a solve reports, per matrix (tensors of the batch shape, on the CPU).

    Attributes:
        solver: the solver's registered name (``"exact"`` also where asked for as ``"gram_newton"``).
        evaluations: polar evaluations (eigendecompositions for ``exact``, msign calls for the others).
        residual: RMS of $L_W(A)$ over the constrained Gram entries (`tangent_residual`).
        converged: residual at most ``tol``.
        dual_gap: $(U - \langle \hat G, A\rangle)/U$, $U \ge \mathrm{OPT}$: a bound on the relative suboptimality.
        dual: ``state["dual"]`` ``(..., n, n)``, to pass back as ``dual=``, or None.
        multiplier: the multiplier $S$ ``(..., n, n)`` at which ``dual_gap`` is certified (``exact``).
        escalated: ``state["escalated"]`` (``exact``): solved in float64 although the input is float32.
        trace: with ``trace=True``: the first matrix's per-evaluation ``residual``, ``objective``, ``dual_bound``.
        state: the solver's warm-start state ``{slot.key: tensor}`` (batch shape in front), or None.
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


ON_MANIFOLD_PROBE_TOL = 1e-2  # far above a float32 or float16 point's probe error, far below a raw weight's


def on_manifold_probe(T: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    r"""$\|C w - w\|/\|w\|$ per matrix of a tall ``T``, $w$ a fixed $\pm 1$ vector, $C = T^\top T$ or, given the
    column norms ``s``, $S^{-1}T^\top T S^{-1}$ ($I$ on the manifold): catches a weight that was never projected."""
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
    r"""Unit-spectral-norm tangent direction maximising $\langle G, A\rangle$ at ``W``. Long because it is the one
    entry point every solver shares: checks, zero and Euclidean matrices, the wide-to-tall turn and batching.

    Args:
        manifold: a :class:`manifolds.GramManifold` (any mask; built-in masks get closed forms).
        W: point(s) on the manifold, ``(..., m, n)``; wide matrices are constrained on rows.
        G: gradient or momentum, shaped like ``W``, finite.
        solver: a registered name (`solver_names`) or a `Solver`; default ``"exact"``.
        **options: solver options (``SOLVER_OPTIONS[solver]``; ``exact``'s: docs/manifold-muon.md) and the warm-start
            state (`DirectionStats.state`) under its `StateSlot` options (``dual=``, ``escalate=``).

    Returns:
        ``(A, stats)``: ``A`` shaped like ``W``, in ``W``'s dtype, and a `DirectionStats`.

    Euclidean returns ``msign(G)`` with the ``msign`` options. A matrix with ``G = 0`` gets ``A = 0`` without a solve
    (residual and gap 0, its warm-start state passed through); the others are solved as a batch of only them.
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
    stats = {"evaluations": torch.ones(B, dtype=torch.long), "residual": torch.zeros(B, dtype=torch.float64)}
    return msign_with(G, opts), {**stats, "converged": torch.ones(B, dtype=torch.bool)}, None


def _solve_nonzero(solve, slots, manifold, T: torch.Tensor, G: torch.Tensor, opts: dict, given: dict, nonzero):
    r"""``solve`` on the matrices with $G \ne 0$ (``nonzero``) only; the others get $A = 0$, empty statistics and
    their ``given`` state (else zero; ``slots``: the solver's `StateSlot` s)."""
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


# The statistics a solver may report beyond STAT_KEYS, and empty ones (no matrix solved)
_REPORTS = ("dual_gap", "multiplier")
_EMPTY_STATS = {
    "evaluations": lambda T, n: torch.zeros(0, dtype=torch.long),
    "residual": lambda T, n: torch.zeros(0, dtype=torch.float64),
    "converged": lambda T, n: torch.zeros(0, dtype=torch.bool),
    "dual_gap": lambda T, n: torch.zeros(0, dtype=torch.float64),
    "multiplier": lambda T, n: T.new_zeros((0, n, n)),
}
