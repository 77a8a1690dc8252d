"""geomtrain.evaluate: a checkpoint's loss reproduces the run's logged validation loss."""

import json
import math

import pytest
import torch
from conftest import tiny_config

from geomtrain.evaluate import evaluate_checkpoint, load_model
from geomtrain.train import train


@pytest.fixture(scope="module")
def tiny_run(data_dir, tmp_path_factory):
    """A finished 8-step ``tiny`` run (float32, evaluations at steps 4 and 8) and its last logged val loss."""
    run = tmp_path_factory.mktemp("eval") / "run"
    train(tiny_config(data_dir, run, preset="hetero"), print_fn=lambda *a, **k: None)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return run, [r["val_loss"] for r in records if r["kind"] == "eval"][-1]


@pytest.mark.slow
def test_evaluate_checkpoint_gives_the_logged_val_loss(tiny_run):
    run, logged = tiny_run
    result = evaluate_checkpoint(run)
    # the same batches, model and float32 arithmetic as the trainer's evaluation: equal up to the
    # order of the mean (1e-6 relative)
    assert result["loss"] == pytest.approx(logged, rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert result["step"] == 8 and result["split"] == "val" and result["batches"] == 1
    assert result["tokens"] == result["batches"] * 4 * 64  # batch_size 4 of the run, tiny's block 64


def test_other_batches_give_another_loss_and_train_split_is_accepted(tiny_run):
    run, logged = tiny_run
    other_seed = evaluate_checkpoint(run, seed=12345)
    assert other_seed["loss"] != pytest.approx(logged, rel=1e-6)
    more = evaluate_checkpoint(run, split="train", iters=2, batch_size=2)
    assert more["batches"] == 2 and more["tokens"] == 2 * 2 * 64 and math.isfinite(more["loss"])


def test_bad_split_and_counts_are_refused_naming_the_choices(tiny_run):
    run, _ = tiny_run
    with pytest.raises(ValueError, match="unknown split 'test'; valid: train, val"):
        evaluate_checkpoint(run, split="test")
    with pytest.raises(ValueError, match="batch_size must be >= 1; got -1"):
        evaluate_checkpoint(run, batch_size=-1)


def test_load_model_gives_the_checkpoint_weights_in_eval_mode(tiny_run):
    run, _ = tiny_run
    model, ckpt = load_model(run)
    assert not model.training and ckpt["step"] == 8
    for name, value in model.state_dict().items():
        assert torch.equal(value, ckpt["model"][name]), name
