"""Typed training configuration: defaults per model size, TOML files and CLI overrides.

Precedence: dataclass defaults < the model's defaults (`MODEL_DEFAULTS`) < a TOML file
< explicit overrides (CLI flags, keyword arguments). The ``gpt2`` defaults are the published
ones of the paper (arXiv 2606.13276: 50k steps of 64 x 1024 tokens, warmup 1000, cosine to 0.1 of
the peak, bf16); the small models get CPU-sized schedules.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .suggest import did_you_mean

__all__ = [
    "TrainConfig",
    "MODEL_DEFAULTS",
    "load_toml",
    "make_config",
    "field_kind",
    "parse_value",
    "parse_scalar",
    "parse_assignments",
    "parse_solver_options",
    "RUN_DEFINING_KEYS",
    "INVOCATION_KEYS",
    "saved_config",
    "import_manifold_modules",
    "did_you_mean",
    "unknown_keys_message",
]


@dataclass
class TrainConfig:
    """Everything a training run needs; saved as ``config.json`` in the run folder."""

    # model and data
    model: str = "mini"  # a name from geomtrain.model.MODEL_CONFIGS
    data_dir: str = "data/classics"  # prepared by `geomtrain prepare`
    block_size: int | None = None  # context length; None = the model's
    n_embd: int | None = None  # width (a multiple of the model's n_head); None = the model's
    split_qkv: bool = False  # c_attn as three matrices W_Q, W_K, W_V, each constrained on its own
    init_from: str | None = None  # a local Hugging Face GPT-2 folder of the same shape (pretrained weights)
    # manifold assignment
    preset: str = "hetero"  # adamw | unconstrained | all-stiefel | all-dgram | hetero | hetero-inv
    rules: list[str] = field(default_factory=list)  # "GLOB=TARGET", applied before the preset
    manifold_modules: list[str] = field(default_factory=list)  # modules imported first (they register manifolds)
    # schedule (AdamW part)
    max_iters: int = 300
    batch_size: int = 16  # global sequences per micro-step (split over ranks)
    grad_accum: int = 1
    warmup_iters: int = 30
    lr: float = 6e-4  # AdamW peak lr; warmup then cosine to min_lr
    min_lr: float = 6e-5
    weight_decay: float = 0.1  # AdamW, on 2-D weights only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global norm; 0 disables
    # Manifold Muon part (its lr follows the AdamW schedule: muon_lr * lr_t / lr)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_solver: str | None = None  # None: per kind: filled_split on Stiefel, DGram and custom masks, else exact
    muon_solver_options: list[str] = field(default_factory=list)  # "KEY=VALUE" options of the solver
    muon_solver_rules: list[str] = field(default_factory=list)  # "GLOB=SOLVER" per Muon matrix, first match wins
    muon_weight_decay: float = 0.0  # decoupled, Euclidean (unconstrained) matrices only
    muon_certify_every: int = 0  # every N Muon steps: the exact float64 dual gap of each direction; 0 = off
    # evaluation, diagnostics, robustness
    eval_interval: int = 50
    eval_iters: int = 10
    diagnostics: bool = True
    diag_batch_size: int = 4
    divergence_margin: float = 1.0  # diverged when val loss > best val loss + margin (nats)
    nonfinite_patience: int = 5  # diverged after this many steps in a row skipped (non-finite loss/grad)
    log_interval: int = 10
    checkpoint_interval: int | None = None  # None = every evaluation
    stop_after: int | None = None  # stop (as if interrupted) after this many steps
    # system
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "float32"  # float32 | bfloat16 (autocast for the forward pass)
    compile: bool = False  # torch.compile the model
    fsdp: bool = False  # under torchrun: FSDP2 (fully_shard per block) and DCP checkpoints instead of DDP; else a no-op
    bucketed: bool = True  # under DDP: ManifoldMuon's one all-gather per (shape, dtype) bucket; False: a broadcast each
    tf32: bool = True  # on CUDA: TF32 tensor cores for the model's float32 matmuls (the optimizer's stay IEEE)
    out_dir: str = "runs/{model}-{preset}-s{seed}"
    progress: bool = True  # tqdm progress bar
    tensorboard: bool = False  # also log every metric and diagnostic to OUT_DIR/tensorboard

    def resolved_out_dir(self) -> Path:
        return Path(self.out_dir.format(model=self.model, preset=self.preset, seed=self.seed))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def solver_options(self) -> dict:
        """``muon_solver_options`` (``"KEY=VALUE"`` entries, e.g. ``msign_dtype=float32``, ``tol=1e-5``)
        as the solver's typed options (`parse_solver_options`)."""
        return parse_solver_options(self.muon_solver_options, self.muon_solver, "muon_solver_options")

    def validate(self, custom_names: tuple[str, ...] = ()) -> TrainConfig:
        """Raise ``ValueError`` (one line, naming the valid choices) on a bad value; return self.

        The one validation site: flags, TOML, ``--set``, the study and resume all end here. Long
        because it checks every field in turn, each check one or two lines.
        ``custom_names``: extra manifold names rules may use (passed to ``train(custom_manifolds=)``)."""
        from .assign import PRESETS, validate_rule
        from .model import MODEL_CONFIGS

        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name))
        if self.model not in MODEL_CONFIGS:
            raise ValueError(f"unknown model {self.model!r}; valid: {', '.join(MODEL_CONFIGS)}")
        n_head = MODEL_CONFIGS[self.model].n_head
        if self.n_embd is not None and (self.n_embd < 1 or self.n_embd % n_head):
            raise ValueError(
                f"n_embd must be a positive multiple of {self.model}'s n_head ({n_head}); got {self.n_embd}"
            )
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; valid: {', '.join(PRESETS)}")
        import_manifold_modules(self.manifold_modules)
        for text in self.rules:
            validate_rule(text, custom_names)
        if self.muon_solver is not None:
            from .optim import SOLVERS, retired_note  # the registry, live: a solver or an alias ("gram_newton")

            if self.muon_solver not in SOLVERS:
                raise ValueError(
                    f"unknown muon_solver {self.muon_solver!r}{did_you_mean(self.muon_solver, SOLVERS)}; "
                    f"valid: {', '.join(SOLVERS)} (or none: the default){retired_note(self.muon_solver)}"
                )
        self.solver_options()
        from .groups import parse_solver_rule

        for text in self.muon_solver_rules:
            parse_solver_rule(text)
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ValueError(f"unknown device {self.device!r}; valid: auto, cpu, cuda, cuda:N, mps")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: float32, bfloat16")
        for name in (
            "max_iters",
            "batch_size",
            "grad_accum",
            "eval_interval",
            "eval_iters",
            "log_interval",
            "diag_batch_size",
            "nonfinite_patience",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("warmup_iters", "muon_certify_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        if not self.lr > 0:  # NaN too; the finite test below names the rest
            raise ValueError(f"lr must be a finite number > 0; got {self.lr!r}")
        for name in ("lr", "min_lr", "muon_lr", "weight_decay", "grad_clip", "muon_weight_decay", "divergence_margin"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
        for name in ("beta1", "beta2", "muon_momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1); got {getattr(self, name)!r}")
        for name in ("checkpoint_interval", "stop_after"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None; got {getattr(self, name)}")
        try:
            self.resolved_out_dir()
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"bad placeholder in out_dir {self.out_dir!r} ({exc}); valid: {{model}}, {{preset}}, {{seed}}"
            ) from None
        return self


MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    # Published: 50k iterations of 64 x 1024 tokens, warmup 1000, cosine to 6e-5; bf16 on GPU.
    "gpt2": dict(
        max_iters=50_000,
        batch_size=64,
        warmup_iters=1000,
        eval_interval=1000,
        eval_iters=50,
        log_interval=50,
        dtype="bfloat16",
        diag_batch_size=2,
    ),
    "mini": dict(max_iters=300, batch_size=16, warmup_iters=30, eval_interval=50, eval_iters=10),
    "tiny": dict(
        max_iters=60, batch_size=8, warmup_iters=6, eval_interval=20, eval_iters=2, log_interval=5, diag_batch_size=2
    ),
}

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}

RUN_DEFINING_KEYS = (
    "model",
    "data_dir",
    "block_size",
    "n_embd",
    "split_qkv",
    "init_from",
    "preset",
    "rules",
    "max_iters",
    "batch_size",
    "grad_accum",
    "warmup_iters",
    "lr",
    "min_lr",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "muon_lr",
    "muon_momentum",
    "muon_nesterov",
    "muon_solver",
    "muon_solver_options",
    "muon_solver_rules",
    "muon_weight_decay",
    "seed",
    "dtype",
)
"""Keys whose change makes a different run: a resume that changes one is refused unless allowed. ``fsdp``
and ``bucketed`` are not among them: like the number of ranks, they change how the same step is
computed (float rounding: another order of the gradient reduction, other batches of solves), not the
step, so a run may resume on another world size or strategy."""

INVOCATION_KEYS = ("out_dir", "stop_after", "progress")
"""Keys of one invocation, not of the run: a resume does not take them from the run (the folder is
where the run is; ``stop_after`` and the progress bar are this invocation's) and they are no change."""


def saved_config(saved: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A ``config.json`` written by an earlier version, read as this version's: a key that did not
    exist then gets its dataclass default, which is the behaviour of the code before the key was
    added (a new key's default never changes what an old run did). Unknown keys are kept."""
    if saved is None:
        return None
    missing = {name: f for name, f in _FIELDS.items() if name not in saved}
    filled = {
        name: (f.default_factory() if f.default is dataclasses.MISSING else f.default) for name, f in missing.items()
    }
    return {**filled, **saved}


def field_kind(name: str) -> tuple[type, bool]:
    """``(kind, optional)`` of a `TrainConfig` field: kind is int, float, bool, str or list."""
    if name not in _FIELDS:
        raise ValueError(unknown_keys_message([name]))
    hint = typing.get_type_hints(TrainConfig)[name]
    args = typing.get_args(hint)
    optional = type(None) in args
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
    kind = list if typing.get_origin(hint) is list or hint is list else hint
    return kind, optional


def unknown_keys_message(keys: Sequence[str], where: str = "") -> str:
    """``unknown config key 'max_iter' (did you mean 'max_iters'?){where}; valid: ...``: one line, each
    unknown key with its closest valid one."""
    named = ", ".join(f"{key!r}{did_you_mean(key, list(_FIELDS))}" for key in keys)
    return f"unknown config key{'s' if len(keys) > 1 else ''} {named}{where}; valid: {', '.join(_FIELDS)}"


def _check_type(name: str, value: Any) -> None:
    kind, optional = field_kind(name)
    if value is None and optional:
        return
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list) and all(isinstance(v, str) for v in value),
    }[kind]
    if not ok:
        want = "a list of strings" if kind is list else f"{'an' if kind is int else 'a'} {kind.__name__}"
        raise ValueError(f"{name} must be {want}{' or None' if optional else ''}; got {value!r}")


def import_manifold_modules(modules: Sequence[str]) -> None:
    """Import user modules that register manifolds (``--manifolds mypkg.mymanifolds``)."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(
                f"cannot import manifold module {name!r} ({exc}); it must be importable (installed, or on PYTHONPATH)"
            ) from None


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_DTYPES = ("float32", "float64", "bfloat16", "float16")  # solver dtype options, by torch name


def parse_value(name: str, text: str) -> Any:
    """The one parser of config text (CLI flags, ``--set KEY=VALUE``, sweeps): ``text`` as the
    type of field ``name``. Lists are ``;``-separated; ``none`` is None for optional fields."""
    kind, optional = field_kind(name)
    text = text.strip()
    if optional and text.lower() in ("none", "null", ""):
        return None
    if kind is list:
        return [t for t in text.split(";") if t]
    return parse_scalar(kind, text, f"for {name}")


def parse_scalar(kind: type, text: str, where: str) -> Any:
    """``text`` as a ``bool`` (true/false, yes/no, on/off, 1/0), ``int``, finite ``float`` or
    ``str``; a bad value is a one-line ``ValueError`` ``bad value ... {where} (expects ...)``."""
    try:
        if kind is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
    except ValueError:
        expects = "true/false" if kind is bool else ("an integer" if kind is int else "a number")
        raise ValueError(f"bad value {text!r} {where} (expects {expects})") from None
    return text


def parse_solver_options(entries: Sequence[str], solver: str | None = None, what: str = "--solver-options") -> dict:
    """``["compute_dtype=float64", "tol=1e-5"]`` -> the typed options of a direction solver
    (`geomtrain.optim.SOLVER_OPTIONS`; ``solver`` None, the default per mask, takes none): dtypes by
    torch name, the rest typed by the option's default. A bad entry or value
    (`geomtrain.optim.check_solver_options`) is a one-line ``ValueError`` naming the valid keys or values."""
    import torch

    from .optim import SOLVER_OPTIONS, check_solver_options, describe_default, get_solver, retired_note

    if solver is None:
        if not entries:
            return {}
        raise ValueError(
            f"{what} need a solver to belong to: the default picks one per mask ({describe_default()}); "
            "name one, e.g. muon_solver=exact"
        )
    valid = {k: v for k, v in SOLVER_OPTIONS[solver].items() if k != "trace"}  # no state slots (correction, dual)
    state = get_solver(solver).state_options()
    out = {}
    for entry in entries:
        key, sep, text = (part.strip() for part in entry.partition("="))
        if key not in valid or not sep:
            why = f": {key!r} is the solver's warm-start state, kept by the optimizer, not an option" * (key in state)
            why = why or retired_note(f"{get_solver(solver).name}.{key}")
            raise ValueError(
                f"bad {what} entry {entry!r} for solver {solver!r}{why or did_you_mean(key, list(valid))}; "
                f"give KEY=VALUE with KEY one of {', '.join(valid)}"
            )
        if key.endswith("dtype"):
            if text not in _DTYPES:
                raise ValueError(f"bad {key} {text!r} in {what}; valid: {', '.join(_DTYPES)}")
            out[key] = getattr(torch, text)
        else:  # typed by the option's default (bool before int: a bool is an int)
            kind = next((t for t in (bool, int, float) if isinstance(valid[key], t)), str)
            out[key] = parse_scalar(kind, text, f"for {key} in {what}")
    check_solver_options(solver, out)  # the values: tol=0, anderson=-1, msign=foo, ...
    return out


def parse_assignments(items: Sequence[str], what: str = "--set") -> dict[str, Any]:
    """``["muon_lr=0.05", "batch-size=8"]`` -> typed overrides (dashes in keys allowed)."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{what} {item!r} must look like KEY=VALUE, e.g. muon_lr=0.05")
        key = key.strip().replace("-", "_")
        out[key] = parse_value(key, value)
    return out


def _bounded_number(kind: type, name: str, ok) -> Any:
    """An argparse ``type``: ``kind(text)`` where ``ok`` holds, else argparse's one-line error, which names
    the option and reads "invalid <name> value" (exit code 2)."""

    def parse(text: str):
        value = kind(text)
        if not ok(value):
            raise ValueError
        return value

    parse.__name__ = name
    return parse


def check_integer(name: str, value: Any, low: int) -> None:
    """A count given to a library function: an ``int`` (not a bool) >= ``low``, else a one-line ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")


# argparse types of counts and sizes on the command lines
positive_int = _bounded_number(int, "integer >= 1", lambda v: v >= 1)
non_negative_int = _bounded_number(int, "integer >= 0", lambda v: v >= 0)
positive_float = _bounded_number(float, "finite number > 0", lambda v: math.isfinite(v) and v > 0)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read config keys from a TOML file: top-level keys and the keys of a ``[train]`` table, merged.

    A key given both at the top level and in ``[train]`` is refused (neither silently wins), as is
    any other table (``[model]``, ``[optim]``: this file has one namespace) and an unknown key
    (one line, with the closest valid key)."""
    with open(path, "rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:  # its message names the line, not the file
            raise ValueError(f"{path} is not valid TOML: {exc}") from None
    table = data.pop("train", {})
    if not isinstance(table, dict):
        raise ValueError(f"train in {path} must be a table ([train]) of config keys; got {table!r}")
    others = [key for key, value in data.items() if isinstance(value, dict)]
    if others:
        raise ValueError(
            f"table [{others[0]}] in {path} is not a config section; put config keys at the top level "
            f"or in [train]{did_you_mean(others[0], ['train'])}"
        )
    both = sorted(set(data) & set(table))
    if both:
        raise ValueError(f"{path} sets {', '.join(both)} both at the top level and in [train]; keep one")
    data.update(table)
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(unknown_keys_message(unknown, f" in {path}"))
    return data


def make_config(
    overrides: Mapping[str, Any] | None = None,
    toml_path: str | Path | None = None,
    custom_names: tuple[str, ...] = (),
) -> TrainConfig:
    """Build a `TrainConfig`: defaults, then the model's, then ``toml_path``, then ``overrides``."""
    merged: dict[str, Any] = {}
    if toml_path is not None:
        merged.update(load_toml(toml_path))
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = sorted(set(merged) - set(_FIELDS))
    if unknown:
        raise ValueError(unknown_keys_message(unknown))
    model = merged.get("model", TrainConfig.model)
    values = {**MODEL_DEFAULTS.get(model, {}), **merged}
    return TrainConfig(**values).validate(tuple(n.lower() for n in custom_names))
