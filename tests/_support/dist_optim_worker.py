"""Launched by torchrun from tests/optim/test_muon_distributed.py (or called in-process for the 1-process
reference): a few ManifoldMuon steps on a mix of manifolds, then write this rank's parameters,
optimizer state and statistics to ``<out_dir>/rank<r>.pt``."""

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from geomtrain.optim import ManifoldMuon
from manifolds import DGram, Oblique, Stiefel

STEPS = 4


def make_params():
    gen = torch.Generator().manual_seed(0)
    return {
        **{f"st{i}": torch.nn.Parameter(Stiefel().random(12, 5, generator=gen)) for i in range(3)},
        **{f"dg{i}": torch.nn.Parameter(DGram().random(5, 12, generator=gen)) for i in range(2)},
        "ob": torch.nn.Parameter(Oblique().random(2, 9, 4, generator=gen)),
        "eu": torch.nn.Parameter(torch.randn(8, 6, generator=gen)),
    }


def run(steps: int = STEPS):
    params = make_params()
    opt = ManifoldMuon(
        [
            {"params": [params[f"st{i}"] for i in range(3)], "manifold": Stiefel()},
            {"params": [params["dg0"], params["dg1"]], "manifold": DGram()},
            {"params": [params["ob"]], "manifold": Oblique()},
            {"params": [params["eu"]], "weight_decay": 0.1},
        ],
        lr=0.05,
    )
    stats = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)  # the same gradients on every rank
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen)
        if step == 2:
            params["dg1"].grad[0, 0] = float("nan")  # one skipped update, decided identically everywhere
        opt.step()
        stats.append(dict(opt.last_stats))
    state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    return {k: v.detach().clone() for k, v in params.items()}, state, stats


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    try:
        params, state, stats = run()
        torch.save(
            {"params": params, "state": state, "stats": stats, "world_size": dist.get_world_size()},
            Path(out_dir) / f"rank{dist.get_rank()}.pt",
        )
        gc.collect()  # nothing that touched the process group may outlive it (gloo aborts at exit otherwise)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
