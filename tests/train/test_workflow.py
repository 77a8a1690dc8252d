"""A researcher's workflow from the CLI: your own manifold, eval, plot, TensorBoard, pretrained init."""

import functools
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import forget_manifold, tiny_config

from geomtrain.cli import main as cli_main
from geomtrain.train import load_checkpoint, train

pytestmark = pytest.mark.slow  # end-to-end CLI runs, 10-20 s each: `make test` runs it, `make check` does not

# shorter than the default tiny run: 6 steps, an eval every 3
_cfg = functools.partial(tiny_config, max_iters=6, warmup_iters=1, eval_interval=3, eval_iters=2)


def _quiet(*args, **kwargs):
    pass


def _train_args(data_dir, out, *extra):
    return [
        "train",
        "--model",
        "tiny",
        "--data-dir",
        data_dir,
        "--out-dir",
        str(out),
        "--max-iters",
        "6",
        "--batch-size",
        "4",
        "--warmup-iters",
        "1",
        "--eval-interval",
        "3",
        "--eval-iters",
        "1",
        "--log-interval",
        "1",
        "--no-progress",
        *extra,
    ]


@pytest.fixture
def forget_user_module():
    """The registry and ``sys.modules`` are process-wide: undo what the user's module registers."""
    yield
    forget_manifold("unitcols", "my_manifolds")


@pytest.mark.usefixtures("forget_user_module")
def test_user_manifold_from_a_module_trains_from_the_cli_and_resumes(data_dir, tmp_path, monkeypatch, capsys):
    # A user's module that registers a manifold (unit columns, under a name of its own).
    (tmp_path / "my_manifolds.py").write_text(
        textwrap.dedent("""
        import manifolds
        from manifolds import Oblique

        class UnitColumns(Oblique):
            name = "UnitColumns"

        manifolds.register("unitcols", lambda: UnitColumns(), overwrite=True)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    args = _train_args(data_dir, out, "--manifolds", "my_manifolds", "--rule", "*.attn.*=unitcols", "--stop-after", "3")
    assert cli_main(args) == 130  # stopped as if interrupted, checkpoint written
    assert (
        cli_main(_train_args(data_dir, out, "--manifolds", "my_manifolds", "--rule", "*.attn.*=unitcols", "--resume"))
        == 0
    )
    printed = capsys.readouterr().out
    assert "resuming" in printed and "from step 3" in printed
    assignment = json.loads((out / "assignment.json").read_text())
    attn = [a for a in assignment if ".attn." in a["name"] and a["name"].endswith(".weight")]
    assert attn and all(a["manifold"] == "unitcols" for a in attn)
    ckpt = load_checkpoint(out)
    W = ckpt["model"]["transformer.h.0.attn.c_attn.weight"]
    assert torch.allclose(W.norm(dim=0), torch.ones(W.shape[1]), atol=1e-4)  # (192, 64) is tall: unit columns
    steps = [
        json.loads(line)["step"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert steps == list(range(1, 7))  # nothing lost, nothing duplicated across the resume


def test_eval_reproduces_the_logged_val_loss(data_dir, tmp_path, capsys):
    train(_cfg(data_dir, tmp_path / "r", preset="hetero"), print_fn=_quiet)
    logged = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in logged if r["kind"] == "eval"][-1]
    capsys.readouterr()
    assert cli_main(["eval", str(tmp_path / "r"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 6 and result["split"] == "val"
    assert result["loss"] == pytest.approx(val, rel=1e-6) and result["perplexity"] == pytest.approx(math.exp(val))
    assert cli_main(["eval", str(tmp_path / "r"), "--split", "test"]) == 2
    assert "valid: train, val" in capsys.readouterr().err


def test_plot_two_runs_side_by_side(data_dir, tmp_path):
    for preset in ("adamw", "hetero"):
        train(_cfg(data_dir, tmp_path / preset, preset=preset), print_fn=_quiet)
    out = tmp_path / "cmp.png"
    assert cli_main(["plot", str(tmp_path / "adamw"), str(tmp_path / "hetero"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    from geomtrain.plot import read_curves

    curves = read_curves(tmp_path / "hetero")
    assert [s for s, _ in curves["val"]] == [3, 6] and len(curves["sigma_max"]["attn_q"]) == 2
    assert cli_main(["plot", str(tmp_path / "nothing"), "--out", str(out)]) == 2


def test_tensorboard_event_files_hold_every_metric(data_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(_cfg(data_dir, tmp_path / "tb", preset="hetero", tensorboard=True), print_fn=_quiet)
    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    logged = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(
        [r["loss"] for r in logged if r["kind"] == "train"]
    )
    assert [e.step for e in acc.Scalars("eval/val_loss")] == [3, 6]
    assert "train/muon/residual_max" in tags
    assert "diagnostics/matrices/transformer.h.0.attn.c_attn.weight/sigma_max" in tags
    assert "diagnostics/attention/layer1/mean_entropy" in tags


def test_init_from_a_hugging_face_folder_projects_onto_the_manifolds(data_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.GPT2Config(vocab_size=50257, n_positions=128, n_embd=64, n_layer=2, n_head=2)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg)
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "init"
    status = train(_cfg(data_dir, out, preset="hetero", init_from=str(tmp_path / "hf"), max_iters=3), print_fn=_quiet)
    assert status["status"] == "finished"
    moved = json.loads((out / "init_from.json").read_text())["relative_move"]
    assert set(moved) == {
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    # hetero: Stiefel attention rescales the small (std 0.02) pretrained singular values to 1 (a big move);
    # DGram MLP keeps the column norms and only removes the columns' overlap (a partial move)
    assert all(v > 1 for k, v in moved.items() if ".attn." in k)
    assert all(0.05 < v < 0.6 for k, v in moved.items() if ".mlp." in k)
    # the unconstrained parameters are the pretrained ones (before training): compare with no steps
    from geomtrain.train import Trainer

    trainer = Trainer(_cfg(data_dir, tmp_path / "t0", preset="hetero", init_from=str(tmp_path / "hf")))
    wte = hf.state_dict()["transformer.wte.weight"]
    assert torch.equal(trainer.model.transformer.wte.weight.detach(), wte)
    assert torch.equal(trainer.model.transformer.wpe.weight.detach(), hf.state_dict()["transformer.wpe.weight"][:64])
    with pytest.raises(ValueError, match="is not a 'mini' model"):
        Trainer(_cfg(data_dir, tmp_path / "t1", model="mini", init_from=str(tmp_path / "hf")))
    with pytest.raises(ValueError, match="not a Hugging Face model folder"):
        Trainer(_cfg(data_dir, tmp_path / "t2", init_from=str(tmp_path / "nothing")))


def test_docs_name_the_workflow_commands():
    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    for needle in ("geomtrain eval", "geomtrain plot", "--tensorboard", "--init-from", "--manifolds"):
        assert needle in text, needle


def test_report_on_plain_run_folders_shows_stale_runs(data_dir, tmp_path, capsys):
    train(_cfg(data_dir, tmp_path / "done", preset="adamw", max_iters=3), print_fn=_quiet)
    train(_cfg(data_dir, tmp_path / "killed", preset="adamw", max_iters=3), print_fn=_quiet)
    status = json.loads((tmp_path / "killed" / "status.json").read_text())
    # what a SIGKILLed run leaves: "running" with the pid of a process that is gone
    status.update(status="running", pid=2**22 + 12345)
    (tmp_path / "killed" / "status.json").write_text(json.dumps(status))
    capsys.readouterr()
    assert cli_main(["report", str(tmp_path / "done"), str(tmp_path / "killed")]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "| finished |" in rows["done"] and "| 3/3 |" in rows["done"]
    assert "stale" in rows["killed"] and "is gone" in rows["killed"]
    assert cli_main(["report", str(tmp_path / "nothing")]) == 2
