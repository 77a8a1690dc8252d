"""Command lines of the study: ``geomtrain study`` (with the modes ``toy``, ``overhead``, ``compare``, ``pack`` and
``unpack``) and ``geomtrain report``.

:func:`add_study_parser` and :func:`add_report_parser` register them on the ``geomtrain`` subparsers; each sets
``handler=fn(args) -> int``. A user error raises :class:`StudyError` (a ``ValueError``): the caller prints it as one
line and exits 2. :func:`main` does that on its own (``main(["--model", ...])``, ``main(["report", DIR])``,
``main(["toy", ...])``, ``main(["overhead", ...])``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .plan import (
    PRESET_ORDER,
    SUITES,
    StudyError,
    check_solver_names,
    parse_seeds,
    parse_sweep,
    plan,
    shared_config,
)
from .tune import DEFAULT_FRACTION, TuneProtocol, describe_tuning, parse_tune, selection_seeds, validate_selection

__all__ = ["DEFAULT_TOKENIZER", "add_study_parser", "add_report_parser", "command_argv", "main"]

DEFAULT_TOKENIZER = "bpe4k"  # the study's default corpus: data/classics-bpe4k (docs/results.md)
# what defines a tuned study's selection, recorded at any value (a default of these has changed before)
TUNE_PROTOCOL = ("select_seeds", "tune_fraction", "tune_max_extend", "tune_passes")


# ----------------------------------------------------------------------------- shared options
def command_argv(args: argparse.Namespace, always: tuple[str, ...] = ()) -> list[str]:
    """The command's arguments, rebuilt from the parsed ``args`` in the parser's order (those that
    differ from their default, and the options named in ``always`` at any value, so the command
    still replays if a default changes): what ``study.json`` records as the command line."""
    out: list[str] = []
    for action in args.recorded_actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default and action.dest not in always:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true
            out.append(flag)
        elif isinstance(value, list):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


def _add(p: argparse.ArgumentParser, recorded: list, *flags: str, **kw) -> None:
    recorded.append(p.add_argument(*flags, **kw))


def _add_config_options(p: argparse.ArgumentParser, recorded: list) -> None:
    """Data, config file, ``--set`` and device: shared by the study and its overhead mode."""
    from ..data import TOKENIZERS

    _add(
        p,
        recorded,
        "--data-dir",
        default=None,
        help="prepared data (default: data/classics-<tokenizer>, prepared if missing)",
    )
    _add(
        p,
        recorded,
        "--tokenizer",
        default=None,
        choices=TOKENIZERS,
        help=f"tokenizer used to prepare missing data (default: {DEFAULT_TOKENIZER})",
    )
    _add(p, recorded, "--config", default=None, metavar="FILE.toml", help="TOML with shared config keys")
    _add(
        p,
        recorded,
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="shared config override (repeatable)",
    )
    _add(p, recorded, "--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")


def _config_inputs(args) -> tuple[dict, dict, str, str, bool]:
    """``(sets, toml, tokenizer, data_dir, explicit_data)`` from the shared options."""
    from ..config import load_toml, parse_assignments
    from ..data import default_data_dir

    sets = parse_assignments(args.sets, what="--set")
    try:
        toml = load_toml(args.config) if args.config else {}
    except OSError as exc:
        raise StudyError(f"--config {args.config}: {exc.strerror or exc}") from None
    tokenizer = args.tokenizer or DEFAULT_TOKENIZER
    explicit = bool(args.data_dir or "data_dir" in sets or "data_dir" in toml)
    data_dir = (
        args.data_dir
        or sets.get("data_dir")
        or toml.get("data_dir")
        or str(default_data_dir("classics", tokenizer=tokenizer))
    )
    return sets, toml, tokenizer, data_dir, explicit


def _comma_list(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


# ----------------------------------------------------------------------------- geomtrain study
def add_study_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``study`` (and its modes ``toy`` and ``overhead``) on the ``geomtrain`` subparsers.

    Long only because it declares the twenty-odd options one after the other; no logic."""
    from ..assign import PRESETS
    from ..model import MODEL_CONFIGS
    from .autoassign import GRANULARITIES

    p = subparsers.add_parser(
        "study",
        help="the module-wise manifold study (suites of runs, report, figures)",
        description=(
            "Train every variant of a suite for every seed with shared settings, then write the report "
            "(results.md/csv, summary.json, figures). Resumable: rerun the same command to continue. "
            "`geomtrain report OUT` rebuilds the report; the modes `toy` and `overhead` below run the "
            "single-layer attention demo and the interleaved step-time measurement."
        ),
    )
    rec: list = []
    _add(p, rec, "--model", default="mini", help=f"model config: {', '.join(MODEL_CONFIGS)} (default: mini)")
    _add(p, rec, "--suite", default="presets", help=f"one of {', '.join(SUITES)} (default: presets)")
    _add(
        p,
        rec,
        "--presets",
        default=None,
        help=f"comma-separated presets (default: the suite's); valid: {', '.join(PRESETS)}",
    )
    sweep_help = "run every preset at every value of a config key, as given (lr alone: min_lr held; --tune moves it)"
    _add(p, rec, "--sweep", default=None, metavar="KEY=V1,V2", help=sweep_help)
    _add_comparison_options(p, rec)
    _add(p, rec, "--bounds", default=None, help="bounded suite: comma-separated column-norm bounds (default: 1,2)")
    _add(p, rec, "--seeds", default="1", help="number of seeds (3 -> 0,1,2) or a list (0,5,7); default 1")
    _add(p, rec, "--iters", type=int, default=None, help="training iterations per run (default: the model's max_iters)")
    _add(
        p,
        rec,
        "--out",
        default=None,
        help="study folder (report, study.json; runs/ inside unless --runs-dir); required",
    )
    _add(p, rec, "--runs-dir", default=None, help="where the run folders go (default: OUT/runs)")
    _add_config_options(p, rec)
    _add(
        p,
        rec,
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads per run (default: torch's, i.e. OMP_NUM_THREADS; with --jobs: CPU count // jobs)",
    )
    _add(
        p,
        rec,
        "--jobs",
        type=int,
        default=1,
        help="runs trained at once, each in its own process (default: 1); results do not depend on it",
    )
    _add(
        p,
        rec,
        "--probe-iters",
        type=int,
        default=None,
        help="autoassign: steps of each probe run (default: iters // 4)",
    )
    _add(p, rec, "--granularity", default="module", help=f"autoassign: {' | '.join(GRANULARITIES)} (default: module)")
    _add(p, rec, "--drop-checkpoints", action="store_true", help="delete ckpt.pt of runs that are done (saves disk)")
    _add(p, rec, "--no-report", action="store_true", help="train only; write the report later: geomtrain report OUT")
    _add(p, rec, "--dry-run", action="store_true", help="print the plan (variants, seeds, config) and stop")
    _add(p, rec, "--quiet", action="store_true", help="only the final table")
    p.set_defaults(handler=run_study_command, recorded_actions=rec)
    modes = p.add_subparsers(dest="mode", metavar="MODE")
    _add_toy_parser(modes)
    _add_overhead_parser(modes)
    _add_compare_parser(modes)
    _add_pack_parsers(modes)
    return p


def _add_comparison_options(p: argparse.ArgumentParser, rec: list) -> None:
    """Arms, tuning and the paired statistics (docs/studies.md has the whole protocol)."""
    g = p.add_argument_group("fair comparisons (docs/studies.md)")
    _add(g, rec, "--solvers", default=None, help="Muon solvers, one arm each (default,exact -> hetero, hetero+exact)")
    tune_help = "tune each arm on --select-seeds, then confirm on --seeds (repeatable: keys searched in turn)"
    _add(g, rec, "--tune", action="append", default=[], metavar="[PRESET:]KEY=V1,V2,V3", help=tune_help)
    _add(g, rec, "--select-seeds", default="1", help="--tune: a count (2 -> 1000,1001) or a list (default: 1)")
    _add(g, rec, "--tune-fraction", type=float, default=DEFAULT_FRACTION, help="selection steps / --iters (default: 1)")
    _add(g, rec, "--tune-max-extend", type=int, default=2, help="--tune: points a grid may grow by (default: 2)")
    _add(g, rec, "--tune-passes", type=int, default=3, help="--tune, several keys: most passes over them (default: 3)")
    ref_help = "what arms pair with: an arm, or +SOLVER, or both (default: unconstrained, where the study has it)"
    _add(g, rec, "--reference", default=None, help=ref_help)
    _add(g, rec, "--delta", type=float, default=0.005, help="'level' within ±DELTA (default: 0.005)")


def _check_study_args(args) -> None:
    from .autoassign import GRANULARITIES

    if args.out is None:
        raise StudyError("the following argument is required: --out")
    if args.granularity not in GRANULARITIES:
        raise StudyError(f"unknown granularity {args.granularity!r}; valid: {', '.join(GRANULARITIES)}")
    for name in ("jobs", "threads", "iters"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise StudyError(f"--{name} must be >= 1; got {value}")


def _tune_options(args) -> dict:
    """``{"tune": protocol}`` of the ``--tune`` flags (empty without them)."""
    if not args.tune:
        return {}
    protocol = TuneProtocol(
        grids=parse_tune(args.tune),
        select_seeds=selection_seeds(args.select_seeds),
        fraction=args.tune_fraction,
        max_extend=args.tune_max_extend,
        max_passes=args.tune_passes,
    )
    return {"tune": protocol.check(parse_seeds(args.seeds)).to_dict()}


def _bounds(text: str | None) -> list[float] | None:
    try:
        return [float(b) for b in text.split(",") if b.strip()] if text else None
    except ValueError:
        raise StudyError(f"--bounds {text!r}: give comma-separated numbers, e.g. 1,2") from None


def run_study_command(args) -> int:
    """``geomtrain study``: plan (every run config validated), prepare missing data, train, report.

    (One straight sequence of those phases; just over 60 lines.)"""
    from .runner import ensure_data, run_study, threads_per_worker

    _check_study_args(args)
    sets, toml, tokenizer, data_dir, explicit_data = _config_inputs(args)
    base = shared_config(args.model, args.iters, data_dir, args.device, toml, sets)
    presets, bounds = _comma_list(args.presets), _bounds(args.bounds)
    options = {
        "probe_iters": args.probe_iters,
        "granularity": args.granularity,
        "threads": args.threads,
        "tokenizer": tokenizer,
        "bounds": bounds,
        "presets": presets,
        "reference": args.reference,
        "delta": args.delta,
        **_tune_options(args),
    }
    study = plan(
        args.out,
        suite=args.suite,
        presets=presets,
        sweep=parse_sweep(args.sweep),
        bounds=bounds,
        seeds=parse_seeds(args.seeds),
        base=base,
        runs_dir=args.runs_dir,
        argv=command_argv(args, always=TUNE_PROTOCOL if args.tune else ()),
        options=options,
        solvers=_comma_list(args.solvers),
    )
    if study.options.get("tune"):
        validate_selection(study)
    if args.dry_run:
        print(f"suite {study.suite}: {len(study.variants)} variants x {len(study.seeds)} seeds -> {study.runs_dir}")
        for v in study.variants:
            print(
                f"  {v.name}: preset {v.preset}"
                + (f", rules {v.rules}" if v.rules else "")
                + (f", {v.overrides}" if v.overrides else "")
            )
        print("shared config: " + json.dumps(study.base))
        if study.options.get("tune"):
            print("tuning: " + json.dumps(study.options["tune"]))
            print("\n".join(describe_tuning(study)))
        return 0
    say = (lambda *a, **k: None) if args.quiet else print
    # the default data folder is prepared when missing; an explicit one only with --tokenizer
    ensure_data(base["data_dir"], tokenizer if (args.tokenizer or not explicit_data) else None, print_fn=say)
    # with --jobs each worker gets CPU count // jobs threads; work done here (autoassign probes) too
    threads = args.threads or (threads_per_worker(args.jobs) if args.jobs > 1 else None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    code = run_study(
        study,
        print_fn=say,
        report_after=not args.no_report,
        drop_checkpoints=args.drop_checkpoints,
        workers=args.jobs,
        threads=args.threads,
    )
    if args.quiet and not args.no_report:
        from .collect import collect
        from .report import format_table

        print(format_table(collect(study.out)["table"]))
    return code


# ----------------------------------------------------------------------------- geomtrain study toy
def _add_toy_parser(modes) -> None:
    from .toy import DEFAULT_SCALES

    p = modes.add_parser(
        "toy",
        help="softmax saturation in one attention layer as W_Q, W_K are scaled up",
        description="Softmax saturation in one attention layer as W_Q, W_K are scaled up.",
    )
    rec: list = []
    _add(p, rec, "--out", required=True, help="folder for toy.json and toy_saturation.png")
    _add(p, rec, "--scales", default=",".join(f"{s:g}" for s in DEFAULT_SCALES), help="comma-separated scales s")
    _add(p, rec, "--tokens", type=int, default=64)
    _add(p, rec, "--d-model", type=int, default=64)
    _add(p, rec, "--d-head", type=int, default=16)
    _add(p, rec, "--seed", type=int, default=0)
    p.set_defaults(handler=run_toy_command, recorded_actions=rec)


def run_toy_command(args) -> int:
    """``geomtrain study toy``: :func:`geomtrain.study.toy_attention`, written to ``--out``."""
    from .toy import toy_attention, write_toy

    try:
        scales = [float(s) for s in args.scales.split(",") if s.strip()]
    except ValueError:
        raise StudyError(f"--scales {args.scales!r}: give comma-separated numbers > 0") from None
    if (
        not scales
        or any(s <= 0 for s in scales)
        or min(args.tokens, args.d_model, args.d_head) < 1
        or args.d_head > args.d_model
    ):
        raise StudyError("--scales must be > 0, --tokens/--d-model/--d-head >= 1 and d_head <= d_model")
    result = toy_attention(scales, args.tokens, args.d_model, args.d_head, args.seed)
    written = write_toy(result, args.out, "geomtrain study toy " + shlex.join(command_argv(args)))
    for s, lg, h, j, gq in zip(
        result["scale"], result["max_abs_logit"], result["mean_entropy"], result["jacobian_norm"], result["grad_wq"]
    ):
        print(f"s={s:<5g} max|logit|={lg:8.2f} entropy={h:.3f} jacobian={j:.2e} |dL/dWq|={gq:.2e}")
    print(f"wrote {' and '.join(str(p) for p in written)}")
    return 0


# ----------------------------------------------------------------------------- geomtrain study overhead
def _add_overhead_parser(modes) -> None:
    from ..model import MODEL_CONFIGS

    p = modes.add_parser(
        "overhead",
        help="step time of every preset and Muon solver, interleaved in one process",
        description=(
            "Step time of every preset (and Manifold Muon solver), measured interleaved in one process; "
            "writes overhead.json, overhead.md and overhead_solvers.png."
        ),
    )
    rec: list = []
    _add(p, rec, "--model", default="mini", help=f"one of {', '.join(MODEL_CONFIGS)}")
    _add(p, rec, "--presets", default=",".join(PRESET_ORDER), help="comma-separated presets")
    _add(p, rec, "--solvers", default="default", help="comma-separated Muon solvers (default: the optimizer's default)")
    _add(p, rec, "--steps", type=int, default=20, help="timed steps per configuration")
    _add(p, rec, "--warmup", type=int, default=3, help="untimed steps first")
    _add_config_options(p, rec)
    _add(p, rec, "--out", required=True)
    p.set_defaults(handler=run_overhead_command, recorded_actions=rec)


def _solvers(text: str) -> list[str | None]:
    names = _comma_list(text) or ["default"]
    check_solver_names(names)
    return [None if x == "default" else x for x in names]


def run_overhead_command(args) -> int:
    """``geomtrain study overhead``: every configuration validated, data prepared if missing, then
    :func:`geomtrain.study.measure_overhead`, written to ``--out``."""
    from .._io import environment_record, writable_output
    from ..train import resolve_device
    from .collect import round_sig
    from .overhead import format_overhead_table, measure_overhead, overhead_configs, write_overhead
    from .runner import data_record, ensure_data

    presets, solvers = _comma_list(args.presets) or [], _solvers(args.solvers)
    if args.steps < 1 or args.warmup < 0:
        raise StudyError("--steps must be >= 1 and --warmup >= 0")
    sets, toml, tokenizer, data_dir, explicit_data = _config_inputs(args)
    base = shared_config(args.model, None, data_dir, args.device, toml, sets)
    overhead_configs(base, presets, solvers, args.steps, args.warmup)  # every config valid before any work
    writable_output(args.out, folder=True)  # and the folder its results go to
    ensure_data(data_dir, tokenizer if (args.tokenizer or not explicit_data) else None)
    t0 = time.time()
    rows = measure_overhead(base, presets, solvers, args.steps, args.warmup)
    record = {
        "command": "geomtrain study overhead " + shlex.join(command_argv(args)),
        "base_config": base,
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": rows,
        "wall_s": round_sig(time.time() - t0),
        "environment": environment_record(resolve_device(args.device)),
        "data": data_record(data_dir),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    written = write_overhead(record, args.out)
    print(format_overhead_table(rows))
    print(f"wrote {', '.join(p.name for p in written)} in {args.out}")
    return 0


# ----------------------------------------------------------------------------- geomtrain study compare
def _add_compare_parser(modes) -> None:
    p = modes.add_parser(
        "compare",
        help="several study folders side by side (table, orderings, gap to unconstrained vs steps)",
        description=(
            "Compare finished study folders: one table of final val and train losses with their gaps "
            "to each study's unconstrained run, the ordering in each, and the gap against the number of "
            "steps when the studies differ in length, with differences paired by seed. Writes "
            "compare.json/md/csv, val_curves.png (and gap_vs_steps.png) to --out; `geomtrain report OUT` "
            "rebuilds them."
        ),
    )
    rec: list = []
    _add(p, rec, "--out", required=True, help="folder for the comparison")
    _add(
        p,
        rec,
        "--across-commits",
        action="store_true",
        help="pair studies made at different commits (refused by default: the code may differ)",
    )
    p.add_argument("studies", nargs="+", metavar="LABEL=FOLDER", help="a label and a study folder")
    p.set_defaults(handler=run_compare_command, recorded_actions=rec)


def run_compare_command(args) -> int:
    """``geomtrain study compare``: :func:`geomtrain.study.compare.compare`."""
    from .compare import compare

    pairs = []
    for text in args.studies:
        label, sep, folder = text.partition("=")
        if not sep or not label or not folder:
            raise StudyError(f"{text!r} must look like LABEL=FOLDER, e.g. exact=docs/results/main-exact")
        pairs.append((label, folder))
    flags = ["--across-commits"] if args.across_commits else []
    command = "geomtrain study compare " + shlex.join(["--out", args.out, *flags, *args.studies])
    compare(args.out, pairs, command, print_fn=print, across_commits=args.across_commits)
    return 0


# ----------------------------------------------------------------------------- geomtrain study pack / unpack
def _add_pack_parsers(modes) -> None:
    p = modes.add_parser(
        "pack",
        help="an unfinished study and its runs in one archive, to continue on another machine",
        description=(
            "Write a study folder and its runs folder into one .tar.xz (checksummed, read back before it "
            "replaces an older archive): what resuming needs, without the checkpoints of runs that are "
            "done. Stop the study first. `geomtrain study unpack` restores it elsewhere."
        ),
    )
    p.add_argument("out", metavar="STUDY", help="the study's --out folder")
    p.add_argument("archive", metavar="ARCHIVE", help="the .tar.xz to write")
    p.add_argument("--runs-dir", default=None, help="where its runs are (default: as recorded in study.json)")
    p.add_argument("--restart-unfinished", action="store_true", help="leave out runs not done: they start again")
    p.set_defaults(handler=run_pack_command, recorded_actions=[])
    p = modes.add_parser(
        "unpack",
        help="restore a `study pack` archive, then rerun the study's command to continue",
        description=(
            "Restore a study folder and its runs folder from a `geomtrain study pack` archive. Refuses "
            "targets that are not empty; verifies every file before anything appears there."
        ),
    )
    p.add_argument("archive", metavar="ARCHIVE")
    p.add_argument("out", metavar="STUDY", help="the study folder to create")
    p.add_argument("--runs-dir", default=None, help="where to put its runs (default: the study's own --runs-dir)")
    p.set_defaults(handler=run_unpack_command, recorded_actions=[])


def run_pack_command(args) -> int:
    """``geomtrain study pack``: :func:`geomtrain.study.pack.pack`."""
    from .pack import pack

    manifest = pack(args.out, args.archive, args.runs_dir, args.restart_unfinished)
    size = Path(args.archive).stat().st_size
    print(f"packed {len(manifest['files'])} files of {args.out} into {args.archive} ({size / 1e6:.1f} MB)")
    return 0


def run_unpack_command(args) -> int:
    """``geomtrain study unpack``: :func:`geomtrain.study.pack.unpack`."""
    from .pack import unpack

    out, runs = unpack(args.archive, args.out, args.runs_dir)
    study = json.loads((out / "study.json").read_text())
    command = study["command"]
    if study.get("runs_dir") and Path(study["runs_dir"]) != runs:
        command += f" (with --runs-dir {runs} in place of {study['runs_dir']})"
    print(f"unpacked {out} and {runs}; to continue, rerun: {command}")
    return 0


# ----------------------------------------------------------------------------- geomtrain report
def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``report`` on the ``geomtrain`` subparsers."""
    p = subparsers.add_parser(
        "report",
        help="rebuild a study's results table and figures",
        description="Rebuild a study's results table and figures.",
    )
    p.add_argument(
        "out",
        nargs="+",
        metavar="FOLDER",
        help="a study folder (holding study.json or summary.json), or one or more run folders",
    )
    p.add_argument("--runs-dir", default=None, help="where a study's runs are (default: as recorded in study.json)")
    p.set_defaults(handler=run_report_command)
    return p


def run_report_command(args) -> int:
    """``geomtrain report STUDY``: :func:`geomtrain.study.report`; ``geomtrain report RUN [RUN ...]``:
    a table of plain run folders (:func:`geomtrain.runfolder.runs_table`)."""
    from ..runfolder import runs_table
    from .compare import is_comparison, rebuild
    from .report import report

    if len(args.out) == 1 and is_comparison(args.out[0]):
        rebuild(args.out[0])
        return 0
    studies = [f for f in args.out if (Path(f) / "study.json").exists() or (Path(f) / "summary.json").exists()]
    if studies and len(args.out) > 1:
        raise StudyError("give one study folder, or only run folders")
    if studies:
        report(args.out[0], args.runs_dir)
    else:
        print(runs_table(args.out))
    return 0


# ----------------------------------------------------------------------------- standalone entry
class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`StudyError` (one line) instead of printing usage."""

    def error(self, message):
        raise StudyError(message)


def main(argv: Sequence[str] | None = None) -> int:
    """``main(["--model", ...])`` runs a study, ``main(["report", DIR])`` rebuilds a report,
    ``main(["toy", "--out", DIR])`` runs the toy demonstration, ``main(["overhead", "--out", DIR])``
    measures step times interleaved. Bad input: one line on stderr, exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    root = _Parser(prog="geomtrain")
    commands = root.add_subparsers(dest="command", required=True)
    add_study_parser(commands)
    add_report_parser(commands)
    if argv[:1] == ["report"]:
        prog = "geomtrain report"
    else:
        argv = ["study", *argv]
        prog = "geomtrain study" + (
            f" {argv[1]}" if argv[1:2] in (["toy"], ["overhead"], ["compare"], ["pack"], ["unpack"]) else ""
        )
    try:
        args = root.parse_args(argv)
        return int(args.handler(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
