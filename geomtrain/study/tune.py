"""The tuning protocol of a study: every arm at its own tuned value, confirmed on other seeds.

An *arm* is one thing compared (a preset, with a solver: ``hetero``, ``hetero+exact``). With
``geomtrain study --tune muon_lr=0.005,0.01,0.02,0.04,0.08`` the study runs in two phases:

1. **Selection.** Each arm trains at every grid value on the *selection seeds*, for
   ``fraction`` of the horizon (default the whole of it; ``max_iters``, ``warmup_iters`` and
   ``eval_interval`` scaled together). A shorter selection run is cheaper but biased: the best
   rate falls as the horizon grows, so it prefers rates above the horizon's own best. Its score
   at a value is the mean final val loss over those seeds (a diverged run
   scores +inf). When the best value is at an end of the grid, the grid grows by one point past
   that end (geometric when the grid is, else by its end step) and the new runs train, until the
   best value is interior or the arm has grown ``max_extend`` times (recorded as stopped at the
   edge).
   With several keys for one arm (``--tune muon_lr=... --tune lr=...``) the search is
   coordinate-wise, one key after the other in the order given: each key's grid search runs
   with the keys before it at their chosen values and the keys after it at the study's values.
   Later passes (up to ``max_passes`` over the keys) search each key again about its chosen value
   (that value and its grid neighbours, growing at an edge as above), every other key at its
   chosen value, until the last ``n_keys - 1`` searches in a row left their key where it was: no
   single key's neighbouring value then scores better.
   A tuned ``lr`` keeps the schedule's shape: ``min_lr`` moves with it (``min_lr / lr`` as in
   the arm's own config), so the AdamW part's cosine, and the Muon part's, which follows
   ``lr_t / lr``, end at the same fraction of their peaks at every value.
2. **Confirmation.** Each arm trains at the full horizon at its own best values on the
   *confirmation seeds* (the study's ``--seeds``), which must not share a seed with the
   selection seeds. Only these runs enter the results table and the paired statistics
   (`geomtrain.study.stats`).

A grid applies to every arm, or to the arms of one preset (``adamw:lr=3e-4,6e-4,1.2e-3``: the
AdamW baseline has no Muon matrices, so ``muon_*`` grids pass it by; without a grid of its own
it is confirmed untuned, and the record says so). A preset's grid of a key replaces the shared grid of that key.
Everything is in ``study.json``'s ``tuning``: the protocol, every score, each arm's grids, choices
and where each stopped. Rerunning the command resumes; the grids' growth and the order of the keys
are decided again from the recorded runs, so they are the same.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .._io import read_json
from .plan import StudyError, StudyPlan, Variant, format_value, swept_name

__all__ = [
    "SELECT_SEED_START",
    "DEFAULT_FRACTION",
    "DEFAULT_MAX_EXTEND",
    "TuneProtocol",
    "parse_tune",
    "selection_seeds",
    "extend_grid",
    "choose",
    "selection_variant",
    "confirmation_variant",
    "validate_selection",
    "describe_tuning",
    "run_tuning",
]

SELECT_SEED_START = 1000  # "--select-seeds 2" -> 1000, 1001: apart from the usual confirmation seeds 0, 1, 2
DEFAULT_FRACTION = 1.0  # selection runs train the whole horizon: the best rate falls as the horizon grows, so a
# shorter selection run prefers rates above the horizon's own best (Fair comparisons: "The selection horizon")
DEFAULT_MAX_EXTEND = 2  # points a grid may grow by at its edges before the search stops there
DEFAULT_MAX_PASSES = 3  # passes over several keys: once a later key moves, an earlier key's choice may not be best
ALL_ARMS = "*"


@dataclass
class TuneProtocol:
    """What the selection phase does (stored in ``study.json`` before any run)."""

    grids: dict[str, list[dict]]  # scope ("*" or a preset) -> [{"key", "values"}, ...] in search order
    select_seeds: list[int]
    fraction: float = DEFAULT_FRACTION
    max_extend: int = DEFAULT_MAX_EXTEND
    scale_min_lr: bool = True  # a tuned lr moves min_lr with it (min_lr / lr fixed); see `TuneProtocol.follow`
    max_passes: int = DEFAULT_MAX_PASSES  # passes over an arm's keys (several keys only); see `_ArmSearch`

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TuneProtocol:
        """The protocol of a ``study.json`` (one grid per scope stored as a dict reads as a list of one; a record
        without ``scale_min_lr`` was made when a tuned ``lr`` kept the study's ``min_lr``: it reads as False; one
        without ``max_passes``, when the keys were searched once: it reads as 1)."""
        out = cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
        out.grids = {scope: [g] if isinstance(g, dict) else list(g) for scope, g in out.grids.items()}
        out.scale_min_lr = bool(d.get("scale_min_lr", False))
        out.max_passes = int(d.get("max_passes", 1))
        return out

    def follow(self, arm: Variant, base: dict, at: dict) -> dict:
        """The overrides of ``arm`` at the tuned values ``at``: ``at``, and where it sets ``lr`` to another value
        than the arm's own (and not ``min_lr`` too), ``min_lr = min_lr_own * lr / lr_own``. The schedule keeps its
        shape: the AdamW part's cosine ends at the same fraction of its peak, and so does the Muon part's, whose
        rate is ``muon_lr * lr_t / lr``. With a fixed ``min_lr`` a higher ``lr`` would decay both deeper."""
        from ..config import make_config

        if not self.scale_min_lr or "lr" not in at or "min_lr" in at:
            return dict(at)
        own = make_config({**base, **arm.overrides, "preset": arm.preset, "rules": list(arm.rules)})  # as a run's
        if at["lr"] == own.lr:
            return dict(at)
        return {**at, "min_lr": _round(own.min_lr * at["lr"] / own.lr)}

    def grids_of(self, arm: Variant) -> list[dict]:
        """The grids ``[{"key", "values"}, ...]`` that tune ``arm``, in search order: the shared ones (less the
        ``muon_*`` ones where the arm has no Muon matrices), each replaced by its preset's grid of the same key, then
        the preset's grids of other keys; empty: confirmed untuned."""
        skip_muon = not _trains_muon(arm.preset)
        shared = [g for g in self.grids.get(ALL_ARMS, []) if not (skip_muon and g["key"].startswith("muon_"))]
        own = {g["key"]: g for g in self.grids.get(arm.preset, [])}
        return [own.pop(g["key"], g) for g in shared] + list(own.values())

    def check(self, confirm_seeds: Sequence[int]) -> TuneProtocol:
        """``StudyError`` on a fraction outside (0, 1], a negative ``max_extend``, no pass or shared seeds."""
        if not 0 < self.fraction <= 1:
            raise StudyError(f"--tune-fraction must be in (0, 1]; got {self.fraction}")
        if self.max_extend < 0:
            raise StudyError(f"--tune-max-extend must be >= 0; got {self.max_extend}")
        if self.max_passes < 1:
            raise StudyError(f"--tune-passes must be >= 1; got {self.max_passes}")
        shared = sorted(set(self.select_seeds) & set(confirm_seeds))
        if shared:
            raise StudyError(
                f"selection seeds {', '.join(map(str, shared))} are also confirmation seeds (--seeds): "
                "a value must be confirmed on seeds that did not select it; pick disjoint --select-seeds"
            )
        return self


def _trains_muon(preset: str) -> bool:
    """Whether a preset's arms have Muon matrices (``muon_*`` keys act on them); the AdamW baseline has none."""
    return preset != "adamw"


def parse_tune(texts: Sequence[str]) -> dict[str, list[dict]]:
    """``["muon_lr=0.01,0.02,0.04", "adamw:lr=3e-4,6e-4,1.2e-3"]`` -> ``{"*": [{"key": "muon_lr", "values":
    [0.01, 0.02, 0.04]}], "adamw": [{...}]}`` (values typed by `geomtrain.config.parse_value`, sorted; a scope's
    grids in the order given, which is the order of the coordinate-wise search)."""
    from ..assign import PRESETS
    from ..config import parse_value

    grids: dict[str, dict] = {}
    for text in texts:
        scope, _, assignment = text.rpartition(":")
        key, sep, values = assignment.partition("=")
        key = key.strip().replace("-", "_")
        scope = scope.strip() or ALL_ARMS
        if not sep or not key or not values.strip():
            raise StudyError(f"--tune {text!r} must look like [PRESET:]KEY=V1,V2,..., e.g. muon_lr=0.01,0.02,0.04")
        if scope != ALL_ARMS and scope not in PRESETS:
            raise StudyError(f"--tune {text!r}: unknown preset {scope!r}; valid: {', '.join(PRESETS)}")
        if not _trains_muon(scope) and key.startswith("muon_"):
            raise StudyError(f"--tune {text!r}: {scope} trains no matrix with Muon, so {key} changes nothing; tune lr")
        if any(g["key"] == key for g in grids.get(scope, [])):
            raise StudyError(f"--tune gives two grids of {key} for {'every arm' if scope == ALL_ARMS else scope}")
        parsed = sorted({parse_value(key, v.strip()) for v in values.split(",") if v.strip()})
        if len(parsed) < 3:
            raise StudyError(f"--tune {text!r}: give at least 3 values, so that a best value can be interior")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in parsed):
            raise StudyError(f"--tune {text!r}: the values must be finite numbers")
        grids.setdefault(scope, []).append({"key": key, "values": parsed})
    return grids


def selection_seeds(text: str) -> list[int]:
    """``"2"`` -> [1000, 1001] (from `SELECT_SEED_START`); ``"7,8"`` -> those seeds."""
    from .plan import parse_seeds

    seeds = parse_seeds(text, "--select-seeds")
    return seeds if "," in text else [SELECT_SEED_START + s for s in seeds]


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def extend_grid(values: Sequence[float], side: str) -> float | None:
    """The next point past the ``"low"`` or ``"high"`` end of a sorted grid: times the end ratio
    when the grid is geometric (all > 0, ratios within 1%), else plus the end step; None when a
    geometric grid would need a value <= 0 (an arithmetic one stepping below zero) or ints collide."""
    v = list(values)
    ratios = [b / a for a, b in zip(v, v[1:])] if all(x > 0 for x in v) else []
    geometric = bool(ratios) and max(ratios) <= min(ratios) * 1.01
    if side == "high":
        new = v[-1] * (v[-1] / v[-2]) if geometric else v[-1] + (v[-1] - v[-2])
    else:
        new = v[0] / (v[1] / v[0]) if geometric else v[0] - (v[1] - v[0])
        if new <= 0 and v[0] > 0:
            return None
    new = type(v[0])(round(new)) if isinstance(v[0], int) else _round(new)
    return None if new in v else new


def choose(values: Sequence[float], scores: dict, extended: int, max_extend: int) -> dict:
    """The selection outcome of one arm: ``{"best", "where", "grow"}``. ``where``: ``interior``,
    ``edge`` (best at an end after ``max_extend`` growths, or no point past it) or ``diverged``
    (every value diverged); ``grow``: ``"low"``/``"high"`` when the grid should grow there."""
    finite = {v: s for v, s in scores.items() if s is not None and math.isfinite(s)}
    if not finite:
        return {"best": None, "where": "diverged", "grow": None}
    best = min(finite, key=lambda v: (finite[v], v))
    i = list(values).index(best)
    side = "low" if i == 0 else "high" if i == len(values) - 1 else None
    if side is None:
        return {"best": best, "where": "interior", "grow": None}
    if extended < max_extend and extend_grid(values, side) is not None:
        return {"best": best, "where": "edge", "grow": side}
    return {"best": best, "where": "edge", "grow": None}


def _scaled(base: dict, fraction: float) -> dict:
    iters = max(1, round(int(base["max_iters"]) * fraction))
    out = {"max_iters": iters}
    for key, floor in (("warmup_iters", 0), ("eval_interval", 1)):
        if key in base:
            out[key] = min(iters, max(floor, round(int(base[key]) * fraction)))
    return out


def _assignments(values: dict) -> list[str]:
    return [f"{k}={format_value(v)}" for k, v in values.items()]


def selection_variant(
    arm: Variant,
    key: str,
    value,
    protocol: TuneProtocol,
    base: dict,
    fixed: dict | None = None,
    at_fixed: str | None = None,
    base_value=None,
) -> Variant:
    """The run of ``arm`` at ``key=value`` on the selection seeds, at ``fraction`` of the horizon: the first key's
    ``select-ARM__KEY-VALUE``; a later key's with the keys before it at their chosen values (``fixed``), named by
    `swept_name` after the run at ``fixed`` (``at_fixed``), so that at the arm's own value (``base_value``) it is
    that very run: ``select-ARM__K1-V1__KEY-VALUE``, or ``select-ARM__K1-V1``."""
    scaled = _scaled(base, protocol.fraction)
    at = {**(fixed or {}), key: value}
    return Variant(
        swept_name(at_fixed or f"select-{arm.name}", key, value, base_value),
        arm.preset,
        rules=list(arm.rules),
        overrides={**arm.overrides, **protocol.follow(arm, base, at), **scaled},
        label=f"{arm.label or arm.name}, {', '.join(_assignments(at))} (selection, {scaled['max_iters']} steps)",
        base=arm.name,
        sweep={"key": key, "value": value},
        seeds=list(protocol.select_seeds),
        role="select",
    )


def confirmation_variant(arm: Variant, chosen: dict, protocol: TuneProtocol, base: dict) -> Variant:
    """``arm`` at its chosen values ``{key: value}`` (with `TuneProtocol.follow`; unchanged when untuned), on the
    study's confirmation seeds."""
    if not chosen:
        return arm
    return dataclasses.replace(
        arm,
        overrides={**arm.overrides, **protocol.follow(arm, base, chosen)},
        label=f"{arm.label or arm.name} ({', '.join(_assignments(chosen))})",
    )


def validate_selection(study: StudyPlan) -> StudyPlan:
    """Every value of every grid gets a config (and so is validated) before any training, each key's with the keys
    before it at their grids' first values; ``StudyError`` names the arm and value, or a preset's grid that matches
    no arm. Returns ``study``."""
    protocol = TuneProtocol.from_dict(study.options["tune"]).check(study.seeds)
    presets = list(dict.fromkeys(v.preset for v in study.variants))
    for scope in protocol.grids:  # a preset's grid that tunes no arm: refused, not confirmed untuned
        if scope != ALL_ARMS and scope not in presets:
            raise StudyError(
                f"--tune {scope}:...: {scope} is not an arm of this study; its presets: {', '.join(presets)}"
            )
    for arm in study.variants:
        fixed: dict = {}
        for grid in protocol.grids_of(arm):
            for value in grid["values"]:
                variant = selection_variant(arm, grid["key"], value, protocol, study.base, fixed)
                study.config(variant, protocol.select_seeds[0])
            fixed[grid["key"]] = grid["values"][0]
    return study


def _current_value(study: StudyPlan, arm: Variant, key: str):
    """``key``'s value in ``arm``'s config (the study's, or the arm's own override)."""
    return getattr(study.config(arm, study.seeds[0]), key)


def describe_tuning(study: StudyPlan) -> list[str]:
    """The selection plan in words, a line per arm and one for the totals: what a dry run prints for a budget
    (the least number of runs; each grid may grow by ``max_extend`` points)."""
    protocol = TuneProtocol.from_dict(study.options["tune"])
    select_steps, seeds = _scaled(study.base, protocol.fraction)["max_iters"], len(protocol.select_seeds)
    lines, runs = [], 0
    for arm in (v for v in study.variants if v.role is None):
        grids = protocol.grids_of(arm)
        reused = sum(_current_value(study, arm, g["key"]) in g["values"] for g in grids[1:])  # `swept_name`
        runs += (sum(len(g["values"]) for g in grids) - reused) * seeds
        keys = ", then ".join(f"{g['key']} {', '.join(map(format_value, g['values']))}" for g in grids)
        lines.append(f"  {arm.name}: {keys or 'untuned (no grid applies)'}")
    arms = sum(v.role is None for v in study.variants)
    lines.append(
        f"selection: at least {runs} runs of {select_steps} steps (seeds {', '.join(map(str, protocol.select_seeds))}; "
        f"each grid may grow by {protocol.max_extend}; several keys: up to {protocol.max_passes} passes); "
        f"confirmation: {arms * len(study.seeds)} runs of "
        f"{study.base['max_iters']} steps"
    )
    return lines


def _score(study: StudyPlan, v: Variant) -> float | None:
    """Mean final val loss of a selection variant over its seeds; +inf when one diverged or
    failed; None while a run is missing or unfinished."""
    losses = []
    for s in v.seeds or study.seeds:
        st = read_json(study.run_dir(v, s) / "status.json") or {}
        if st.get("status") in ("diverged", "failed"):
            return math.inf
        if st.get("status") != "finished" or st.get("final_val_loss") is None:
            return None
        losses.append(float(st["final_val_loss"]))
    return sum(losses) / len(losses)


@dataclass
class _KeySearch:
    """The grid search of one key of an arm, the other keys searched so far at their chosen values (``fixed``: the
    run ``at_fixed``, where the key has the value ``base_value``; None for the first key), in pass ``pass_no``."""

    key: str
    values: list
    fixed: dict
    at_fixed: str | None = None
    base_value: object = None
    pass_no: int = 1
    initial: int = field(init=False)  # the grid's size before it grew
    scores: dict = field(default_factory=dict)
    outcome: dict = field(default_factory=dict)

    def __post_init__(self):
        self.initial = len(self.values)

    def record(self) -> dict:
        return {
            "key": self.key,
            **({"pass": self.pass_no} if self.pass_no > 1 else {}),
            **({"fixed": self.fixed} if self.fixed else {}),
            "grid": self.values,
            "scores": {format_value(v): self.scores.get(v) for v in self.values},
            "extended": len(self.values) - self.initial,
            **{k: self.outcome.get(k) for k in ("best", "where")},
            **({"reused": {format_value(self.base_value): self.at_fixed}} if self.base_value in self.values else {}),
        }

    def variant(self, arm: Variant, value, protocol: TuneProtocol, base: dict) -> Variant:
        """The selection run of ``value`` (at the arm's own value: the run at ``fixed``, trained once)."""
        return selection_variant(arm, self.key, value, protocol, base, self.fixed, self.at_fixed, self.base_value)


@dataclass
class _ArmSearch:
    """An arm's coordinate-wise search: one `_KeySearch` per grid, each started when the one before it is done, then
    (several keys) later passes, each key again about its chosen value, until it settles or ``max_passes`` ran out."""

    arm: Variant
    grids: list[dict]
    stages: list[_KeySearch] = field(default_factory=list)
    done: bool = False

    def __post_init__(self):
        self.stages = [_KeySearch(self.grids[0]["key"], list(self.grids[0]["values"]), {})]

    def selection(self, protocol: TuneProtocol, base: dict) -> list[Variant]:
        runs = {}
        for k in self.stages:
            for v in k.values:
                run = k.variant(self.arm, v, protocol, base)
                runs.setdefault(run.name, run)  # a later key at the arm's own value: an earlier key's run
        return list(runs.values())

    def update(self, study: StudyPlan, protocol: TuneProtocol, print_fn: Callable) -> bool:
        """Score the current key's grid; grow it, or start the next key, or finish. True when there are new runs."""
        k = self.stages[-1]
        k.scores = {v: _score(study, k.variant(self.arm, v, protocol, study.base)) for v in k.values}
        k.outcome = choose(k.values, k.scores, len(k.values) - k.initial, protocol.max_extend)
        if k.outcome["grow"]:
            new = extend_grid(k.values, k.outcome["grow"])
            k.values = sorted([*k.values, new])
            print_fn(f"tuning {self.arm.name}: best {k.key} at the {k.outcome['grow']} edge; grid grows to {new:g}")
            return True
        nxt = self._next_search(study, protocol) if k.outcome["best"] is not None else None
        if nxt is None:
            self.done = True
            return False
        self.stages.append(nxt)
        again = f" again (pass {nxt.pass_no})" if nxt.pass_no > 1 else ""
        print_fn(f"tuning {self.arm.name}: {', '.join(_assignments(nxt.fixed))}; now {nxt.key}{again}")
        return True

    def _next_search(self, study: StudyPlan, protocol: TuneProtocol) -> _KeySearch | None:
        """The next key's search, or None when done. Pass 1: the next grid, the keys before it at their chosen values.
        Later passes: key ``len(stages) % n`` about its chosen value (its last search's grid, that value and one
        neighbour each side), the other keys at theirs; none once ``n - 1`` searches in a row kept their key's value
        (the key before them was chosen with every other key where it is now) or after ``max_passes`` passes."""
        k, n, current = self.stages[-1], len(self.grids), self.chosen()
        at_fixed = k.variant(self.arm, k.outcome["best"], protocol, study.base).name
        if len(self.stages) < n:
            grid = self.grids[len(self.stages)]
            now = _current_value(study, self.arm, grid["key"])
            return _KeySearch(grid["key"], list(grid["values"]), dict(current), at_fixed, now)
        if n < 2 or len(self.stages) >= n * protocol.max_passes:
            return None
        kept = 0
        for done in reversed(self.stages[n:]):
            if done.outcome.get("best") != done.base_value:
                break
            kept += 1
        if kept >= n - 1:
            return None
        key = self.grids[len(self.stages) % n]["key"]
        grid = next(s.values for s in reversed(self.stages) if s.key == key)
        i = grid.index(current[key])
        fixed = {name: value for name, value in current.items() if name != key}
        return _KeySearch(key, grid[max(0, i - 1) : i + 2], fixed, at_fixed, current[key], len(self.stages) // n + 1)

    def chosen(self) -> dict | None:
        """``{key: best value}`` of every key (its latest search's), or None where a key's every value diverged."""
        best = {k.key: k.outcome.get("best") for k in self.stages}
        return None if any(v is None for v in best.values()) else best

    def record(self) -> dict:
        """One key: its `_KeySearch` record; several: ``{"stages": [...]}`` in search order, every pass."""
        records = [k.record() for k in self.stages]
        return records[0] if len(self.grids) == 1 else {"stages": records}


def run_tuning(
    study: StudyPlan,
    record: dict,
    train_jobs: Callable[[list], int],
    save: Callable[[], None],
    print_fn: Callable = print,
) -> int:
    """Both phases of a tuned study (``study.options["tune"]``: a `TuneProtocol` as a dict).
    ``train_jobs(jobs)`` trains ``(variant, seed)`` pairs not done yet and returns an exit code;
    ``save()`` writes ``record``. Returns 0, or the code of an interrupted phase."""
    protocol = TuneProtocol.from_dict(study.options["tune"])
    arms = [v for v in study.variants if v.role is None]
    grids = {a.name: protocol.grids_of(a) for a in arms}
    searches = [_ArmSearch(a, grids[a.name]) for a in arms if grids[a.name]]
    tuning = record.setdefault("tuning", {})
    tuning["protocol"] = protocol.to_dict()
    tuning["untuned"] = [a.name for a in arms if not grids[a.name]]
    while True:
        selection = [v for s in searches for v in s.selection(protocol, study.base)]
        study.variants = arms + selection
        study.validate()
        record["variants"] = [v.to_dict() for v in study.variants]
        save()
        code = train_jobs([(v, seed) for seed in protocol.select_seeds for v in selection])
        if code:
            return code
        moved = [s.update(study, protocol, print_fn) for s in searches if not s.done]
        tuning["arms"] = {s.arm.name: s.record() for s in searches}
        if not any(moved):
            break
    chosen = {s.arm.name: s.chosen() for s in searches}
    confirm = []
    for a in arms:
        if a.name in chosen and chosen[a.name] is None:
            print_fn(f"tuning {a.name}: every value of a key diverged in selection; not confirmed")
            continue
        confirm.append(confirmation_variant(a, chosen.get(a.name) or {}, protocol, study.base))
    for s in searches:
        picks = ", ".join(f"{k.key}={format_value(k.outcome['best'])} ({k.outcome['where']})" for k in s.stages)
        print_fn(f"tuning {s.arm.name}: {picks}")
    study.variants = confirm + [v for v in study.variants if v.role == "select"]
    study.validate()
    record["variants"] = [v.to_dict() for v in study.variants]
    save()
    return train_jobs([(v, seed) for seed in study.seeds for v in confirm])
