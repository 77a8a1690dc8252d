"""Shared pytest setup: Hypothesis profiles, a headless matplotlib backend, single-threaded torch."""

import os

import matplotlib
from hypothesis import HealthCheck, settings

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

try:  # keep torch from oversubscribing the 2 cores when the caller did not set it
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The classics corpus with the GPT-2 tokenizer, prepared once per test session (~3 s)."""
    from geomtrain.data import prepare

    out = tmp_path_factory.mktemp("data") / "classics"
    prepare(out, dataset="classics")
    return str(out)
