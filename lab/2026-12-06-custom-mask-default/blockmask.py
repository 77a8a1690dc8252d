"""Registers ``blockmask`` (`geomtrain.bench.problems.BlockMask`: columns orthogonal across blocks, written with
``project_gram`` only, so every map and solve takes the generic path) for this record's studies:
``--set manifold_modules=blockmask`` with this folder on ``PYTHONPATH``."""

from geomtrain.bench.problems import BlockMask
from manifolds import register

register("blockmask", BlockMask, overwrite=True)

if __name__ == "__main__":  # a module, not a script: it only answers --help
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
