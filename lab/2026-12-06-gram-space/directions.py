"""The products-only directions computed in Gram space against the same directions on the tall matrices.

On the Stiefel and DGram matrices of a training checkpoint, per arm and matrix kind (median, and range over the
matrices): the exact float64 certified relative dual gap (`geomtrain.optim.certificate.certify`), the length
||A||_F / ||A*||_F (A* the float64 exact direction), the relative distance to the same solver's tall-space
direction, and the matmul FLOPs of the solve over those of one 5-step Polar Express msign of the same matrix
(msign-equivalents).

    python lab/2026-12-06-gram-space/directions.py RUN/ckpt.pt [--out FILE.md]
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

ARMS = {  # name -> spectral_direction's solver and options; each Gram arm has its tall twin
    "split_tangent": {"solver": "split_tangent"},
    "split_tangent space=tall": {"solver": "split_tangent", "space": "tall"},
    "filled_split (joint, refine=0)": {"solver": "filled_split"},
    "filled_split (joint, refine=0) space=tall": {"solver": "filled_split", "space": "tall"},
    "filled_split refine=1": {"solver": "filled_split", "refine": 1},
    "filled_split square=split refine=1 space=tall": {
        "solver": "filled_split",
        "square": "split",
        "refine": 1,
        "space": "tall",
    },
}


def matmul_flops(fn, *args, **kwargs) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


def summary(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ck = torch.load(args.checkpoint, weights_only=False, map_location="cpu")
    rows = collections.defaultdict(list)  # (kind, arm) -> [(gap, length, distance to tall, cost)]
    for group in ck["muon"]["param_groups"]:
        manifold = {"stiefel": Stiefel(), "dgram": DGram()}.get(group["manifold_name"])
        if manifold is None:
            continue
        for pid, name in zip(group["params"], group["param_names"]):
            W = to_tall(ck["model"][name]).float()
            G = to_tall(ck["muon"]["state"][pid]["momentum_buffer"]).float()
            A_star, _ = spectral_direction(manifold, W.double(), G.double(), solver="exact", tol=1e-9, max_iter=300)
            unit = matmul_flops(msign, G, "polar_express", steps=5)
            kind = f"{group['manifold_name']} {'attn' if '.attn.' in name else 'mlp'} {tuple(W.shape)}"
            for arm, kw in ARMS.items():
                A, _ = spectral_direction(manifold, W, G, **kw)
                twin, _ = spectral_direction(manifold, W, G, **{**kw, "space": "tall"})
                gap, _ = certify(manifold, W[None].double(), G[None].double(), A[None].double())
                cost = matmul_flops(spectral_direction, manifold, W, G, **kw) / unit
                length = float(A.double().norm() / A_star.norm())
                distance = float((A - twin).double().norm() / twin.double().norm())
                rows[(kind, arm)].append((float(gap[0]), length, distance, cost))
    lines = [
        f"Checkpoint: `{args.checkpoint}` (step {ck['step']}); float32 solves, float64 references.",
        "",
        "| matrices | solver | certified gap | length vs exact | distance to the tall path | msign-equivalents |",
        "|---|---|---|---|---|---|",
    ]
    for (kind, arm), vals in sorted(rows.items()):
        gap, length, distance, cost = zip(*vals)
        lines.append(
            f"| {kind} ({len(vals)}) | {arm} | {summary(list(gap), 4)} | {summary(list(length), 3)} | "
            f"{summary(list(distance), 4)} | {summary(list(cost), 2)} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
