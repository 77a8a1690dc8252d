"""split_tangent directions on the matrices of a training checkpoint, against exact and projected_tangent.

For every Stiefel or DGram matrix of a run's checkpoint (its weights W, its momentum buffer as G), per arm and
matrix kind (median, and range over the matrices):

- ``gap``: the exact float64 certified relative dual gap of the arm's direction A
  (`geomtrain.optim.certificate.certify`);
- ``length``: ||A||_F / ||A*||_F, A* the float64 exact direction (how much of the spectral budget A uses);
- ``msign-eq``: the matmul FLOPs of the solve over those of one 5-step Polar Express msign of the same matrix.

    python lab/2026-12-06-split-tangent/directions.py RUN/ckpt.pt [--out FILE.md]
"""

from __future__ import annotations

import argparse
import collections
import statistics

import torch
from torch.utils.flop_counter import FlopCounterMode

from geomtrain.optim import spectral_direction
from geomtrain.optim.certificate import certify
from manifolds import DGram, Stiefel, msign
from manifolds.base import to_tall

ARMS = {
    "projected_tangent msign_steps=8": dict(solver="projected_tangent", msign_steps=8),
    "split_tangent msign_steps=5": dict(solver="split_tangent", msign_steps=5),
    "split_tangent (6 steps)": dict(solver="split_tangent"),
    "split_tangent msign_steps=8": dict(solver="split_tangent", msign_steps=8),
    "split_tangent sub_steps=2": dict(solver="split_tangent", sub_steps=2),
}


def flops(fn, *args, **kwargs) -> int:
    """Matmul FLOPs of ``fn(*args, **kwargs)`` (torch's FLOP counter)."""
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ck = torch.load(args.checkpoint, weights_only=False, map_location="cpu")
    rows = collections.defaultdict(list)  # (arm, kind) -> [(gap, length, msign_eq)]
    for group in ck["muon"]["param_groups"]:
        man = {"stiefel": Stiefel(), "dgram": DGram()}.get(group["manifold_name"])
        if man is None:
            continue
        for pid, name in zip(group["params"], group["param_names"]):
            W = to_tall(ck["model"][name]).float()
            G = to_tall(ck["muon"]["state"][pid]["momentum_buffer"]).float()
            A_star, _ = spectral_direction(man, W.double(), G.double(), solver="exact", tol=1e-9, max_iter=300)
            unit = flops(msign, G, "polar_express", steps=5)
            kind = f"{group['manifold_name']} {'attn' if '.attn.' in name else 'mlp'} {tuple(W.shape)}"
            for arm, kw in ARMS.items():
                A, _ = spectral_direction(man, W, G, **kw)
                gap, _ = certify(man, W[None].double(), G[None].double(), A[None].double())
                cost = flops(spectral_direction, man, W, G, **kw) / unit
                rows[(arm, kind)].append((float(gap[0]), float(A.double().norm() / A_star.norm()), cost))
    lines = [
        f"Checkpoint: `{args.checkpoint}` (step {ck['step']}); float32 solves, float64 references.",
        "",
        "| matrices | solver | certified gap | length vs exact | msign-equivalents |",
        "|---|---|---|---|---|",
    ]
    fmt = lambda xs, p: f"{statistics.median(xs):.{p}f} ({min(xs):.{p}f}-{max(xs):.{p}f})"  # noqa: E731
    for (arm, kind), vals in sorted(rows.items(), key=lambda kv: kv[0][1]):
        g, ln, eq = zip(*vals)
        lines.append(f"| {kind} ({len(vals)}) | {arm} | {fmt(g, 3)} | {fmt(ln, 2)} | {fmt(eq, 1)} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
