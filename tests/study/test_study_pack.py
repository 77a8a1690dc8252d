"""geomtrain study pack / unpack: an interrupted study moved to another folder resumes there to the
same losses as an uninterrupted one; the archive holds no locks and no checkpoints of finished
runs; a corrupted or truncated archive, a non-empty target and a live run are refused with
nothing written."""

import io
import json
import os
import tarfile

import pytest
from conftest import tiny_study

from geomtrain._io import FileLock
from geomtrain.study import load_summary
from geomtrain.study import main as study_main
from geomtrain.study.pack import pack, unpack
from geomtrain.study.plan import StudyError

pytestmark = pytest.mark.slow  # tiny studies, 1-4 min a test on 2 busy cores: only in `make test`


def _final_losses(out):
    return {r["variant"]: r["final_val_mean"] for r in load_summary(out)["table"]}


@pytest.fixture(scope="module")
def interrupted(data_dir, tmp_path_factory):
    """A study whose ``adamw`` run finished and whose ``hetero`` run stopped at step 3 (runs
    folder outside the study folder), and the same study run without interruption."""
    root = tmp_path_factory.mktemp("pack")
    out, runs = root / "a" / "study", root / "a" / "runs"
    assert tiny_study(data_dir, out, "--presets", "adamw", "--runs-dir", str(runs)) == 0
    assert tiny_study(data_dir, out, "--presets", "adamw,hetero", "--runs-dir", str(runs), "--set", "stop_after=3") == 0
    assert json.loads((runs / "hetero" / "s0" / "status.json").read_text())["status"] == "interrupted"
    reference = root / "ref" / "study"
    assert tiny_study(data_dir, reference, "--presets", "adamw,hetero") == 0
    return out, runs, reference


def test_packed_study_resumes_elsewhere_to_the_same_losses(data_dir, interrupted, tmp_path, capsys):
    out, runs, reference = interrupted
    archive = tmp_path / "study.tar.xz"
    assert study_main(["pack", str(out), str(archive)]) == 0
    assert "packed" in capsys.readouterr().out
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert names[0] == "manifest.json"
    assert "runs/hetero/s0/ckpt.pt" in names and "runs/adamw/s0/metrics.jsonl" in names
    assert "runs/adamw/s0/ckpt.pt" not in names  # finished: the report needs its metrics only
    assert not [n for n in names if n.endswith(".lock") or ".tmp." in n]

    new_out, new_runs = tmp_path / "b" / "study", tmp_path / "b" / "elsewhere"
    assert study_main(["unpack", str(archive), str(new_out), "--runs-dir", str(new_runs)]) == 0
    assert f"--runs-dir {new_runs} in place of" in capsys.readouterr().out
    assert (new_runs / "hetero" / "s0" / "ckpt.pt").read_bytes() == (runs / "hetero" / "s0" / "ckpt.pt").read_bytes()
    assert tiny_study(data_dir, new_out, "--presets", "adamw,hetero", "--runs-dir", str(new_runs)) == 0
    status = json.loads((new_runs / "hetero" / "s0" / "status.json").read_text())
    assert status["status"] == "finished" and status["step"] == 6
    # resume is bit-exact (test_train), so the moved study ends where the uninterrupted one does
    assert _final_losses(new_out) == _final_losses(reference)


def test_restart_unfinished_leaves_those_runs_out_and_they_train_again(data_dir, interrupted, tmp_path):
    out, runs, reference = interrupted
    archive = tmp_path / "small.tar.xz"
    assert study_main(["pack", str(out), str(archive), "--restart-unfinished"]) == 0
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert not [n for n in names if n.startswith("runs/hetero/")]  # interrupted at step 3: out whole
    assert "runs/adamw/s0/metrics.jsonl" in names and "study/study.json" in names  # done: as without the flag
    new_out, new_runs = tmp_path / "b" / "study", tmp_path / "b" / "runs"
    assert study_main(["unpack", str(archive), str(new_out), "--runs-dir", str(new_runs)]) == 0
    assert not (new_runs / "hetero").exists()  # so it trains from step 0
    assert tiny_study(data_dir, new_out, "--presets", "adamw,hetero", "--runs-dir", str(new_runs)) == 0
    assert json.loads((new_runs / "hetero" / "s0" / "status.json").read_text())["status"] == "finished"
    assert _final_losses(new_out) == _final_losses(reference)  # a seeded run from scratch: the same losses


def test_runs_inside_the_study_folder_travel_with_it(data_dir, tmp_path):
    out = tmp_path / "study"
    assert tiny_study(data_dir, out, "--presets", "adamw", "--set", "stop_after=2") == 0  # runs in out/runs
    archive = tmp_path / "state" / "s.tar.xz"  # a folder that does not exist yet: pack makes it
    manifest = pack(out, archive)
    assert manifest["runs_inside_study"] == "runs" and "study/runs/adamw/s0/ckpt.pt" in manifest["files"]
    new_out, new_runs = unpack(archive, tmp_path / "moved")
    assert new_runs == tmp_path / "moved" / "runs" and (new_runs / "adamw" / "s0" / "ckpt.pt").is_file()


def test_bad_archives_and_targets_are_refused_with_nothing_written(interrupted, tmp_path, capsys):
    out, runs, _ = interrupted
    archive = tmp_path / "good.tar.xz"
    pack(out, archive)
    data = archive.read_bytes()

    truncated = tmp_path / "truncated.tar.xz"
    truncated.write_bytes(data[: len(data) // 2])
    assert (
        study_main(["unpack", str(truncated), str(tmp_path / "t" / "study"), "--runs-dir", str(tmp_path / "t" / "r")])
        == 2
    )
    assert "not a readable study archive" in capsys.readouterr().err
    assert not (tmp_path / "t").exists() or not any((tmp_path / "t").iterdir())

    # a member whose bytes changed after packing: re-packed with a stale manifest
    tampered = tmp_path / "tampered.tar.xz"
    with tarfile.open(archive) as src, tarfile.open(tampered, "w:xz") as dst:
        for info in src:
            payload = src.extractfile(info).read()
            if info.name == "runs/adamw/s0/metrics.jsonl":
                payload = payload.replace(b'"step": 1', b'"step": 9', 1)
                info.size = len(payload)
            dst.addfile(info, io.BytesIO(payload))
    with pytest.raises(StudyError, match="does not match its manifest checksum"):
        unpack(tampered, tmp_path / "u" / "study", tmp_path / "u" / "runs")
    assert not (tmp_path / "u" / "study").exists() and not (tmp_path / "u" / "runs").exists()

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert study_main(["unpack", str(archive), str(tmp_path / "full"), "--runs-dir", str(tmp_path / "r2")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"] and not (tmp_path / "r2").exists()

    assert study_main(["unpack", str(tmp_path / "missing.tar.xz"), str(tmp_path / "m")]) == 2
    assert "no study archive" in capsys.readouterr().err
    assert study_main(["pack", str(tmp_path / "full"), str(tmp_path / "x.tar.xz")]) == 2
    assert "holds no study.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", [".lock", ".claim"])
def test_a_run_being_trained_is_not_packed(name, interrupted, tmp_path):
    out, runs, _ = interrupted
    lock = FileLock(runs / "hetero" / "s0" / name)
    assert lock.acquire() is None  # this process trains the run (.lock) or a study has claimed it (.claim)
    try:
        with pytest.raises(StudyError, match="is being trained"):
            pack(out, tmp_path / "x.tar.xz")
        assert not (tmp_path / "x.tar.xz").exists()
    finally:
        lock.release()
    (runs / "hetero" / "s0" / name).write_text(str(os.getpid()))  # a lock file no process holds: packs
    pack(out, tmp_path / "x.tar.xz")
    (runs / "hetero" / "s0" / name).unlink()


def test_a_study_resumed_on_other_data_is_refused(data_dir, tmp_path, capsys):
    # after a move, a machine that prepared another corpus must not continue the study on it
    out = tmp_path / "study"
    assert tiny_study(data_dir, out, "--presets", "adamw", "--set", "stop_after=2") == 0
    record = json.loads((out / "study.json").read_text())
    assert record["invocations"][0]["environment"]["torch"] == record["environment"]["torch"]
    record["data"]["splits"]["train"]["sha256"] = "0" * 64  # as if started on other data
    (out / "study.json").write_text(json.dumps(record))
    before = (out / "runs" / "adamw" / "s0" / "ckpt.pt").read_bytes()
    assert tiny_study(data_dir, out, "--presets", "adamw") == 2
    assert "are not the data" in capsys.readouterr().err
    assert (out / "runs" / "adamw" / "s0" / "ckpt.pt").read_bytes() == before
