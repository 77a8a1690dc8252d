r"""One step from the warm start of training's tall direction problems: Gauss-Newton against exact Newton.

The default solver's step (`GramDual.step`) freezes $R = (\max(M, \tau^2) + \varphi)^{-1/2}$ and solves
the linearised stationarity condition $P(\Gamma\Delta R + R\Delta\Gamma) = -H$. The exact Newton step
also differentiates $R$ (Daleckii-Krein): with $M = V\Lambda V^\top$,
$dR = V\big((V^\top dM\,V)\circ\Phi\big)V^\top$, $\Phi_{ij} = (r_i - r_j)/(\lambda_i - \lambda_j)$
($-r_i^2 r_j^2/(r_i + r_j)$ where neither eigenvalue is clamped at $\tau^2$, 0 where both are) and
$dM = dS\,Z + Z^\top dS$, so the derivative of the residual $H = P(ZR + RZ^\top)$ is
$P(X + X^\top)$, $X = \Gamma\,dS\,R + Z\,dR$: the Hessian of the smoothed dual, symmetric positive
semidefinite ($\varphi$ held fixed).

The script trains the `mini` model (``--model``) with a preset up to ``--step``, captures that step's tall solves and,
for each group of them, takes one step from the run's warm start, in float64: the Gauss-Newton step,
and the Newton step (conjugate gradients on the Hessian, preconditioned by the Gauss-Newton solve, to
a relative residual of ``--cg-rtol``) at lengths 1, 1/2 and 1/4. It prints the tangent residual RMS
(median and largest over the group) at the start and after each step. A measurement for
docs/solver-experiments.md, not a solver of the library.

    OMP_NUM_THREADS=1 python scripts/exact_newton_step.py all-dgram --step 41
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import geomtrain.optim.muon as muon_module
from geomtrain.config import make_config, positive_int
from geomtrain.optim import mask_kind
from geomtrain.optim.gram import Evaluation, GramDual
from geomtrain.optim.numerics import normalise, pcg, sym
from geomtrain.train import Trainer
from manifolds.base import to_tall

LENGTHS = (1.0, 0.5, 0.25)  # Newton step lengths tried


def hessian_product(dual: GramDual, ev: Evaluation):
    r"""$dS \mapsto$ the derivative of $H(S) = P(ZR + RZ^\top)$ at the evaluation ``ev`` (module docstring)."""
    Z = dual.gram(ev.S)[1]
    V, lam, r, R = ev.V, ev.lam, ev.r, ev.weights()
    free = lam > dual.tau2  # eigenvalues not clamped at tau^2
    r_i, r_j = r[..., :, None], r[..., None, :]
    gap = lam[..., :, None] - lam[..., None, :]
    divided = (r_i - r_j) / torch.where(gap == 0, torch.ones_like(gap), gap)
    # Where both are clamped, or the eigenvalues are equal and not both free, r_i = r_j exactly: divided is 0.
    Phi = torch.where(free[..., :, None] & free[..., None, :], -(r_i**2) * r_j**2 / (r_i + r_j), divided)

    def product(dS: torch.Tensor) -> torch.Tensor:
        dM = dS @ Z
        dR = V @ ((V.mT @ (dM + dM.mT) @ V) * Phi) @ V.mT
        X = dual.gamma(dS) @ R + Z @ dR
        return dual.P(X + X.mT)

    return product


def gauss_newton_solve(dual: GramDual, ev: Evaluation):
    r"""$B \mapsto \Delta$ with $P(\Gamma\Delta R + R\Delta\Gamma) = B$: the library's step for the residual $-B$."""

    def solve(B: torch.Tensor) -> torch.Tensor:
        Ht = None if ev.Ht is None else -(ev.V.mT @ B @ ev.V)
        return dual.step(dataclasses.replace(ev, H=None if ev.H is None else -B, Ht=Ht))

    return solve


def residual_matrix(ev: Evaluation) -> torch.Tensor:
    """$H$ of an evaluation (Stiefel evaluations keep it in the eigenbasis of $M$)."""
    return ev.H if ev.H is not None else ev.V @ ev.Ht @ ev.V.mT


def one_step(manifold, W: torch.Tensor, U: torch.Tensor, dual0: torch.Tensor | None, cg_iters: int, cg_rtol: float):
    """Residuals (per matrix) at the start, after the Gauss-Newton step and after the Newton step at each of
    `LENGTHS`, and the conjugate-gradient iterations the Newton step took (float64)."""
    Gh, _ = normalise(to_tall(U, W).double())
    dual = GramDual(manifold, to_tall(W).double(), Gh, torch.float64, 1e-3)  # the default smoothing
    S = dual.tangent_start() if dual0 is None else dual.P(sym(dual0.double()))
    ev = dual.evaluate(S)
    rows = {"start": ev.res, "gauss-newton": dual.evaluate(S + dual.step(ev)).res}
    iterations = [0]

    def counted(B):
        iterations[0] += 1
        return hessian_product(dual, ev)(B)

    step = dual.P(sym(pcg(counted, -residual_matrix(ev), gauss_newton_solve(dual, ev), cg_iters, cg_rtol)))
    for t in LENGTHS:
        rows[f"newton t={t:g}"] = dual.evaluate(S + t * step).res
    return rows, iterations[0]


def capture(preset: str, step: int, data_dir: str, model: str) -> list[tuple]:
    """The ``(manifold, W, U, options)`` of every tall solve call of training step ``step``."""
    calls: list[tuple] = []
    solve = muon_module.spectral_direction
    on = {"now": False}

    def hook(manifold, W, U, **options):
        if on["now"] and mask_kind(manifold) in ("stiefel", "dgram") and W.shape[-1] != W.shape[-2]:
            calls.append((manifold, W.clone(), U.clone(), dict(options)))
        return solve(manifold, W, U, **options)

    muon_module.spectral_direction = hook
    try:
        config = dict(data_dir=data_dir, preset=preset, seed=0, max_iters=step + 1, warmup_iters=1)
        trainer = Trainer(make_config(dict(model=model, progress=False, diagnostics=False, eval_iters=1, **config)))
        for k in range(step + 1):
            on["now"] = k == step
            trainer.step()
    finally:
        muon_module.spectral_direction = solve
    return calls


def add_capture_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments `capture` takes: the preset, ``--step`` (at least 1: a warm start), ``--model``, ``--data-dir``."""
    parser.add_argument("preset")
    parser.add_argument(
        "--step", type=positive_int, default=41, help="the training step whose solves are taken (default 41)"
    )
    parser.add_argument("--model", default="mini", help="a model of geomtrain.model.MODEL_CONFIGS (default mini)")
    parser.add_argument("--data-dir", default="data/classics-bpe8k")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_capture_arguments(parser)
    parser.add_argument(
        "--cg-iters", type=positive_int, default=50, help="conjugate-gradient iterations at most (default 50)"
    )
    parser.add_argument("--cg-rtol", type=float, default=1e-6, help="relative CG residual to stop at (default 1e-6)")
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    if not args.cg_rtol > 0:  # --step and --cg-iters: positive_int
        parser.error("need --cg-rtol > 0")
    torch.set_num_threads(args.threads)
    calls = capture(args.preset, args.step, args.data_dir, args.model)
    columns = ["start", "gauss-newton", *(f"newton t={t:g}" for t in LENGTHS)]
    print(f"{args.preset} step {args.step}: tangent residual RMS after one step from the warm start (median / largest)")
    print(f"{'group':<22}" + "".join(f"{c:>20}" for c in columns) + f"{'CG iterations':>15}")
    for manifold, W, U, options in calls:
        rows, iterations = one_step(manifold, W, U, options.get("dual"), args.cg_iters, args.cg_rtol)
        shape = "x".join(map(str, to_tall(W).shape[-2:]))
        cells = "".join(f"{statistics.median(rows[c].tolist()):>10.1e}{float(rows[c].max()):>10.1e}" for c in columns)
        print(f"{type(manifold).__name__ + ' ' + shape + f' ({W.shape[0]})':<22}{cells}{iterations:>15}")


if __name__ == "__main__":
    main()
