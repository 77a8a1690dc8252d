"""DGram's retraction near the manifold by matrix products (Newton-Schulz on the normalised columns), with an
exact fallback far from it that is counted."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from manifolds import DGram, msign

DECOMPOSITIONS = {"linalg_svd", "_linalg_svd", "linalg_eigh", "_linalg_eigh", "linalg_qr", "linalg_solve"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step(m=256, n=64, lr=0.02, seed=0, dtype=torch.float32):
    """A DGram point and a Manifold Muon step: lr times a tangent direction of spectral norm 1."""
    g = torch.Generator().manual_seed(seed)
    M = DGram()
    W = M.random(m, n, dtype=torch.float64, generator=g)
    U = M.proju(W, torch.randn(m, n, dtype=torch.float64, generator=g))
    U = U / torch.linalg.matrix_norm(U, ord=2)
    return W.to(dtype), (lr * U).to(dtype)


def _old_projx(X):
    """The exact form: Q diag(diag(Q^T X)), Q = msign(X) by SVD."""
    Q = msign(X.double(), "svd")
    return Q * (Q * X.double()).sum(dim=-2, keepdim=True)


def test_retraction_step_uses_products_only_and_lands_on_dgram():
    W, step = _step()
    M = DGram()
    with _Ops() as ops:
        R = M.retr(W, step)
    assert not set(ops.counts) & DECOMPOSITIONS, ops.counts  # the old projx called linalg_svd here
    assert M.polar_fallbacks == 0
    # float32 rounding of a 256-long Gram entry ~ 16 * 6e-8 = 1e-6 relative; the manifold check's own atol
    assert M.check_point_on_manifold(R, atol=1e-5)
    # both forms are first-order retractions: they differ by O(lr^2) = 4e-4 here, not O(lr)
    assert float((R.double() - _old_projx(W + step)).abs().max()) < 4e-3


def test_far_input_falls_back_to_the_exact_form_and_is_counted():
    X = torch.randn(40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    M = DGram()
    batch = torch.stack([X, _step(40, 8, seed=3, dtype=torch.float64)[0]])
    Y = M.projx(batch)
    assert M.polar_fallbacks == 1  # the Gaussian, not the point of DGram
    assert torch.allclose(Y[0], _old_projx(X), atol=1e-12)
    assert torch.allclose(Y[1], batch[1], atol=1e-12)  # a point of DGram is kept


def test_products_retraction_is_first_order():
    W, U = _step(64, 16, lr=1.0, seed=4, dtype=torch.float64)
    errors = [float((DGram().retr(W, t * U) - (W + t * U)).norm()) for t in (1e-2, 1e-3)]
    assert errors[1] < errors[0] / 50  # O(t^2): a tenth of t gives a hundredth of the error
