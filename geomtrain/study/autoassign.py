r"""Automatic manifold assignment: a first policy that picks a manifold per module group from
short probe runs and the spectral / attention diagnostics they record.

**Policy** (greedy, "safe first"):

1. Split the Muon-managed matrices into groups: ``module`` granularity = attention
   (``c_attn``, ``attn.c_proj``) and MLP (``c_fc``, ``mlp.c_proj``); ``kind`` = those four matrix
   kinds; ``layer`` = attention and MLP of every block.
2. Start with every group on the *safe* manifold (Stiefel: bounded spectrum) and probe it: the
   first ``probe_iters`` steps of the real schedule (same config, same seed, same batches as the
   full run; ``stop_after``), ending on an evaluation.
3. For each group in order, probe the current assignment with that group switched to the *free*
   manifold (DGram: scale freedom). Accept the switch when all three hold:

   - the probe is stable (no divergence);
   - its validation loss at the probe's end beats the current assignment's by more than
     ``min_gain``;
   - **saturation guard** (from the diagnostics, the paper's mechanism as a risk signal): in
     every layer, the attention's mean row entropy stays above ``entropy_ratio`` times the
     all-safe probe's, and its max |logit| below ``logit_ratio`` times the all-safe probe's.

The cost is ``1 + #groups`` probes of ``probe_iters`` steps (module granularity: 3 probes; with
the default ``probe_iters = max_iters // 4`` that is 0.75 of one full run). Probes are run
folders like any other, so an interrupted search resumes. The thresholds are fixed a priori,
not tuned on the study's outcome; everything each decision used is returned.

Known limits, by construction: the greedy order matters (attention is decided before the MLP);
early-training loss is a proxy for final loss; the guard only knows the softmax route to
instability; one seed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .._io import read_json, read_jsonl
from ..runfolder import RunFolder

__all__ = [
    "Policy",
    "GRANULARITIES",
    "groups_for",
    "rules_for",
    "probe",
    "saturation_guard",
    "propose",
    "matching_preset",
]

GRANULARITIES = ("module", "kind", "layer")


@dataclass(frozen=True)
class Policy:
    """Thresholds of the greedy policy (see the module docstring); fixed before any study ran."""

    safe: str = "stiefel"
    free: str = "dgram"
    min_gain: float = 0.0  # nats of probe val loss a switch must win by
    entropy_ratio: float = 0.75  # per-layer mean attention entropy must stay >= this x the all-safe probe's
    logit_ratio: float = 2.0  # per-layer max |logit| must stay <= this x the all-safe probe's


def groups_for(granularity: str, n_layer: int) -> dict[str, tuple[str, ...]]:
    """Group name -> parameter-name globs, in decision order (attention before MLP)."""
    from ..assign import ATTENTION_GLOBS, MLP_GLOBS

    if granularity == "module":
        return {"attention": tuple(ATTENTION_GLOBS), "mlp": tuple(MLP_GLOBS)}
    if granularity == "kind":
        return {
            "attn.c_attn": ("*.attn.c_attn.weight",),
            "attn.c_proj": ("*.attn.c_proj.weight",),
            "mlp.c_fc": ("*.mlp.c_fc.weight",),
            "mlp.c_proj": ("*.mlp.c_proj.weight",),
        }
    if granularity == "layer":
        out = {}
        for i in range(n_layer):
            out[f"h{i}.attention"] = (f"transformer.h.{i}.attn.c_attn.weight", f"transformer.h.{i}.attn.c_proj.weight")
        for i in range(n_layer):
            out[f"h{i}.mlp"] = (f"transformer.h.{i}.mlp.c_fc.weight", f"transformer.h.{i}.mlp.c_proj.weight")
        return out
    raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")


def rules_for(choice: Mapping[str, str], groups: Mapping[str, tuple[str, ...]]) -> list[str]:
    """``GLOB=MANIFOLD`` rules (used with preset ``adamw``, so unmatched parameters stay on AdamW)."""
    return [f"{glob}={choice[g]}" for g in groups for glob in groups[g]]


def matching_preset(choice: Mapping[str, str]) -> str | None:
    """The preset equal to ``choice`` when every attention group and every MLP group agree."""
    from ..assign import ATTENTION_GLOBS, MLP_GLOBS, PRESETS, preset_rules

    attn = {m for g, m in choice.items() if "att" in g}
    mlp = {m for g, m in choice.items() if "mlp" in g}
    if len(attn) != 1 or len(mlp) != 1:
        return None
    wanted = (attn.pop(), mlp.pop())
    for name in PRESETS:
        rules = preset_rules(name)
        a = {str(r.target) for r in rules if r.pattern in ATTENTION_GLOBS}
        m = {str(r.target) for r in rules if r.pattern in MLP_GLOBS}
        if len(a) == 1 and len(m) == 1 and (a.pop(), m.pop()) == wanted:
            return name
    return None


def probe(
    base: Mapping, rules: list[str], out_dir: Path, seed: int, probe_iters: int, print_fn: Callable = print
) -> dict:
    """Train (or reuse) the first ``probe_iters`` steps of a run with ``rules``; return its end
    state: val loss, status, and per-layer attention entropy / max |logit| and Q/K spectral norms
    at the last evaluation."""
    from ..config import make_config
    from ..train import train

    out_dir = Path(out_dir)
    cfg = make_config(
        {
            **base,
            "preset": "adamw",
            "rules": list(rules),
            "seed": seed,
            "out_dir": str(out_dir),
            "stop_after": probe_iters,
            "progress": False,
        }
    )
    status = read_json(out_dir / "status.json")
    old_cfg = RunFolder(out_dir).read_config()
    ignore = ("progress", "out_dir")
    same = old_cfg is not None and (
        {k: v for k, v in old_cfg.items() if k not in ignore}
        == {k: v for k, v in cfg.to_dict().items() if k not in ignore}
    )
    reusable = (
        status is not None
        and same
        and (status.get("status") in ("diverged", "failed") or status.get("step", 0) >= probe_iters)
    )
    if not reusable:
        resume = (out_dir / "ckpt.pt").exists() and same
        status = train(cfg, resume=resume, overwrite=not resume, print_fn=lambda *a, **k: None)  # else: a fresh start
        if status.get("status") == "interrupted" and status.get("step", 0) < probe_iters:
            raise KeyboardInterrupt  # Ctrl-C inside a probe: stop the search, never decide on a cut-short probe
    evals = [m for m in read_jsonl(out_dir / "metrics.jsonl") if m.get("kind") == "eval"]
    diags = read_jsonl(out_dir / "diagnostics.jsonl")
    last = diags[-1] if diags else {}
    att = sorted(last.get("attention", []), key=lambda a: a.get("layer", 0))
    qk = {}
    for m in last.get("matrices", []):
        if m.get("kind") in ("attn_q", "attn_k") and m.get("layer") is not None:
            qk.setdefault(m["layer"], []).append(m.get("sigma_max") or 0.0)
    diverged = status.get("status") in ("diverged", "failed")
    return {
        "rules": list(rules),
        "dir": str(out_dir),
        "status": "diverged" if diverged else "ok",
        "step": status.get("step"),
        "val_loss": evals[-1]["val_loss"] if evals and not diverged else None,
        "mean_entropy": [a.get("mean_entropy") for a in att],
        "max_abs_logit": [a.get("max_abs_logit") for a in att],
        "qk_sigma_product": [math.prod(qk[i]) for i in sorted(qk)],
    }


def saturation_guard(trial: dict, ref: dict, policy: Policy) -> tuple[bool, str]:
    """``(passed, why)``: in every layer, the ``trial`` probe's mean attention entropy stays at
    least ``policy.entropy_ratio`` x the all-safe probe ``ref``'s, and its max |logit| at most
    ``policy.logit_ratio`` x (layers without a value are skipped)."""
    for layer, (h, h0) in enumerate(zip(trial["mean_entropy"], ref["mean_entropy"])):
        if h is None or h0 is None:
            continue
        if h < policy.entropy_ratio * h0:
            return (
                False,
                f"layer {layer}: attention entropy {h:.3f} < {policy.entropy_ratio} x {h0:.3f} "
                f"(all-{policy.safe} probe)",
            )
    for layer, (z, z0) in enumerate(zip(trial["max_abs_logit"], ref["max_abs_logit"])):
        if z is None or z0 is None:
            continue
        if z > policy.logit_ratio * z0:
            return (
                False,
                f"layer {layer}: max |logit| {z:.2f} > {policy.logit_ratio} x {z0:.2f} (all-{policy.safe} probe)",
            )
    return True, "saturation guard passed"


def propose(
    base: Mapping,
    probe_dir: str | Path,
    seed: int = 0,
    probe_iters: int | None = None,
    granularity: str = "module",
    policy: Policy = Policy(),
    print_fn: Callable = print,
) -> dict:
    """Run the greedy policy; returns the choice, its rules and every probe and decision.

    One function on purpose: the policy of the module docstring reads top to bottom."""
    from ..model import model_config

    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    max_iters = int(base["max_iters"])
    every = int(base.get("eval_interval") or max(1, max_iters // 20))
    wanted = probe_iters or max(1, max_iters // 4)
    probe_iters = min(max_iters, every * max(1, math.ceil(wanted / every)))  # end on an evaluation
    groups = groups_for(granularity, model_config(base["model"]).n_layer)
    probe_dir = Path(probe_dir)
    choice = {g: policy.safe for g in groups}

    def run(name: str, assignment: dict) -> dict:
        print_fn(f"autoassign probe {name}: {probe_iters} steps ...")
        r = probe(base, rules_for(assignment, groups), probe_dir / name, seed, probe_iters, print_fn)
        r["name"], r["assignment"] = name, dict(assignment)
        loss = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"
        print_fn(f"autoassign probe {name}: {r['status']}, val loss {loss}")
        return r

    ref = run(f"all-{policy.safe}", choice)
    probes, decisions, current = [ref], [], ref
    for g in groups:
        trial_choice = {**choice, g: policy.free}
        trial = run(f"{g}-{policy.free}", trial_choice)
        probes.append(trial)
        if trial["status"] != "ok" or trial["val_loss"] is None:
            ok, why = False, "probe diverged"
        elif current["val_loss"] is None or not trial["val_loss"] < current["val_loss"] - policy.min_gain:
            ok, why = False, f"no gain: val loss {trial['val_loss']:.4f} vs {current['val_loss']:.4f}"
        else:
            ok, why = saturation_guard(trial, ref, policy)
            if ok:
                why = f"val loss {trial['val_loss']:.4f} < {current['val_loss']:.4f}; " + why
        decisions.append({"group": g, "candidate": policy.free, "accepted": ok, "reason": why})
        print_fn(f"autoassign: {g} -> {policy.free if ok else policy.safe} ({why})")
        if ok:
            choice, current = trial_choice, trial
    return {
        "policy": dataclasses.asdict(policy),
        "granularity": granularity,
        "seed": seed,
        "groups": {g: list(v) for g, v in groups.items()},
        "probe_iters": probe_iters,
        "probe_steps": probe_iters * len(probes),
        "probes": probes,
        "decisions": decisions,
        "choice": choice,
        "rules": rules_for(choice, groups),
        "matches_preset": matching_preset(choice),
    }
