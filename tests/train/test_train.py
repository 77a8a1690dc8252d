"""The trainer: outputs, resume exactness, divergence handling, Ctrl-C, bad input."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from geomtrain.cli import main as cli_main
from geomtrain.config import make_config
from geomtrain.train import load_checkpoint, lr_at, train

_cfg = tiny_config


def _records(run_dir, kind):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_lr_schedule_warmup_then_cosine():
    cfg = make_config(dict(model="tiny", max_iters=100, warmup_iters=10, lr=1e-3, min_lr=1e-4))
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx(0.5 * (1e-3 + 1e-4))
    assert lr_at(100, cfg) == pytest.approx(1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["adamw", "hetero"])
def test_run_writes_its_outputs(data_dir, tmp_path, preset):
    status = train(_cfg(data_dir, tmp_path / preset, preset=preset), print_fn=lambda *a: None)
    run = tmp_path / preset
    assert status["status"] == "finished" and status["step"] == 8
    for name in (
        "config.json",
        "env.json",
        "assignment.json",
        "assignment.txt",
        "metrics.jsonl",
        "diagnostics.jsonl",
        "ckpt.pt",
        "status.json",
    ):
        assert (run / name).exists(), name
    env = json.loads((run / "env.json").read_text())
    assert env["seed"] == 3 and env["torch"] == torch.__version__ and "commit" in env["git"]
    assert json.loads((run / "config.json").read_text())["preset"] == preset
    assert [r["step"] for r in _records(run, "eval")] == [4, 8]
    assert len(_records(run, "train")) == 8
    diag = [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in diag] == [4, 8]
    assert len(diag[-1]["attention"]) == 2
    kinds = {m["kind"] for m in diag[-1]["matrices"]}
    if preset == "hetero":
        assert kinds == {"attn_in", "attn_q", "attn_k", "attn_out", "mlp_in", "mlp_out"}
        stiefel = [
            m
            for m in diag[-1]["matrices"]
            if m["manifold"] == "stiefel" and "sigma_min" in m and m["kind"] in ("attn_in", "attn_out")
        ]
        assert all(abs(m["sigma_max"] - 1) < 1e-3 and abs(m["sigma_min"] - 1) < 1e-3 for m in stiefel)
        assert all(m["grad_norm"] is not None and m["grad_norm"] > 0 for m in diag[-1]["matrices"])
        assert "muon" in _records(run, "train")[-1]
    else:
        assert kinds == set()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["adamw", "hetero"])
def test_resume_is_bit_exact(data_dir, tmp_path, preset):
    full = train(_cfg(data_dir, tmp_path / "full", preset=preset), print_fn=lambda *a: None)
    part = train(_cfg(data_dir, tmp_path / "part", preset=preset, stop_after=6), print_fn=lambda *a: None)
    assert part["status"] == "interrupted" and part["step"] == 6
    resumed = train(_cfg(data_dir, tmp_path / "part", preset=preset), resume=True, print_fn=lambda *a: None)
    assert resumed["status"] == "finished" and full["status"] == "finished"
    losses_full = [(r["step"], r["loss"]) for r in _records(tmp_path / "full", "train")]
    losses_resumed = [(r["step"], r["loss"]) for r in _records(tmp_path / "part", "train")]
    assert losses_full == losses_resumed  # exact equality, step by step
    a = load_checkpoint(tmp_path / "full" / "ckpt.pt")
    b = load_checkpoint(tmp_path / "part" / "ckpt.pt")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


@pytest.mark.slow
def test_divergence_on_val_loss_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path):
    # A huge AdamW lr blows the loss up; any val increase beyond the margin counts as divergence.
    cfg = _cfg(
        data_dir,
        tmp_path / "div",
        preset="adamw",
        lr=5.0,
        min_lr=5.0,
        warmup_iters=0,
        eval_interval=2,
        max_iters=40,
        divergence_margin=0.05,
    )
    status = train(cfg, print_fn=lambda *a: None)
    assert status["status"] == "diverged" and status["diverged_step"] % 2 == 0
    ckpt = load_checkpoint(tmp_path / "div" / "ckpt.pt")
    assert ckpt["step"] < status["diverged_step"]
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


def _poison_forward(monkeypatch, bad_calls):
    """Make the training forward pass return a NaN loss on the given (1-based) calls."""
    import geomtrain.model as gm

    calls = {"n": 0}
    original = gm.GPT.forward

    def poisoned(self, idx, targets=None):
        logits, loss = original(self, idx, targets)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] in bad_calls:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(gm.GPT, "forward", poisoned)


@pytest.mark.slow
def test_non_finite_loss_skips_that_step_and_counts_it(data_dir, tmp_path, monkeypatch):
    _poison_forward(monkeypatch, {6})
    status = train(_cfg(data_dir, tmp_path / "nan", preset="hetero"), print_fn=lambda *a: None)
    assert status["status"] == "finished" and status["step"] == 8 and status["n_skipped"] == 1
    skipped = [r for r in _records(tmp_path / "nan", "train") if r.get("skipped")]
    assert [r["step"] for r in skipped] == [6] and "non-finite loss" in skipped[0]["skipped"]
    ckpt = load_checkpoint(tmp_path / "nan" / "ckpt.pt")
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


@pytest.mark.slow
def test_non_finite_loss_for_patience_steps_is_divergence(data_dir, tmp_path, monkeypatch):
    _poison_forward(monkeypatch, set(range(5, 100)))
    status = train(
        _cfg(data_dir, tmp_path / "nan", preset="hetero", nonfinite_patience=3, max_iters=12), print_fn=lambda *a: None
    )
    assert status["status"] == "diverged" and status["diverged_step"] == 7
    assert "3 steps in a row skipped" in status["reason"]
    ckpt = load_checkpoint(tmp_path / "nan" / "ckpt.pt")
    assert ckpt["step"] == 4 and all(torch.isfinite(t).all() for t in ckpt["model"].values())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--preset", "hetero2"], "invalid choice: 'hetero2'"),
        (
            ["train", "--rule", "*.mlp.*=sphere"],
            "unknown manifold 'sphere'; valid: stiefel, dgram, oblique, euclidean, bdgram",
        ),
        (["train", "--model", "huge"], "valid: gpt2, mini, tiny"),
        (["train", "--dtype", "fp8"], "invalid choice: 'fp8'"),
        (["prepare", "--dataset", "wiki"], "invalid choice: 'wiki'"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys, tmp_path):
    argv = argv + (["--out-dir", str(tmp_path / "x")] if argv[0] == "train" else [])
    try:
        code = cli_main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert not (tmp_path / "x").exists()


def test_missing_data_is_a_clear_error(tmp_path, capsys):
    code = cli_main(
        ["train", "--model", "tiny", "--data-dir", str(tmp_path / "nothing"), "--out-dir", str(tmp_path / "r")]
    )
    assert code == 2 and "geomtrain prepare" in capsys.readouterr().err


def test_toml_config_and_flag_precedence(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('model = "tiny"\nmax_iters = 7\nlr = 1e-3\n[unused]\n'.replace("[unused]\n", ""))
    cfg = make_config({"lr": 2e-3}, toml_path=path)
    assert cfg.max_iters == 7 and cfg.lr == 2e-3 and cfg.batch_size == 8  # tiny's default
    path.write_text("bogus = 1\n")
    with pytest.raises(ValueError, match="unknown config key"):
        make_config({}, toml_path=path)


class _Killed(BaseException):
    """Stands for SIGKILL in this process: nothing catches it on the way out."""


@pytest.mark.slow
def test_checkpoint_interval_holds_between_evaluations(data_dir, tmp_path, monkeypatch):
    """``checkpoint_interval`` 2 with ``eval_interval`` 6: a checkpoint every 2 steps, not only at evaluations,
    so a run killed after step 5 resumes from step 4."""
    from geomtrain.checkpoint import Checkpoint
    from geomtrain.train import Trainer

    cfg = _cfg(data_dir, tmp_path / "run", checkpoint_interval=2, eval_interval=6, max_iters=8, diagnostics=False)
    saved, original_save, original_step = [], Checkpoint.save, Trainer.step

    def save(self, state):
        saved.append(state["step"])
        original_save(self, state)

    def step(self, *args, **kwargs):
        if self.steps_done == 5:
            raise _Killed
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(Checkpoint, "save", save)
    monkeypatch.setattr(Trainer, "step", step)
    with pytest.raises(_Killed):
        train(cfg, print_fn=lambda *a: None)
    assert saved == [2, 4] and load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 4
    monkeypatch.setattr(Trainer, "step", original_step)
    printed = []
    assert train(cfg, resume=True, print_fn=printed.append)["status"] == "finished"
    assert any("from step 4" in str(p) for p in printed)
    assert saved == [2, 4, 6, 8]  # the last step's once, at the end


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_cleanly(data_dir, tmp_path):
    out = tmp_path / "int"
    cmd = [
        sys.executable,
        "-m",
        "geomtrain",
        "train",
        "--model",
        "tiny",
        "--preset",
        "hetero",
        "--data-dir",
        data_dir,
        "--out-dir",
        str(out),
        "--max-iters",
        "10000",
        "--batch-size",
        "4",
        "--eval-interval",
        "1000",
        "--log-interval",
        "1",
        "--no-progress",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-2000:]
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "interrupted" and status["step"] >= 3
    ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["step"] == status["step"] and math.isfinite(ckpt["best_val"]) is False


def test_every_config_field_is_documented():
    import dataclasses

    from geomtrain.config import TrainConfig

    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    missing = [f.name for f in dataclasses.fields(TrainConfig) if f"`{f.name}`" not in text]
    assert not missing, f"document these TrainConfig fields in docs/training.md: {missing}"


@pytest.mark.slow
def test_sample_generates_text_from_a_run(data_dir, tmp_path, capsys):
    train(_cfg(data_dir, tmp_path / "s", preset="adamw", max_iters=2, eval_interval=2), print_fn=lambda *a: None)
    capsys.readouterr()
    assert cli_main(["sample", str(tmp_path / "s"), "--prompt", "KING", "--max-new-tokens", "5", "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("KING") and len(first) > len("KING")
    cli_main(["sample", str(tmp_path / "s"), "--prompt", "KING", "--max-new-tokens", "5", "--seed", "1"])
    assert capsys.readouterr().out == first  # seeded: reproducible
    assert cli_main(["sample", str(tmp_path / "nothing")]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["hetero", "hetero-inv"])
def test_split_qkv_constrains_q_k_and_v_one_by_one(data_dir, tmp_path, preset):
    """``split_qkv``: c_attn is Muon's (3, C, C) batch, each of W_Q, W_K, W_V on its own manifold
    (Stiefel: each orthogonal; DGram: each with orthogonal columns, which the stacked matrix is not),
    and the run resumes bit-exactly and evaluates from its checkpoint."""
    from geomtrain.evaluate import evaluate_checkpoint

    full = train(_cfg(data_dir, tmp_path / "full", preset=preset, split_qkv=True), print_fn=lambda *a: None)
    assert full["status"] == "finished"
    table = json.loads((tmp_path / "full" / "assignment.json").read_text())
    rows = {r["name"]: r for r in (table if isinstance(table, list) else table["assignments"])}
    row = rows["transformer.h.0.attn.c_attn.weight"]
    assert row["optimizer"] == "muon" and list(row["shape"]) == [3, 64, 64]
    W = load_checkpoint(tmp_path / "full" / "ckpt.pt")["model"]["transformer.h.0.attn.c_attn.weight"]
    assert W.shape == (3, 64, 64)
    grams = W.mT @ W
    off = grams - torch.diag_embed(grams.diagonal(dim1=-2, dim2=-1))
    assert float(off.abs().max()) < 1e-5  # float32 retraction: ~1e-6 measured
    stacked = W.reshape(192, 64)
    stacked_gram = stacked.T @ stacked  # what one constraint on the fused matrix would hold at I / diagonal
    if preset == "hetero":  # Stiefel attention: each block orthonormal, so the stacked Gram is 3I, not I
        assert float((grams - torch.eye(64)).abs().max()) < 1e-5
        assert float((stacked_gram - 3 * torch.eye(64)).abs().max()) < 1e-5
    else:  # DGram attention: three diagonal Grams, whose sum is diagonal but whose blocks' columns differ
        assert float((stacked_gram - torch.diag(stacked_gram.diagonal())).abs().max()) < 1e-5
        norms = W.norm(dim=-2)
        assert float((norms[0] - norms[1]).abs().max()) > 1e-3  # each block keeps its own column norms
    quiet = lambda *a: None  # noqa: E731
    part = train(_cfg(data_dir, tmp_path / "part", preset=preset, split_qkv=True, stop_after=6), print_fn=quiet)
    assert part["status"] == "interrupted"
    train(_cfg(data_dir, tmp_path / "part", preset=preset, split_qkv=True), resume=True, print_fn=lambda *a: None)
    assert [r["loss"] for r in _records(tmp_path / "full", "train")] == [
        r["loss"] for r in _records(tmp_path / "part", "train")
    ]
    logged = _records(tmp_path / "full", "eval")[-1]["val_loss"]
    assert evaluate_checkpoint(tmp_path / "full")["loss"] == pytest.approx(logged, abs=1e-6)


def test_solver_options_reach_the_optimizer_typed(data_dir, tmp_path):
    """``muon_solver_options`` ("KEY=VALUE") become the group's typed solver options: here the
    published solver with a float32 matrix sign (the paper's is bf16) and a 4-step dual ascent."""
    from geomtrain.train import Trainer

    options = ["msign_dtype=float32", "steps=4"]
    cfg = _cfg(data_dir, tmp_path / "r", muon_solver="published", muon_solver_options=options)
    trainer = Trainer(cfg)
    group = trainer.muon.param_groups[0]
    assert group["solver"] == "published"
    assert group["solver_options"] == {"msign_dtype": torch.float32, "steps": 4}
    trainer.step()
    assert 0 < trainer.muon.last_stats["iterations_max"] <= 4 + 1  # 4 ascent steps (+ the final sign)


@pytest.mark.slow
def test_run_folder_from_before_a_key_existed_resumes_and_its_study_run_is_reused(data_dir, tmp_path):
    # A config.json written before `split_qkv` and `muon_solver_options` existed: those keys read as
    # their defaults (what the older code did), so the run resumes and a study counts it as done.
    from geomtrain.runfolder import RunFolderError
    from geomtrain.study.runner import run_state

    run = tmp_path / "old"
    quiet = lambda *a: None  # noqa: E731
    train(_cfg(data_dir, run, stop_after=4), print_fn=quiet)
    saved = json.loads((run / "config.json").read_text())
    for key in ("split_qkv", "muon_solver_options"):
        del saved[key]
    (run / "config.json").write_text(json.dumps(saved))
    with pytest.raises(RunFolderError, match="split_qkv: False -> True"):  # a real change still is one
        train(_cfg(data_dir, run, split_qkv=True), resume=True, print_fn=quiet)
    assert run_state(run, _cfg(data_dir, run)) == "resume"
    assert train(_cfg(data_dir, run), resume=True, print_fn=quiet)["status"] == "finished"
    assert run_state(run, _cfg(data_dir, run)) == "done"
