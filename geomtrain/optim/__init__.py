"""Manifold Muon: the spectral steepest-descent direction on a Gram-space manifold and the optimizer.

- `spectral_direction(manifold, W, G, solver=...)`: the direction and its `DirectionStats`.
- `ManifoldMuon`: the `torch.optim.Optimizer`.
- `register_solver(Solver(...))`, `get_solver(name)`, `solver_names()`: the solver registry;
  `default_solver(manifold)`: the one training uses when none is named.

Modules: `direction` (entry point), `solver` (the `Solver` record), `registry` (the registry),
`gram` (the Gram-space dual), `gram_newton` (the ``exact`` solver, the reference),
`filled_split` (training's default: products only), `column_split` (its split of a tall matrix),
`products` (its kernels), `douglas_rachford` (degenerate duals), `baselines` (``tangent``, ``published``),
`numerics` (kernels), `muon` (the optimizer; `muon_step` its pieces, `muon_dist` the DDP exchange,
`muon_fsdp` the FSDP2 one).
"""

from .direction import (
    REFERENCE_SOLVER,
    SOLVER_OPTIONS,
    SOLVERS,
    TRAINING_DEFAULTS,
    DirectionStats,
    check_solver_options,
    default_solver,
    describe_default,
    get_solver,
    register_solver,
    solver_names,
    spectral_direction,
    tangent_residual,
)
from .muon import SHAPE_SCALES, SKIP_REASONS, ManifoldMuon
from .registry import RETIRED_SOLVERS, retired_note, unregister_solver
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
