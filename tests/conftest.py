"""Shared pytest setup: Hypothesis profiles, a headless matplotlib backend, single-threaded torch,
and what several test files share: the ``data_dir`` fixture and the ``BlockGram`` test manifold
(import it with ``from conftest import BlockGram``)."""

import os

import matplotlib
import pytest
import torch
from hypothesis import HealthCheck, settings

from manifolds import GramManifold

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
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

if "OMP_NUM_THREADS" not in os.environ:  # keep torch from oversubscribing the 2 cores
    torch.set_num_threads(1)


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
