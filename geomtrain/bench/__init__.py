"""Benchmarks: ``geomtrain bench <name>`` (also ``python -m geomtrain.bench <name>``).

- ``optimizer`` (`geomtrain.bench.optimizer`): one Manifold Muon direction per solver against
  AdamW and plain Muon at GPT-2-small matrix shapes.
- ``train`` (`geomtrain.bench.training`): the full training step per preset, side by side.

Each benchmark module exposes ``add_parser(subparsers)``; its handler is ``handler(args) -> int``
(``args.argv`` holds the command line, for the record). `geomtrain.cli` nests them under ``bench``.
"""

from __future__ import annotations

import sys

from . import optimizer, training
from .optimizer import GPT2_SHAPES, bench_optimizer, format_optimizer_table
from .training import format_speed_table, measure_training_speed

__all__ = [
    "main",
    "bench_optimizer",
    "format_optimizer_table",
    "GPT2_SHAPES",
    "measure_training_speed",
    "format_speed_table",
    "BENCHMARKS",
]

BENCHMARKS = {"optimizer": optimizer.add_parser, "train": training.add_parser}


def main(argv: list[str] | None = None) -> int:
    """``python -m geomtrain.bench ARGS`` is ``geomtrain bench ARGS``."""
    from ..cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])
