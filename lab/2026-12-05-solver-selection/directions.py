"""The directions of the candidate solvers on the matrices of a training checkpoint, against the exact one.

For every Manifold Muon matrix of a run's checkpoint (its weights W and momentum buffer as G), each solver arm
gives a direction A; printed per arm and matrix kind (median, and range over the matrices):

- ``gap``: the exact float64 certified relative dual gap of A (`geomtrain.optim.certificate.certify`);
- ``length``: ||A||_F / ||A*||_F, A* the float64 exact direction (all its singular values are 1 where the
  optimum is non-degenerate: the step length a direction uses of the spectral budget);
- ``msign-eq``: the matmul FLOPs of the solve over those of one 5-step Polar Express msign of the same matrix;
- ``decomp``: eigendecompositions, SVDs, QRs or solves dispatched (products-only solvers: 0).

    python lab/2026-12-05-solver-selection/directions.py RUN/ckpt.pt [--out FILE.md]
"""

from __future__ import annotations

import argparse
import collections
import statistics

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from geomtrain.optim import spectral_direction
from geomtrain.optim.certificate import certify
from manifolds import DGram, Stiefel, msign
from manifolds.base import to_tall

ARMS = {
    "exact": dict(solver="exact"),
    "tangent": dict(solver="tangent"),
    "projected_tangent": dict(solver="projected_tangent"),
    "projected_tangent msign_steps=8": dict(solver="projected_tangent", msign_steps=8),
    "projected_tangent msign_steps=8 rounds=3": dict(solver="projected_tangent", msign_steps=8, rounds=3),
    "dual_ascent steps=2": dict(solver="dual_ascent", steps=2),
    "admm": dict(solver="admm"),
}
DECOMPOSITIONS = (
    "linalg_eigh",
    "_linalg_eigh",
    "linalg_svd",
    "_linalg_svd",
    "linalg_qr",
    "linalg_solve",
    "_linalg_solve_ex",
    "linalg_cholesky_ex",
    "linalg_eig",
    "linalg_inv_ex",
    "linalg_lu_factor_ex",
)


class FlopCounter(TorchDispatchMode):
    """Matmul FLOPs (mm, bmm, addmm, baddbmm) and decompositions dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.flops, self.ops = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in ("mm", "bmm", "addmm", "baddbmm"):
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            self.flops += 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        return func(*args, **(kwargs or {}))


def measure(man, W, G, A_star, kw):
    with FlopCounter() as fc:
        A, _ = spectral_direction(man, W, G, **kw)
    gap, _ = certify(man, W[None].double(), G[None].double(), A[None].double())
    decomp = sum(fc.ops[d] for d in DECOMPOSITIONS)
    return float(gap[0]), float(A.double().norm() / A_star.norm()), fc.flops, decomp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ck = torch.load(args.checkpoint, weights_only=False, map_location="cpu")
    rows = collections.defaultdict(list)  # (arm, kind) -> [(gap, length, msign_eq, decomp)]
    for group in ck["muon"]["param_groups"]:
        man = {"stiefel": Stiefel(), "dgram": DGram()}.get(group["manifold_name"])
        if man is None:
            continue
        for pid, name in zip(group["params"], group["param_names"]):
            W = to_tall(ck["model"][name]).float()
            G = to_tall(ck["muon"]["state"][pid]["momentum_buffer"]).float()
            A_star, _ = spectral_direction(man, W.double(), G.double(), solver="exact", tol=1e-9, max_iter=300)
            with FlopCounter() as fc:
                msign(G, "polar_express", steps=5)
            role = "attn" if ".attn." in name else "mlp"
            for arm, kw in ARMS.items():
                gap, length, flops, decomp = measure(man, W, G, A_star, kw)
                rows[(arm, f"{group['manifold_name']} {role}")].append((gap, length, flops / fc.flops, decomp))
    lines = [
        f"Checkpoint: `{args.checkpoint}` (step {ck['step']}); float32 solves, float64 references.",
        "",
        "| solver | matrices | certified gap | length vs exact | msign-equivalents | decompositions |",
        "|---|---|---|---|---|---|",
    ]
    fmt = lambda xs, p: f"{statistics.median(xs):.{p}f} ({min(xs):.{p}f}-{max(xs):.{p}f})"  # noqa: E731
    for (arm, kind), vals in rows.items():
        g, ln, eq, dc = zip(*vals)
        lines.append(f"| {arm} | {kind} ({len(vals)}) | {fmt(g, 3)} | {fmt(ln, 2)} | {fmt(eq, 1)} | {max(dc)} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
