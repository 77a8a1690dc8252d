"""Shared pytest setup: Hypothesis profiles, a headless matplotlib backend, single-threaded torch,
and what several test files share: the ``data_dir`` fixture, the ``BlockGram`` test manifold, the
``tiny_config`` run config and ``forget_manifold`` (import them with ``from conftest import ...``)."""

import os
import sys
from pathlib import Path

import matplotlib
import pytest
import torch
from hypothesis import HealthCheck, settings

from geomtrain.config import TrainConfig, make_config
from manifolds import GramManifold, manifold_names, unregister

# tests/_support holds the shared helpers and subprocess workers, imported by bare name
# (`from fault_helpers import ...`); the test files live in folders that mirror the package.
SUPPORT = Path(__file__).resolve().parent / "_support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

matplotlib.use("Agg")

# ci: >= 200 examples per property, reproducible (derandomized), no deadline on a busy 2-core box.
settings.register_profile(
    "ci",
    max_examples=200,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# quick (`make check`): a few reproducible examples per property, the pre-commit tier; CI runs `ci`.
settings.register_profile(
    "quick",
    max_examples=10,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

if "OMP_NUM_THREADS" not in os.environ:  # keep torch from oversubscribing the 2 cores
    torch.set_num_threads(1)


def forget_manifold(name: str, module: str | None = None) -> None:
    """Undo a test's registration of manifold ``name`` (and the import of the user ``module`` that made it):
    the registry and ``sys.modules`` are process-wide, and other tests list the registered names."""
    if name in manifold_names():
        unregister(name)
    if module is not None:
        sys.modules.pop(module, None)


class BlockGram(GramManifold):
    """A user-style mask (the generic code paths): columns orthogonal across blocks of 2, free inside."""

    def project_gram(self, M):
        block = torch.arange(M.shape[-1], device=M.device) // 2
        return M * (block[:, None] != block[None, :]).to(M.dtype)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The classics corpus with the GPT-2 tokenizer, prepared once per test session (~3 s)."""
    from geomtrain.data import prepare

    out = tmp_path_factory.mktemp("data") / "classics"
    prepare(out, dataset="classics")
    return str(out)


def tiny_config(data_dir, out_dir=None, **overrides) -> TrainConfig:
    """A seconds-long run of the ``tiny`` model (8 steps, batch 4, an eval every 4 steps, no progress
    bar, seed 3); ``overrides`` are config keys (no ``out_dir``: the default, for a bare `Trainer`)."""
    keys = dict(
        model="tiny",
        data_dir=str(data_dir),
        **({} if out_dir is None else {"out_dir": str(out_dir)}),
        max_iters=8,
        batch_size=4,
        warmup_iters=2,
        eval_interval=4,
        eval_iters=1,
        log_interval=1,
        progress=False,
        seed=3,
    )
    keys.update(overrides)
    return make_config(keys)


# `geomtrain study --set` options that make a tiny-model study take seconds
FAST_STUDY_SETS = [
    "--set",
    "batch_size=4",
    "--set",
    "eval_iters=1",
    "--set",
    "log_interval=1",
    "--set",
    "diag_batch_size=2",
    "--set",
    "block_size=32",
]


def tiny_study(data_dir, out, *extra) -> int:
    """``geomtrain study`` of the ``tiny`` model into ``out``: 6 steps, an evaluation every 3, quiet,
    `FAST_STUDY_SETS`; ``extra`` are further arguments. Returns the exit code."""
    from geomtrain.study import main as study_main

    args = ["--model", "tiny", "--data-dir", data_dir, "--iters", "6", "--set", "eval_interval=3"]
    return study_main([*args, "--out", str(out), "--quiet", *FAST_STUDY_SETS, *extra])


@pytest.fixture(scope="session")
def tiny_study_folder(data_dir, tmp_path_factory):
    """A finished `tiny_study` of the ``adamw`` and ``hetero`` presets, one seed, reported (summary.json
    and figures written), built once per test session; tests must not modify it."""
    out = tmp_path_factory.mktemp("study") / "study"
    assert tiny_study(data_dir, out, "--presets", "adamw,hetero") == 0
    return out
