"""Per-matrix time of the products-only solvers vs the exact solver and plain Muon (msign only), side by side
in one process, fp32, at GPT-2 shapes (tall form 768x768 and 3072x768), with the ratio <G, A>/OPT.

Run: OMP_NUM_THREADS=1 taskset -c 0,1 .venv/bin/python lab/2026-12-05-products-only/products_only.py [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from geomtrain.optim import spectral_direction
from manifolds import DGram, Stiefel, msign

SOLVERS = ("exact", "projected_tangent", "dual_ascent", "admm")


def problem(manifold, m, n, seed):
    g = torch.Generator().manual_seed(seed)
    W = manifold.random(m, n, dtype=torch.float64, generator=g).float()
    G = (torch.randn(m, n, dtype=torch.float64, generator=g) * torch.logspace(0, -2, n, dtype=torch.float64)).float()
    return W, G


def timed(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| manifold | shape (tall) | solver | ms per matrix | x plain Muon | <G,A>/OPT |")
    print("|---|---|---|---|---|---|")
    for manifold in (Stiefel(), DGram()):
        for m, n in ((768, 768), (3072, 768)):
            W, G = problem(manifold, m, n, seed=m)
            base, _ = timed(lambda G=G: msign(G, "polar_express", steps=5), args.repeats)
            A64, st = spectral_direction(manifold, W.double(), G.double(), solver="exact", tol=1e-8, max_iter=100)
            Gn = G.double() / G.double().norm()
            opt = float((Gn * A64).sum())
            print(f"| {manifold.name} | {m}x{n} | plain Muon (msign) | {1e3 * base:.0f} | 1.00 | - |")
            for solver in SOLVERS:
                call = lambda s=solver, M=manifold, W=W, G=G: spectral_direction(M, W, G, solver=s)  # noqa: E731
                sec, (A, _) = timed(call, args.repeats)
                ratio = float((Gn * A.double()).sum()) / opt
                print(f"| {manifold.name} | {m}x{n} | {solver} | {1e3 * sec:.0f} | {sec / base:.2f} | {ratio:.4f} |")
            gap = float(st.dual_gap)
            print(f"<!-- {manifold.name} {m}x{n}: float64 exact OPT {opt:.6f}, certified gap {gap:.1e} -->")


if __name__ == "__main__":
    main()
