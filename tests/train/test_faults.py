"""Fault injection, part 2 (in this process): corrupted files, a read-only or full disk,
non-finite gradients, exceptions.

What each test asserts is what a user loses or sees: nothing lost (the previous checkpoint still
verifies and a later resume matches the uninterrupted run exactly), nothing duplicated, no NaN in
weights or optimizer state, and one clear line on stderr with exit code 2.
"""

import contextlib
import json
import os

import numpy as np
import pytest
import torch
from conftest import tiny_config
from fault_helpers import (
    CHECKPOINT_EVERY,
    FailingDisk,
    assert_all_finite,
    assert_log_whole,
    assert_one_line_error,
    assert_same_run,
    cli,
    losses,
    records,
    rewrite_checkpoint,
    run_args,
    snapshot,
    temp_files,
)

pytest_plugins = ["fault_helpers"]


def _flip_bytes(path, offset_fraction=0.5, n=8):
    """Invert ``n`` bytes in the middle of ``path``: same size, different content."""
    data = bytearray(path.read_bytes())
    at = int(len(data) * offset_fraction)
    data[at : at + n] = bytes(255 - b for b in data[at : at + n])
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- corrupted files
@pytest.mark.parametrize("where", [0.5, 0.999])  # inside tensor data (torch.load would not notice), near the end
def test_corrupted_checkpoint_is_refused_and_nothing_changes(where, data_dir, stopped_run, capsys):
    _flip_bytes(stopped_run / "ckpt.pt", where)
    before = snapshot(stopped_run)
    code, _, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    assert_one_line_error(code, err, str(stopped_run / "ckpt.pt"), "corrupted")
    assert snapshot(stopped_run) == before  # ckpt, ckpt.json, metrics, status untouched


@pytest.mark.parametrize("flip", [False, True])
def test_unreadable_checkpoint_manifest_is_refused_not_skipped(flip, data_dir, stopped_run, capsys):
    """A damaged ckpt.json must not turn verification off (a flipped ckpt.pt would then load)."""
    (stopped_run / "ckpt.json").write_text('{"sha256": "5e')
    if flip:
        _flip_bytes(stopped_run / "ckpt.pt")
    before = snapshot(stopped_run)
    code, _, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    assert_one_line_error(code, err, str(stopped_run / "ckpt.json"), "cannot be verified")
    assert snapshot(stopped_run) == before


@pytest.mark.parametrize("command", [["sample", "--max-new-tokens", "2"], ["eval", "--iters", "1"]])
def test_corrupted_checkpoint_is_refused_by_sample_and_eval(command, stopped_run, capsys):
    _flip_bytes(stopped_run / "ckpt.pt")
    code, _, err = cli([command[0], stopped_run, *command[1:]], capsys)
    assert_one_line_error(code, err, "ckpt.pt", "corrupted")


def test_same_size_corruption_of_a_token_file_is_one_line(data_copy, tmp_path, capsys):
    _flip_bytes(data_copy / "train.bin")
    code, _, err = cli(run_args(data_copy, tmp_path / "run"), capsys)
    assert_one_line_error(code, err, str(data_copy / "train.bin"), "sha256")
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


def test_corruption_after_a_verified_start_is_still_seen(data_copy, tmp_path, capsys):
    """The sha256 cache (verified.json) is keyed by file identity: an edit after a good start is
    noticed at the next start."""
    from geomtrain.data import verify_cached

    verify_cached(data_copy)  # fills the cache
    _flip_bytes(data_copy / "val.bin")
    code, _, err = cli(run_args(data_copy, tmp_path / "run"), capsys)
    assert_one_line_error(code, err, str(data_copy / "val.bin"))


def test_out_of_vocabulary_token_ids_are_one_line(data_copy, tmp_path, capsys):
    """A token file whose ids do not fit the vocabulary, with a manifest that matches it (prepared
    with another tokenizer): refused before the model sees an id, no IndexError."""
    path = data_copy / "train.bin"
    tokens = np.fromfile(path, dtype=np.uint16)
    tokens[len(tokens) // 2] = 60000  # the GPT-2 vocabulary has 50257 ids
    tokens.tofile(path)
    manifest = json.loads((data_copy / "manifest.json").read_text())
    import hashlib

    manifest["splits"]["train"]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (data_copy / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = cli(run_args(data_copy, tmp_path / "run"), capsys)
    assert_one_line_error(code, err, str(path), "60000", "50257")


# ----------------------------------------------------------------------------- read-only and full disks
def test_read_only_output_folder_fresh_run(data_dir, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    disk = FailingDisk(run, readonly=True)
    monkeypatch.setattr("builtins.open", disk.open)
    code, _, err = cli(run_args(data_dir, run), capsys)
    monkeypatch.undo()
    assert_one_line_error(code, err, "Read-only file system", str(run))
    assert disk.failures >= 1 and list(run.iterdir()) == []  # nothing written, no temporary file


def test_read_only_output_folder_on_resume_changes_nothing(data_dir, stopped_run, monkeypatch, capsys):
    before = snapshot(stopped_run)
    monkeypatch.setattr("builtins.open", FailingDisk(stopped_run, readonly=True).open)
    code, _, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    monkeypatch.undo()
    assert_one_line_error(code, err, "Read-only file system", str(stopped_run))
    assert snapshot(stopped_run) == before


def _full_after_step(monkeypatch, disk, step):
    """From training step ``step`` on, ``disk`` replaces ``builtins.open``."""
    from geomtrain.train import Trainer

    original = Trainer.step

    def step_then_fill(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if result.step == step:
            monkeypatch.setattr("builtins.open", disk.open)
        return result

    monkeypatch.setattr(Trainer, "step", step_then_fill)


@pytest.mark.parametrize(
    "free, fails_on",
    [
        (100_000, "ckpt.pt"),  # room for the small files, not for the checkpoint (step 8)
        (40, "metrics.jsonl"),  # 40 bytes left: the next log line is cut in the middle
    ],
)
@pytest.mark.slow
def test_full_disk_is_one_line_and_a_later_resume_loses_nothing(
    free, fails_on, data_dir, reference, stopped_run, monkeypatch, capsys
):
    disk = FailingDisk(stopped_run, free=free)
    _full_after_step(monkeypatch, disk, 6)
    code, _, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    monkeypatch.undo()
    assert_one_line_error(code, err, "No space left on device", str(stopped_run / fails_on))
    assert disk.failures >= 1 and temp_files(stopped_run) == []
    from geomtrain.train import load_checkpoint

    assert load_checkpoint(stopped_run / "ckpt.pt")["step"] == CHECKPOINT_EVERY  # the previous checkpoint verifies
    if fails_on == "metrics.jsonl":
        assert not (stopped_run / "metrics.jsonl").read_text().endswith("\n")  # really torn
    with pytest.warns(RuntimeWarning, match="torn") if fails_on == "metrics.jsonl" else contextlib.nullcontext():
        code, out, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)  # space again
    assert code == 0, err[-3000:]
    assert f"from step {CHECKPOINT_EVERY}" in out
    assert_same_run(stopped_run, reference)


class _Killed(BaseException):
    """Stands for SIGKILL in this process: not an Exception, so nothing catches it on the way out."""


@pytest.mark.slow
def test_full_disk_then_kill_between_the_renames_still_resumes(data_dir, reference, stopped_run, monkeypatch, capsys):
    """Two faults in a row: a checkpoint write fails (ckpt.json already names it), then the next
    run dies between writing ckpt.json and renaming ckpt.pt. ``previous`` in ckpt.json must name
    the checkpoint actually on disk, not the one that never landed."""
    _full_after_step(monkeypatch, FailingDisk(stopped_run, free=100_000), 6)
    code, _, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    monkeypatch.undo()
    assert_one_line_error(code, err, "ckpt.pt")

    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(dst) == "ckpt.pt":
            raise _Killed
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(_Killed):
        cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    monkeypatch.undo()
    code, out, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    assert code == 0, err[-3000:]
    assert f"from step {CHECKPOINT_EVERY}" in out
    assert_same_run(stopped_run, reference)


# ----------------------------------------------------------------------------- non-finite gradients
MUON_MATRIX = "transformer.h.0.attn.c_attn.weight"  # Stiefel under the hetero preset
ADAMW_MATRIX = "transformer.wte.weight"


def _trainer(data_dir, **kw):
    from geomtrain.train import Trainer

    return Trainer(tiny_config(data_dir, block_size=16, max_iters=10, diagnostics=False, **kw))


def _state(trainer):
    return {k: v.clone() for k, v in tensors_of_trainer(trainer).items()}


def tensors_of_trainer(trainer):
    from fault_helpers import tensors_of

    return {
        **tensors_of(trainer.model.state_dict(), "model"),
        **tensors_of(trainer.adamw.state_dict(), "adamw"),
        **tensors_of(trainer.muon.state_dict(), "muon"),
    }


@pytest.mark.parametrize("param", [MUON_MATRIX, ADAMW_MATRIX])
@pytest.mark.parametrize(
    "bad, grad_clip",
    [
        (float("nan"), 1.0),
        (float("inf"), 1.0),
        (1e30, 0.0),  # finite, but its square overflows float32: Inf in Adam's exp_avg_sq when nothing clips it
    ],
)
@pytest.mark.slow
def test_one_non_finite_gradient_entry_skips_the_step_and_touches_nothing(param, bad, grad_clip, data_dir):
    trainer = _trainer(data_dir, grad_clip=grad_clip)
    by_name = dict(trainer.model.named_parameters())
    assert (param == MUON_MATRIX) == any(p is by_name[param] for g in trainer.muon.param_groups for p in g["params"])
    for _ in range(2):  # Adam moments and Muon momentum exist
        assert trainer.step().skipped is None
    before = _state(trainer)

    def poison(grad):
        grad = grad.clone()
        grad.view(-1)[7] = bad
        return grad

    hook = by_name[param].register_hook(poison)
    result = trainer.step()
    hook.remove()
    assert np.isfinite(result.loss)  # the loss was finite: only the gradient is bad
    assert result.skipped is not None and param in result.skipped
    assert trainer.n_skipped == 1 and trainer.steps_done == 3
    after = _state(trainer)
    assert after.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == []  # no weight, no Adam moment, no Muon momentum moved
    assert all(p.grad is None for p in trainer.model.parameters())
    assert trainer.step().skipped is None  # training goes on, with finite updates
    assert assert_all_finite(tensors_of_trainer(trainer)) > 30
    assert not torch.equal(after[f"model/{param}"], trainer.model.state_dict()[param])


@pytest.mark.slow
def test_non_finite_gradient_in_a_run_is_counted_and_the_run_finishes(data_dir, tmp_path, monkeypatch, capsys):
    from geomtrain.train import Trainer, load_checkpoint

    original = Trainer.forward_backward

    def forward_backward(self):
        loss = original(self)
        if self.steps_done == 5:  # the 6th step
            dict(self.model.named_parameters())[MUON_MATRIX].grad[0, 0] = float("nan")
        return loss

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)
    run = tmp_path / "run"
    code, _, err = cli(run_args(data_dir, run), capsys)
    assert code == 0, err[-3000:]
    skipped = [r for r in records(run, "train") if r.get("skipped")]
    assert [r["step"] for r in skipped] == [6] and MUON_MATRIX in skipped[0]["skipped"] and skipped[0]["n_skipped"] == 1
    assert json.loads((run / "status.json").read_text())["n_skipped"] == 1
    assert_log_whole(run)
    ckpt = load_checkpoint(run / "ckpt.pt")
    assert assert_all_finite(ckpt["model"], ckpt["adamw"], ckpt["muon"]) > 30


@pytest.mark.slow
def test_a_skipped_matrix_update_is_logged_by_name_and_the_run_finishes(data_dir, tmp_path, monkeypatch, capsys):
    """A direction solve that comes out non-finite for one matrix (step 6): that update is skipped, and the
    train record of step 6 is written, though off the log interval, naming the matrix and the reason."""
    import geomtrain.optim.muon_step as muon_module
    from geomtrain.train import Trainer, load_checkpoint

    original_step, original_direction = Trainer.step, muon_module.spectral_direction
    at_step = {"now": 0}

    def step(self, *args, **kwargs):
        at_step["now"] = self.steps_done + 1
        return original_step(self, *args, **kwargs)

    def direction(m, W, U, **opts):
        A, stats = original_direction(m, W, U, **opts)
        if at_step["now"] == 6:
            A[0] = float("nan")
        return A, stats

    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(muon_module, "spectral_direction", direction)
    run = tmp_path / "run"
    with pytest.warns(RuntimeWarning, match="non-finite direction"):
        code, _, err = cli(run_args(data_dir, run, "--log-interval", "100"), capsys)
    assert code == 0, err[-3000:]
    logged = {r["step"]: r for r in records(run, "train")}
    assert 6 in logged and 5 not in logged and 7 not in logged  # logged for the skip, not the interval
    skipped = logged[6]["muon"]["skipped"]
    assert len(skipped) >= 1 and {s["reason"] for s in skipped} == {"non-finite direction"}
    names = {a["name"] for a in json.loads((run / "assignment.json").read_text()) if a["optimizer"] == "muon"}
    assert {s["param"] for s in skipped} <= names
    assert logged[6]["muon"]["n_skipped_nonfinite_total"] == len(skipped)
    assert "skipped" not in logged[6]  # the step itself went on
    ckpt = load_checkpoint(run / "ckpt.pt")
    assert assert_all_finite(ckpt["model"], ckpt["adamw"], ckpt["muon"]) > 30


# ----------------------------------------------------------------------------- a damaged warm start
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.slow
def test_a_non_finite_carried_correction_starts_that_matrix_cold_with_one_note(bad, data_dir, stopped_run, capsys):
    """An Inf or a NaN in one matrix's saved ``correction`` (filled_split's carried state): ``--resume`` drops it
    and says so in one note naming the matrix, which starts cold; before, an Inf stopped every resume."""
    from geomtrain.train import load_checkpoint

    def poison(state):  # muon state 0: MUON_MATRIX, the first of the Stiefel group
        state["muon"]["state"][0]["correction"][3, 5] = bad

    rewrite_checkpoint(stopped_run, poison)
    code, out, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    assert code == 0 and "Warning" not in err, err[-3000:]
    assert f"from step {CHECKPOINT_EVERY}" in out
    assert [line for line in out.splitlines() if "cold" in line] == [
        f"note: ManifoldMuon: the saved warm-start state 'correction' of {MUON_MATRIX} is not finite; "
        "that matrix starts cold"
    ]
    assert assert_all_finite(load_checkpoint(stopped_run / "ckpt.pt")["muon"]) > 10


# ----------------------------------------------------------------------------- exceptions
@pytest.mark.slow
def test_an_exception_records_failed_status_and_resume_loses_nothing(
    data_dir, reference, stopped_run, monkeypatch, capsys
):
    from geomtrain.train import Trainer

    original = Trainer.step

    def step(self, *args, **kwargs):
        if self.steps_done == 6:
            raise RuntimeError("injected failure")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "step", step)
    with pytest.raises(RuntimeError, match="injected"):  # a bug, not a user error: the traceback is kept
        cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    monkeypatch.undo()
    status = json.loads((stopped_run / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == 6 and "injected failure" in status["error"]
    code, out, err = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    assert code == 0 and f"from step {CHECKPOINT_EVERY}" in out, err[-3000:]
    assert_same_run(stopped_run, reference)
    assert losses(stopped_run) == losses(reference)
