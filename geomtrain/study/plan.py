"""What a study trains: variants, suites, the shared config and the validated plan.

A :class:`Variant` is one assignment (a preset, rules applied before it, config overrides); a
suite is a list of variants (:func:`preset_variants`, :func:`sweep_variants`,
:func:`bounded_variants`); :func:`plan` turns a suite, seeds and the shared config into a
:class:`StudyPlan` whose every run config has been built (and so validated, by
`geomtrain.config.TrainConfig.validate`) before anything trains.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "PRESET_ORDER",
    "SUITES",
    "LR_SWEEP_PRESETS",
    "LR_SWEEP_VALUES",
    "BOUNDED_REFERENCES",
    "DEFAULT_BOUNDS",
    "AUTOASSIGN_REFERENCES",
    "SUMMARY_FORMAT",
    "StudyError",
    "Variant",
    "StudyPlan",
    "format_value",
    "preset_variants",
    "swept_name",
    "sweep_variants",
    "bounded_variants",
    "solver_variants",
    "check_solver_names",
    "references_of",
    "CONSTRAINED_PRESETS",
    "parse_sweep",
    "parse_seeds",
    "shared_config",
    "plan",
    "TERMINAL_STATUSES",
]

PRESET_ORDER = ("adamw", "unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv")
SUITES = ("presets", "lr-sweep", "bounded", "autoassign")
LR_SWEEP_PRESETS = ("all-stiefel", "hetero", "hetero-inv", "all-dgram")
LR_SWEEP_VALUES = (0.02, 0.05, 0.1, 0.3)
BOUNDED_REFERENCES = ("all-stiefel", "all-dgram", "hetero", "hetero-inv")
DEFAULT_BOUNDS = (1.0, 2.0)
AUTOASSIGN_REFERENCES = ("all-stiefel", "hetero")
SUMMARY_FORMAT = 1  # version of the study.json / summary.json layout
TERMINAL_STATUSES = ("finished", "diverged", "failed")  # a run's status.json once it has ended for good


class StudyError(ValueError):
    """A user error of the study (bad input, a folder holding other settings): one line, exit 2."""


# ----------------------------------------------------------------------------- variants
@dataclass
class Variant:
    """One assignment to train: a preset, rules applied before it, config overrides.

    ``base`` groups variants of one family (a preset and its sweep values); ``sweep`` is
    ``{"key", "value"}`` for a swept variant; ``seeds`` and ``role`` mark a tuned study's
    selection runs (`geomtrain.study.tune`). Rule targets are manifold specs of the
    `manifolds` registry (``bdgram@1.5``, or a user's registered name)."""

    name: str
    preset: str
    rules: list[str] = field(default_factory=list)
    overrides: dict = field(default_factory=dict)
    label: str | None = None
    base: str | None = None
    sweep: dict | None = None
    seeds: list[int] | None = None  # its own seeds (a tuned study's selection runs); None: the study's
    role: str | None = None  # "select" for a tuning run (not in the results table), else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Variant:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def format_value(value) -> str:
    """A config value as it appears in folder names and labels (``0.1``, ``1e-05``, ``8``; a list
    joined by commas, ``max_iter=2,tol=1e-05``: no brackets or quotes in a folder name)."""
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def preset_variants(presets: Sequence[str]) -> list[Variant]:
    """One variant per preset, named after it."""
    return [Variant(p, p, base=p) for p in presets]


def swept_name(name: str, key: str, value, base_value=None) -> str:
    """Folder name of ``name`` at ``key=value``: unchanged at the shared value (so such a run is the
    very run of the plain variant, and can be reused), else ``<name>__<key>-<value>``."""
    return name if value == base_value else f"{name}__{key}-{format_value(value)}"


def sweep_variants(variants: Sequence[Variant], key: str, values: Sequence, base_value=None) -> list[Variant]:
    """Every variant at every value of the config field ``key``; ``base_value`` is the shared
    config's value (its variants keep their plain names)."""
    out = []
    for v in variants:
        for value in values:
            out.append(
                Variant(
                    swept_name(v.name, key, value, base_value),
                    v.preset,
                    rules=list(v.rules),
                    overrides={**v.overrides, key: value},
                    label=f"{v.label or v.name}, {key}={format_value(value)}",
                    base=v.base or v.name,
                    sweep={"key": key, "value": value},
                )
            )
    return out


CONSTRAINED_PRESETS = ("all-stiefel", "all-dgram", "hetero", "hetero-inv")


def solver_variants(variants: Sequence[Variant], solvers: Sequence[str]) -> list[Variant]:
    """Each variant once per Muon solver (``default``: the optimizer's per-kind default, named as
    the variant; another solver ``S``: ``NAME+S``). Presets with no Stiefel or DGram matrix are
    kept once: every solver gives them the same direction."""
    out = []
    for v in variants:
        for solver in solvers:
            if solver == "default":
                out.append(v)
            elif v.preset in CONSTRAINED_PRESETS or v.rules:
                name = f"{v.name}+{solver}"
                out.append(
                    dataclasses.replace(
                        v,
                        name=name,
                        overrides={**v.overrides, "muon_solver": solver},
                        label=f"{v.label or v.name} ({solver})",
                        base=name,
                    )
                )
    return out


def bounded_variants(bounds: Sequence[float], references: Sequence[str] = BOUNDED_REFERENCES) -> list[Variant]:
    """Bounded-DGram attention (``bdgram@B``) with Stiefel MLP and with DGram MLP, per bound,
    after the reference presets."""
    from ..assign import ATTENTION_GLOBS

    out = preset_variants(references)
    for mlp, preset in (("stiefel", "hetero-inv"), ("dgram", "all-dgram")):
        for b in bounds:
            rules = [f"{g}=bdgram@{b:g}" for g in ATTENTION_GLOBS]
            out.append(
                Variant(
                    f"bdgram{b:g}+{mlp}",
                    preset,
                    rules=rules,
                    base=f"bdgram{b:g}+{mlp}",
                    label=f"BDGram(b={b:g}) attn / {'Stiefel' if mlp == 'stiefel' else 'DGram'} MLP",
                )
            )
    return out


# ----------------------------------------------------------------------------- config text
def parse_sweep(text: str | None) -> tuple[str, list] | None:
    """``"muon_lr=0.02,0.05"`` -> ``("muon_lr", [0.02, 0.05])`` (values typed by
    `geomtrain.config.parse_value`); ``None`` for no sweep."""
    from ..config import parse_value

    if not text:
        return None
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not values.strip():
        raise StudyError(f"--sweep {text!r} must look like KEY=V1,V2,..., e.g. muon_lr=0.02,0.05")
    return key, [parse_value(key, v) for v in values.split(",") if v.strip()]


def parse_seeds(text: str, flag: str = "--seeds") -> list[int]:
    """``"3"`` -> [0, 1, 2]; ``"0,5,7"`` -> those seeds (each >= 0; ``flag`` names the option in errors)."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        else:
            n = int(text)
            if n < 1:
                raise ValueError
            seeds = list(range(n))
        if not seeds or min(seeds) < 0:
            raise ValueError
    except ValueError:
        raise StudyError(
            f"{flag} {text!r}: give a count >= 1 (3) or a comma-separated list of seeds >= 0 (0,1,2)"
        ) from None
    if len(set(seeds)) != len(seeds):
        raise StudyError(f"{flag} {text!r} repeats a seed")
    return seeds


def shared_config(
    model: str,
    iters: int | None,
    data_dir: str,
    device: str = "auto",
    toml: dict | None = None,
    sets: dict | None = None,
) -> dict:
    """The config fields every variant shares (before its preset, rules and overrides)."""
    from ..config import MODEL_DEFAULTS, TrainConfig

    iters = iters or MODEL_DEFAULTS.get(model, {}).get("max_iters", TrainConfig.max_iters)
    base = {
        "model": model,
        "data_dir": str(data_dir),
        "max_iters": int(iters),
        "warmup_iters": max(1, iters // 10),
        "eval_interval": max(1, iters // 20),
        "device": device,
        "diagnostics": True,
    }
    base.update(toml or {})
    base.update(sets or {})
    return base


# ----------------------------------------------------------------------------- the plan
@dataclass
class StudyPlan:
    """Everything a study invocation does: where, which variants, which seeds, which config."""

    out: Path
    runs_dir: Path
    suite: str
    variants: list[Variant]
    seeds: list[int]
    base: dict
    argv: list[str] = field(default_factory=list)
    options: dict = field(default_factory=dict)

    def run_dir(self, variant: Variant, seed: int) -> Path:
        return self.runs_dir / variant.name / f"s{seed}"

    def config(self, variant: Variant, seed: int):
        """The `TrainConfig` of one run; ``StudyError`` naming the variant on a bad value."""
        from ..config import make_config

        values = {
            **self.base,
            **variant.overrides,
            "preset": variant.preset,
            "rules": list(variant.rules),
            "seed": seed,
            "out_dir": str(self.run_dir(variant, seed)),
            "progress": False,
        }
        try:
            return make_config(values)
        except (ValueError, TypeError) as exc:
            raise StudyError(f"variant {variant.name}: {exc}") from None

    def validate(self) -> StudyPlan:
        """Build every run's config (the one validation site: `TrainConfig.validate`); return self."""
        for v in self.variants:
            for s in self.seeds:
                self.config(v, s)
        return self


def _shared(base: dict):
    """The shared config as a `TrainConfig` (the model's defaults filled in); ``StudyError`` when
    it is invalid, before any variant is looked at."""
    from ..config import make_config

    try:
        return make_config({k: v for k, v in base.items() if k not in ("preset", "rules")})
    except (ValueError, TypeError) as exc:
        raise StudyError(str(exc)) from None


def _suite_variants(
    suite: str, presets: Sequence[str] | None, sweep: tuple | None, bounds: Sequence[float] | None
) -> tuple[list[Variant], tuple | None]:
    """The variants of ``suite`` (before a sweep) and the sweep it runs."""
    if suite not in SUITES:
        raise StudyError(f"unknown suite {suite!r}; valid: {', '.join(SUITES)}")
    if suite == "lr-sweep":
        return preset_variants(list(presets or LR_SWEEP_PRESETS)), sweep or ("muon_lr", list(LR_SWEEP_VALUES))
    if suite == "bounded":
        bounds = list(bounds or DEFAULT_BOUNDS)
        if any(not (b > 0) for b in bounds):
            raise StudyError(f"--bounds must be numbers > 0; got {bounds}")
        return bounded_variants(bounds, list(presets if presets is not None else BOUNDED_REFERENCES)), sweep
    if suite == "autoassign":  # the policy's variant is added when the probes are done (run_study)
        if sweep:
            raise StudyError("--sweep does not combine with --suite autoassign")
        return preset_variants(list(presets or AUTOASSIGN_REFERENCES)), None
    return preset_variants(list(presets or PRESET_ORDER)), sweep


def plan(
    out: str | Path,
    suite: str = "presets",
    presets: Sequence[str] | None = None,
    sweep: tuple | None = None,
    bounds: Sequence[float] | None = None,
    seeds: Sequence[int] = (0,),
    base: dict | None = None,
    runs_dir: str | Path | None = None,
    argv: Sequence[str] = (),
    options: dict | None = None,
    solvers: Sequence[str] | None = None,
) -> StudyPlan:
    """Build and validate a study: every run's config is made (and checked) before anything trains.

    ``solvers``: one arm per Muon solver (`solver_variants`). ``options["tune"]``: a tuning
    protocol (`geomtrain.study.tune`, whose `validate_selection` checks its runs)."""
    base = dict(base or {})
    variants, sweep = _suite_variants(suite, presets, sweep, bounds)
    shared = _shared(base)
    if solvers:
        variants = solver_variants(variants, _checked_solvers(solvers))
    if sweep:
        key, values = sweep
        variants = sweep_variants(variants, key, values, getattr(shared, key, base.get(key)))
    out = Path(out)
    options = dict(options or {})
    if options.get("reference"):
        _check_reference([v.name for v in variants], options["reference"])
    if options.get("tune"):
        if sweep or suite != "presets":
            raise StudyError("--tune runs on the presets suite without --sweep (it sweeps on its own)")
    return StudyPlan(
        out=out,
        runs_dir=Path(runs_dir) if runs_dir else out / "runs",
        suite=suite,
        variants=variants,
        seeds=list(seeds),
        base=base,
        argv=list(argv),
        options=options,
    ).validate()


def _reference_parts(reference: str) -> list[str]:
    return [r.strip() for r in reference.split(",") if r.strip()]


def references_of(names: list[str], reference: str) -> list[tuple[str, str]]:
    """``(arm, reference)`` pairs for a ``--reference`` text: an arm's name (every other arm
    against it), ``+SOLVER`` (each arm ``P`` against ``P+SOLVER``), or several, comma-separated."""
    pairs = []
    for ref in _reference_parts(reference):
        if ref.startswith("+"):
            pairs += [(n, n + ref) for n in names if n + ref in names]
        elif ref in names:
            pairs += [(n, ref) for n in names if n != ref]
    return list(dict.fromkeys(pairs))


def _check_reference(names: list[str], reference: str) -> None:
    """``StudyError`` for a part of ``--reference`` that pairs no arm (the study would end without comparisons)."""
    for ref in _reference_parts(reference):
        if not references_of(names, ref):
            raise StudyError(
                f"--reference {ref!r} pairs no arm of this study; valid: one of {', '.join(names)}, "
                "or +SOLVER for a solver of --solvers (comma-separated for several)"
            )


def check_solver_names(solvers: Sequence[str]) -> None:
    """``StudyError`` naming the valid ones for a name that is neither ``default`` nor a registered solver."""
    from ..optim import SOLVERS

    for x in solvers:
        if x != "default" and x not in SOLVERS:
            raise StudyError(f"unknown solver {x!r}; valid: default, {', '.join(SOLVERS)}")


def _checked_solvers(solvers: Sequence[str]) -> list[str]:
    check_solver_names(solvers)
    if len(set(solvers)) != len(solvers):
        raise StudyError(f"--solvers repeats a solver: {','.join(solvers)}")
    return list(solvers)
