"""Benchmarks: ``geomtrain bench <name>`` (also ``python -m geomtrain.bench <name>``).

- ``optimizer`` (`geomtrain.bench.optimizer`): one Manifold Muon direction per solver against
  AdamW and plain Muon at GPT-2-small matrix shapes, on the synthetic problems of
  `geomtrain.bench.problems`.
- ``train`` (`geomtrain.bench.training`): the full training step per preset, side by side.
- ``dist`` (`geomtrain.bench.dist`): Manifold Muon's DDP exchange, bytes and collectives per step.
- ``manifold`` (`geomtrain.bench.manifold`): a manifold defined by ``project_gram`` alone (the generic,
  products-only maps) against the built-in DGram: ``projx``, ``proju``, ``retr`` and an optimizer step.

Each benchmark module exposes ``add_parser(subparsers)``; its handler is ``handler(args) -> int``
(``args.argv`` holds the command line, for the record) and reports bad input as a `ValueError`, which
the CLI prints as one line (exit code 2). `geomtrain.cli` nests them under ``bench``; this package
never imports the CLI (``python -m geomtrain.bench`` is `geomtrain.bench.__main__`, an entry script).
"""

from __future__ import annotations

from . import dist, manifold, optimizer, training
from .optimizer import GPT2_SHAPES, bench_optimizer, format_optimizer_table
from .training import format_speed_table, measure_training_speed

__all__ = [
    "bench_optimizer",
    "format_optimizer_table",
    "GPT2_SHAPES",
    "measure_training_speed",
    "format_speed_table",
    "BENCHMARKS",
]

BENCHMARKS = {
    "optimizer": optimizer.add_parser,
    "train": training.add_parser,
    "dist": dist.add_parser,
    "manifold": manifold.add_parser,
}
