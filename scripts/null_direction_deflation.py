"""A gradient with an exact null direction, solved with that direction deflated (Stiefel; DGram evidence).

A matrix that writes into a transformer's residual stream gets a gradient with $\\hat G v = 0$ exactly
(tall form, $v = \\mathbf 1/\\sqrt n$: LayerNorm's backward pass removes the feature mean; see
docs/solver-experiments.md). The dual optimum $S^\\star$ then satisfies $S^\\star v = 0$: $Y^\\star v = 0$,
the degenerate direction that slows the solver. Deflating it, for a Stiefel point $W$, with $U$
an orthonormal basis of $v^\\perp$:

1. solve the Stiefel problem of $(WU, \\hat GU)$, $n - 1$ columns (its dual is $S = US'U^\\top$, so
   $Sv = 0$), with the library's default solver: $A'$;
2. complete it: $A = A'U^\\top + a v^\\top$, where tangency at $W$ needs $W^\\top a = -UA'^\\top Wv$ and
   $\\|A\\|_{\\mathrm{op}} \\le 1$ needs $A'^\\top a = 0$, $\\|a\\| \\le 1$; $a = Wc + x$ with
   $c = -UA'^\\top Wv$ and the least-norm $x \\perp \\operatorname{range}(W)$ with $A'^\\top x = -A'^\\top Wc$.

Since $\\hat G v = 0$, $\\langle \\hat G, A\\rangle = \\langle \\hat GU, A'\\rangle$: the objective and the
certificate are those of the deflated problem. Prints, per seed, the evaluations of the default
solver on the whole problem and of the deflated one, and for both the tangent residual, the
spectral norm and the gap to a float64 reference (tol 1e-10), with $\\|a\\|$ against $\\|A^\\star v\\|$.
Then, for DGram points (column norms $1 + 0.3u$), the evidence that the same holds there:
$\\|S^\\star v\\| / \\|S^\\star\\|$ and the two smallest singular values of $Y^\\star$ at the reference optimum.
A prototype for docs/solver-experiments.md, not a solver of the library.

    OMP_NUM_THREADS=1 python scripts/null_direction_deflation.py --shape 512 128 --seeds 4
"""

from __future__ import annotations

import argparse

import torch

from geomtrain.bench.optimizer import synthetic_gradient
from geomtrain.optim import spectral_direction
from manifolds import DGram, Stiefel

REFERENCE = {"tol": 1e-10, "max_iter": 3000, "smoothing": 1e-7}  # float64 reference solves


def complement(v: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis ``(n, n - 1)`` of the complement of the unit vector ``v``."""
    n = v.shape[0]
    Q = torch.linalg.qr(torch.cat([v[:, None], torch.eye(n, dtype=v.dtype)[:, : n - 1]], 1))[0]
    return Q[:, 1:]


def complete(
    W: torch.Tensor, A_def: torch.Tensor, U: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """$A = A'U^\\top + av^\\top$ tangent at the Stiefel point ``W`` with $A'^\\top a = 0$ (module docstring);
    returns ``(A, a)``."""
    c = -U @ (A_def.mT @ (W @ v))
    outside = A_def - W @ (W.mT @ A_def)  # the part of A' outside range(W): for x there, A'^T x = outside^T x
    # the least-norm solution of outside^T x = r lies in range(outside), so x is outside range(W) as needed
    x = torch.linalg.lstsq(outside.mT, -(A_def.mT @ (W @ c))[:, None]).solution[:, 0]
    a = W @ c + x
    return A_def @ U.mT + a[:, None] * v[None, :], a


def accuracy(W: torch.Tensor, A: torch.Tensor, Gh: torch.Tensor, opt: float) -> str:
    """Tangent residual RMS (Stiefel), spectral norm and relative gap to ``opt`` of a direction."""
    H = W.mT @ A + A.mT @ W
    res = float(H.square().mean().sqrt())
    return f"{res:>9.1e} {float(torch.linalg.matrix_norm(A, ord=2)):>9.6f} {1 - float((A * Gh).sum()) / opt:>9.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[512, 128], metavar=("M", "N"), help="tall m x n")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="of the solves timed")
    parser.add_argument(
        "--perturb",
        type=float,
        default=0.0,
        help="add EPS |G|_op u v^T (u a random unit vector): a null direction that is only approximate, "
        "as the gradients of c_attn and c_fc have (default 0: exact)",
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    m, n = args.shape
    if not m >= 2 * n - 1 or n < 3 or args.seeds < 1 or args.perturb < 0:
        parser.error(
            "need a tall shape with m >= 2n - 1 (room for the completion), n >= 3, --seeds >= 1, --perturb >= 0"
        )
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    v = torch.ones(n, dtype=torch.float64) / n**0.5
    U = complement(v)
    null = "G v = 0" if args.perturb == 0 else f"|G v| = {args.perturb:g} |G|_op"
    print(f"Stiefel {m} x {n}, layernorm gradients ({null}), solves in {args.dtype}")
    print(
        f"{'seed':>4} {'whole: evals':>12} {'residual':>9} {'opnorm':>9} {'gap':>9}   "
        f"{'deflated: evals':>15} {'residual':>9} {'opnorm':>9} {'gap':>9} {'|a|':>6} {'|A* v|':>6}   "
        f"{'whole from deflated S: evals':>28}"
    )
    for seed in range(args.seeds):
        gen = torch.Generator().manual_seed(seed)
        W = torch.linalg.qr(torch.randn(m, n, generator=gen, dtype=torch.float64))[0]
        G = synthetic_gradient((m, n), "layernorm", gen, torch.float64, "cpu")
        if args.perturb:
            u = torch.randn(m, generator=gen, dtype=torch.float64)
            G = G + args.perturb * torch.linalg.matrix_norm(G, ord=2) * (u / u.norm())[:, None] * v[None, :]
        Gh = G / G.norm()
        ref, _ = spectral_direction(Stiefel(), W, G, **REFERENCE)
        opt = float((ref * Gh).sum())
        whole, st = spectral_direction(Stiefel(), W.to(dtype), G.to(dtype))
        A_def, st_def = spectral_direction(Stiefel(), (W @ U).to(dtype), (Gh @ U).to(dtype))
        A, a = complete(W, A_def.double(), U, v)
        # the whole problem again, warm-started at the deflated multiplier U S' U^T (S v = 0)
        _, st_warm = spectral_direction(
            Stiefel(), W.to(dtype), G.to(dtype), dual=(U @ st_def.multiplier.double() @ U.mT).to(dtype)
        )
        norms = f"{float(a.norm()):>6.3f} {float((ref @ v).norm()):>6.3f}"
        print(
            f"{seed:>4} {int(st.evaluations):>12} {accuracy(W, whole.double(), Gh, opt)}   "
            f"{int(st_def.evaluations):>15} {accuracy(W, A, Gh, opt)} {norms}   {int(st_warm.evaluations):>28}"
        )
    print(f"DGram {m} x {n} (column norms 1 + 0.3 u), layernorm gradients: the reference optimum")
    print(f"{'seed':>4} {'|S* v| / |S*|':>14} {'smallest sv of Y*':>18} {'next':>9}")
    for seed in range(args.seeds):
        gen = torch.Generator().manual_seed(seed)
        Q = torch.linalg.qr(torch.randn(m, n, generator=gen, dtype=torch.float64))[0]
        W = Q * (1 + 0.3 * (2 * torch.rand(n, generator=gen, dtype=torch.float64) - 1))
        G = synthetic_gradient((m, n), "layernorm", gen, torch.float64, "cpu")
        _, st = spectral_direction(DGram(), W, G, **REFERENCE)
        S = st.multiplier
        sv = torch.linalg.svdvals(G / G.norm() + W @ S)
        print(f"{seed:>4} {float((S @ v).norm() / S.norm()):>14.1e} {float(sv[-1]):>18.1e} {float(sv[-2]):>9.1e}")


if __name__ == "__main__":
    main()
