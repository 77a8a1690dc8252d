r"""The solver registry: one place that turns a name (``"exact"``, ``"tangent"``) into a `Solver`. The built-in
solvers are listed in ``_BUILTINS``, training's default is per mask (`default_solver`), and retired solvers and options
(`RETIRED_SOLVERS`, `RETIRED_OPTIONS`) are refused with the commit that still runs them.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

from manifolds import GramManifold, MaskForm

from .solver import OPTION_RULES, Solver, option_rule

__all__ = [
    "register_solver",
    "unregister_solver",
    "get_solver",
    "solver_names",
    "check_solver_options",
    "solver_option_rule",
    "SOLVERS",
    "SOLVER_OPTIONS",
    "REFERENCE_SOLVER",
    "TRAINING_DEFAULTS",
    "default_solver",
    "describe_default",
    "RETIRED_SOLVERS",
    "RETIRED_OPTIONS",
    "retired_note",
]

REFERENCE_SOLVER = "exact"  # `spectral_direction`'s default, and training's where TRAINING_DEFAULTS names none
TRAINING_DEFAULTS: Mapping[MaskForm, str] = MappingProxyType(  # per mask (why: docs/manifold-muon.md)
    {MaskForm.FULL: "filled_split", MaskForm.OFF_DIAGONAL: "filled_split", MaskForm.CUSTOM: "filled_split"}
)
_NAME = re.compile(r"[a-z0-9_\-]+")
_SOLVERS: dict[str, Solver] = {}
_ALIASES: dict[str, str] = {}


def solver_names() -> tuple[str, ...]:
    """The registered names (not the aliases), in registration order."""
    return tuple(_SOLVERS)


def default_solver(manifold: GramManifold) -> str:
    """The solver training uses on ``manifold`` when none is named: `TRAINING_DEFAULTS`, else `REFERENCE_SOLVER`."""
    return TRAINING_DEFAULTS.get(manifold.mask_form, REFERENCE_SOLVER)


def describe_default() -> str:
    """Training's default in words, for messages: ``"filled_split on Stiefel matrices, ..., exact on the others"``."""
    picks = [f"{solver} on {form.label} matrices" for form, solver in TRAINING_DEFAULTS.items()]
    return ", ".join([*picks, f"{REFERENCE_SOLVER} on the others"])


def _unknown(name: object) -> str:
    close = difflib.get_close_matches(str(name), [*_SOLVERS, *_ALIASES], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown solver {name!r}{hint}; valid: {', '.join(_SOLVERS)}{retired_note(str(name))}"


def get_solver(name: str | Solver) -> Solver:
    """The `Solver` registered under ``name`` or an alias (a `Solver` as it is); else a one-line ``ValueError``."""
    if isinstance(name, Solver):
        return name
    key = _ALIASES.get(name, name) if isinstance(name, str) else None
    if key not in _SOLVERS:
        raise ValueError(_unknown(name))
    return _SOLVERS[key]


def register_solver(solver: Solver, *, overwrite: bool = False) -> Solver:
    """Register ``solver`` under its name and aliases (checked: well formed, free unless ``overwrite``, every option
    with a rule, none a state slot); returns it."""
    if not isinstance(solver, Solver):
        raise TypeError(f"register_solver takes a geomtrain.optim.solver.Solver; got {type(solver).__name__}")
    for name in (solver.name, *solver.aliases):
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"bad solver name {name!r}: use lower-case letters, digits, '_' or '-'")
        taken = _ALIASES.get(name, name if name in _SOLVERS else None)
        if taken is not None and taken != solver.name and not overwrite:
            raise ValueError(f"solver name {name!r} is taken (by {taken!r}); pass overwrite=True to replace it")
    if solver.name in _SOLVERS and not overwrite:
        raise ValueError(f"solver {solver.name!r} is already registered; pass overwrite=True to replace it")
    clash = sorted(set(solver.options) & set(solver.state_options()))
    if clash:
        raise ValueError(
            f"solver {solver.name!r}: {', '.join(clash)} is both an option and a warm-start state slot; "
            "a state slot is passed back by spectral_direction, never given as an option"
        )
    missing = [k for k in solver.options if k not in solver.rules and k not in OPTION_RULES]
    if missing:
        raise ValueError(f"solver {solver.name!r}: option(s) {', '.join(missing)} need a rule in Solver.rules")
    if not callable(solver.solve):
        raise TypeError(f"solver {solver.name!r}: solve must be callable")
    _SOLVERS[solver.name] = solver
    for alias in solver.aliases:
        _ALIASES[alias] = solver.name
    return solver


def unregister_solver(name: str) -> None:
    """Remove a registered solver and its aliases (``ValueError`` naming the valid ones if unknown)."""
    solver = get_solver(name)
    del _SOLVERS[solver.name]
    for alias in solver.aliases:
        _ALIASES.pop(alias, None)


def check_solver_options(solver: str | Solver, options: Mapping) -> None:
    """A one-line ``ValueError`` for an unknown solver or option, or a value out of range, naming the valid ones."""
    spec = get_solver(solver)
    valid = [*spec.options, *spec.state_options()]
    unknown = set(options) - set(valid)
    if unknown:
        retired = next((note for k in sorted(unknown) if (note := retired_note(f"{spec.name}.{k}"))), "")
        raise ValueError(
            f"unknown option(s) {', '.join(sorted(unknown))} for solver {spec.name!r}; valid: {', '.join(valid)}"
            f"{retired}"
        )
    for name, value in options.items():
        must = option_rule(spec, name, value)
        if must is not None:
            raise ValueError(f"bad solver option {name}={value!r} for solver {spec.name!r}: must be {must}")


def solver_option_rule(name: str, value, solver: str | Solver = REFERENCE_SOLVER) -> str | None:
    """None where ``value`` is valid for the scalar option ``name`` of ``solver``, else what it must be."""
    return option_rule(get_solver(solver), name, value)


class _Names(Sequence):
    """`SOLVERS`: the registered names, live; ``in`` also accepts an alias (``"gram_newton" in SOLVERS``)."""

    def __getitem__(self, i):
        return solver_names()[i]

    def __len__(self) -> int:
        return len(_SOLVERS)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _ALIASES.get(name, name) in _SOLVERS

    def __iter__(self) -> Iterator[str]:
        return iter(solver_names())

    def __repr__(self) -> str:
        return repr(solver_names())


class _Options(Mapping):
    """`SOLVER_OPTIONS`: name (or alias) -> every option with its default."""

    def __getitem__(self, name: str) -> dict:
        try:
            spec = get_solver(name)
        except ValueError:
            raise KeyError(name) from None
        return dict(spec.options)

    def __iter__(self) -> Iterator[str]:
        return iter(solver_names())

    def __len__(self) -> int:
        return len(_SOLVERS)


SOLVERS: Sequence[str] = _Names()
SOLVER_OPTIONS: Mapping[str, dict] = _Options()

# (module of geomtrain.optim, name of its Solver): a built-in solver is one line here
_BUILTINS = (
    ("gram_newton", "SOLVER"),
    ("baselines", "TANGENT"),
    ("baselines", "PUBLISHED"),
    ("filled_split", "SOLVER"),
)
# Solvers and options the product no longer has, and the last commit that registered them (named when refused)
RETIRED_AT = "64b2e8a"
RETIRED_SOLVERS = ("split_tangent", "projected_tangent", "dual_ascent", "admm")
RETIRED_OPTIONS = {"filled_split": ("square", "refine", "rounds", "sub_steps", "carry_step")}


def retired_note(what: str) -> str:
    """``" (... retired ...)"`` for a retired solver name or ``"solver.option"``, else ``""``."""
    solver, _, option = what.partition(".")
    if (not option and solver in RETIRED_SOLVERS) or option in RETIRED_OPTIONS.get(solver, ()):
        return (
            f"; {what} was retired from the product: run what names it from a checkout of {RETIRED_AT} "
            f"(git worktree add ../geomtrain-{RETIRED_AT} {RETIRED_AT})"
        )
    return ""


def _register_builtins() -> None:
    for module, attribute in _BUILTINS:
        register_solver(getattr(importlib.import_module(f"{__package__}.{module}"), attribute))


_register_builtins()
