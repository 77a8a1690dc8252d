r"""How many coupled Newton-Schulz iterations replace the eigendecomposition of a Gram-space evaluation?

An evaluation of the default solver needs $R = (M + \tau^2 I)^{-1/2}$-like weights of the Gram matrix
$M = Y^\top Y$ at the multiplier $S$; it takes them from one eigendecomposition. On a GPU that
eigendecomposition costs as much as ~130 products at $n = 768$ (docs/manifold-muon.md, *On a GPU*),
so a products-only iteration could be cheaper there. This script counts the iterations of the coupled
Newton-Schulz iteration ($T = \tfrac12(3I - ZY)$, $Y \leftarrow YT$, $Z \leftarrow TZ$, from $Y = M/c$,
$Z = I$; three products each) until $\|Z/\sqrt c - R\|_{\mathrm{op}} \le 10^{-3}\|R\|_{\mathrm{op}}$ against
a float64 eigendecomposition, with $\tau = 10^{-3} n^{-1/2}$, at the tangent start $S_T$ of Stiefel
problems: Gaussian and `layernorm` gradients at 2304x768 (``--shape M N``) and a `mini` training
momentum (the test fixture, 384x128), in float32 and float64.

    OMP_NUM_THREADS=1 python lab/2026-12-04-inverse-sqrt-iterations/inverse_sqrt_iterations.py
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from geomtrain.bench.problems import synthetic_gradient
from geomtrain.optim.gram import GramDual
from manifolds import Stiefel

FIXTURE = "tests/fixtures/stiefel_momenta_384x128_steps30_31.npz"


def newton_schulz_iterations(M: torch.Tensor, tau2: float, dtype: torch.dtype, tol: float = 1e-3, cap: int = 200):
    """Iterations to ``tol`` (or ``cap``), the condition number of $M + \\tau^2 I$ and the final error."""
    n = M.shape[-1]
    A = (M + tau2 * torch.eye(n, dtype=M.dtype)).double()
    lam, V = torch.linalg.eigh(A)
    R = (V * lam.rsqrt()) @ V.T
    c = float(lam[-1]) * 1.0001  # the spectrum scaled into (0, 1]
    Y, Z = (A / c).to(dtype), torch.eye(n, dtype=dtype)
    three = 3 * torch.eye(n, dtype=dtype)
    err = float("inf")
    for k in range(1, cap + 1):
        T = 0.5 * (three - Z @ Y)
        Y, Z = Y @ T, T @ Z
        err = float(torch.linalg.matrix_norm(Z.double() / c**0.5 - R, ord=2) / torch.linalg.matrix_norm(R, ord=2))
        if err <= tol:
            return k, float(lam[-1] / lam[0]), err
    return cap, float(lam[-1] / lam[0]), err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape",
        type=int,
        nargs=2,
        default=[2304, 768],
        metavar=("M", "N"),
        help="of the Gaussian and layernorm problems (default 2304 768)",
    )
    args = parser.parse_args()
    m, n = args.shape
    if not m >= n >= 2:
        parser.error(f"need M >= N >= 2 (a tall Stiefel matrix), got {m} {n}")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    problems = []
    for spectrum in ("gaussian", "layernorm"):
        W = Stiefel().random(m, n, dtype=torch.float64, generator=gen)
        G = synthetic_gradient((m, n), spectrum, gen, torch.float64, "cpu")
        problems.append((f"{m}x{n} {spectrum}", W, G))
    data = np.load(FIXTURE)
    problems.append(("mini momentum 384x128", torch.tensor(data["W0"]).double(), torch.tensor(data["G0"]).double()))
    print("problem                  dtype    kappa     iterations  products  error")
    for name, W, G in problems:
        dual = GramDual(Stiefel(), W[None], (G / G.norm())[None], torch.float64, 1e-3)
        M = dual.gram(dual.tangent_start())[0][0]
        tau2 = 1e-6 / M.shape[-1]
        for dtype in (torch.float32, torch.float64):
            k, kappa, err = newton_schulz_iterations(M, tau2, dtype)
            print(f"{name:<24} {str(dtype)[6:]:<8} {kappa:<9.1e} {k:>10d}  {3 * k:>8d}  {err:.1e}")


if __name__ == "__main__":
    main()
