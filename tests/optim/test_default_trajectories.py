"""The default trajectories, pinned: 30 steps of the ``tiny`` model with the default solvers on
``hetero`` and ``all-dgram``, bit for bit as they were before the optimizer's restructuring
(f475818). A change to `geomtrain.optim` that is meant to keep behaviour must keep these.

Bitwise equality holds for one torch build on one CPU kernel family (``get_cpu_capability``): the
digests were made with torch 2.13.0 on an AVX512 CPU. Elsewhere float reductions may round
differently, so there the test compares the loss curve to a relative 1e-5 instead.
"""

import hashlib

import pytest
import torch
from conftest import tiny_config

from geomtrain.train import Trainer

PIN_TORCH, PIN_CAPABILITY = "2.13.0", "AVX512"
PINNED = {
    "hetero": {
        "weights_sha256": "81db4c1dacafdf1ef51b1edceaacf7f95771f25a4bc8c51ad9386017144e6602",
        "losses": [
            10.841673851013184,
            10.818317413330078,
            10.780989646911621,
            10.729443550109863,
            10.725093841552734,
            10.672452926635742,
            10.63293170928955,
            10.621464729309082,
            10.584065437316895,
            10.500672340393066,
            10.542414665222168,
            10.495768547058105,
            10.440075874328613,
            10.408891677856445,
            10.400559425354004,
            10.304491996765137,
            10.364336967468262,
            10.334588050842285,
            10.290596008300781,
            10.290633201599121,
            10.239090919494629,
            10.239588737487793,
            10.269283294677734,
            10.209676742553711,
            10.244278907775879,
            10.136818885803223,
            10.191079139709473,
            10.210721969604492,
            10.16429328918457,
            10.192593574523926,
        ],
    },
    "all-dgram": {
        "weights_sha256": "d23c53ad98cd5a2875da007d00f49436ff8ecf6972f8e2088f3d14b487acc282",
        "losses": [
            10.831032752990723,
            10.7772798538208,
            10.773316383361816,
            10.71253776550293,
            10.713394165039062,
            10.64937973022461,
            10.551559448242188,
            10.542401313781738,
            10.498992919921875,
            10.418808937072754,
            10.462606430053711,
            10.427675247192383,
            10.345853805541992,
            10.306242942810059,
            10.298711776733398,
            10.199501991271973,
            10.264259338378906,
            10.244047164916992,
            10.192963600158691,
            10.177190780639648,
            10.134811401367188,
            10.131290435791016,
            10.158387184143066,
            10.113627433776855,
            10.133861541748047,
            10.00030517578125,
            10.087282180786133,
            10.116243362426758,
            10.027398109436035,
            10.07994556427002,
        ],
    },
}


def trajectory(data_dir, preset: str) -> tuple[list[float], str]:
    """The 30 training losses and the SHA-256 of the final state dict (names and bytes, sorted)."""
    trainer = Trainer(tiny_config(data_dir, preset=preset, max_iters=30, eval_interval=30))
    losses = [trainer.step().loss for _ in range(30)]
    digest = hashlib.sha256()
    for name, tensor in sorted(trainer.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return losses, digest.hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PINNED))
def test_the_default_trajectory_is_pinned(data_dir, preset):
    losses, digest = trajectory(data_dir, preset)
    pinned = PINNED[preset]
    same_build = (
        torch.__version__.split("+")[0] == PIN_TORCH and torch.backends.cpu.get_cpu_capability() == PIN_CAPABILITY
    )
    if same_build:
        assert losses == pinned["losses"] and digest == pinned["weights_sha256"]
    else:
        assert losses == pytest.approx(pinned["losses"], rel=1e-5)
