"""The DGram MLP's column norms under exact and products-only directions.

For each DGram matrix of the first checkpoint (an exact run's): the summed norm rates sum_i (U^T A)_ii of the
directions of exact and of filled_split (refine=0 and 1) on its momenta, and the mean and sd of its column norms
beside those of the same matrix in every other checkpoint given.

    python lab/2026-12-06-filled-split/norms.py EXACT_RUN/ckpt.pt OTHER_RUN/ckpt.pt ... [--out FILE.md]
"""

from __future__ import annotations

import argparse

import torch

from geomtrain.optim import spectral_direction
from manifolds import DGram
from manifolds.base import to_tall

ARMS = {"exact": {"solver": "exact"}, "filled_split refine=0": {"solver": "filled_split", "refine": 0}}
ARMS["filled_split refine=1"] = {"solver": "filled_split", "refine": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cks = [torch.load(p, weights_only=False, map_location="cpu") for p in args.checkpoints]
    group = next(g for g in cks[0]["muon"]["param_groups"] if g["manifold_name"] == "dgram")
    lines = ["| matrix | " + " | ".join(f"sum of norm rates, {a}" for a in ARMS) + " | "]
    lines[0] += " | ".join(f"column norms, mean / sd ({p})" for p in args.checkpoints) + " |"
    lines.append("|---" * (1 + len(ARMS) + len(cks)) + "|")
    for pid, name in zip(group["params"], group["param_names"]):
        W = to_tall(cks[0]["model"][name]).double()
        G = to_tall(cks[0]["muon"]["state"][pid]["momentum_buffer"]).double()
        U = W / W.norm(dim=-2)
        rates = [float((U.mT @ spectral_direction(DGram(), W, G, **kw)[0]).diagonal().sum()) for kw in ARMS.values()]
        norms = [to_tall(ck["model"][name]).double().norm(dim=-2) for ck in cks]
        cells = [f"{r:+.3f}" for r in rates] + [f"{float(d.mean()):.3f} / {float(d.std()):.3f}" for d in norms]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
