r"""Evaluate a checkpoint: loss and perplexity on a prepared data folder (``geomtrain eval RUN``).

The loss is the mean next-token cross-entropy (nats) over ``iters`` batches of ``batch_size``
sequences of the model's block size, drawn from ``split`` with the same seeded sampler the
trainer uses for its evaluations (`geomtrain.data.iter_eval_batches`); perplexity is
$e^{\text{loss}}$. With the run's own data folder, split ``val``, its ``eval_iters`` and seed,
the loss of a float32 run equals the ``val_loss`` the trainer logged at that checkpoint's step.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from . import data as gdata
from .model import GPT, GPTConfig
from .train import load_checkpoint, resolve_device

__all__ = ["load_model", "evaluate_checkpoint"]


def load_model(run: str | Path, device: str = "cpu") -> tuple[GPT, dict]:
    """The model of a run folder's (or a file's) verified checkpoint, in eval mode, and the checkpoint."""
    dev = resolve_device(device)
    ckpt = load_checkpoint(run, map_location=dev)
    model = GPT(GPTConfig(**ckpt["model_config"])).to(dev)
    model.load_state_dict(ckpt["model"])
    return model.eval(), ckpt


@torch.no_grad()
def evaluate_checkpoint(
    run: str | Path,
    data_dir: str | None = None,
    split: str = "val",
    iters: int | None = None,
    batch_size: int | None = None,
    seed: int | None = None,
    device: str = "cpu",
) -> dict:
    """Loss and perplexity of a checkpoint; defaults (data folder, iters, batch, seed) are the run's own.

    Returns ``{"run", "step", "data_dir", "split", "loss", "perplexity", "tokens", "batches"}``."""
    if split not in gdata.SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(gdata.SPLITS)}")
    model, ckpt = load_model(run, device)
    cfg = ckpt.get("config", {})
    data_dir = data_dir or cfg.get("data_dir")
    iters = iters or cfg.get("eval_iters", 10)
    batch_size = batch_size or min(cfg.get("batch_size", 16), 16)
    seed = cfg.get("seed", 0) if seed is None else seed
    for name, value in (("iters", iters), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    gdata.verify_cached(data_dir, vocab_size=model.config.vocab_size)
    tokens = gdata.load_split(data_dir, split, block_size=model.config.block_size)
    dev = next(model.parameters()).device
    losses = []
    for x, y in gdata.iter_eval_batches(tokens, batch_size, model.config.block_size, iters, seed):
        _, loss = model(x.to(dev), y.to(dev))
        losses.append(float(loss))
    loss = float(np.mean(losses))
    return {
        "run": str(run),
        "step": ckpt.get("step"),
        "data_dir": str(data_dir),
        "split": split,
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "batches": len(losses),
        "tokens": len(losses) * batch_size * model.config.block_size,
    }
