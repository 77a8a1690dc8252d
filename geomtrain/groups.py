r"""ManifoldMuon and AdamW param groups for any ``nn.Module``, in one call: `param_groups`.

```python
groups = geomtrain.param_groups(model, rules={"body.*": "stiefel", "head.*": "adamw"})
print(groups)                                     # the assignment table
muon = ManifoldMuon(groups.muon, lr=0.02)
adamw = torch.optim.AdamW(groups.adamw, lr=1e-3)
```

**Rules** are `geomtrain.assign` rules: an ``fnmatch`` glob on parameter names mapped to a
manifold name of the `manifolds` registry (``"stiefel"``, ``"dgram"``, ``"bdgram@1.5"``, a name
added with `manifolds.register`), a `manifolds.GramManifold` instance, ``"euclidean"`` (plain
Muon) or ``"adamw"``; the first matching rule wins, a parameter no rule matches goes to AdamW,
and a rule matching nothing is an error. ``preset`` adds the GPT-2 presets of `assign` (they match
our `GPT` and Hugging Face ``GPT2LMHeadModel`` names alike).

**What Muon may take.** Matrices (and, with ``conv=``, kernels); vectors and scalars always go
to AdamW, without weight decay. ``nn.Embedding`` weights (and weights tied to them, like GPT-2's
``lm_head``) and the output layer (names ``lm_head.*``, or a Hugging Face model's
``get_output_embeddings()``) go to AdamW even when a glob matches them, unless
``embeddings="rules"`` / ``lm_head="rules"``.

**Orientation.** Every manifold constrains the *smaller* Gram of a matrix (columns of a tall
one, rows of a wide one), and the constraint set is closed under transposition: $W$ is on it
iff $W^\top$ is. So a layout that stores a layer as ``(in, out)``, as Hugging Face's GPT-2
``Conv1D`` does, gets the same constraint as the ``(out, in)`` ``nn.Linear`` of the same layer;
nothing needs transposing. (Euclidean Muon's shape factor $\sqrt{\max(1, \text{rows}/\text{cols})}$
does read the stored layout: see the docs page.)

**Kernels** (3+-dim weights ``(out, in, *k)``) need ``conv=``: ``"flatten"`` constrains the
``(out, in * prod(k))`` matrix (Muon's own view of a kernel), ``"batch"`` each of the ``prod(k)``
``(out, in)`` matrices of its taps. The module is re-parametrised in place
(`torch.nn.utils.parametrize`, `MatrixView`): the parameter the optimizer sees *is* that matrix
(batch), ``module.weight`` is still the kernel, and the state-dict key becomes
``<module>.parametrizations.weight.original``. ``ManifoldMuon`` treats leading dims of a
manifold parameter as a batch, so both views are exact; its Euclidean path flattens any
3+-dim tensor, so ``conv="batch"`` with ``"euclidean"`` is refused.

Constrained matrices are projected onto their manifold (``project=True``); `ParamGroups.moved`
says how far each moved, $\|\pi(W) - W\|_F / \|W\|_F$.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from manifolds import GramManifold

from .assign import ADAMW, Assignment, Rule, assign, format_table
from .optim import default_solver, get_solver, solver_names

__all__ = [
    "param_groups",
    "ParamGroups",
    "MatrixView",
    "project_onto_manifolds",
    "CONV_VIEWS",
    "INCLUDE_CHOICES",
    "LM_HEAD_GLOBS",
    "optimizer_groups",
    "build_optimizers",
    "parse_solver_rule",
    "pick_solvers",
    "logical_parameters",
    "reserved_for_adamw",
]

CONV_VIEWS = ("flatten", "batch")
INCLUDE_CHOICES = ("adamw", "rules")  # embeddings= / lm_head=: always AdamW, or follow the rules
LM_HEAD_GLOBS = ("lm_head.*", "*.lm_head.*")  # the output layer of our GPT and of Hugging Face LM heads
EUCLIDEAN = "euclidean"


class MatrixView(nn.Module):
    r"""A parametrization storing an ``(out, in, *k)`` kernel as the matrix (batch) a manifold constrains.

    ``"flatten"``: stored ``(out, in * prod(k))``, the kernel is its reshape. ``"batch"``: stored
    ``(prod(k), out, in)``, matrix ``t`` is the tap ``W[:, :, *index(t)]``.
    """

    def __init__(self, kernel_shape: Sequence[int], view: str):
        super().__init__()
        if view not in CONV_VIEWS:
            raise ValueError(f"unknown conv view {view!r}; valid: {', '.join(CONV_VIEWS)}")
        self.kernel_shape, self.view = tuple(kernel_shape), view

    def stored_shape(self) -> tuple[int, ...]:
        out, inp, *k = self.kernel_shape
        return (out, inp * math.prod(k)) if self.view == "flatten" else (math.prod(k), out, inp)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if self.view == "flatten":
            return X.reshape(self.kernel_shape)
        return X.movedim(0, -1).reshape(self.kernel_shape)

    def right_inverse(self, W: torch.Tensor) -> torch.Tensor:
        if self.view == "flatten":
            return W.reshape(W.shape[0], -1)
        return W.reshape(*W.shape[:2], -1).movedim(-1, 0).contiguous()

    def extra_repr(self) -> str:
        return f"{self.view}: kernel {_fmt(self.kernel_shape)} stored as {_fmt(self.stored_shape())}"


@dataclass
class ParamGroups:
    """What `param_groups` returns: hand ``muon`` to ``ManifoldMuon`` and ``adamw`` to ``torch.optim.AdamW``.

    ``muon`` has one group per manifold and solver (keys ``params``, ``manifold``, ``manifold_name``,
    ``solver`` where a solver rule picked one; empty when every parameter goes to AdamW), ``adamw`` up
    to two (matrices with ``weight_decay`` when one was given, vectors with 0). ``assignments`` lists
    every parameter once, by the name the rules see (a re-parametrised kernel by its module's
    ``weight``), with the shape the optimizer sees; ``parameters`` maps those names to the tensors;
    ``views`` names the re-parametrised kernels; ``moved`` the relative projection distance of each
    constrained matrix.
    """

    muon: list[dict]
    adamw: list[dict]
    assignments: list[Assignment]
    parameters: dict[str, torch.Tensor]
    views: dict[str, str] = field(default_factory=dict)
    moved: dict[str, float] = field(default_factory=dict)

    def table(self) -> str:
        """The assignment table (`geomtrain.assign.format_table`, kernel views as notes)."""
        notes = {name: f"kernel {view}" for name, view in self.views.items()}
        return format_table(self.assignments, notes)

    def __str__(self) -> str:
        return self.table()


def param_groups(
    model: nn.Module,
    preset: str | None = None,
    rules: Sequence[Rule | str] | Mapping[str, str | GramManifold] = (),
    *,
    embeddings: str = "adamw",
    lm_head: str = "adamw",
    conv: str | None = None,
    weight_decay: float | None = None,
    custom_manifolds: Mapping[str, GramManifold] | None = None,
    project: bool = True,
    solver_rules: Sequence[str] = (),
) -> ParamGroups:
    """ManifoldMuon and AdamW param groups for any module (see the module docstring).

    Args:
        model: any ``nn.Module``.
        preset: a GPT-2 preset of `geomtrain.assign.PRESETS`, or ``None`` (rules only).
        rules: ``"GLOB=TARGET"`` strings, `geomtrain.assign.Rule` objects, or a ``{glob: target}``
            mapping (in order); targets: a registry name or spec, a ``GramManifold``,
            ``"euclidean"`` or ``"adamw"``. Each rule must match a parameter.
        embeddings: ``"adamw"`` (``nn.Embedding`` weights always to AdamW) or ``"rules"``.
        lm_head: ``"adamw"`` (the output layer always to AdamW) or ``"rules"``.
        conv: how a kernel given to Muon is viewed: ``"flatten"``, ``"batch"``, or ``None``
            (a kernel matched by a Muon rule is then a ``ValueError``).
        weight_decay: AdamW weight decay of its matrices (``None``: the optimizer's default).
        custom_manifolds: extra ``name -> GramManifold`` rule targets.
        project: project constrained matrices onto their manifold now.
        solver_rules: ``"GLOB=SOLVER"`` strings (`pick_solvers`): a Muon matrix a glob matches gets that
            direction solver (its group carries ``solver``); the others the optimizer's.
    """
    _check_options(model, embeddings, lm_head, conv)
    if isinstance(rules, Mapping):
        rules = [Rule(pattern, target) for pattern, target in rules.items()]
    named, views = logical_parameters(model)
    reserved = reserved_for_adamw(model, named, embeddings, lm_head)
    eligible = lambda name, p: p.dim() >= 2 and id(p) not in reserved  # noqa: E731
    assignments = assign(named, preset, rules, custom_manifolds, eligible, _eligible_desc(embeddings, lm_head))
    params = dict(named)
    kernels = _kernels_to_view(assignments, params, views, conv)  # every check before the model changes
    for a in kernels:
        module_name, _, attr = a.name.rpartition(".")
        parametrize.register_parametrization(model.get_submodule(module_name), attr, MatrixView(a.shape, conv))
        views[a.name] = conv
        a.shape = tuple(params[a.name].shape)  # the same Parameter, now stored as the view
    pick_solvers(assignments, solver_rules)
    muon, adamw = optimizer_groups(assignments, params, weight_decay)
    moved = project_onto_manifolds(params, assignments) if project else {}
    return ParamGroups(muon, adamw, assignments, params, views, moved)


def _check_options(model: object, embeddings: str, lm_head: str, conv: str | None) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"param_groups needs a torch.nn.Module; got {type(model).__name__}")
    for option, value in (("embeddings", embeddings), ("lm_head", lm_head)):
        if value not in INCLUDE_CHOICES:
            raise ValueError(f"{option}={value!r}; valid: {', '.join(map(repr, INCLUDE_CHOICES))}")
    if conv is not None and conv not in CONV_VIEWS:
        raise ValueError(f"conv={conv!r}; valid: {', '.join(map(repr, CONV_VIEWS))} or None")


def _eligible_desc(embeddings: str, lm_head: str) -> str:
    """What a Muon rule may take, in words (for the error of a rule that matches none of it)."""
    excluded = [w for w, v in (("embeddings", embeddings), ("lm_head", lm_head)) if v == "adamw"]
    if not excluded:
        return "parameters of 2+ dims"
    include = " or ".join(f"{w}='rules'" for w in excluded)
    return f"parameters of 2+ dims other than {' and '.join(excluded)} (set {include} to include them)"


def _kernels_to_view(
    assignments: Sequence[Assignment], params: Mapping[str, torch.Tensor], views: Mapping[str, str], conv: str | None
) -> list[Assignment]:
    """The Muon kernels (3+ dims, not viewed yet) to re-parametrise; ``ValueError`` (one line) if
    one needs a ``conv`` view that was not given or cannot be honoured."""
    out = []
    for a in assignments:
        if a.name in views and conv is not None and views[a.name] != conv:
            raise ValueError(
                f"{a.name} is already viewed as conv={views[a.name]!r} (an earlier param_groups "
                f"call); build a fresh model for conv={conv!r}"
            )
        if a.optimizer != "muon" or a.name in views or params[a.name].dim() <= 2:
            continue
        if conv is None:
            raise ValueError(
                f"{a.name} is a {len(a.shape)}-dim kernel ({_fmt(a.shape)}) matched by a Muon rule "
                f"({a.manifold_name}); say how to view it: conv='flatten' or conv='batch', "
                f"or send it to AdamW with a rule '{a.name}=adamw' first"
            )
        if conv == "batch" and a.manifold_name == EUCLIDEAN:
            raise ValueError(
                f"{a.name}: conv='batch' needs a manifold target; Euclidean Muon flattens 3+-dim "
                "tensors (use conv='flatten' there)"
            )
        out.append(a)
    return out


def logical_parameters(model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """``model.named_parameters()`` with a `MatrixView`-parametrised weight named as its module's
    ``weight`` (``conv.weight``, not ``conv.parametrizations.weight.original``), and those views."""
    renamed, views = {}, {}
    for prefix, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for attr, plist in module.parametrizations.items():
            if len(plist) == 1 and isinstance(plist[0], MatrixView):
                dot = f"{prefix}." if prefix else ""
                renamed[f"{dot}parametrizations.{attr}.original"] = f"{dot}{attr}"
                views[f"{dot}{attr}"] = plist[0].view
    return [(renamed.get(n, n), p) for n, p in model.named_parameters()], views


def reserved_for_adamw(
    model: nn.Module, named: Sequence[tuple[str, torch.Tensor]], embeddings: str, lm_head: str
) -> set[int]:
    """Ids of the parameters that go to AdamW whatever the rules say: embedding weights (and
    weights tied to them) when ``embeddings == "adamw"``, the output layer when ``lm_head == "adamw"``."""
    reserved: set[int] = set()
    if embeddings == "adamw":
        reserved |= {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)}
    if lm_head == "adamw":
        reserved |= {id(p) for n, p in named if any(fnmatch.fnmatchcase(n, g) for g in LM_HEAD_GLOBS)}
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
        if isinstance(head, nn.Module):
            reserved |= {id(p) for p in head.parameters()}
    return reserved


def parse_solver_rule(text: str) -> tuple[str, str]:
    """``"GLOB=SOLVER"`` (e.g. ``"*.mlp.*=exact"``) -> ``(glob, canonical solver name)``;
    a one-line ``ValueError`` for a malformed entry or an unknown solver (the registry's message)."""
    pattern, sep, name = (part.strip() for part in str(text).partition("="))
    if not sep or not pattern or not name:
        raise ValueError(
            f"solver rule {text!r} must look like GLOB=SOLVER with SOLVER one of: {', '.join(solver_names())}"
        )
    try:
        return pattern, get_solver(name).name
    except ValueError as exc:
        raise ValueError(f"solver rule {text!r}: {exc}") from None


def pick_solvers(
    assignments: Sequence[Assignment], rules: Sequence[str] = (), default: str | None = None, by_kind: bool = False
) -> list[Assignment]:
    """Set ``solver`` of every Muon assignment, in place: the solver of the first rule (``"GLOB=SOLVER"``,
    `parse_solver_rule`) whose glob matches its name, else ``default``; with ``default`` ``None``, the
    default for its manifold kind (`geomtrain.optim.default_solver`) where ``by_kind``, else ``None`` (the
    optimizer decides, by the same rule, unless it is given a ``solver``).

    Like a manifold rule (`geomtrain.assign.assign`), a solver rule that matches no Muon matrix is a
    one-line ``ValueError`` naming the rule and the closest Muon matrix names. Returns ``assignments``."""
    parsed = [(text, *parse_solver_rule(text)) for text in rules]
    muon = [a for a in assignments if a.optimizer == "muon"]
    names = [a.name for a in muon]
    for text, pattern, _ in parsed:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.0) or names[:3]
            raise ValueError(
                f"solver rule {text!r} matches no Muon matrix; closest: {', '.join(close) or 'none (no Muon matrix)'}"
            )
    for a in muon:
        a.solver = next((solver for _, pattern, solver in parsed if fnmatch.fnmatchcase(a.name, pattern)), default)
        if a.solver is None and by_kind:
            a.solver = default_solver(a.manifold)
    return list(assignments)


def optimizer_groups(
    assignments: Sequence[Assignment], params: Mapping[str, torch.Tensor], weight_decay: float | None = None
) -> tuple[list[dict], list[dict]]:
    """``(muon_groups, adamw_groups)``: one ManifoldMuon group per (manifold object, solver), with the
    names of its parameters (``param_names``, torch.optim's key: ManifoldMuon names skipped updates by
    it) and ``solver`` when the assignments carry one (`pick_solvers`; else the optimizer's default);
    AdamW matrices (with ``weight_decay`` unless ``None``) and vectors (weight decay 0) in separate
    groups."""
    by_key: dict[tuple[int, str | None], dict] = {}  # by manifold object: two BoundedDGram instances must not merge
    for a in assignments:
        if a.optimizer == "muon":
            group = by_key.get((id(a.manifold), a.solver))
            if group is None:
                group = {"params": [], "param_names": [], "manifold": a.manifold, "manifold_name": a.manifold_name}
                group.update({"solver": a.solver} if a.solver is not None else {})
                by_key[id(a.manifold), a.solver] = group
            group["params"].append(params[a.name])
            group["param_names"].append(a.name)
    adam = [params[a.name] for a in assignments if a.optimizer == ADAMW]
    matrices = {"params": [p for p in adam if p.dim() >= 2]}
    if weight_decay is not None:
        matrices["weight_decay"] = weight_decay
    vectors = {"params": [p for p in adam if p.dim() < 2], "weight_decay": 0.0}
    return list(by_key.values()), [g for g in (matrices, vectors) if g["params"]]


@torch.no_grad()
def project_onto_manifolds(params: Mapping[str, torch.Tensor], assignments: Sequence[Assignment]) -> dict[str, float]:
    r"""Project each constrained (non-Euclidean) matrix onto its manifold in place; return
    $\|\pi(W) - W\|_F / \|W\|_F$ per name (0 for a point already on it)."""
    moved = {}
    for a in assignments:
        if a.manifold is not None and a.manifold_name != EUCLIDEAN:
            p = params[a.name]
            w = p.detach().float()
            projected = a.manifold.projx(w)
            moved[a.name] = float((projected - w).norm() / w.norm().clamp_min(1e-30))
            p.copy_(projected.to(p.dtype))
    return moved


def _fmt(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


def build_optimizers(model: torch.nn.Module, assignments, cfg):
    """AdamW for the ``adamw`` parameters (weight decay on 2-D ones only) and ManifoldMuon for
    the ``muon`` parameters of a `geomtrain.config.TrainConfig` ``cfg``, one param group per manifold and solver
    (`optimizer_groups`;
    ``muon_solver_rules`` pick a Muon matrix's solver, `pick_solvers`, which sets each assignment's
    ``solver``: a rule's, else ``muon_solver``, else the default for its manifold kind,
    `geomtrain.optim.default_solver`). ``muon_solver_options`` are ``muon_solver``'s: a rule's other solver
    runs with its defaults. Returns ``(adamw, muon_or_None)``."""
    from .optim import ManifoldMuon, get_solver

    run_solver = get_solver(cfg.muon_solver).name if cfg.muon_solver is not None else None
    pick_solvers(assignments, cfg.muon_solver_rules, run_solver, by_kind=True)
    muon_groups, adam_groups = optimizer_groups(assignments, dict(model.named_parameters()), cfg.weight_decay)
    for group in muon_groups:
        if group["solver"] != run_solver:
            group["solver_options"] = {}
    adamw = torch.optim.AdamW(adam_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    if not muon_groups:
        return adamw, None
    kwargs = dict(
        lr=cfg.muon_lr,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        weight_decay=cfg.muon_weight_decay,
        bucketed=cfg.bucketed,
    )
    if cfg.muon_solver is not None:
        kwargs["solver"] = cfg.muon_solver
    if cfg.muon_solver_options:
        kwargs["solver_options"] = cfg.solver_options()
    return adamw, ManifoldMuon(muon_groups, certify_every=cfg.muon_certify_every, **kwargs)
