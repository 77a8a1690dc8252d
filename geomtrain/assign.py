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

**Custom rules** map parameter-name globs (``fnmatch``) to a target: ``adamw``, a manifold
spec of the `manifolds` registry (``stiefel``, ``dgram``, ``oblique``, ``euclidean`` = Muon
without constraint, ``bdgram@1.5``, or any name a user added with `manifolds.register`), or from
Python any `manifolds.GramManifold` instance. The first matching rule wins; a parameter no rule
matches goes to AdamW.

**Manifold rules apply to matrices.** A rule whose target is a manifold matches 2-D weights
only, so ``*.attn.*=stiefel`` puts the attention weight matrices on Stiefel and leaves their
biases to the later rules (in the end AdamW). An ``adamw`` rule matches any parameter. A custom
rule that matches no parameter (or, for a manifold rule, no matrix) is a ``ValueError`` naming
the rule: a typo in a glob must not pass silently.

**Other models.** `assign` works on any ``named_parameters()``; which parameters a manifold rule
may take is its ``eligible`` predicate (default `is_matrix`). `geomtrain.groups.param_groups`
builds on it for any ``nn.Module``: kernels through a view, embeddings and the output layer kept
on AdamW, and the optimizer groups.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from manifolds import SPEC_SYNTAX, GramManifold, get_manifold, manifold_names

from .suggest import did_you_mean

__all__ = [
    "PRESETS",
    "ATTENTION_GLOBS",
    "MLP_GLOBS",
    "Rule",
    "Assignment",
    "preset_rules",
    "parse_rule",
    "target_names",
    "resolve_target",
    "validate_rule",
    "OWN_MANIFOLD_HINT",
    "is_matrix",
    "is_gpt_matrix",
    "assign",
    "assignment_label",
    "format_table",
]

ATTENTION_GLOBS = ("*.attn.c_attn.weight", "*.attn.c_proj.weight")
MLP_GLOBS = ("*.mlp.c_fc.weight", "*.mlp.c_proj.weight")
ADAMW = "adamw"

_PRESET_TABLE = {
    "adamw": (None, None),
    "unconstrained": ("euclidean", "euclidean"),
    "all-stiefel": ("stiefel", "stiefel"),
    "all-dgram": ("dgram", "dgram"),
    "hetero": ("stiefel", "dgram"),
    "hetero-inv": ("dgram", "stiefel"),
}
PRESETS = tuple(_PRESET_TABLE)

Target = str | GramManifold


def target_names(custom_names: Iterable[str] = ()) -> tuple[str, ...]:
    """Every rule target name now: the registered manifold names, ``custom_names``, ``adamw``."""
    return manifold_names() + tuple(n.lower() for n in custom_names) + (ADAMW,)


@dataclass(frozen=True)
class Rule:
    """``pattern`` (an fnmatch glob on parameter names) -> ``target`` (manifold spec, ``adamw`` or instance)."""

    pattern: str
    target: Target

    def __str__(self) -> str:
        target = self.target if isinstance(self.target, str) else type(self.target).__name__
        return f"{self.pattern}={target}"


@dataclass
class Assignment:
    """One parameter's assignment: ``optimizer`` is ``"muon"`` or ``"adamw"``; ``solver``, the direction
    solver of a Muon matrix, once `geomtrain.groups.pick_solvers` chose it (``None``: not chosen)."""

    name: str
    shape: tuple[int, ...]
    optimizer: str
    manifold_name: str | None
    manifold: GramManifold | None = None
    solver: str | None = None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "optimizer": self.optimizer,
            "manifold": self.manifold_name,
            **({"solver": self.solver} if self.solver is not None else {}),
        }


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
    """Parse ``"GLOB=TARGET"`` (the CLI form), e.g. ``"*.attn.*=stiefel"`` or ``"*.attn.*=bdgram@1.5"``.

    Only the form is checked here; `resolve_target` (or `validate_rule`) checks the target.
    """
    pattern, sep, target = text.partition("=")
    if not sep or not pattern.strip() or not target.strip():
        raise ValueError(
            f"rule {text!r} must look like GLOB=TARGET with TARGET one of: {', '.join(target_names())} "
            "(or a parametric manifold such as bdgram@1.5)"
        )
    return Rule(pattern.strip(), target.strip())


def resolve_target(
    target: Target, custom_manifolds: Mapping[str, GramManifold] | None = None
) -> tuple[str, GramManifold | None]:
    """``(label, manifold)`` of a rule target: ``("adamw", None)``, a ``custom_manifolds`` entry,
    or a new instance from the `manifolds` registry (``"bdgram@1.5"`` -> ``BoundedDGram(1.5)``).

    The label (shown in the assignment table, the diagnostics and the study) is the target
    lowercased without whitespace, or the class name lowercased for an instance. ``ValueError``
    (one line, naming the valid targets) on an unknown or malformed one.
    """
    if isinstance(target, GramManifold):
        return type(target).__name__.lower(), target
    if not isinstance(target, str):
        raise TypeError(f"a rule target must be a str or a GramManifold; got {type(target).__name__}")
    label = "".join(target.split()).lower()
    if label == ADAMW:
        return ADAMW, None
    custom = {k.lower(): v for k, v in (custom_manifolds or {}).items()}
    if label in custom:
        return label, custom[label]
    name = label.partition("@")[0]
    if name not in manifold_names():
        valid = target_names(custom)
        raise ValueError(
            f"unknown manifold {target!r}{did_you_mean(name, valid)}; valid: {', '.join(valid)}; "
            f"parametric: {SPEC_SYNTAX}"
        )
    return label, get_manifold(target)


OWN_MANIFOLD_HINT = "a manifold of your own: --manifolds MODULE (a module that calls manifolds.register)"
"""How a rule of the command line or a config file reaches a manifold the user wrote."""


def validate_rule(text: str | Rule, custom_names: Iterable[str] = ()) -> Rule:
    """Parse a rule and check that its target resolves (``custom_names`` count as valid); return it.

    ``ValueError`` naming the rule and the valid targets otherwise (for ``TrainConfig.validate``); for
    a name no manifold is registered under, with the closest one and `OWN_MANIFOLD_HINT`.
    """
    rule = parse_rule(text) if isinstance(text, str) else text
    names = {n.lower() for n in custom_names}
    if isinstance(rule.target, str) and "".join(rule.target.split()).lower() in names:
        return rule
    try:
        resolve_target(rule.target, dict.fromkeys(names))
    except ValueError as exc:
        name = "".join(rule.target.split()).lower().partition("@")[0] if isinstance(rule.target, str) else None
        unregistered = name is not None and name not in (*manifold_names(), ADAMW)
        hint = f"; {OWN_MANIFOLD_HINT}" if unregistered else ""
        raise ValueError(f"rule {str(rule)!r}: {exc}{hint}") from None
    return rule


def is_matrix(name: str, p: torch.Tensor) -> bool:
    """The default eligibility of `assign`: a manifold (or Muon) rule may take 2-D parameters."""
    return p.dim() == 2


def is_gpt_matrix(name: str, p: torch.Tensor) -> bool:
    """The eligibility the GPT trainer uses: 2-D parameters, and the ``(3, C, C)`` ``c_attn`` of a
    ``split_qkv`` model (`geomtrain.model.SplitQKV`: $W_Q$, $W_K$, $W_V$, each constrained)."""
    return p.dim() == 2 or (p.dim() == 3 and fnmatch.fnmatchcase(name, ATTENTION_GLOBS[0]))


def _check_rule_matches(
    rule: Rule,
    is_manifold: bool,
    named: Sequence[tuple[str, torch.Tensor]],
    eligible: Callable[[str, torch.Tensor], bool],
    eligible_desc: str,
) -> None:
    """``ValueError`` if ``rule`` matches no parameter, or (a manifold rule) no eligible one."""
    names = [n for n, _ in named]
    hits = [(n, p) for n, p in named if fnmatch.fnmatchcase(n, rule.pattern)]
    if not hits:
        close = difflib.get_close_matches(rule.pattern, names, n=3, cutoff=0.0) or names[:3]
        raise ValueError(f"rule {str(rule)!r} matches no parameter; closest names: {', '.join(close)}")
    if is_manifold and not any(eligible(n, p) for n, p in hits):
        n, p = hits[0]
        kinds = "of other shapes" if eligible is is_matrix else "it may not take"
        raise ValueError(
            f"rule {str(rule)!r} matches no matrix (only {len(hits)} parameter(s) {kinds}, "
            f"e.g. {n} {tuple(p.shape)}); manifold rules apply to {eligible_desc}"
        )


def assign(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    preset: str | None = "hetero",
    rules: Sequence[Rule | str] = (),
    custom_manifolds: Mapping[str, GramManifold] | None = None,
    eligible: Callable[[str, torch.Tensor], bool] = is_matrix,
    eligible_desc: str = "2-D weights",
) -> list[Assignment]:
    """Assign every parameter: custom ``rules`` first (in order), then the ``preset``'s rules.

    A manifold rule matches eligible parameters only (by default 2-D ones); an ``adamw`` rule
    matches any. The first matching rule wins; an unmatched parameter goes to AdamW.

    Args:
        named_parameters: e.g. ``model.named_parameters()``.
        preset: a name from `PRESETS`, or ``None`` for rules only.
        rules: `Rule` objects or ``"GLOB=TARGET"`` strings; they take precedence. Each must
            match at least one parameter (a manifold rule: one matrix), else ``ValueError``.
        custom_manifolds: extra ``name -> GramManifold`` targets usable by name in rules
            (names registered with `manifolds.register` need no entry here).
        eligible: ``(name, parameter) -> bool``, which parameters a manifold rule may take
            (default `is_matrix`; `geomtrain.groups.param_groups` also admits conv kernels and
            excludes embeddings).
        eligible_desc: what ``eligible`` admits, in words, for the error of a rule matching none.
    """
    named = list(named_parameters)
    user_rules = [parse_rule(r) if isinstance(r, str) else r for r in rules]
    all_rules = user_rules + (preset_rules(preset) if preset is not None else [])
    cache: dict[str, tuple[str, GramManifold | None]] = {}  # one instance per distinct spec
    resolved = []
    for rule in all_rules:  # validate every rule up front
        key = rule.target if isinstance(rule.target, str) else id(rule.target)
        if key not in cache:
            try:
                cache[key] = resolve_target(rule.target, custom_manifolds)
            except ValueError as exc:
                raise ValueError(f"rule {str(rule)!r}: {exc}") from None
        resolved.append((rule, *cache[key]))
    for rule, label, _ in resolved[: len(user_rules)]:
        _check_rule_matches(rule, label != ADAMW, named, eligible, eligible_desc)
    out = []
    for name, p in named:
        label, manifold = ADAMW, None
        for rule, t_label, t_manifold in resolved:
            if (t_label == ADAMW or eligible(name, p)) and fnmatch.fnmatchcase(name, rule.pattern):
                label, manifold = t_label, t_manifold
                break
        optimizer = "adamw" if label == ADAMW else "muon"
        out.append(Assignment(name, tuple(p.shape), optimizer, None if optimizer == "adamw" else label, manifold))
    return out


def assignment_label(preset: str | None, rules: Sequence[str] = ()) -> str:
    """What a run's assignment is called in legends and tables: its preset (``"hetero"``) or, with manifold
    rules, the rules first and the preset that takes the rest (``"*.attn.*=stiefel *.mlp.*=euclidean, rest
    hetero"``): a rules run is not labelled as the preset it overrides."""
    if not rules:
        return preset or "-"
    return " ".join(rules) + (f", rest {preset}" if preset else "")


def format_table(assignments: Sequence[Assignment], notes: Mapping[str, str] | None = None) -> str:
    """A plain-text table: parameter, shape, optimizer, manifold (a ``solver`` column when an assignment
    has one, and a ``note`` column, by parameter name, when ``notes`` has any)."""
    notes = {k: v for k, v in (notes or {}).items() if v}
    solvers = any(a.solver is not None for a in assignments)
    rows = [
        ("parameter", "shape", "optimizer", "manifold")
        + (("solver",) if solvers else ())
        + (("note",) if notes else ())
    ]
    rows += [
        (a.name, "x".join(map(str, a.shape)), a.optimizer, a.manifold_name or "-")
        + ((a.solver or "-",) if solvers else ())
        + ((notes.get(a.name, ""),) if notes else ())
        for a in assignments
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
