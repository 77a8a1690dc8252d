"""Manifold Muon: the spectral steepest-descent direction on a Gram-space manifold and the optimizer.

- `spectral_direction(manifold, W, G, solver=...)`: the direction and its `DirectionStats`.
- `ManifoldMuon`: the `torch.optim.Optimizer`.

Modules: `direction` (entry point), `gram` (the Gram-space dual), `gram_newton` (the default
solver), `douglas_rachford` (degenerate duals), `baselines` (``tangent``, ``published``),
`numerics` (kernels), `muon` (the optimizer).
"""

from .direction import (
    DEFAULT_SOLVER,
    SOLVER_OPTIONS,
    SOLVERS,
    DirectionStats,
    check_solver_options,
    mask_kind,
    spectral_direction,
    tangent_residual,
)
from .muon import SHAPE_SCALES, SKIP_REASONS, ManifoldMuon

__all__ = [
    "ManifoldMuon",
    "SHAPE_SCALES",
    "SKIP_REASONS",
    "spectral_direction",
    "DirectionStats",
    "tangent_residual",
    "mask_kind",
    "SOLVERS",
    "SOLVER_OPTIONS",
    "DEFAULT_SOLVER",
    "check_solver_options",
]
