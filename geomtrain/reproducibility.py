"""Process settings that make CPU runs bit-reproducible (no torch import here)."""
from __future__ import annotations

import os

__all__ = ["reproducible_cpu_math"]


def reproducible_cpu_math() -> None:
    """Ask Intel MKL (torch's CPU BLAS/LAPACK) for conditional numerical reproducibility.

    By default MKL may pick a different code path depending on how a buffer happens to be aligned
    in memory, so the same run can round differently in the last bits from one process to the next,
    and training amplifies that into visibly different losses. ``MKL_CBWR=AUTO`` fixes the path for
    this CPU. A value the user set is kept. Measured on this machine: the same all-Stiefel run
    (mini, seed 1) gave loss 6.4564 or 6.4560 at step 60 depending on unrelated allocations
    (evaluating every 25 or 1000 steps); with ``MKL_CBWR=AUTO`` both gave 6.4832, also when it
    was set after torch had already run MKL kernels in the process.
    """
    os.environ.setdefault("MKL_CBWR", "AUTO")
