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
  every matrix is solved and retracted (`Commit`), so an exception (a solver refusing its input, an
  unexpected retraction error) leaves parameters and state as before the call.
- **Non-finite gradients**: that matrix's step is skipped (momentum and weights untouched),
  counted and warned about once; an update that comes out non-finite is skipped the same way, and
  so is a retraction that raises ``ValueError`` (DGram refusing a point with a zero column). Any
  other exception propagates. Weights never receive NaN/Inf.
- **Distributed**: when ``torch.distributed`` is initialised with more than one rank, the matrices
  are grouped by ``(shape, dtype, device)`` into buckets and each bucket's matrices are dealt
  round-robin to the ranks (`geomtrain.optim.muon_dist.owners`); each rank solves its own, then ONE
  all-gather per bucket carries every owner's new weights and warm-start state, and one all-reduce
  the statistics, so every rank ends identical (``bucketed=False``: matrix ``i`` on rank
  ``i % world_size``, broadcast per matrix and state slot). ``last_stats["comm"]`` counts what this
  rank sent. Momentum is updated on every rank (gradients are assumed identical across ranks, as
  after DDP's all-reduce).
  **FSDP2**: parameters that ``fully_shard`` made DTensors (placement ``Shard(0)`` on a 1-D mesh over all
  ranks; any other layout, or plain tensors and DTensors in one optimizer, is refused) are solved by one owner
  rank per matrix, balanced by size (`geomtrain.optim.muon_fsdp`): momentum on each rank's rows, ONE all-reduce
  agrees the non-finite and zero-update checks, ONE ``all_to_all_single`` gathers each matrix's rows (weights,
  update, warm-start state) to its owner, which solves and retracts it whole, and ONE more hands the new rows
  back. Momentum and warm-start matrices are DTensors sharded like the parameter, so
  ``torch.distributed.checkpoint`` saves and reshards them (`get_optimizer_state_dict` /
  `set_optimizer_state_dict` work; the counters travel in every param group too). Nothing else to call.

``optimizer.last_stats`` after each ``step()`` (plain Python numbers, JSON-ready):
``n_matrices`` (a ``(k, m, n)`` parameter counts ``k``), ``msign_calls`` (total polar evaluations:
eigendecompositions of ``exact``, msign calls of the others), ``iterations_max``
(most polar evaluations of one matrix), ``residual_max``/``residual_mean`` (RMS tangent residual
of the directions), ``dual_gap_max`` (relative, where the solver knows it, else ``None``),
``n_unconverged`` and ``unconverged`` (the names of the matrices whose direction was polished at
``max_iter``), ``off_manifold_max`` (largest `constraint_violation` after the retraction),
``n_skipped_nonfinite`` (this step), ``n_skipped_nonfinite_total`` and ``skipped`` (this step's
skipped matrices, ``[{"param": name, "reason": one of SKIP_REASONS}]``, where ``name`` is the group's
``param_names`` entry, as ``torch.optim`` keeps for named parameters, else ``"group G param I"``), and with
``certify_every=N`` on steps N, 2N, ...: ``certified_gap_max`` (the exact float64 relative dual gap of the
directions the solver returned, made feasible first, `geomtrain.optim.certificate`) and
``certified_residual_max`` (their tangent residual), else ``None``; ``length_mean`` and ``length_min``: the
RMS singular value $\|A\|_F/\sqrt{n}$ of the directions applied this step (1: the whole spectral budget, as
exact and msign directions; a products-only direction is shorter: a smaller step at the same ``lr``;
``None`` when none was applied); ``comm``: this step's collectives and
bytes sent by this rank (`geomtrain.optim.exchange.CommCount`; zeros in one process). ``step_stats`` holds
the same as a `StepStats`.

The step has the shape of ``torch.optim.Muon``: gather (`_init_group`), the batched direction kernel
(`geomtrain.optim.muon_step.batched_directions`: the solver call), apply (`apply_directions`: retraction
and guards), commit.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable

import geoopt
import torch
import torch.distributed as dist

from manifolds import Euclidean, GramManifold
from manifolds.base import to_tall
from manifolds.matrix_sign import MSIGN_METHODS

from .direction import (
    SOLVER_OPTIONS,
    check_solver_options,
    default_solver,
    get_solver,
    solver_option_rule,
)
from .exchange import CommCount, reduce_stats
from .muon_dist import owners, share, share_bucketed
from .muon_fsdp import (
    agree,
    check_sharded,
    cold_slot,
    drop_placeholders,
    local_grad,
    placeholder_slots,
    settle_loaded,
    sharded_like,
    solve_sharded,
    whole,
)
from .muon_step import (
    SHAPE_SCALES,
    SKIP_GRADIENT,
    SKIP_REASONS,
    Commit,
    MatrixItem,
    MatrixPlan,
    StatsTable,
    StepStats,
    apply_directions,
    batched_directions,
    group_batches,
    make_plan,
    shape_factor,
    skip_record,
)
from .numerics import host_values
from .solver import is_int

__all__ = ["ManifoldMuon", "SHAPE_SCALES", "SKIP_REASONS", "StepStats", "shape_factor"]

_EUCLIDEAN = Euclidean()

# A manifold parameter must start on its manifold (otherwise the first direction is solved at a point the
# solver's algebra does not describe; measured: a Gaussian 24x8 Stiefel start gave residual 2.2, unconverged).
# Raw weights are far off (GPT-2's initialisation: column cosines ~ m^-1/2, Stiefel diagonals ~ 0.3-0.7); float32
# points after thousands of retractions are within ~1e-6, and a float32 point cast to float64 within ~1e-7.
OFF_MANIFOLD_ATOL = 1e-3


def _param_name(group: dict, group_index: int, param_index: int) -> str:
    """The parameter's name from the group's ``param_names`` (torch.optim's key), else its position."""
    names = group.get("param_names")
    return names[param_index] if names else f"group {group_index} param {param_index}"


class ManifoldMuon(torch.optim.Optimizer):
    r"""Manifold Muon (see the module docstring for the update rule and `last_stats`).

    Args:
        params: parameters or param groups; a group may set ``manifold`` (a
            `manifolds.GramManifold` or ``None``) and any of the options below.
        lr: learning rate $\eta$ (the spectral norm of a manifold step).
        momentum: $\beta$.
        nesterov: use the Nesterov form of the momentum.
        weight_decay: decoupled weight decay of Euclidean matrices (ignored on manifolds).
        solver: a registered solver (`geomtrain.optim.registry`): ``"exact"`` (alias ``"gram_newton"``),
            ``"split_tangent"``, ``"tangent"``, ``"published"``, ... or one a user registered. Default
            ``None``: per matrix, by its manifold's kind (`geomtrain.optim.default_solver`): the
            products-only ``"filled_split"`` on Stiefel, DGram and custom masks, ``"exact"`` on Oblique.
        solver_options: options for `spectral_direction` (``tol``, ``max_iter``, ...); with ``solver``
            ``None`` they must be valid for every solver the default picks for the group's matrices.
        warm_start: start each solve from the matrix's previous dual variable.
        shape_scale: ``"muon"`` ($\sqrt{\max(1, \text{rows}/\text{cols})}$), ``"match_rms_adamw"``
            ($0.2\sqrt{\max(\text{rows}, \text{cols})}$) or ``"none"``, for Euclidean matrices.
        msign_method: the matrix sign of Euclidean matrices (default Polar Express; ``"keller_jordan"``
            with ``msign_dtype=torch.bfloat16`` is ``torch.optim.Muon``'s).
        msign_steps: its iterations. Default ``None``: 5 on Euclidean matrices (as Muon), and on manifold
            matrices each solver's own default (``filled_split``: 6); a number sets both.
        msign_dtype: its compute dtype (default: the parameter's).
        manifold: the manifold of groups that do not set one (default ``None``: from a geoopt
            ``ManifoldParameter``, else Euclidean).
        certify_every: every this many steps (``step_count`` divisible by it; 0: never) compute the exact
            float64 dual gap of every manifold direction the solver returned (`geomtrain.optim.certificate`)
            into ``last_stats["certified_gap_max"]`` and its tangent residual ``certified_residual_max``.
        bucketed: under DDP, exchange the solved matrices in one all-gather per ``(shape, dtype, device)``
            bucket (`geomtrain.optim.muon_dist`); ``False``: one broadcast per matrix and state slot. (FSDP2: unused.)
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        solver: str | None = None,
        solver_options: dict | None = None,
        warm_start: bool = True,
        shape_scale: str = "muon",
        msign_method: str = "polar_express",
        msign_steps: int | None = None,
        msign_dtype: torch.dtype | None = None,
        manifold: GramManifold | None = None,
        certify_every: int = 0,
        bucketed: bool = True,
    ):
        if not (is_int(certify_every) and certify_every >= 0):
            raise ValueError(f"certify_every must be an integer >= 0 (0: off); got {certify_every!r}")
        if not isinstance(bucketed, bool):
            raise ValueError(f"bucketed must be True or False; got {bucketed!r}")
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
        self.mesh = check_sharded([p for g in self.param_groups for p in g["params"]])  # FSDP2's, else None
        self._plan_of: dict[int, MatrixPlan] = {}
        for group in self.param_groups:
            self._setup_group(group)
        self.step_stats = StepStats()
        self.last_stats: dict = {}
        self.certify_every, self.step_count = int(certify_every), 0
        self.bucketed, self.comm = bucketed, CommCount().as_dict()
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
            must = None if group[name] is None else solver_option_rule(name, group[name])
            if must is not None:
                raise ValueError(f"{name} must be {must}; got {group[name]!r}")
        if group["solver"] is not None:
            get_solver(group["solver"])  # a one-line error naming the registered solvers
        if group["shape_scale"] not in SHAPE_SCALES:
            raise ValueError(f"unknown shape_scale {group['shape_scale']!r}; valid: {', '.join(SHAPE_SCALES)}")
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
        if not m.unconstrained:
            if p.dtype not in (torch.float32, torch.float64):
                raise TypeError(f"manifold parameters must be float32 or float64; got {p.dtype}")
            ok, why = m.check_point_on_manifold(whole(p), explain=True, atol=OFF_MANIFOLD_ATOL)
            if not ok:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is not on its manifold {type(m).__name__} ({why}); "
                    "project it first, p.data.copy_(manifold.projx(p.data)) (geomtrain.groups does by default)"
                )
        return m

    @staticmethod
    def _check_solver_options(group: dict, solver: str, picked: bool) -> None:
        """The group's ``solver_options`` against ``solver`` (``picked``: the default picked it): one-line errors."""
        valid = [k for k in SOLVER_OPTIONS[solver] if k not in ("dual", "escalate")]  # the optimizer's
        bad = set(group["solver_options"]) - set(valid)
        if bad:
            why = " (the default solver of some of the group's matrices; name a solver to use others)" if picked else ""
            raise ValueError(
                f"unknown solver option(s) {', '.join(sorted(bad))} for {solver!r}{why}; valid: {', '.join(valid)}"
            )
        check_solver_options(solver, group["solver_options"])  # the values, before the first step

    def _setup_group(self, group: dict) -> None:
        """Check a param group, resolve each parameter's manifold (once, here, never at step time) and check the
        group's ``solver_options`` against its solver or, without one, against every solver the default will
        pick for its matrices (`default_solver`), and fix each parameter's `MatrixPlan`."""
        self._check_group(group)
        manifolds = [self._resolve(group, p) for p in group["params"]]
        named = group["solver"]
        picked = {default_solver(m) for m in manifolds if not m.unconstrained}
        solvers = {named} if named is not None else picked or {default_solver(_EUCLIDEAN)}  # Euclidean: as exact's
        for solver in sorted(solvers):
            self._check_solver_options(group, solver, picked=named is None)
        for p, m in zip(group["params"], manifolds):
            self._plan_of[id(p)] = make_plan(group, m)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_plan_of"):  # called after __init__
            self.mesh = check_sharded([p for g in self.param_groups for p in g["params"]])
            self._setup_group(self.param_groups[-1])

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One step: gather (`_init_group`), the batched directions (the solver call), apply (retraction and
        guards), then commit everything at once; ``last_stats`` is the step's `StepStats`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_count += 1
        certify_now = self.certify_every > 0 and self.step_count % self.certify_every == 0
        comm = CommCount()
        items, commits, skipped = self._init_group(comm)
        table = StatsTable(len(items))
        world, rank = (
            (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)
        )
        if self.mesh is not None:  # FSDP2: each matrix's rows to its owner and back (geomtrain.optim.muon_fsdp)
            owner, sharded, sent = solve_sharded(items, self.state, table, certify_now)
            self._commit(commits + sharded)
            reduce_stats(items, self.state, table, world, owner, comm)
            for key, value in sent.as_dict().items():
                setattr(comm, key, getattr(comm, key) + value)
            return self._finish(items, table, skipped, comm, loss)
        owner = owners(items, world, self.bucketed)
        mine = [it for it in items if owner[it.index] == rank]
        for it in mine:
            if it.still:  # a zero update: A = 0, no solve, no retraction, the warm-start state as it is
                table.set(it.index, "matrices", math.prod(to_tall(it.update).shape[:-2]))
                table.set(it.index, "converged", 1.0)
                decay = it.group["lr"] * it.group["weight_decay"]
                if it.manifold.unconstrained and decay:  # decoupled weight decay still applies
                    commits.append(Commit(it.p, weights=it.p * (1 - decay)))
        for batch in group_batches([it for it in mine if not it.still]):
            A, st, sizes = batched_directions(batch, certify_now)
            commits += apply_directions(batch, A, st, sizes, table)
        self._commit(commits)
        for it in mine:
            slots = it.plan.solver.state
            table.set(it.index, "has_state", float(bool(slots) and all(s.key in self.state[it.p] for s in slots)))
        if world > 1:
            comm = (share_bucketed if self.bucketed else share)(items, self.state, table, world, owner)
        return self._finish(items, table, skipped, comm, loss)

    def _finish(self, items: list[MatrixItem], table: StatsTable, skipped: list[dict], comm: CommCount, loss):
        """The step's skip records, the warning (once) and ``last_stats``."""
        self.comm = comm.as_dict()
        codes = table.col("skipped").tolist()
        skipped += [skip_record(it.name, int(codes[it.index])) for it in items if codes[it.index]]
        if skipped:
            self.n_skipped_nonfinite_total += len(skipped)
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                what = "; ".join(f"{s['param']}: {s['reason']}" for s in skipped)
                warnings.warn(
                    f"ManifoldMuon: skipped {len(skipped)} matrix update(s) ({what}); counted and named in "
                    "last_stats['skipped'] (warned once)",
                    RuntimeWarning,
                    stacklevel=3,  # the caller of step()
                )
        names = [it.name for it in items]
        self.step_stats = StepStats.from_table(table, skipped, names, self.n_skipped_nonfinite_total, self.comm)
        self.last_stats = self.step_stats.as_dict()
        return loss

    def _init_group(self, comm: CommCount) -> tuple[list[MatrixItem], list[Commit], list[dict]]:
        """Gather the step's matrices: each parameter with a gradient, its new momentum buffer and update
        (`_momentum`), as a `MatrixItem` to solve, a `Commit` of the buffer, or a skip record (non-finite
        gradient). Nothing is written before every matrix is solved: a step that raises changes nothing.
        Under FSDP2 the update is this rank's rows and the checks are agreed by all ranks (counted in ``comm``)."""
        items, commits, skipped = [], [], []
        with_grad = [
            (gi, group, pi, p)
            for gi, group in enumerate(self.param_groups)
            for pi, p in enumerate(group["params"])
            if p.grad is not None
        ]
        grads = [p.grad if self.mesh is None else local_grad(p) for _, _, _, p in with_grad]
        moments = [(g, self._momentum(group, p, g)) for (_, group, _, p), g in zip(with_grad, grads)]
        flags = [torch.isfinite(g).all() for g, _ in moments] + [u.eq(0).all() for _, (_, u) in moments]
        checks = host_values(flags) if self.mesh is None else agree(flags, comm)  # one host read / all-reduce
        for (gi, group, pi, p), (_, (buf, u)), ok, zero in zip(with_grad, moments, checks, checks[len(with_grad) :]):
            if not ok:
                skipped.append(skip_record(_param_name(group, gi, pi), SKIP_GRADIENT))
                continue
            commits.append(Commit(p, state={"momentum_buffer": buf if self.mesh is None else sharded_like(p, buf)}))
            if group["lr"] == 0:  # e.g. a warmup schedule at 0: momentum moves, weights do not
                continue
            plan = self._plan_of[id(p)]
            if plan.manifold.unconstrained and self.mesh is None:  # FSDP2: the owner reshapes the whole update
                u = u.reshape(p.shape[0], -1)
            name = _param_name(group, gi, pi)
            items.append(MatrixItem(len(items), p, group, plan, u, name, self.state[p], still=zero))
        return items, commits, skipped

    def _momentum(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The new momentum buffer $\beta b + (1-\beta) g$ (a new tensor; the state keeps the old one until the
        commit) and the update $u$: $(1-\beta) g + \beta b$ (Nesterov) or the new buffer itself. Under FSDP2
        ``grad`` and both results are this rank's rows."""
        buf = self.state[p].get("momentum_buffer")
        if buf is None:
            buf = torch.zeros(grad.shape, dtype=p.dtype, device=p.device)
        elif self.mesh is not None:
            buf = buf.to_local()
        buf = buf.lerp(grad, 1 - group["momentum"])
        return buf, grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _commit(self, commits: list[Commit]) -> None:
        """Write the step: each `Commit`'s weights and state entries."""
        for c in commits:
            if c.weights is not None:
                c.p.copy_(c.weights)
            state = self.state[c.p]
            for key, value in (c.state or {}).items():
                if value is None:
                    state.pop(key, None)
                else:
                    state[key] = value

    # ------------------------------------------------------------------ state
    COUNTERS = ("n_skipped_nonfinite_total", "step_count")

    def state_dict(self) -> dict:
        """Like `torch.optim.Optimizer.state_dict`, with each group's manifold replaced by its class
        name (so ``torch.load(weights_only=True)`` works) and the `COUNTERS` added, at the top and in every
        group (``get_optimizer_state_dict`` keeps only ``state`` and ``param_groups``). Under FSDP2 every
        warm-start slot a parameter lacks is a placeholder (`geomtrain.optim.muon_fsdp.placeholder_slots`)."""
        sd = super().state_dict()
        if self.mesh is not None:
            params = [(p, g) for g in self.param_groups for p in g["params"]]
            for i, (p, g) in enumerate(params):
                if i in sd["state"]:
                    sd["state"][i] = placeholder_slots(p, g, self._plan_of[id(p)], sd["state"][i])
        for g in sd["param_groups"]:
            g.update(n_skipped_nonfinite_total=self.n_skipped_nonfinite_total, step_count=self.step_count)
            m = g.get("manifold")
            g["manifold"] = None if m is None else type(m).__name__
            if g.get("msign_dtype") is not None:
                g["msign_dtype"] = str(g["msign_dtype"])
            g["solver_options"] = {
                k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in g["solver_options"].items()
            }
        sd["n_skipped_nonfinite_total"] = self.n_skipped_nonfinite_total
        sd["step_count"] = self.step_count
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore momentum, dual variables and hyperparameters; manifolds stay those of this optimizer
        (a saved group whose manifold class differs is refused). Under FSDP2 (a collective: every rank calls it)
        whole plain tensors are sharded and placeholders dropped (`geomtrain.optim.muon_fsdp.settle_loaded`); an
        unsharded optimizer drops the placeholders of a state an FSDP2 run saved (`drop_placeholders`). A warm-start
        slot holding a NaN or Inf (damaged) is dropped too: that matrix starts cold, with a RuntimeWarning naming it."""
        state_dict = dict(state_dict)
        first = state_dict["param_groups"][0] if state_dict["param_groups"] else {}
        total = state_dict.pop("n_skipped_nonfinite_total", first.get("n_skipped_nonfinite_total", 0))
        steps = state_dict.pop("step_count", first.get("step_count", 0))  # 0: written before certify_every
        groups = []
        for saved, live in zip(state_dict["param_groups"], self.param_groups):
            saved = {k: v for k, v in saved.items() if k not in self.COUNTERS}
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
        for g in self.param_groups:  # new group dicts, with the saved settings: the plans follow them
            for p in g["params"]:
                self._plan_of[id(p)] = make_plan(g, self._plan_of[id(p)].manifold)
        named = [
            (_param_name(g, gi, pi), p, g)
            for gi, g in enumerate(self.param_groups)
            for pi, p in enumerate(g["params"])
            if p in self.state
        ]
        if self.mesh is not None:
            cold = settle_loaded([(p, g, self._plan_of[id(p)], self.state[p]) for _, p, g in named])
        else:  # an FSDP2 run's state loaded whole: its placeholders for missing warm-start slots go
            cold = drop_placeholders([self.state[p] for _, p, _ in named])
        for i, slot in cold:  # a damaged warm-start slot: that matrix starts cold, said in one line
            warnings.warn(cold_slot(named[i][0], slot), RuntimeWarning, stacklevel=2)
        self.n_skipped_nonfinite_total = int(total)
        self.step_count = int(steps)
