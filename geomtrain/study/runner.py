r"""The module-wise manifold study: many training runs that differ only in their assignment.

``geomtrain study`` trains every *variant* of a *suite* for every seed, with identical data,
schedule and hyperparameters, into ``RUNS_DIR/<variant>/s<seed>`` (a normal run folder of
:func:`geomtrain.train.train`), then writes the report into ``OUT``:

=================  ===========================================================================
``study.json``     command line, suite, variants, seeds, the shared config, environment, data
                   manifest, wall time per run
``summary.json``   per run: status, losses, ms/step, eval curve, training loss and the
                   per-evaluation diagnostics (per layer); per variant: the table row. The
                   figures and tables are rebuilt from this file alone.
``results.csv``    one row per variant: final and best val loss (mean, std over seeds), stable /
``results.md``     diverged (with steps), ms per step and its ratio to ``adamw`` / ``unconstrained``
``*.png``          :mod:`geomtrain.plots`: ``val_loss``, ``sigma_max``, ``attention``,
                   ``overhead``, ``mechanism`` (when some variant has DGram attention), ``sweep``
=================  ===========================================================================

Suites (``--suite``):

- ``presets`` (default): the six presets ``adamw, unconstrained, all-stiefel, all-dgram,
  hetero, hetero-inv`` (or ``--presets``).
- ``lr-sweep``: ``all-stiefel, hetero, hetero-inv, all-dgram`` x ``muon_lr`` in
  :data:`LR_SWEEP_VALUES`: where does DGram attention become unstable?
- ``bounded``: attention on :class:`manifolds.BoundedDGram` (``bdgram@B``, column norms
  at most ``B``, for each ``--bounds`` value) with Stiefel MLP and with DGram MLP, next to
  ``all-stiefel, all-dgram, hetero, hetero-inv``: does a scale bound remove the instability?
- ``autoassign``: the policy of :mod:`geomtrain.autoassign` picks a manifold per module group
  from short probe runs; its choice is then trained next to ``hetero`` and ``all-stiefel``.

``--sweep KEY=V1,V2`` runs every variant of a suite at every value of a config key. A variant at
the shared config's value keeps its plain folder name (others get ``__KEY-VALUE``), so suites
that share ``--runs-dir`` reuse each other's identical runs instead of training them twice: a
run is skipped whenever its folder already holds a finished run with the same config.

The study is **resumable**: a finished (or diverged) run whose folder holds the same config is
skipped, an interrupted one continues from its checkpoint; a folder holding a run with other
settings is an error (use another ``--out``). Ctrl-C stops after the current step; run the same
command again to continue. ``geomtrain report OUT`` rebuilds tables and figures from the runs
(or, without them, from ``summary.json``). ``geomtrain study toy --out DIR`` runs the controlled
single-layer attention demonstration (:func:`toy_attention`); ``geomtrain study overhead --out
DIR`` measures the step time of every preset and Muon solver interleaved in one process
(:func:`measure_overhead`), which a busy shared machine distorts far less than per-run timings.

Shared settings: the model's defaults (:data:`geomtrain.config.MODEL_DEFAULTS`) with
``max_iters = --iters``, ``warmup_iters = iters // 10``, ``eval_interval = iters // 20``; a
``--config FILE.toml`` and ``--set KEY=VALUE`` override them, identically for every variant.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import os
import shlex
import sys
import time
import traceback
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = [
    "PRESET_ORDER", "SUITES", "LR_SWEEP_VALUES", "Variant", "StudyError", "preset_variants",
    "sweep_variants", "bounded_variants", "plan", "run_study", "collect", "write_report",
    "report", "toy_attention", "load_summary", "measure_overhead", "main",
]

PRESET_ORDER = ("adamw", "unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv")
SUITES = ("presets", "lr-sweep", "bounded", "autoassign")
LR_SWEEP_PRESETS = ("all-stiefel", "hetero", "hetero-inv", "all-dgram")
LR_SWEEP_VALUES = (0.02, 0.05, 0.1, 0.3)
BOUNDED_REFERENCES = ("all-stiefel", "all-dgram", "hetero", "hetero-inv")
DEFAULT_BOUNDS = (1.0, 2.0)
AUTOASSIGN_REFERENCES = ("all-stiefel", "hetero")
_IGNORED_CONFIG_KEYS = ("progress", "stop_after", "out_dir")
_TERMINAL = ("finished", "diverged", "failed")
SUMMARY_FORMAT = 1


class StudyError(Exception):
    """A user error: printed as one line, exit code 2."""


# ----------------------------------------------------------------------------- variants
@dataclass
class Variant:
    """One assignment to train: a preset, rules applied before it, config overrides.

    ``base`` groups variants of one family (a preset and its sweep values); ``sweep`` is
    ``{"key", "value"}`` for a swept variant."""

    name: str
    preset: str
    rules: list[str] = field(default_factory=list)
    overrides: dict = field(default_factory=dict)
    label: str | None = None
    base: str | None = None
    sweep: dict | None = None

    def custom_manifolds(self) -> dict:
        """Manifold instances for the ``bdgram@B`` targets its rules use."""
        from manifolds import get_manifold

        from ..assign import parse_rule

        out = {}
        for text in self.rules:
            target = str(parse_rule(text).target)
            if target.lower().startswith("bdgram@"):
                out[target.lower()] = get_manifold(target)
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Variant":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _fmt(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def preset_variants(presets: Sequence[str]) -> list[Variant]:
    """One variant per preset, named after it."""
    return [Variant(p, p, base=p) for p in presets]


def swept_name(name: str, key: str, value, base_value=None) -> str:
    """Folder name of ``name`` at ``key=value``: unchanged at the shared value (so such a run is the
    very run of the plain variant, and can be reused), else ``<name>__<key>-<value>``."""
    return name if value == base_value else f"{name}__{key}-{_fmt(value)}"


def sweep_variants(variants: Sequence[Variant], key: str, values: Sequence, base_value=None) -> list[Variant]:
    """Every variant at every value of the config field ``key``; ``base_value`` is the shared
    config's value (its variants keep their plain names)."""
    out = []
    for v in variants:
        for value in values:
            out.append(Variant(swept_name(v.name, key, value, base_value), v.preset, rules=list(v.rules),
                               overrides={**v.overrides, key: value}, label=f"{v.label or v.name}, {key}={_fmt(value)}",
                               base=v.base or v.name, sweep={"key": key, "value": value}))
    return out


def bounded_variants(bounds: Sequence[float], references: Sequence[str] = BOUNDED_REFERENCES) -> list[Variant]:
    """Bounded-DGram attention (``bdgram@B``) with Stiefel MLP and with DGram MLP, per bound,
    after the reference presets."""
    from ..assign import ATTENTION_GLOBS

    out = preset_variants(references)
    for mlp, preset in (("stiefel", "hetero-inv"), ("dgram", "all-dgram")):
        for b in bounds:
            rules = [f"{g}=bdgram@{b:g}" for g in ATTENTION_GLOBS]
            out.append(Variant(f"bdgram{b:g}+{mlp}", preset, rules=rules, base=f"bdgram{b:g}+{mlp}",
                               label=f"BDGram(b={b:g}) attn / {'Stiefel' if mlp == 'stiefel' else 'DGram'} MLP"))
    return out


# ----------------------------------------------------------------------------- config
def _field_types() -> dict[str, Any]:
    from ..config import TrainConfig

    return typing.get_type_hints(TrainConfig)


def _coerce(key: str, text: str):
    """Parse ``text`` for the TrainConfig field ``key`` (int, float, bool, str, optional, list)."""
    from ..config import TrainConfig

    hints = _field_types()
    if key not in hints:
        valid = ", ".join(f.name for f in dataclasses.fields(TrainConfig))
        raise StudyError(f"unknown config key {key!r} in --set; valid: {valid}")
    hint = hints[key]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    kind = args[0] if args and typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    if optional and text.lower() in ("none", "null", ""):
        return None
    if typing.get_origin(kind) is list or kind is list:
        return [t for t in text.split(";") if t]
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise StudyError(f"bad value {text!r} for {key} (expects {getattr(kind, '__name__', kind)})") from None
    return text


def parse_sets(items: Sequence[str]) -> dict:
    """``["muon_lr=0.05", "batch_size=8"]`` -> typed overrides (dashes in keys allowed)."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise StudyError(f"--set {item!r} must look like KEY=VALUE, e.g. muon_lr=0.05")
        key = key.strip().replace("-", "_")
        out[key] = _coerce(key, value.strip())
    return out


def _parse_sweep(text: str | None):
    if not text:
        return None
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not values.strip():
        raise StudyError(f"--sweep {text!r} must look like KEY=V1,V2,..., e.g. muon_lr=0.02,0.05")
    parsed = [_coerce(key, v.strip()) for v in values.split(",") if v.strip()]
    return key, parsed


def _parse_seeds(text: str) -> list[int]:
    """``"3"`` -> [0, 1, 2]; ``"0,5,7"`` -> those seeds."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        else:
            n = int(text)
            if n < 1:
                raise ValueError
            seeds = list(range(n))
    except ValueError:
        raise StudyError(f"--seeds {text!r}: give a count >= 1 (3) or a comma-separated list of seeds (0,1,2)") from None
    if len(set(seeds)) != len(seeds):
        raise StudyError(f"--seeds {text!r} repeats a seed")
    return seeds


def shared_config(model: str, iters: int | None, data_dir: str, device: str = "auto", toml: dict | None = None,
                  sets: dict | None = None) -> dict:
    """The config fields every variant shares (before its preset, rules and overrides)."""
    from ..config import MODEL_DEFAULTS, TrainConfig

    iters = iters or MODEL_DEFAULTS.get(model, {}).get("max_iters", TrainConfig.max_iters)
    base = {"model": model, "data_dir": str(data_dir), "max_iters": int(iters), "warmup_iters": max(1, iters // 10),
            "eval_interval": max(1, iters // 20), "device": device, "diagnostics": True}
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
        """``(TrainConfig, custom_manifolds)`` of one run; ``StudyError`` on a bad value."""
        from ..config import make_config

        custom = variant.custom_manifolds()
        values = {**self.base, **variant.overrides, "preset": variant.preset, "rules": list(variant.rules),
                  "seed": seed, "out_dir": str(self.run_dir(variant, seed)), "progress": False}
        try:
            return make_config(values, custom_names=tuple(custom)), custom
        except (ValueError, TypeError) as exc:
            raise StudyError(f"variant {variant.name}: {exc}") from None


def _shared_value(base: dict, key: str):
    """The value of ``key`` in the shared config (after the model's defaults)."""
    from ..config import make_config

    try:
        return getattr(make_config({k: v for k, v in base.items() if k not in ("preset", "rules")}), key)
    except (ValueError, TypeError, AttributeError):
        return base.get(key)


def plan(out: str | Path, suite: str = "presets", presets: Sequence[str] | None = None, sweep: tuple | None = None,
         bounds: Sequence[float] | None = None, seeds: Sequence[int] = (0,), base: dict | None = None,
         runs_dir: str | Path | None = None, argv: Sequence[str] = (), options: dict | None = None) -> StudyPlan:
    """Build and validate a study: every run's config is made (and checked) before anything trains."""
    from ..assign import PRESETS

    if suite not in SUITES:
        raise StudyError(f"unknown suite {suite!r}; valid: {', '.join(SUITES)}")
    for p in presets or ():
        if p not in PRESETS:
            raise StudyError(f"unknown preset {p!r}; valid: {', '.join(PRESETS)}")
    if suite == "lr-sweep":
        sweep = sweep or ("muon_lr", list(LR_SWEEP_VALUES))
        variants = preset_variants(list(presets or LR_SWEEP_PRESETS))
    elif suite == "bounded":
        bounds = list(bounds or DEFAULT_BOUNDS)
        if any(not (b > 0) for b in bounds):
            raise StudyError(f"--bounds must be numbers > 0; got {bounds}")
        variants = bounded_variants(bounds, list(presets if presets is not None else BOUNDED_REFERENCES))
    elif suite == "autoassign":  # the policy's variant is added when the probes are done (run_study)
        if sweep:
            raise StudyError("--sweep does not combine with --suite autoassign")
        variants = preset_variants(list(presets or AUTOASSIGN_REFERENCES))
    else:
        variants = preset_variants(list(presets or PRESET_ORDER))
    if sweep:
        key, values = sweep
        variants = sweep_variants(variants, key, values, _shared_value(base or {}, key))
    out = Path(out)
    study = StudyPlan(out=out, runs_dir=Path(runs_dir) if runs_dir else out / "runs", suite=suite, variants=variants,
                      seeds=list(seeds), base=dict(base or {}), argv=list(argv), options=dict(options or {}))
    for v in study.variants:
        for s in study.seeds:
            study.config(v, s)
    return study


# ----------------------------------------------------------------------------- running
def _read_json(path: Path, default=None):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def _write_json(path: Path, obj, compact: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(obj, separators=(",", ":"), default=_json_default) if compact else json.dumps(obj, indent=2, default=_json_default)
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _config_diff(old: dict, new: dict) -> list[str]:
    keys = sorted((set(old) | set(new)) - set(_IGNORED_CONFIG_KEYS))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def run_state(run_dir: Path, cfg) -> str:
    """``new``, ``resume`` or ``done`` for the run folder; ``StudyError`` when it holds other settings."""
    status = _read_json(run_dir / "status.json")
    old = _read_json(run_dir / "config.json")
    if old is not None:
        diff = _config_diff(old, cfg.to_dict())
        if diff:
            raise StudyError(f"{run_dir} holds a run with other settings ({'; '.join(diff[:3])}); "
                             "use another --out / --runs-dir or delete that folder")
    if status is None:
        return "new"
    if status.get("status") in _TERMINAL and (status.get("status") != "finished" or status.get("step", 0) >= cfg.max_iters):
        return "done"
    return "resume" if (run_dir / "ckpt.pt").exists() else "new"


def _last_logged_step(run_dir: Path) -> int:
    step = 0
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                step = max(step, int(json.loads(line).get("step", 0)))
            except ValueError:
                continue
    return step


class RunLock:
    """``run_dir/.lock`` (holding the PID) while a process trains that run: studies sharing a
    ``--runs-dir`` never train the same run twice at once. A lock whose process is gone is stale
    and taken over."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self.held = False

    def acquire(self) -> int | None:
        """Take the lock; return ``None`` on success, else the PID of the live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".lock.{os.getpid()}")
        tmp.write_text(str(os.getpid()))
        try:
            return self._acquire(tmp)
        finally:
            tmp.unlink(missing_ok=True)

    def _acquire(self, tmp: Path) -> int | None:
        for _ in range(2):
            try:
                os.link(tmp, self.path)  # atomic: fails if the lock exists, and never holds a partial PID
            except FileExistsError:
                try:
                    pid = int(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and pid != os.getpid() and _alive(pid):
                    return pid
                self.path.unlink(missing_ok=True)  # stale
                continue
            self.held = True
            return None
        return -1

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def train_one(cfg, custom: dict, state: str, print_fn=print) -> dict:
    """Run (or resume) one training run; a numerical exception after the first step is recorded
    as status ``failed`` (with the error) instead of stopping the study."""
    from ..train import train

    run_dir = cfg.resolved_out_dir()
    if state == "new":  # a fresh start: leftovers of a killed attempt would duplicate records
        for name in ("metrics.jsonl", "diagnostics.jsonl", "status.json"):
            (run_dir / name).unlink(missing_ok=True)
    try:
        return train(cfg, resume=state == "resume", custom_manifolds=custom or None, print_fn=lambda *a, **k: None)
    except (ValueError, RuntimeError, FloatingPointError) as exc:
        step = _last_logged_step(run_dir)
        if step == 0:
            raise
        traceback.print_exc(file=sys.stderr)
        status = {"status": "failed", "step": step, "failed_step": step, "reason": f"{type(exc).__name__}: {exc}".splitlines()[0],
                  "best_val_loss": None, "last_val_loss": None}
        old = _read_json(run_dir / "status.json", {}) or {}
        status["best_val_loss"] = old.get("best_val_loss")
        _write_json(run_dir / "status.json", status)
        print_fn(f"  run failed at step ~{step}: {status['reason']}")
        return status


def _environment(device: str) -> dict:
    import torch

    from ..train import environment_info, resolve_device

    info = environment_info(resolve_device(device), seed=-1)
    info.pop("seed", None)
    info["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    info["torch_threads"] = torch.get_num_threads()
    return info


def _data_info(data_dir: str) -> dict:
    from .. import data as gdata

    m = gdata.load_manifest(data_dir)
    keep = ("dataset", "tokenizer", "vocab_size", "eot_token", "format_version", "source_fingerprint")
    info = {k: m.get(k) for k in keep}
    info["splits"] = {k: {"tokens": v.get("tokens"), "sha256": v.get("sha256")} for k, v in m.get("splits", {}).items()}
    return info


def _study_record(study: StudyPlan, previous: dict | None) -> dict:
    device = study.base.get("device", "auto")
    prev = previous or {}
    return {
        "format": SUMMARY_FORMAT,
        "command": "geomtrain study " + shlex.join(study.argv) if study.argv else prev.get("command"),
        "argv": study.argv or prev.get("argv"),
        "cwd": os.getcwd(),
        "suite": study.suite,
        "options": study.options,
        "variants": [v.to_dict() for v in study.variants],
        "seeds": study.seeds,
        "base_config": study.base,
        "runs_dir": str(study.runs_dir),
        "runs_dir_abs": str(study.runs_dir.resolve()),
        "created": prev.get("created") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": _environment(device),
        "data": _data_info(study.base["data_dir"]),
        "timing": prev.get("timing", {"runs": {}, "total_s": 0.0}),
        "invocations": prev.get("invocations", []) + [{"argv": study.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}],
        **({"autoassign": prev["autoassign"]} if "autoassign" in prev else {}),
    }


def _check_previous(study: StudyPlan, previous: dict | None) -> None:
    if not previous:
        return
    old = dict(previous.get("base_config", {}))
    diff = _config_diff(old, study.base)
    if diff or previous.get("suite") != study.suite:
        what = "; ".join(diff[:3]) or f"suite {previous.get('suite')} -> {study.suite}"
        raise StudyError(f"{study.out} holds a study with other settings ({what}); use another --out")


def ensure_data(data_dir: str | Path, tokenizer: str | None, dataset: str = "classics", print_fn=print) -> None:
    """Prepare ``data_dir`` (offline corpus) when it does not verify and ``tokenizer`` is given."""
    from .. import data as gdata

    problems = gdata.verify(data_dir, check_hashes=False) if Path(data_dir).exists() else ["missing"]
    if not problems:
        return
    if tokenizer is None:
        raise StudyError(f"data in {data_dir} is not usable ({problems[0]}); run `geomtrain prepare` or pass --tokenizer")
    print_fn(f"preparing {dataset} with tokenizer {tokenizer} in {data_dir} ...")
    gdata.prepare(data_dir, dataset=dataset, tokenizer=tokenizer)


def run_study(study: StudyPlan, print_fn: Callable = print, report_after: bool = True, drop_checkpoints: bool = False,
              workers: int = 1, threads: int | None = None) -> int:
    """Train every (variant, seed) not already done, then write the report. Returns an exit code
    (0 done, 130 interrupted).

    ``workers > 1`` trains that many runs at once, each in its own process with ``threads`` torch
    threads (default: CPU count // workers). Every run is seeded and independent, so the results
    are the same as with one worker; only ms/step reflects the shared machine.
    """
    study.out.mkdir(parents=True, exist_ok=True)
    study_path = study.out / "study.json"
    previous = _read_json(study_path)
    _check_previous(study, previous)
    record = _study_record(study, previous)
    _write_json(study_path, record)
    t_start = t_invocation = time.time()

    if study.suite == "autoassign":
        from .autoassign import propose

        opts = study.options
        granularity = opts.get("granularity", "module")
        try:
            result = propose(study.base, study.runs_dir / "_probes" / f"{granularity}-s{study.seeds[0]}", seed=study.seeds[0],
                             probe_iters=opts.get("probe_iters"), granularity=granularity,
                             print_fn=print_fn)
        except KeyboardInterrupt:
            print_fn("interrupted during the probes: run the same command again to continue")
            return 130
        _write_json(study.out / "autoassign.json", result)
        record["autoassign"] = {k: result[k] for k in ("choice", "rules", "matches_preset", "probe_steps")}
        record["timing"]["total_s"] = record["timing"].get("total_s", 0.0) + (time.time() - t_start)
        t_start = time.time()
        study.variants = _with_auto_variant(study.variants, result)
        record["variants"] = [v.to_dict() for v in study.variants]
        for s in study.seeds:
            for v in study.variants:
                study.config(v, s)
        _write_json(study_path, record)

    jobs = [(v, s) for s in study.seeds for v in study.variants]
    if study.suite != "presets":  # plain preset runs may be shared with a presets study: do them last
        from ..assign import PRESETS

        jobs.sort(key=lambda job: job[0].name in PRESETS)
    if workers > 1:
        code = _run_parallel(study, jobs, record, workers, threads, print_fn, drop_checkpoints)
    else:
        code = _run_sequential(study, jobs, record, print_fn, drop_checkpoints)
    record["timing"]["elapsed_s"] = record["timing"].get("elapsed_s", 0.0) + (time.time() - t_invocation)
    record["timing"].setdefault("workers", []).append(workers)
    _write_json(study_path, record)
    if report_after:
        summary = collect(study.out)
        written = write_report(summary, study.out)
        print_fn(format_table(summary["table"]))
        print_fn(f"report: {', '.join(p.name for p in written)} in {study.out}")
    return code


def _claimed_runs(study: StudyPlan, jobs: list, print_fn: Callable):
    """Yield ``(v, seed, tag, cfg, custom, state, lock)`` for each job that still needs training,
    its lock held; done runs and runs another process is training are reported and passed over.
    Lazy, so a run is claimed only when a worker is free for it."""
    for i, (v, seed) in enumerate(jobs, 1):
        tag = f"[{i}/{len(jobs)}] {v.name} seed {seed}"
        cfg, custom = study.config(v, seed)
        run_dir = study.run_dir(v, seed)
        if run_state(run_dir, cfg) == "done":
            print_fn(f"{tag}: already {_read_json(run_dir / 'status.json', {}).get('status')} (skipped)")
            continue
        lock = RunLock(run_dir)
        holder = lock.acquire()
        if holder is not None:
            print_fn(f"{tag}: being trained by another process (pid {holder}); skipped, rerun later to include it")
            continue
        state = run_state(run_dir, cfg)  # again, now that the folder is ours
        if state == "done":
            lock.release()
            continue
        print_fn(f"{tag}: {'resuming' if state == 'resume' else 'training'} ...")
        yield v, seed, tag, cfg, custom, state, lock


def _record_run(study: StudyPlan, record: dict, v: Variant, seed: int, tag: str, status: dict, wall: float,
                print_fn: Callable, drop_checkpoints: bool) -> None:
    key = f"{v.name}/s{seed}"
    record["timing"]["runs"][key] = record["timing"]["runs"].get(key, 0.0) + wall
    record["timing"]["total_s"] = record["timing"].get("total_s", 0.0) + wall
    record["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _write_json(study.out / "study.json", record)
    print_fn(f"{tag}: {_status_line(status)} in {wall:.0f} s")
    if drop_checkpoints and status.get("status") in _TERMINAL:
        (study.run_dir(v, seed) / "ckpt.pt").unlink(missing_ok=True)


def _interrupted(status: dict, cfg) -> bool:
    return status.get("status") == "interrupted" and cfg.stop_after is None


def _silent(*args, **kwargs) -> None:
    pass


def _train_timed(cfg, custom: dict, state: str, print_fn: Callable = _silent) -> tuple[dict, float]:
    """``train_one`` and its wall time (module level, so a worker process can run it)."""
    t0 = time.time()
    status = train_one(cfg, custom, state, print_fn)
    return status, time.time() - t0


def _run_sequential(study: StudyPlan, jobs: list, record: dict, print_fn: Callable, drop_checkpoints: bool) -> int:
    try:
        for v, seed, tag, cfg, custom, state, lock in _claimed_runs(study, jobs, print_fn):
            try:
                status, wall = _train_timed(cfg, custom, state, print_fn)
            finally:
                lock.release()
            _record_run(study, record, v, seed, tag, status, wall, print_fn, drop_checkpoints)
            if _interrupted(status, cfg):
                print_fn("interrupted: run the same command again to continue")
                return 130
    except KeyboardInterrupt:
        print_fn("interrupted: run the same command again to continue")
        return 130
    return 0


def _threads_per_worker(workers: int) -> int:
    """Default torch threads of each of ``workers`` parallel runs: the CPU count shared out."""
    return max(1, (os.cpu_count() or 1) // workers)


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _run_parallel(study: StudyPlan, jobs: list, record: dict, workers: int, threads: int | None,
                  print_fn: Callable, drop_checkpoints: bool) -> int:
    """Up to ``workers`` runs at once in spawned processes; locks and the record stay here."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    claims = _claimed_runs(study, jobs, print_fn)
    running: dict = {}
    code = 0
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_init, initargs=(threads or _threads_per_worker(workers),))
    try:
        while True:
            while len(running) < workers and code == 0:
                claim = next(claims, None)
                if claim is None:
                    break
                v, seed, tag, cfg, custom, state, lock = claim
                try:
                    future = pool.submit(_train_timed, cfg, custom, state)
                except BaseException:
                    lock.release()
                    raise
                running[future] = (v, seed, tag, cfg, lock)
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                v, seed, tag, cfg, lock = running.pop(future)
                lock.release()
                try:
                    status, wall = future.result()
                except BrokenProcessPool:  # a worker died (Ctrl-C between runs, out of memory)
                    print_fn(f"{tag}: its worker process died; rerun the same command to continue")
                    code = code or 130
                    continue
                _record_run(study, record, v, seed, tag, status, wall, print_fn, drop_checkpoints)
                if _interrupted(status, cfg):
                    code = 130
    except KeyboardInterrupt:  # the workers got the signal too: they checkpoint and return
        code = 130
        for future, (v, seed, tag, cfg, lock) in running.items():
            try:
                status, wall = future.result()
                _record_run(study, record, v, seed, tag, status, wall, print_fn, drop_checkpoints)
            except (KeyboardInterrupt, BrokenProcessPool):  # a second Ctrl-C, or the worker died
                pass
            finally:
                lock.release()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if code:
        print_fn("interrupted: run the same command again to continue")
    return code


def _status_line(status: dict) -> str:
    st = status.get("status")
    ms = status.get("ms_per_step")
    ms_text = f", {ms:.0f} ms/step" if ms else ""
    if st == "finished":
        return f"finished, val loss {status.get('final_val_loss', float('nan')):.4f}{ms_text}"
    if st == "diverged":
        return f"DIVERGED at step {status.get('diverged_step')} ({status.get('reason')}){ms_text}"
    return f"{st} at step {status.get('step')}{ms_text}"


def _with_auto_variant(variants: list[Variant], result: dict) -> list[Variant]:
    match = result.get("matches_preset")
    out = list(variants)
    if match:
        names = [v.name for v in out]
        if match not in names:
            out.append(Variant(match, match, base=match))
        for v in out:
            if v.name == match:
                v.label = f"{match} (= auto choice)"
        return out
    out.append(Variant("auto", "adamw", rules=list(result["rules"]), base="auto",
                       label="auto: " + ", ".join(f"{g} {m}" for g, m in result["choice"].items())))
    return out


# ----------------------------------------------------------------------------- collecting
def _round(x, digits: int = 5):
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return [_round(v, digits) for v in x]
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        return float(f"{x:.{digits}g}")
    return x


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _manifold_of(assignment: list[dict], suffix: str) -> str | None:
    for a in assignment or []:
        if a["name"].endswith(suffix):
            return a.get("manifold") or a.get("optimizer")
    return None


def read_run(run_dir: Path, max_train_points: int = 100) -> dict:
    """Everything the report needs from one run folder, compact (losses to 5 significant digits,
    diagnostics to 4)."""
    status = _read_json(run_dir / "status.json", {}) or {}
    assignment = _read_json(run_dir / "assignment.json", [])
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    evals = [m for m in metrics if m.get("kind") == "eval"]
    trains = [m for m in metrics if m.get("kind") == "train"]
    stride = max(1, math.ceil(len(trains) / max_train_points))
    ms = [m["ms_per_step"] for m in trains if m.get("ms_per_step") is not None]
    diag_records = _read_jsonl(run_dir / "diagnostics.jsonl")
    n_layer = 0
    for d in diag_records:
        for m in d.get("matrices", []):
            if m.get("layer") is not None:
                n_layer = max(n_layer, m["layer"] + 1)
        n_layer = max(n_layer, len(d.get("attention", [])))
    kinds = ("attn_in", "attn_q", "attn_k", "attn_out", "mlp_in", "mlp_out")
    diag = {"step": [], "sigma_max": {k: [] for k in kinds}, "grad_norm": {k: [] for k in kinds},
            "attention": {k: [] for k in ("max_abs_logit", "mean_entropy", "saturated_frac", "jacobian_norm")}}
    for d in diag_records:
        diag["step"].append(d["step"])
        per = {k: {f: [None] * n_layer for f in ("sigma_max", "grad_norm")} for k in kinds}
        for m in d.get("matrices", []):
            k, layer = m.get("kind"), m.get("layer")
            if k in per and layer is not None:
                for f in ("sigma_max", "grad_norm"):
                    per[k][f][layer] = m.get(f)
        for k in kinds:
            for f in ("sigma_max", "grad_norm"):
                diag[f][k].append(_round(per[k][f], 4))
        att = sorted(d.get("attention", []), key=lambda a: a.get("layer", 0))
        for f in diag["attention"]:
            diag["attention"][f].append(_round([a.get(f) for a in att], 4))
    keep = {"sigma_max": ("attn_q", "attn_k", "attn_out", "mlp_in", "mlp_out"), "grad_norm": ("attn_q", "attn_k")}
    for f in ("sigma_max", "grad_norm"):  # what the figures and tables use (keeps summary.json small)
        diag[f] = {k: v for k, v in diag[f].items() if k in keep[f] and any(any(x is not None for x in row) for row in v)}
    st = status.get("status", "missing")
    muon = [m["muon"] for m in trains if isinstance(m.get("muon"), dict)]
    skipped = max((m.get("n_skipped_nonfinite_total") or 0 for m in muon), default=None)
    return {
        "status": st,
        "step": status.get("step"),
        "diverged_step": status.get("diverged_step") if st == "diverged" else (status.get("failed_step") if st == "failed" else None),
        "reason": status.get("reason"),
        "final_val": _round(status.get("final_val_loss")) if st == "finished" else None,
        "best_val": _round(status.get("best_val_loss")),
        "last_val": _round(status.get("last_val_loss")),
        "ms_per_step": _round(float(np.median(ms)) if ms else status.get("ms_per_step")),
        "skipped_updates": skipped,
        "attn": _manifold_of(assignment, "attn.c_attn.weight"),
        "mlp": _manifold_of(assignment, "mlp.c_fc.weight"),
        "eval": {"step": [m["step"] for m in evals], "val": _round([m.get("val_loss") for m in evals])},
        "train": {"step": [m["step"] for m in trains[::stride]], "loss": _round([m.get("loss") for m in trains[::stride]])},
        "diag": diag,
    }


def _resolve_runs_dir(out: Path, study: dict) -> Path | None:
    candidates = []
    if study.get("runs_dir"):
        given = Path(study["runs_dir"])
        candidates.append(given)  # relative to the current folder, as given on the command line
    if study.get("runs_dir_abs"):
        candidates.append(Path(study["runs_dir_abs"]))
    candidates.append(out / "runs")
    for c in candidates:
        if c.is_dir():
            return c
    return None


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None, None
    return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else None)


def make_table(variants: list[dict], runs: list[dict]) -> list[dict]:
    """One row per variant (see the module docstring); ratios use the ``adamw`` and
    ``unconstrained`` rows (same sweep value, when swept) when present."""
    rows = []
    for v in variants:
        rs = [r for r in runs if r["variant"] == v["name"]]
        fin = [r for r in rs if r["status"] == "finished"]
        div = [r for r in rs if r["status"] in ("diverged", "failed")]
        final_mean, final_std = _mean_std([r["final_val"] for r in fin])
        best_mean, best_std = _mean_std([r["best_val"] for r in rs])
        ms = [r["ms_per_step"] for r in rs if r.get("ms_per_step") is not None]
        if not rs:
            text = "not run"
        elif div:
            steps = ", ".join(str(r.get("diverged_step")) for r in div)
            text = f"diverged {len(div)}/{len(rs)} (step {steps})"
            if any(r["status"] == "failed" for r in div):
                text += " [failed: exception]"
        elif len(fin) == len(rs):
            text = f"stable {len(fin)}/{len(rs)}"
        else:
            text = f"incomplete ({len(fin)}/{len(rs)} finished)"
        rows.append({
            "variant": v["name"], "label": v.get("label") or v["name"],
            "attention": next((r["attn"] for r in rs if r.get("attn")), None),
            "mlp": next((r["mlp"] for r in rs if r.get("mlp")), None),
            "seeds": len(rs), "finished": len(fin), "diverged": len(div),
            "diverged_steps": [r.get("diverged_step") for r in div],
            "final_val_mean": _round(final_mean), "final_val_std": _round(final_std),
            "best_val_mean": _round(best_mean), "best_val_std": _round(best_std),
            "ms_per_step": _round(float(np.mean(ms)) if ms else None),
            "status": text, "sweep": v.get("sweep"),
            "skipped_updates": sum(r.get("skipped_updates") or 0 for r in rs) if any(r.get("skipped_updates") is not None for r in rs) else None,
            **_end_of_training(rs),
        })
    by = {r["variant"]: r for r in rows}
    for r, v in zip(rows, variants):
        for ref, col in (("adamw", "vs_adamw"), ("unconstrained", "vs_unconstrained")):
            ref_name = ref
            base = v.get("base") or ""
            if v.get("sweep") and base and v["name"].startswith(base):
                ref_name = ref + v["name"][len(base):]  # the reference at the same value
            other = by.get(ref_name) or by.get(ref)
            ok = other and other.get("ms_per_step") and r.get("ms_per_step")
            r[col] = _round(r["ms_per_step"] / other["ms_per_step"], 4) if ok else None
    return rows


def _last_row(rows: list) -> list:
    return [x for x in (rows[-1] if rows else []) if x is not None]


def _end_of_training(runs: list[dict]) -> dict:
    """Attention-side state at each run's last evaluation, mean over runs: the largest
    sigma_max of W_Q / W_K, max |logit|, smallest mean row entropy, largest saturated fraction."""
    cols = {"end_sigma_qk": [], "end_max_logit": [], "end_min_entropy": [], "end_saturated": []}
    for r in runs:
        d = r.get("diag") or {}
        sig, att = d.get("sigma_max", {}), d.get("attention", {})
        qk = _last_row(sig.get("attn_q", [])) + _last_row(sig.get("attn_k", []))
        if qk:
            cols["end_sigma_qk"].append(max(qk))
        for key, col, fn in (("max_abs_logit", "end_max_logit", max), ("mean_entropy", "end_min_entropy", min),
                             ("saturated_frac", "end_saturated", max)):
            vals = _last_row(att.get(key, []))
            if vals:
                cols[col].append(fn(vals))
    return {k: _round(float(np.mean(v))) if v else None for k, v in cols.items()}


def collect(out: str | Path, runs_dir: str | Path | None = None) -> dict:
    """Read ``OUT/study.json`` and every run folder into a summary (see the module docstring)."""
    out = Path(out)
    study = _read_json(out / "study.json")
    if study is None:
        raise StudyError(f"{out} holds no study.json (not a study folder)")
    rdir = Path(runs_dir) if runs_dir else _resolve_runs_dir(out, study)
    if rdir is None or not rdir.is_dir():
        raise StudyError(f"runs of {out} not found (looked for {study.get('runs_dir')}); pass --runs-dir")
    variants = [dict(v) for v in study["variants"]]
    runs = []
    for v in variants:
        for seed in study["seeds"]:
            rd = rdir / v["name"] / f"s{seed}"
            if not (rd / "config.json").exists():
                continue
            run = {"variant": v["name"], "seed": seed, **read_run(rd)}
            run["wall_s"] = _round(study.get("timing", {}).get("runs", {}).get(f"{v['name']}/s{seed}"))
            runs.append(run)
        rs = [r for r in runs if r["variant"] == v["name"]]
        v["attn"] = next((r["attn"] for r in rs if r.get("attn")), None)
        v["mlp"] = next((r["mlp"] for r in rs if r.get("mlp")), None)
    study_light = {k: v for k, v in study.items() if k not in ("variants",)}
    return {"format": SUMMARY_FORMAT, "study": study_light, "variants": variants, "runs": runs,
            "table": make_table(variants, runs)}


def load_summary(path: str | Path) -> dict:
    """A ``summary.json`` (or a study folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    data = _read_json(path)
    if data is None:
        raise StudyError(f"{path} not found or not JSON (run `geomtrain report` on the study folder)")
    return data


# ----------------------------------------------------------------------------- the report
def _pm(mean, std) -> str:
    if mean is None:
        return "-"
    return f"{mean:.4f} ± {std:.4f}" if std is not None else f"{mean:.4f}"


def format_table(rows: list[dict], markdown: bool = True) -> str:
    """The results table as Markdown."""
    head = ["assignment", "attention", "MLP", "final val loss", "best val loss", "status", "ms/step", "vs AdamW", "vs Muon"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [r["label"], r.get("attention") or "-", r.get("mlp") or "-", _pm(r["final_val_mean"], r["final_val_std"]),
                 _pm(r["best_val_mean"], r["best_val_std"]), r["status"],
                 f"{r['ms_per_step']:.0f}" if r.get("ms_per_step") else "-",
                 f"{r['vs_adamw']:.2f}x" if r.get("vs_adamw") else "-",
                 f"{r['vs_unconstrained']:.2f}x" if r.get("vs_unconstrained") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_attention_table(rows: list[dict]) -> str:
    """Attention at the last evaluation (mean over seeds) as Markdown."""
    head = ["assignment", "attention", "max σ(W_Q), σ(W_K)", "max \\|logit\\|", "min mean entropy (nats)", "max saturated rows"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in rows:
        lines.append("| " + " | ".join([r["label"], r.get("attention") or "-", f(r.get("end_sigma_qk"), ".3g"),
                                         f(r.get("end_max_logit"), ".3g"), f(r.get("end_min_entropy"), ".3f"),
                                         f(r.get("end_saturated"), ".3f")]) + " |")
    return "\n".join(lines)


def _csv(rows: list[dict]) -> str:
    cols = ["variant", "label", "attention", "mlp", "seeds", "finished", "diverged", "diverged_steps", "final_val_mean",
            "final_val_std", "best_val_mean", "best_val_std", "ms_per_step", "vs_adamw", "vs_unconstrained", "status",
            "end_sigma_qk", "end_max_logit", "end_min_entropy", "end_saturated", "skipped_updates"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in rows:
        w.writerow(["" if r.get(c) is None else (" ".join(map(str, r[c])) if isinstance(r.get(c), list) else r[c]) for c in cols])
    return buf.getvalue()


def write_report(summary: dict, out: str | Path) -> list[Path]:
    """``summary.json``, ``results.csv``, ``results.md`` and the figures into ``out``."""
    from . import figures as plots

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "summary.json", summary, compact=True)
    (out / "results.csv").write_text(_csv(summary["table"]))
    st = summary.get("study", {})
    seeds = st.get("seeds", [])
    md = [f"# Study results: suite `{st.get('suite')}`", "",
          f"Command: `{st.get('command')}`", "",
          f"Seeds: {', '.join(map(str, seeds))}. Shared config: "
          + ", ".join(f"{k}={v}" for k, v in sorted(st.get("base_config", {}).items())) + ".", "",
          "Final val loss: mean ± sample std over the seeds whose run finished (diverged runs left out); "
          "best val loss: over all runs (for a diverged run, its best before the divergence). "
          "ms/step: median step time of each run, mean over seeds; ratios to `adamw` / `unconstrained`. "
          "Matrix updates ManifoldMuon skipped as non-finite (all seeds): "
          + (", ".join(f"{r['variant']} {r['skipped_updates']}" for r in summary["table"] if r.get("skipped_updates")) or "none")
          + ".", "",
          format_table(summary["table"]), "",
          "Attention at the last evaluation (mean over seeds; per run the worst layer):", "",
          format_attention_table(summary["table"]), ""]
    (out / "results.md").write_text("\n".join(md))
    written = [out / "summary.json", out / "results.csv", out / "results.md"]
    written += plots.write_all(summary, out)
    return written


def report(out: str | Path, runs_dir: str | Path | None = None, print_fn: Callable = print) -> dict:
    """Rebuild the report of a study folder from its runs, or from ``summary.json`` without them."""
    out = Path(out)
    study = _read_json(out / "study.json")
    if study is None and not (out / "summary.json").exists():
        raise StudyError(f"{out} is not a study folder (no study.json or summary.json)")
    rdir = Path(runs_dir) if runs_dir else (_resolve_runs_dir(out, study) if study else None)
    if rdir is not None and rdir.is_dir():
        summary = collect(out, rdir)
    else:
        summary = load_summary(out)
        summary["table"] = make_table(summary["variants"], summary["runs"])
        print_fn(f"runs folder not found: rebuilt from {out / 'summary.json'}")
    written = write_report(summary, out)
    print_fn(format_table(summary["table"]))
    print_fn(f"report: {', '.join(p.name for p in written)} in {out}")
    return summary


# ----------------------------------------------------------------------------- toy attention
def toy_attention(scales: Sequence[float] = (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16), n_tokens: int = 64, d_model: int = 64,
                  d_head: int = 16, seed: int = 0) -> dict:
    r"""A single causal attention layer with $W_Q = s\,Q_0$, $W_K = s\,K_0$ ($Q_0, K_0$ with
    orthonormal rows, so $\sigma_{\max}(W_Q) = \sigma_{\max}(W_K) = s$) on LayerNorm-like inputs
    ($\|x_t\| = \sqrt{d_{\mathrm{model}}}$). For each $s$: the logits $Z = X W_Q^\top W_K X^\top /
    \sqrt{d_{\mathrm{head}}}$ (scale $s^2$), the mean row entropy, the fraction of rows with
    $\max p > 0.99$, the mean softmax Jacobian norm $\|\operatorname{diag}(p) - pp^\top\|_F$ and,
    for the loss $L = \langle P V, R \rangle$ with a fixed random $R$, the gradient norms
    $\|\partial L/\partial Z\|_F$ and $\|\partial L/\partial W_Q\|_F$ (autograd, float64).

    Degeneracy of the gradient: ``grad_wq_stable_rank`` $= \|G\|_F^2 / \|G\|_2^2$ of
    $G = \partial L/\partial W_Q$, and ``grad_rows_90``, the fraction of query rows that carry 90%
    of $\|\partial L/\partial Z\|_F^2$.

    Per row (rows 1.., row 0 sees a single key): ``row_gap`` (largest minus second largest
    logit) and ``row_jacobian``; a saturated row has $\|J\|_F \approx 2 e^{-\mathrm{gap}}$."""
    import torch

    from ..diagnostics import softmax_row_stats

    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    X = torch.randn(n_tokens, d_model, generator=g, dtype=dt)
    X = (X - X.mean(-1, keepdim=True)) / X.std(-1, keepdim=True, unbiased=False)  # LayerNorm, unit gain
    Q0 = torch.linalg.qr(torch.randn(d_model, d_head, generator=g, dtype=dt))[0].T
    K0 = torch.linalg.qr(torch.randn(d_model, d_head, generator=g, dtype=dt))[0].T
    V = X @ torch.linalg.qr(torch.randn(d_model, d_head, generator=g, dtype=dt))[0]
    R = torch.randn(n_tokens, d_head, generator=g, dtype=dt)
    causal = torch.ones(n_tokens, n_tokens, dtype=torch.bool).tril()
    out = {k: [] for k in ("scale", "max_abs_logit", "logit_std", "mean_entropy", "saturated_frac", "jacobian_norm",
                           "grad_logits", "grad_wq", "grad_wk", "grad_wq_stable_rank", "grad_rows_90", "row_gap",
                           "row_jacobian")}
    for s in scales:
        Wq = (s * Q0).clone().requires_grad_(True)
        Wk = (s * K0).clone().requires_grad_(True)
        Z = (X @ Wq.T) @ (X @ Wk.T).T / math.sqrt(d_head)
        Z.retain_grad()
        Zm = Z.masked_fill(~causal, float("-inf"))
        P = torch.softmax(Zm, dim=-1)
        loss = ((P @ V) * R).sum()
        loss.backward()
        st = softmax_row_stats(Zm.detach(), P.detach())
        out["scale"].append(float(s))
        out["max_abs_logit"].append(st["max_abs_logit"])
        out["logit_std"].append(float(Z.detach()[causal].std()))
        out["mean_entropy"].append(st["mean_entropy"])
        out["saturated_frac"].append(st["saturated_frac"])
        out["jacobian_norm"].append(st["jacobian_norm"])
        out["grad_logits"].append(float(Z.grad.masked_fill(~causal, 0).norm()))
        out["grad_wq"].append(float(Wq.grad.norm()))
        out["grad_wk"].append(float(Wk.grad.norm()))
        sv = torch.linalg.svdvals(Wq.grad)
        out["grad_wq_stable_rank"].append(float((sv ** 2).sum() / sv[0] ** 2))
        energy = (Z.grad.masked_fill(~causal, 0) ** 2).sum(-1).sort(descending=True).values
        share = energy.cumsum(0) / energy.sum()
        out["grad_rows_90"].append(float((int((share < 0.9).sum()) + 1) / n_tokens))
        # per row: the gap between the two largest visible logits and the row's Jacobian norm
        p = P.detach()
        top2 = Zm.detach()[1:].topk(2, dim=-1).values  # row 0 sees one key only
        s2, s3 = (p[1:] ** 2).sum(-1), (p[1:] ** 3).sum(-1)
        out["row_gap"].append([float(v) for v in (top2[:, 0] - top2[:, 1])])
        out["row_jacobian"].append([float(v) for v in (s2 - 2 * s3 + s2 * s2).clamp_min(0).sqrt()])
    out.update(n_tokens=n_tokens, d_model=d_model, d_head=d_head, seed=seed)
    return out


# ----------------------------------------------------------------------------- overhead
def measure_overhead(base: dict, presets: Sequence[str] = PRESET_ORDER, solvers: Sequence[str | None] = (None,),
                     steps: int = 20, warmup: int = 3, seed: int = 0) -> list[dict]:
    """Median ms per full training step (forward, backward, clipping, AdamW, Manifold Muon) of each
    (preset, Muon solver), measured **interleaved**: one step of every configuration in turn, so a
    shared machine's slow drift hits them all alike. ``adamw`` and ``unconstrained`` do not use a
    manifold solver and are measured once. Rows carry the ratios to ``adamw`` and ``unconstrained``."""
    import statistics
    import tempfile

    from ..config import make_config
    from ..train import _Run  # the trainer's own step

    configs = []
    for p in presets:
        for solver in ((None,) if p in ("adamw", "unconstrained") else solvers):
            configs.append((p, solver))
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for p, solver in configs:
            values = {**base, "preset": p, "rules": [], "seed": seed, "out_dir": f"{tmp}/{p}-{solver}", "progress": False,
                      "diagnostics": False, "max_iters": max(int(base.get("max_iters", 1)), warmup + steps)}
            if solver is not None:
                values["muon_solver"] = solver
            runs[(p, solver)] = _Run(make_config(values), resume=False)
        for i in range(warmup + steps):
            for c, run in runs.items():
                run.set_lr()
                t0 = time.perf_counter()
                run.train_step()
                dt = time.perf_counter() - t0
                run.step += 1
                if i >= warmup:
                    times[c].append(dt)
    rows = [{"preset": p, "solver": solver or ("-" if p in ("adamw", "unconstrained") else "default"),
             "ms_per_step": _round(1000 * statistics.median(times[(p, solver)])),
             "ms_p10": _round(1000 * float(np.percentile(times[(p, solver)], 10))),
             "ms_p90": _round(1000 * float(np.percentile(times[(p, solver)], 90)))} for p, solver in configs]
    ref = {r["preset"]: r["ms_per_step"] for r in rows if r["preset"] in ("adamw", "unconstrained")}
    for r in rows:
        r["vs_adamw"] = _round(r["ms_per_step"] / ref["adamw"], 4) if ref.get("adamw") else None
        r["vs_unconstrained"] = _round(r["ms_per_step"] / ref["unconstrained"], 4) if ref.get("unconstrained") else None
    return rows


def format_overhead_table(rows: list[dict]) -> str:
    head = ["preset", "Muon solver", "ms/step (median)", "p10-p90", "vs AdamW", "vs unconstrained Muon"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['solver']} | {r['ms_per_step']:.0f} | {r['ms_p10']:.0f}-{r['ms_p90']:.0f} | "
                     + (f"{r['vs_adamw']:.2f}x" if r.get("vs_adamw") else "-") + " | "
                     + (f"{r['vs_unconstrained']:.2f}x" if r.get("vs_unconstrained") else "-") + " |")
    return "\n".join(lines)


def _cmd_overhead(argv: list[str]) -> int:
    from . import figures as plots
    from ..assign import PRESETS
    from ..config import load_toml
    from ..model import MODEL_CONFIGS

    p = _Parser(prog="geomtrain study overhead", description=(
        "Step time of every preset (and Manifold Muon solver), measured interleaved in one process; "
        "writes overhead.json, overhead.md and overhead_solvers.png."))
    p.add_argument("--model", default="mini", help=f"one of {', '.join(MODEL_CONFIGS)}")
    p.add_argument("--presets", default=",".join(PRESET_ORDER), help="comma-separated presets")
    p.add_argument("--solvers", default="default", help="comma-separated Muon solvers (default: the optimizer's default)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--config", default=None, metavar="FILE.toml")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from ..optim import SOLVERS

    if args.model not in MODEL_CONFIGS:
        raise StudyError(f"unknown model {args.model!r}; valid: {', '.join(MODEL_CONFIGS)}")
    presets = [x.strip() for x in args.presets.split(",") if x.strip()]
    for x in presets:
        if x not in PRESETS:
            raise StudyError(f"unknown preset {x!r}; valid: {', '.join(PRESETS)}")
    solvers = [None if x.strip() == "default" else x.strip() for x in args.solvers.split(",") if x.strip()]
    for x in solvers:
        if x is not None and x not in SOLVERS:
            raise StudyError(f"unknown solver {x!r}; valid: default, {', '.join(SOLVERS)}")
    if args.steps < 1 or args.warmup < 0:
        raise StudyError("--steps must be >= 1 and --warmup >= 0")
    sets = parse_sets(args.sets)
    toml = load_toml(args.config) if args.config else {}
    tokenizer = args.tokenizer or _default_tokenizer()
    data_dir = args.data_dir or sets.get("data_dir") or toml.get("data_dir") or str(_default_data_dir(tokenizer))
    ensure_data(data_dir, tokenizer if (args.tokenizer or not args.data_dir) else None)
    base = shared_config(args.model, None, data_dir, args.device, toml, sets)
    t0 = time.time()
    rows = measure_overhead(base, presets, solvers, args.steps, args.warmup)
    out = Path(args.out)
    record = {"command": "geomtrain study overhead " + shlex.join(argv), "base_config": base, "steps": args.steps,
              "warmup": args.warmup, "rows": rows, "wall_s": _round(time.time() - t0),
              "environment": _environment(args.device), "data": _data_info(data_dir),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write_json(out / "overhead.json", record)
    table = format_overhead_table(rows)
    (out / "overhead.md").write_text(f"# Step time per assignment and solver\n\nCommand: `{record['command']}`\n\n"
                                     f"{args.steps} timed steps per configuration after {args.warmup} untimed ones, "
                                     "interleaved round-robin in one process.\n\n" + table + "\n")
    plots.save(plots.overhead_solvers(rows, title=f"model {base['model']}, {args.steps} interleaved steps"), out / "overhead_solvers.png")
    print(table)
    print(f"wrote overhead.json, overhead.md, overhead_solvers.png in {out}")
    return 0


# ----------------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`StudyError` (one line) instead of printing usage."""

    def error(self, message):  # noqa: D401
        raise StudyError(message)


def _study_parser() -> argparse.ArgumentParser:
    from ..assign import PRESETS
    from ..model import MODEL_CONFIGS

    p = _Parser(prog="geomtrain study", description=(
        "Train every variant of a suite for every seed with shared settings, then write the report "
        "(results.md/csv, summary.json, figures). Resumable: rerun the same command to continue. "
        "Other forms: `geomtrain report OUT` (rebuild the report), `geomtrain study toy --out DIR` "
        "(single-layer attention saturation demo)."))
    p.add_argument("--model", default="mini", help=f"model config: {', '.join(MODEL_CONFIGS)} (default: mini)")
    p.add_argument("--suite", default="presets", help=f"one of {', '.join(SUITES)} (default: presets)")
    p.add_argument("--presets", default=None, help=f"comma-separated presets (default: the suite's); valid: {', '.join(PRESETS)}")
    p.add_argument("--sweep", default=None, metavar="KEY=V1,V2", help="run every preset at every value of a config key")
    p.add_argument("--bounds", default=None, help="bounded suite: comma-separated column-norm bounds (default: 1,2)")
    p.add_argument("--seeds", default="1", help="number of seeds (3 -> 0,1,2) or a list (0,5,7); default 1")
    p.add_argument("--iters", type=int, default=None, help="training iterations per run (default: the model's max_iters)")
    p.add_argument("--out", required=True, help="study folder (report, study.json; runs/ inside unless --runs-dir)")
    p.add_argument("--runs-dir", default=None, help="where the run folders go (default: OUT/runs)")
    p.add_argument("--data-dir", default=None, help="prepared data (default: data/classics-<tokenizer>, prepared if missing)")
    p.add_argument("--tokenizer", default=None, help="tokenizer used to prepare missing data (default: bpe4k)")
    p.add_argument("--config", default=None, metavar="FILE.toml", help="TOML with shared config keys")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="shared config override (repeatable)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per run (default: torch's, i.e. "
                   "OMP_NUM_THREADS; with --jobs: CPU count // jobs)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process (default: 1); "
                   "results do not depend on it")
    p.add_argument("--probe-iters", type=int, default=None, help="autoassign: steps of each probe run (default: iters // 4)")
    p.add_argument("--granularity", default="module", help="autoassign: module | kind | layer (default: module)")
    p.add_argument("--drop-checkpoints", action="store_true", help="delete ckpt.pt of runs that are done (saves disk)")
    p.add_argument("--no-report", action="store_true", help="train only; write the report later with `geomtrain report OUT`")
    p.add_argument("--dry-run", action="store_true", help="print the plan (variants, seeds, config) and stop")
    p.add_argument("--quiet", action="store_true", help="only the final table")
    return p


def _default_tokenizer() -> str:
    from .. import data as gdata

    return "bpe4k" if "bpe4k" in getattr(gdata, "TOKENIZERS", ()) else "gpt2"


def _default_data_dir(tokenizer: str) -> Path:
    from .. import data as gdata

    try:
        return gdata.default_data_dir("classics", tokenizer=tokenizer)
    except TypeError:  # a data module without tokenizer choice
        return gdata.default_data_dir("classics")


def _cmd_study(argv: list[str]) -> int:
    from .. import data as gdata
    from ..assign import PRESETS
    from ..config import load_toml
    from ..model import MODEL_CONFIGS

    args = _study_parser().parse_args(argv)
    if args.model not in MODEL_CONFIGS:
        raise StudyError(f"unknown model {args.model!r}; valid: {', '.join(MODEL_CONFIGS)}")
    if args.suite not in SUITES:
        raise StudyError(f"unknown suite {args.suite!r}; valid: {', '.join(SUITES)}")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()] if args.presets else None
    for p in presets or ():
        if p not in PRESETS:
            raise StudyError(f"unknown preset {p!r}; valid: {', '.join(PRESETS)}")
    if args.granularity not in ("module", "kind", "layer"):
        raise StudyError(f"unknown granularity {args.granularity!r}; valid: module, kind, layer")
    if args.jobs < 1:
        raise StudyError(f"--jobs must be >= 1; got {args.jobs}")
    if args.threads is not None and args.threads < 1:
        raise StudyError(f"--threads must be >= 1; got {args.threads}")
    if args.iters is not None and args.iters < 1:
        raise StudyError(f"--iters must be >= 1; got {args.iters}")
    tokens = getattr(gdata, "TOKENIZERS", ("gpt2",))
    if args.tokenizer is not None and args.tokenizer not in tokens:
        raise StudyError(f"unknown tokenizer {args.tokenizer!r}; valid: {', '.join(tokens)}")
    try:
        bounds = [float(b) for b in args.bounds.split(",") if b.strip()] if args.bounds else None
    except ValueError:
        raise StudyError(f"--bounds {args.bounds!r}: give comma-separated numbers, e.g. 1,2") from None
    seeds = _parse_seeds(args.seeds)
    sets = parse_sets(args.sets)
    try:
        toml = load_toml(args.config) if args.config else {}
    except (OSError, ValueError) as exc:
        raise StudyError(str(exc)) from None
    tokenizer = args.tokenizer or _default_tokenizer()
    data_dir = args.data_dir or sets.get("data_dir") or toml.get("data_dir") or str(_default_data_dir(tokenizer))
    base = shared_config(args.model, args.iters, data_dir, args.device, toml, sets)
    # with --jobs each worker gets CPU count // jobs threads; work done here (autoassign probes) too
    threads = args.threads or (_threads_per_worker(args.jobs) if args.jobs > 1 else None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    options = {"probe_iters": args.probe_iters, "granularity": args.granularity, "threads": args.threads,
               "tokenizer": tokenizer, "bounds": bounds, "presets": presets}
    say = (lambda *a, **k: None) if args.quiet else print
    explicit_data = bool(args.data_dir or "data_dir" in sets or "data_dir" in toml)
    if not args.dry_run:  # the default data folder is prepared when missing; an explicit one only with --tokenizer
        ensure_data(base["data_dir"], tokenizer if (args.tokenizer or not explicit_data) else None, print_fn=say)
    study = plan(args.out, suite=args.suite, presets=presets, sweep=_parse_sweep(args.sweep), bounds=bounds, seeds=seeds,
                 base=base, runs_dir=args.runs_dir, argv=argv, options=options)
    if args.dry_run:
        print(f"suite {study.suite}: {len(study.variants)} variants x {len(study.seeds)} seeds -> {study.runs_dir}")
        for v in study.variants:
            print(f"  {v.name}: preset {v.preset}" + (f", rules {v.rules}" if v.rules else "") + (f", {v.overrides}" if v.overrides else ""))
        print("shared config: " + json.dumps(study.base))
        return 0
    code = run_study(study, print_fn=say, report_after=not args.no_report, drop_checkpoints=args.drop_checkpoints,
                     workers=args.jobs, threads=args.threads)
    if args.quiet and not args.no_report:
        print(format_table(collect(study.out)["table"]))
    return code


def _cmd_report(argv: list[str]) -> int:
    p = _Parser(prog="geomtrain report", description="Rebuild a study's results table and figures.")
    p.add_argument("out", help="the study folder (holding study.json or summary.json)")
    p.add_argument("--runs-dir", default=None, help="where its runs are (default: as recorded in study.json)")
    args = p.parse_args(argv)
    if not Path(args.out).is_dir():
        raise StudyError(f"{args.out} is not a folder")
    report(args.out, args.runs_dir)
    return 0


def _cmd_toy(argv: list[str]) -> int:
    from . import figures as plots

    p = _Parser(prog="geomtrain study toy", description="Softmax saturation in one attention layer as W_Q, W_K are scaled up.")
    p.add_argument("--out", required=True, help="folder for toy.json and toy_saturation.png")
    p.add_argument("--scales", default="0.25,0.5,1,1.5,2,3,4,6,8,12,16", help="comma-separated scales s")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-head", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        scales = [float(s) for s in args.scales.split(",") if s.strip()]
    except ValueError:
        raise StudyError(f"--scales {args.scales!r}: give comma-separated numbers > 0") from None
    if not scales or any(s <= 0 for s in scales) or min(args.tokens, args.d_model, args.d_head) < 1 or args.d_head > args.d_model:
        raise StudyError("--scales must be > 0, --tokens/--d-model/--d-head >= 1 and d_head <= d_model")
    result = toy_attention(scales, args.tokens, args.d_model, args.d_head, args.seed)
    out = Path(args.out)
    _write_json(out / "toy.json", {"command": "geomtrain study toy " + shlex.join(argv),
                                   **{k: _round(v, 5) if isinstance(v, list) and k != "row_gap" and k != "row_jacobian"
                                      else v for k, v in result.items()},
                                   "row_gap": [_round(r, 4) for r in result["row_gap"]],
                                   "row_jacobian": [_round(r, 4) for r in result["row_jacobian"]]}, compact=True)
    plots.save(plots.toy_saturation(result), out / "toy_saturation.png")
    for s, lg, h, j, gq in zip(result["scale"], result["max_abs_logit"], result["mean_entropy"], result["jacobian_norm"], result["grad_wq"]):
        print(f"s={s:<5g} max|logit|={lg:8.2f} entropy={h:.3f} jacobian={j:.2e} |dL/dWq|={gq:.2e}")
    print(f"wrote {out / 'toy.json'} and {out / 'toy_saturation.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``main(["--model", ...])`` runs a study, ``main(["report", DIR])`` rebuilds a report,
    ``main(["toy", "--out", DIR])`` runs the toy demonstration, ``main(["overhead", "--out", DIR])``
    measures step times interleaved. Bad input: one line, exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        prog, handler, rest = "geomtrain report", _cmd_report, argv[1:]
    elif argv and argv[0] == "toy":
        prog, handler, rest = "geomtrain study toy", _cmd_toy, argv[1:]
    elif argv and argv[0] == "overhead":
        prog, handler, rest = "geomtrain study overhead", _cmd_overhead, argv[1:]
    else:
        prog, handler, rest = "geomtrain study", _cmd_study, argv
    try:
        return int(handler(rest) or 0)
    except (StudyError, ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
