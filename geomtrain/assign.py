r"""Module-wise manifold assignment: which optimizer and manifold each parameter gets.

Muon-managed matrices of a GPT-2 block are the attention ``c_attn`` (fused Q, K, V) and
``c_proj`` and the MLP ``c_fc`` and ``c_proj``; everything else (embeddings, LayerNorms,
biases) goes to AdamW. A **preset** fixes the manifold of each Muon matrix:

| preset          | attention (c_attn, attn.c_proj) | MLP (c_fc, mlp.c_proj) |
|-----------------|---------------------------------|------------------------|
| ``adamw``       | AdamW                           | AdamW                  |
| ``unconstrained`` | Muon, no manifold (Euclidean) | Muon, Euclidean        |
| ``all-stiefel`` | Stiefel                         | Stiefel                |
| ``all-dgram``   | DGram                           | DGram                  |
| ``hetero``      | Stiefel                         | DGram                  |
| ``hetero-inv``  | DGram                           | Stiefel                |

**Custom rules** map parameter-name globs (``fnmatch``) to a target: a manifold name
(``stiefel``, ``dgram``, ``oblique``, ``euclidean`` = Muon without constraint), ``adamw``, or
from Python any `manifolds.GramManifold` instance. The first matching rule wins; a
parameter no rule matches goes to AdamW. Only 2-D weights can take a manifold.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence, Union

import torch

from manifolds import MANIFOLDS, GramManifold, get_manifold

__all__ = [
    "PRESETS", "ATTENTION_GLOBS", "MLP_GLOBS", "Rule", "Assignment", "preset_rules", "parse_rule",
    "assign", "format_table", "TARGETS",
]

ATTENTION_GLOBS = ("*.attn.c_attn.weight", "*.attn.c_proj.weight")
MLP_GLOBS = ("*.mlp.c_fc.weight", "*.mlp.c_proj.weight")
TARGETS = tuple(MANIFOLDS) + ("adamw",)

_PRESET_TABLE = {
    "adamw": (None, None),
    "unconstrained": ("euclidean", "euclidean"),
    "all-stiefel": ("stiefel", "stiefel"),
    "all-dgram": ("dgram", "dgram"),
    "hetero": ("stiefel", "dgram"),
    "hetero-inv": ("dgram", "stiefel"),
}
PRESETS = tuple(_PRESET_TABLE)

Target = Union[str, GramManifold]


@dataclass(frozen=True)
class Rule:
    """``pattern`` (an fnmatch glob on parameter names) -> ``target`` (manifold name, ``adamw`` or instance)."""

    pattern: str
    target: Target


@dataclass
class Assignment:
    """One parameter's assignment: ``optimizer`` is ``"muon"`` or ``"adamw"``."""

    name: str
    shape: tuple[int, ...]
    optimizer: str
    manifold_name: str | None
    manifold: GramManifold | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "optimizer": self.optimizer, "manifold": self.manifold_name}


def preset_rules(preset: str) -> list[Rule]:
    """The rules of a named preset; ``ValueError`` listing the valid presets otherwise."""
    if preset not in _PRESET_TABLE:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    attention, mlp = _PRESET_TABLE[preset]
    rules = []
    for globs, target in ((ATTENTION_GLOBS, attention), (MLP_GLOBS, mlp)):
        if target is not None:
            rules += [Rule(g, target) for g in globs]
    return rules


def parse_rule(text: str) -> Rule:
    """Parse ``"GLOB=TARGET"`` (the CLI form), e.g. ``"*.attn.*=stiefel"``."""
    pattern, sep, target = text.partition("=")
    if not sep or not pattern.strip() or not target.strip():
        raise ValueError(f"rule {text!r} must look like GLOB=TARGET with TARGET one of: {', '.join(TARGETS)}")
    return Rule(pattern.strip(), target.strip())


def _resolve(target: Target, custom: Mapping[str, GramManifold]) -> tuple[str, GramManifold | None]:
    if isinstance(target, GramManifold):
        return type(target).__name__.lower(), target
    key = str(target).lower()
    if key == "adamw":
        return "adamw", None
    if key in custom:
        return key, custom[key]
    if key in MANIFOLDS:
        return key, get_manifold(key)
    valid = ", ".join(list(TARGETS) + sorted(custom))
    raise ValueError(f"unknown manifold {target!r}; valid: {valid}")


def assign(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    preset: str | None = "hetero",
    rules: Sequence[Rule | str] = (),
    custom_manifolds: Mapping[str, GramManifold] | None = None,
) -> list[Assignment]:
    """Assign every parameter: custom ``rules`` first (in order), then the ``preset``'s rules.

    Args:
        named_parameters: e.g. ``model.named_parameters()``.
        preset: a name from `PRESETS`, or ``None`` for rules only.
        rules: `Rule` objects or ``"GLOB=TARGET"`` strings; they take precedence.
        custom_manifolds: extra ``name -> GramManifold`` targets usable by name in rules.
    """
    custom = {k.lower(): v for k, v in (custom_manifolds or {}).items()}
    all_rules = [parse_rule(r) if isinstance(r, str) else r for r in rules]
    if preset is not None:
        all_rules += preset_rules(preset)
    resolved = [(r.pattern, *_resolve(r.target, custom)) for r in all_rules]  # validate every rule up front
    out = []
    for name, p in named_parameters:
        target_name, manifold = "adamw", None
        for pattern, t_name, t_manifold in resolved:
            if fnmatch.fnmatchcase(name, pattern):
                target_name, manifold = t_name, t_manifold
                break
        if target_name != "adamw" and p.dim() != 2:
            raise ValueError(f"parameter {name} of shape {tuple(p.shape)} matched a manifold rule; only 2-D weights can take a manifold")
        optimizer = "adamw" if target_name == "adamw" else "muon"
        out.append(Assignment(name, tuple(p.shape), optimizer, None if optimizer == "adamw" else target_name, manifold))
    return out


def format_table(assignments: Sequence[Assignment]) -> str:
    """A plain-text table: parameter, shape, optimizer, manifold."""
    rows = [("parameter", "shape", "optimizer", "manifold")]
    rows += [(a.name, "x".join(map(str, a.shape)), a.optimizer, a.manifold_name or "-") for a in assignments]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
