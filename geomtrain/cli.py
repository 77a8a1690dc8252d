"""Command line: ``geomtrain prepare | train | sample | bench | study | report``.

Every ``TrainConfig`` field is a ``train`` flag (``--max-iters 200``, ``--no-diagnostics``);
``--config FILE.toml`` supplies a base; flags win. Bad input prints one line naming the valid
choices and exits with code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path

__all__ = ["main", "build_parser"]


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


def _field_type(f: dataclasses.Field):
    hint = typing.get_type_hints(_train_config_cls())[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and args:
        hint = args[0]
    return hint


def _train_config_cls():
    from .config import TrainConfig

    return TrainConfig


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    from .assign import PRESETS, TARGETS
    from .config import TrainConfig

    p.add_argument("--config", metavar="FILE.toml", help="TOML file with config keys (flags override it)")
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/ckpt.pt if present")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _field_type(f)
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"(default: {default!r}, or the model's)" if f.name in ("max_iters", "batch_size") else f"(default: {default!r})"
        if f.name == "rules":
            p.add_argument("--rule", dest="rules", action="append", default=None, metavar="GLOB=TARGET",
                           help=f"manifold rule applied before the preset; TARGET in {', '.join(TARGETS)} (repeatable)")
        elif f.name == "preset":
            p.add_argument(flag, choices=PRESETS, default=None, help=f"manifold assignment preset {help_text}")
        elif f.name == "dtype":
            p.add_argument(flag, choices=("float32", "bfloat16"), default=None, help=help_text)
        elif kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            p.add_argument(flag, type=kind, default=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    from .data import DATASETS, TOKENIZERS
    from .model import MODEL_CONFIGS

    parser = argparse.ArgumentParser(prog="geomtrain", description="Manifold Muon on GPT-2: data, training, sampling, benchmarks, the study.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare", help="tokenize a corpus into train/val token files with a manifest")
    p.add_argument("--dataset", choices=DATASETS, default="classics", help="corpus (default: classics = Shakespeare + King James Bible)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="gpt2",
                   help="gpt2 (the original 50257-token BPE) or a byte-level BPE of 4k/8k/16k tokens trained on the train split")
    p.add_argument("--out", default=None, help="output folder (default: data/<dataset> or data/<dataset>-<tokenizer>)")
    p.add_argument("--text-files", nargs="+", default=None, help="files or folders of .txt for --dataset text")
    p.add_argument("--force", action="store_true", help="rebuild even if the prepared files verify")

    p = sub.add_parser("train", help="train a GPT-2 with a manifold assignment")
    _add_train_flags(p)

    p = sub.add_parser("sample", help="generate text from a run's checkpoint")
    p.add_argument("run_dir", help="a run folder (holding ckpt.pt) or a checkpoint file")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")

    sub.add_parser("bench", help="benchmarks (see `geomtrain bench --help`)", add_help=False)
    sub.add_parser("study", help="the module-wise manifold study (see `geomtrain study --help`)", add_help=False)
    sub.add_parser("report", help="rebuild a study's tables and figures (see `geomtrain report --help`)", add_help=False)
    parser.epilog = f"models: {', '.join(MODEL_CONFIGS)}"
    return parser


def _cmd_prepare(args) -> int:
    from .data import default_data_dir, prepare

    if args.dataset == "text" and not args.text_files:
        raise CLIError("--dataset text needs --text-files FILE_OR_DIR ...")
    manifest = prepare(args.out, dataset=args.dataset, tokenizer=args.tokenizer, force=args.force, text_files=args.text_files)
    splits = manifest["splits"]
    out = args.out or default_data_dir(args.dataset, tokenizer=args.tokenizer)
    print(f"prepared {args.dataset} in {out}: train {splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,} tokens "
          f"({manifest['tokenizer']}, vocab {manifest['vocab_size']})")
    return 0


def _cmd_train(args) -> int:
    from .config import TrainConfig, make_config
    from .train import distributed_from_env, train

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    cfg = make_config(overrides, toml_path=args.config)
    with distributed_from_env():
        status = train(cfg, resume=args.resume)
    return {"finished": 0, "interrupted": 130}.get(status["status"], 1)


def _cmd_sample(args) -> int:
    import torch

    from .data import load_tokenizer
    from .model import GPT, GPTConfig
    from .train import load_checkpoint

    path = Path(args.run_dir)
    path = path / "ckpt.pt" if path.is_dir() else path
    if not path.exists():
        raise CLIError(f"no checkpoint at {path}")
    ckpt = load_checkpoint(path, map_location=args.device)
    model = GPT(GPTConfig(**ckpt["model_config"])).to(args.device)
    model.load_state_dict(ckpt["model"])
    model.eval()
    tok = load_tokenizer(ckpt["config"]["data_dir"])
    ids = tok.encode(args.prompt) or [tok.eot_token]
    idx = torch.tensor([ids], dtype=torch.long, device=args.device)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, generator=gen)
    print(tok.decode(out[0].tolist()))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # bench / study / report own their parsers (they live in their modules).
    if argv and argv[0] in ("bench", "study", "report"):
        import importlib

        module = importlib.import_module(f".{'bench' if argv[0] == 'bench' else 'study'}", __package__)
        rest = argv[1:] if argv[0] != "report" else ["report", *argv[1:]]
        return int(module.main(rest) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"prepare": _cmd_prepare, "train": _cmd_train, "sample": _cmd_sample}
    try:
        return handlers[args.command](args)
    except (CLIError, ValueError, FileNotFoundError) as exc:
        print(f"geomtrain {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
