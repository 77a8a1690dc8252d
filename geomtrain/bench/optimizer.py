r"""``geomtrain bench optimizer``: the cost and accuracy of one Manifold Muon direction at GPT-2-small matrix shapes.
Per layer: ``c_attn`` 2304x768, attention ``c_proj`` 768x768, ``c_fc`` 3072x768 and MLP ``c_proj``
768x3072 (``(out, in)``, as ``nn.Linear`` stores them). For each manifold and gradient scale it
times, in one process:

- ``adamw``: one ``torch.optim.AdamW`` step on the four matrices (elementwise: the floor);
- ``muon``: plain Muon's direction, 5 Polar Express steps (``--muon-dtype``);
- ``published``: the paper's dual ascent as published (20 msign calls, same msign as ``muon``);
- ``tangent``: one msign of the tangent-projected gradient;
- ``gram_newton``: the default solver, cold start (tol 1e-4);
- ``gram_newton_warm``: the default solver on the *next* step of a simulated run (weights moved by
  ``lr = 0.02`` along the direction, momentum blended with a fresh gradient of the same
  distribution), warm-started from the cold solve's dual variable.

Accuracy per direction $A$: ``residual`` (max RMS tangent residual $L_W(A)$ over the layer's
matrices, computed in float64 from the returned $A$), ``gap`` (largest relative objective gap
$(\mathrm{OPT} - \langle \hat G, A\rangle)/\mathrm{OPT}$ against a float64 reference solve of the same
problem; negative when an infeasible $A$ overshoots), ``dual_gap`` (the solver's own certificate,
where it has one) and ``msign_calls`` (sum over the layer). Times are the sum over the layer's
matrices (best of ``--repeats``); ``x muon`` is the ratio to plain Muon's time.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from typing import Callable

import torch

__all__ = ["bench_optimizer", "format_optimizer_table", "add_parser", "GPT2_SHAPES"]

GPT2_SHAPES = (("c_attn", (2304, 768)), ("attn.c_proj", (768, 768)), ("c_fc", (3072, 768)), ("mlp.c_proj", (768, 3072)))
OPT_SOLVERS = ("adamw", "muon", "published", "tangent", "gram_newton", "gram_newton_warm")


def _gradient(shape, scale: float, spectrum: str, gen: torch.Generator, dtype, device) -> torch.Tensor:
    m, n = shape
    if spectrum == "gaussian":
        G = torch.randn(m, n, generator=gen, dtype=dtype)
    else:  # "powerlaw": singular values k^(-1/2) over orthonormal factors, plus a small isotropic floor
        k = min(m, n)
        U = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))[0]
        V = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))[0]
        s = torch.arange(1, k + 1, dtype=torch.float64) ** -0.5
        G = ((U * s) @ V.T).to(dtype)
        G = G / G.norm() * math.sqrt(m * n) + 0.01 * torch.randn(m, n, generator=gen, dtype=dtype)
    G = G / G.pow(2).mean().sqrt()  # entries of RMS 1 before scaling
    return (scale * G).to(device)


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


def bench_optimizer(manifolds=("stiefel", "dgram"), scales=(1e-3, 1.0), layers: int = 1, solvers=OPT_SOLVERS,
                    device: str = "cpu", muon_dtype: torch.dtype | None = None, spectrum: str = "gaussian",
                    repeats: int = 1, seed: int = 0, shapes=GPT2_SHAPES, log: Callable[[str], None] = print) -> dict:
    """Run the optimizer benchmark; returns ``{"rows": [...], "matrices": [...], "config": {...}}``.

    ``shapes`` is a sequence of ``(name, (out, in))`` (default: one GPT-2-small layer).
    """
    from manifolds import get_manifold, msign

    from ..optim import spectral_direction, tangent_residual

    bad = [s for s in solvers if s not in OPT_SOLVERS]
    if bad:
        raise ValueError(f"unknown solver(s) {', '.join(bad)}; valid: {', '.join(OPT_SOLVERS)}")
    if spectrum not in ("gaussian", "powerlaw"):
        raise ValueError(f"unknown spectrum {spectrum!r}; valid: gaussian, powerlaw")
    if muon_dtype is None:
        muon_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    dt = torch.float32
    mopts = {"msign": "polar_express", "msign_steps": 5, "msign_dtype": muon_dtype}
    matrices, rows = [], []
    for mname in manifolds:
        man = get_manifold(mname)
        for li in range(layers):
            for si, (sname, shape) in enumerate(shapes):
                gen = torch.Generator().manual_seed(seed + 1000 * li + si)
                W = man.random(*shape, dtype=dt, generator=gen).to(device)
                direction = _gradient(shape, 1.0, spectrum, gen, dt, device)
                fresh = _gradient(shape, 1.0, spectrum, gen, dt, device)
                t0 = time.perf_counter()
                ref, ref_st = spectral_direction(man, W.double(), direction.double(), tol=1e-6, max_iter=150,
                                                 smoothing=1e-5)
                opt_val = _objective(direction, ref)
                log(f"  reference {mname} {sname} layer {li}: {int(ref_st['msign_calls'])} evaluations, "
                    f"residual {float(ref_st['residual']):.1e}, certified gap {float(ref_st['dual_gap']):.1e} "
                    f"({time.perf_counter() - t0:.1f} s)")
                for scale in scales:
                    G = scale * direction
                    rec = {"manifold": mname, "layer": li, "matrix": sname, "shape": list(shape), "scale": scale,
                           "reference": {"objective": opt_val, "residual": float(ref_st["residual"]),
                                         "dual_gap": float(ref_st["dual_gap"]),
                                         "evaluations": int(ref_st["msign_calls"])}, "solvers": {}}

                    def record(name, seconds, A, st, W_=W, G_=G, ref_obj=opt_val):
                        res = float(tangent_residual(man, W_.double(), A.double()))
                        entry = {"seconds": seconds, "residual": res,
                                 "msign_calls": int(st["msign_calls"]) if st is not None else 1,
                                 "opnorm": float(torch.linalg.matrix_norm(A.double(), ord=2))}
                        if ref_obj is not None:
                            entry["gap"] = (ref_obj - _objective(G_, A)) / ref_obj
                        if st is not None and st.get("dual_gap") is not None:
                            entry["dual_gap"] = float(st["dual_gap"])
                        rec["solvers"][name] = entry

                    for name in solvers:
                        if name == "adamw":
                            p = torch.nn.Parameter(W.clone())
                            opt = torch.optim.AdamW([p], lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
                            p.grad = G.clone()
                            opt.step()  # state allocation outside the timing
                            sec, _ = _timed(opt.step, repeats, device)
                            rec["solvers"]["adamw"] = {"seconds": sec, "msign_calls": 0}
                        elif name == "muon":
                            sec, A = _timed(lambda: msign(G, "polar_express", steps=5, compute_dtype=muon_dtype),
                                            repeats, device)
                            record("muon", sec, A, None)
                        elif name in ("published", "tangent"):
                            sec, (A, st) = _timed(lambda: spectral_direction(man, W, G, solver=name, **mopts),
                                                  repeats, device)
                            record(name, sec, A, st)
                        elif name == "gram_newton":
                            sec, (A, st) = _timed(lambda: spectral_direction(man, W, G, **mopts), repeats, device)
                            record(name, sec, A, st)
                            cold = (A, st)
                        elif name == "gram_newton_warm":
                            if "gram_newton" not in rec["solvers"]:
                                cold = spectral_direction(man, W, G, **mopts)
                            A0, st0 = cold
                            W2 = man.retr(W, -0.02 * A0)
                            G2 = 0.95 * G + 0.05 * scale * fresh
                            sec, (A, st) = _timed(lambda: spectral_direction(man, W2, G2, dual=st0["dual"], **mopts),
                                                  repeats, device)
                            record(name, sec, A, st, W_=W2, G_=G2, ref_obj=None)
                    matrices.append(rec)
                    log(f"  {mname} {sname} layer {li} scale {scale:g}: " + ", ".join(
                        f"{k} {v['seconds']:.2f}s" for k, v in rec["solvers"].items()))
            rows += _rows(mname, scales, solvers, [r for r in matrices if r["manifold"] == mname])
    return {"config": {"manifolds": list(manifolds), "scales": list(scales), "layers": layers, "solvers": list(solvers),
                       "device": str(device), "muon_dtype": str(muon_dtype), "spectrum": spectrum, "repeats": repeats,
                       "seed": seed, "shapes": {k: list(v) for k, v in shapes}},
            "rows": rows, "matrices": matrices}


def _rows(mname: str, scales, solvers, recs: list[dict]) -> list[dict]:
    out = []
    for scale in scales:
        rs = [r for r in recs if r["scale"] == scale]
        muon_time = sum(r["solvers"]["muon"]["seconds"] for r in rs) if "muon" in solvers else None
        for name in solvers:
            es = [r["solvers"][name] for r in rs]
            row = {"manifold": mname, "scale": scale, "solver": name, "seconds": sum(e["seconds"] for e in es),
                   "msign_calls": sum(e["msign_calls"] for e in es), "matrices": len(es)}
            row["x_muon"] = row["seconds"] / muon_time if muon_time else None
            for key in ("residual", "gap", "dual_gap"):
                vals = [e[key] for e in es if key in e]
                row[key] = max(vals, key=abs) if vals else None
            out.append(row)
    return out


def format_optimizer_table(result: dict) -> str:
    """A plain-text table of the aggregated rows."""
    head = ("manifold", "scale", "solver", "time [s]", "x muon", "msign calls", "residual", "gap vs ref", "dual gap")
    lines = [head]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in result["rows"]:
        lines.append((r["manifold"], f"{r['scale']:g}", r["solver"], f"{r['seconds']:.3f}", fmt(r["x_muon"], ".1f"),
                      str(r["msign_calls"]), fmt(r["residual"], ".1e"), fmt(r["gap"], ".1e"), fmt(r["dual_gap"], ".1e")))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)


def _machine(device: str) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "device": str(device)}
    try:
        with open("/proc/cpuinfo") as fh:
            names = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
        if names:
            info["cpu"], info["cpu_cores"] = names[0], len(names)
    except OSError:
        pass
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _cmd_optimizer(args: argparse.Namespace) -> int:
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
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if not args.quiet else (lambda s: None)
    t0 = time.perf_counter()
    shapes = GPT2_SHAPES
    if args.shapes:
        try:
            shapes = tuple((s, tuple(int(x) for x in s.lower().split("x"))) for s in args.shapes)
            assert all(len(sh) == 2 and min(sh) > 0 for _, sh in shapes)
        except (ValueError, AssertionError):
            raise ValueError(f"--shapes takes OUTxIN pairs such as 64x32; got {' '.join(args.shapes)}") from None
    result = bench_optimizer(manifolds=args.manifolds, scales=args.scales, layers=layers, solvers=args.solvers,
                             device=device, muon_dtype=muon_dtype, spectrum=args.spectrum, repeats=args.repeats,
                             seed=args.seed, shapes=shapes, log=log)
    result["machine"] = _machine(device)
    result["command"] = "geomtrain bench " + " ".join(argv)
    result["wall_seconds"] = time.perf_counter() - t0
    print(format_optimizer_table(result))
    print(f"\n{result['command']}  ({result['wall_seconds']:.0f} s, {result['machine'].get('cpu', device)}, "
          f"{result['machine']['threads']} threads)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.out}")
    return 0


def add_parser(sub) -> None:
    """Register ``optimizer`` on the ``geomtrain bench`` subparsers."""
    p = sub.add_parser("optimizer", help="Manifold Muon solvers vs AdamW and plain Muon at GPT-2-small shapes",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--layers", type=int, default=None, help="transformer layers (4 matrices each); default 12 on GPU, 1 on CPU")
    p.add_argument("--manifolds", nargs="+", default=["stiefel", "dgram"], choices=["stiefel", "dgram", "oblique"])
    p.add_argument("--scales", nargs="+", type=float, default=[1e-3, 1.0], help="gradient entry RMS (default: 1e-3 1)")
    p.add_argument("--solvers", nargs="+", default=list(OPT_SOLVERS), choices=list(OPT_SOLVERS))
    p.add_argument("--shapes", nargs="+", default=None, metavar="OUTxIN",
                   help="matrix shapes instead of a GPT-2-small layer (e.g. 64x32 32x64)")
    p.add_argument("--spectrum", default="gaussian", choices=["gaussian", "powerlaw"],
                   help="gradient singular values: i.i.d. Gaussian entries, or k^-1/2 decay")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--muon-dtype", default=None, choices=list(_DTYPES),
                   help="msign dtype of muon/published/tangent (default bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--repeats", type=int, default=1, help="time each solve this many times, keep the best")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the full results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(handler=_cmd_optimizer)
