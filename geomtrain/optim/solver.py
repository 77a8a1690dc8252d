r"""The `Solver` record every solver module defines, and the shared rules its options are checked by.

``solve(manifold, W, G, state, options) -> (A, stats, state)`` maximises $\langle G, A\rangle$ over
$\|A\|_{\mathrm{op}} \le 1$, $L_W(A) = 0$ for ``(B, m, n)`` tall ``W``, ``G`` on the manifold, finite, every $G \ne 0$
(``B`` may be 0); ``state`` is ``{slot.key: tensor}`` (``(B, n, n)`` or ``(B,)`` bool per `StateSlot`) or None, and
``options`` every option, defaults filled in, checked. It returns ``A`` (``W``'s shape and dtype), ``stats``
(``evaluations`` long, ``converged`` bool, on the CPU, ``residual`` float64 on the CPU or ``A``'s device, each ``(B,)``;
the `Solver.reports`; ``trace`` where asked) and the new state or None.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from manifolds import GramManifold
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
"""The rules of the options shared by several solvers; a `Solver` overrides or adds its own in ``rules``."""

NON_NEGATIVE = _finite_above(0.0, True)
POSITIVE = _finite_above(0.0, False)

STAT_KEYS = ("evaluations", "residual", "converged")
"""The statistics every solver returns."""


@dataclass(frozen=True)
class StateSlot:
    """One warm-start tensor of a solver: its ``key`` in the state, the `spectral_direction` ``option`` that passes it
    back, and its ``kind``: ``"matrix"`` (``(n, n)`` per matrix) or ``"flag"`` (one bool per matrix)."""

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
        solve: the solve function (the module docstring).
        options: every scalar option with its default.
        rules: rules for options that `OPTION_RULES` lacks or that differ here.
        state: the warm-start slots (empty: always cold).
        warm_starts: the optimizer carries ``state`` from step to step.
        carries: with ``warm_starts``, whether it does under the given options on the given manifold (None:
            always).
        reports: statistics beyond `STAT_KEYS` (``dual_gap``, ``multiplier``).
        aliases: other names that resolve to it.
        optimizer_msign: `ManifoldMuon`'s msign settings set the solver's ``msign`` options.
        summary: one line for help texts.
    """

    name: str
    solve: Callable
    options: Mapping[str, object]
    rules: Mapping[str, Rule] = field(default_factory=dict)
    state: tuple[StateSlot, ...] = ()
    warm_starts: bool = False
    carries: Callable[[Mapping, GramManifold], bool] | None = None
    reports: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    optimizer_msign: bool = True
    summary: str = ""

    def rule(self, option: str) -> Rule:
        """The rule of ``option`` (``KeyError`` if it has none)."""
        return self.rules[option] if option in self.rules else OPTION_RULES[option]

    def keeps_state(self, options: Mapping, manifold: GramManifold) -> bool:
        """Whether the optimizer carries this solver's state under ``options`` (a group's ``solver_options``) for a
        matrix on ``manifold``."""
        if not (self.warm_starts and self.state):
            return False
        return self.carries is None or bool(self.carries({**self.options, **options}, manifold))

    def state_options(self) -> dict[str, StateSlot]:
        """``{slot.option: slot}``: the tensor options of `spectral_direction` that carry the state."""
        return {slot.option: slot for slot in self.state}


def option_rule(solver: Solver, name: str, value) -> str | None:
    """None where ``value`` is valid for the option ``name`` of ``solver`` (always for a state option), else what it
    must be (``"an integer >= 1"``)."""
    if name in solver.state_options():
        return None
    valid, must = solver.rule(name)
    return None if valid(value) else must
