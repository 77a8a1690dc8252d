r"""Solver ``"exact"`` (the reference; alias ``"gram_newton"``): Anderson-accelerated Gauss-Newton on the Gram dual.

Freezing $R$ linearises the stationarity condition $L_W(YR) = 0$ in $S$ (`GramDual.step`); Anderson mixing over the last
``anderson`` steps accelerates it, and a mixed step that doubles the residual is replaced by the plain step from the
best point. The iterate of lowest residual is returned; the stop test is $\mathrm{RMS}(L_W(A)) \le$ ``tol`` of exactly
that $A$. A warm start (``dual=``, the previous multiplier) whose first residual is above ``warm_reset`` restarts from
the tangent projection $S_T$. A float32 dual the first evaluation finds ill-conditioned (``ESCALATE``) is solved in
float64; ``stats.escalated``, passed back as ``escalate=``, skips that float32 probe.

Square DGram goes to `solve_square_dgram`; DGram and custom masks with $m < 2n$, and stalled entries, continue with
`douglas_rachford`; past ``max_iter`` the best direction is projected onto the tangent space and scaled by its exact
spectral norm (`GramDual.polish`). So every direction is tangent to ``tol`` with $\|A\|_{\mathrm{op}} \le 1$ (to
rounding), and ``dual_gap`` $= (U - \langle\hat G, A\rangle)/U$, $U \ge \|\hat G + WS\|_* \ge \mathrm{OPT}$ at the
returned multiplier (`GramDual.upper_bound`), bounds its relative suboptimality.
"""

from __future__ import annotations

import math

import torch

from manifolds import GramManifold, MaskForm

from .douglas_rachford import DR_ANDERSON, douglas_rachford
from .gram import CERTIFICATE_SMOOTHING, ROUNDING_FLOOR, Evaluation, GramDual, inverse_sqrt_weights
from .numerics import Anderson, Trace, WorkingSet, eigh_psd, normalise, sym
from .solver import Solver, StateSlot
from .square_dgram import SQUARE_ANDERSON, solve_square_dgram

__all__ = ["solve_gram_newton", "solve_exact", "OPTIONS", "SOLVER"]

OPTIONS = {
    "tol": 1e-4,
    "max_iter": 50,
    "anderson": 5,
    "smoothing": 1e-3,
    "compute_dtype": None,
    "warm_reset": 0.1,
    "cg_iters": 10,
    "cg_tol": 1e-2,
    "relative_tol": False,
}
"""The scalar options and their defaults (the warm-start state travels as ``dual=``/``escalate=``)."""

STALL_WINDOW, STALL_FACTOR = 4, 0.7  # an entry stops where its best residual fell less than 0.7x in 4 evaluations
DR_ASPECT = 2.0  # below m / n = 2, DGram and custom-mask duals are typically degenerate
FLOOR = {torch.float32: 1e-6, torch.float64: 1e-12}  # residuals at the rounding floor of the weights
STOP_MARGIN = {torch.float32: 0.95, torch.float64: 1.0}  # x tol: the returned A = Y R differs from it by rounding
ESCALATE = 2e-4  # float32 duals with lambda_min(M) below this x lambda_max (~2000 roundoffs) go to float64
SQUARE_STIEFEL_LOSS = 1e-4  # float32 square Stiefel losing more of the objective to the smoothing goes to float64


def compute_dtype_for(T: torch.Tensor, requested: torch.dtype | None) -> torch.dtype:
    """The dtype the $n \\times n$ work starts in: as requested, else float64 for float64 inputs, else float32."""
    if requested is not None:
        return requested
    return torch.float64 if T.dtype == torch.float64 else torch.float32


def solve_gram_newton(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, opts: dict
) -> tuple[torch.Tensor, dict]:
    """Solve a batch of tall problems ``(B, m, n)``; returns ``(A, raw statistics)``. Long because the phases
    (special shapes, precision probe, Newton loop, fallback, polish, certificate) read best in order."""
    tol, max_iter = float(opts["tol"]), int(opts["max_iter"])  # checked by direction.check_solver_options
    B, m, n = T.shape
    Gh, zero = normalise(G)
    live = ~zero.view(B)
    trace = Trace() if opts["trace"] else None
    dtype = compute_dtype_for(T, opts["compute_dtype"])
    square_dgram = manifold.mask_form is MaskForm.OFF_DIAGONAL and m == n
    hint = opts["escalate"]
    if hint is not None and not square_dgram and dtype == torch.float32 and opts["compute_dtype"] is None:
        hint = hint.reshape(B).to(device=T.device, dtype=torch.bool)
        if bool(hint.any()):  # entries escalated at the previous step: straight to float64, no float32 probe
            return _solve_apart(manifold, T, G, opts, hint, 0)
    stop = tol * STOP_MARGIN.get(dtype, 1.0)
    if square_dgram:
        scale = _residual_scale(T) if opts["relative_tol"] else None
        depth = min(int(opts["anderson"]), SQUARE_ANDERSON)  # the option caps it, as for douglas_rachford
        A, out = solve_square_dgram(
            T.to(dtype), Gh.to(dtype), live, tol, stop, max_iter, opts["dual"], trace, scale, depth
        )
        return torch.where(zero, torch.zeros_like(A), A).to(T.dtype), out
    if manifold.mask_form is MaskForm.FULL and m == n:
        A, out = _square_stiefel(manifold, T, Gh, live, dtype, opts, trace)
        if A is None:  # out: the entries to redo in float64, counting the float32 evaluation they spent
            return _solve_apart(manifold, T, G, opts, out, 1)
        return torch.where(zero, torch.zeros_like(A), A).to(T.dtype), out
    dual, S_T, S, first, extra, mixed = _probe(manifold, T, Gh, zero, live, dtype, stop, opts)
    if mixed is not None:
        return _solve_apart(manifold, T, G, opts, mixed, extra)
    stop = tol * STOP_MARGIN[dual.C.dtype]
    degenerate = dual.form in (MaskForm.OFF_DIAGONAL, MaskForm.CUSTOM) and m < DR_ASPECT * n
    warm = S_T if opts["dual"] is not None else None
    budget = 1 if degenerate else max_iter
    best, calls = _newton(
        dual, S, warm, float(opts["warm_reset"]), stop, budget, int(opts["anderson"]), live, trace, first
    )
    calls[live.cpu()] += extra  # float32 probe evaluations that were not kept
    S_out, res = best["S"], best["res"]
    coef = torch.stack([best["R"], best["S"] @ best["R"]], 1)
    _, A, U = dual.certify(best["S"], best["R"], best["r"], best["V"], best["lam"])
    stalled = (res > max(tol, FLOOR.get(T.dtype, 1e-6))) & (calls.to(T.device) < max_iter) & live
    if bool(stalled.any()):
        _douglas_rachford_fallback(dual, best, stalled, stop, max_iter, opts, trace, calls, coef, res, S_out, A, U)
    converged = res <= tol
    polish = ~converged & live
    if bool(polish.any()):
        j = polish.nonzero().squeeze(-1)
        sub = dual.sub(j)
        Zp, res[j] = sub.polish(coef[j])
        A[j] = sub.combine(Zp)
        calls[j.cpu()] += 1
    A = torch.where(zero, torch.zeros_like(A), A)
    prim = (A.double() * Gh.double()).sum(dim=(-2, -1))
    z = zero.view(B)
    gap = torch.where(z, torch.zeros_like(prim), (U - prim) / U.clamp_min(torch.finfo(torch.float64).tiny))
    if trace is not None and bool(polish[0]):
        trace.add(res[0], prim[0], U[0])
    return A.to(T.dtype), {
        "evaluations": calls,
        "residual": torch.where(z, torch.zeros_like(res), res).double().cpu(),
        "converged": (converged | z).cpu(),
        "dual_gap": gap.cpu(),
        "dual": torch.where(zero, torch.zeros_like(S_out), S_out),
        "multiplier": torch.where(zero, torch.zeros_like(S_out), S_out),
        "escalated": _escalated(T, dual.C.dtype, B),
        "trace": trace,
    }


def _square_stiefel(manifold, T, Gh, live, dtype, opts, trace):
    r"""Square Stiefel ($\{W\Omega\}$ is closed under msign): one evaluation at $S_T$, $Z = \operatorname{skew}(K)$,
    $A = W\operatorname{skew}(ZR)$; ``(None, mask)``: float32 entries to redo in float64 (``SQUARE_STIEFEL_LOSS``)."""
    n = T.shape[-1]
    Td = T.to(dtype)
    K = Td.mT @ Gh.to(dtype)
    Z = 0.5 * (K - K.mT)  # K + S_T with S_T = -sym(K); Y = W Z, M = Z^T Z (W^T W = I: no C needed)
    lam, V = eigh_psd(Z.mT @ Z)
    lam = lam.clamp_min(0)
    floor = ROUNDING_FLOOR * torch.finfo(dtype).eps
    r = inverse_sqrt_weights(lam, float(opts["smoothing"]) ** 2 / n, floor)
    if dtype == torch.float32 and opts["compute_dtype"] is None:
        sig = lam.sqrt()
        loss = (sig - lam * r).clamp_min(0).sum(-1) / sig.sum(-1).clamp_min(torch.finfo(dtype).tiny)
        ill = (loss > SQUARE_STIEFEL_LOSS) & live
        if bool(ill.any()):
            return None, ill
    ZR = Z @ ((V * r.unsqueeze(-2)) @ V.mT)
    Bk = 0.5 * (ZR - ZR.mT)
    A = Td @ Bk
    res = torch.where(live, ((Bk + Bk.mT).square().sum(dim=(-2, -1)) / (n * n)).sqrt(), torch.zeros_like(lam[..., 0]))
    S_T = Z - K
    eps = torch.finfo(dtype).eps
    margin = eps * n * n**0.5 * S_T.double().norm(dim=(-2, -1))
    U = 0.5 * ((ZR.double() * Z.double()).sum(dim=(-2, -1)) + r.double().reciprocal().sum(-1)) + margin
    if dtype == torch.float64:
        r_c = inverse_sqrt_weights(lam, CERTIFICATE_SMOOTHING**2 / n, floor)
        tight = 0.5 * ((Z @ ((V * r_c.unsqueeze(-2)) @ V.mT) * Z).sum(dim=(-2, -1)) + r_c.reciprocal().sum(-1))
        U = torch.minimum(U, tight + margin)
    prim = (A.double() * Gh.double()).sum(dim=(-2, -1))
    gap = torch.where(live, (U - prim) / U.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(U))
    if trace is not None:
        trace.add(res[0], prim[0], U[0])
    calls = torch.where(live.cpu(), 1, 0).long()
    tol = float(opts["tol"])
    return A, {
        "evaluations": calls,
        "residual": res.double().cpu(),
        "converged": (res <= tol).cpu() | ~live.cpu(),
        "dual_gap": gap.cpu(),
        "dual": torch.where(live[:, None, None], S_T, torch.zeros_like(S_T)),
        "multiplier": torch.where(live[:, None, None], S_T, torch.zeros_like(S_T)),
        "escalated": _escalated(T, dtype, T.shape[0]),
        "trace": trace,
    }


def _probe(manifold, T, Gh, zero, live, dtype, stop, opts):
    r"""``(dual, S_T, S, first, extra, mixed)``: the dual, set up again in float64 where the first float32 evaluation
    finds it ill-conditioned (warm starts: at $S_T$), the kept evaluation, evaluations spent, ill entries of a mix."""
    dual, S_T, S = _setup(manifold, T, Gh, zero, dtype, opts)
    if opts["compute_dtype"] is not None or dtype != torch.float32:
        return dual, S_T, S, None, 0, None
    first = dual.evaluate(S)
    ill = (first.lam[..., 0] < ESCALATE * first.lam[..., -1]) & (first.res > stop) & live
    spent = 1
    if opts["dual"] is not None:  # a warm start that the monitor will reset says nothing about the problem
        ill = ill & (first.res <= float(opts["warm_reset"]))
        if bool(ill.any()):  # ill-conditioned near the optimum: ask the tangent start whether the problem is
            ill = ill & (dual.conditioning(S_T) < ESCALATE)
            spent = 2  # the eigenvalues at S_T, counted as an evaluation (they cost about half of one)
    if bool(ill.any()) and not bool(ill[live].all()):
        return dual, S_T, S, None, spent, ill  # the precision is decided per entry: solve the two kinds apart
    if bool(ill.any()):
        return (*_setup(manifold, T, Gh, zero, torch.float64, opts), None, spent, None)
    return dual, S_T, S, first.select(live.nonzero().squeeze(-1)), spent - 1, None


def _solve_apart(manifold, T, G, opts, ill, spent: int) -> tuple[torch.Tensor, dict]:
    """Solve the ``ill`` entries in float64, the others in float32, and merge; evaluations count as for the entry alone
    (the ``spent`` probe evaluations, all but the kept one for a float32 entry)."""
    B, n = T.shape[0], T.shape[-1]
    A = torch.empty_like(T)
    merged: dict = {}
    for mask, dtype in ((ill, torch.float64), (~ill, torch.float32)):
        idx = mask.nonzero().squeeze(-1)
        if idx.numel() == 0:
            continue
        sub_opts = {**opts, "compute_dtype": dtype, "escalate": None, "trace": bool(opts["trace"]) and bool(mask[0])}
        if opts["dual"] is not None:
            sub_opts["dual"] = opts["dual"].reshape(B, n, n)[idx.to(opts["dual"].device)]
        A_part, out = solve_gram_newton(manifold, T[idx], G[idx], sub_opts)
        out["evaluations"] = out["evaluations"] + (spent if dtype == torch.float64 else max(spent - 1, 0))
        A[idx] = A_part
        for key, value in out.items():
            if isinstance(value, torch.Tensor):
                if key not in merged:
                    merged[key] = value.new_zeros((B, *value.shape[1:]))
                merged[key][idx.to(value.device)] = value.to(merged[key].dtype)
            elif value is not None or key not in merged:
                merged[key] = value
    return A, merged


def _douglas_rachford_fallback(dual, best, stalled, stop, max_iter, opts, trace, calls, coef, res, S_out, A, U):
    """`douglas_rachford` on the stalled entries, its result taken where its residual is lower; updates ``calls``,
    ``coef``, ``res``, ``S_out``, ``A`` and the bound ``U`` in place."""
    idx = stalled.nonzero().squeeze(-1)
    sub = dual.sub(idx)
    Z, res_dr, S_dr, used = douglas_rachford(
        sub,
        best["S"][idx],
        best["V"][idx],
        best["r"][idx],
        stop,
        max_iter - calls[idx.cpu()].to(idx.device),
        min(int(opts["anderson"]), DR_ANDERSON),
        trace if trace is not None and int(idx[0]) == 0 else None,
    )
    calls[idx.cpu()] += used.cpu() + 1  # + the evaluation that certifies the DR multiplier
    ev = sub.evaluate(S_dr)
    U[idx] = torch.minimum(U[idx], sub.certify(S_dr, ev.weights(), ev.r, ev.V, ev.lam)[2])
    better = res_dr < res[idx]
    coef[idx] = torch.where(better[:, None, None, None], Z, coef[idx])
    res[idx] = torch.where(better, res_dr, res[idx])
    S_out[idx] = torch.where(better[:, None, None], S_dr, S_out[idx])
    A[idx] = torch.where(better[:, None, None], sub.combine(Z), A[idx])


def _residual_scale(T: torch.Tensor) -> torch.Tensor:
    r"""$1/c$ per matrix, $c = \|W\|_F/\sqrt n$ the RMS column norm of the tall ``T`` ``(B, m, n)``: the residual
    scale of ``relative_tol``, invariant to scaling $W$."""
    c = T.norm(dim=(-2, -1)) / T.shape[-1] ** 0.5
    return 1 / c.clamp_min(torch.finfo(T.dtype).tiny)


def _escalated(T: torch.Tensor, dtype: torch.dtype, B: int) -> torch.Tensor:
    """Per entry: solved in float64 although the input is float32 (the ``escalate`` hint of the next call)."""
    return torch.full((B,), bool(dtype == torch.float64 and T.dtype == torch.float32), dtype=torch.bool)


def _setup(manifold, T, Gh, zero, dtype, opts) -> tuple[GramDual, torch.Tensor, torch.Tensor]:
    """The dual in ``dtype``, the tangent start $S_T$ and the (warm) start $S$."""
    B, n = T.shape[0], T.shape[-1]
    scale = _residual_scale(T) if opts["relative_tol"] else None
    dual = GramDual(manifold, T, Gh, dtype, opts["smoothing"], opts["cg_iters"], opts["cg_tol"], scale)
    S_T = dual.tangent_start()
    S = S_T.clone()
    if opts["dual"] is not None:
        S = dual.P(sym(opts["dual"].reshape(B, n, n).to(device=T.device, dtype=S.dtype)))
    return dual, S_T, torch.where(zero, torch.zeros_like(S), S)


def _newton(
    dual: GramDual,
    S: torch.Tensor,
    S_reset: torch.Tensor | None,
    warm_reset: float,
    tol: float,
    budget: int,
    depth: int,
    live: torch.Tensor,
    trace: Trace | None,
    first: Evaluation | None = None,
) -> tuple[dict, torch.Tensor]:
    """The Gauss-Newton/Anderson loop: the best evaluation per entry and the evaluations used (``S_reset``: a warm
    start's cold one; ``first``: the evaluation at ``S``, if done). One loop over shared per-entry state: longer than
    60 lines on purpose."""
    B, n = S.shape[0], S.shape[-1]
    dev, dt = S.device, S.dtype
    best = {
        "res": torch.full((B,), math.inf, dtype=dt, device=dev),
        "S": S.clone(),
        "r": torch.ones(B, n, dtype=dt, device=dev),
        "V": torch.zeros_like(S),
        "lam": torch.zeros(B, n, dtype=dt, device=dev),
        "D": torch.zeros_like(S),
        "calls": torch.zeros(B, dtype=torch.long, device=dev),
    }
    idx = live.nonzero().squeeze(-1)
    ws = WorkingSet(idx, {name: value[idx] for name, value in best.items()}, best)
    ws["S_now"] = S[idx]
    if S_reset is not None:
        ws["S_reset"] = S_reset[idx]
    # best residuals of the last STALL_WINDOW + 1 evaluations, oldest first (inf: not yet evaluated)
    ws["history"] = torch.full((len(idx), STALL_WINDOW + 1), math.inf, dtype=dt, device=dev)
    sub, mixer = dual.sub(idx), Anderson(depth, ws["S_now"])
    for it in range(budget):
        if len(ws) == 0:
            break
        ev = first if it == 0 and first is not None else sub.evaluate(ws["S_now"])
        ws["calls"] = ws["calls"] + 1
        if trace is not None and int(ws.idx[0]) == 0:
            trace.add(ev.res[0], sub.objective(ev)[0])
        improved = ev.res < ws["res"]
        worse = ev.res > 2 * ws["res"]  # a bad (mixed) step: restart from the best point
        for k in ("res", "S", "r", "V", "lam"):
            mask = improved.view(-1, *([1] * (ws[k].dim() - 1)))
            ws[k] = torch.where(mask, getattr(ev, k), ws[k])
        # converged, or the best residual stalls (STALL_FACTOR over STALL_WINDOW evaluations)
        ws["history"] = torch.cat([ws["history"][:, 1:], ws["res"][:, None]], 1)
        conv = (ev.res <= tol) | (ws["res"] > STALL_FACTOR * ws["history"][:, 0])
        if it == budget - 1:
            break
        keep = ws.shrink(~conv)  # the iteration's one host synchronisation
        if keep is not None:
            if len(ws) == 0:
                break
            ev, improved, worse = ev.select(keep), improved[keep], worse[keep]
            sub = sub.sub(keep)
            mixer.compact(keep)
        D = sub.step(ev)
        ws["D"] = torch.where(improved[:, None, None], D, ws["D"])
        mixed = sub.P(sym(mixer.mix(mixer.every, ev.S, D)))
        mixer.reset(mixer.every, where=worse)
        S_next = torch.where(worse[:, None, None], ws["S"] + ws["D"], mixed)
        if it == 0 and S_reset is not None:  # the residual monitor of warm starts
            cold = ev.res > warm_reset
            S_next = torch.where(cold[:, None, None], ws["S_reset"], S_next)
            mixer.reset(mixer.every, where=cold)
        ws["S_now"] = S_next
    ws.flush()
    calls = best.pop("calls").cpu()
    best["R"] = (best["V"] * best["r"].unsqueeze(-2)) @ best["V"].mT  # zero where never evaluated (V = 0)
    return best, calls


def solve_exact(manifold: GramManifold, W: torch.Tensor, G: torch.Tensor, state: dict | None, options: dict):
    """`solve_gram_newton` as a `Solver`: the state is ``{"dual": S (square DGram: the Douglas-Rachford iterate),
    "escalated": solved in float64}``."""
    state = state or {}
    opts = {**options, "dual": state.get("dual"), "escalate": state.get("escalated")}
    A, raw = solve_gram_newton(manifold, W, G, opts)
    return A, raw, {"dual": raw.pop("dual"), "escalated": raw.pop("escalated")}


SOLVER = Solver(
    name="exact",
    solve=solve_exact,
    options={**OPTIONS, "msign": "polar_express", "msign_steps": 5, "msign_dtype": None, "trace": False},
    state=(StateSlot("dual", "dual", "matrix"), StateSlot("escalated", "escalate", "flag")),
    warm_starts=True,
    reports=("dual_gap", "multiplier"),
    aliases=("gram_newton",),
    summary="Gauss-Newton on the Gram-space dual: converged to tol, warm-started, certified (dual_gap)",
)
