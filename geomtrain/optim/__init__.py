"""Manifold Muon: the spectral steepest-descent direction on a Gram-space manifold (`spectral_direction`), its solver
registry and the optimizer (`ManifoldMuon`)."""

from .direction import DirectionStats, spectral_direction, tangent_residual
from .muon import SHAPE_SCALES, SKIP_REASONS, ManifoldMuon
from .registry import (
    REFERENCE_SOLVER,
    RETIRED_SOLVERS,
    SOLVER_OPTIONS,
    SOLVERS,
    TRAINING_DEFAULTS,
    check_solver_options,
    default_solver,
    describe_default,
    get_solver,
    register_solver,
    retired_note,
    solver_names,
    unregister_solver,
)
from .solver import Solver, StateSlot

__all__ = [
    "ManifoldMuon",
    "SHAPE_SCALES",
    "SKIP_REASONS",
    "spectral_direction",
    "DirectionStats",
    "tangent_residual",
    "SOLVERS",
    "SOLVER_OPTIONS",
    "REFERENCE_SOLVER",
    "TRAINING_DEFAULTS",
    "default_solver",
    "describe_default",
    "check_solver_options",
    "Solver",
    "StateSlot",
    "register_solver",
    "unregister_solver",
    "get_solver",
    "solver_names",
    "RETIRED_SOLVERS",
    "retired_note",
]
