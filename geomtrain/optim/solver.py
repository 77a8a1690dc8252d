r"""What a direction solver is: the `Solver` record every solver module defines and
`geomtrain.optim.registry` registers, and the shared rules its options are checked by.

A solver maximises $\langle G, A\rangle$ over $\|A\|_{\mathrm{op}} \le 1$, $L_W(A) = 0$ for a batch of
tall problems. Its ``solve(manifold, W, G, state, options) -> (A, stats, state)`` receives

- ``W``, ``G``: ``(B, m, n)`` tall, on the manifold, finite, **every** $G \ne 0$ (`spectral_direction`
  answers $G = 0$ with $A = 0$ itself and never calls a solver with such a matrix; it may call it with
  ``B = 0``);
- ``state``: the warm-start state, ``{slot.key: tensor}`` for the solver's `StateSlot` s (``(B, n, n)``
  for a ``"matrix"`` slot, ``(B,)`` bool for a ``"flag"`` one), or None for a cold start;
- ``options``: every option of `Solver.options`, defaults filled in, already checked;

and returns ``A`` (``(B, m, n)``, ``W``'s dtype), ``stats`` (``evaluations`` long and ``converged`` bool on the
CPU, ``residual`` float64 on the CPU or on ``A``'s device (read with the optimizer's other per-batch values),
each ``(B,)``, plus the keys of `Solver.reports` and ``trace`` where asked) and the new state
(``{slot.key: tensor}``, or None).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from manifolds.matrix_sign import MSIGN_METHODS

__all__ = ["Solver", "StateSlot", "OPTION_RULES", "STAT_KEYS", "option_rule"]


def _finite_above(low: float, inclusive: bool):
    return lambda v: is_real(v) and math.isfinite(v) and (v >= low if inclusive else v > low)


def is_real(v) -> bool:
    """A real number, not a bool (``numbers.Real``: NumPy scalars count too)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_int(v) -> bool:
    """An integer, not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


Rule = tuple[Callable[[object], bool], str]
"""``(valid(value) -> bool, what the one-line error says the value must be)``."""

OPTION_RULES: dict[str, Rule] = {
    "tol": (_finite_above(0.0, False), "a finite number > 0"),
    "max_iter": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "anderson": (lambda v: is_int(v) and v >= 0, "an integer >= 0 (0: no mixing)"),
    "smoothing": (_finite_above(0.0, True), "a finite number >= 0"),
    "compute_dtype": (lambda v: v in (None, torch.float32, torch.float64), "None, torch.float32 or torch.float64"),
    "warm_reset": (lambda v: is_real(v) and v > 0, "a number > 0 (inf: never restart cold)"),
    "cg_iters": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "cg_tol": (_finite_above(0.0, False), "a finite number > 0"),
    "relative_tol": (lambda v: isinstance(v, bool), "True or False"),
    "trace": (lambda v: isinstance(v, bool), "True or False"),
    "msign": (lambda v: v in MSIGN_METHODS, f"one of {', '.join(MSIGN_METHODS)}"),
    "msign_steps": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "msign_dtype": (
        lambda v: v is None or (isinstance(v, torch.dtype) and v.is_floating_point),
        "None or a floating torch dtype",
    ),
    "steps": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "alpha": (_finite_above(0.0, False), "a finite number > 0"),
}
"""The rules of the options shared by several solvers, by name; a `Solver` overrides or adds its own in
``rules`` (``published``'s ``tol`` may be 0)."""

NON_NEGATIVE = _finite_above(0.0, True)
POSITIVE = _finite_above(0.0, False)

STAT_KEYS = ("evaluations", "residual", "converged")
"""The statistics every solver returns; `Solver.reports` names the others (``dual_gap``, ``multiplier``)."""


@dataclass(frozen=True)
class StateSlot:
    """One warm-start tensor of a solver: ``key`` in the returned state, `DirectionStats.state` and the
    optimizer's per-parameter state; ``option`` the `spectral_direction` keyword that passes it back;
    ``kind`` ``"matrix"`` (float ``(n, n)`` per matrix, kept by the optimizer in the parameter's dtype) or
    ``"flag"`` (one bool per matrix, kept as uint8)."""

    key: str
    option: str
    kind: str = "matrix"

    def __post_init__(self):
        if self.kind not in ("matrix", "flag"):
            raise ValueError(f"StateSlot kind must be 'matrix' or 'flag'; got {self.kind!r}")


@dataclass(frozen=True)
class Solver:
    """A direction solver, as registered (`geomtrain.optim.registry.register_solver`).

    Attributes:
        name: its registered name (lower case: letters, digits, ``_``, ``-``).
        solve: ``solve(manifold, W, G, state, options) -> (A, stats, state)`` (the module docstring).
        options: every scalar option with its default (``trace`` included where supported).
        rules: rules for options that `OPTION_RULES` lacks or that differ here.
        state: the warm-start slots (empty: the solver starts cold every time).
        warm_starts: the optimizer carries ``state`` from step to step (``ManifoldMuon(warm_start=True)``).
        carries: with ``warm_starts``, the options under which it does (``carries(options)``, every option
            given, defaults filled in; None: always): ``filled_split`` keeps state with ``carry=True`` only.
        reports: statistics beyond `STAT_KEYS`: ``dual_gap`` (certified relative gap, float64) and
            ``multiplier`` (the dual point $S$, ``(B, n, n)``, at which it is certified).
        aliases: other names that resolve to it (old configs, checkpoints).
        optimizer_msign: `ManifoldMuon`'s ``msign_method``/``msign_steps``/``msign_dtype`` set the
            solver's ``msign`` options (False: it keeps its own defaults, as ``published``'s bf16 msign).
        summary: one line for help texts.
    """

    name: str
    solve: Callable
    options: Mapping[str, object]
    rules: Mapping[str, Rule] = field(default_factory=dict)
    state: tuple[StateSlot, ...] = ()
    warm_starts: bool = False
    carries: Callable[[Mapping], bool] | None = None
    reports: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    optimizer_msign: bool = True
    summary: str = ""

    def rule(self, option: str) -> Rule:
        """The rule of ``option`` (``KeyError`` if it has none)."""
        return self.rules[option] if option in self.rules else OPTION_RULES[option]

    def keeps_state(self, options: Mapping) -> bool:
        """Whether the optimizer carries this solver's state from step to step under ``options`` (a group's
        ``solver_options``; the defaults fill the rest): `warm_starts`, a slot, and `carries` where set."""
        if not (self.warm_starts and self.state):
            return False
        return self.carries is None or bool(self.carries({**self.options, **options}))

    def state_options(self) -> dict[str, StateSlot]:
        """``{slot.option: slot}``: the tensor options of `spectral_direction` that carry the state."""
        return {slot.option: slot for slot in self.state}


def option_rule(solver: Solver, name: str, value) -> str | None:
    """None where ``value`` is valid for the scalar option ``name`` of ``solver``, else what it must be
    (``"an integer >= 1"``). The state options (``dual``, ``escalate``) are always None here."""
    if name in solver.state_options():
        return None
    valid, must = solver.rule(name)
    return None if valid(value) else must
