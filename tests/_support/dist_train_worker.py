"""Launched by torchrun from tests/train/test_train_distributed.py: train, then write per-rank checksums."""

import json
import sys

import torch
import torch.distributed as dist

from geomtrain.config import make_config
from geomtrain.train import distributed_from_env, train


def run_config(data_dir: str, out_dir: str):
    """The run both sides train: this worker under torchrun, and the test in one process."""
    return make_config(
        dict(
            model="tiny",
            data_dir=data_dir,
            out_dir=out_dir,
            preset="hetero",
            max_iters=6,
            batch_size=4,
            warmup_iters=2,
            eval_interval=3,
            eval_iters=1,
            log_interval=1,
            progress=False,
            seed=5,
        )
    )


def main(data_dir: str, out_dir: str, report: str) -> None:
    cfg = run_config(data_dir, out_dir)
    with distributed_from_env():
        captured = {}
        train(
            cfg,
            print_fn=lambda *a: None,
            on_finish=lambda model: captured.update({k: v.detach().clone() for k, v in model.state_dict().items()}),
        )
        flat = torch.cat([v.double().flatten() for v in captured.values()])
        gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        if dist.get_rank() == 0:
            same = all(torch.equal(gathered[0], g) for g in gathered[1:])
            with open(report, "w") as fh:
                json.dump({"ranks_identical": same, "world_size": dist.get_world_size()}, fh)
        captured.clear()


if __name__ == "__main__":
    main(*sys.argv[1:4])
