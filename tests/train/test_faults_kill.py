"""Fault injection, part 1: a training process killed (SIGKILL) or stopped (SIGTERM, SIGINT).

Each run is a subprocess ``python -m geomtrain train`` (through tests/_support/fault_worker.py, which
injects the fault), then ``--resume`` in this process; the result is compared step by step (exact
losses, evaluations, final weights and optimizer state) with one uninterrupted run of the same
config. Checkpoints are at steps 4, 8 and 12.
"""

import contextlib
import json
import os
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
from ranks import kill_processes_of, launch_command, processes_of

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


@contextlib.contextmanager
def _torchrun_job(fault: str, data_dir, run, log_path, *extra: str):
    """``fault_worker.py FAULT train ...`` on 2 gloo ranks under torchrun (DDP); every process of it is
    SIGKILLed on the way out (a hung rank must not outlive the test)."""
    argv = [*launch_command(2, WORKER), fault, *run_args(data_dir, run, *extra)]
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would stall the ranks
        job = subprocess.Popen(argv, env=worker_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            yield job
        finally:
            job.kill()
            kill_processes_of(run)
            job.wait()


def _ends(job: subprocess.Popen, run, timeout: float) -> None:
    """Wait for torchrun and then for its ranks (which it may have left running) to exit."""
    job.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while processes_of(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_of(run), "a rank is still running (waiting in a collective?)"


@pytest.mark.parametrize("to, times", [("torchrun", 1), ("every process", 1), ("every process", 2)])
def test_sigterm_under_torchrun_checkpoints_at_a_step_boundary(to, times, data_dir, tmp_path):
    """A 2-rank DDP job under torchrun, SIGTERM sent to torchrun alone (it forwards it to each rank) or to every
    process of the job, as Slurm and Kubernetes do (each rank then gets it twice: directly and forwarded), once
    or twice in a row: the ranks agree on a step, checkpoint it and exit, before torchrun's 30 s SIGKILL."""
    from geomtrain.train import load_checkpoint

    run, log = tmp_path / "run", tmp_path / "job.log"
    with _torchrun_job("slow-after-step:3", data_dir, run, log, "--max-iters", "60") as job:
        deadline = time.monotonic() + 180
        while not (run / ".reached-3").exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = [pid for pid in processes_of(run) if pid != job.pid]
        assert len(ranks) == 2, log.read_text()[-3000:]
        for _ in range(times):
            for pid in [job.pid, *(ranks if to == "every process" else [])]:
                os.kill(pid, signal.SIGTERM)
            time.sleep(0.3)
        _ends(job, run, timeout=25)  # torchrun gives the ranks 30 s, then SIGKILLs them
    text = log.read_text()
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text[-3000:]
    assert "forcefully exiting" not in text, text[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "interrupted" and status["signal"] == "SIGTERM", status
    assert 3 <= status["step"] < 60
    assert load_checkpoint(run / "ckpt.pt")["step"] == status["step"]  # the checkpoint of the step it stopped at
    assert [s for s, _ in losses(run)] == list(range(1, status["step"] + 1))


def test_a_full_disk_under_torchrun_stops_every_rank_with_one_line(data_dir, tmp_path):
    """A 2-rank DDP job whose second ``ckpt.pt`` write (rank 0's) fails with ENOSPC: every rank learns of it and
    stops with one line (none waits in a collective); the status is ``failed``, the first checkpoint kept."""
    from geomtrain.train import load_checkpoint

    run, log = tmp_path / "run", tmp_path / "job.log"
    with _torchrun_job("full-disk-at-checkpoint:2", data_dir, run, log) as job:
        _ends(job, run, timeout=150)
    text = log.read_text()
    assert text.count("geomtrain train: error:") == 2, text[-3000:]  # one line per rank (they may interleave)
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text[-3000:]
    assert f"No space left on device: {run / 'ckpt.pt'}" in text
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "No space left on device" in status["error"], status
    assert load_checkpoint(run / "ckpt.pt")["step"] == 4
