r"""`ManifoldMuon`: Muon whose update is the spectral steepest-descent direction on a manifold (user's guide, with
every ``last_stats`` entry: docs/manifold-muon.md, *The optimizer*). Per matrix $W$ with gradient $g$:

$$b \leftarrow \beta b + (1-\beta) g,\qquad u = (1-\beta) g + \beta b \ \text{(Nesterov; else } u = b),$$
$$\text{manifold: } W \leftarrow R_W(-\eta A),\quad A = \texttt{spectral\_direction}(W, u);\qquad
\text{Euclidean: } W \leftarrow (1 - \eta\lambda) W - \eta\, s\, \operatorname{msign}(u).$$

Manifolds and plans (`MatrixPlan`) are fixed when a param group is added, never at step time. A step gathers
(`_init_group`), solves (`batched_directions`), applies (`apply_directions`) and only then writes (`Commit`): a step
that raises changes nothing. A matrix whose update or direction is exactly zero is neither solved nor retracted; a
non-finite one is skipped. An exchange decides which rank solves each matrix and shares the
results: `geomtrain.optim.muon_dist.OwnerExchange` (one process, DDP), `geomtrain.optim.muon_fsdp.ShardedExchange`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable

import geoopt
import torch

from manifolds import Euclidean, GramManifold
from manifolds.matrix_sign import MSIGN_METHODS

from .exchange import CommCount
from .muon_dist import OwnerExchange
from .muon_fsdp import (
    ShardedExchange,
    agree,
    check_sharded,
    cold_slot,
    drop_placeholders,
    local_grad,
    placeholder_slots,
    settle_loaded,
    sharded_like,
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
    make_plan,
    shape_factor,
    skip_record,
)
from .numerics import host_values
from .registry import SOLVER_OPTIONS, check_solver_options, default_solver, get_solver, solver_option_rule
from .solver import is_int

__all__ = ["ManifoldMuon", "SHAPE_SCALES", "SKIP_REASONS", "StepStats", "shape_factor"]

_EUCLIDEAN = Euclidean()

# A manifold parameter must start on its manifold: raw weights are far off, retracted float32 points within ~1e-6
OFF_MANIFOLD_ATOL = 1e-3


def _param_name(group: dict, group_index: int, param_index: int) -> str:
    """The parameter's name from the group's ``param_names`` (torch.optim's key), else its position."""
    names = group.get("param_names")
    return names[param_index] if names else f"group {group_index} param {param_index}"


class ManifoldMuon(torch.optim.Optimizer):
    r"""Manifold Muon (the update rule: the module docstring).

    Args:
        params: parameters or param groups; a group may set ``manifold`` and any of the options below.
        lr: learning rate $\eta$ (the spectral norm of a manifold step).
        momentum: $\beta$.
        nesterov: use the Nesterov form of the momentum.
        weight_decay: decoupled weight decay of Euclidean matrices (ignored on manifolds).
        solver: a registered solver name; ``None``: per matrix, `geomtrain.optim.default_solver`.
        solver_options: options for `spectral_direction`, valid for every solver the group's matrices use.
        warm_start: carry each matrix's solver state to its next solve.
        shape_scale: the Euclidean step scale, one of `SHAPE_SCALES`.
        msign_method: the matrix sign of Euclidean matrices (default Polar Express).
        msign_steps: its iterations (``None``: 5 on Euclidean matrices, each solver's default on manifolds).
        msign_dtype: its compute dtype (``None``: the parameter's).
        manifold: a `manifolds.GramManifold` for groups that set none (``None``: a geoopt ``ManifoldParameter``'s,
            else Euclidean).
        certify_every: certify every manifold direction in float64 every this many steps (0: never;
            `geomtrain.optim.certificate`).
        bucketed: under DDP, one all-gather per bucket (`geomtrain.optim.muon_dist`); ``False``: broadcasts.
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
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, solver=solver)
        defaults.update(solver_options=dict(solver_options or {}), warm_start=warm_start, shape_scale=shape_scale)
        defaults.update(msign_method=msign_method, msign_steps=msign_steps, msign_dtype=msign_dtype, manifold=manifold)
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
        """The manifold of ``p``: the group's, a geoopt ``ManifoldParameter``'s, else Euclidean; ``p`` must be on it."""
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
        """Check a param group, resolve its manifolds, check its ``solver_options`` and fix each `MatrixPlan`."""
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
        """One step (the module docstring); ``last_stats`` is its `StepStats`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_count += 1
        certify_now = self.certify_every > 0 and self.step_count % self.certify_every == 0
        comm = CommCount()
        items, commits, skipped = self._init_group(comm)  # gather
        table = StatsTable(len(items))
        exchange = OwnerExchange(self.bucketed) if self.mesh is None else ShardedExchange()
        solved, owner = exchange.solve(items, self.state, table, certify_now)  # batches -> solve -> apply
        self._commit(commits + solved)
        comm = exchange.share(items, self.state, table, owner, comm)
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
        """Each parameter with a gradient as a `MatrixItem`, a `Commit` of its new momentum buffer, or a skip record
        (non-finite gradient); writes nothing. Under FSDP2 the update is this rank's rows, the checks agreed by all."""
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
        r"""The new momentum buffer $\beta b + (1-\beta) g$ (a new tensor) and the update $u$."""
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
        """`torch.optim.Optimizer.state_dict` with manifolds and dtypes by name (for ``torch.load(weights_only=True)``),
        the `COUNTERS` at the top and in every group, and under FSDP2 `placeholder_slots`."""
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
                k: str(v) if isinstance(v, torch.dtype) else v for k, v in g["solver_options"].items()
            }
        sd.update(n_skipped_nonfinite_total=self.n_skipped_nonfinite_total, step_count=self.step_count)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore momentum, warm-start state and hyperparameters (manifolds stay this optimizer's); placeholders and
        damaged warm-start slots are dropped (that matrix starts cold, with a RuntimeWarning)."""
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
            dtypes = {k: v for k, v in live["solver_options"].items() if isinstance(v, torch.dtype)}
            options = {**saved.get("solver_options", {}), **dtypes}
            groups.append(
                dict(saved, manifold=live["manifold"], msign_dtype=live["msign_dtype"], solver_options=options)
            )
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
