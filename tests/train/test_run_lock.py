"""One run per folder, and a resume that reads the run's own config.

- The lock (`geomtrain._io.FileLock`, taken by `RunFolder.open` before it reads or writes anything):
  processes released at the same instant by a barrier, many times; exactly one may win each time.
- ``--resume`` takes the config from the checkpoint: flags given with it are changes (refused when
  run-defining unless ``--allow-config-change``, recorded in ``config_history.jsonl``); a missing or
  damaged ``config.json`` is rebuilt from the checkpoint, never trusted over it.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
from fault_helpers import (
    CHECKPOINT_EVERY,
    MAX_ITERS,
    assert_one_line_error,
    assert_same_run,
    cli,
    run_args,
    snapshot,
)

from geomtrain._io import FileLock, read_jsonl
from geomtrain.runfolder import RunFolder

pytest_plugins = ["fault_helpers"]

DEAD_PID = 999999999  # above Linux's pid_max (4194304): never a live process


# ----------------------------------------------------------------------------- the lock itself
def _lock_racer(path: str, rounds: int, barrier, results) -> None:
    for i in range(rounds):
        barrier.wait()  # released together with the other racer
        lock = FileLock(path)
        won = lock.acquire() is None
        barrier.wait()  # both have tried
        results.put((i, won, lock.took_over))
        lock.release()
        barrier.wait()  # both have released: the parent prepares the next round


@pytest.mark.slow
def test_exactly_one_of_two_processes_released_together_takes_the_lock(tmp_path):
    """200 rounds; every other round starts from the lock file of a killed holder (a dead PID), so
    the take-over path races too. The old study lock (link, then unlink a stale file) let both win
    when both found the same stale file."""
    rounds, path = 200, tmp_path / ".lock"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    racers = [ctx.Process(target=_lock_racer, args=(str(path), rounds, barrier, results)) for _ in range(2)]
    for p in racers:
        p.start()
    try:
        for i in range(rounds):
            stale = i % 2 == 1
            if stale:
                path.write_text(str(DEAD_PID))
            barrier.wait(timeout=60)
            barrier.wait(timeout=60)
            outcome = [results.get(timeout=60) for _ in range(2)]
            winners = [took_over for (_, won, took_over) in outcome if won]
            assert len(winners) == 1, f"round {i}: {outcome}"
            assert winners[0] == (DEAD_PID if stale else None), f"round {i}: {outcome}"
            barrier.wait(timeout=60)
            assert not path.exists()  # released: the file is gone
    finally:
        for p in racers:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in racers)


@pytest.mark.slow
def test_a_lock_is_refused_while_held_and_free_after_its_holder_dies(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    held, stop = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path / ".lock"), held, stop))
    holder.start()
    try:
        assert held.wait(timeout=60)
        lock = FileLock(tmp_path / ".lock")
        assert lock.acquire() == holder.pid and not lock.held
        assert lock.live_holder() == holder.pid
    finally:
        holder.kill()  # dies holding it: the kernel drops the lock, the file stays behind
        holder.join()
    assert (tmp_path / ".lock").read_text() == str(holder.pid) and lock.live_holder() is None
    assert lock.acquire() is None and lock.took_over == holder.pid
    lock.release()


def _hold(path: str, held, stop) -> None:
    lock = FileLock(path)
    assert lock.acquire() is None
    held.set()
    stop.wait(120)


# ----------------------------------------------------------------------------- two trainers, one folder
def _cli_racer(argvs: list[list[str]], barrier, results) -> None:
    import geomtrain.train  # noqa: F401  (imports done before the start signal)
    from geomtrain.cli import main

    for i, argv in enumerate(argvs):
        barrier.wait()
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        results.put((i, os.getpid(), code, err.getvalue()))


def _race(argvs: list[list[str]]) -> list[list[tuple]]:
    """Two processes run ``geomtrain ARGV`` for each ``argv``, released together by a barrier."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    racers = [ctx.Process(target=_cli_racer, args=(argvs, barrier, results)) for _ in range(2)]
    for p in racers:
        p.start()
    try:
        got = [results.get(timeout=300) for _ in range(2 * len(argvs))]
    finally:
        for p in racers:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return [sorted((r for r in got if r[0] == i), key=lambda r: r[2]) for i in range(len(argvs))]


def _assert_whole(run: Path, last_step: int) -> None:
    """One run's files: one record per step, a checkpoint that verifies, config.json its config."""
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, last_step + 1))
    ckpt = RunFolder(run).checkpoint.load()
    assert ckpt["step"] == last_step
    assert json.loads((run / "config.json").read_text()) == ckpt["config"]
    assert not (run / ".lock").exists()


def _refused_for_lock(code: int, err: str, run: Path, pids: set[int]) -> bool:
    lines = err.strip().splitlines()
    return (
        code == 2
        and len(lines) == 1
        and str(run) in lines[0]
        and "in use" in lines[0]
        and any(f"pid {p}" in lines[0] for p in pids)
    )


@pytest.mark.slow
def test_two_trainers_started_together_into_one_folder(data_dir, tmp_path):
    """Fresh starts: one trains, the other gets one line naming the folder and the winner's pid
    (or, had it come after the end, "already holds a run"), exit 2."""
    runs = [tmp_path / f"run{i}" for i in range(6)]
    argvs = [run_args(data_dir, run, "--max-iters", "4") for run in runs]
    for run, outcome in zip(runs, _race(argvs)):
        (_, pid_a, code_a, err_a), (_, pid_b, code_b, err_b) = outcome
        assert code_a == 0, outcome
        late = code_b == 2 and "already holds a run" in err_b and len(err_b.strip().splitlines()) == 1
        assert late or _refused_for_lock(code_b, err_b, run, {pid_a}), outcome
        _assert_whole(run, 4)


@pytest.mark.slow
def test_two_resumes_started_together(data_dir, stopped_at_4, tmp_path):
    """Paired resumes of one stopped run: one continues it; the other is refused naming the pid,
    or (had it come after the end) resumes the finished run and adds nothing."""
    runs = [Path(shutil.copytree(stopped_at_4, tmp_path / f"run{i}")) for i in range(3)]
    argvs = [run_args(data_dir, run, "--resume") for run in runs]
    for run, outcome in zip(runs, _race(argvs)):
        (_, pid_a, code_a, err_a), (_, pid_b, code_b, err_b) = outcome
        assert code_a == 0, outcome
        assert code_b == 0 or _refused_for_lock(code_b, err_b, run, {pid_a}), outcome
        _assert_whole(run, MAX_ITERS)


@pytest.mark.slow
def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_note(data_dir, stopped_run, reference, capsys):
    (stopped_run / ".lock").write_text(str(DEAD_PID))
    code, out, _ = cli(run_args(data_dir, stopped_run, "--resume"), capsys)
    assert code == 0 and f"took over the lock of {stopped_run} from pid {DEAD_PID}" in out
    assert not (stopped_run / ".lock").exists()
    assert_same_run(stopped_run, reference)


@pytest.mark.slow
def test_a_folder_locked_by_a_live_process_is_refused_and_unchanged(data_dir, stopped_run, capsys):
    ctx = multiprocessing.get_context("spawn")
    held, stop = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(stopped_run / ".lock"), held, stop))
    holder.start()
    try:
        assert held.wait(timeout=60)
        before = snapshot(stopped_run)
        for extra in (("--resume",), ("--overwrite",), ()):
            code, _, err = cli(run_args(data_dir, stopped_run, *extra), capsys)
            assert _refused_for_lock(code, err, stopped_run, {holder.pid}), (extra, code, err)
            assert snapshot(stopped_run) == before
    finally:
        stop.set()
        holder.join()


# ----------------------------------------------------------------------------- resume from the folder alone
@pytest.mark.slow
def test_resume_needs_only_the_folder(data_dir, stopped_run, reference, capsys):
    """``train --out-dir RUN --resume``: every other key (tiny model, data folder, seed, sizes)
    comes from the run; before, the defaults were applied and the resume refused (model 'tiny' ->
    'mini'; data_dir ...)."""
    code, out, err = cli(["train", "--out-dir", stopped_run, "--resume"], capsys)
    assert code == 0, err
    assert f"resuming {stopped_run} from step {CHECKPOINT_EVERY}" in out
    assert_same_run(stopped_run, reference)
    assert not (stopped_run / "config_history.jsonl").exists()  # nothing changed
    assert json.loads((stopped_run / "config.json").read_text())["stop_after"] is None  # an invocation key


@pytest.mark.slow
def test_a_flag_given_with_resume_is_a_change(data_dir, stopped_run, capsys):
    before = snapshot(stopped_run)
    code, _, err = cli(["train", "--out-dir", stopped_run, "--resume", "--lr", "0.001"], capsys)
    assert_one_line_error(code, err, "lr: 0.0006 -> 0.001", "--allow-config-change")
    assert snapshot(stopped_run) == before
    code, _, _ = cli(
        [
            "train",
            "--out-dir",
            stopped_run,
            "--resume",
            "--lr",
            "0.001",
            "--allow-config-change",
            "--log-interval",
            "2",
        ],
        capsys,
    )
    assert code == 0
    (entry,) = read_jsonl(stopped_run / "config_history.jsonl")
    assert entry["step"] == CHECKPOINT_EVERY
    assert entry["changes"] == {"lr": {"old": 6e-4, "new": 1e-3}, "log_interval": {"old": 1, "new": 2}}


@pytest.mark.slow
def test_a_setting_change_with_resume_is_recorded_without_permission(data_dir, stopped_run, capsys):
    code, _, _ = cli(["train", "--out-dir", stopped_run, "--resume", "--eval-iters", "2"], capsys)
    assert code == 0
    (entry,) = read_jsonl(stopped_run / "config_history.jsonl")
    assert entry["changes"] == {"eval_iters": {"old": 1, "new": 2}}
    assert json.loads((stopped_run / "config.json").read_text())["eval_iters"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["deleted", "truncated", "rewritten"])
@pytest.mark.parametrize("change", [("--lr", "0.001", "lr"), ("--seed", "4", "seed")])
def test_a_damaged_config_json_cannot_hide_a_change(damage, change, data_dir, stopped_run, capsys):
    """The checkpoint's config is the truth: with config.json deleted, torn, or rewritten to claim
    the new value, a resume with another value is still refused (it used to exit 0 with no warning
    and no history entry, the folder then claiming the new value for the whole run)."""
    flag, value, key = change
    config = stopped_run / "config.json"
    if damage == "deleted":
        config.unlink()
    elif damage == "truncated":
        config.write_text(config.read_text()[:40])
    else:
        saved = json.loads(config.read_text())
        saved[key] = type(saved[key])(value)
        config.write_text(json.dumps(saved))
    before = snapshot(stopped_run)
    code, _, err = cli(run_args(data_dir, stopped_run, "--resume", flag, value), capsys)
    assert_one_line_error(code, err, f"{key}:", "--allow-config-change")
    assert snapshot(stopped_run) == before


@pytest.mark.slow
def test_a_deleted_config_json_is_rebuilt_from_the_checkpoint(data_dir, stopped_run, reference, capsys):
    (stopped_run / "config.json").unlink()
    code, out, _ = cli(["train", "--out-dir", stopped_run, "--resume"], capsys)
    assert code == 0 and "config.json was missing or unreadable: rebuilt from the checkpoint" in out
    assert json.loads((stopped_run / "config.json").read_text()) == RunFolder(stopped_run).checkpoint.load()["config"]
    assert_same_run(stopped_run, reference)


def test_resume_of_a_folder_without_a_run_starts_it(data_dir, tmp_path, capsys):
    """Nothing to read the config from: the flags are the config (a fresh start, as before)."""
    code, out, _ = cli(run_args(data_dir, tmp_path / "new", "--resume", "--max-iters", "2"), capsys)
    assert code == 0 and "starting from step 0" in out
