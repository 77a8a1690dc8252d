"""Training speed per preset, measured side by side in one process.

``measure_step_times`` is the timing loop; ``measure_training_speed`` builds one trainer per
preset (same model, data, batch and seed), does ``warmup`` untimed steps, then times ``steps``
full training steps (forward, backward, clipping, AdamW and Manifold Muon) and reports the median
ms per step, tokens per second and the ratios to ``adamw`` and ``unconstrained``. Presets are
interleaved round-robin, step by step, so slow drift of a shared machine affects all of them
alike. ``geomtrain bench train`` prints the table.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Mapping, Sequence

from .._io import atomic_write_json, environment_record, writable_output
from ..assign import PRESETS
from ..config import TrainConfig, check_integer, make_config, non_negative_int, parse_assignments, positive_int
from ..model import model_config
from .syncs import count_host_syncs, counted_in_steps

__all__ = ["measure_step_times", "measure_training_speed", "format_speed_table", "add_parser"]


def measure_step_times(
    configs: Mapping[str, TrainConfig],
    steps: int = 10,
    warmup: int = 2,
    log: Callable[[str], None] | None = None,
    evaluations: dict[str, list[int]] | None = None,
    syncs: dict[str, int] | None = None,
    muon_syncs: dict[str, int] | None = None,
) -> dict[str, list[float]]:
    """Seconds per full training step of each config, ``steps`` timed after ``warmup`` untimed ones.

    The one timing loop of the project (``bench train`` and the study's overhead suite): one
    trainer per config, stepped **interleaved** round-robin so a shared machine's slow drift hits
    them all alike; on CUDA the step time includes a ``torch.cuda.synchronize``. Nothing is
    written (the trainers have no run folder). ``log`` gets one line per step (a run cut short
    still shows what it measured); ``evaluations``, if given, is filled with the Manifold Muon
    polar evaluations (``msign_calls``) of each timed step; ``syncs``, if given, with the host
    synchronisations of each config's last warmup step (`geomtrain.bench.syncs`: what a GPU step would
    wait for; counted untimed, since counting slows the step; not counted for compiled models), and
    ``muon_syncs`` with those made inside its Manifold Muon ``step()`` (the part the solver decides)."""
    from ..train import Trainer

    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0; got {steps}, {warmup}")
    trainers = {label: Trainer(cfg) for label, cfg in configs.items()}
    times: dict[str, list[float]] = {label: [] for label in configs}
    for i in range(warmup + steps):
        for label, trainer in trainers.items():
            if syncs is not None and i == warmup - 1 and not configs[label].compile:  # no modes in compiled code
                with count_host_syncs() as counts, counted_in_steps(trainer.muon, counts) as inside:
                    result = trainer.step()
                syncs[label] = sum(counts.values())
                if muon_syncs is not None and trainer.muon is not None:
                    muon_syncs[label] = inside[0]
            else:
                result = trainer.step()
            calls = int(result.muon.get("msign_calls", 0) or 0)
            if log is not None:
                kind = "warmup" if i < warmup else "timed"
                log(f"  {label} step {i + 1} ({kind}): {1000 * result.seconds:.1f} ms, {calls} evaluations")
            if i >= warmup:
                times[label].append(result.seconds)
                if evaluations is not None:
                    evaluations.setdefault(label, []).append(calls)
    return times


def measure_training_speed(
    model: str = "mini",
    data_dir: str = "data/classics",
    presets: Sequence[str] = PRESETS,
    steps: int = 10,
    warmup: int = 2,
    batch_size: int | None = None,
    device: str = "auto",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    sets: Mapping[str, object] | None = None,
) -> list[dict]:
    """Median step time of each preset; rows with ``preset``, ``ms_per_step``, ``tokens_per_s``,
    ``evaluations_per_step`` (median polar evaluations of Manifold Muon), ``host_syncs_per_step`` and
    ``muon_host_syncs_per_step`` (those of the whole step and of its Manifold Muon ``step()``, counted on the
    last warmup step), ``muon_solver`` (its registered name, an alias such as ``gram_newton`` reading
    ``exact``; ``default``: per mask, `geomtrain.optim.default_solver`) and ratios. ``sets``: config
    overrides for every preset (``bench train --set``, e.g. ``muon_solver_options``); a key that the
    timing protocol sets itself (below, and ``batch_size``, which has its own argument) is a ValueError."""
    if not presets:
        raise ValueError(f"no preset given; valid: {', '.join(PRESETS)}")
    check_integer("steps", steps, 1)
    check_integer("warmup", warmup, 0)
    configs = {}
    for preset in presets:
        overrides = dict(
            model=model,
            data_dir=data_dir,
            preset=preset,
            seed=seed,
            max_iters=warmup + steps,
            warmup_iters=1,
            progress=False,
            diagnostics=False,
            eval_iters=1,
            device=device,
        )
        fixed = sorted(set(sets or {}) & {*overrides, "batch_size"})
        if fixed:
            raise ValueError(f"--set {fixed[0]} is set by bench train itself; settable: any other config key")
        if batch_size is not None:
            overrides["batch_size"] = batch_size
        configs[preset] = make_config({**(sets or {}), **overrides})
    evaluations: dict[str, list[int]] = {}
    syncs: dict[str, int] = {}
    muon_syncs: dict[str, int] = {}
    times = measure_step_times(configs, steps, warmup, log, evaluations, syncs, muon_syncs)
    rows = [speed_row(preset, cfg, times, evaluations, syncs, muon_syncs) for preset, cfg in configs.items()]
    base = {r["preset"]: r["ms_per_step"] for r in rows}
    for r in rows:
        r["vs_adamw"] = r["ms_per_step"] / base["adamw"] if "adamw" in base else None
        r["vs_unconstrained"] = r["ms_per_step"] / base["unconstrained"] if "unconstrained" in base else None
    return rows


def speed_row(preset: str, cfg: TrainConfig, times, evaluations, syncs, muon_syncs) -> dict:
    """One preset's row of `measure_training_speed` (without the ratios), from `measure_step_times`' outputs."""
    from ..optim import get_solver

    ms = 1000 * statistics.median(times[preset])
    tokens = cfg.batch_size * cfg.grad_accum * (cfg.block_size or model_config(cfg.model).block_size)
    return {
        "preset": preset,
        "ms_per_step": ms,
        "tokens_per_s": tokens / (ms / 1000),
        "evaluations_per_step": statistics.median(evaluations.get(preset, [0])),
        "host_syncs_per_step": syncs.get(preset),  # None without a warmup step
        "muon_host_syncs_per_step": muon_syncs.get(preset),  # None as well for adamw (no Manifold Muon)
        "muon_solver": get_solver(cfg.muon_solver).name if cfg.muon_solver else "default",
    }


def format_speed_table(rows: list[dict]) -> str:
    """Markdown table of :func:`measure_training_speed` rows."""
    lines = [
        "| preset | ms/step | tokens/s | evaluations/step | host syncs/step | in Manifold Muon | x adamw "
        "| x unconstrained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        cells = [
            r["preset"],
            f"{r['ms_per_step']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r.get('evaluations_per_step', 0):.0f}",
            "-" if r.get("host_syncs_per_step") is None else str(r["host_syncs_per_step"]),
            "-" if r.get("muon_host_syncs_per_step") is None else str(r["muon_host_syncs_per_step"]),
            fmt(r["vs_adamw"]),
            fmt(r["vs_unconstrained"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cmd_train(args) -> int:

    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    bad = [s for s in presets if s not in PRESETS]
    if bad:
        raise ValueError(f"unknown preset {bad[0]!r}; valid: {', '.join(PRESETS)}")
    sets = parse_assignments(args.sets)
    if args.out:
        writable_output(args.out)  # before minutes of timing, not after
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    rows = measure_training_speed(
        args.model, args.data_dir, presets, args.steps, args.warmup, args.batch_size, args.device, log=log, sets=sets
    )
    print(format_speed_table(rows))
    if args.out:
        record = {
            "model": args.model,
            "data_dir": args.data_dir,
            "steps": args.steps,
            "warmup": args.warmup,
            "sets": args.sets,
            "rows": rows,
            "environment": environment_record(args.device),
        }
        atomic_write_json(args.out, record)
    return 0


def add_parser(sub) -> None:
    """Register ``train`` on the ``geomtrain bench`` subparsers."""
    from ..model import MODEL_CONFIGS
    from ..optim import solver_names

    p = sub.add_parser(
        "train",
        help="training step time per preset, side by side (ratios to adamw and unconstrained)",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("--model", choices=tuple(MODEL_CONFIGS), default="mini")
    p.add_argument("--data-dir", default="data/classics")
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per preset")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first")
    p.add_argument("--batch-size", type=positive_int, default=None)
    p.add_argument("--threads", type=non_negative_int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every preset, repeatable (e.g. muon_solver_options=compute_dtype=float64; "
        f"muon_solver: one of {', '.join(solver_names())})",
    )
    p.add_argument("--quiet", action="store_true", help="no line per step on stderr")
    p.set_defaults(handler=_cmd_train)
