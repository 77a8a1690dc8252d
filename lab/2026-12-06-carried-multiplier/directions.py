"""filled_split with its multiplier carried (``carry=True``), on the fixed problems of a training checkpoint.

Each solve of a carried run starts its joint msign from the correction the previous solve returned, so on a fixed
(W, G) the k-th solve is the fixed-point iteration's k-th step, one joint msign each. Per Stiefel and DGram matrix
kind (median, and range over the matrices): the exact float64 certified relative dual gap
(`geomtrain.optim.certificate.certify`) of the cold start (``carry=False``), of ``refine=1``, of the k-th carried
solve from cold and, for a checkpoint trained with ``carry=True``, of the solve from the multiplier it carried,
and the matmul FLOPs of one solve over those of one 5-step Polar Express msign of the same matrix. G is the
checkpoint's momentum buffer.

    python lab/2026-12-06-carried-multiplier/directions.py RUN/ckpt.pt [--solves 8] [--out FILE.md]
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


def matmul_flops(fn, *args, **kwargs) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


def carried_correction(manifold, W, G, state: dict) -> torch.Tensor | None:
    """The correction C to N(G) of the multiplier a checkpoint carried: its ``correction`` (carry=True from 884932a
    on), or from a ``dual`` S (the multiplier itself, Lambda = -S, as 612600b carried it): C = -S - N(G / ||G||_F)."""
    n = W.shape[-1]
    if "correction" in state:
        return state["correction"].reshape(n, n).float()
    if "dual" in state:
        return -state["dual"].reshape(n, n).float() - manifold.normal_multiplier(
            W, G / G.norm()
        )  # the geometry owns it since ae12848
    return None


def gap_of(manifold, W, G, A) -> float:
    return float(certify(manifold, W[None].double(), G[None].double(), A[None].double())[0])


def summary(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--solves", type=int, default=8, help="carried solves on each fixed problem")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ck = torch.load(args.checkpoint, weights_only=False, map_location="cpu")
    rows = collections.defaultdict(lambda: collections.defaultdict(list))  # kind -> arm -> [value]
    for group in ck["muon"]["param_groups"]:
        manifold = {"stiefel": Stiefel(), "dgram": DGram()}.get(group["manifold_name"])
        if manifold is None:
            continue
        for pid, name in zip(group["params"], group["param_names"]):
            W = to_tall(ck["model"][name]).float()
            G = to_tall(ck["muon"]["state"][pid]["momentum_buffer"]).float()
            if W.shape[-2] == W.shape[-1]:
                continue  # a square matrix has no complement: carry does not apply
            kind = f"{group['manifold_name']} {'attn' if '.attn.' in name else 'mlp'} {tuple(W.shape)}"
            unit = matmul_flops(msign, G, "polar_express", steps=5)
            arm = rows[kind]
            for label, kw in (("refine=0", {"carry": False}), ("refine=1", {"carry": False, "refine": 1})):
                A, _ = spectral_direction(manifold, W, G, solver="filled_split", **kw)
                arm[label].append(gap_of(manifold, W, G, A))
                cost = matmul_flops(spectral_direction, manifold, W, G, solver="filled_split", **kw)
                arm[f"{label} cost"].append(cost / unit)
            C = carried_correction(manifold, W, G, ck["muon"]["state"][pid])
            if C is not None:  # a checkpoint trained with carry=True: start from the multiplier it carried
                A, _ = spectral_direction(manifold, W, G, solver="filled_split", correction=C)
                arm["carried in training"].append(gap_of(manifold, W, G, A))
            carried = None
            for k in range(1, args.solves + 1):
                kw = {"carry": True} if carried is None else {"carry": True, "correction": carried}
                if k == 1:
                    cost = matmul_flops(spectral_direction, manifold, W, G, solver="filled_split", **kw)
                    arm["carry cost"].append(cost / unit)
                A, stats = spectral_direction(manifold, W, G, solver="filled_split", **kw)
                carried = stats.state["correction"]
                arm[f"carry, solve {k}"].append(gap_of(manifold, W, G, A))
    lines = [f"Checkpoint `{args.checkpoint}`; certified gap (median, range over the matrices)", ""]
    for kind, arm in rows.items():
        lines += [f"### {kind}, {len(arm['refine=0'])} matrices", ""]
        lines += ["| arm | certified gap | msign-equivalents |", "|---|---|---|"]
        for label in ("refine=0", "refine=1"):
            lines.append(f"| {label} | {summary(arm[label], 4)} | {summary(arm[label + ' cost'], 2)} |")
        if arm["carried in training"]:
            carried = summary(arm["carried in training"], 4)
            lines.append(f"| carried in training (from the checkpoint's multiplier) | {carried} | |")
        for k in range(1, args.solves + 1):
            cost = summary(arm["carry cost"], 2) if k == 1 else ""
            lines.append(f"| carry, solve {k} | {summary(arm[f'carry, solve {k}'], 4)} | {cost} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
