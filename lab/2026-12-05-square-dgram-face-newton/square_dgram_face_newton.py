"""Square DGram: Douglas-Rachford alone against Douglas-Rachford then Newton on its fixed point.

The square DGram direction problem (`geomtrain.optim.square_dgram`) in the frame $W = Q\\,\\mathrm{diag}(s)$,
solved in float64 without Anderson mixing, from the library's cold start, two ways, to a tangent
residual RMS of ``--tol``:

- Douglas-Rachford alone: $x = \\Pi_T(z + K/\\rho)$, $y = \\Pi_{\\mathrm{ball}}(2x - z)$,
  $z \\leftarrow z + 1.5\\,(y - x)$, one eigendecomposition per iteration;
- $k_0$ of those iterations, then Newton steps on the fixed-point residual $\\Phi(z) = y - x$: GMRES
  (relative tolerance ``--gmres-rtol``, default 1e-2; at most 40 products) on the generalised Jacobian
  $v \\mapsto D\\Pi_{\\mathrm{ball}}[2\\Pi_T v - v] - \\Pi_T v$, where the derivative of the clipping
  $U\\min(\\Sigma, 1)V^\\top$ at $2x - z = U\\Sigma V^\\top$ is $U\\tilde E V^\\top$ with $E = U^\\top\\,dF\\,V$,
  $\\tilde E = g^-\\circ\\operatorname{sym}E + g^+\\circ\\operatorname{skew}E$ (divided differences
  $g^\\mp_{ij} = (g_i \\mp g_j)/(\\sigma_i \\mp \\sigma_j)$ of $g = \\min(\\sigma, 1)$; four products, no
  eigendecomposition), and a step halved until $\\|\\Phi\\|_F$ falls (each try one eigendecomposition).

``--warm``: the next step's problem instead, every method started from the state of this one
(solved to ``--tol`` / 10), the way the optimizer warm-starts. Prints one row per method:
eigendecompositions, Jacobian products, the final residual and the seconds. A prototype for
lab/2026-12-05-square-dgram-face-newton (square DGram), not a solver of the library.

    OMP_NUM_THREADS=1 python lab/2026-12-05-square-dgram-face-newton/square_dgram_face_newton.py --n 128 --k0 2 4 8
    OMP_NUM_THREADS=1 python lab/2026-12-05-square-dgram-face-newton/square_dgram_face_newton.py --n 768 --k0 4
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator, gmres

from geomtrain.bench.problems import SPECTRA, benchmark_point, synthetic_gradient
from geomtrain.config import positive_int
from geomtrain.optim.square_dgram import SQUARE_RELAX, SquareFrame
from manifolds import DGram

GMRES_PRODUCTS = 40  # GMRES's restart length: at most this many Jacobian products per Newton step
MAX_HALVINGS = 6
WARM_STEP, WARM_BLEND = 0.02, 0.05  # `bench optimizer`'s simulated next step (docs/manifold-muon.md, Benchmark)


class FixedPointMap:
    """$\\Phi(z) = y - x$ of Douglas-Rachford on one square problem, counting eigendecompositions."""

    def __init__(self, frame: SquareFrame):
        self.fr, self.rho, self.eighs = frame, frame.n**-0.5, 0

    def __call__(self, z: torch.Tensor):
        """``(Phi, y, (U, sigma, V))`` at ``z``: the singular triple of $2x - z$ from one eigendecomposition."""
        x = self.fr.proj_tangent(z + self.fr.K / self.rho)
        F = 2 * x - z
        lam, V = torch.linalg.eigh(F.mT @ F)
        self.eighs += 1
        sigma = lam.clamp_min(0).sqrt()
        U = F @ V / sigma.clamp_min(torch.finfo(F.dtype).tiny)
        y = (U * sigma.clamp(max=1.0)) @ V.mT
        return y - x, y, (U, sigma, V)

    def jacobian(self, svd):
        """$v \\mapsto D\\Phi(z)[v]$ (module docstring) at the singular triple ``svd`` of $2x - z$."""
        U, sigma, V = svd
        g, inside = sigma.clamp(max=1.0), (sigma < 1).to(sigma.dtype)
        diff = sigma[:, None] - sigma[None, :]
        close = diff.abs() <= 1e-12 * sigma.amax()
        g_minus = torch.where(close, inside[:, None].expand_as(diff), (g[:, None] - g[None, :]) / diff.where(~close, 1))
        g_plus = (g[:, None] + g[None, :]) / (sigma[:, None] + sigma[None, :]).clamp_min(torch.finfo(sigma.dtype).tiny)

        def apply(v: torch.Tensor) -> torch.Tensor:
            dx = self.fr.proj_tangent(v)
            E = U.mT @ (2 * dx - v) @ V
            Et = g_minus * (E + E.mT) / 2 + g_plus * (E - E.mT) / 2
            Et.diagonal().copy_(inside * E.diagonal())
            return U @ Et @ V.mT - dx

        return apply


def douglas_rachford(phi: FixedPointMap, z: torch.Tensor, iters: int, tol: float):
    """Plain over-relaxed iterations until the residual of $y$ is at most ``tol``; returns ``(z, residual)``."""
    res = float("inf")
    for _ in range(iters):
        F, y, _ = phi(z)
        res = float(phi.fr.residual(y))
        if res <= tol:
            break
        z = z + SQUARE_RELAX * F
    return z, res


def newton(phi: FixedPointMap, z: torch.Tensor, tol: float, rtol: float, steps: int = 20):
    """Newton-GMRES on $\\Phi(z) = 0$ with step halving; returns ``(residual, Jacobian products)``."""
    n, products = z.shape[-1], 0
    F, y, svd = phi(z)
    for _ in range(steps):
        res = float(phi.fr.residual(y))
        if res <= tol:
            break
        apply = phi.jacobian(svd)

        def matvec(v, apply=apply):
            nonlocal products
            products += 1
            return apply(torch.from_numpy(v).reshape(n, n)).reshape(-1).numpy()

        op = LinearOperator((n * n, n * n), matvec=matvec, dtype=np.float64)
        delta, _ = gmres(op, -F.reshape(-1).numpy(), rtol=rtol, restart=GMRES_PRODUCTS, maxiter=1)
        delta = torch.from_numpy(delta).reshape(n, n)
        t, base = 1.0, float(F.norm())
        for _ in range(MAX_HALVINGS):
            F, y, svd = phi(z + t * delta)
            if float(F.norm()) < base:
                break
            t /= 2
        z = z + t * delta
    return float(phi.fr.residual(y)), products


def cold_start(frame: SquareFrame) -> torch.Tensor:
    """The library's cold start: the tangent projection at unit spectral norm, as a Douglas-Rachford state."""
    x = frame.proj_tangent(frame.K)
    return x / torch.linalg.matrix_norm(x, ord=2) - frame.K * frame.n**0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=positive_int, default=128, help="matrix size n (W is n x n; default 128)")
    parser.add_argument("--spectrum", default="gaussian", choices=SPECTRA)
    parser.add_argument("--k0", type=int, nargs="+", default=[2, 4, 8], help="Douglas-Rachford iterations first")
    parser.add_argument("--tol", type=float, default=1e-4, help="tangent residual RMS to reach (default 1e-4)")
    parser.add_argument(
        "--spread",
        type=float,
        default=None,
        help="column norms 1 + spread * u, u uniform in [-1, 1] (as the square-dgram-spread record); default: "
        "the benchmark's random DGram point",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="solve the next step's problem (W retracted by 0.02 along the direction, gradient blended "
        "0.95/0.05 with a fresh one, as `bench optimizer`), every method started from this one's state",
    )
    parser.add_argument("--gmres-rtol", type=float, default=1e-2, help="GMRES's relative tolerance (default 1e-2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    if args.n < 2 or any(k < 0 for k in args.k0) or not args.tol > 0 or not 0 <= (args.spread or 0) < 1:
        parser.error("need --n >= 2, every --k0 >= 0, --tol > 0 and --spread in [0, 1)")
    if not 0 < args.gmres_rtol < 1:
        parser.error("need --gmres-rtol in (0, 1)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    if args.spread is None:
        W = benchmark_point(DGram(), "square", (args.n, args.n), "random", gen).double()
    else:
        Q = torch.linalg.qr(torch.randn(args.n, args.n, generator=gen, dtype=torch.float64))[0]
        W = Q * (1 + args.spread * (2 * torch.rand(args.n, generator=gen, dtype=torch.float64) - 1))
    G = synthetic_gradient((args.n, args.n), args.spectrum, gen, torch.float64, "cpu")
    frame = SquareFrame(W, G / G.norm())  # one problem: its maps work on unbatched (n, n) matrices too
    start_state = cold_start(frame)
    if args.warm:  # this problem solved to tol / 10, then the next step's problem, started from its state
        phi = FixedPointMap(frame)
        start_state, _ = douglas_rachford(phi, start_state, 10_000, args.tol / 10)
        direction = frame.Q @ phi(start_state)[1]
        W = DGram().retr(W, -WARM_STEP * direction)
        G = (1 - WARM_BLEND) * G + WARM_BLEND * synthetic_gradient(G.shape, args.spectrum, gen, G.dtype, "cpu")
        frame = SquareFrame(W, G / G.norm())
    point = "random DGram point" if args.spread is None else f"column norms spread {args.spread:g}"
    start = "warm (next step)" if args.warm else "cold"
    print(
        f"n = {args.n}, {args.spectrum} gradient, {point}, seed {args.seed}, float64, tol {args.tol:g}, {start}, "
        f"GMRES rtol {args.gmres_rtol:g}"
    )
    print(f"{'method':<26} {'eighs':>6} {'jacobian products':>18} {'residual':>9} {'seconds':>8}")
    runs = [("douglas-rachford", None)] + [(f"dr x {k} + newton", k) for k in args.k0]
    for name, k0 in runs:
        phi, start, products = FixedPointMap(frame), time.perf_counter(), 0
        if k0 is None:
            _, res = douglas_rachford(phi, start_state, 10_000, args.tol)
        else:
            z, res = douglas_rachford(phi, start_state, k0, args.tol)
            if res > args.tol:
                res, products = newton(phi, z, args.tol, args.gmres_rtol)
        seconds = time.perf_counter() - start
        print(f"{name:<26} {phi.eighs:>6} {products:>18} {res:>9.1e} {seconds:>8.2f}")


if __name__ == "__main__":
    main()
