"""The README's "By hand" block and the guides' `geomtrain` lines run as written, in order.

Each document is walked top to bottom in its own scratch folder: a git repository holding only the
project's `.gitignore`, with `.venv` linked to this interpreter's environment (as after
`make setup`) and the `data/` folders of the previous walk (a reader of the guides has followed the
README). Every command line runs in bash exactly as written, with smaller sizes appended
(`SMALL_FLAGS`), and must exit with 0, or with the code its comment documents (`... (exit 2)`).
The README walk sees PATH without the environment (it is not activated); the guides, which write
bare `geomtrain`, see it first on PATH. After each walk, `git status` may show no new untracked
file: everything a command writes must land under a git-ignored folder.
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
}

# Files the guides assume the reader wrote (docs/training.md shows this example of my.toml).
READER_FILES = {"docs/training.md": {"my.toml": 'preset = "all-stiefel"\n'}}

INVOCATION = re.compile(r"^(\S+=\S+\s+)*(\.venv/bin/)?(geomtrain|torchrun|python3? -m geomtrain)\b")


def code_blocks(text: str) -> list[list[tuple[int, str]]]:
    """The fenced code blocks of a Markdown text, as lists of (line number, line)."""
    blocks, current = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if current is None:
                current = []
            else:
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
    """The lines of a guide's code blocks that invoke geomtrain (directly or under torchrun)."""
    text = (REPO / name).read_text()
    return [(n, line) for block in code_blocks(text) for n, line in joined_lines(block) if INVOCATION.match(line)]


def subcommand(words: list[str]) -> str:
    """`train`, `eval`, `bench train`, ...: the words after the geomtrain invocation."""
    i = next(i for i, w in enumerate(words) if w == "geomtrain" or w.endswith("/geomtrain"))
    return " ".join(words[i + 1 : i + 3]) if words[i + 1] == "bench" else words[i + 1]


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


def scratch_clone(folder: Path, data_from: Path | None) -> Path:
    """A git repository with the project's .gitignore, `.venv` (linked) and a copy of data/."""
    folder.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    shutil.copy(REPO / ".gitignore", folder / ".gitignore")
    (folder / ".git" / "info" / "exclude").write_text("/.venv\n/.gitignore\n")  # the checkout's own files
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
    left = sorted(untracked(folder) - before)
    if left:
        failures.append(f"{doc}: the walk left files that git does not ignore: {', '.join(left)}")
    return failures


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git for the untracked-file check")
def test_documented_commands_run_as_written(tmp_path):
    without_venv = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != VENV_BIN)
    activated = os.pathsep.join([str(VENV_BIN), without_venv])
    walks = [
        ("README.md", readme_commands(), without_venv),
        ("docs/training.md", guide_commands("docs/training.md"), activated),
        ("docs/runs.md", guide_commands("docs/runs.md"), activated),
    ]
    all_lines = [line for _, commands, _ in walks for _, line in commands]
    assert not [key for key in SKIPPED if not any(key in line for line in all_lines)], "stale SKIPPED entries"
    failures, skipped, previous = [], [], None
    for doc, commands, path_env in walks:
        assert commands, f"no commands found in {doc}"
        folder = scratch_clone(tmp_path / Path(doc).stem, previous)
        failures += walk(doc, commands, folder, path_env, skipped)
        previous = folder
    print("\n".join(skipped))
    assert not failures, "\n".join(failures)
