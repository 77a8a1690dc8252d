"""lab/, the dated records of the solver experiments: a smoke test only.

Every script compiles and answers ``--help`` (and a shell one ``-h``) without working, none patches the library,
and every record's README names the commit it ran at, its command and its conclusion. The experiments themselves
are not rerun here.
"""

import ast
import os
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "lab"
RECORDS = sorted(p for p in LAB.iterdir() if p.is_dir())
SCRIPTS = sorted(LAB.glob("*/*.py"))
SHELL_SCRIPTS = sorted(LAB.glob("*/*.sh"))
LIBRARY = ("geomtrain", "manifolds")


def section(readme: str, title: str) -> str:
    """The text under the ``## title`` heading of a README, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", readme, flags=re.M | re.S)
    return match.group(1).strip() if match else ""


def library_patches(source: str) -> list[str]:
    """The statements of ``source`` that patch the library: an assignment to (or ``setattr``/``delattr`` on)
    an attribute of a name bound by importing from `geomtrain` or `manifolds` (a module, a class, a function),
    or any use of ``unittest.mock.patch``. Returns them as ``LINE: text``."""
    tree = ast.parse(source)
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARY:
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in LIBRARY:
            bound.update(alias.asname or alias.name for alias in node.names)

    def root(expr) -> str | None:
        while isinstance(expr, (ast.Attribute, ast.Subscript)):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        hit = any(isinstance(t, (ast.Attribute, ast.Subscript)) and root(t) in bound for t in targets)
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            hit = (name in ("setattr", "delattr") and bool(node.args) and root(node.args[0]) in bound) or (
                name == "patch" and root(node.func) in ("mock", "unittest")
            )
        if hit:
            found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_lab_holds_records_and_its_index_lists_each():
    index = (LAB / "README.md").read_text()
    assert RECORDS and SCRIPTS
    for record in RECORDS:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+", record.name), record.name
        assert f"({record.name}/README.md)" in index, f"lab/README.md does not list {record.name}"
    for title in ("At a glance", "The arithmetic of the target", "Records"):
        assert section(index, title), f"lab/README.md has no section {title!r}"


@pytest.mark.parametrize("record", RECORDS, ids=lambda p: p.name)
def test_every_record_names_its_commit_command_and_conclusion(record):
    readme = (record / "README.md").read_text()
    commit = re.search(r"^- \*\*Commit:\*\* `([0-9a-f]{7,40})`", readme, flags=re.M)
    assert commit, f"{record.name}: no '- **Commit:** `HASH`' line"
    command = section(readme, "Command")
    lines = re.findall(r"```bash\n(.*?)```", command, flags=re.S)
    assert lines and any(line.strip() and not line.startswith("#") for line in lines[0].splitlines())
    assert len(section(readme, "Conclusion").splitlines()) >= 3
    scripts = sorted(p.name for p in record.iterdir() if p.suffix in (".py", ".sh"))
    if scripts:  # copied: the command runs the script from its record
        assert any(f"lab/{record.name}/{name}" in command for name in scripts), record.name
    else:  # frozen at its commit: the README says how to run it there
        assert f"git worktree add /tmp/lab-{commit.group(1)} {commit.group(1)}" in command, record.name


def copied_record(script: Path, root: Path) -> tuple[Path, Path, dict]:
    """``script``'s record copied under ``root``/lab (the scripts change to ``root``, two levels up), a stub on
    PATH and in $GEOMTRAIN/$PYTHON that leaves a file in ``root``/called when anything runs, and the
    environment: (the copy of the script, the stub's folder, env)."""
    shutil.copytree(script.parent, root / "lab" / script.parent.name)
    stub = root.parent / "stub"
    stub.mkdir(exist_ok=True)
    for name in ("geomtrain", "python"):
        (stub / name).write_text(f'#!/bin/sh\nmkdir -p "{root}/called" && touch "{root}/called/{name}.$$"\n')
        (stub / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "PYTHONDONTWRITEBYTECODE": "1"}
    env.update(GEOMTRAIN=str(stub / "geomtrain"), PYTHON=str(stub / "python"))
    return root / "lab" / script.parent.name / script.name, stub, env


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_lab_shell_script_answers_help_without_working(script, flag, tmp_path):
    # issue 53: run.sh --help ignored the flag and started four 500-step studies
    root = tmp_path / "repo"
    copy, _, env = copied_record(script, root)
    before = files_under(root)
    done = subprocess.run(["bash", str(copy), flag], cwd=root, env=env, capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: lab/{script.parent.name}/{script.name}"), done.stdout[:300]
    assert files_under(root) == before, "the script did work (a command ran or a file was written)"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_lab_script_compiles_patches_nothing_and_answers_help(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "compiled.pyc"), doraise=True)
    assert library_patches(script.read_text()) == []
    root = tmp_path / "repo"
    copy, _, env = copied_record(script, root)
    before = files_under(root)
    done = subprocess.run(
        [sys.executable, str(copy), "--help"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]
    assert files_under(root) == before, "the script wrote a file while answering --help"


def test_the_patch_check_finds_patches_of_the_library_and_nothing_else():
    # The shapes the old scripts/ used (a module attribute replaced, a class swapped, setattr), and what
    # a record may do: subclass a library class, override on its own instances, set its own attributes.
    patches = [
        "import geomtrain.optim.muon as muon_module\nmuon_module.spectral_direction = lambda *a: None\n",
        "import geomtrain.optim.gram_newton as gram_newton\ngram_newton.GramDual = object\n",
        "from geomtrain.optim import gram_newton\nsetattr(gram_newton, 'GramDual', object)\n",
        "from geomtrain.optim.gram import GramDual\nGramDual.step = None\n",
        "import manifolds\nmanifolds.DGram.check_mask = None\n",
        "import geomtrain\ngeomtrain.optim.numerics.EPS += 1\n",
        "from unittest import mock\nimport geomtrain\nwith mock.patch('geomtrain.x', 1):\n    pass\n",
    ]
    for source in patches:
        assert len(library_patches(source)) == 1, source
    clean = (
        "import argparse\nfrom manifolds import DGram\n"
        "class Deflated(DGram):\n    name = 'Deflated'\n    def check_mask(self, n):\n        self.n = n\n"
        "args = argparse.Namespace()\nargs.out = 'x'\nsetattr(args, 'seed', 0)\n"
    )
    assert library_patches(clean) == []


def test_study_suites_runs_from_its_record_and_refuses_an_unknown_suite():
    # It changes to the repository root itself; a bad suite gets the usage line (naming this path), exit 2.
    done = subprocess.run(
        ["bash", str(LAB / "2026-12-01-study-suites" / "study_suites.sh"), "no-such-suite"],
        cwd=LAB,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("usage: lab/2026-12-01-study-suites/study_suites.sh SUITE")


def test_operations_scripts_and_makefile_point_at_files_that_exist():
    # What scripts/ keeps (shell operations scripts, and Python helpers that one of them runs) and the
    # Makefile name only paths that exist.
    shell = "".join(p.read_text() for p in (ROOT / "scripts").glob("*.sh"))
    for path in (ROOT / "scripts").iterdir():
        if path.is_file():
            assert path.suffix == ".sh" or f"scripts/{path.name}" in shell, (
                f"scripts/{path.name} is no operations script"
            )
    for path in [*(ROOT / "scripts").glob("*.sh"), ROOT / "Makefile"]:
        for named in re.findall(r"\b((?:scripts|lab)/[\w./-]+\.(?:py|sh))\b", path.read_text()):
            assert (ROOT / named).is_file(), f"{path.name} names {named}, which does not exist"
