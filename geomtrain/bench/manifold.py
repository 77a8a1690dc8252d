r"""``geomtrain bench manifold``: a manifold defined by ``project_gram`` alone against the built-in DGram, side by side.

The custom manifold is `geomtrain.bench.problems.BlockMask` (columns orthogonal across blocks of ``--block``
columns, free inside: the guide's ``BlockGram``), so every map takes the generic, products-only path
(`manifolds.gram_solve`: conjugate gradients on the normal equation, Newton in Gram space). Per matrix shape
(float32, ``(out, in)``; default 384x128 and 512x128, the ``mini`` model's tall matrices), in one process, arms
interleaved round-robin so a shared machine's drift hits both alike:

- ``projx`` of GPT-2's initial weight ($\mathcal N(0, 0.02^2)$ entries), ``proju`` of a Gaussian at that point, and
  ``retr`` along a tangent step of spectral norm 0.02 (a Manifold Muon step at ``lr = 0.02``): the median
  milliseconds per call of the generic path and of DGram's closed forms, with how far the generic results land
  from the manifold (the largest cross-block $|(W^\top W)_{ij}|$ over the largest diagonal entry);
- ``step``: one `geomtrain.optim.ManifoldMuon` step on that matrix with each manifold's default solver
  (`geomtrain.optim.default_solver`) and its retraction, on the same gradient sequence (power-law spectra),
  after ``--warmup`` untimed steps (the warm-start state settles); with ``--solvers``, also the custom mask with
  each solver named (``exact``, the certified reference, say).

The ratio column is generic over DGram, measured side by side (what a `project_gram`-only manifold costs against
closed forms: docs/custom-manifold.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from .._io import atomic_write_json, environment_record, writable_output
from ..config import positive_int
from .problems import INIT_STD, BlockMask, synthetic_gradient

__all__ = ["measure_manifold", "format_manifold_table", "add_parser", "off_block_ratio"]

LR = 0.02  # the step size of the retraction and optimizer arms: Manifold Muon's default


def off_block_ratio(manifold, W: torch.Tensor) -> float:
    r"""$\max |P(W^\top W)| / \max_i (W^\top W)_{ii}$ in float64: 0 on the manifold (cross-block entries for a
    block mask)."""
    G = manifold.gram(W.double())
    return float(manifold.project_gram(G).abs().max() / G.diagonal(dim1=-2, dim2=-1).max())


def _median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def _timed(fn: Callable) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _map_arms(shape, block: int, gen: torch.Generator) -> dict[str, tuple[Callable, Callable]]:
    """Per map, the (generic, DGram) calls on the same input: projx of GPT-2's initial weight, proju of a Gaussian
    and retr along a tangent step of spectral norm `LR` at each manifold's projection of it."""
    from manifolds import DGram

    X = INIT_STD * torch.randn(*shape, generator=gen)
    Z = torch.randn(*shape, generator=gen)
    arms = {}
    for name, M in (("generic", BlockMask(block)), ("dgram", DGram())):
        W = M.projx(X)
        U = M.proju(W, Z)
        step = -LR * U / torch.linalg.matrix_norm(U.double(), ord=2).float()
        arms[name] = {"projx": lambda M=M: M.projx(X), "proju": lambda M=M, W=W: M.proju(W, Z)}
        arms[name]["retr"] = lambda M=M, W=W, step=step: M.retr(W, step)
    return {op: (arms["generic"][op], arms["dgram"][op]) for op in ("projx", "proju", "retr")}


def _optimizers(shape, block: int, solvers, gen: torch.Generator) -> dict[str, tuple]:
    """Per arm ``(optimizer, parameter, solver name)``: ManifoldMuon on GPT-2's initial weight projected onto the
    custom mask (its default solver, then each of ``solvers``) and onto DGram (its default)."""
    from manifolds import DGram

    from ..optim import ManifoldMuon, default_solver

    X = INIT_STD * torch.randn(*shape, generator=gen)
    arms = {"generic": (BlockMask(block), None), "dgram": (DGram(), None)}
    for solver in solvers:
        arms[f"step ({solver})"] = (BlockMask(block), solver)
    out = {}
    for label, (M, solver) in arms.items():
        p = torch.nn.Parameter(M.projx(X))
        opt = ManifoldMuon([{"params": [p], "manifold": M}], lr=LR, solver=solver)
        out[label] = (opt, p, solver or default_solver(M))
    return out


def measure_manifold(
    shapes, block: int = 16, repeats: int = 5, steps: int = 6, warmup: int = 2, solvers=(), seed: int = 0
) -> list[dict]:
    """One row per shape and map (``projx``, ``proju``, ``retr``, ``step``): median ms per call of the generic
    path and of DGram, their ratio, and where the generic result lands (`off_block_ratio`; the maps)."""
    rows = []
    for shape in shapes:
        gen = torch.Generator().manual_seed(seed)
        times: dict[str, dict[str, list[float]]] = {}
        landed = {}
        for _ in range(repeats):
            for op, (generic, builtin) in _map_arms(shape, block, gen).items():
                t_g, out = _timed(generic)
                t_d, _ = _timed(builtin)
                times.setdefault(op, {"generic": [], "dgram": []})
                times[op]["generic"].append(t_g)
                times[op]["dgram"].append(t_d)
                if op != "proju":
                    landed[op] = max(landed.get(op, 0.0), off_block_ratio(BlockMask(block), out))
        for op, t in times.items():
            row = {"shape": list(shape), "op": op, "generic_ms": _median_ms(t["generic"])}
            ratio = statistics.median(t["generic"]) / statistics.median(t["dgram"])
            row.update(dgram_ms=_median_ms(t["dgram"]), ratio=ratio)
            rows.append({**row, "off_block": landed.get(op)})
        rows.extend(_step_rows(shape, block, steps, warmup, solvers, gen))
    return rows


def _step_rows(shape, block: int, steps: int, warmup: int, solvers, gen: torch.Generator) -> list[dict]:
    """The ``step`` rows: ManifoldMuon steps of each arm (`_optimizers`), interleaved, on one gradient sequence."""
    arms = _optimizers(shape, block, solvers, gen)
    times: dict[str, list[float]] = {label: [] for label in arms}
    for i in range(warmup + steps):
        grad = synthetic_gradient(shape, "powerlaw", gen, torch.float32, "cpu")
        for label, (opt, p, _) in arms.items():
            p.grad = grad.clone()
            elapsed, _ = _timed(opt.step)
            if i >= warmup:
                times[label].append(elapsed)
    dgram = statistics.median(times["dgram"])
    rows = []
    for label in (name for name in arms if name != "dgram"):
        opt, p, solver = arms[label]
        rows.append(
            {
                "shape": list(shape),
                "op": "step" if label == "generic" else label,
                "solver": solver,
                "dgram_solver": arms["dgram"][2],
                "generic_ms": _median_ms(times[label]),
                "dgram_ms": 1e3 * dgram,
                "ratio": statistics.median(times[label]) / dgram,
                "off_block": off_block_ratio(BlockMask(block), p.detach()),
            }
        )
    return rows


def format_manifold_table(rows: list[dict], block: int) -> str:
    """The rows as a table: ms per call, generic and DGram, their ratio and where the generic result lands."""
    width = max([len("op"), *(len(r["op"]) for r in rows)])
    head = f"{'shape':>9}  {'op':<{width}} {'generic ms':>10} {'DGram ms':>9} {'ratio':>6}  off-block  solvers"
    lines = [f"project_gram-only block mask (blocks of {block}) against DGram, float32, side by side", head]
    for r in rows:
        off = "-" if r["off_block"] is None else f"{r['off_block']:.1e}"
        solvers = f"{r['solver']}, {r['dgram_solver']}" if "solver" in r else ""
        shape = "x".join(map(str, r["shape"]))
        times = f"{r['generic_ms']:10.1f} {r['dgram_ms']:9.1f} {r['ratio']:6.2f}"
        lines.append(f"{shape:>9}  {r['op']:<{width}} {times}  {off:>9}  {solvers}".rstrip())
    return "\n".join(lines)


def _shape(text: str) -> tuple[int, int]:
    try:
        m, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"bad shape {text!r}: use ROWSxCOLS, e.g. 384x128") from None
    if m < 1 or n < 1:
        raise ValueError(f"bad shape {text!r}: both sizes must be >= 1")
    return m, n


def _cmd_manifold(args) -> int:
    from ..optim import get_solver

    shapes = [_shape(s) for s in args.shapes]
    for solver in args.solvers:
        get_solver(solver)  # a one-line error naming the registered solvers
    if args.out:
        writable_output(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure_manifold(shapes, args.block, args.repeats, args.steps, args.warmup, args.solvers, args.seed)
    print(format_manifold_table(rows, args.block))
    if args.out:
        atomic_write_json(args.out, {"block": args.block, "rows": rows, "environment": environment_record("cpu")})
    return 0


def add_parser(sub) -> None:
    """Register ``manifold`` on the ``geomtrain bench`` subparsers."""
    p = sub.add_parser(
        "manifold",
        help="a project_gram-only manifold's projx/proju/retr and optimizer step against DGram's, side by side",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("--shapes", nargs="+", default=["384x128", "512x128"], help="matrix shapes ROWSxCOLS")
    p.add_argument("--block", type=positive_int, default=16, help="columns per block of the custom mask")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed calls per map (median)")
    p.add_argument("--steps", type=positive_int, default=6, help="timed optimizer steps (median)")
    p.add_argument("--warmup", type=positive_int, default=2, help="untimed optimizer steps first")
    p.add_argument(
        "--solvers", nargs="*", default=[], metavar="SOLVER", help="also time the custom mask's step with these solvers"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.set_defaults(handler=_cmd_manifold)
