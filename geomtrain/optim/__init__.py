"""Manifold Muon: the spectral steepest-descent direction on a Gram-space manifold and the optimizer.

- `spectral_direction(manifold, W, G, solver=...)`: the direction and its statistics.
- `ManifoldMuon`: the `torch.optim.Optimizer`.
"""
from .direction import DEFAULT_SOLVER, SOLVER_OPTIONS, SOLVERS, mask_kind, spectral_direction, tangent_residual
from .muon import SHAPE_SCALES, ManifoldMuon

__all__ = ["ManifoldMuon", "SHAPE_SCALES", "spectral_direction", "tangent_residual", "mask_kind", "SOLVERS", "SOLVER_OPTIONS", "DEFAULT_SOLVER"]
