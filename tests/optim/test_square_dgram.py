"""square_dgram.py: the square DGram solver."""

import torch
from optim_cases import seeded

from geomtrain.optim import spectral_direction
from manifolds import DGram


def test_anderson_option_caps_the_square_dgram_depth():
    # anderson=0 turns mixing off everywhere (before, square DGram kept its own depth whatever the option);
    # a depth above SQUARE_ANDERSON changes nothing
    W = DGram().random(2, 64, 64, generator=seeded(0))
    G = torch.randn(2, 64, 64, generator=seeded(1))
    counts = {a: spectral_direction(DGram(), W, G, anderson=a)[1].evaluations.tolist() for a in (0, 5, 10)}
    assert counts[5] == counts[10] and counts[0] != counts[5]
