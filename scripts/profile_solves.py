r"""Where a preset's training step spends its direction solves.

Trains the `mini` model (``--model``) with one preset for steps 0..LAST and, over steps FIRST..LAST,
times every call of `spectral_direction` made by ManifoldMuon, grouped by manifold, matrix shape and
start (cold, or warm from the previous step's multiplier). Prints the step time and, per group, the solve
time and the evaluations per step. One preset per process (not interleaved like `bench train`),
so compare the groups within one run and the step times only on an otherwise idle machine.

With ``--reference`` every profiled solve is also checked against a float64 reference solve of the
same problem (untimed; ``tol`` 1e-9, at most 3,000 evaluations, smoothing 1e-6): per group, the
largest and median relative objective gap $(\mathrm{OPT} - \langle \hat G, A\rangle)/\mathrm{OPT}$
of the directions training used, next to the largest certified gap they reported (negative gaps:
a direction tangent only to ``tol`` overshoots the optimum).

    OMP_NUM_THREADS=1 python scripts/profile_solves.py all-dgram --first 40 --last 44
    OMP_NUM_THREADS=1 python scripts/profile_solves.py all-dgram --first 41 --last 41 --reference
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import geomtrain.optim.muon as muon_module
from geomtrain.bench.optimizer import reference_solve
from geomtrain.config import make_config
from geomtrain.train import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("--first", type=int, default=40, help="first profiled step (default 40)")
    parser.add_argument("--last", type=int, default=44, help="last profiled step (default 44)")
    parser.add_argument("--model", default="mini", help="a model of geomtrain.model.MODEL_CONFIGS (default mini)")
    parser.add_argument("--data-dir", default="data/classics-bpe8k")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reference", action="store_true", help="check each profiled direction against float64")
    args = parser.parse_args()
    if not 0 <= args.first <= args.last:
        parser.error(f"need 0 <= --first <= --last, got {args.first} and {args.last}")
    torch.set_num_threads(args.threads)

    totals: dict[tuple, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])  # seconds, evaluations, matrices
    gaps: dict[tuple, list[tuple[float, float]]] = collections.defaultdict(list)  # (true gap, certified gap)
    profiling = False
    solve = muon_module.spectral_direction

    def timed_solve(manifold, W, U, **options):
        start = time.perf_counter()
        A, stats = solve(manifold, W, U, **options)
        if profiling:
            key = (type(manifold).__name__, "x".join(map(str, W.shape[-2:])), "warm" if "dual" in options else "cold")
            row = totals[key]
            row[0] += time.perf_counter() - start
            row[1] += int(stats.evaluations.sum())
            row[2] += W.shape[0] if W.dim() == 3 else 1
            if args.reference:
                _, _, (true,) = reference_solve(manifold, W, U, [A], tol=1e-9, max_iter=3000, smoothing=1e-6)
                gaps[key].extend(zip(true.reshape(-1).tolist(), stats.dual_gap.reshape(-1).tolist()))
        return A, stats

    muon_module.spectral_direction = timed_solve
    config = make_config(
        dict(
            model=args.model,
            data_dir=args.data_dir,
            preset=args.preset,
            seed=0,
            max_iters=args.last + 1,
            warmup_iters=1,
            progress=False,
            diagnostics=False,
            eval_iters=1,
        )
    )
    trainer = Trainer(config)
    step_seconds = 0.0
    for step in range(args.last + 1):
        profiling = step >= args.first
        seconds = trainer.step().seconds
        if profiling:
            step_seconds += seconds
    steps = args.last + 1 - args.first
    note = " (including the untimed reference solves)" if args.reference else ""
    print(f"{args.preset}: {step_seconds / steps * 1e3:.0f} ms/step over steps {args.first}-{args.last}{note}")
    for (manifold, shape, start), (seconds, evaluations, matrices) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(
            f"  {manifold} {shape} {start}: {seconds / steps * 1e3:.0f} ms/step, "
            f"{evaluations / steps:.1f} evaluations/step over {matrices / steps:.0f} matrices"
        )
        if gaps[(manifold, shape, start)]:
            true, certified = zip(*gaps[(manifold, shape, start)])
            print(
                f"    gap to the float64 optimum: largest {max(true):.1e}, median {sorted(true)[len(true) // 2]:.1e}; "
                f"largest certified gap {max(certified):.1e}"
            )


if __name__ == "__main__":
    main()
