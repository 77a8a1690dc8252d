"""Fault injection, part 1: a training process killed (SIGKILL) or stopped (SIGTERM, SIGINT).

Each run is a subprocess ``python -m geomtrain train`` (through tests/_support/fault_worker.py, which
injects the fault), then ``--resume`` in this process; the result is compared step by step (exact
losses, evaluations, final weights and optimizer state) with one uninterrupted run of the same
config. Checkpoints are at steps 4, 8 and 12.
"""

import json
import signal
import subprocess
import sys
import time

import pytest
from fault_helpers import (
    MAX_ITERS,
    WORKER,
    assert_same_run,
    cli,
    losses,
    records,
    run_args,
    temp_files,
    worker,
    worker_env,
)

pytest_plugins = ["fault_helpers"]
pytestmark = pytest.mark.slow  # subprocess runs killed and resumed, 20 s each: only in `make test`

# fault -> (step the resume starts from, what the folder holds when the process dies)
KILLS = {
    "kill-at-step:3": (0, "before the first checkpoint"),
    "kill-renaming:ckpt.pt:1": (0, "ckpt.json of the first checkpoint in place, ckpt.pt not yet"),
    "kill-at-step:6": (4, "between two checkpoints"),
    "kill-renaming:ckpt.json:2": (4, "the second checkpoint's ckpt.json written, not renamed"),
    "kill-renaming:ckpt.pt:2": (4, "ckpt.json names the new checkpoint, ckpt.pt still the old one"),
    "kill-after-checkpoint:2": (8, "the second checkpoint in place, status not yet updated"),
    "kill-renaming:status.json:2": (4, "status.json of the first checkpoint written, not renamed"),
}


@pytest.mark.parametrize("fault", list(KILLS))
def test_sigkill_then_resume_loses_nothing(fault, data_dir, reference, tmp_path, capsys):
    from geomtrain.runfolder import RunFolder

    resume_from, _ = KILLS[fault]
    run = tmp_path / "run"
    proc = worker(fault, run_args(data_dir, run))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    status = RunFolder(run).read_status()
    assert status["status"] == "stale" and "gone" in status["reason"], status
    code, out, _ = cli(["report", run], capsys)
    assert code == 0 and "stale" in out  # what `geomtrain report` shows for it
    done = [s for s, _ in losses(run)]
    assert done == list(range(1, len(done) + 1))  # what was logged before the kill: no gaps

    code, out, err = cli(run_args(data_dir, run, "--resume"), capsys)
    assert code == 0, err[-3000:]
    if resume_from:
        assert f"from step {resume_from}" in out
    else:
        assert "starting from step 0" in out
    assert_same_run(run, reference)
    assert temp_files(run) == []  # the killed process's temporary files are cleaned up by the resume
    assert RunFolder(run).read_status()["status"] == "finished"


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_checkpoints_at_the_step_boundary_and_resumes_exactly(sig, code, data_dir, reference, tmp_path, capsys):
    from geomtrain.train import load_checkpoint

    run = tmp_path / "run"
    argv = [sys.executable, str(WORKER), "slow-after-step:5", *run_args(data_dir, run)]
    proc = subprocess.Popen(argv, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not (run / ".reached-5").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err
    status = json.loads((run / "status.json").read_text())
    stopped = status["step"]
    assert status["status"] == "interrupted" and status["signal"] == signal.Signals(sig).name
    assert 5 <= stopped < MAX_ITERS
    assert load_checkpoint(run / "ckpt.pt")["step"] == stopped  # the checkpoint is of the last step taken
    assert [s for s, _ in losses(run)] == list(range(1, stopped + 1))

    (run / ".reached-5").unlink()
    rc, out, err = cli(run_args(data_dir, run, "--resume"), capsys)
    assert rc == 0, err[-3000:]
    assert f"from step {stopped}" in out
    assert_same_run(run, reference)
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    assert records(run, "train")[-1]["step"] == MAX_ITERS
