"""Training steps of the paper's setting, per preset: tokens/s, MFU, the optimizer's share of a step
and peak memory. Part of scripts/gpu_checks.sh; on a CPU it is a smoke test (MFU and memory: "-").

    python3 scripts/recipe_steps.py --model gpt2 --device cuda --steps 50 --seconds 600 --out recipe.json

Each preset gets ``--seconds / presets`` of wall time and stops early (the steps done are reported);
the first ``--warmup`` steps (compilation, cuSOLVER start-up) are not in the medians. The optimizer
phase (AdamW + Manifold Muon ``step()``) is timed with the optimizers' step hooks, synchronising
CUDA around it. ``--set KEY=VALUE`` applies config keys (e.g. ``batch_size=32``, ``grad_accum=2``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from geomtrain.assign import PRESETS
from geomtrain.config import make_config, parse_assignments
from geomtrain.hardware import mfu, model_flops_per_token, peak_bf16_flops
from geomtrain.train import Trainer


def optimizer_timer(trainer: Trainer) -> list[float]:
    """Seconds of each optimizer phase (all optimizers of one step summed), filled by step hooks."""
    seconds: list[float] = []
    started: list[float] = []
    cuda = trainer.device.type == "cuda"

    def before(*_):
        if cuda:
            torch.cuda.synchronize(trainer.device)
        started.append(time.perf_counter())

    def after(*_):
        if cuda:
            torch.cuda.synchronize(trainer.device)
        seconds.append(time.perf_counter() - started.pop())

    for opt in trainer.optimizers():
        opt.register_step_pre_hook(before)
        opt.register_step_post_hook(after)
    return seconds


def measure(cfg, steps: int, warmup: int, budget_s: float) -> dict:
    """One preset: up to ``warmup + steps`` steps within ``budget_s`` seconds; medians over the timed ones."""
    trainer = Trainer(cfg)
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    opt_seconds = optimizer_timer(trainer)
    n_opts = len(trainer.optimizers())
    step_s, share, evaluations = [], [], []
    t_end = time.perf_counter() + budget_s
    for i in range(warmup + steps):
        before = len(opt_seconds)
        r = trainer.step()
        if i >= warmup:
            step_s.append(r.seconds)
            share.append(sum(opt_seconds[before:]) / r.seconds if len(opt_seconds) - before == n_opts else 0.0)
            evaluations.append(int(r.muon.get("msign_calls", 0) or 0))
        if time.perf_counter() > t_end and step_s:
            break
    tokens = cfg.batch_size * cfg.grad_accum * trainer.block
    ms = 1000 * statistics.median(step_s)
    row = {
        "preset": cfg.preset,
        "steps_timed": len(step_s),
        "ms_per_step": ms,
        "tokens_per_s": tokens / (ms / 1000),
        "mfu": mfu(
            model_flops_per_token(trainer.model, trainer.block), tokens / (ms / 1000), peak_bf16_flops(trainer.device)
        ),
        "optimizer_share": statistics.median(share),
        "evaluations_per_step": statistics.median(evaluations),
        "peak_memory_gib": torch.cuda.max_memory_allocated(trainer.device) / 2**30 if cuda else None,
        "last_loss": r.loss,
    }
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return row


def format_rows(rows: list[dict]) -> str:
    dash = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = ["| preset | steps | ms/step | tokens/s | MFU | optimizer share | evaluations/step | peak GiB |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["preset"], str(r["steps_timed"]), f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}"]
        cells += [dash(r["mfu"], ".1%"), f"{r['optimizer_share']:.0%}", f"{r['evaluations_per_step']:.0f}"]
        cells.append(dash(r["peak_memory_gib"], ".1f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--data-dir", default="data/classics")
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seconds", type=float, default=600.0, help="wall-time budget of all presets together")
    p.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE config override")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    presets = [s for s in args.presets.split(",") if s]
    rows = []
    for preset in presets:
        keys = dict(model=args.model, data_dir=args.data_dir, device=args.device, preset=preset, progress=False)
        cfg = make_config({**parse_assignments(args.sets), **keys, "max_iters": args.warmup + args.steps})
        rows.append(measure(cfg, args.steps, args.warmup, args.seconds / len(presets)))
        print(f"recipe: {preset}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print(format_rows(rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"model": args.model, "sets": args.sets, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
