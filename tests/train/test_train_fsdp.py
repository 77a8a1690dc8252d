"""``fsdp``: FSDP2 training on 2 gloo CPU ranks against one process, DCP checkpoints (bit-exact resume,
resharding 2 -> 1 -> 2, a rank killed mid-run), the DDP bucketed exchange on every preset, and the
``fsdp`` key's bad values. The runs are `fsdp_worker.worker_config`: 20 steps of ``tiny``."""

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import fsdp_worker
import pytest
import torch
from ranks import kill_processes_of, launch_command, run_ranks, worker_env

from geomtrain.checkpoint import CheckpointError
from geomtrain.cli import main as cli_main
from geomtrain.config import make_config
from geomtrain.runfolder import RunFolder, resume_config
from geomtrain.train import load_checkpoint, train

pytestmark = pytest.mark.slow  # torchrun jobs of 2 ranks: `make test` runs them, `make check` does not

PRESETS = ("adamw", "unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv")
NO_SOLVE = ("adamw", "unconstrained")  # no manifold direction solve: only the reduction order differs
# Tolerances against one process (same global batch, same update rule). The losses are ~10 nats, where
# float32's spacing is 9.5e-7: 1e-6 is one ulp, and the gradient averages are summed in another order (a
# reduce-scatter or all-reduce of per-rank means vs one mean), so the losses differ by a few ulps (measured:
# at most 4.8e-6 over 20 steps, FSDP and DDP alike). The weights: 1.4e-5 measured without a manifold solve
# (AdamW's g / sqrt(v) turns last-bit gradient differences into lr-sized ones for entries near 0); with one,
# up to 4.1e-4 (FSDP) and 7.8e-4 (DDP) on hetero-inv, where a solve that stops at its tolerance (1e-4
# RMS residual) may stop at another iterate. Bounds a few times above, far below another seed's or
# preset's difference (> 1e-2).
LOSS_TOL = 2e-5
WEIGHT_TOL = {"no solve": 1e-4, "solve": 2e-3}


def _run_worker(data_dir, out_root, report, mode, presets, *keys, ranks=2, timeout=300) -> dict:
    """``fsdp_worker`` under torchrun (``ranks`` 2) or as one process (``ranks`` 1); its report."""
    run_ranks(ranks, fsdp_worker.__file__, data_dir, out_root, report, mode, ",".join(presets), *keys, timeout=timeout)
    return torch.load(report, weights_only=False)


@pytest.fixture(scope="module")
def one_process(data_dir, tmp_path_factory):
    """Every preset's run in one process (the reference): about 30 s."""
    tmp = tmp_path_factory.mktemp("single")
    return _run_worker(data_dir, tmp / "runs", tmp / "report.pt", "single", PRESETS, ranks=1)


@pytest.fixture(scope="module")
def fsdp_runs(data_dir, tmp_path_factory):
    """Every preset's run on 2 ranks under FSDP2, in one torchrun job: about 50 s."""
    tmp = tmp_path_factory.mktemp("fsdp")
    return tmp / "runs", _run_worker(data_dir, tmp / "runs", tmp / "report.pt", "fsdp", PRESETS)


def _assert_matches(runs: dict, reference: dict, what: str) -> None:
    for preset in PRESETS:
        got, want = runs[preset], reference[preset]
        assert sorted(got["losses"]) == sorted(want["losses"]) == list(range(1, 21))
        dloss = max(abs(got["losses"][s] - want["losses"][s]) for s in want["losses"])
        dw = max(float((got["weights"][k].double() - want["weights"][k].double()).abs().max()) for k in want["weights"])
        print(f"{what} {preset}: max |loss - one process| {dloss:.2e}, max |W - one process| {dw:.2e}")
        assert dloss < LOSS_TOL, preset
        assert dw < WEIGHT_TOL["no solve" if preset in NO_SOLVE else "solve"], preset


def test_fsdp_matches_one_process_on_every_preset(fsdp_runs, one_process):
    root, runs = fsdp_runs
    _assert_matches(runs, one_process, "FSDP2")
    for preset in PRESETS:
        weights = runs[preset]["weights"]
        assert torch.equal(weights["transformer.wte.weight"], weights["lm_head.weight"])  # still tied
        manifest = json.loads((root / preset / "ckpt.dcp.json").read_text())
        assert manifest["step"] == 20 and manifest["world_size"] == 2
        assert not (root / preset / "ckpt.pt").exists()
    # diagnostics need whole matrices: every rank gathered them, rank 0 wrote the same rows as one process
    diag = [json.loads(line) for line in (root / "hetero" / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in diag] == [10, 20]
    rows = {r["name"]: r for r in diag[-1]["matrices"]}
    assert len(rows) == 12 and all(r["grad_norm"] is not None for r in rows.values() if "[" not in r["name"])


def test_ddp_bucketed_matches_one_process_on_every_preset(data_dir, tmp_path, one_process):
    runs = _run_worker(data_dir, tmp_path / "runs", tmp_path / "report.pt", "ddp", PRESETS, "bucketed=true")
    _assert_matches(runs, one_process, "DDP bucketed")


@pytest.fixture(scope="module")
def stopped(data_dir, tmp_path_factory):
    """A 2-rank FSDP2 hetero run stopped at step 10 (DCP checkpoint of 2 ranks) and its report."""
    tmp = tmp_path_factory.mktemp("stopped")
    report = _run_worker(data_dir, tmp / "runs", tmp / "report.pt", "fsdp", ["hetero"], "stop_after=10")
    return tmp / "runs", report["hetero"]


def _copy(stopped, tmp_path) -> Path:
    shutil.copytree(stopped[0], tmp_path / "runs")
    return tmp_path / "runs"


def test_dcp_resume_on_the_same_world_size_is_bit_exact(data_dir, tmp_path, stopped, fsdp_runs):
    runs = _copy(stopped, tmp_path)
    resumed = _run_worker(data_dir, runs, tmp_path / "report.pt", "resume", ["hetero"])["hetero"]
    uninterrupted = fsdp_runs[1]["hetero"]
    assert stopped[1]["weights"].keys() == resumed["start"].keys()
    assert all(torch.equal(resumed["start"][k], w) for k, w in stopped[1]["weights"].items())
    assert [resumed["losses"][s] for s in range(11, 21)] == [uninterrupted["losses"][s] for s in range(11, 21)]
    assert all(torch.equal(resumed["weights"][k], w) for k, w in uninterrupted["weights"].items())


def test_dcp_reshards_two_ranks_to_one_and_back(data_dir, tmp_path, stopped, one_process):
    runs = _copy(stopped, tmp_path)
    one = _run_worker(data_dir, runs, tmp_path / "one.pt", "resume", ["hetero"], "stop_after=15", ranks=1)["hetero"]
    assert all(torch.equal(one["start"][k], w) for k, w in stopped[1]["weights"].items())  # 2 -> 1: same weights
    assert json.loads((runs / "hetero" / "ckpt.dcp.json").read_text())["world_size"] == 1
    two = _run_worker(data_dir, runs, tmp_path / "two.pt", "resume", ["hetero"])["hetero"]
    assert all(torch.equal(two["start"][k], w) for k, w in one["weights"].items())  # 1 -> 2: same weights
    assert sorted(two["losses"]) == list(range(1, 21))
    reference = one_process["hetero"]
    assert max(abs(two["losses"][s] - reference["losses"][s]) for s in range(11, 21)) < LOSS_TOL
    dw = max(float((two["weights"][k] - w).abs().max()) for k, w in reference["weights"].items())
    assert dw < WEIGHT_TOL["solve"]


def test_a_ckpt_pt_run_resumes_under_fsdp(data_dir, tmp_path, one_process):
    """A run of one process (``ckpt.pt``, whole tensors) resumed on 2 ranks with ``fsdp``: its weights and
    optimizer state are sharded as the live ones, it trains on like one process and writes DCP."""
    runs = tmp_path / "runs"
    first = _run_worker(data_dir, runs, tmp_path / "one.pt", "single", ["hetero"], "stop_after=10", ranks=1)
    assert (runs / "hetero" / "ckpt.pt").exists()
    resumed = _run_worker(data_dir, runs, tmp_path / "two.pt", "resume", ["hetero"], "fsdp=true")["hetero"]
    assert all(torch.equal(resumed["start"][k], w) for k, w in first["hetero"]["weights"].items())
    reference = one_process["hetero"]
    assert max(abs(resumed["losses"][s] - reference["losses"][s]) for s in range(11, 21)) < LOSS_TOL
    dw = max(float((resumed["weights"][k] - w).abs().max()) for k, w in reference["weights"].items())
    assert dw < WEIGHT_TOL["solve"]
    assert json.loads((runs / "hetero" / "ckpt.dcp.json").read_text())["world_size"] == 2
    assert not (runs / "hetero" / "ckpt.pt").exists()


def test_a_rank_killed_mid_run_leaves_the_last_checkpoint_loadable(data_dir, tmp_path):
    """SIGKILL one rank of a 2-rank FSDP2 job once it has committed a checkpoint past step 10: the job
    dies; the last committed checkpoint verifies, loads and resumes (here in one process)."""
    root = tmp_path / "runs"
    keys = ["max_iters=400", "eval_interval=5", "diagnostics=false", "warmup_iters=2"]
    log = open(tmp_path / "job.log", "w")  # a file, not a pipe: a full pipe would stall the ranks
    args = [data_dir, str(root), str(tmp_path / "report.pt"), "fsdp", "adamw", *keys]
    job = subprocess.Popen(
        [*launch_command(2, fsdp_worker.__file__), *args],
        env=worker_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    manifest = root / "adamw" / "ckpt.dcp.json"
    try:
        deadline = time.monotonic() + 120
        while (
            time.monotonic() < deadline
            and (json.loads(manifest.read_text()) if manifest.exists() else {}).get("step", 0) < 10
        ):
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.2)
        os.kill(int((root / "rank1.pid").read_text()), signal.SIGKILL)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        log.close()
    assert job.returncode != 0
    committed = json.loads(manifest.read_text())
    assert committed["step"] >= 10 and committed["step"] % 5 == 0
    ckpt = load_checkpoint(root / "adamw")  # verified, whole tensors, no process group
    assert ckpt["step"] == committed["step"]
    assert all(bool(torch.isfinite(t).all()) for t in ckpt["model"].values())
    cfg = resume_config({"out_dir": str(root / "adamw"), "stop_after": committed["step"] + 3, "progress": False})
    status = train(cfg, resume=True, print_fn=lambda *a: None)
    assert status["status"] == "interrupted" and status["step"] == committed["step"] + 3


# ----------------------------------------------------------------------------- one process: DCP rules
def _dcp_run(data_dir, out, **keys):
    keys = {"fsdp": True, "max_iters": 10, "eval_interval": 5, **keys}
    cfg = fsdp_worker.worker_config(data_dir, str(out), "hetero", **keys)
    return train(cfg, print_fn=lambda *a: None)


def test_dcp_checkpoint_is_committed_last_and_verified(data_dir, tmp_path):
    """Without torchrun ``fsdp`` keeps the checkpoints DCP (so the run can go back to torchrun); a folder
    the manifest does not name (a save killed before its commit) is never loaded and is removed on resume;
    a committed file that changed is refused in one line naming it."""
    run = tmp_path / "run"
    assert _dcp_run(data_dir, run)["status"] == "finished"
    manifest = json.loads((run / "ckpt.dcp.json").read_text())
    assert manifest["step"] == 10 and [f"ckpt.dcp/{name}" for name in os.listdir(run / "ckpt.dcp")] == [
        manifest["folder"]
    ]  # the previous checkpoints deleted once this one was committed
    half = run / "ckpt.dcp" / "step-00000015"  # a save killed before its commit
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"torn")
    assert load_checkpoint(run)["step"] == 10
    folder = RunFolder(run)
    folder.open(resume=True)  # removes it
    folder.close()
    assert not half.exists()
    shard = run / manifest["folder"] / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__0_0.distcp is corrupted"):
        load_checkpoint(run)


def test_a_run_may_leave_fsdp_on_resume(data_dir, tmp_path):
    """``fsdp`` is not run-defining: a DCP run resumed without it loads the DCP checkpoint, records the
    change, writes ``ckpt.pt`` and deletes the DCP checkpoint (never two checkpoints of one run)."""
    run = tmp_path / "run"
    _dcp_run(data_dir, run, max_iters=14, stop_after=10)
    cfg = resume_config({"out_dir": str(run), "fsdp": False, "stop_after": 12, "progress": False})
    assert train(cfg, resume=True, print_fn=lambda *a: None)["step"] == 12
    assert load_checkpoint(run)["step"] == 12 and (run / "ckpt.pt").exists()
    assert not (run / "ckpt.dcp.json").exists() and not (run / "ckpt.dcp").exists()
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert history[-1]["step"] == 10 and history[-1]["changes"]["fsdp"] == {"old": True, "new": False}


def test_bucketed_reaches_the_optimizer(data_dir):
    from conftest import tiny_config

    from geomtrain.train import Trainer

    assert Trainer(tiny_config(data_dir, bucketed=False)).muon.bucketed is False
    assert Trainer(tiny_config(data_dir)).muon.bucketed is True


def test_fsdp_bad_values_are_one_line_errors(tmp_path, capsys):
    assert cli_main(["train", "--fsdp=maybe"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--fsdp" in err
    toml = tmp_path / "run.toml"
    toml.write_text('fsdp = "yes"\nbucketed = 1\n')
    with pytest.raises(ValueError, match="fsdp must be a bool; got 'yes'"):
        make_config(toml_path=toml)
    assert make_config({"fsdp": True, "bucketed": False}).fsdp is True


class _FullDisk:
    """DCP's file system writer on a disk with ``free`` bytes left: a write beyond them writes what fits and
    fails with ENOSPC, as the kernel does (no file name). Streams opened for reading are unaffected."""

    def __init__(self, monkeypatch, free: int):
        from torch.distributed.checkpoint.filesystem import FileSystem

        self.free, real = free, FileSystem.create_stream

        @contextlib.contextmanager
        def create_stream(fs, path, mode):
            with real(fs, path, mode) as stream:
                yield stream if "w" not in mode else _QuotaStream(self, stream)

        monkeypatch.setattr(FileSystem, "create_stream", create_stream)


class _QuotaStream:
    def __init__(self, disk: _FullDisk, stream):
        self._disk, self._stream = disk, stream

    def write(self, data):
        data = bytes(memoryview(data).cast("B"))
        fits = max(0, min(len(data), self._disk.free))
        self._stream.write(data[:fits])
        self._disk.free -= fits
        if fits < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return len(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@pytest.mark.parametrize("free", [0, 100_000])  # nothing written; a shard cut in the middle
def test_a_full_disk_during_a_dcp_save_is_one_line_and_keeps_the_committed_checkpoint(
    free, data_dir, tmp_path, monkeypatch, capsys
):
    """ENOSPC inside DCP's writer (it arrives as a ``CheckpointException``): exit 2 and one line naming the
    checkpoint folder, the partial folder removed, the status ``failed`` (not ``running``), the committed
    checkpoint intact; the resume once there is space again continues from it."""
    run = tmp_path / "run"
    _dcp_run(data_dir, run, max_iters=14, stop_after=10)
    committed = (run / "ckpt.dcp.json").read_bytes()
    folder = json.loads(committed)["folder"]
    disk = _FullDisk(monkeypatch, free)
    code = cli_main(["train", "--out-dir", str(run), "--resume", "--no-progress"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    assert "No space left on device" in err and str(run / "ckpt.dcp" / "step-00000014") in err
    assert disk.free == 0
    assert (run / "ckpt.dcp.json").read_bytes() == committed
    assert [f"ckpt.dcp/{d}" for d in os.listdir(run / "ckpt.dcp")] == [folder]
    assert not [p for p in os.listdir(run) if ".tmp." in p]
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "No space left on device" in status["error"]
    assert load_checkpoint(run)["step"] == 10
    cfg = resume_config({"out_dir": str(run), "progress": False})
    assert train(cfg, resume=True, print_fn=lambda *a: None)["status"] == "finished"
    assert load_checkpoint(run)["step"] == 14


@pytest.fixture(scope="module")
def dcp_stopped(data_dir, tmp_path_factory) -> Path:
    """A one-process ``fsdp`` run (DCP checkpoints) of 14 steps stopped at step 10: copy it to change it."""
    run = tmp_path_factory.mktemp("dcp-stopped") / "run"
    _dcp_run(data_dir, run, max_iters=14, stop_after=10)
    return run


def _tree(run: Path) -> dict[str, bytes]:
    """Every file under ``run`` (shards included) by relative path."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _one_line(argv, capsys) -> str:
    code = cli_main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err[-3000:]
    return err


@pytest.mark.parametrize("damage", ["torn", "deleted"])
def test_a_damaged_or_missing_dcp_manifest_is_refused_and_no_shard_is_deleted(
    damage, data_dir, dcp_stopped, tmp_path, capsys
):
    """``ckpt.dcp.json`` torn or deleted beside committed shards: ``--resume``, ``sample`` and ``eval`` (of the
    folder or of the manifest itself) refuse in one line naming ``ckpt.dcp.json`` (not ``ckpt.pt``), with advice
    that keeps the checkpoint (never "delete it"); the resume neither starts from step 0 nor deletes a shard.
    Following the advice (``geomtrain rebuild-manifest RUN``) resumes from step 10."""
    run = Path(shutil.copytree(dcp_stopped, tmp_path / "run"))
    manifest = run / "ckpt.dcp.json"
    if damage == "torn":
        manifest.write_text(manifest.read_text()[:40])
    else:
        manifest.unlink()
    before = _tree(run)
    for argv in (
        ["train", "--out-dir", run, "--resume", "--no-progress"],
        ["sample", run, "--max-new-tokens", "2"],
        ["eval", run, "--iters", "1"],
        ["eval", manifest, "--iters", "1"],
    ):
        err = _one_line(argv, capsys)
        assert str(manifest) in err and "ckpt.pt" not in err and "delete it" not in err, err
        assert "geomtrain rebuild-manifest" in err and "nothing was changed" in err, err
        assert _tree(run) == before, argv  # no shard deleted, nothing written
    with pytest.raises(CheckpointError, match="ckpt.dcp.json"):
        resume_config({"out_dir": str(run)})
    cfg = fsdp_worker.worker_config(data_dir, str(run), "hetero", fsdp=True, max_iters=14, eval_interval=5)
    with pytest.raises(CheckpointError, match="ckpt.dcp.json"):  # the library's resume: open, then load
        train(cfg, resume=True, print_fn=lambda *a: None)
    assert {k: v for k, v in _tree(run).items() if k.startswith("ckpt.dcp/")} == {
        k: v for k, v in before.items() if k.startswith("ckpt.dcp/")
    }
    assert cli_main(["rebuild-manifest", str(run)]) == 0  # the advice, as given
    assert "from step-00000010b" in capsys.readouterr().out
    printed = []
    status = train(resume_config({"out_dir": str(run), "progress": False}), resume=True, print_fn=printed.append)
    assert "resuming" in printed[0] and "from step 10" in printed[0] and status["step"] == 14


def test_a_save_killed_before_its_first_dcp_commit_still_starts_clean(data_dir, dcp_stopped, tmp_path):
    """No manifest and only an incomplete ``ckpt.dcp/`` folder (a first save killed while writing): nothing to
    resume from, the folder is removed and the run starts from step 0, as before."""
    run = Path(shutil.copytree(dcp_stopped, tmp_path / "run"))
    (run / "ckpt.dcp.json").unlink()
    for folder in (run / "ckpt.dcp").iterdir():
        (folder / ".metadata").unlink()  # DCP writes it once every rank's shards are complete
    printed = []
    status = train(resume_config({"out_dir": str(run), "progress": False}), resume=True, print_fn=printed.append)
    assert any("starting from step 0" in p for p in printed) and status["step"] == 14
    assert json.loads((run / "ckpt.dcp.json").read_text())["step"] == 14


def test_a_non_finite_correction_resumed_under_fsdp_starts_that_matrix_cold(data_dir, tmp_path):
    """A one-process run's ``ckpt.pt`` with an Inf in one matrix's carried ``correction``, resumed on 2 ranks with
    ``fsdp``: the sharded load (`settle_loaded`, agreed by both ranks) drops it, one note (rank 0) names the
    matrix, and the run trains to its end."""
    from fault_helpers import WORKER, rewrite_checkpoint

    run = tmp_path / "run"
    cfg = fsdp_worker.worker_config(data_dir, str(run), "hetero", max_iters=14, eval_interval=5, stop_after=10)
    train(cfg, print_fn=lambda *a: None)

    def poison(state):
        state["muon"]["state"][0]["correction"][3, 5] = float("inf")

    rewrite_checkpoint(run, poison)
    argv = [*launch_command(2, WORKER), "none", "train", "--out-dir", str(run), "--resume", "--fsdp", "--no-progress"]
    try:
        proc = subprocess.run(argv, env=worker_env(), capture_output=True, text=True, timeout=240)
    finally:
        kill_processes_of(run)  # a rank hung in a collective outlives torchrun
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stdout.splitlines() if "starts cold" in line]
    assert notes == [
        "note: ManifoldMuon: the saved warm-start state 'correction' of transformer.h.0.attn.c_attn.weight is not "
        "finite; that matrix starts cold"
    ], proc.stdout[-3000:]
    assert "from step 10" in proc.stdout and load_checkpoint(run)["step"] == 14
