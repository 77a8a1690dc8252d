r"""Where a preset's training step spends its direction solves, and what other solver settings would cost.

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

With ``--variants NAME ...`` every profiled problem is solved again under each variant (`VARIANTS`, or
``KEY=VALUE[+KEY=VALUE...]``: the run's options with these solver options changed), timed
side by side with the run's own solve, and each group gets a line per variant (with ``--reference``, its
true gaps too) and, for warm groups, how far the warm-start state moved between consecutive steps
($\|S_k - S_{k-1}\|_F / \|S_k\|_F$ per matrix: for tall matrices the multiplier, for square DGram the
Douglas-Rachford iterate) next to the cosine between consecutive momenta and how far the direction moved
($\|A_k - A_{k-1}\|_F / \|A_k\|_F$). Training itself always uses the run's own directions.

    OMP_NUM_THREADS=1 python scripts/profile_solves.py all-dgram --first 40 --last 44
    OMP_NUM_THREADS=1 python scripts/profile_solves.py all-dgram --first 41 --last 41 --reference
    OMP_NUM_THREADS=1 python scripts/profile_solves.py hetero --first 40 --last 41 --variants cold extrapolated float32
    OMP_NUM_THREADS=1 python scripts/profile_solves.py all-stiefel --first 41 --last 45 --null-census
    OMP_NUM_THREADS=1 python scripts/profile_solves.py all-stiefel --first 41 --last 43 --variants deflated
    OMP_NUM_THREADS=1 python scripts/profile_solves.py all-dgram --first 41 --last 42 --variants frozen-r continuation
    OMP_NUM_THREADS=1 python scripts/profile_solves.py all-dgram --first 41 --last 41 --reference \
        --variants smoothing=0.03 max_iter=6 compute_dtype=float32+smoothing=0.03

With ``--ops`` the profiled optimizer steps are also timed per aten operator (`OperatorTimer`): what
the whole ``ManifoldMuon.step`` spends in eigendecompositions and SVDs, in matrix products and in
everything else, the dearest operators, and the functions of `geomtrain` and `manifolds` that called
the dearest ones. These are the operators' own times, not the Python between them, and the timer slows
the steps it watches (the step times printed then include it); not with ``--variants`` or
``--reference``, whose extra solves it would count.

    OMP_NUM_THREADS=1 python scripts/profile_solves.py all-dgram --first 41 --last 43 --ops

With ``--null-census`` each group also gets a line per kind of momentum: those with LayerNorm's null
direction to rounding (the matrices that write into the residual stream) and the others, with their
evaluations per solve (docs/solver-experiments.md, *An exact null direction, deflated*).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import inspect
import os
import runpy
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import geomtrain
import geomtrain.optim.muon as muon_module
import manifolds
from geomtrain.bench.optimizer import reference_solve
from geomtrain.config import make_config, parse_solver_options, positive_int
from geomtrain.optim import mask_kind
from geomtrain.optim.gram import Evaluation, GramDual
from geomtrain.optim.gram_newton import OPTIONS as GRAM_NEWTON_OPTIONS
from geomtrain.optim.numerics import normalise
from geomtrain.train import Trainer
from manifolds import Stiefel
from manifolds.base import from_tall, to_tall

VARIANTS = {
    "cold": "no warm start (neither the previous multiplier nor the float64 hint)",
    "extrapolated": "warm start from 2 S_(k-1) - S_(k-2), the states of the two previous steps, linearly extrapolated",
    "float32": "compute_dtype=float32: no escalation to float64",
    "stiefel": "DGram only: the Stiefel problem at the column-normalised W, cold (the cost of the mask itself)",
    "deflated": "Stiefel only: the momenta with LayerNorm's exact null direction v solved with v deflated "
    "(n - 1 columns, warm from U^T S U) and completed in closed form (scripts/null_direction_deflation.py), "
    "the others as the run solves them",
    "continuation": "tall: first solved with smoothing 0.1 to tol 1e-3 (from the run's start), then with the "
    "run's options from that multiplier (a homotopy in the smoothing)",
    "frozen-r": "tall, warm: started where the frozen-R system of the previous step's optimal R holds "
    "(P(Z R + R Z^T) = 0 with Z = K + Gamma S) instead of at the previous multiplier",
}
# Any other variant is KEY=VALUE[+KEY=VALUE...]: the run's own options with these solver options changed.
OPTION_VARIANTS = (
    "KEY=VALUE[+KEY=VALUE...] (solver options, e.g. anderson=0, max_iter=4, smoothing=0.03+compute_dtype=float32)"
)


# How --ops sorts the aten operators (by their overload packet's name); the rest is "other operators".
OPERATOR_KINDS = {
    "eigendecompositions and SVDs": ("_linalg_eigh", "linalg_eigvalsh", "_linalg_svd", "linalg_svd"),
    "matrix products": ("mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul"),
}


# The packages whose functions --ops charges an operator to (the innermost of their frames that called it).
CALLER_ROOTS = tuple(str(Path(m.__file__).parent) + os.sep for m in (geomtrain, manifolds))


class OperatorTimer(TorchDispatchMode):
    """Wall time and calls per aten operator while ``on`` (the operator's own time, measured around it),
    and the same per calling function: the innermost frame in `geomtrain` or `manifolds`
    (``file.py:function``)."""

    def __init__(self):
        super().__init__()
        self.on = False
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.caller_seconds: collections.Counter = collections.Counter()
        self.caller_calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.on:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds = time.perf_counter() - start
        name = func.overloadpacket.__name__
        self.seconds[name] += seconds
        self.calls[name] += 1
        caller = caller_name(inspect.currentframe())
        self.caller_seconds[caller] += seconds
        self.caller_calls[caller] += 1
        return out

    def kinds(self) -> dict[str, float]:
        """Seconds per kind of `OPERATOR_KINDS`, and ``"other operators"``."""
        out = {kind: sum(self.seconds[n] for n in names) for kind, names in OPERATOR_KINDS.items()}
        out["other operators"] = sum(self.seconds.values()) - sum(out.values())
        return out


def caller_name(frame) -> str:
    """``file.py:function`` of the innermost frame from ``frame`` outwards that is in `CALLER_ROOTS`."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(CALLER_ROOTS):
            return f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "elsewhere"


def timing_operators(step, timer: OperatorTimer, now: dict):
    """``ManifoldMuon.step`` with ``timer`` on inside it during the profiled steps."""

    @functools.wraps(step)
    def timed(self, *args, **kwargs):
        timer.on = now["profiling"]
        try:
            return step(self, *args, **kwargs)
        finally:
            timer.on = False

    return timed


def variant_options(name: str, manifold, W: torch.Tensor, options: dict, history: list) -> tuple | None:
    """``(manifold, W, options)`` of variant ``name`` for one solve call, or None where it does not apply
    (``history``: the warm-start states this call returned at earlier steps, oldest first)."""
    cold = {k: v for k, v in options.items() if k not in ("dual", "escalate")}
    if name == "cold":
        return manifold, W, cold
    if name == "extrapolated":
        if "dual" not in options or len(history) < 2 or history[-1].shape != history[-2].shape:
            return None
        return manifold, W, {**options, "dual": 2 * history[-1] - history[-2]}
    if "=" in name:
        return manifold, W, {**options, **option_variant(name)}
    if name == "float32":
        return manifold, W, {**options, "compute_dtype": torch.float32, "escalate": None}
    if name == "stiefel":
        if mask_kind(manifold) != "dgram" or W.shape[-2] < W.shape[-1]:
            return None
        Q = W / W.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(W.dtype).tiny)
        return Stiefel(), Q, cold
    raise unknown_variant(name)


def unknown_variant(name: str) -> ValueError:
    """The one-line error for a variant that is neither a name of `VARIANTS` nor ``KEY=VALUE`` options."""
    return ValueError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)} or {OPTION_VARIANTS}")


def option_variant(name: str) -> dict:
    """The solver options of a ``KEY=VALUE[+KEY=VALUE...]`` variant, typed and checked by the library's parser
    (a one-line ``ValueError`` naming the valid keys for a bad one)."""
    return parse_solver_options(name.split("+"), what="variant")


def variant_name(text: str) -> str:
    """``--variants`` entries: a name of `VARIANTS` or an option variant (argparse type: exit 2 otherwise)."""
    try:
        if text not in VARIANTS:
            if "=" not in text:
                raise unknown_variant(text)
            option_variant(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def entries(options: dict, idx: torch.Tensor) -> dict:
    """The solve options of batch entries ``idx``: the per-entry tensors (``dual``, ``escalate``) indexed."""
    return {k: v[idx.to(v.device)] if isinstance(v, torch.Tensor) else v for k, v in options.items()}


@functools.cache
def deflation_prototype() -> dict:
    """The functions of scripts/null_direction_deflation.py (``complement``, ``complete``), loaded once."""
    return runpy.run_path(str(Path(__file__).with_name("null_direction_deflation.py")))


def deflated_solve(solve, manifold, W: torch.Tensor, U: torch.Tensor, options: dict):
    r"""The ``deflated`` variant of one solve call: ``(A, stats)`` with ``stats.evaluations`` and ``stats.dual_gap``
    per matrix, or None where it does not apply (not Stiefel, square, or no momentum with an exact null).

    Momenta with $\|\hat G v\| \le$ ``EXACT_NULL`` $\|\hat G\|_{\mathrm{op}}$ ($v = \mathbf 1/\sqrt n$, tall form)
    are solved as the Stiefel problem of $(WU, \hat GU)$ with $n - 1$ columns, warm-started at $U^\top SU$,
    and completed by scripts/null_direction_deflation.py's ``complete``; the certified gap is the deflated
    solve's ($\langle \hat G, A\rangle = \langle \hat GU, A'\rangle$ and its dual value bounds the optimum).
    The others are solved as the run solves them. Everything is timed by the caller."""
    if mask_kind(manifold) != "stiefel" or W.dim() != 3 or W.shape[-1] == W.shape[-2]:
        return None
    exact = null_ratio(U) <= EXACT_NULL
    if not bool(exact.any()):
        return None
    prototype = deflation_prototype()
    T, G = to_tall(W), to_tall(U, W)
    n = T.shape[-1]
    v = torch.full((n,), n**-0.5, dtype=torch.float64)
    basis = prototype["complement"](v)
    A = torch.empty_like(T)
    stats = SimpleNamespace(
        evaluations=torch.zeros(T.shape[0], dtype=torch.long), dual_gap=torch.zeros(T.shape[0], dtype=torch.float64)
    )
    for part, deflate in ((exact.nonzero().squeeze(-1), True), ((~exact).nonzero().squeeze(-1), False)):
        if part.numel() == 0:
            continue
        opts = entries(options, part)
        if not deflate:
            A_part, st = solve(manifold, T[part], G[part], **opts)
        else:
            if opts.get("dual") is not None:
                opts["dual"] = (basis.mT @ opts["dual"].double() @ basis).to(opts["dual"].dtype)
            A_def, st = solve(
                manifold, (T[part].double() @ basis).to(T.dtype), (G[part].double() @ basis).to(T.dtype), **opts
            )
            A_part = torch.stack(
                [prototype["complete"](T[j].double(), a.double(), basis, v)[0] for j, a in zip(part.tolist(), A_def)]
            ).to(T.dtype)
        A[part] = A_part
        stats.evaluations[part] = st.evaluations.reshape(-1)
        stats.dual_gap[part] = st.dual_gap.reshape(-1).double()
    return from_tall(A, W), stats


# Frozen-R steps per start: one solves the Stiefel system exactly (closed form in the eigenbasis of R); the DGram
# step approximates the Schur complement of its zero diagonal (rank DGRAM_STEP_RANK), so it is repeated.
FROZEN_STEPS = {"stiefel": 1}
FROZEN_STEPS_OTHER = 4


def tall_dual(manifold, W: torch.Tensor, U: torch.Tensor, options: dict) -> GramDual:
    """The float64 Gram-space dual of a batch ``(B, m, n)`` or ``(B, n, m)`` in its tall form, with the run's
    smoothing and inner-CG settings."""
    opts = {**GRAM_NEWTON_OPTIONS, **options}
    T, G = to_tall(W), to_tall(U, W)
    Gh, _ = normalise(G)
    return GramDual(manifold, T, Gh, torch.float64, opts["smoothing"], opts["cg_iters"], opts["cg_tol"])


def optimum_weights(manifold, W: torch.Tensor, U: torch.Tensor, options: dict, multiplier: torch.Tensor) -> tuple:
    r"""``(V, lam, r)`` of $M$ at a solve's multiplier (float64): the optimal $R = V\operatorname{diag}(r)V^\top$
    that the next step's ``frozen-r`` variant starts from (a solver would keep its last evaluation)."""
    ev = tall_dual(manifold, W, U, options).evaluate(multiplier.double())
    return ev.V, ev.lam, ev.r


def frozen_r_start(manifold, W: torch.Tensor, U: torch.Tensor, options: dict, previous: tuple) -> torch.Tensor:
    r"""The ``frozen-r`` start: from the previous multiplier $S$, frozen-R steps (`GramDual.step`) with the
    previous step's optimal $R$ (``previous`` = ``(V, lam, r)``), i.e. towards the $S$ at which
    $P(ZR + RZ^\top) = 0$, $Z = K + \Gamma S$ (linear in $S$ for a fixed $R$)."""
    dual = tall_dual(manifold, W, U, options)
    V, lam, r = previous
    R = (V * r.unsqueeze(-2)) @ V.mT
    S = options["dual"].double()
    for _ in range(FROZEN_STEPS.get(dual.kind, FROZEN_STEPS_OTHER)):
        ZR = dual.gram(S)[1] @ R
        H = dual.P(ZR + ZR.mT)
        Ht = V.mT @ H @ V if dual.kind == "stiefel" else None
        S = S + dual.step(Evaluation(S, V, lam, r, R, H, Ht, dual.residual(H)))
    return S.to(options["dual"].dtype)


def frozen_r_solve(solve, manifold, W: torch.Tensor, U: torch.Tensor, options: dict, previous: tuple | None):
    """The ``frozen-r`` variant of one solve call: solved from `frozen_r_start`, or None where it does not apply
    (a cold call, or no optimum kept from the previous step for a batch of this size)."""
    if previous is None or "dual" not in options or previous[0].shape != options["dual"].shape:
        return None
    return solve(manifold, W, U, **{**options, "dual": frozen_r_start(manifold, W, U, options, previous)})


# The continuation variant's first stage: a smoothing (tau / sigma_rms) and tolerance at which the tall training
# problems of mini took 3.5-6 evaluations per matrix warm and 5-7.5 cold (all-stiefel and all-dgram, step 41).
CONTINUATION_STAGE = {"smoothing": 0.1, "tol": 1e-3}


def continuation_solve(solve, manifold, W: torch.Tensor, U: torch.Tensor, options: dict):
    """The ``continuation`` variant of one solve call: ``(A, stats)`` with the evaluations of both stages summed
    and the second stage's certified gap, or None for square matrices (square DGram has no smoothing)."""
    if W.shape[-1] == W.shape[-2]:
        return None
    _, first = solve(manifold, W, U, **{**options, **CONTINUATION_STAGE})
    A, second = solve(manifold, W, U, **{**options, "dual": first.dual, "escalate": first.escalated})
    return A, SimpleNamespace(evaluations=first.evaluations + second.evaluations, dual_gap=second.dual_gap)


def _range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f} (median {statistics.median(values):.2f})"


EXACT_NULL = 1e-5  # |G v| / |G|_op below this: LayerNorm's null direction to float32 rounding (measured 2-5e-7)


def null_ratio(U: torch.Tensor) -> torch.Tensor:
    r"""$\|\hat G v\| / \|\hat G\|_{\mathrm{op}}$ per matrix (flattened batch), $v = \mathbf 1/\sqrt n$, tall form."""
    G = U.reshape(-1, *U.shape[-2:]).double()
    G = G if G.shape[-2] >= G.shape[-1] else G.mT
    v = torch.full((G.shape[-1],), G.shape[-1] ** -0.5, dtype=torch.float64)
    return (G @ v).norm(dim=-1) / torch.linalg.matrix_norm(G, ord=2).clamp_min(torch.finfo(torch.float64).tiny)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("--first", type=int, default=40, help="first profiled step (default 40)")
    parser.add_argument("--last", type=int, default=44, help="last profiled step (default 44)")
    parser.add_argument("--model", default="mini", help="a model of geomtrain.model.MODEL_CONFIGS (default mini)")
    parser.add_argument("--data-dir", default="data/classics-bpe8k")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--reference", action="store_true", help="check each profiled direction against float64")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[],
        type=variant_name,
        help=f"solve again with these: {', '.join(VARIANTS)} or {OPTION_VARIANTS}",
    )
    parser.add_argument(
        "--null-census",
        action="store_true",
        help="per group, the evaluations per solve split by the momentum's LayerNorm null direction: exact "
        f"(|G v| <= {EXACT_NULL:g} |G|_op, v = 1/sqrt(n), tall form) or not",
    )
    parser.add_argument(
        "--ops",
        action="store_true",
        help="time the profiled optimizer steps per aten operator (not with --variants or --reference)",
    )
    args = parser.parse_args()
    if not 0 <= args.first <= args.last:
        parser.error(f"need 0 <= --first <= --last, got {args.first} and {args.last}")
    if args.ops and (args.variants or args.reference):
        parser.error("--ops times the run's own step: leave out --variants and --reference")
    torch.set_num_threads(args.threads)

    # per (group, variant): seconds, evaluations, matrices; variant "" is the run's own solve
    totals: dict[tuple, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
    gaps: dict[tuple, list[tuple[float, float]]] = collections.defaultdict(list)  # (true gap, certified gap)
    moves: dict[tuple, list[float]] = collections.defaultdict(list)  # warm-start state moves, per matrix
    turns: dict[tuple, list[float]] = collections.defaultdict(list)  # |A_k - A_(k-1)| / |A_k|, per matrix
    optima: dict[int, tuple] = {}  # per call: (V, lam, r) of the previous step's optimum (frozen-r)
    directions: dict[int, torch.Tensor] = {}  # per call: the previous step's direction
    history: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=2))
    momenta: dict[int, torch.Tensor] = {}  # the momentum of each call at the previous step
    cosines: dict[tuple, list[float]] = collections.defaultdict(list)  # with the previous step's, per matrix
    now = {"profiling": False, "call": 0}
    solve = muon_module.spectral_direction
    census: dict[tuple, list[tuple[int, float]]] = collections.defaultdict(list)  # (evaluations, |G v| / |G|_op)

    def record(key, variant, seconds, stats, W, manifold, U, A):
        row = totals[key, variant]
        row[0] += seconds
        row[1] += int(stats.evaluations.sum())
        row[2] += W.shape[0] if W.dim() == 3 else 1
        if args.reference and variant != "stiefel":  # the stiefel variant solves another problem
            _, _, (true,) = reference_solve(manifold, W, U, [A], tol=1e-9, max_iter=3000, smoothing=1e-6)
            gaps[key, variant].extend(zip(true.reshape(-1).tolist(), stats.dual_gap.reshape(-1).tolist()))

    def timed_solve(manifold, W, U, **options):
        call = now["call"]
        now["call"] += 1
        start = time.perf_counter()
        A, stats = solve(manifold, W, U, **options)
        seconds = time.perf_counter() - start
        if now["profiling"]:
            key = (type(manifold).__name__, "x".join(map(str, W.shape[-2:])), "warm" if "dual" in options else "cold")
            record(key, "", seconds, stats, W, manifold, U, A)
            if args.null_census:
                for evaluations, ratio in zip(stats.evaluations.reshape(-1).tolist(), null_ratio(U).tolist()):
                    census[key, ratio <= EXACT_NULL].append((evaluations, ratio))
            if args.variants and "dual" in options and stats.dual is not None:
                before, after = options["dual"].double(), stats.dual.double()
                moves[key].extend(((after - before).norm(dim=(-2, -1)) / after.norm(dim=(-2, -1))).reshape(-1).tolist())
            if args.variants and momenta.get(call) is not None and momenta[call].shape == U.shape:
                cos = torch.nn.functional.cosine_similarity(U.double().flatten(-2), momenta[call].flatten(-2), dim=-1)
                cosines[key].extend(cos.reshape(-1).tolist())
                turn = (A.double() - directions[call]).norm(dim=(-2, -1)) / A.double().norm(dim=(-2, -1))
                turns[key].extend(turn.reshape(-1).tolist())
            for name in args.variants:
                start = time.perf_counter()
                if name == "deflated":
                    result = deflated_solve(solve, manifold, W, U, options)
                elif name == "continuation":
                    result = continuation_solve(solve, manifold, W, U, options)
                elif name == "frozen-r":
                    result = frozen_r_solve(solve, manifold, W, U, options, optima.get(call))
                else:
                    setting = variant_options(name, manifold, W, options, list(history[call]))
                    result = None if setting is None else solve(setting[0], setting[1], U, **setting[2])
                if result is not None:
                    record(key, name, time.perf_counter() - start, result[1], W, manifold, U, result[0])
        if args.variants:  # what the next step's variants compare with
            if stats.dual is not None:
                history[call].append(stats.dual.clone())
            momenta[call] = U.detach().to(torch.float64, copy=True)
            directions[call] = A.detach().to(torch.float64, copy=True)
            tall = stats.multiplier is not None and W.shape[-1] != W.shape[-2] and W.dim() == 3
            if "frozen-r" in args.variants and tall:  # untimed: a solver would keep its last evaluation
                optima[call] = optimum_weights(manifold, W, U, options, stats.multiplier)
        return A, stats

    muon_module.spectral_direction = timed_solve
    timer = OperatorTimer()
    if args.ops:
        muon_module.ManifoldMuon.step = timing_operators(muon_module.ManifoldMuon.step, timer, now)
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
    with timer if args.ops else contextlib.nullcontext():  # the mode itself slows every operator: only with --ops
        for step in range(args.last + 1):
            now["profiling"], now["call"] = step >= args.first, 0
            seconds = trainer.step().seconds
            if now["profiling"]:
                step_seconds += seconds
    steps = args.last + 1 - args.first
    extra = [w for w, on in (("reference", args.reference), ("variant", args.variants)) if on]
    note = f" (including the untimed {' and '.join(extra)} solves)" if extra else ""
    note += " (slowed by the operator timer)" if args.ops else ""
    print(f"{args.preset}: {step_seconds / steps * 1e3:.0f} ms/step over steps {args.first}-{args.last}{note}")
    if args.ops:
        print_operators(timer, steps)
    own = sorted(((k, v) for k, v in totals.items() if k[1] == ""), key=lambda kv: -kv[1][0])
    for (key, _), (seconds, evaluations, matrices) in own:
        manifold, shape, start = key
        print(
            f"  {manifold} {shape} {start}: {seconds / steps * 1e3:.0f} ms/step, "
            f"{evaluations / steps:.1f} evaluations/step over {matrices / steps:.0f} matrices"
        )
        if gaps[key, ""]:
            true, certified = zip(*gaps[key, ""])
            print(
                f"    gap to the float64 optimum: largest {max(true):.1e}, median {sorted(true)[len(true) // 2]:.1e}; "
                f"largest certified gap {max(certified):.1e}"
            )
        for name in args.variants:
            if (key, name) not in totals:
                continue
            seconds_v, evaluations_v, _ = totals[key, name]
            line = f"    variant {name}: {seconds_v / steps * 1e3:.0f} ms/step, "
            line += f"{evaluations_v / steps:.1f} evaluations/step"
            if gaps[key, name]:
                true, certified = zip(*gaps[key, name])
                line += f"; gap largest {max(true):.1e}, median {sorted(true)[len(true) // 2]:.1e}"
                line += f", largest certified {max(certified):.1e}"
            print(line)
        if moves[key]:
            print(f"    warm-start state moved {_range(moves[key])} between steps")
        if cosines[key]:
            print(f"    momentum cosine with the previous step {_range(cosines[key])}")
        if turns[key]:
            print(f"    direction moved {_range(turns[key])} between steps")
        for exact in (True, False):
            if census[key, exact]:
                evaluations, ratios = zip(*census[key, exact])
                print(
                    f"    {'exact' if exact else 'no exact'} null direction: {len(ratios) // steps} matrices, "
                    f"{sum(evaluations) / len(evaluations):.1f} evaluations per solve ({min(evaluations)}-"
                    f"{max(evaluations)}), |G v| / |G|_op {min(ratios):.1e}-{max(ratios):.1e}"
                )


def print_operators(timer: OperatorTimer, steps: int, most: int = 8) -> None:
    """The ``--ops`` lines: the optimizer step's operator time, by kind, then its dearest operators, then
    the functions whose operators cost the most."""
    total = sum(timer.seconds.values())
    calls = sum(timer.calls.values()) // steps
    print(f"  optimizer step, aten operators: {total / steps * 1e3:.0f} ms/step, {calls} calls/step")
    for kind, seconds in timer.kinds().items():
        print(f"    {kind}: {seconds / steps * 1e3:.0f} ms/step ({seconds / max(total, 1e-12):.0%})")
    for name, seconds in timer.seconds.most_common(most):
        print(f"    {name}: {seconds / steps * 1e3:.1f} ms/step, {timer.calls[name] / steps:.0f} calls/step")
    print("  by calling function:")
    for name, seconds in timer.caller_seconds.most_common(most):
        calls = timer.caller_calls[name] / steps
        print(f"    {name}: {seconds / steps * 1e3:.1f} ms/step, {calls:.0f} operator calls/step")


if __name__ == "__main__":
    main()
