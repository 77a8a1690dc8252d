"""Benchmarks: ``geomtrain bench <name>`` (also ``python -m geomtrain.bench <name>``).

- ``optimizer`` (`geomtrain.bench.optimizer`): one Manifold Muon direction per solver against
  AdamW and plain Muon at GPT-2-small matrix shapes.
- ``train`` (`geomtrain.bench.training`): the full training step per preset, side by side.

Each benchmark module exposes ``add_parser(subparsers)``; its handler is ``handler(args, argv)``.
"""
from __future__ import annotations

import argparse
import sys

from . import optimizer, training
from .optimizer import GPT2_SHAPES, bench_optimizer, format_optimizer_table
from .training import format_speed_table, measure_training_speed

__all__ = ["main", "build_parser", "bench_optimizer", "format_optimizer_table", "GPT2_SHAPES",
           "measure_training_speed", "format_speed_table", "BENCHMARKS"]

BENCHMARKS = {"optimizer": optimizer.add_parser, "train": training.add_parser}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geomtrain bench", description="Benchmarks: " + ", ".join(BENCHMARKS) + ".")
    sub = parser.add_subparsers(dest="bench", metavar="{" + ",".join(BENCHMARKS) + "}", required=True)
    for add in BENCHMARKS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args, argv) or 0)
    except ValueError as exc:
        print(f"geomtrain bench {args.bench}: error: {exc}", file=sys.stderr)
        return 2
