"""Launched by torchrun (or run as one process) from tests/train/test_train_fsdp.py: train runs of the
``tiny`` model, then write what the test compares (losses, whole weights) as a ``.pt`` file.

    fsdp_worker.py DATA_DIR OUT_ROOT REPORT.pt MODE PRESET[,PRESET...] [KEY=VALUE ...]

MODE ``fsdp``: one run per preset in ``OUT_ROOT/<preset>`` with ``fsdp=True``; ``ddp`` or ``single``: without
(DDP under torchrun, else one process);
MODE ``resume``: continue the run in ``OUT_ROOT/<preset>`` (``--resume``). ``KEY=VALUE`` are config keys
(`geomtrain.config.parse_assignments`), e.g. ``max_iters=10 stop_after=5``. The report maps each preset to
``{"losses": {step: loss}, "weights": {name: whole tensor}, "start": {name: whole tensor}}`` (``start``:
the weights just after loading, for resume), written by rank 0. Each rank writes its PID to
``OUT_ROOT/rank<r>.pid`` first.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from geomtrain.config import make_config, parse_assignments
from geomtrain.runfolder import RunFolder, resume_config
from geomtrain.train import Trainer, distributed_from_env, train


def worker_config(data_dir: str, out_dir: str, preset: str, **overrides):
    """The run both sides train: 20 steps of ``tiny`` (batch 4, block 32), an evaluation and checkpoint every 10."""
    keys = dict(
        model="tiny",
        data_dir=data_dir,
        out_dir=out_dir,
        preset=preset,
        max_iters=20,
        batch_size=4,
        block_size=32,
        warmup_iters=2,
        eval_interval=10,
        eval_iters=1,
        log_interval=1,
        diag_batch_size=2,
        progress=False,
        seed=5,
    )
    return make_config({**keys, **overrides})


def whole(model) -> dict:
    """The model's weights as whole tensors on every rank (a DTensor's ``full_tensor``: a collective)."""
    out = {}
    for name, t in model.state_dict().items():
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    return out


def losses(out_dir) -> dict:
    return {r["step"]: r["loss"] for r in RunFolder(out_dir).read_metrics() if r["kind"] == "train"}


def run_one(data_dir: str, out_dir: str, mode: str, preset: str, overrides: dict) -> dict:
    """One run (or resume) of ``preset`` in ``out_dir``: its losses, final and (resume) loaded weights."""
    final: dict = {}
    start: dict = {}
    if mode == "resume":
        cfg = resume_config({"out_dir": out_dir, "progress": False, **overrides})
        original = Trainer.load_state_dict

        def capture(self, ckpt):  # the weights right after loading
            original(self, ckpt)
            start.update(whole(self.model))

        Trainer.load_state_dict = capture
        try:
            train(cfg, resume=True, print_fn=lambda *a: None, on_finish=lambda m: final.update(whole(m)))
        finally:
            Trainer.load_state_dict = original
    else:
        cfg = worker_config(data_dir, out_dir, preset, fsdp=mode == "fsdp", **overrides)
        train(cfg, print_fn=lambda *a: None, on_finish=lambda m: final.update(whole(m)))
    return {"losses": losses(out_dir), "weights": final, "start": start}


def main(data_dir: str, out_root: str, report: str, mode: str, presets: str, *keys: str) -> None:
    overrides = parse_assignments(keys)
    with distributed_from_env():
        rank = dist.get_rank() if dist.is_initialized() else 0
        Path(out_root).mkdir(parents=True, exist_ok=True)
        Path(out_root, f"rank{rank}.pid").write_text(str(os.getpid()))  # the kill test's target
        results = {p: run_one(data_dir, f"{out_root}/{p}", mode, p, overrides) for p in presets.split(",")}
        if rank == 0:
            torch.save(results, report)
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
