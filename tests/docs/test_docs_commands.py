"""The README's "By hand" block and every guide's `geomtrain` lines run as written, in order.

The guides are every page of docs/ with a ```bash block that invokes geomtrain (`guides`), each walked
top to bottom (one test each) in its own scratch folder: a git repository holding only the project's
`.gitignore`, with `.venv` linked to this interpreter's environment (as after `make setup`), the files of
the checkout a page's commands name (`CHECKOUT_FILES`), and, for a guide, the `data/` folders that the
README and the training guide prepare (`make demo`'s data/classics-bpe8k and data/classics: a reader of
the guides has followed the README). The README walk starts without data. Every command line runs in
bash exactly as written, with smaller sizes appended (`SMALL_FLAGS`), and must exit with 0, or with the
code its comment documents (`... (exit 2)`). The README walk sees PATH without the environment (it is not
activated); the guides, which write bare `geomtrain`, see it first on PATH. After each walk, `git status`
may show no new untracked file: everything a command writes must land under a git-ignored folder, or
under docs/results/ where a reproduction command rebuilds a committed study (`COMMITTED_OUTPUTS`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.prefix) / "bin"

# Flags appended per command (later flags win in argparse), so a walk takes minutes, not hours.
TRAIN_FLAGS = "--max-iters 1 --eval-interval 1 --eval-iters 1 --batch-size 2 --block-size 16 --no-progress"
SMALL_FLAGS = {
    "train": TRAIN_FLAGS,
    "eval": "--iters 1 --batch-size 2",
    "sample": "--max-new-tokens 4",
    "bench optimizer": "--shapes 32x16 --repeats 1 --quiet",
    "bench train": "--steps 1 --warmup 0 --batch-size 2 --presets adamw,hetero --quiet",
    "bench manifold": "--shapes 48x16 --block 4 --repeats 1 --steps 1 --warmup 1",
    "study": "--model tiny --seeds 1 --iters 2 --jobs 1 --probe-iters 1 --quiet --set block_size=16 "
    "--set batch_size=2 --set eval_iters=1 --set eval_interval=1 --set diag_batch_size=2",
    "study overhead": "--model tiny --steps 1 --warmup 0 --set block_size=16 --set batch_size=2",
    "study compare": "",  # reads study folders: nothing to make smaller
}

# Lines that cannot run here, each with its reason; an entry that matches no line fails the test.
SKIPPED = {
    "--dataset classics+austen": "downloads Jane Austen's novels with apt-get (network); tests/test_data_austen.py",
    "--manifolds mypkg.mymanifolds": "imports the reader's own module",
    "--init-from ~/models/gpt2": "needs a local Hugging Face GPT-2 folder (nothing is downloaded)",
    "--device cuda": "needs a GPU",
    "geomtrain study pack": "needs a study's runs folder (hours of training); tests/test_study_pack.py",
    "geomtrain study unpack": "needs the archive of the skipped `study pack` line; tests/test_study_pack.py",
    "geomtrain study ...": "stands for the study's own command",
    "exact=docs/results/main-exact": "compares with docs/results/main-exact, which no walked line makes "
    "(lab/2026-12-01-study-suites main-exact: hours)",
}

# Files the guides assume the reader wrote (docs/training.md shows this example of my.toml).
READER_FILES = {"docs/training.md": {"my.toml": 'preset = "all-stiefel"\n'}}
# Files of the checkout a page's commands use, copied into its scratch folder.
CHECKOUT_FILES = {"docs/custom-manifold.md": ("docs/examples",)}
# Where a page's command may write files that git does not ignore: the committed studies it rebuilds.
COMMITTED_OUTPUTS = ("docs/results/",)
# The guides walked first, in a reader's order (the training guide prepares data/classics); the rest follow
# alphabetically.
READING_ORDER = ("docs/training.md", "docs/runs.md")
# What the guides assume prepared: `make demo`'s data (the README's first line) and the training guide's.
PREPARED = ("prepare --tokenizer bpe8k", "prepare")

INVOCATION = re.compile(r"^(\S+=\S+\s+)*(\.venv/bin/)?(geomtrain|torchrun|python3? -m geomtrain)\b")


def code_blocks(text: str, language: str | None = None) -> list[list[tuple[int, str]]]:
    """The fenced code blocks of a Markdown text (those opened with ``` + ``language`` where given), as lists
    of (line number, line)."""
    blocks, current, wanted = [], None, True
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if current is None:
                current, wanted = [], language is None or line[3:].strip() == language
            else:
                if wanted:
                    blocks.append(current)
                current = None
        elif current is not None:
            current.append((number, line))
    return blocks


def joined_lines(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines with their backslash continuations joined, numbered by their first line."""
    lines, pending, start = [], "", 0
    for number, line in block:
        if not pending:
            start = number
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        lines.append((start, pending))
        pending = ""
    return lines


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment): the line cut at its first unquoted `#` that starts a word."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def readme_commands() -> list[tuple[int, str]]:
    """Every non-empty line of the README's code block that follows "By hand"."""
    text = (REPO / "README.md").read_text()
    start = text.index("\nBy hand") + 1
    first_line = text[:start].count("\n") + 1
    block = next(b for b in code_blocks(text) if b and b[0][0] > first_line)
    return [(n, line) for n, line in joined_lines(block) if line.strip()]


def guide_commands(name: str) -> list[tuple[int, str]]:
    """The lines of a guide's ```bash blocks that invoke geomtrain (directly or under torchrun)."""
    text = (REPO / name).read_text()
    blocks = code_blocks(text, "bash")
    return [(n, line) for block in blocks for n, line in joined_lines(block) if INVOCATION.match(line)]


def guides() -> list[str]:
    """Every page of docs/ with a runnable geomtrain line: `READING_ORDER` first, then alphabetically."""
    pages = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md") if guide_commands(p))
    return [page for page in READING_ORDER if page in pages] + [page for page in pages if page not in READING_ORDER]


def subcommand(words: list[str]) -> str:
    """`train`, `eval`, `bench train`, `study`, `study overhead`, ...: the words after the geomtrain invocation."""
    i = next(i for i, w in enumerate(words) if w == "geomtrain" or w.endswith("/geomtrain"))
    two = " ".join(words[i + 1 : i + 3])
    return two if words[i + 1] == "bench" or two in SMALL_FLAGS else words[i + 1]


def shrunk(command: str) -> str:
    """The command with `SMALL_FLAGS` appended; `...` (the run's flags) stands for them, and a
    `train --resume` without `...` gets none (it continues with the run's own config)."""
    words = shlex.split(command)
    if not any(w == "geomtrain" or w.endswith("/geomtrain") for w in words):
        return command
    sub = subcommand(words)
    flags = SMALL_FLAGS.get(sub, "")
    if "..." in words:
        return command.replace(" ...", " " + flags if flags else "", 1)
    if sub == "train" and "--resume" in words:
        return command
    return f"{command} {flags}".rstrip()


def untracked(folder: Path) -> set[str]:
    status = ["git", "status", "--porcelain", "--untracked-files=all"]
    out = subprocess.run(status, cwd=folder, capture_output=True, text=True, check=True)
    return {line[3:] for line in out.stdout.splitlines() if line.startswith("??")}


def scratch_clone(folder: Path, doc: str, data_from: Path | None) -> Path:
    """A git repository with the project's .gitignore, `.venv` (linked), the checkout's files ``doc`` uses
    (`CHECKOUT_FILES`) and a copy of data/."""
    folder.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    shutil.copy(REPO / ".gitignore", folder / ".gitignore")
    own = ["/.venv", "/.gitignore"]  # the checkout's own files
    for name in CHECKOUT_FILES.get(doc, ()):
        shutil.copytree(REPO / name, folder / name)
        own.append(f"/{name}")
    (folder / ".git" / "info" / "exclude").write_text("".join(f"{name}\n" for name in own))
    (folder / ".venv").symlink_to(sys.prefix)
    if data_from is not None and (data_from / "data").is_dir():
        shutil.copytree(data_from / "data", folder / "data", copy_function=os.link)
    return folder


def walk(doc: str, commands: list[tuple[int, str]], folder: Path, path_env: str, skipped: list[str]) -> list[str]:
    """Run the commands in order in `folder`; the failures, one message each."""
    env = {**os.environ, "PATH": path_env, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    for name, content in READER_FILES.get(doc, {}).items():
        (folder / name).write_text(content)
    before = untracked(folder)
    failures = []
    for number, line in commands:
        command, comment = split_comment(line)
        reason = next((why for key, why in SKIPPED.items() if key in command), None)
        if reason:
            skipped.append(f"{doc}:{number}: {command}  [skipped: {reason}]")
            continue
        if m := re.fullmatch(r"export (\w+)=(\S+)", command):
            env[m.group(1)] = m.group(2)
            continue
        expected = int(m.group(1)) if (m := re.search(r"\(exit (\d+)\)", comment)) else 0
        run = shrunk(command)
        start = time.perf_counter()
        result = subprocess.run(["bash", "-c", run], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
        print(f"{time.perf_counter() - start:6.1f} s  exit {result.returncode}  {doc}:{number}: {run}", flush=True)
        if result.returncode != expected:
            tail = "\n    ".join((result.stdout + result.stderr).strip().splitlines()[-8:])
            failures.append(f"{doc}:{number}: `{run}` exited {result.returncode}, expected {expected}:\n    {tail}")
    left = sorted(f for f in untracked(folder) - before if not f.startswith(COMMITTED_OUTPUTS))
    if left:
        failures.append(f"{doc}: the walk left files that git does not ignore: {', '.join(left)}")
    return failures


def paths() -> tuple[str, str]:
    """PATH without this environment's bin (the README: not activated) and with it first (the guides)."""
    without_venv = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != VENV_BIN)
    return without_venv, os.pathsep.join([str(VENV_BIN), without_venv])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A folder whose data/ holds what the guides assume prepared (`PREPARED`), made by the CLI."""
    folder = tmp_path_factory.mktemp("prepared")
    env = {**os.environ, "PATH": paths()[1], "OMP_NUM_THREADS": "1"}
    for command in PREPARED:
        subprocess.run(["bash", "-c", f"geomtrain {command}"], cwd=folder, env=env, check=True, capture_output=True)
    return folder


def run_walk(doc: str, commands: list[tuple[int, str]], folder: Path, path_env: str) -> None:
    """Walk ``doc`` in ``folder``; print the skipped lines and fail on any failure."""
    assert commands, f"no commands found in {doc}"
    skipped: list[str] = []
    failures = walk(doc, commands, folder, path_env, skipped)
    print("\n".join(skipped))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git for the untracked-file check")
def test_readme_commands_run_as_written(tmp_path):
    run_walk("README.md", readme_commands(), scratch_clone(tmp_path / "README", "README.md", None), paths()[0])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git for the untracked-file check")
@pytest.mark.parametrize("doc", guides())
def test_guide_commands_run_as_written(doc, prepared, tmp_path):
    folder = scratch_clone(tmp_path / Path(doc).stem, doc, prepared)
    run_walk(doc, guide_commands(doc), folder, paths()[1])


def test_every_skipped_line_is_still_in_a_walked_page():
    lines = [line for _, line in readme_commands()] + [line for doc in guides() for _, line in guide_commands(doc)]
    assert not [key for key in SKIPPED if not any(key in line for line in lines)], "stale SKIPPED entries"


def test_every_page_with_runnable_commands_is_walked():
    # issue 53: the walk covered the README and two guides, not docs/custom-manifold.md (whose line failed)
    walked = guides()
    assert {"docs/training.md", "docs/runs.md", "docs/custom-manifold.md", "docs/manifold-muon.md"} <= set(walked)
    assert walked[: len(READING_ORDER)] == list(READING_ORDER)
    assert "docs/contributing.md" not in walked  # its diagrams name geomtrain in plain blocks, not ```bash ones


def test_custom_manifold_command_runs_after_make_demo():
    # issue 53: it used the default data folder, which `make demo` does not prepare, and the default out-dir,
    # which the README's first train line takes
    demo = (REPO / "Makefile").read_text().split("\ndemo:")[1].split("\n\n")[0]
    assert "prepare --tokenizer bpe8k" in demo and PREPARED[0] == "prepare --tokenizer bpe8k"
    # the fast class and the generic one (issue 55: the guide times the two), each into its own folder
    lines = [line for _, line in guide_commands("docs/custom-manifold.md") if "block_gram" in line]
    assert len(lines) == 2
    others = [line for _, line in readme_commands()] + [
        line for doc in READING_ORDER for _, line in guide_commands(doc)
    ]
    outs = set()
    for line in lines:
        words = shlex.split(line)
        assert words[words.index("--data-dir") + 1] == "data/classics-bpe8k"
        out = words[words.index("--out-dir") + 1]
        assert out not in demo and not any(f"--out-dir {out}" in other for other in others)
        outs.add(out)
    assert len(outs) == 2


def test_the_readme_rules_example_is_no_preset():
    # issue 53: `--rule '*.attn.*=stiefel' --rule '*.mlp.*=dgram'` was exactly `hetero`: one curve hid the other
    from geomtrain.assign import PRESETS, assign, is_gpt_matrix
    from geomtrain.model import GPT, model_config

    (line,) = [line for _, line in readme_commands() if "--rule" in line and "runs/rules" in line]
    words = shlex.split(split_comment(line)[0])
    rules = [words[i + 1] for i, w in enumerate(words) if w == "--rule"]
    named = list(GPT(model_config("tiny")).named_parameters())

    def table(preset, rules=()):
        return [(a.name, a.optimizer, a.manifold_name) for a in assign(named, preset, rules, eligible=is_gpt_matrix)]

    assert all(table("hetero", rules) != table(preset) for preset in PRESETS)
