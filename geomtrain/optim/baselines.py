r"""The paper's baselines: ``"tangent"`` (one msign of the tangent-projected gradient) and ``"published"`` (its dual
ascent, as published: no normalisation of $G$, $\Lambda_0 = -P(W^\top G + G^\top W)/4$,
$A = \operatorname{msign}(G + L^*(\Lambda))$, $\Lambda \leftarrow \Lambda - \alpha (1 - k/K) L(A)$ for $K$ = ``steps``
steps, stopping when $\|L(A)\|_F / n <$ ``tol``; not scale-invariant).
"""

from __future__ import annotations

import torch

from manifolds import GramManifold, msign

from .gram import tangent_residual
from .numerics import Trace, first_objective
from .solver import NON_NEGATIVE, Solver, StateSlot

__all__ = [
    "solve_tangent",
    "solve_published",
    "MSIGN_OPTIONS",
    "TANGENT_OPTIONS",
    "PUBLISHED_OPTIONS",
    "msign_with",
    "TANGENT",
    "PUBLISHED",
]

MSIGN_OPTIONS = {"msign": "polar_express", "msign_steps": 5, "msign_dtype": None, "trace": False}
TANGENT_OPTIONS = dict(MSIGN_OPTIONS)
PUBLISHED_OPTIONS = {"steps": 20, "alpha": 0.1, "tol": 1e-6, **MSIGN_OPTIONS, "msign_dtype": torch.bfloat16}


def msign_with(X: torch.Tensor, opts: dict) -> torch.Tensor:
    """``manifolds.msign`` with the ``msign``/``msign_steps``/``msign_dtype`` options."""
    return msign(X, opts["msign"], steps=opts["msign_steps"], compute_dtype=opts["msign_dtype"])


def solve_tangent(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, state: dict | None, opts: dict
) -> tuple[torch.Tensor, dict, None]:
    """$A = \\operatorname{msign}(\\operatorname{proju}(W, G))$: one msign, no certificate, no state."""
    A = msign_with(manifold.proju(T, G), opts)
    B = T.shape[0]
    res = tangent_residual(manifold, T, A).double().cpu()
    trace = None
    if opts["trace"]:
        trace = Trace()
        trace.add(res[0], first_objective(G, A))
    stats = {"evaluations": torch.ones(B, dtype=torch.long), "residual": res}
    return A, {**stats, "converged": torch.ones(B, dtype=torch.bool), "trace": trace}, None


def solve_published(
    manifold: GramManifold, T: torch.Tensor, G: torch.Tensor, state: dict | None, opts: dict
) -> tuple[torch.Tensor, dict, dict]:
    """The published dual ascent (see the module docstring); the state is ``{"dual": Lambda}``."""
    steps, alpha, tol = int(opts["steps"]), float(opts["alpha"]), float(opts["tol"])
    n = T.shape[-1]
    dual = (state or {}).get("dual")
    Lam = -0.25 * manifold.tangent_constraint(T, G) if dual is None else dual.reshape(-1, n, n).to(T)
    calls = 0
    A = H = None
    trace = Trace() if opts["trace"] else None
    count = max(manifold.constraint_count(n, T), 1.0)
    for k in range(max(steps, 1)):
        A = msign_with(G + manifold.tangent_constraint_adjoint(T, Lam), opts)
        calls += 1
        H = manifold.tangent_constraint(T, A)
        if trace is not None:
            trace.add((H[0].square().sum() / count).sqrt(), first_objective(G, A))
        if float(H.norm(dim=(-2, -1)).max()) / n < tol:  # RMS over all n^2 entries, as published
            break
        Lam = Lam - alpha * (1 - k / steps) * H
    B = T.shape[0]
    res = (H.square().sum(dim=(-2, -1)) / count).sqrt()
    stats = {"evaluations": torch.full((B,), calls, dtype=torch.long), "residual": res.double().cpu()}
    return A, {**stats, "converged": (H.norm(dim=(-2, -1)) / n < tol).cpu(), "trace": trace}, {"dual": Lam}


TANGENT = Solver(
    name="tangent",
    solve=solve_tangent,
    options=TANGENT_OPTIONS,
    summary="one msign of the tangent-projected G: cheapest, not tangent, no certificate",
)
PUBLISHED = Solver(
    name="published",
    solve=solve_published,
    options=PUBLISHED_OPTIONS,
    rules={"tol": (NON_NEGATIVE, "a finite number >= 0 (0: always run every step)")},
    state=(StateSlot("dual", "dual", "matrix"),),  # accepted by spectral_direction; the optimizer starts cold
    optimizer_msign=False,
    summary="the paper's dual ascent as published: 20 bf16 msign calls, not scale-invariant",
)
