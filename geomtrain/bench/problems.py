r"""The synthetic problems of ``geomtrain bench optimizer``: its weights, its gradients and its reference.

- `benchmark_point`: a weight on the manifold, ``random`` or GPT-2's initialisation (`POINTS`);
- `synthetic_gradient`: a gradient of entries of RMS 1 with one of the spectra of `SPECTRA`;
- `custom_mask_twin`: a manifold's twin that the solver treats as a user-defined mask;
- `BlockMask`: a manifold defined by its mask alone, as a user writes one (columns orthogonal across blocks);
- `reference_solve`: the float64 optimum of a problem and the relative objective gap
  $(\mathrm{OPT} - \langle G, A\rangle)/\mathrm{OPT}$ of candidate directions against it.

The tests of the solver draw their problems from here too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from manifolds import GramManifold

if TYPE_CHECKING:
    from ..optim import DirectionStats

__all__ = [
    "SPECTRA",
    "POINTS",
    "INIT_STD",
    "INIT_LAYERS",
    "benchmark_point",
    "synthetic_gradient",
    "custom_mask_twin",
    "BlockMask",
    "reference_solve",
]

SPECTRA = ("gaussian", "powerlaw", "layernorm")  # of the benchmark gradients: see synthetic_gradient
POINTS = ("random", "init")  # of the benchmark weights: see benchmark_point
# GPT-2's initialisation (geomtrain.model.GPT.reset_parameters) at GPT-2 small's depth, 12 layers
INIT_STD, INIT_LAYERS = 0.02, 12


def benchmark_point(manifold, name: str, shape, points: str, gen: torch.Generator) -> torch.Tensor:
    r"""A benchmark weight of ``shape`` on ``manifold`` (float32, CPU): ``manifold.random`` for
    ``"random"``; for ``"init"``, GPT-2's initial weight projected onto the manifold (``projx``, as
    training starts): $\mathcal N(0, 0.02^2)$ entries, $0.02/\sqrt{2\cdot 12}$ for a matrix named
    ``*c_proj`` (the residual-stream projections)."""
    if points == "random":
        return manifold.random(*shape, dtype=torch.float32, generator=gen)
    if points != "init":
        raise ValueError(f"unknown points {points!r}; valid: {', '.join(POINTS)}")
    std = INIT_STD / math.sqrt(2 * INIT_LAYERS) if name.endswith("c_proj") else INIT_STD
    return manifold.projx(std * torch.randn(*shape, generator=gen, dtype=torch.float32))


def synthetic_gradient(shape, spectrum: str, gen: torch.Generator, dtype, device) -> torch.Tensor:
    """A benchmark gradient of ``shape`` (entries of RMS 1) with the ``spectrum`` of `SPECTRA`."""
    m, n = shape
    if spectrum == "gaussian":
        G = torch.randn(m, n, generator=gen, dtype=dtype)
    else:  # "powerlaw": singular values k^(-1/2) over orthonormal factors, plus a small isotropic floor
        k = min(m, n)
        U = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))[0]
        V = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))[0]
        s = torch.arange(1, k + 1, dtype=torch.float64) ** -0.5
        G = ((U * s) @ V.T).to(dtype)
        G = G / G.norm() * math.sqrt(m * n) + 0.01 * torch.randn(m, n, generator=gen, dtype=dtype)
    if spectrum == "layernorm":
        # The null direction LayerNorm gives a transformer's gradients, on the small side: G 1 = 0 for a
        # matrix that reads a LayerNorm output (tall c_attn, c_fc), 1^T G = 0 for one that writes into the
        # residual stream (wide mlp.c_proj, square attn.c_proj). See docs/manifold-muon.md.
        G = G - G.mean(dim=1 if m > n else 0, keepdim=True)
    return (G / G.pow(2).mean().sqrt()).to(device)  # entries of RMS 1 before scaling


def custom_mask_twin(manifold):
    """An instance of a subclass of ``type(manifold)`` whose ``project_gram`` is its own (returning the
    parent's): the same geometry, but its `manifolds.GramManifold.mask_form` is ``CUSTOM``, so the direction
    solver uses the code path of a user-defined mask. The manifold must take no constructor arguments."""
    base = type(manifold)

    class CustomMask(base):
        def project_gram(self, M: torch.Tensor) -> torch.Tensor:
            return base.project_gram(self, M)

    CustomMask.__name__ = CustomMask.__qualname__ = f"Custom{base.__name__}"
    return CustomMask()


class BlockMask(GramManifold):
    """Columns orthogonal across consecutive blocks of ``block_size``, free inside a block: written as a user writes
    a manifold, `project_gram` only (docs/custom-manifold.md's ``BlockGram``), so every map takes the generic path
    and its `mask_form` is ``CUSTOM``."""

    name = "BlockMask"

    def __init__(self, block_size: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.block_size = block_size

    def project_gram(self, M: torch.Tensor) -> torch.Tensor:
        block = torch.arange(M.shape[-1], device=M.device) // self.block_size
        return M * (block[:, None] != block[None, :]).to(M.dtype)


def reference_solve(
    manifold, W: torch.Tensor, G: torch.Tensor, directions=(), *, tol: float, max_iter: int, smoothing: float
) -> tuple[torch.Tensor, DirectionStats, list[torch.Tensor]]:
    r"""The float64 reference solve of the direction problem at ``(W, G)`` (batches too) and the
    relative objective gap $(\mathrm{OPT} - \langle G, A\rangle)/\mathrm{OPT}$ of each ``A`` in
    ``directions`` against it (the scale of $G$ cancels; negative when an infeasible $A$ overshoots).

    ``tol``, ``max_iter`` and ``smoothing`` are the default solver's options: the caller's accuracy.
    Returns ``(reference, stats, gaps)``: the float64 direction, its `DirectionStats` and, per
    direction, a float64 tensor of the batch shape."""
    from ..optim import spectral_direction

    W, G = W.double(), G.double()
    ref, stats = spectral_direction(manifold, W, G, tol=tol, max_iter=max_iter, smoothing=smoothing)
    opt = (ref * G).sum(dim=(-2, -1))
    return ref, stats, [(opt - (A.double() * G).sum(dim=(-2, -1))) / opt for A in directions]
