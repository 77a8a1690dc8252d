"""The Makefile's targets as a newcomer meets them (issue 53, items 9, 12 and 13): `make check` in a fresh clone
says to run `make setup` first, `make test` runs on the two workers `make check` uses, and `make docs` prints
no upstream banner."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_check_without_setup_says_to_run_make_setup(tmp_path):
    # before: `.venv/bin/ruff: No such file or directory` and make's Error 127
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "scripts" / "check.sh", tmp_path / "scripts" / "check.sh")
    done = subprocess.run(["make", "check"], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "run `make setup` first" in done.stderr, done.stderr
    assert "No such file or directory" not in done.stderr and "127" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Makefile", "scripts"]  # it made nothing


def test_make_test_runs_pytest_on_two_workers_as_make_check_does():
    # before: `make test` ran 1,337 tests in one process (23 min 42 s on a loaded 2-core machine)
    for script in ("test.sh", "check.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert "-m pytest" in text and re.search(r'-n "\$\{\w+_WORKERS:-2\}"', text), script


def test_every_mkdocs_command_silences_the_upstream_banner():
    # the banner of mkdocs-material prints raw ANSI codes into a log; scripts/test.sh silenced it, `make docs` did not
    for path in (ROOT / "Makefile", ROOT / "scripts" / "test.sh"):
        lines = [line for line in path.read_text().splitlines() if "bin/mkdocs " in line]
        assert lines and all("NO_MKDOCS_2_WARNING=1 " in line for line in lines), (path.name, lines)
