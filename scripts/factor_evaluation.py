r"""Float32 evaluations from the square-root factor of $M$ in place of float64 ones: training's tall solves.

Why the solver needs float64: an evaluation decomposes $M = Y^\top Y$, whose eigenvalues a float32
decomposition knows only to about $\varepsilon\lambda_{\max}$ ($\varepsilon = 6\cdot10^{-8}$), so singular
values of $Y$ below $\sqrt\varepsilon\,\sigma_{\max} \approx 2.4\cdot10^{-4}\sigma_{\max}$ are lost. Training
momenta have many, and the Huber threshold $\tau$ sits at about $10^{-4}\sigma_{\max}$: their problems are
escalated to float64. A factor of $Y$ keeps them: with $W = Q\Gamma^{1/2}$ ($\Gamma = W^\top W$ diagonal on
Stiefel and DGram points) and $R_\perp$ the triangular factor of the part of $\hat G$ outside the range of
$W$ ($R_\perp^\top R_\perp = \hat G_\perp^\top\hat G_\perp$, one QR per solve),

$$Y = \hat G + WS \;\simeq\; F = \begin{bmatrix}\Gamma^{-1/2}Z\\ R_\perp\end{bmatrix},\qquad Z = K + \Gamma S,$$

($2n \times n$, the same singular values and right singular vectors as $Y$), and a float32 SVD of $F$
resolves singular values down to about $\varepsilon\,\sigma_{\max}$ (``--decomposition svd``). LAPACK's
SVD is dear on a CPU, so the default, ``--decomposition graded``, decomposes $M$ in float32 (formed from
$F$) and then decomposes again the block of its eigenvectors whose eigenvalues are below ``--threshold``
$\cdot\lambda_{\max}$, from the products $FV_k$: those entries are known to their own scale, not to
$\lambda_{\max}$'s. The multiplier $S$, $K$ and $Z$ stay float64 (a float32 $S$ rounds at a residual of
about $3\cdot10^{-4}$, measured); everything else of an evaluation is float32, and the Stiefel step too
(the DGram step already is). The certificate is the solver's own, in float64, at the eigenvectors
orthonormalised in float64.

The script trains the `mini` model (``--model``) with a preset up to ``--step``, captures that step's tall
solves, and solves each group again twice, alternately, ``--repeats`` times: as the library does
(``float64``), and with the library's solver patched to use these evaluations wherever it would evaluate
in float64 (``factor32``). Per group and variant: the evaluations, the fastest solve time, the largest
tangent residual RMS, $\|A\|_{\mathrm{op}} - 1$, certified gap and gap to the float64 optimum (a
reference solve: ``tol`` 1e-9, smoothing 1e-6), and how many evaluations were factored (problems that
the library keeps in float32 are solved the same way by both). A measurement for docs/solver-experiments.md, not a
solver of the library.

    OMP_NUM_THREADS=1 python scripts/factor_evaluation.py all-stiefel --step 41   # and all-dgram
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import runpy
import time
from pathlib import Path

import torch

import geomtrain.optim.gram_newton as gram_newton
from geomtrain.bench.optimizer import reference_solve
from geomtrain.config import positive_float, positive_int
from geomtrain.optim import spectral_direction, tangent_residual
from geomtrain.optim.gram import ROUNDING_FLOOR, Evaluation, GramDual, inverse_sqrt_weights
from geomtrain.optim.numerics import eigh_psd, sym
from manifolds.base import to_tall

# Below this fraction of lambda_max the float32 eigenvectors of M are decomposed again from the factor. On the
# tall momenta of `mini` at step 41 (all-stiefel, all-dgram), 1e-4 needed 2-11 more evaluations per group and
# raised ||A||_op - 1 to 1.1e-3, and 1e-5 (a prototype) stalled at residuals of 2e-3 with ||A||_op up to 1.2:
# the float32 eigenvectors are inaccurate well above the resolution of the eigenvalues.
THRESHOLD = 1e-3


def graded_eigh(Zs: torch.Tensor, Rp: torch.Tensor, N: torch.Tensor, threshold: float):
    r"""Eigenpairs of $M = F^\top F$, $F = [Z_s; R_\perp]$ (float32): those of $M = Z_s^\top Z_s + N$, then the
    block below ``threshold`` $\cdot\lambda_{\max}$ again from $B = FV_k$ (entries known to their own scale)."""
    lam0, V0 = eigh_psd(Zs.mT @ Zs + N)
    k = int((lam0 < threshold * lam0[..., -1:]).sum(-1).max())  # one block size for the batch (the largest)
    if k == 0:
        return lam0.clamp_min(0), V0
    Vk = V0[..., :k]
    B1, B2 = Zs @ Vk, Rp @ Vk
    theta, Q = eigh_psd(sym(B1.mT @ B1 + B2.mT @ B2))
    return torch.cat([theta, lam0[..., k:]], -1).clamp_min(0), torch.cat([Vk @ Q, V0[..., k:]], -1)


def factor_svd(Zs: torch.Tensor, Rp: torch.Tensor, N: torch.Tensor, threshold: float):
    r"""Eigenpairs of $M = F^\top F$ (ascending) from a float32 SVD of $F = [Z_s; R_\perp]$ (``N``, ``threshold``:
    unused, the signature of `graded_eigh`)."""
    _, s, Vh = torch.linalg.svd(torch.cat([Zs, Rp], -2), full_matrices=False)
    return s.flip(-1).square(), Vh.mT.flip(-1)


DECOMPOSITIONS = {"graded": graded_eigh, "svd": factor_svd}


class FactorDual(GramDual):
    """`GramDual` whose float64 Stiefel and DGram evaluations are float32 ones from the factor (module docstring)."""

    threshold = THRESHOLD
    decompose = staticmethod(graded_eigh)
    evaluations = 0  # factored evaluations so far (all instances)

    def __init__(self, manifold, T, Gh, dtype, smoothing, *args):
        super().__init__(manifold, T, Gh, dtype, smoothing, *args)
        self.factored = dtype == torch.float64 and self.kind in ("stiefel", "dgram")
        if not self.factored:
            return
        # Gamma as the float32 path knows it (W is a float32 point, on the manifold to its rounding)
        self.d = torch.ones_like(self.C[..., 0]) if self.kind == "stiefel" else self.Td.square().sum(-2)
        self.Gw = None
        Kd = self.K / self.d.unsqueeze(-1)
        self.N = sym(self.C - Kd.mT @ self.K)
        self.Rp = torch.linalg.qr((self.Gd - self.Td @ Kd).float(), mode="r").R
        self.N32 = self.Rp.mT @ self.Rp
        self.sd = self.d.sqrt().float()
        self.floor = ROUNDING_FLOOR * torch.finfo(torch.float64).eps  # the eigenvalues are known to their scale

    def sub(self, idx):
        out = super().sub(idx)
        if out is not self and self.factored:
            out.Rp, out.N32, out.sd = self.Rp[idx], self.N32[idx], self.sd[idx]
        return out

    def evaluate(self, S: torch.Tensor) -> Evaluation:
        if not self.factored:
            return super().evaluate(S)
        FactorDual.evaluations += S.shape[0]
        Z = (self.K + self.d.unsqueeze(-1) * S).float()
        lam, V = self.decompose(Z / self.sd.unsqueeze(-1), self.Rp, self.N32, self.threshold)
        r = inverse_sqrt_weights(lam, self.tau2, self.floor)
        if self.kind == "stiefel":
            Zt = V.mT @ Z @ V
            Ht = (Zt * r.unsqueeze(-2) + r.unsqueeze(-1) * Zt.mT).double()
            return Evaluation(S, V.double(), lam.double(), r.double(), None, None, Ht, self.residual(Ht))
        R = (V * r.unsqueeze(-2)) @ V.mT
        ZR = Z @ R
        H = self.P(ZR + ZR.mT).double()
        return Evaluation(S, V.double(), lam.double(), r.double(), R.double(), H, None, self.residual(H))

    def step(self, ev: Evaluation) -> torch.Tensor:
        if not (self.factored and self.kind == "stiefel"):
            return super().step(ev)
        # the library's Stiefel step, in float32 (the DGram step already is)
        return super().step(dataclasses.replace(ev, V=ev.V.float(), r=ev.r.float(), Ht=ev.Ht.float())).double()

    def certify(self, S, R, r, V, lam):
        if not self.factored:
            return super().certify(S, R, r, V, lam)
        Q, T = torch.linalg.qr(V)  # float64: the bound's tr R^{-1} = sum 1/r needs orthonormal eigenvectors
        Q = Q * torch.sign(T.diagonal(dim1=-2, dim2=-1)).unsqueeze(-2)
        return super().certify(S, (Q * r.unsqueeze(-2)) @ Q.mT, r, Q, lam)


@contextlib.contextmanager
def factor_evaluations():
    """The library's default solver, with `FactorDual` in place of `GramDual`, inside the block."""
    saved = gram_newton.GramDual
    gram_newton.GramDual = FactorDual
    try:
        yield
    finally:
        gram_newton.GramDual = saved


def solve_both(manifold, W: torch.Tensor, U: torch.Tensor, options: dict, repeats: int) -> dict:
    """Per variant: ``(A, stats, fastest seconds, factored evaluations)``, the two variants alternated
    ``repeats`` times (the factored evaluations: of factor32's last solve, those that `FactorDual` made)."""
    out: dict = {}
    for _ in range(repeats):
        for name, context in (("float64", contextlib.nullcontext), ("factor32", factor_evaluations)):
            FactorDual.evaluations = 0
            with context():
                start = time.perf_counter()
                A, stats = spectral_direction(manifold, W, U, **options)
                seconds = time.perf_counter() - start
            fastest = min(seconds, out[name][2]) if name in out else seconds
            out[name] = (A, stats, fastest, FactorDual.evaluations)
    return out


def main() -> None:
    prototype = runpy.run_path(str(Path(__file__).with_name("exact_newton_step.py")))  # its capture of a step
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    prototype["add_capture_arguments"](parser)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed solves per variant (default 3)")
    parser.add_argument("--threshold", type=positive_float, default=THRESHOLD, help=f"default {THRESHOLD:g}")
    parser.add_argument(
        "--decomposition",
        choices=sorted(DECOMPOSITIONS),
        default="graded",
        help="of the factor: graded (float32 eigh of M, its small block again; default) or svd (float32 SVD of F)",
    )
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    FactorDual.threshold = args.threshold
    FactorDual.decompose = staticmethod(DECOMPOSITIONS[args.decomposition])
    calls = prototype["capture"](args.preset, args.step, args.data_dir, args.model)
    print(f"{args.preset} step {args.step}: tall solves as the library does them (float64) and with factor32")
    columns = {"variant": 10, "evaluations": 13, "ms": 8, "residual": 10, "|A|-1": 10, "certified": 11}
    columns.update({"true gap": 10, "factored": 10})
    print(f"{'group':<22}" + "".join(f"{name:>{width}}" for name, width in columns.items()))
    for manifold, W, U, options in calls:
        reference, _, _ = reference_solve(manifold, W, U, tol=1e-9, max_iter=3000, smoothing=1e-6)
        opt = (reference * U.double()).sum(dim=(-2, -1))
        shape = "x".join(map(str, to_tall(W).shape[-2:]))
        for name, (A, stats, seconds, factored) in solve_both(manifold, W, U, options, args.repeats).items():
            residual = tangent_residual(manifold, W.double(), A.double())
            excess = torch.linalg.matrix_norm(A.double(), 2) - 1
            gap = (opt - (A.double() * U.double()).sum(dim=(-2, -1))) / opt
            print(
                f"{type(manifold).__name__ + ' ' + shape + f' ({W.shape[0]})':<22}{name:>10}"
                f"{int(stats.evaluations.sum()):>13}{seconds * 1e3:>8.0f}{float(residual.max()):>10.1e}"
                f"{float(excess.max()):>10.1e}{float(stats.dual_gap.max()):>11.1e}{float(gap.max()):>10.1e}{factored:>10}"
            )


if __name__ == "__main__":
    main()
