r"""``geomtrain bench optimizer``: the cost and accuracy of one Manifold Muon direction at GPT-2-small matrix shapes.

Per layer: ``c_attn`` 2304x768, attention ``c_proj`` 768x768, ``c_fc`` 3072x768 and MLP ``c_proj``
768x3072 (``(out, in)``, as ``nn.Linear`` stores them). For each manifold, gradient scale and
matrix it times, side by side in one process:

- ``muon``: plain Muon's direction, one 5-step Polar Express msign (``--muon-dtype``): the unit
  of every ratio;
- every other registered solver (`solver_arms`, from `geomtrain.optim.solver_names`: ``tangent``, one msign
  of the tangent-projected gradient; ``published``, the paper's dual ascent, 20 msign calls; the products-only
  ``filled_split``, training's default), one cold solve each;
- ``cold``: the reference solver (``exact``) from a cold start;
- ``warm``: the reference solver on the *next* step of a simulated run (weights moved by
  ``lr = 0.02`` along the cold direction, momentum blended with a fresh gradient of the same
  distribution, 0.95/0.05), warm-started from the cold solve's dual variable and precision flag.

The points $W$ (``--points``, `POINTS`): ``random`` (the manifold's ``random``: for DGram,
log-normal column norms, a spread of about $e^{\pm 1}$) or ``init`` (where training starts: GPT-2's
initialisation, $\mathcal N(0, 0.02^2)$ entries and $0.02/\sqrt{2 \cdot 12}$ for the two ``c_proj``
matrices, projected onto the manifold as the trainer does). DGram points at ``init`` have nearly
equal column norms, the hard case of the square DGram problem (docs/manifold-muon.md).

The problems (weights, gradients, reference) are those of `geomtrain.bench.problems`. With
``--custom-mask`` every manifold is replaced by its twin with its own ``project_gram``
(`geomtrain.bench.problems.custom_mask_twin`: the same geometry), so the solver takes the code path
of a user-defined mask (conjugate gradients instead of the closed forms); the reference solve keeps
the built-in one.

Accuracy of every direction $A$, computed in float64 from the returned $A$: ``residual`` (RMS
tangent residual $L_W(A)$), ``opnorm`` ($\|A\|_{\mathrm{op}}$), ``gap`` (relative objective gap
$(\mathrm{OPT} - \langle \hat G, A\rangle)/\mathrm{OPT}$ against a float64 reference solve of the
same problem, `geomtrain.bench.problems.reference_solve` to tol 1e-6, skipped by ``--quick``;
negative when an infeasible $A$ overshoots) and, for the reference solver, its own certified
``dual_gap``. Tables: per matrix (ratios to ``muon`` and evaluations) and per layer (summed times).
The run prints its estimated duration first.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

import torch

from .._io import atomic_write_json, environment_record, writable_output
from ..config import check_integer, non_negative_int, parse_solver_options, positive_float, positive_int
from .problems import POINTS, SPECTRA, benchmark_point, custom_mask_twin, reference_solve, synthetic_gradient

__all__ = [
    "bench_optimizer",
    "format_optimizer_table",
    "format_matrix_table",
    "estimate_seconds",
    "add_parser",
    "GPT2_SHAPES",
    "solver_arms",
]

GPT2_SHAPES = (("c_attn", (2304, 768)), ("attn.c_proj", (768, 768)), ("c_fc", (3072, 768)), ("mlp.c_proj", (768, 3072)))
# Cost of each entry in units of one plain-Muon msign of the same matrix, for the up-front estimate
# (measured on this CPU in float32; the reference solve is float64 to residual 1e-6; square DGram
# duals are degenerate and cost several times more; the products-only solvers cost a few
# msign-equivalents at m = 3n-4n). Only the estimate printed before the run uses these.
_COST = {"muon": 1.0, "published": 20.0, "tangent": 1.3, "cold": 2.5, "warm": 1.5, "reference": 8.0}
_COST.update(filled_split=2.8)
_UNMEASURED_COST = 5.0  # a solver registered later, never timed here: a few msigns' worth
_SQUARE_DGRAM_COST = {"cold": 12.0, "warm": 12.0, "reference": 60.0}
# A custom mask's solve (CG for the normal coordinates and the step) against the built-in one, measured at
# 2304x768 and 3072x768 (CPU, float32): 1.3-1.4x for a Stiefel-like mask, 4.5-6x for a DGram-like one.
_CUSTOM_MASK_COST = 5.0
_MSIGN_STEPS, _MSIGN_GRAMS = 5, 3  # Polar Express: per step X X^T, (X X^T)^2 and B X


def solver_arms() -> tuple[str, ...]:
    """The benchmark's arms, read from the solver registry now: ``muon``, every registered solver but the
    reference (one cold solve each), then ``cold`` and ``warm`` (the reference solver, ``exact``, cold and
    warm-started)."""
    from ..optim import REFERENCE_SOLVER, solver_names

    return ("muon", *(name for name in solver_names() if name != REFERENCE_SOLVER), "cold", "warm")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable, repeats: int, device) -> tuple[float, object]:
    best, out = math.inf, None
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def _objective(G: torch.Tensor, A: torch.Tensor) -> float:
    G = G.double()
    return float((G * A.double()).sum() / G.norm())


def _opnorm(A: torch.Tensor) -> float:
    """Exact spectral norm in float64 from the small Gram matrix (cheaper than an SVD of A)."""
    A = A.double()
    small = A.mT @ A if A.shape[-2] >= A.shape[-1] else A @ A.mT
    return float(torch.linalg.eigvalsh(small)[..., -1].clamp_min(0).sqrt())


def estimate_seconds(
    manifolds,
    scales,
    layers: int,
    solvers,
    shapes,
    reference: bool,
    repeats: int,
    device: str = "cpu",
    gflops: float | None = None,
    custom_mask: bool = False,
) -> tuple[float, float]:
    """Predicted wall time of a run and the float32 matmul rate it is based on (GFLOP/s): measured
    here unless ``gflops`` is given."""
    if gflops is None:
        n = 512
        X = torch.randn(n, n, device=device)
        sec, _ = _timed(lambda: X @ X, 3, device)
        rate = 2 * n**3 / sec
    else:
        rate = gflops * 1e9
    slower = _CUSTOM_MASK_COST if custom_mask else 1.0  # the reference solver's entries only
    total = 0.0
    for mname in manifolds:
        for _, (out, inp) in shapes:
            m, k = max(out, inp), min(out, inp)
            msign_s = _MSIGN_STEPS * _MSIGN_GRAMS * 2 * m * k * k / rate
            square_dgram = mname == "dgram" and m < 2 * k
            cost = lambda s: (_SQUARE_DGRAM_COST if square_dgram else _COST).get(s, _COST.get(s, _UNMEASURED_COST))  # noqa: E731, B023 (called at once)
            per_scale = sum(cost(s) * (slower if s in ("cold", "warm") else 1.0) for s in solvers) * repeats
            total += msign_s * (per_scale * len(scales) + (cost("reference") if reference else 0.0))
    return total * layers, rate / 1e9


def bench_optimizer(
    manifolds=("stiefel", "dgram"),
    scales=(1e-3,),
    layers: int = 1,
    solvers=None,
    device: str = "cpu",
    muon_dtype: torch.dtype | None = None,
    spectrum: str = "gaussian",
    repeats: int = 1,
    seed: int = 0,
    shapes=GPT2_SHAPES,
    reference: bool = True,
    log: Callable[[str], None] = print,
    custom_mask: bool = False,
    solver_options: dict | None = None,
    points: str = "random",
) -> dict:
    """Run the optimizer benchmark; returns ``{"matrices": [...], "layers": [...], "config": {...}}``.

    (Long because its 14-argument signature takes a quarter of it; the body is one loop over shapes.)

    ``solvers``: arms of `solver_arms` (default: all of them; with ``custom_mask`` those that take a custom
    mask). ``shapes`` is a sequence of ``(name, (out, in))`` (default: one GPT-2-small layer).
    ``custom_mask``: time the solvers on `custom_mask_twin` of each manifold.
    ``solver_options``: options of the reference solver for ``cold`` and ``warm`` (e.g.
    ``{"compute_dtype": torch.float64}``; `geomtrain.config.parse_solver_options` reads them from text).
    ``points``: the weights, one of `POINTS` (see `benchmark_point`).
    """
    from manifolds import get_manifold

    solvers = resolve_arms(manifolds, solvers, custom_mask, log)
    if "muon" not in solvers:
        raise ValueError("the solvers must include muon (every ratio is to plain Muon)")
    if spectrum not in SPECTRA:
        raise ValueError(f"unknown spectrum {spectrum!r}; valid: {', '.join(SPECTRA)}")
    check_integer("layers", layers, 1)
    check_integer("repeats", repeats, 1)
    if not scales or not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in scales):
        raise ValueError(f"scales must be finite numbers > 0 (gradient entry RMS), at least one; got {list(scales)!r}")
    if muon_dtype is None:
        muon_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    matrices = []
    for mname in manifolds:
        builtin = get_manifold(mname)
        man = custom_mask_twin(builtin) if custom_mask else builtin
        for li in range(layers):
            for si, (sname, shape) in enumerate(shapes):
                gen = torch.Generator().manual_seed(seed + 1000 * li + si)
                W = benchmark_point(man, sname, shape, points, gen).to(device)
                direction = synthetic_gradient(shape, spectrum, gen, torch.float32, device)
                fresh = synthetic_gradient(shape, spectrum, gen, torch.float32, device)
                recs, directions = [], []
                for scale in scales:
                    rec, As = _bench_matrix(
                        man, W, scale * direction, scale * fresh, solvers, muon_dtype, repeats, device, solver_options
                    )
                    rec.update(manifold=mname, layer=li, matrix=sname, shape=list(shape), scale=scale)
                    recs.append(rec)
                    directions.append(As)
                    log(
                        f"  {mname} {sname} layer {li} scale {scale:g}: "
                        + ", ".join(f"{k} {v['seconds']:.2f}s" for k, v in rec["solvers"].items())
                    )
                if reference:
                    _add_reference(builtin, W, direction, recs, directions, log, f"{mname} {sname} layer {li}")
                matrices.extend(recs)
    return {
        "config": {
            "manifolds": list(manifolds),
            "scales": list(scales),
            "layers": layers,
            "solvers": list(solvers),
            "device": str(device),
            "muon_dtype": str(muon_dtype),
            "spectrum": spectrum,
            "points": points,
            "repeats": repeats,
            "seed": seed,
            "shapes": {k: list(v) for k, v in shapes},
            "reference": reference,
            "custom_mask": custom_mask,
            "solver_options": {k: str(v) for k, v in (solver_options or {}).items()},
        },
        "matrices": matrices,
        "layers": _layer_rows(matrices, solvers),
    }


def resolve_arms(manifolds, solvers, custom_mask: bool, log) -> tuple[str, ...]:
    """The arms to time: ``solvers`` (None: all of `solver_arms`), checked. With ``custom_mask``, those that
    solve every manifold's `custom_mask_twin` (tried on a 4x2 problem): a solver that refuses a custom mask (the
    products-only ones) is dropped from the default arms and a one-line ValueError where asked for."""
    from manifolds import get_manifold

    from ..optim import spectral_direction

    bad = [s for s in solvers or () if s not in solver_arms()]
    if bad:
        raise ValueError(f"unknown solver(s) {', '.join(bad)}; valid: {', '.join(solver_arms())}")
    if not custom_mask:
        return tuple(solvers or solver_arms())

    def refusal(name: str) -> str | None:
        for mname in manifolds if name not in ("muon", "cold", "warm") else ():
            twin = custom_mask_twin(get_manifold(mname))
            try:
                W = twin.random(4, 2, generator=torch.Generator().manual_seed(0))
                spectral_direction(twin, W, torch.ones(4, 2), solver=name)
            except ValueError as err:
                return str(err)
        return None

    asked = solvers or solver_arms()
    refused = {name: why for name in asked if (why := refusal(name)) is not None}
    if refused and solvers:
        raise ValueError(f"--custom-mask: {next(iter(refused.values()))}")
    if refused:
        log(f"  --custom-mask: not timing {', '.join(refused)} (built-in masks only)")
    return tuple(name for name in asked if name not in refused)


def _add_reference(man, W, G, recs, directions, log, label) -> None:
    """Solve ``(W, G)`` in float64 (tol 1e-6, at most 150 evaluations, smoothing 1e-5), record it in
    each of ``recs`` and each direction's gap in its solver's entry."""
    t0 = time.perf_counter()
    pairs = [(rec["solvers"][name], A) for rec, As in zip(recs, directions) for name, A in As.items()]
    R, st, gaps = reference_solve(man, W, G, [A for _, A in pairs], tol=1e-6, max_iter=150, smoothing=1e-5)
    log(
        f"  reference {label}: {int(st.evaluations)} evaluations, residual {float(st.residual):.1e}, "
        f"certified gap {float(st.dual_gap):.1e} ({time.perf_counter() - t0:.1f} s)"
    )
    ref = {
        "objective": _objective(G, R),
        "residual": float(st.residual),
        "dual_gap": float(st.dual_gap),
        "evaluations": int(st.evaluations),
    }
    for rec in recs:
        rec["reference"] = ref
    for (entry, _), gap in zip(pairs, gaps):
        entry["gap"] = float(gap)


def _bench_matrix(man, W, G, fresh, solvers, muon_dtype, repeats, device, options=None) -> tuple[dict, dict]:
    """Time and check every solver on one problem (and ``warm`` on the next step); returns the record
    and the directions of the problem ``(W, G)`` (all but ``warm``) by solver, for the reference gaps."""
    from manifolds import msign

    from ..optim import get_solver, spectral_direction, tangent_residual

    mopts = {"msign": "polar_express", "msign_dtype": muon_dtype}  # steps: each solver's own (5; filled_split 6)
    msign_opts = lambda name: {k: v for k, v in mopts.items() if k in get_solver(name).options}  # noqa: E731
    opts = dict(options or {})
    out: dict = {"reference": None, "solvers": {}}
    directions: dict = {}

    def record(name, seconds, A, st, W_):
        out["solvers"][name] = entry = {
            "seconds": seconds,
            "residual": float(tangent_residual(man, W_.double(), A.double())),
            "opnorm": _opnorm(A),
            "evaluations": int(st.evaluations) if st is not None else 1,
        }
        if st is not None and st.dual_gap is not None:
            entry["dual_gap"] = float(st.dual_gap)
        if W_ is W:
            directions[name] = A

    cold = None
    for name in solvers:
        if name == "muon":
            sec, A = _timed(lambda: msign(G, "polar_express", steps=5, compute_dtype=muon_dtype), repeats, device)
            record(name, sec, A, None, W)
        elif name not in ("cold", "warm"):  # a registered solver: one cold solve, muon's msign
            o = msign_opts(name)
            sec, (A, st) = _timed(lambda: spectral_direction(man, W, G, solver=name, **o), repeats, device)  # noqa: B023
            record(name, sec, A, st, W)
        elif name == "cold":
            sec, cold = _timed(lambda: spectral_direction(man, W, G, **opts), repeats, device)
            record(name, sec, *cold, W)
        elif name == "warm":
            A0, st0 = cold if cold is not None else spectral_direction(man, W, G, **opts)
            W2 = man.retr(W, -0.02 * A0)
            G2 = 0.95 * G + 0.05 * fresh
            warm_opts = {**opts, "dual": st0.dual, "escalate": st0.escalated}  # what ManifoldMuon passes back
            sec, (A, st) = _timed(lambda: spectral_direction(man, W2, G2, **warm_opts), repeats, device)  # noqa: B023
            record(name, sec, A, st, W2)
    muon_s = out["solvers"]["muon"]["seconds"]
    for entry in out["solvers"].values():
        entry["x_muon"] = entry["seconds"] / muon_s
    return out, directions


def _layer_rows(matrices: list[dict], solvers) -> list[dict]:
    """Per manifold, scale and layer: summed times, ratios to summed muon time, worst accuracy."""
    groups: dict[tuple, list[dict]] = {}
    for r in matrices:
        groups.setdefault((r["manifold"], r["scale"], r["layer"]), []).append(r)
    rows = []
    for (mname, scale, layer), rs in groups.items():
        muon_s = sum(r["solvers"]["muon"]["seconds"] for r in rs)
        for name in solvers:
            es = [r["solvers"][name] for r in rs]
            row = {
                "manifold": mname,
                "scale": scale,
                "layer": layer,
                "solver": name,
                "seconds": sum(e["seconds"] for e in es),
                "evaluations": sum(e["evaluations"] for e in es),
            }
            row["x_muon"] = row["seconds"] / muon_s
            row["x_muon_max"] = max(e["x_muon"] for e in es)
            for key in ("residual", "opnorm", "gap", "dual_gap"):
                vals = [e[key] for e in es if key in e]
                row[key] = max(vals, key=abs) if vals else None
            rows.append(row)
    return rows


_ACCURACY_HEAD = ("residual", "opnorm", "gap vs ref", "dual gap")


def _table(head, lines) -> str:
    lines = [head] + lines
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)


def _fmt(v, f) -> str:
    return "-" if v is None else format(v, f)


def format_matrix_table(result: dict) -> str:
    """Per matrix: muon seconds and every solver's ratio to it (evaluations in brackets), accuracy of cold/warm."""
    solvers = [s for s in result["config"]["solvers"] if s != "muon"]
    head = ("manifold", "scale", "matrix", "muon [s]", *[f"{s} x" for s in solvers], *_ACCURACY_HEAD)
    lines = []
    for r in result["matrices"]:
        sv = r["solvers"]
        ours = [sv[k] for k in ("cold", "warm") if k in sv]
        worst = lambda key: max((e[key] for e in ours if key in e), key=abs, default=None)  # noqa: E731, B023 (called at once)
        lines.append(
            (
                r["manifold"],
                f"{r['scale']:g}",
                f"{r['matrix']} {r['shape'][0]}x{r['shape'][1]}",
                f"{sv['muon']['seconds']:.3f}",
                *[f"{sv[s]['x_muon']:.2f} ({sv[s]['evaluations']})" for s in solvers],
                _fmt(worst("residual"), ".1e"),
                _fmt(worst("opnorm"), ".5f"),
                _fmt(worst("gap"), ".1e"),
                _fmt(worst("dual_gap"), ".1e"),
            )
        )
    return _table(head, lines)


def format_optimizer_table(result: dict) -> str:
    """Per layer: summed seconds, ratio to plain Muon, the largest single-matrix ratio, accuracy."""
    head = ("manifold", "scale", "layer", "solver", "time [s]", "x muon", "max matrix x", "evaluations")
    head = (*head, *_ACCURACY_HEAD)
    lines = [
        (
            r["manifold"],
            f"{r['scale']:g}",
            str(r["layer"]),
            r["solver"],
            f"{r['seconds']:.3f}",
            f"{r['x_muon']:.2f}",
            f"{r['x_muon_max']:.2f}",
            str(r["evaluations"]),
            _fmt(r["residual"], ".1e"),
            _fmt(r["opnorm"], ".5f"),
            _fmt(r["gap"], ".1e"),
            _fmt(r["dual_gap"], ".1e"),
        )
        for r in result["layers"]
    ]
    return _table(head, lines)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _parse_shapes(specs) -> tuple:
    try:
        shapes = tuple((s, tuple(int(x) for x in s.lower().split("x"))) for s in specs)
        if not all(len(sh) == 2 and min(sh) > 0 for _, sh in shapes):
            raise ValueError
    except ValueError:
        raise ValueError(f"--shapes takes OUTxIN pairs such as 64x32; got {' '.join(specs)}") from None
    return shapes


def _cmd_optimizer(args: argparse.Namespace) -> int:
    """``geomtrain bench optimizer``: resolve device and threads, run `bench_optimizer`, print and save.

    Long because it maps each flag onto the benchmark's arguments in turn; no logic of its own."""
    argv = getattr(args, "argv", [])[1:]
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available; valid: auto, cpu, cuda")
    layers = args.layers if args.layers is not None else (12 if device.startswith("cuda") else 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    muon_dtype = _DTYPES[args.muon_dtype] if args.muon_dtype else None
    scales = args.scales or ([1e-3] if args.quick else [1e-3, 1.0])
    reference = not (args.quick or args.no_reference)
    shapes = _parse_shapes(args.shapes) if args.shapes else GPT2_SHAPES
    solver_options = parse_solver_options(args.solver_options, "exact")
    if args.out:
        writable_output(args.out)  # before minutes of timing, not after
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if not args.quiet else (lambda s: None)
    solvers = resolve_arms(args.manifolds, args.solvers, args.custom_mask, log)  # before the estimate, too
    est, rate = estimate_seconds(
        args.manifolds,
        scales,
        layers,
        solvers,
        shapes,
        reference,
        args.repeats,
        device,
        custom_mask=args.custom_mask,
    )
    print(
        f"geomtrain bench optimizer: {len(args.manifolds)} manifold(s) x {layers} layer(s) x {len(shapes)} "
        f"matrices x {len(scales)} scale(s), reference {'on' if reference else 'off'}: estimated "
        f"~{est / 60:.1f} min (float32 matmul here: {rate:.0f} GFLOP/s)",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    result = bench_optimizer(
        manifolds=args.manifolds,
        scales=scales,
        layers=layers,
        solvers=solvers,
        device=device,
        muon_dtype=muon_dtype,
        spectrum=args.spectrum,
        repeats=args.repeats,
        seed=args.seed,
        shapes=shapes,
        reference=reference,
        log=log,
        custom_mask=args.custom_mask,
        solver_options=solver_options,
        points=args.points,
    )
    result["machine"] = environment_record(device)
    result["command"] = "geomtrain bench " + " ".join(argv)
    result["wall_seconds"] = time.perf_counter() - t0
    result["estimated_seconds"] = est
    print("Per matrix (ratio to plain Muon; evaluations in brackets; accuracy: worst of cold and warm):")
    print(format_matrix_table(result))
    print("\nPer layer (summed times):")
    print(format_optimizer_table(result))
    print(
        f"\n{result['command']}  ({result['wall_seconds']:.0f} s, estimated {est:.0f} s, "
        f"{result['machine'].get('cpu', device)}, {result['machine']['torch_threads']} threads)"
    )
    if args.out:
        atomic_write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


def add_parser(sub) -> None:
    """Register ``optimizer`` on the ``geomtrain bench`` subparsers.

    Long because it declares the options one after the other; no logic."""
    p = sub.add_parser(
        "optimizer",
        help="Manifold Muon solvers vs plain Muon at GPT-2-small shapes",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one gradient scale (1e-3), no reference solve: about two minutes on a 2-core CPU",
    )
    p.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="transformer layers (4 matrices each); default 12 on GPU, 1 on CPU",
    )
    p.add_argument("--manifolds", nargs="+", default=["stiefel", "dgram"], choices=["stiefel", "dgram", "oblique"])
    p.add_argument(
        "--scales",
        nargs="+",
        type=positive_float,
        default=None,
        help="gradient entry RMS (default: 1e-3 1; --quick: 1e-3)",
    )
    p.add_argument(
        "--solvers",
        nargs="+",
        default=None,
        choices=solver_arms(),
        help="arms: muon, the registered solvers, cold and warm (the default solver); default: all",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the float64 reference solves (no gap vs ref)")
    p.add_argument(
        "--custom-mask",
        action="store_true",
        help="solve each manifold as a user-defined mask would be (same geometry, own project_gram: the generic path)",
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        metavar="OUTxIN",
        help="matrix shapes instead of a GPT-2-small layer (e.g. 64x32 32x64)",
    )
    p.add_argument(
        "--spectrum",
        default="gaussian",
        choices=list(SPECTRA),
        help="gradients: i.i.d. Gaussian entries, k^-1/2 singular-value decay, or that decay with the null "
        "direction LayerNorm gives training gradients (layernorm)",
    )
    p.add_argument(
        "--points",
        default="random",
        choices=list(POINTS),
        help="weights: the manifold's random points (DGram: log-normal column norms) or GPT-2's initialisation "
        "projected onto the manifold (init: nearly equal column norms)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument(
        "--muon-dtype",
        default=None,
        choices=list(_DTYPES),
        help="msign dtype of muon and the other solvers' arms (default bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument(
        "--solver-options",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="options of the default solver for cold and warm (e.g. compute_dtype=float64 tol=1e-5)",
    )
    p.add_argument("--repeats", type=positive_int, default=1, help="time each solve this many times, keep the best")
    p.add_argument("--threads", type=non_negative_int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the full results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(handler=_cmd_optimizer)
