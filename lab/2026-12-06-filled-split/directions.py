"""filled_split directions on the Stiefel and DGram matrices of a training checkpoint, against split_tangent.

Per arm and matrix kind (median, and range over the matrices): the exact float64 certified relative dual gap
(`geomtrain.optim.certificate.certify`), the length ||A||_F / ||A*||_F (A* the float64 exact direction), the
smallest singular value of A, the square part's share alpha (filled_split only) and the matmul FLOPs of the solve
over those of one 5-step Polar Express msign of the same matrix (msign-equivalents).

    python lab/2026-12-06-filled-split/directions.py RUN/ckpt.pt [--out FILE.md]
"""

from __future__ import annotations

import argparse
import collections
import statistics

import torch
from torch.utils.flop_counter import FlopCounterMode

from geomtrain.optim import spectral_direction
from geomtrain.optim.certificate import certify
from geomtrain.optim.filled_split import OPTIONS, filled_split_direction
from manifolds import DGram, Stiefel, msign
from manifolds.base import to_tall

ARMS = {  # name -> spectral_direction's solver and options (each solver's own 6 Polar Express steps)
    "split_tangent": {"solver": "split_tangent"},
    "filled_split refine=0": {"solver": "filled_split", "refine": 0},
    "filled_split square=joint refine=0": {"solver": "filled_split", "square": "joint", "refine": 0},
    "filled_split (refine=1, its default)": {"solver": "filled_split", "refine": 1},
    # what training ran before cc61981: ManifoldMuon's 5 Polar Express steps in place of the solvers' 6
    "split_tangent msign_steps=5": {"solver": "split_tangent", "msign_steps": 5},
    "filled_split refine=0 msign_steps=5": {"solver": "filled_split", "refine": 0, "msign_steps": 5},
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
    rows = collections.defaultdict(list)  # (kind, arm) -> [(gap, length, smallest singular value, share, cost)]
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
                gap, _ = certify(manifold, W[None].double(), G[None].double(), A[None].double())
                cost = matmul_flops(spectral_direction, manifold, W, G, **kw) / unit
                options = {**OPTIONS, **{k: v for k, v in kw.items() if k != "solver"}}
                share = float(filled_split_direction(manifold, W, G, options)[1])
                low = float(torch.linalg.svdvals(A.double()).min())
                length = float(A.double().norm() / A_star.norm())
                rows[(kind, arm)].append((float(gap[0]), length, low, share, cost))
    lines = [
        f"Checkpoint: `{args.checkpoint}` (step {ck['step']}); float32 solves, float64 references.",
        "",
        "| matrices | solver | certified gap | length vs exact | smallest singular value | share | msign-equivalents |",
        "|---|---|---|---|---|---|---|",
    ]
    for (kind, arm), vals in sorted(rows.items()):
        gap, length, low, share, cost = zip(*vals)
        shares = summary(list(share), 3) if arm.startswith("filled_split") else "-"
        lines.append(
            f"| {kind} ({len(vals)}) | {arm} | {summary(list(gap), 3)} | {summary(list(length), 3)} | "
            f"{summary(list(low), 2)} | {shares} | {summary(list(cost), 1)} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
