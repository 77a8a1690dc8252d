"""Launched by torchrun from tests/optim/test_muon_distributed.py (or called in-process for the 1-process
reference): a few ManifoldMuon steps on a mix of manifolds, then write this rank's parameters,
optimizer state and statistics to ``<out_dir>/rank<r>.pt``: ``python dist_optim_worker.py OUT [LAYOUT]``,
LAYOUT ``mixed`` (default: the bucketed exchange) or ``buckets`` (uneven buckets of 3, 5 and 1 matrices, run
with the bucketed exchange and with the per-matrix broadcasts, under ``"bucketed"`` and ``"broadcast"``)."""

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from geomtrain.optim import ManifoldMuon
from manifolds import DGram, Oblique, Stiefel

STEPS = 4
MODES = ("bucketed", "broadcast")  # ManifoldMuon(bucketed=True / False)


def make_params():
    gen = torch.Generator().manual_seed(0)
    return {
        **{f"st{i}": torch.nn.Parameter(Stiefel().random(12, 5, generator=gen)) for i in range(3)},
        **{f"dg{i}": torch.nn.Parameter(DGram().random(5, 12, generator=gen)) for i in range(2)},
        "ob": torch.nn.Parameter(Oblique().random(2, 9, 4, generator=gen)),
        "eu": torch.nn.Parameter(torch.randn(8, 6, generator=gen)),
    }


def make_bucket_params():
    """Buckets of 3 (two Stiefel and a Euclidean 12x5: with and without warm-start state), 5 (Oblique 9x4)
    and 1 (DGram 5x12: fewer matrices than ranks) matrices."""
    gen = torch.Generator().manual_seed(1)
    return {
        **{f"st{i}": torch.nn.Parameter(Stiefel().random(12, 5, generator=gen)) for i in range(2)},
        "eu": torch.nn.Parameter(torch.randn(12, 5, generator=gen)),
        **{f"ob{i}": torch.nn.Parameter(Oblique().random(9, 4, generator=gen)) for i in range(5)},
        "dg1": torch.nn.Parameter(DGram().random(5, 12, generator=gen)),
    }


def param_groups(params: dict) -> list[dict]:
    """One group per manifold, by name prefix, in the order st, dg, ob, then ``eu`` (Euclidean, weight decay)."""
    manifolds = {"st": Stiefel(), "dg": DGram(), "ob": Oblique()}
    groups = [
        {"params": [p for n, p in params.items() if n.startswith(prefix)], "manifold": m}
        for prefix, m in manifolds.items()
    ]
    return [g for g in groups if g["params"]] + [{"params": [params["eu"]], "weight_decay": 0.1}]


def run(steps: int = STEPS, layout: str = "mixed", bucketed: bool = True):
    params = make_params() if layout == "mixed" else make_bucket_params()
    opt = ManifoldMuon(param_groups(params), lr=0.05, bucketed=bucketed)
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


def main(out_dir: str, layout: str = "mixed") -> None:
    dist.init_process_group("gloo")
    try:
        keys = ("params", "state", "stats")
        if layout == "mixed":
            record = dict(zip(keys, run()))
        else:
            record = {mode: dict(zip(keys, run(layout=layout, bucketed=mode == "bucketed"))) for mode in MODES}
        record["world_size"] = dist.get_world_size()
        torch.save(record, Path(out_dir) / f"rank{dist.get_rank()}.pt")
        gc.collect()  # nothing that touched the process group may outlive it (gloo aborts at exit otherwise)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
