"""douglas_rachford.py: the near-square DGram fallback."""

import pytest
import torch
from optim_cases import seeded

from geomtrain.optim import spectral_direction
from manifolds import DGram


@pytest.mark.parametrize("shape", [(48, 32), (96, 64)])
def test_near_square_dgram_warm_started_from_its_own_state_converges(shape):
    # Near-square DGram goes to the Douglas-Rachford fallback, started from the warm multiplier. Near that
    # degenerate optimum R has eigenvalues up to 1/tau; before the start's condition number was capped
    # (douglas_rachford.start_weights) the float32 iteration floored at a residual of about 2.5e-4 and ran to
    # max_iter (52 evaluations, polished, certified gaps 4e-3 to 9e-3) where a cold solve took 18-30.
    W = DGram().random(4, *shape, generator=seeded(0), dtype=torch.float32)
    G = torch.randn(4, *shape, generator=seeded(1))
    _, cold = spectral_direction(DGram(), W, G)
    assert bool(cold.converged.all()) and not bool(cold.escalated.any())
    for G2 in (G, G + 1e-3 * torch.randn(4, *shape, generator=seeded(2))):  # the same and an almost unchanged problem
        _, warm = spectral_direction(DGram(), W, G2, dual=cold.dual, escalate=cold.escalated)
        assert bool(warm.converged.all()) and float(warm.residual.max()) <= 1e-4
        assert int(warm.evaluations.sum()) <= int(cold.evaluations.sum())
