r"""`ManifoldMuon`: Muon whose update is the spectral steepest-descent direction on a manifold.

Per matrix parameter $W$ with gradient $g$ (momentum $\beta$, learning rate $\eta$):

$$b \leftarrow \beta b + (1-\beta) g,\qquad u = (1-\beta) g + \beta b \ \text{(Nesterov; else } u = b),$$
$$\text{manifold: } W \leftarrow R_W(-\eta A),\quad A = \texttt{spectral\_direction}(W, u);\qquad
\text{Euclidean: } W \leftarrow (1 - \eta\lambda) W - \eta\, s\, \operatorname{msign}(u).$$

- **Manifold** of a parameter: the param-group key ``manifold`` (a `manifolds.GramManifold`), else
  the manifold of a geoopt ``ManifoldParameter``, else Euclidean. ``geoopt.Euclidean`` counts
  as Euclidean; any other non-Gram geoopt manifold is refused. It is resolved once, in
  ``__init__``, never inside a compiled region: ``torch.compile`` the model, not ``step``
  (inside compiled code ``isinstance(p, ManifoldParameter)`` is False and geoopt silently falls
  back to Euclidean; here nothing is looked up at step time).
- **Euclidean** is plain Muon: decoupled weight decay $\lambda$ (``weight_decay``) and Keller
  Jordan's shape factor $s = \sqrt{\max(1, \text{rows}/\text{cols})}$ of the ``(out, in)``
  weight (``shape_scale="muon"``; ``"match_rms_adamw"`` gives $0.2\sqrt{\max(\text{rows},
  \text{cols})}$, ``"none"`` gives $s = 1$). Tensors with more than two dims are flattened to
  ``(shape[0], -1)``.
- **torch.optim.Muon conventions**: ``ManifoldMuon(params, msign_method="keller_jordan",
  msign_dtype=torch.bfloat16, shape_scale="muon")`` (or ``"match_rms_adamw"``) reproduces
  ``torch.optim.Muon(params, adjust_lr_fn=None)`` (or ``"match_rms_adamw"``) on Euclidean
  matrices with the same lr, momentum, nesterov and weight decay (tested against it). The default
  here is Polar Express in the parameter's dtype: a different orthogonaliser, about 20% of the
  displacement apart after 20 steps.
- **On a manifold** the step has spectral norm $\eta$ before the retraction (no shape factor,
  no weight decay: the constraint fixes the scale). Leading dims of a ``ManifoldParameter`` are
  a batch of matrices.
- **Batching**: same-shape matrices with equal manifolds (equal ``manifold.key()``: class and every
  public setting, so two ``BoundedDGram`` bounds never share a batch) and equal solver settings are
  solved in one batched call and retracted together.
- **Warm start**: the dual variable of each matrix (``state["dual"]``) starts the next solve, and
  its precision flag (``state["escalated"]``, ``stats.escalated``) sends a float32 matrix whose last
  solve needed float64 there without the float32 probe.
- **Zero updates**: a matrix whose update $u$ is exactly zero (zero gradient and zero momentum: a
  zero-initialised gate in front of it, ReZero or adaLN-Zero, at step 1) has $A = 0$: it is not solved
  and not retracted (its weights stay bitwise, as $R_W(0)$ is $W$ only up to rounding), and its
  warm-start state stays as it was; a Euclidean one still gets its decoupled weight decay. The same holds
  for any matrix whose direction comes out exactly zero, also one matrix of a ``(k, m, n)`` parameter.
  The other matrices of its batch are solved and retracted as a batch of only them (bitwise the same).
- **A step that raises changes nothing**: momentum, weights and warm-start state are written only after
  every matrix is solved and retracted (`_Commit`), so an exception (a solver refusing its input, an
  unexpected retraction error) leaves parameters and state as before the call.
- **Non-finite gradients**: that matrix's step is skipped (momentum and weights untouched),
  counted and warned about once; an update that comes out non-finite is skipped the same way, and
  so is a retraction that raises ``ValueError`` (DGram refusing a point with a zero column). Any
  other exception propagates. Weights never receive NaN/Inf.
- **Distributed**: when ``torch.distributed`` is initialised with more than one rank, matrix
  ``i`` (in parameter order, among those with a finite gradient) is solved on rank
  ``i % world_size``; results (weights, dual variables, statistics) are broadcast from their
  owner so every rank ends identical. Momentum is updated on every rank (gradients are assumed
  identical across ranks, as after DDP's all-reduce).

``optimizer.last_stats`` after each ``step()`` (plain Python numbers, JSON-ready):
``n_matrices`` (a ``(k, m, n)`` parameter counts ``k``), ``msign_calls`` (total polar evaluations:
eigendecompositions of ``gram_newton``, msign calls of the others), ``iterations_max``
(most polar evaluations of one matrix), ``residual_max``/``residual_mean`` (RMS tangent residual
of the directions), ``dual_gap_max`` (relative, where the solver knows it, else ``None``),
``n_unconverged`` and ``unconverged`` (the names of the matrices whose direction was polished at
``max_iter``), ``off_manifold_max`` (largest `constraint_violation` after the retraction),
``n_skipped_nonfinite`` (this step), ``n_skipped_nonfinite_total`` and ``skipped`` (this step's
skipped matrices, ``[{"param": name, "reason": one of SKIP_REASONS}]``, where ``name`` is the group's
``param_names`` entry, as ``torch.optim`` keeps for named parameters, else ``"group G param I"``).
"""

from __future__ import annotations

import itertools
import math
import numbers
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import geoopt
import torch
import torch.distributed as dist

from manifolds import Euclidean, GramManifold, msign
from manifolds.base import from_tall, to_tall
from manifolds.matrix_sign import MSIGN_METHODS

from .direction import (
    DEFAULT_SOLVER,
    SOLVER_OPTIONS,
    check_solver_options,
    get_solver,
    mask_kind,
    solver_option_rule,
    spectral_direction,
)
from .numerics import host_values

__all__ = ["ManifoldMuon", "SHAPE_SCALES", "SKIP_REASONS", "shape_factor"]

SHAPE_SCALES = ("muon", "match_rms_adamw", "none")
"""Euclidean step scale s for an (out, in) = (A, B) weight: "muon" sqrt(max(1, A/B)) (Keller Jordan's,
torch.optim.Muon's ``adjust_lr_fn="original"``), "match_rms_adamw" 0.2 sqrt(max(A, B)) (torch's
``adjust_lr_fn="match_rms_adamw"``, Moonshot's), "none" 1."""


def shape_factor(rule: str, rows: int, cols: int) -> float:
    """The Euclidean step scale of `SHAPE_SCALES` for an (out, in) = (rows, cols) weight."""
    if rule == "muon":
        return max(1.0, rows / cols) ** 0.5
    if rule == "match_rms_adamw":
        return 0.2 * max(rows, cols) ** 0.5
    return 1.0


_EUCLIDEAN = Euclidean()
# Per parameter: "matrices" (1, or k for a (k, m, n) batch), "msign_calls" (summed over them) and
# "calls_max" (of one matrix), residual / dual gap (worst), converged (all), off_manifold, skipped.
_STAT_FIELDS = (
    "matrices",
    "msign_calls",
    "calls_max",
    "residual",
    "dual_gap",
    "converged",
    "off_manifold",
    "skipped",  # 0, or the SKIP_REASONS code of a skipped update
    "has_dual",
)

_SKIP_GRADIENT, _SKIP_DIRECTION, _SKIP_REFUSED, _SKIP_RETRACTION = 1, 2, 3, 4
SKIP_REASONS = {
    _SKIP_GRADIENT: "non-finite gradient",
    _SKIP_DIRECTION: "non-finite direction",
    _SKIP_REFUSED: "retraction refused the point",
    _SKIP_RETRACTION: "non-finite retraction",
}
"""Why a matrix update was skipped, by the code stored in its statistics row (``last_stats["skipped"]``)."""


# A manifold parameter must start on its manifold (otherwise the first direction is solved at a point the
# solver's algebra does not describe; measured: a Gaussian 24x8 Stiefel start gave residual 2.2, unconverged).
# Raw weights are far off (GPT-2's initialisation: column cosines ~ m^-1/2, Stiefel diagonals ~ 0.3-0.7); float32
# points after thousands of retractions are within ~1e-6, and a float32 point cast to float64 within ~1e-7.
OFF_MANIFOLD_ATOL = 1e-3


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, as a plain tensor (not a geoopt ManifoldParameter/ManifoldTensor)."""
    return t.detach().as_subclass(torch.Tensor)


@dataclass
class _Item:
    index: int
    p: torch.Tensor
    group: dict
    manifold: GramManifold
    update: torch.Tensor  # the (Nesterov) momentum, as a matrix (batch) view
    name: str  # for skip reports: `_param_name`
    still: bool = False  # the update is exactly zero: no solve, no retraction (Euclidean: weight decay only)


@dataclass
class _Commit:
    """What a step writes to one parameter, applied only once every matrix of the step is solved: the new
    weights (None: unchanged) and state entries (a value of None removes the entry)."""

    p: torch.Tensor
    weights: torch.Tensor | None = None
    state: dict | None = None


def _param_name(group: dict, group_index: int, param_index: int) -> str:
    """The parameter's name from the group's ``param_names`` (torch.optim's key), else its position."""
    names = group.get("param_names")
    return names[param_index] if names else f"group {group_index} param {param_index}"


def _skip_record(name: str, code: int) -> dict:
    """One entry of ``last_stats["skipped"]``."""
    return {"param": name, "reason": SKIP_REASONS[code]}


class ManifoldMuon(torch.optim.Optimizer):
    r"""Manifold Muon (see the module docstring for the update rule and `last_stats`).

    Args:
        params: parameters or param groups; a group may set ``manifold`` (a
            `manifolds.GramManifold` or ``None``) and any of the options below.
        lr: learning rate $\eta$ (the spectral norm of a manifold step).
        momentum: $\beta$.
        nesterov: use the Nesterov form of the momentum.
        weight_decay: decoupled weight decay of Euclidean matrices (ignored on manifolds).
        solver: a registered solver (`geomtrain.optim.registry`): ``"exact"`` (default; alias
            ``"gram_newton"``), ``"tangent"``, ``"published"`` or one a user registered.
        solver_options: options for `spectral_direction` (``tol``, ``max_iter``, ...).
        warm_start: start each solve from the matrix's previous dual variable.
        shape_scale: ``"muon"`` ($\sqrt{\max(1, \text{rows}/\text{cols})}$), ``"match_rms_adamw"``
            ($0.2\sqrt{\max(\text{rows}, \text{cols})}$) or ``"none"``, for Euclidean matrices.
        msign_method: the matrix sign of Euclidean matrices (default Polar Express; ``"keller_jordan"``
            with ``msign_dtype=torch.bfloat16`` is ``torch.optim.Muon``'s).
        msign_steps: its iterations (default 5).
        msign_dtype: its compute dtype (default: the parameter's).
        manifold: the manifold of groups that do not set one (default ``None``: from a geoopt
            ``ManifoldParameter``, else Euclidean).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        solver: str = DEFAULT_SOLVER,
        solver_options: dict | None = None,
        warm_start: bool = True,
        shape_scale: str = "muon",
        msign_method: str = "polar_express",
        msign_steps: int = 5,
        msign_dtype: torch.dtype | None = None,
        manifold: GramManifold | None = None,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            solver=solver,
            solver_options=dict(solver_options or {}),
            warm_start=warm_start,
            shape_scale=shape_scale,
            msign_method=msign_method,
            msign_steps=msign_steps,
            msign_dtype=msign_dtype,
            manifold=manifold,
        )
        super().__init__(params, defaults)
        self._manifold_of: dict[int, GramManifold] = {}
        for group in self.param_groups:
            self._check_group(group)
            for p in group["params"]:
                self._manifold_of[id(p)] = self._resolve(group, p)
        self.last_stats: dict = {}
        self.n_skipped_nonfinite_total = 0
        self._warned_nonfinite = False

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _check_group(group: dict) -> None:
        """Every hyperparameter of a param group (the defaults and a group's own): one-line errors."""
        for name, low, high in (("lr", 0.0, math.inf), ("momentum", 0.0, 1.0), ("weight_decay", 0.0, math.inf)):
            v = group[name]
            v = float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v  # a tensor lr, as torch.optim allows
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (low <= v < high and math.isfinite(v)):
                need = "a number in [0, 1)" if name == "momentum" else "a finite number >= 0"
                raise ValueError(f"{name} must be {need}; got {v!r}")
        for name in ("nesterov", "warm_start"):
            if not isinstance(group[name], bool):
                raise ValueError(f"{name} must be True or False; got {group[name]!r}")
        if group["msign_method"] not in MSIGN_METHODS:
            raise ValueError(f"unknown msign_method {group['msign_method']!r}; valid: {', '.join(MSIGN_METHODS)}")
        for name in ("msign_steps", "msign_dtype"):  # the rules of the solver options of the same names
            must = solver_option_rule(name, group[name])
            if must is not None:
                raise ValueError(f"{name} must be {must}; got {group[name]!r}")
        get_solver(group["solver"])  # a one-line error naming the registered solvers
        if group["shape_scale"] not in SHAPE_SCALES:
            raise ValueError(f"unknown shape_scale {group['shape_scale']!r}; valid: {', '.join(SHAPE_SCALES)}")
        valid = [k for k in SOLVER_OPTIONS[group["solver"]] if k not in ("dual", "escalate")]  # the optimizer's
        bad = set(group["solver_options"]) - set(valid)
        if bad:
            raise ValueError(
                f"unknown solver option(s) {', '.join(sorted(bad))} for {group['solver']!r}; valid: {', '.join(valid)}"
            )
        check_solver_options(group["solver"], group["solver_options"])  # the values, before the first step
        m = group["manifold"]
        if m is not None and not isinstance(m, GramManifold):
            raise TypeError(f"param group manifold must be a manifolds.GramManifold or None; got {type(m).__name__}")

    @staticmethod
    def _resolve(group: dict, p: torch.Tensor) -> GramManifold:
        m = group["manifold"]
        if m is None and isinstance(p, geoopt.ManifoldParameter):
            m = p.manifold
            if isinstance(m, geoopt.Euclidean):
                m = None
            elif not isinstance(m, GramManifold):
                raise TypeError(
                    f"ManifoldMuon supports manifolds.GramManifold (Stiefel, DGram, Oblique, Euclidean "
                    f"or a subclass); a parameter has geoopt manifold {type(m).__name__}"
                )
        m = _EUCLIDEAN if m is None else m
        if p.dim() < 2:
            raise ValueError(
                f"ManifoldMuon updates matrices; got a parameter of shape {tuple(p.shape)} "
                "(give biases and norms to AdamW)"
            )
        if mask_kind(m) != "euclidean":
            if p.dtype not in (torch.float32, torch.float64):
                raise TypeError(f"manifold parameters must be float32 or float64; got {p.dtype}")
            ok, why = m.check_point_on_manifold(_plain(p), explain=True, atol=OFF_MANIFOLD_ATOL)
            if not ok:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is not on its manifold {type(m).__name__} ({why}); "
                    "project it first, p.data.copy_(manifold.projx(p.data)) (geomtrain.groups does by default)"
                )
        return m

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_manifold_of"):  # called after __init__
            group = self.param_groups[-1]
            self._check_group(group)
            for p in group["params"]:
                self._manifold_of[id(p)] = self._resolve(group, p)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items, skipped = [], []
        with_grad = [
            (gi, group, pi, p)
            for gi, group in enumerate(self.param_groups)
            for pi, p in enumerate(group["params"])
            if p.grad is not None
        ]
        # Nothing is written before every matrix is solved (`_Commit`): a step that raises changes nothing.
        moments = [self._momentum(group, p) for _, group, _, p in with_grad]
        checks = host_values(  # one host read: finite gradients, zero updates
            [torch.isfinite(p.grad).all() for _, _, _, p in with_grad] + [u.eq(0).all() for _, u in moments]
        )
        commits = []
        for (gi, group, pi, p), (buf, u), ok, zero in zip(with_grad, moments, checks, checks[len(with_grad) :]):
            if not ok:
                skipped.append(_skip_record(_param_name(group, gi, pi), _SKIP_GRADIENT))
                continue
            commits.append(_Commit(p, state={"momentum_buffer": buf}))
            if group["lr"] == 0:  # e.g. a warmup schedule at 0: momentum moves, weights do not
                continue
            m = self._manifold_of[id(p)]
            if mask_kind(m) == "euclidean":
                u = u.reshape(p.shape[0], -1)
            items.append(_Item(len(items), p, group, m, u, _param_name(group, gi, pi), still=zero))

        stats = torch.zeros(len(items), len(_STAT_FIELDS), dtype=torch.float64)
        stats[:, _STAT_FIELDS.index("dual_gap")] = float("nan")
        world, rank = (
            (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)
        )
        mine = [it for it in items if it.index % world == rank]
        for it in mine:
            if it.still:  # a zero update: A = 0, no solve, no retraction, the warm-start state as it is
                stats[it.index, _STAT_FIELDS.index("matrices")] = math.prod(to_tall(it.update).shape[:-2])
                stats[it.index, _STAT_FIELDS.index("converged")] = 1.0
                decay = it.group["lr"] * it.group["weight_decay"]
                if mask_kind(it.manifold) == "euclidean" and decay:  # decoupled weight decay still applies
                    commits.append(_Commit(it.p, weights=it.p * (1 - decay)))
        for batch in self._batches([it for it in mine if not it.still]):
            commits += self._solve_batch(batch, stats)
        self._commit(commits)
        for it in mine:
            stats[it.index, _STAT_FIELDS.index("has_dual")] = float("dual" in self.state[it.p])
        if world > 1:
            self._share(items, stats, world)
        codes = stats[:, _STAT_FIELDS.index("skipped")].tolist()
        skipped += [_skip_record(it.name, int(codes[it.index])) for it in items if codes[it.index]]
        if skipped:
            self.n_skipped_nonfinite_total += len(skipped)
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                what = "; ".join(f"{s['param']}: {s['reason']}" for s in skipped)
                warnings.warn(
                    f"ManifoldMuon: skipped {len(skipped)} matrix update(s) ({what}); counted and named in "
                    "last_stats['skipped'] (warned once)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self.last_stats = self._aggregate(stats, skipped, [it.name for it in items])
        return loss

    def _momentum(self, group: dict, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The new momentum buffer $\beta b + (1-\beta) g$ (a new tensor; the state keeps the old one until the
        commit) and the update $u$: $(1-\beta) g + \beta b$ (Nesterov) or the new buffer itself."""
        buf = self.state[p].get("momentum_buffer")
        buf = (torch.zeros(p.shape, dtype=p.dtype, device=p.device) if buf is None else buf).lerp(
            p.grad, 1 - group["momentum"]
        )
        return buf, p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _commit(self, commits: list[_Commit]) -> None:
        """Write the step: each `_Commit`'s weights and state entries."""
        for c in commits:
            if c.weights is not None:
                c.p.copy_(c.weights)
            state = self.state[c.p]
            for key, value in (c.state or {}).items():
                if value is None:
                    state.pop(key, None)
                else:
                    state[key] = value

    @staticmethod
    def _batch_key(it: _Item) -> tuple:
        g, m = it.group, it.manifold
        tall = to_tall(it.update).shape
        # equal geometry only (class and every public setting, e.g. BoundedDGram's bound): the batch is
        # retracted with one manifold object; manifolds without ``key()`` batch only with themselves
        mkey = m.key() if callable(getattr(m, "key", None)) else id(m)
        return (
            mkey,
            tuple(tall[-2:]),
            it.p.dtype,
            it.p.device,
            g["solver"],
            repr(sorted(g["solver_options"].items())),
            g["warm_start"],
            g["msign_method"],
            g["msign_steps"],
            g["msign_dtype"],
        )

    def _batches(self, items: list[_Item]) -> list[list[_Item]]:
        out: dict[tuple, list[_Item]] = {}
        for it in items:
            out.setdefault(self._batch_key(it), []).append(it)
        return list(out.values())

    def _solve_batch(self, batch: list[_Item], stats: torch.Tensor) -> list[_Commit]:
        """Solve one batch: the directions, per-matrix statistics (written to ``stats``) and each matrix's new
        weights and warm-start state, returned as `_Commit` s (nothing is written here). A matrix whose
        direction is exactly zero is not retracted and keeps its warm-start state. (The solve, the guards and
        the statistics in one pass over the batch: longer than 60 lines on purpose.)"""
        g0, m = batch[0].group, batch[0].manifold
        euclid = mask_kind(m) == "euclidean"
        # solve in tall form, one batch of (k, m, n) matrices
        U = torch.cat([to_tall(it.update).reshape(-1, *to_tall(it.update).shape[-2:]) for it in batch])
        sizes = [to_tall(it.update).reshape(-1, *to_tall(it.update).shape[-2:]).shape[0] for it in batch]
        col = {f: _STAT_FIELDS.index(f) for f in _STAT_FIELDS}
        if euclid:
            A = msign(U, g0["msign_method"], steps=g0["msign_steps"], compute_dtype=g0["msign_dtype"])
            st = {
                "msign_calls": torch.ones(len(U)),
                "residual": torch.zeros(len(U)),
                "converged": torch.ones(len(U)),
                "dual_gap": None,
                "dual": None,
            }
        else:
            W = torch.cat([to_tall(_plain(it.p)).reshape(-1, *to_tall(it.p).shape[-2:]) for it in batch])
            opts = {"msign": g0["msign_method"], "msign_steps": g0["msign_steps"], "msign_dtype": g0["msign_dtype"]}
            spec = get_solver(g0["solver"])
            opts = {k: v for k, v in opts.items() if k in spec.options and spec.optimizer_msign}
            opts.update(g0["solver_options"])
            duals = [self.state[it.p].get("dual") for it in batch]
            if g0["warm_start"] and spec.warm_starts and all(d is not None for d in duals):
                opts["dual"] = torch.cat([d.reshape(-1, *d.shape[-2:]) for d in duals]).double()
                flags = [self.state[it.p].get("escalated") for it in batch]
                if all(f is not None for f in flags):
                    opts["escalate"] = torch.cat([f.reshape(-1) for f in flags]).bool()
            A, ds = spectral_direction(m, W, U, solver=g0["solver"], **opts)
            st = {
                "msign_calls": ds.evaluations,
                "residual": ds.residual,
                "converged": ds.converged,
                "dual_gap": ds.dual_gap,
                "dual": ds.dual,
                "escalated": ds.escalated,
            }
        bounds = [0, *itertools.accumulate(sizes)]
        directions = [
            from_tall(A[lo:hi].reshape(to_tall(it.update).shape), like=it.update)
            for it, lo, hi in zip(batch, bounds, bounds[1:])
        ]
        # every guard reads the whole batch on the host at once (on a GPU each read waits for the queue)
        moving = None if euclid else A.flatten(1).ne(0).any(1)  # per matrix: A != 0 (retracted)
        guards = host_values([torch.isfinite(a).all() for a in directions] + ([] if euclid else [moving.all()]))
        skips = [0 if ok else _SKIP_DIRECTION for ok in guards[: len(batch)]]
        moving = None if euclid or guards[-1] else moving.cpu()  # None: every matrix moves
        tall = None if euclid else (W, A, bounds, moving)  # the batch as solved: tall and stacked
        updates = self._updates(batch, directions, skips, m, tall)
        computed = [i for i, new in enumerate(updates) if new is not None]
        for i, ok in zip(computed, host_values([torch.isfinite(updates[i]).all() for i in computed])):
            if not ok:
                skips[i] = _SKIP_DIRECTION if euclid else _SKIP_RETRACTION
        applied = [i for i in computed if not skips[i]]
        commits = {i: _Commit(batch[i].p, weights=updates[i], state={}) for i in applied}
        # with the warm-start state of each applied matrix: finite, or not kept (the next solve starts cold)
        warm = get_solver(g0["solver"]).warm_starts and g0["warm_start"]
        keep_dual = not euclid and warm and st.get("dual") is not None
        # (all in float64: host_values reads once per dtype)
        checks = [] if euclid else [m.constraint_violation(updates[i]).max().double() for i in applied]
        if keep_dual:
            checks += [torch.isfinite(st["dual"][bounds[i] : bounds[i + 1]]).all().double() for i in applied]
        values, n_off = host_values(checks), 0 if euclid else len(applied)
        off_of = dict(zip(applied, values[:n_off]))
        dual_ok = dict(zip(applied, values[n_off:])) if keep_dual else {}
        for i, it in enumerate(batch):
            sl = slice(bounds[i], bounds[i + 1])
            row = stats[it.index]
            row[col["matrices"]] = sizes[i]
            # tensor to tensor, no Python numbers read (the solver's statistics are on the CPU)
            row[col["msign_calls"]] = st["msign_calls"][sl].double().sum()
            row[col["calls_max"]] = st["msign_calls"][sl].double().max()
            for f in ("residual", "dual_gap", "converged"):
                if st.get(f) is not None:
                    row[col[f]] = st[f][sl].double().max() if f != "converged" else st[f][sl].double().min()
            row[col["skipped"]] = skips[i]
            if i in off_of:
                row[col["off_manifold"]] = off_of[i]
                if dual_ok.get(i):
                    still = None if moving is None else ~moving[sl]
                    commits[i].state = self._warm_state(it, st["dual"][sl], st.get("escalated"), sl, still)
                elif keep_dual:  # a non-finite state is never written: the previous one goes too (start cold)
                    commits[i].state = {"dual": None, "escalated": None}
        return list(commits.values())

    def _warm_state(self, it: _Item, dual: torch.Tensor, escalated, rows: slice, still) -> dict:
        """The state entries ``dual`` and ``escalated`` (one uint8 flag per matrix, broadcast by DDP) of a solved
        parameter; its matrices in ``still`` (bool per matrix, None: none) keep their previous entries."""
        lead = to_tall(it.p).shape[:-2]
        new = {"dual": dual.reshape(*lead, *dual.shape[-2:]).to(it.p.dtype)}
        if escalated is not None:
            new["escalated"] = escalated[rows].reshape(-1).to(torch.uint8)
        old = self.state[it.p]
        if still is not None and bool(still.any()):
            for key, value in new.items():
                if key in old:  # dual: (*lead, n, n); escalated: one flag per matrix
                    keep = still.to(value.device).reshape(*value.shape[:-2], 1, 1) if key == "dual" else still
                    new[key] = torch.where(keep.to(value.device), old[key], value)
        return new

    @staticmethod
    def _updates(batch: list[_Item], directions: list[torch.Tensor], skips: list[int], m, tall) -> list:
        r"""The new weights of each matrix (None where ``skips`` is set or no matrix moves; sets ``_SKIP_REFUSED``
        in ``skips`` where the retraction raises ``ValueError``). ``tall``: None for Euclidean batches, else the
        solve's stacked tall weights and directions, the row bounds of each parameter and which matrices have
        $A \ne 0$ (None: all); only those are retracted, the others keep their weights bitwise. The manifold
        matrices of a batch are retracted in one call (its input checks read the host once, not once per
        matrix); if that call refuses, each parameter is retracted alone to find the one refused."""
        go = [i for i in range(len(batch)) if not skips[i]]
        updates: list[torch.Tensor | None] = [None] * len(batch)
        if tall is None:
            for i in go:
                it, a = batch[i], directions[i]
                rows, cols = it.update.shape[-2:]
                lr, scale = it.group["lr"], shape_factor(it.group["shape_scale"], rows, cols)
                new = it.p.reshape(it.update.shape) * (1 - lr * it.group["weight_decay"])
                updates[i] = (new - (lr * scale) * a.to(it.p.dtype)).reshape(it.p.shape)
            return updates
        W, A, bounds, moving = tall
        rows = {}  # parameter -> its stacked matrices with A != 0: all (a slice) or some (an index)
        for i in go:
            lo, hi = bounds[i], bounds[i + 1]
            if moving is None or bool(moving[lo:hi].all()):
                rows[i] = slice(lo, hi)
            elif bool(moving[lo:hi].any()):
                rows[i] = (torch.arange(lo, hi)[moving[lo:hi]]).to(W.device)
        if not rows:
            return updates
        points = W if moving is None and len(go) == len(batch) else torch.cat([W[r] for r in rows.values()])
        steps = torch.cat([-batch[i].group["lr"] * A[r].to(W.dtype) for i, r in rows.items()])
        try:
            parts = dict(zip(rows, torch.split(m.retr(points, steps), [len(W[r]) for r in rows.values()])))
        except ValueError:  # a refused point in the batch: retract one by one to find it
            parts = {}
            for i, r in rows.items():
                try:
                    parts[i] = m.retr(W[r], -batch[i].group["lr"] * A[r].to(W.dtype))
                except ValueError:  # DGram refusing a (near-)zero column: a skipped update; other errors surface
                    skips[i] = _SKIP_REFUSED
        for i, part in parts.items():
            p, (lo, hi), r = batch[i].p, (bounds[i], bounds[i + 1]), rows[i]
            if not isinstance(r, slice):  # the matrices with A = 0 keep their weights
                part = W[lo:hi].index_copy(0, r - lo, part)
            updates[i] = from_tall(part.reshape(to_tall(p).shape), like=p).reshape(p.shape)
        return updates

    def _share(self, items: list[_Item], stats: torch.Tensor, world: int) -> None:
        """Broadcast each matrix's new weights and dual variable from its owner; sum the stats."""
        for it in items:
            owner = it.index % world
            dist.broadcast(it.p.data, src=owner)
            warm = get_solver(it.group["solver"]).warm_starts and it.group["warm_start"]
            if warm and mask_kind(it.manifold) != "euclidean":
                st = self.state[it.p]
                if "dual" not in st:  # first step on a non-owner: allocate the buffer to receive into
                    n = min(it.p.shape[-2:])
                    st["dual"] = torch.zeros(*it.p.shape[:-2], n, n, dtype=it.p.dtype, device=it.p.device)
                dist.broadcast(st["dual"], src=owner)
                if "escalated" not in st:
                    k = math.prod(it.p.shape[:-2])
                    st["escalated"] = torch.zeros(k, dtype=torch.uint8, device=it.p.device)
                dist.broadcast(st["escalated"], src=owner)
        mine = torch.tensor([it.index % world == dist.get_rank() for it in items], dtype=torch.bool)
        local = torch.where(mine[:, None], stats, torch.zeros_like(stats))
        local = torch.nan_to_num(local, nan=-1.0)  # nan (unknown gap) travels as -1
        buf = local.to(_comm_device())
        dist.all_reduce(buf)
        out = buf.cpu()
        out[:, _STAT_FIELDS.index("dual_gap")] = torch.where(
            out[:, _STAT_FIELDS.index("dual_gap")] == -1, torch.nan, out[:, _STAT_FIELDS.index("dual_gap")]
        )
        stats.copy_(out)
        for it in items:  # drop receive buffers where the owner kept no dual (skipped update)
            if stats[it.index, _STAT_FIELDS.index("has_dual")] == 0:
                self.state[it.p].pop("dual", None)
                self.state[it.p].pop("escalated", None)

    def _aggregate(self, stats: torch.Tensor, skipped: list[dict], names: list[str]) -> dict:
        """``last_stats`` from the per-matrix rows of ``stats`` (row i is the item named ``names[i]``)."""
        c = {f: stats[:, i] for i, f in enumerate(_STAT_FIELDS)}
        n = stats.shape[0]
        unconverged = [name for name, ok in zip(names, c["converged"].tolist()) if ok < 1]
        gaps = c["dual_gap"][~torch.isnan(c["dual_gap"])]
        return {
            "n_matrices": int(c["matrices"].sum()),
            "msign_calls": int(c["msign_calls"].sum()),
            "iterations_max": int(c["calls_max"].max()) if n else 0,
            "residual_max": float(c["residual"].max()) if n else 0.0,
            "residual_mean": float(c["residual"].mean()) if n else 0.0,
            "dual_gap_max": float(gaps.max()) if gaps.numel() else None,
            "n_unconverged": len(unconverged),
            "unconverged": unconverged,
            "off_manifold_max": float(c["off_manifold"].max()) if n else 0.0,
            "n_skipped_nonfinite": len(skipped),
            "n_skipped_nonfinite_total": self.n_skipped_nonfinite_total,
            "skipped": skipped,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Like `torch.optim.Optimizer.state_dict`, with each group's manifold replaced by its class
        name (so ``torch.load(weights_only=True)`` works) and the skip counter added."""
        sd = super().state_dict()
        for g in sd["param_groups"]:
            m = g.get("manifold")
            g["manifold"] = None if m is None else type(m).__name__
            if g.get("msign_dtype") is not None:
                g["msign_dtype"] = str(g["msign_dtype"])
            g["solver_options"] = {
                k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in g["solver_options"].items()
            }
        sd["n_skipped_nonfinite_total"] = self.n_skipped_nonfinite_total
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore momentum, dual variables and hyperparameters; manifolds stay those of this optimizer
        (a saved group whose manifold class differs is refused)."""
        state_dict = dict(state_dict)
        total = state_dict.pop("n_skipped_nonfinite_total", 0)
        groups = []
        for saved, live in zip(state_dict["param_groups"], self.param_groups):
            want = None if live["manifold"] is None else type(live["manifold"]).__name__
            if saved.get("manifold") != want:
                raise ValueError(
                    f"state_dict param group has manifold {saved.get('manifold')!r}, this optimizer has {want!r}"
                )
            saved = dict(
                saved,
                manifold=live["manifold"],
                msign_dtype=live["msign_dtype"],
                solver_options={
                    **saved.get("solver_options", {}),
                    **{k: v for k, v in live["solver_options"].items() if isinstance(v, torch.dtype)},
                },
            )
            groups.append(saved)
        state_dict["param_groups"] = groups
        super().load_state_dict(state_dict)
        self.n_skipped_nonfinite_total = int(total)


def _comm_device() -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
