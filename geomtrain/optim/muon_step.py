"""The pieces of one `ManifoldMuon` step: plans, items, batches, the direction kernel, the apply phase, statistics."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

import torch

from manifolds import GramManifold, msign
from manifolds.base import from_tall, to_tall

from .certificate import certify
from .direction import spectral_direction
from .numerics import HostRead, host_values
from .registry import default_solver, get_solver
from .solver import Solver

__all__ = [
    "SHAPE_SCALES",
    "SKIP_REASONS",
    "shape_factor",
    "MatrixPlan",
    "make_plan",
    "MatrixItem",
    "Commit",
    "StatsTable",
    "StepStats",
    "group_batches",
    "keeps_warm_state",
    "batched_directions",
    "apply_directions",
    "solve_owned",
    "skip_record",
    "SKIP_GRADIENT",
]

SHAPE_SCALES = ("muon", "match_rms_adamw", "none")
"""Euclidean step scale s of an (out, in) = (A, B) weight: sqrt(max(1, A/B)), 0.2 sqrt(max(A, B)) (as torch's), 1."""


def shape_factor(rule: str, rows: int, cols: int) -> float:
    """The Euclidean step scale of `SHAPE_SCALES` for an (out, in) = (rows, cols) weight."""
    if rule == "muon":
        return max(1.0, rows / cols) ** 0.5
    if rule == "match_rms_adamw":
        return 0.2 * max(rows, cols) ** 0.5
    return 1.0


SKIP_GRADIENT, SKIP_DIRECTION, SKIP_REFUSED, SKIP_RETRACTION = 1, 2, 3, 4
SKIP_REASONS = {
    SKIP_GRADIENT: "non-finite gradient",
    SKIP_DIRECTION: "non-finite direction",
    SKIP_REFUSED: "retraction refused the point",
    SKIP_RETRACTION: "non-finite retraction",
}
"""Why a matrix update was skipped, by the code in its statistics row."""


def skip_record(name: str, code: int) -> dict:
    """One entry of ``last_stats["skipped"]``."""
    return {"param": name, "reason": SKIP_REASONS[code]}


@dataclass(frozen=True)
class MatrixPlan:
    """How every step updates one parameter, fixed when its param group is set: manifold, solver (unconstrained
    matrices use msign whatever it is), options (msign settings, then ``solver_options``), warm start, batch key."""

    manifold: GramManifold
    solver: Solver
    options: Mapping[str, object]
    warm: bool
    key: tuple

    @property
    def kept_slots(self) -> tuple:
        """The `StateSlot` s carried from step to step."""
        return () if not self.warm or self.manifold.unconstrained else self.solver.state


def make_plan(group: dict, manifold: GramManifold) -> MatrixPlan:
    """The `MatrixPlan` of a parameter of ``group`` (already checked) on ``manifold``."""
    named = group["solver"] or default_solver(manifold)
    spec = get_solver(named)
    msign = {"msign": group["msign_method"], "msign_steps": group["msign_steps"], "msign_dtype": group["msign_dtype"]}
    options = {k: v for k, v in msign.items() if v is not None and k in spec.options and spec.optimizer_msign}
    options.update(group["solver_options"])
    mkey = manifold.key() if callable(getattr(manifold, "key", None)) else id(manifold)
    key = (mkey, named, repr(sorted(group["solver_options"].items())), group["warm_start"], *msign.values())
    return MatrixPlan(manifold, spec, MappingProxyType(options), keeps_warm_state(group, spec, manifold), key)


@dataclass
class MatrixItem:
    """One parameter of the step (its matrices: 1, or k for a ``(k, m, n)`` parameter)."""

    index: int
    p: torch.Tensor
    group: dict  # its param group: lr and weight decay, read at every step (schedules change them)
    plan: MatrixPlan
    update: torch.Tensor  # the (Nesterov) momentum, as a matrix (batch) view
    name: str  # for skip reports
    state: dict  # the optimizer's state of p (read only here)
    still: bool = False  # the update is exactly zero: no solve, no retraction (Euclidean: weight decay only)

    @property
    def manifold(self) -> GramManifold:
        return self.plan.manifold


@dataclass
class Commit:
    """What a step writes to one parameter once every matrix is solved: weights (None: unchanged), state entries (None
    removes one)."""

    p: torch.Tensor
    weights: torch.Tensor | None = None
    state: dict | None = None


class StatsTable:
    """Per-parameter statistics of a step: one float64 row per `MatrixItem` (a tensor, so DDP sums it), columns
    `FIELDS`; ``skipped`` holds a `SKIP_REASONS` code, the `UNKNOWN` ones are NaN until known."""

    FIELDS = (
        "matrices",
        "msign_calls",
        "calls_max",
        "residual",
        "dual_gap",
        "converged",
        "off_manifold",
        "skipped",
        "has_state",
        "certified_gap",
        "certified_residual",
        "solved",
        "length_sum",
        "length_min",
    )
    UNKNOWN = ("dual_gap", "certified_gap", "certified_residual", "length_min")  # NaN until a solver reports them

    def __init__(self, rows: int):
        self.rows = torch.zeros(rows, len(self.FIELDS), dtype=torch.float64)
        for name in self.UNKNOWN:
            self.rows[:, self.FIELDS.index(name)] = float("nan")

    def col(self, name: str) -> torch.Tensor:
        return self.rows[:, self.FIELDS.index(name)]

    def set(self, index: int, name: str, value) -> None:
        self.rows[index, self.FIELDS.index(name)] = value


@dataclass
class StepStats:
    """A step's statistics (``ManifoldMuon.step_stats``; ``last_stats`` is its `as_dict`): plain Python numbers, each
    described in docs/manifold-muon.md (*The optimizer*); ``comm``: `geomtrain.optim.exchange.CommCount`."""

    n_matrices: int = 0
    msign_calls: int = 0
    iterations_max: int = 0
    residual_max: float = 0.0
    residual_mean: float = 0.0
    dual_gap_max: float | None = None
    n_unconverged: int = 0
    unconverged: list = field(default_factory=list)
    off_manifold_max: float = 0.0
    n_skipped_nonfinite: int = 0
    n_skipped_nonfinite_total: int = 0
    skipped: list = field(default_factory=list)
    certified_gap_max: float | None = None
    certified_residual_max: float | None = None
    length_mean: float | None = None
    length_min: float | None = None
    comm: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_table(
        cls, table: StatsTable, skipped: list[dict], names: list[str], total: int, comm: dict | None = None
    ) -> StepStats:
        """From the rows (row i: the item named ``names[i]``) and what was sent (``comm``), in one host read."""
        rows = table.rows if table.rows.shape[0] else StatsTable(1).rows  # an empty step: zeros, unknowns NaN

        def col(name: str) -> torch.Tensor:
            return rows[:, StatsTable.FIELDS.index(name)]

        def worst(name: str) -> torch.Tensor:  # the largest known value; -inf where none is known
            return torch.where(torch.isnan(col(name)), -math.inf, col(name)).max()

        summary = {
            "matrices": col("matrices").sum(),
            "calls": col("msign_calls").sum(),
            "calls_max": col("calls_max").max(),
            "residual_max": col("residual").max(),
            "residual_mean": col("residual").mean(),
            "off_max": col("off_manifold").max(),
            "solved": col("solved").sum(),
            "length_sum": col("length_sum").sum(),
            "lowest": torch.nan_to_num(col("length_min"), nan=math.inf).min(),
            **{k: worst(k) for k in ("dual_gap", "certified_gap", "certified_residual")},
        }
        values = torch.cat([torch.stack(list(summary.values())), col("converged")]).tolist()  # one read
        v = dict(zip(summary, values))
        gap = {k: v[k] if v[k] > -math.inf else None for k in ("dual_gap", "certified_gap", "certified_residual")}
        unconverged = [name for name, ok in zip(names, values[len(summary) :]) if ok < 1]
        solved = v["solved"]
        return cls(
            n_matrices=int(v["matrices"]),
            msign_calls=int(v["calls"]),
            iterations_max=int(v["calls_max"]),
            residual_max=v["residual_max"],
            residual_mean=v["residual_mean"],
            dual_gap_max=gap["dual_gap"],
            n_unconverged=len(unconverged),
            unconverged=unconverged,
            off_manifold_max=v["off_max"],
            n_skipped_nonfinite=len(skipped),
            n_skipped_nonfinite_total=total,
            skipped=skipped,
            certified_gap_max=gap["certified_gap"],
            certified_residual_max=gap["certified_residual"],
            length_mean=v["length_sum"] / solved if solved else None,
            length_min=v["lowest"] if solved else None,
            comm=dict(comm or {}),
        )


def batch_key(it: MatrixItem) -> tuple:
    """Items with equal keys are solved and retracted together: `MatrixPlan.key`, shape, dtype and device."""
    return (it.plan.key, tuple(to_tall(it.update).shape[-2:]), it.p.dtype, it.p.device)


def group_batches(items: list[MatrixItem]) -> list[list[MatrixItem]]:
    out: dict[tuple, list[MatrixItem]] = {}
    for it in items:
        out.setdefault(batch_key(it), []).append(it)
    return list(out.values())


def _stacked(t: torch.Tensor) -> torch.Tensor:
    tall = to_tall(t)
    return tall.reshape(-1, *tall.shape[-2:])


def keeps_warm_state(group: dict, spec, manifold: GramManifold) -> bool:
    """Whether a group's matrices on ``manifold`` carry their solver's state (``warm_start``, `Solver.keeps_state`)."""
    return bool(group["warm_start"]) and spec.keeps_state(group["solver_options"], manifold)


def warm_options(batch: list[MatrixItem]) -> dict:
    """The warm-start options of a batch: each `StateSlot` every item has (none if a ``"matrix"`` one is missing)."""
    plan = batch[0].plan
    if not plan.warm:
        return {}
    opts = {}
    for kind in ("matrix", "flag"):
        for slot in (s for s in plan.solver.state if s.kind == kind):
            values = [it.state.get(slot.key) for it in batch]
            if any(v is None for v in values):
                if kind == "matrix":
                    return {}
                continue
            if kind == "matrix":
                opts[slot.option] = torch.cat([v.reshape(-1, *v.shape[-2:]) for v in values]).double()
            else:
                opts[slot.option] = torch.cat([v.reshape(-1) for v in values]).bool()
    return opts


def batched_directions(batch: list[MatrixItem], certify_now: bool) -> tuple[torch.Tensor, dict, list[int]]:
    """The direction kernel: the batch's directions ``A`` (tall, stacked), the per-matrix statistics and state, and
    each item's matrix count. Writes nothing."""
    g0, plan = batch[0].group, batch[0].plan
    m = plan.manifold
    U = torch.cat([_stacked(it.update) for it in batch])
    sizes = [_stacked(it.update).shape[0] for it in batch]
    if m.unconstrained:
        A = msign(U, g0["msign_method"], steps=g0["msign_steps"], compute_dtype=g0["msign_dtype"])
        ones = torch.ones(len(U))
        return A, {"msign_calls": ones, "residual": torch.zeros(len(U)), "converged": ones}, sizes
    W = torch.cat([_stacked(it.p.detach().as_subclass(torch.Tensor)) for it in batch])
    opts = {**plan.options, **warm_options(batch)}
    A, ds = spectral_direction(m, W, U, solver=plan.solver, **opts)
    st = {"msign_calls": ds.evaluations, "residual": ds.residual, "converged": ds.converged}
    st.update(dual_gap=ds.dual_gap, state=ds.state, W=W)
    if certify_now:
        st["certified_gap"], st["certified_residual"] = certify(m, W, U, A, ds.multiplier)
    return A, st, sizes


def apply_directions(batch: list[MatrixItem], A: torch.Tensor, st: dict, sizes: list[int], table: StatsTable):
    """The apply phase of one batch: guards, retraction (or the Euclidean update), the statistics rows, and each
    matrix's new weights and warm-start state returned as `Commit` s (a matrix with $A = 0$ keeps both). The guards and
    the statistics in one pass over the batch: longer than 60 lines on purpose."""
    m = batch[0].manifold
    euclid = m.unconstrained
    bounds = [0, *itertools.accumulate(sizes)]
    directions = [
        from_tall(A[lo:hi].reshape(to_tall(it.update).shape), like=it.update)
        for it, lo, hi in zip(batch, bounds, bounds[1:])
    ]
    # every guard reads the whole batch on the host at once (on a GPU each read waits for the queue)
    moving = None if euclid else A.flatten(1).ne(0).any(1)  # per matrix: A != 0 (retracted)
    guards = host_values([torch.isfinite(a).all() for a in directions] + ([] if euclid else [moving.all()]))
    skips = [0 if ok else SKIP_DIRECTION for ok in guards[: len(batch)]]
    moving = None if euclid or guards[-1] else moving.cpu()  # None: every matrix moves
    tall = None if euclid else (st["W"], A, bounds, moving)  # the batch as solved: tall and stacked
    updates = retract(batch, directions, skips, m, tall)
    computed = [i for i, new in enumerate(updates) if new is not None]
    new_state = st.get("state")
    keep = bool(batch[0].plan.kept_slots) and new_state is not None
    matrices = [key for key, v in (new_state or {}).items() if v.dim() > 1]  # the "matrix" slots
    reads = HostRead()
    for i in computed:
        reads.add(("finite", i), torch.isfinite(updates[i]).all().double())
        if not euclid:
            reads.add(("off_manifold", i), m.constraint_violation(updates[i]).max().double())
        if keep:
            finite = [torch.isfinite(new_state[k][bounds[i] : bounds[i + 1]]).all() for k in matrices]
            ok = torch.stack(finite).all().double() if finite else torch.ones((), dtype=torch.float64)
            reads.add(("state_ok", i), ok)
    # statistics a solver left on the device join the same read
    fields = [f for f in ("residual", "dual_gap", "certified_gap", "certified_residual") if st.get(f) is not None]
    on_device = [f for f in fields if st[f].device.type != "cpu"]
    for f in on_device:
        for i in range(len(batch)):
            reads.add((f, i), st[f][bounds[i] : bounds[i + 1]].double().max())
    for j, length in enumerate(direction_length(A).double().unbind()):
        reads.add(("length", j), length)
    got = reads.read()
    lengths = torch.tensor([got["length", j] for j in range(A.shape[0])], dtype=torch.float64)
    for i in computed:
        if not got["finite", i]:
            skips[i] = SKIP_DIRECTION if euclid else SKIP_RETRACTION
    applied = [i for i in computed if not skips[i]]
    commits = {i: Commit(batch[i].p, weights=updates[i], state={}) for i in applied}
    off_of = {i: got["off_manifold", i] for i in applied if not euclid}
    state_ok = {i: got["state_ok", i] for i in applied} if keep else {}
    for i, it in enumerate(batch):
        sl = slice(bounds[i], bounds[i + 1])
        table.set(it.index, "matrices", sizes[i])
        table.set(it.index, "msign_calls", st["msign_calls"][sl].double().sum())
        table.set(it.index, "calls_max", st["msign_calls"][sl].double().max())
        for f in fields:
            table.set(it.index, f, got[f, i] if f in on_device else st[f][sl].double().max())
        table.set(it.index, "converged", st["converged"][sl].double().min())
        table.set(it.index, "skipped", skips[i])
        if not skips[i]:  # the step-length statistics of the directions applied
            table.set(it.index, "solved", sizes[i])
            table.set(it.index, "length_sum", lengths[sl].sum())
            table.set(it.index, "length_min", lengths[sl].min())
        if i in off_of:
            table.set(it.index, "off_manifold", off_of[i])
            if state_ok.get(i):
                still = None if moving is None else ~moving[sl]
                commits[i].state = warm_state(it, new_state, sl, still)
            elif keep:  # a non-finite state is never written: the previous one goes too (start cold)
                commits[i].state = {slot.key: None for slot in it.plan.kept_slots}
    return list(commits.values())


def solve_owned(items: list[MatrixItem], table: StatsTable, certify_now: bool) -> list[Commit]:
    """Solve and apply the matrices this rank owns, batch by batch: their `Commit` s (nothing written). A zero update
    (``still``) is not solved: its row says so, and a Euclidean one still gets its decoupled weight decay."""
    commits = []
    for it in (it for it in items if it.still):
        table.set(it.index, "matrices", math.prod(to_tall(it.update).shape[:-2]))
        table.set(it.index, "converged", 1.0)
        decay = it.group["lr"] * it.group["weight_decay"]
        if it.manifold.unconstrained and decay:
            commits.append(Commit(it.p, weights=it.p * (1 - decay)))
    for batch in group_batches([it for it in items if not it.still]):
        A, st, sizes = batched_directions(batch, certify_now)
        commits += apply_directions(batch, A, st, sizes, table)
    return commits


def direction_length(A: torch.Tensor) -> torch.Tensor:
    r"""The RMS singular value $\|A\|_F / \sqrt{n}$ of each tall ``(B, m, n)`` direction (1: the whole budget used)."""
    return torch.linalg.vector_norm(A.flatten(1), dim=1) / A.shape[-1] ** 0.5


def warm_state(it: MatrixItem, state: dict, rows: slice, still) -> dict:
    """A solved parameter's rows of each kept `StateSlot` (matrices in its dtype, flags as uint8); its matrices in
    ``still`` (bool per matrix, or None) keep their previous entries."""
    lead = to_tall(it.p).shape[:-2]
    new = {}
    for slot in it.plan.kept_slots:
        value = state.get(slot.key)
        if value is None:
            continue
        value = value[rows]
        if slot.kind == "matrix":
            new[slot.key] = value.reshape(*lead, *value.shape[-2:]).to(it.p.dtype)
        else:
            new[slot.key] = value.reshape(-1).to(torch.uint8)
    if still is not None and bool(still.any()):
        for key, value in new.items():
            if key in it.state:  # matrix: (*lead, n, n); flag: one per matrix
                keep = still.reshape(*value.shape[:-2], 1, 1) if value.dim() > 1 else still
                new[key] = torch.where(keep.to(value.device), it.state[key], value)
    return new


def retract(batch: list[MatrixItem], directions: list[torch.Tensor], skips: list[int], m, tall) -> list:
    r"""The new weights of each parameter (None if skipped or still; ``SKIP_REFUSED`` where the retraction raises
    ``ValueError``). ``tall``: None (Euclidean) or the stacked weights, directions, row bounds and mask $A \ne 0$."""
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
    with m.inputs_checked():  # the guards read every direction finite; weights are written only when finite
        try:
            parts = dict(zip(rows, torch.split(m.retr(points, steps), [len(W[r]) for r in rows.values()])))
        except ValueError:  # a refused point in the batch: retract one by one to find it
            parts = {}
            for i, r in rows.items():
                try:
                    parts[i] = m.retr(W[r], -batch[i].group["lr"] * A[r].to(W.dtype))
                except ValueError:  # DGram refusing a (near-)zero column: a skipped update; other errors surface
                    skips[i] = SKIP_REFUSED
    for i, part in parts.items():
        p, (lo, hi), r = batch[i].p, (bounds[i], bounds[i + 1]), rows[i]
        if not isinstance(r, slice):  # the matrices with A = 0 keep their weights
            part = W[lo:hi].index_copy(0, r - lo, part)
        updates[i] = from_tall(part.reshape(to_tall(p).shape), like=p).reshape(p.shape)
    return updates
