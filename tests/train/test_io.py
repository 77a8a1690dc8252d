"""geomtrain._io: atomic writes, JSON(L) reading and writing, the file lock."""

import json
import math
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from geomtrain._io import (
    FileLock,
    append_jsonl,
    atomic_write,
    atomic_write_json,
    git_commit,
    read_json,
    read_jsonl,
    to_jsonable,
    truncate_jsonl,
    writable_output,
)


def test_atomic_write_that_raises_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "ckpt.json"
    target.write_text("old")

    def half_then_fail(fh):
        fh.write(b"new, half written")
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.json"]  # no .ckpt.json.tmp.PID left
    atomic_write(target, lambda fh: fh.write(b"new"))
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.json"]


def test_atomic_write_json_is_readable_compact_or_indented(tmp_path):
    record = {"loss": torch.tensor(2.5), "bad": float("nan"), "path": tmp_path}
    atomic_write_json(tmp_path / "a.json", record)
    atomic_write_json(tmp_path / "b.json", record, compact=True)
    expected = {"loss": 2.5, "bad": None, "path": str(tmp_path)}
    assert read_json(tmp_path / "a.json") == read_json(tmp_path / "b.json") == expected
    assert (tmp_path / "b.json").read_text().count("\n") == 1  # one line
    assert read_json(tmp_path / "missing.json", default={}) == {}


def test_to_jsonable_turns_tensors_numpy_and_non_finite_floats_into_plain_json():
    obj = {
        1: torch.tensor(0.5),  # a one-element tensor: a number
        "vec": torch.tensor([1.0, float("inf")]),
        "np": np.float32(0.25),
        "arr": np.array([[1, 2]]),
        "nested": (float("nan"), -math.inf, [torch.tensor([3])]),
    }
    out = to_jsonable(obj)
    assert out == {"1": 0.5, "vec": [1.0, None], "np": 0.25, "arr": [[1, 2]], "nested": [None, None, [3]]}
    assert json.loads(json.dumps(out, allow_nan=False)) == out  # strict JSON: no NaN token


def test_read_jsonl_drops_a_torn_last_line_and_repair_cuts_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2):
        append_jsonl(path, {"step": step, "loss": torch.tensor(float(step))})
    intact = path.read_bytes()
    with open(path, "ab") as fh:
        fh.write(b'{"step": 3, "lo')  # a process killed mid-write
    with pytest.warns(RuntimeWarning, match="torn last line"):
        assert read_jsonl(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
    assert path.read_bytes() != intact  # read alone does not touch the file
    with pytest.warns(RuntimeWarning, match="torn last line"):
        read_jsonl(path, repair=True)
    assert path.read_bytes() == intact
    assert read_jsonl(tmp_path / "none.jsonl") == []


def test_read_jsonl_names_the_file_and_line_of_a_bad_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not valid JSON"):
        read_jsonl(path)


def test_truncate_jsonl_keeps_the_records_up_to_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5')
    with pytest.warns(RuntimeWarning, match="torn"):
        truncate_jsonl(path, 2)
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_writable_output_refuses_a_file_in_the_folder_path(tmp_path):
    (tmp_path / "blocker").write_text("")
    with pytest.raises(NotADirectoryError, match="blocker"):
        writable_output(tmp_path / "blocker" / "sub" / "out.json")
    with pytest.raises(IsADirectoryError):
        writable_output(tmp_path)
    assert writable_output(tmp_path / "new" / "out.json") == tmp_path / "new" / "out.json"
    assert (tmp_path / "new").is_dir()


def test_file_lock_acquire_live_holder_and_release(tmp_path):
    path = tmp_path / ".lock"
    first, second = FileLock(path), FileLock(path)
    assert first.live_holder() is None
    assert first.acquire() is None and first.held
    assert path.read_text() == str(os.getpid())
    assert second.acquire() == os.getpid()  # another open file description of the same file is refused
    assert not second.held and second.live_holder() == os.getpid()
    first.release()
    assert not first.held and not path.exists() and second.live_holder() is None
    assert second.acquire() is None and second.took_over is None
    second.release()
    first.release()  # releasing a lock not held is a no-op


def test_file_lock_takes_over_the_file_of_a_dead_holder(tmp_path):
    path = tmp_path / ".lock"
    path.write_text("4194305")  # a PID left by a killed holder: nobody holds the flock
    lock = FileLock(path)
    assert lock.live_holder() is None
    assert lock.acquire() is None and lock.took_over == 4194305
    assert path.read_text() == str(os.getpid())
    lock.release()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_is_dirty_for_changed_code_not_for_a_studys_output(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True)

    (tmp_path / "geomtrain").mkdir()
    (tmp_path / "geomtrain" / "model.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "code")
    assert git_commit(tmp_path)["dirty"] is False and len(git_commit(tmp_path)["commit"]) == 40
    (tmp_path / "docs" / "results" / "study").mkdir(parents=True)  # what a study writes: untracked, not code
    (tmp_path / "docs" / "results" / "study" / "study.json").write_text("{}")
    (tmp_path / "data").symlink_to(tmp_path / "docs")
    assert git_commit(tmp_path)["dirty"] is False
    (tmp_path / "geomtrain" / "new_module.py").write_text("")  # a new module changes what runs
    assert git_commit(tmp_path)["dirty"] is True
    (tmp_path / "geomtrain" / "new_module.py").unlink()
    (tmp_path / "geomtrain" / "model.py").write_text("x = 2\n")  # so does an edit
    assert git_commit(tmp_path)["dirty"] is True
    assert git_commit(tmp_path.parent / "not-a-checkout-here") == {"commit": None, "dirty": None}
