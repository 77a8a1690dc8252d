"""How the square DGram direction problem gets harder as the column norms of W become equal.

For W = Q diag(s) (Q a random orthogonal matrix) with s_i = 1 + spread * u_i (u_i uniform in [-1, 1]),
and a Gaussian gradient, solves the direction problem with the default solver (float32, the
defaults of `spectral_direction`) and prints, per spread: evaluations, whether it converged (else
max_iter was reached and the direction polished), the certified gap, the time against plain Muon
(one 5-step Polar Express msign in float32) and how many singular values of the direction are 1
(to 1e-3) or within 5% below 1. The problem is invariant to scaling s: only the spread matters
(docs/manifold-muon.md, "Square DGram near equal column norms"). With ``--reference``, also the
true relative gap of each direction against a float64 reference solve (tol 1e-10, at most 4,000
iterations, smoothing 1e-6; slow where the spread is small but not zero). ``--rows M`` takes a tall
M x n point instead (Q with orthonormal columns), ``--spectrum`` another benchmark gradient
(`geomtrain.bench.problems.synthetic_gradient`).

    OMP_NUM_THREADS=1 python lab/2026-12-04-square-dgram-spread/square_dgram_spread.py --n 256
    OMP_NUM_THREADS=1 python lab/2026-12-04-square-dgram-spread/square_dgram_spread.py --n 128 --reference
    OMP_NUM_THREADS=1 python lab/2026-12-04-square-dgram-spread/square_dgram_spread.py --n 128 --rows 512 \\
        --spectrum layernorm --seed 1
"""

from __future__ import annotations

import argparse
import time

import torch

from geomtrain.bench.problems import SPECTRA, reference_solve, synthetic_gradient
from geomtrain.config import positive_int
from geomtrain.optim import spectral_direction
from manifolds import DGram, msign


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=positive_int, default=256, help="matrix size n (W is n x n; default 256)")
    parser.add_argument("--rows", type=int, default=None, help="m >= n rows: a tall m x n point (default n)")
    parser.add_argument("--spectrum", default="gaussian", choices=SPECTRA, help="the gradient's (default gaussian)")
    parser.add_argument("--spreads", type=float, nargs="+", default=[0.0, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 0.9])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--reference", action="store_true", help="true gaps against a float64 reference solve")
    args = parser.parse_args()
    m = args.n if args.rows is None else args.rows
    if args.n < 2 or m < args.n or not all(0 <= s < 1 for s in args.spreads):
        parser.error("need --n >= 2, --rows >= --n and every spread in [0, 1)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    n = args.n
    Q = torch.linalg.qr(torch.randn(m, n, generator=gen, dtype=torch.float64))[0].float()
    u = 2 * torch.rand(n, generator=gen) - 1
    if args.spectrum == "gaussian":  # drawn as before the option existed: the docs' tables stay reproducible
        G = torch.randn(m, n, generator=gen)
    else:
        G = synthetic_gradient((m, n), args.spectrum, gen, torch.float32, "cpu")
    msign(G, "polar_express", steps=5)  # warm-up
    start = time.perf_counter()
    msign(G, "polar_express", steps=5)
    muon = time.perf_counter() - start
    shape = f"n = {n}" if m == n else f"{m} x {n}"
    print(
        f"{shape}, seed {args.seed}, plain Muon {muon * 1e3:.1f} ms"
        + ("" if args.spectrum == "gaussian" else f", {args.spectrum} gradient")
    )
    head = "spread   evaluations  converged  certified gap  x muon  sv = 1  sv in [0.95, 1)"
    print(head + ("  true gap" if args.reference else ""))
    for spread in args.spreads:
        W = Q * (1 + spread * u)
        start = time.perf_counter()
        A, st = spectral_direction(DGram(), W, G)
        seconds = time.perf_counter() - start
        sv = torch.linalg.svdvals(A.double())
        unit, near = int((sv >= 1 - 1e-3).sum()), int(((sv >= 0.95) & (sv < 1 - 1e-3)).sum())
        true = ""
        if args.reference:
            _, _, (gap,) = reference_solve(DGram(), W, G, [A], tol=1e-10, max_iter=4000, smoothing=1e-6)
            true = f"  {float(gap):>8.1e}"
        print(
            f"{spread:<8g} {int(st.evaluations):>11d}  {str(bool(st.converged)):>9}  {float(st.dual_gap):>13.1e}  "
            f"{seconds / muon:>6.1f}  {unit:>6d}  {near:>15d}{true}"
        )


if __name__ == "__main__":
    main()
