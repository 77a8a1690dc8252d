"""A gradient with an exact null direction, solved with that direction deflated (Stiefel; DGram evidence).

A matrix that writes into a transformer's residual stream gets a gradient with $\\hat G v = 0$ exactly
(tall form, $v = \\mathbf 1/\\sqrt n$: LayerNorm's backward pass removes the feature mean; see
lab/README.md). The dual optimum $S^\\star$ then satisfies $S^\\star v = 0$: $Y^\\star v = 0$,
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
A prototype (lab/2026-12-05-null-direction-deflation), not a solver of the library.

    OMP_NUM_THREADS=1 python lab/2026-12-05-null-direction-deflation/null_direction_deflation.py \\
        --shape 512 128 --seeds 4
"""

from __future__ import annotations

import argparse

import torch

from geomtrain.bench.problems import synthetic_gradient
from geomtrain.config import positive_int
from geomtrain.optim import spectral_direction, tangent_residual
from manifolds import DGram, Stiefel

REFERENCE = {"tol": 1e-10, "max_iter": 3000, "smoothing": 1e-7}  # float64 reference solves
DGRAM_SPREAD = 0.3  # DGram points: column norms 1 + 0.3 u, u uniform in [-1, 1]


def complement(v: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis ``(n, n - 1)`` of the complement of the unit vector ``v``."""
    n = v.shape[0]
    Q = torch.linalg.qr(torch.cat([v[:, None], torch.eye(n, dtype=v.dtype)[:, : n - 1]], 1))[0]
    return Q[:, 1:]


def problem(m: int, n: int, seed: int, v: torch.Tensor, perturb: float, spread: float | None = None):
    """``(W, G, G / |G|_F)`` of one seed, float64: a Stiefel point (or, with ``spread``, the DGram point with
    column norms ``1 + spread * u``) and a `layernorm` gradient, plus ``perturb |G|_op u v^T`` if asked."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.linalg.qr(torch.randn(m, n, generator=gen, dtype=torch.float64))[0]
    if spread is not None:
        W = W * (1 + spread * (2 * torch.rand(n, generator=gen, dtype=torch.float64) - 1))
    G = synthetic_gradient((m, n), "layernorm", gen, torch.float64, "cpu")
    if perturb:
        u = torch.randn(m, generator=gen, dtype=torch.float64)
        G = G + perturb * torch.linalg.matrix_norm(G, ord=2) * (u / u.norm())[:, None] * v[None, :]
    return W, G, G / G.norm()


def column_along(W: torch.Tensor, A0: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The column $a$ a completion adds along $v$: $W^\\top a = b$ (tangency) and $A_0^\\top a = 0$ (unit norm), with
    $a = W\\Gamma^{-1}b + x$, $x \\perp \\operatorname{range}(W)$ of least norm ($\\Gamma = W^\\top W$)."""
    gram = W.mT @ W
    c = torch.linalg.solve(gram, b)
    outside = A0 - W @ torch.linalg.solve(gram, W.mT @ A0)  # A0 outside range(W): A0^T x = outside^T x there
    # the least-norm solution of outside^T x = r lies in range(outside), so x is outside range(W) as needed
    x = torch.linalg.lstsq(outside.mT, -(A0.mT @ (W @ c))[:, None]).solution[:, 0]
    return W @ c + x


def complete(
    W: torch.Tensor, A_def: torch.Tensor, U: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """$A = A'U^\\top + av^\\top$ tangent at the Stiefel point ``W`` with $A'^\\top a = 0$ (module docstring):
    $W^\\top a = -UA'^\\top Wv$. Returns ``(A, a)``."""
    A0 = A_def @ U.mT
    a = column_along(W, A0, -U @ (A_def.mT @ (W @ v)))
    return A0 + a[:, None] * v[None, :], a


def accuracy(manifold, W: torch.Tensor, A: torch.Tensor, Gh: torch.Tensor, opt: float) -> str:
    """Tangent residual RMS, spectral norm and relative gap to ``opt`` of a direction."""
    res = float(tangent_residual(manifold, W, A))
    return f"{res:>9.1e} {float(torch.linalg.matrix_norm(A, ord=2)):>9.6f} {1 - float((A * Gh).sum()) / opt:>9.1e}"


def project_zero_row_sums(M: torch.Tensor) -> torch.Tensor:
    r"""The orthogonal projection of a symmetric ``M`` onto the DGram multipliers with $Sv = 0$,
    $v = \mathbf 1/\sqrt n$: zero diagonal and zero row sums. $P(M) = \operatorname{Off}(M) -
    (\mu\mathbf 1^\top + \mathbf 1\mu^\top) + 2\operatorname{diag}(\mu)$, with $\mu$ from the row sums $r$ of
    $\operatorname{Off}(M)$: $(n - 2)\mu + (\mathbf 1^\top\mu)\mathbf 1 = r$."""
    n = M.shape[-1]
    off = M - torch.diag_embed(M.diagonal(dim1=-2, dim2=-1))
    r = off.sum(-1)
    mu = (r - r.sum(-1, keepdim=True) / (2 * n - 2)) / (n - 2)
    return off + torch.diag_embed(2 * mu) - (mu[..., :, None] + mu[..., None, :])


class DeflatedDGramDual(DGram):
    r"""Prototype only: with ``project_gram`` = `project_zero_row_sums`, the library's generic (conjugate-
    gradient) path solves the deflated DGram dual $\min \|\hat G + WS\|_*$ over $S$ with $Sv = 0$. That P is
    a self-adjoint projection but not an entrywise 0/1 mask, which the library refuses (``check_mask``):
    this class overrides the check knowingly, and averages residuals over the $n^2 - n$ off-diagonal
    entries, as DGram does (``gram_mask``)."""

    name = "DeflatedDGramDual"

    def project_gram(self, M: torch.Tensor) -> torch.Tensor:
        return project_zero_row_sums(M)

    def gram_mask(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return DGram.project_gram(self, torch.ones(n, n, dtype=like.dtype, device=like.device))

    def check_mask(self, n: int) -> None:
        return None


def complete_dgram(W: torch.Tensor, A_def: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""$A = A_0 + av^\top$ tangent at the DGram point ``W`` from the deflated solve's $A_0$ ($A_0v = 0$ to
    rounding): $b = W^\top a$ solves $\operatorname{Off}(bv^\top + vb^\top) = -\operatorname{Off}(W^\top A_0 +
    A_0^\top W)$ (least squares), then $a = W\Gamma^{-1}b + x$ with the least-norm $x \perp
    \operatorname{range}(W)$ such that $A_0^\top a = 0$. Returns ``(A, a)``."""
    n = W.shape[-1]
    A0 = A_def - (A_def @ v)[:, None] * v[None, :]
    H = W.mT @ A0 + A0.mT @ W
    i, j = torch.triu_indices(n, n, 1)
    pairs = torch.zeros(i.numel(), n, dtype=W.dtype)
    pairs[torch.arange(i.numel()), i] = pairs[torch.arange(i.numel()), j] = float(v[0])
    b = torch.linalg.lstsq(pairs, -H[i, j][:, None]).solution[:, 0]
    a = column_along(W, A0, b)
    return A0 + a[:, None] * v[None, :], a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[512, 128], metavar=("M", "N"), help="tall m x n")
    parser.add_argument("--seeds", type=positive_int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="of the solves timed")
    parser.add_argument(
        "--perturb",
        type=float,
        default=0.0,
        help="add EPS |G|_op u v^T (u a random unit vector): a null direction that is only approximate, "
        "as the gradients of c_attn and c_fc have (default 0: exact)",
    )
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    m, n = args.shape
    if not m >= 2 * n - 1 or n < 3 or args.perturb < 0:  # --seeds: positive_int
        parser.error("need a tall shape with m >= 2n - 1 (room for the completion), n >= 3 and --perturb >= 0")
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
        W, G, Gh = problem(m, n, seed, v, args.perturb)
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
        deflated = f"{int(st_def.evaluations):>15} {accuracy(Stiefel(), W, A, Gh, opt)} {norms}"
        print(
            f"{seed:>4} {int(st.evaluations):>12} {accuracy(Stiefel(), W, whole.double(), Gh, opt)}   "
            f"{deflated}   {int(st_warm.evaluations):>28}"
        )
    print(
        f"DGram {m} x {n} (column norms 1 + {DGRAM_SPREAD:g} u), layernorm gradients ({null}), solves in {args.dtype}"
    )
    print(
        f"{'seed':>4} {'|S* v| / |S*|':>14} {'sv of Y*: least':>15} {'next':>9}   {'whole: evals':>12} {'gap':>9}   "
        f"{'deflated: evals':>15} {'residual':>9} {'opnorm':>9} {'gap':>9} {'|a|':>6} {'|A* v|':>6}"
    )
    for seed in range(args.seeds):
        W, G, Gh = problem(m, n, seed, v, args.perturb, spread=DGRAM_SPREAD)
        ref, st = spectral_direction(DGram(), W, G, **REFERENCE)
        opt, S = float((ref * Gh).sum()), st.multiplier
        sv = torch.linalg.svdvals(Gh + W @ S)
        whole, st_whole = spectral_direction(DGram(), W.to(dtype), G.to(dtype))
        A_def, st_def = spectral_direction(DeflatedDGramDual(), W.to(dtype), G.to(dtype))
        A, a = complete_dgram(W, A_def.double(), v)
        gap_whole = 1 - float((whole.double() * Gh).sum()) / opt
        print(
            f"{seed:>4} {float((S @ v).norm() / S.norm()):>14.1e} {float(sv[-1]):>15.1e} {float(sv[-2]):>9.1e}   "
            f"{int(st_whole.evaluations):>12} {gap_whole:>9.1e}   {int(st_def.evaluations):>15} "
            f"{accuracy(DGram(), W, A, Gh, opt)} {float(a.norm()):>6.3f} {float((ref @ v).norm()):>6.3f}"
        )


if __name__ == "__main__":
    main()
