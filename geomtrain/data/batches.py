"""Batches of a token array: stateless, a pure function of ``(seed, step, rank)``.

:func:`get_batch` draws its offsets from a generator seeded by ``(seed, step)`` only, so a run
resumed at step ``k`` sees exactly the batches it would have seen, and a ``world_size``-rank run
sees the same global batch as a single process. Evaluation batches come from a separate seed
stream and are the same on every call.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from .folder import MANIFEST_NAME, load_manifest, open_tokens, split_path

__all__ = ["TokenData", "fixed_batch", "get_batch", "iter_eval_batches"]

# Stream tag mixed into the seed of evaluation batches so they never coincide with the
# training batch of some step (must be non-zero: SeedSequence pads entropy with zeros).
EVAL_STREAM = 0x5EED_E7A1


class TokenData:
    """One split of prepared tokens, memory-mapped, with the batch functions bound to it.

    ``TokenData("data/classics", "val")`` or ``TokenData("data/classics/val.bin")``.
    """

    def __init__(self, path_or_dir: str | os.PathLike, split: str = "train"):
        p = Path(path_or_dir)
        self.path = p if p.is_file() else split_path(p, split)
        self.split = p.stem if p.is_file() else split
        self.tokens = open_tokens(self.path)
        manifest_path = self.path.parent / MANIFEST_NAME
        self.manifest: dict | None = load_manifest(self.path.parent) if manifest_path.is_file() else None

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"TokenData({str(self.path)!r}, tokens={len(self):,})"

    def get_batch(self, batch_size: int, block_size: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.tokens, batch_size, block_size, **kwargs)

    def fixed_batch(self, batch_size: int, block_size: int, seed: int, **kwargs):
        return fixed_batch(self.tokens, batch_size, block_size, seed, **kwargs)

    def iter_eval_batches(self, batch_size: int, block_size: int, n_batches: int, seed: int, **kwargs):
        return iter_eval_batches(self.tokens, batch_size, block_size, n_batches, seed, **kwargs)


def _as_tokens(tokens) -> np.ndarray:
    return tokens.tokens if isinstance(tokens, TokenData) else tokens


def _draw_offsets(n_tokens: int, count: int, block_size: int, entropy: Sequence[int]) -> np.ndarray:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if n_tokens < block_size + 1:
        raise ValueError(f"{n_tokens} tokens are too few for block_size {block_size} (need block_size + 1)")
    if any(int(e) < 0 for e in entropy):
        raise ValueError(f"seed and step must be non-negative, got {tuple(entropy)}")
    rng = np.random.default_rng(np.random.SeedSequence([int(e) for e in entropy]))
    return rng.integers(0, n_tokens - block_size, size=count, dtype=np.int64)


def _rank_slice(offsets: np.ndarray, batch_size: int, rank: int, world_size: int) -> np.ndarray:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return offsets[rank * batch_size : (rank + 1) * batch_size]


def _gather(tokens, offsets: np.ndarray, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.asarray(tokens[offsets[:, None] + np.arange(block_size + 1)], dtype=np.int64)
    x = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
    device = torch.device(device)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def get_batch(
    tokens,
    batch_size: int,
    block_size: int,
    *,
    seed: int,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of ``step``: ``(x, y)`` int64 tensors of shape (batch_size, block_size).

    Stateless: a generator seeded from ``(seed, step)`` draws ``world_size * batch_size`` offsets
    ``i`` (the *global* batch); rank ``r`` takes rows ``[r*batch_size, (r+1)*batch_size)``, with
    ``x = tokens[i:i+T]`` and ``y = tokens[i+1:i+T+1]``. Hence the concatenation over ranks is the
    same for any split of the global batch, and resuming at ``step`` reproduces the data order.
    ``batch_size`` is the per-rank batch size.
    """
    tokens = _as_tokens(tokens)
    offsets = _draw_offsets(len(tokens), world_size * batch_size, block_size, (seed, step))
    return _gather(tokens, _rank_slice(offsets, batch_size, rank, world_size), block_size, device)


def iter_eval_batches(
    tokens,
    batch_size: int,
    block_size: int,
    n_batches: int,
    seed: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` evaluation batches, the same on every call (and never a training batch's
    offsets for the same seed: they come from a separate seed stream). Rank-sliced as
    :func:`get_batch`."""
    tokens = _as_tokens(tokens)
    for k in range(n_batches):
        offsets = _draw_offsets(len(tokens), world_size * batch_size, block_size, (seed, k, EVAL_STREAM))
        yield _gather(tokens, _rank_slice(offsets, batch_size, rank, world_size), block_size, device)


def fixed_batch(
    tokens,
    batch_size: int,
    block_size: int,
    seed: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One evaluation batch, the same every call (the first of :func:`iter_eval_batches`)."""
    return next(
        iter_eval_batches(tokens, batch_size, block_size, 1, seed, rank=rank, world_size=world_size, device=device)
    )
