"""Shared checks of the products-only directions (filled_split and its kernels): not collected (no test_)."""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from geomtrain.optim import spectral_direction
from manifolds import DGram, Oblique, Stiefel

MANIFOLDS = {"stiefel": Stiefel, "dgram": DGram, "oblique": Oblique}
SHAPES = ((96, 32), (64, 64), (40, 24))
# Decompositions a products-only solve must not call (aten names, overload packets).
FORBIDDEN = (
    "linalg_eigh",
    "_linalg_eigh",
    "linalg_svd",
    "_linalg_svd",
    "linalg_qr",
    "linalg_solve",
    "_linalg_solve_ex",
    "linalg_cholesky_ex",
    "cholesky",
    "linalg_eig",
    "linalg_inv_ex",
    "linalg_lu_factor_ex",
    "linalg_lstsq",
)


class OperatorCounter(TorchDispatchMode):
    """Counts every aten operator (by overload-packet name) dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_operators():
    mode = OperatorCounter()
    with mode:
        yield mode.counts


def problem(kind: str, m: int, n: int, seed: int, dtype=torch.float32):
    """A point of the manifold and a gradient with log-spread singular values (1 to 1e-2: a hard case)."""
    g = torch.Generator().manual_seed(seed)
    W = MANIFOLDS[kind]().random(m, n, dtype=torch.float64, generator=g)
    G = torch.randn(m, n, dtype=torch.float64, generator=g) * torch.logspace(0, -2, n, dtype=torch.float64)
    return W.to(dtype), G.to(dtype)


def exact_optimum(kind: str, W: torch.Tensor, G: torch.Tensor) -> tuple[float, float]:
    """``(OPT, certified relative gap)`` of the float64 exact solve, for G normalised to ||G||_F = 1."""
    W64, G64 = W.double(), G.double()
    A, stats = spectral_direction(MANIFOLDS[kind](), W64, G64, solver="gram_newton", tol=1e-10, max_iter=200)
    return float((G64 / G64.norm() * A).sum()), float(stats.dual_gap)


def feasibility(kind: str, W: torch.Tensor, A: torch.Tensor) -> tuple[float, float]:
    """``(max |L_W(A)| / max column norm, ||A||_op)``, both in float64."""
    W64, A64 = W.double(), A.double()
    L = MANIFOLDS[kind]().tangent_constraint(W64, A64)
    return float(L.abs().max() / W64.norm(dim=-2).max()), float(torch.linalg.matrix_norm(A64, ord=2))


def objective_ratio(G: torch.Tensor, A: torch.Tensor, opt: float) -> float:
    G64 = G.double()
    return float((G64 / G64.norm() * A.double()).sum()) / opt
