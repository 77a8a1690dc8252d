"""A whole `ManifoldMuon` step with a products-only solver dispatches no matrix decomposition: neither the
direction (`projected_tangent`, `split_tangent`) nor the retraction (Stiefel's and DGram's products-only paths near the
manifold); the exact solver's step does (the counter sees them). Training's default (no solver named) is
products-only on Stiefel and DGram matrices: its step dispatches none either."""

from __future__ import annotations

import pytest
import torch
from products_checks import FORBIDDEN, count_operators

from geomtrain.optim import ManifoldMuon
from manifolds import DGram, Stiefel


def _decompositions_of_a_step(solver: str | None, kinds=(Stiefel, DGram)) -> tuple[dict, int]:
    gen = torch.Generator().manual_seed(0)
    groups, params = [], []
    for manifold in (kind() for kind in kinds):  # model-like shapes, tall and wide (mini's 512x128 and 128x384)
        ps = [torch.nn.Parameter(manifold.random(*s, generator=gen)) for s in ((512, 128), (128, 384))]
        groups.append({"params": ps, "manifold": manifold})
        params += ps
    opt = ManifoldMuon(groups, solver=solver)
    for step in range(3):  # the third step is counted: momentum and warm state as in training
        for p in params:
            p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
        if step < 2:
            opt.step()
    with count_operators() as counts:
        opt.step()
    fallbacks = sum(getattr(g["manifold"], "polar_fallbacks", 0) for g in groups)
    return {k: v for k, v in counts.items() if k in FORBIDDEN}, fallbacks


@pytest.mark.slow  # about 1.3 s: three steps of four model-sized matrices
@pytest.mark.parametrize("solver", ["tangent", "filled_split"])
def test_a_products_only_step_calls_no_decomposition(solver):
    decompositions, fallbacks = _decompositions_of_a_step(solver)
    assert decompositions == {} and fallbacks == 0, (decompositions, fallbacks)


def test_the_default_step_calls_no_decomposition():
    decompositions, fallbacks = _decompositions_of_a_step(None)
    assert decompositions == {} and fallbacks == 0, (decompositions, fallbacks)


def test_the_counter_sees_the_exact_solvers_decompositions():
    decompositions, _ = _decompositions_of_a_step("exact")
    assert sum(decompositions.values()) > 0
