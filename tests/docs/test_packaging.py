"""The core installs with torch and geoopt alone; everything else comes with an extra of pyproject.toml.

The isolated check builds a venv (no pip) whose site-packages links exactly the distributions that
``pip install geomtrain`` brings: the core ``dependencies`` of pyproject.toml and, recursively, their
own runtime requirements, taken from this environment. There the core must import and train, the
extras' packages must be absent, and the ``geomtrain`` command must name the extra to install.
"""

import ast
import contextlib
import functools
import importlib.metadata as md
import io
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import geomtrain
from geomtrain import cli

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRA_PACKAGES = ["tqdm", "hypothesis", "matplotlib", "tiktoken", "tokenizers"]  # none may be in the core env


def requirement_names(requirements: list[str]) -> set[str]:
    """Canonical distribution names of ``requirements``, the project's own extras (``geomtrain[a,b]``) expanded."""
    names = set()
    for text in requirements:
        req = Requirement(text)
        if canonicalize_name(req.name) == canonicalize_name(PROJECT["name"]):
            for extra in req.extras:
                names |= requirement_names(PROJECT["optional-dependencies"][extra])
        else:
            names.add(canonicalize_name(req.name))
    return names


def runtime_closure(names: set[str]) -> list[md.Distribution]:
    """The installed distributions ``names`` need at run time: themselves and, recursively, their
    requirements whose markers hold here without any extra."""
    found, todo = {}, list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        found[name] = dist = md.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def third_party_imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path`` (lazy ones inside functions included),
    less the standard library and the project's own packages."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names - set(sys.stdlib_module_names) - {"manifolds", "geomtrain"}


@functools.cache
def installed_providers() -> dict[str, list[str]]:
    """Top-level module -> the installed distributions providing it (one scan of the environment)."""
    return md.packages_distributions()


def distributions_of(modules: set[str]) -> set[str]:
    """Canonical names of the distributions providing ``modules`` (an uninstalled one: its own name)."""
    provided_by = installed_providers()
    return {canonicalize_name(d) for m in modules for d in provided_by.get(m, [m])}


# Runs in the core venv: the core imports and takes a Manifold Muon step; then the command line.
CORE_SCRIPT = r"""
import contextlib, importlib.util, io, json, sys
import torch
import manifolds, geomtrain.optim, geomtrain
from geomtrain.optim import ManifoldMuon

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 4))
groups = geomtrain.param_groups(model, rules={"0.weight": "stiefel", "1.weight": "dgram"})
muon, adamw = ManifoldMuon(groups.muon, lr=0.02), torch.optim.AdamW(groups.adamw, lr=1e-3)
before = model[0].weight.detach().clone()
model(torch.randn(32, 8)).square().mean().backward()
muon.step()
adamw.step()
W = model[0].weight.detach()
result = {
    "core_modules": sorted(m for m in sys.modules if m.partition(".")[0] in ("manifolds", "geomtrain")),
    "hypothesis_imported": "hypothesis" in sys.modules,
    "moved": (W - before).norm().item(),
    # float32 retraction of an 16x8 matrix: ||W^T W - I|| stays near 8 * eps32 ~ 1e-6, well inside 1e-5
    "on_stiefel": manifolds.Stiefel().check_point_on_manifold(W, atol=1e-5, rtol=1e-5),
    "present": [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None],
}
try:
    import manifolds.testing
except ModuleNotFoundError as exc:
    result["testing_needs"] = exc.name
from geomtrain.cli import main  # the `geomtrain` console script's entry point

for argv in (["--help"], ["train", "--model", "mini"], ["plot", "runs/x"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's --help
            code = exc.code
        except Exception as exc:  # what would be a traceback
            code = f"{type(exc).__name__}: {exc}"
    result[" ".join(argv)] = [code, err.getvalue()]
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def core_env(tmp_path_factory) -> dict:
    """Run `CORE_SCRIPT` in a venv holding only the core distributions; its JSON result."""
    env_dir = tmp_path_factory.mktemp("core-env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    clean = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1", "PYTHONNOUSERSITE": "1"}
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([python, "-I", "-c", purelib], env=clean, capture_output=True, text=True).stdout.strip())
    tops = {}
    for dist in runtime_closure(requirement_names(PROJECT["dependencies"])):
        for file in dist.files or []:
            top = file.parts[0]
            if top not in ("..", "__pycache__") and not top.endswith(".pth"):
                tops[top] = Path(dist.locate_file(top))
    tops |= {"manifolds": ROOT / "manifolds", "geomtrain": ROOT / "geomtrain"}  # the project, as pip would install it
    for top, target in tops.items():
        (site / top).symlink_to(target)
    run = subprocess.run(
        [python, "-I", "-c", CORE_SCRIPT, *EXTRA_PACKAGES],
        env=clean,
        cwd=env_dir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_core_imports_and_steps_without_the_extras(core_env):
    assert core_env["present"] == []  # the venv really lacks the extras' packages
    assert core_env["core_modules"]  # the core modules did load, from the project's folders
    assert not core_env["hypothesis_imported"]  # import manifolds leaves the contract kit alone
    assert core_env["testing_needs"] == "hypothesis"  # manifolds.testing is there on demand, with [testing]
    assert core_env["moved"] > 0 and core_env["on_stiefel"] is True


def test_command_line_names_the_missing_extra(core_env):
    one_line = r"^geomtrain{}: error: No module named '(\w+)': run `pip install 'geomtrain\[{}\]'`\n$"
    train_modules = {m for m, e in geomtrain.EXTRAS.items() if e == "train"}
    for argv, where, extra in (("--help", "", "train"), ("train --model mini", " train", "train")):
        code, err = core_env[argv]
        match = re.match(one_line.format(where, extra), err)
        assert code == 2 and match, err
        assert match[1] in train_modules
    code, err = core_env["plot runs/x"]  # plot needs [study] too; [train] is missing first here
    assert code == 2 and re.match(one_line.format(" plot", "train"), err), err


def test_core_dependencies_are_exactly_what_the_core_imports(core_env):
    files = set()
    for name in core_env["core_modules"]:
        path = ROOT.joinpath(*name.split("."))
        files.add(path / "__init__.py" if path.is_dir() else path.with_suffix(".py"))
    imported = set().union(*(third_party_imports(f) for f in files))
    assert distributions_of(imported) == requirement_names(PROJECT["dependencies"])


def test_every_optional_import_belongs_to_its_extra():
    core = requirement_names(PROJECT["dependencies"])
    for path in [*ROOT.glob("manifolds/**/*.py"), *ROOT.glob("geomtrain/**/*.py")]:
        for module in third_party_imports(path):
            if not distributions_of({module}) <= core:
                assert module in geomtrain.EXTRAS, f"{path.relative_to(ROOT)} imports {module}, in no extra"
    extras = PROJECT["optional-dependencies"]
    for module, extra in geomtrain.EXTRAS.items():
        assert distributions_of({module}) <= requirement_names(extras[extra]), (module, extra)
    # `make test` installs [test,docs]: every extra
    assert requirement_names(extras["test"]) >= requirement_names(
        [f"{PROJECT['name']}[{e}]" for e in extras if e not in ("openwebtext", "docs", "test", "all")]
    )
    assert requirement_names(extras["all"]) >= requirement_names(
        [f"{PROJECT['name']}[{e}]" for e in extras if e not in ("docs", "test", "all")]
    )


def test_missing_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` fails, find_spec says absent
    geomtrain.require_extras("study", "testing")  # each extra checks its own packages (the CLI names [train] too)
    with pytest.raises(ModuleNotFoundError) as e:
        geomtrain.require_extras("train")
    assert e.value.name == "tqdm"
    with pytest.raises(ValueError, match="unknown extras.*choose from"):
        geomtrain.require_extras("trian")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["eval", "runs/x"])
    assert code == 2
    assert err.getvalue() == "geomtrain eval: error: No module named 'tqdm': run `pip install 'geomtrain[train]'`\n"
    assert geomtrain.install_hint("matplotlib.figure") == "pip install 'geomtrain[study]'"
    assert geomtrain.install_hint("torch") is None and geomtrain.install_hint(None) is None
