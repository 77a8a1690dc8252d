"""The GPU recipe's switches, checked on CPU: ``grad_accum``, ``dtype=bfloat16``, ``compile``, TF32
(scoped to the model's passes) and the MFU of the train records (docs/training.md, "The paper's
setting on a GPU")."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from geomtrain import data as gdata
from geomtrain.hardware import (
    flops_per_token,
    matmul_precision,
    mfu,
    model_flops_per_token,
    model_matmul_precision,
    peak_bf16_flops,
    peak_flops_of,
)
from geomtrain.model import GPT, model_config
from geomtrain.train import Trainer, train

BF16_UNIT_ROUNDOFF = 2.0**-8  # 8 significand bits


def _losses(trainer, steps):
    return [trainer.step().loss for _ in range(steps)]


def _assert_finite_state(trainer):
    for name, p in trainer.model.named_parameters():
        assert torch.isfinite(p).all(), name


# ----------------------------------------------------------------------------- grad_accum
def _one_batch_of_the_micro_batches(trainer, micro, accum):
    """A forward_backward for ``trainer`` (batch ``micro * accum``, accum 1) that takes, as one batch,
    the ``accum`` micro-batches of ``micro`` sequences that a ``grad_accum=accum`` run draws at this step."""

    def forward_backward():
        cfg, step = trainer.cfg, trainer.steps_done
        parts = [
            gdata.get_batch(trainer.train_tokens, micro, trainer.block, seed=cfg.seed, step=step * accum + m)
            for m in range(accum)
        ]
        x, y = (torch.cat(t) for t in zip(*parts))
        _, loss = trainer.net(x, y)
        loss.backward()
        return loss.detach()

    return forward_backward


@pytest.mark.slow
def test_grad_accum_equals_one_batch_of_the_same_sequences(data_dir):
    accumulated = Trainer(tiny_config(data_dir, batch_size=4, grad_accum=2))
    one_batch = Trainer(tiny_config(data_dir, batch_size=8, grad_accum=1))
    one_batch.forward_backward = _one_batch_of_the_micro_batches(one_batch, micro=4, accum=2)
    loss_acc, loss_one = accumulated.forward_backward(), one_batch.forward_backward()
    # The same sum in another order: the mean over 8 x 64 token losses vs the mean of two means over
    # 4 x 64, and each weight gradient a sum over 512 rows vs two sums of 256. float32 rounds each
    # addition by u = 2^-24 relative; over ~512 terms the error grows like sqrt(512) u ~ 1.4e-6 (the
    # worst case 512 u = 3e-5), so 1e-5 relative is generous for the typical case and still fails on
    # a missing 1/grad_accum (a factor 2) or a wrong micro-batch (different data: O(1) differences).
    assert float(loss_acc) == pytest.approx(float(loss_one), rel=1e-6)
    params_one = dict(one_batch.model.named_parameters())
    for name, p in accumulated.model.named_parameters():
        g, ref = p.grad, params_one[name].grad
        assert torch.linalg.vector_norm(g - ref) <= 1e-5 * torch.linalg.vector_norm(ref), name
    accumulated.zero_grad()
    one_batch.zero_grad()
    # Whole steps (AdamW + Manifold Muon on the same gradients up to that rounding): the same losses.
    # The solves are iterative, so allow 1e-4 relative on the loss of the next steps.
    losses_acc, losses_one = _losses(accumulated, 3), _losses(one_batch, 3)
    assert losses_acc == pytest.approx(losses_one, rel=1e-4)
    _assert_finite_state(accumulated)


# ----------------------------------------------------------------------------- bfloat16
@pytest.mark.slow
def test_bfloat16_autocast_matches_float32_within_bf16_rounding(data_dir):
    """2 steps (bf16 matmuls are emulated, slow, on CPU). Under autocast the matmul inputs are rounded
    to bf16 (relative error u = 2^-8 each) while the loss is computed in float32; at initialisation
    the logits are small, so the loss moves far less than one bf16 rounding of the loss itself,
    u * loss, which is the bound asserted. It must move at all: else autocast did not apply."""
    fp32 = _losses(Trainer(tiny_config(data_dir)), 2)
    bf16_trainer = Trainer(tiny_config(data_dir, dtype="bfloat16"))
    bf16 = _losses(bf16_trainer, 2)
    for a, b in zip(bf16, fp32):
        assert 0 < abs(a - b) <= BF16_UNIT_ROUNDOFF * abs(b), (bf16, fp32)
    assert all(p.dtype == torch.float32 for p in bf16_trainer.model.parameters())  # weights stay float32
    _assert_finite_state(bf16_trainer)


# ----------------------------------------------------------------------------- compile
@pytest.mark.slow
def test_compiled_model_gives_the_eager_losses(data_dir, tmp_path, monkeypatch):
    """torch.compile (inductor's C++ kernels on CPU; ~20-50 s the first time) fuses and reorders the
    float32 reductions of the forward and backward passes: the losses agree to 1e-5 absolute (a
    loss of ~10.8 carries float32 rounding of ~1e-6), over 3 steps."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    compiled = Trainer(tiny_config(data_dir, preset="adamw", compile=True))
    assert compiled.net is not compiled.model  # the compiled wrapper is what the steps call
    eager = _losses(Trainer(tiny_config(data_dir, preset="adamw")), 3)
    assert _losses(compiled, 3) == pytest.approx(eager, abs=1e-5)
    _assert_finite_state(compiled)


# ----------------------------------------------------------------------------- TF32
def test_tf32_is_chosen_for_cuda_only_and_can_be_switched_off():
    assert model_matmul_precision(torch.device("cuda"), True) == "high"
    assert model_matmul_precision(torch.device("cuda", 1), False) == "highest"
    assert model_matmul_precision(torch.device("cpu"), True) is None
    before = torch.get_float32_matmul_precision()
    with matmul_precision("high"):
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before
    with matmul_precision(None):
        assert torch.get_float32_matmul_precision() == before


def test_tf32_applies_to_the_model_passes_not_to_the_optimizer(data_dir):
    """What a CUDA trainer does, observed on CPU: the model's forward (training and evaluation) runs
    under the trainer's precision, the optimizers' steps under the process's (IEEE) one."""
    trainer = Trainer(tiny_config(data_dir))
    assert trainer.matmul_precision is None  # CPU: nothing changed
    trainer.matmul_precision = "high"  # as on CUDA with tf32=True
    seen = {"forward": set(), "optimizer": set()}
    trainer.model.register_forward_pre_hook(lambda *_: seen["forward"].add(torch.get_float32_matmul_precision()))
    for opt in trainer.optimizers():
        opt.register_step_pre_hook(lambda *_: seen["optimizer"].add(torch.get_float32_matmul_precision()))
    trainer.step()
    trainer.evaluate()
    assert seen == {"forward": {"high"}, "optimizer": {"highest"}}
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.slow
def test_tf32_key_is_validated_and_recorded(data_dir, tmp_path):
    with pytest.raises(ValueError, match="tf32 must be a bool"):
        tiny_config(data_dir, tf32="yes")
    train(tiny_config(data_dir, tmp_path / "run", max_iters=2, tf32=False), print_fn=lambda *a: None)
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["tf32"] is False and env["float32_matmul_precision"] == "highest"


# ----------------------------------------------------------------------------- MFU
@pytest.mark.parametrize("name", ["tiny", "mini"])
def test_flops_per_token_is_the_counted_matmul_flops(name):
    """6N + 12 L d T against torch's FLOP counter over one forward and backward pass (attention by its
    explicit matmuls, SDPA's math path): equal up to the parameters that are no matmul weight
    (biases, LayerNorms: counted in N, 6 FLOPs each per token, by convention)."""
    model = GPT(model_config(name))
    T, B = model.config.block_size, 2
    x = torch.randint(0, model.config.vocab_size, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(x, x)
        loss.backward()
    not_matmul = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert counter.get_total_flops() / (B * T) == model_flops_per_token(model, T) - 6 * not_matmul


def test_mfu_formula_and_peaks():
    assert flops_per_token(10, 2, 3, 4) == 6 * 10 + 12 * 2 * 3 * 4
    assert mfu(1e9, 2e5, 989e12) == pytest.approx(1e9 * 2e5 / 989e12)
    assert mfu(1e9, 2e5, 989e12, devices=8) == pytest.approx(1e9 * 2e5 / (8 * 989e12))
    assert mfu(1e9, 2e5, None) is None
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA H200") == 989e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_of("NVIDIA L40S") == 362e12 and peak_flops_of("NVIDIA L4") == 121e12
    assert peak_flops_of("NVIDIA GeForce GTX 1080") is None
    assert peak_bf16_flops("cpu") is None


@pytest.mark.slow
def test_train_records_log_tokens_per_second_and_mfu(data_dir, tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(tiny_config(data_dir, run, max_iters=2), print_fn=lambda *a: None)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["mfu"] for r in records if r["kind"] == "train"] == [None, None]  # CPU: no peak to divide by
    # with a known peak (as on a listed GPU): the formula, on the logged tokens/s
    monkeypatch.setattr("geomtrain.train.peak_bf16_flops", lambda device: 1e12)
    train(tiny_config(data_dir, tmp_path / "peak", max_iters=2), print_fn=lambda *a: None)
    per_token = model_flops_per_token(GPT(model_config("tiny")), 64)
    lines = Path(tmp_path / "peak" / "metrics.jsonl").read_text().splitlines()
    for r in (json.loads(line) for line in lines):
        if r["kind"] == "train":
            assert r["tokens_per_s"] > 0 and math.isclose(r["mfu"], per_token * r["tokens_per_s"] / 1e12)
