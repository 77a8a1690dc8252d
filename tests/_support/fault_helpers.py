"""Shared setup of the fault-injection tests (tests/train/test_faults*.py, test_bad_input.py, test_run_lock.py).

A pytest plugin (``pytest_plugins = ["fault_helpers"]``), so its session fixtures are built once
for all those modules: one prepared ``classics`` folder, one uninterrupted reference run and one
run stopped after its first checkpoint. PYTEST_DONT_REWRITE: the modules import its helpers
before pytest loads it as a plugin. Every run is the ``tiny`` model with a 16-token context,
batch 4, 12 steps, a checkpoint (and an evaluation) every 4 steps.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geomtrain.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "fault_worker.py"
MAX_ITERS = 12
CHECKPOINT_EVERY = 4  # = eval_interval: a checkpoint at every evaluation (steps 4, 8, 12)


def run_args(data_dir, out_dir, *extra: str) -> list[str]:
    """``train`` arguments of the runs these tests compare (diagnostics on: their log is checked too)."""
    return [
        "train",
        "--model",
        "tiny",
        "--preset",
        "hetero",
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(out_dir),
        "--block-size",
        "16",
        "--batch-size",
        "4",
        "--max-iters",
        str(MAX_ITERS),
        "--warmup-iters",
        "2",
        "--eval-interval",
        str(CHECKPOINT_EVERY),
        "--eval-iters",
        "1",
        "--log-interval",
        "1",
        "--diag-batch-size",
        "1",
        "--no-progress",
        "--seed",
        "3",
        *extra,
    ]


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``geomtrain ARGV`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = cli_main([str(a) for a in argv])
    except SystemExit as exc:  # only a bug lets argparse exit: report the code, the test then fails on it
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def worker(fault: str, argv: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m geomtrain ARGV`` in a subprocess, with ``fault`` injected (tests/_support/fault_worker.py)."""
    return subprocess.run(
        [sys.executable, str(WORKER), fault, *map(str, argv)],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def worker_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    """Exit code 2 and stderr exactly one line ``geomtrain ...`` containing every needle."""
    lines = err.strip("\n").splitlines()
    assert code == 2, f"exit code {code}, stderr:\n{err[-3000:]}"
    assert len(lines) == 1, f"stderr has {len(lines)} lines:\n{err[-3000:]}"
    assert lines[0].startswith("geomtrain"), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


# ----------------------------------------------------------------------------- reading a run folder
def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def records(run, kind: str) -> list[dict]:
    return [r for r in metrics(run) if r["kind"] == kind]


def losses(run) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(run, "train")]


def assert_log_whole(run, last_step: int = MAX_ITERS) -> None:
    """metrics.jsonl: train steps 1..last_step once each, in order; eval steps unique; diagnostics
    steps = eval steps; every line valid JSON (``metrics`` would raise on a torn line)."""
    train_steps = [r["step"] for r in records(run, "train")]
    assert train_steps == list(range(1, last_step + 1)), f"train steps {train_steps}"
    eval_steps = [r["step"] for r in records(run, "eval")]
    assert eval_steps == list(range(CHECKPOINT_EVERY, last_step + 1, CHECKPOINT_EVERY)), f"eval steps {eval_steps}"
    diag = [json.loads(line)["step"] for line in (Path(run) / "diagnostics.jsonl").read_text().splitlines()]
    assert diag == eval_steps, f"diagnostics steps {diag}"


def assert_same_run(run, reference) -> None:
    """Step by step the same losses (exact), the same evaluations and the same final weights and
    optimizer state as the uninterrupted reference run. (Both must run the same code: a source
    file edited while the suite runs makes a later subprocess differ from the session's reference.)"""
    from geomtrain.train import load_checkpoint

    assert_log_whole(run)
    ours, theirs = losses(run), losses(reference)
    differ = [(a, b) for a, b in zip(ours, theirs) if a != b]
    assert not differ, f"{len(differ)} steps differ from the uninterrupted run; first (step, loss): {differ[0]}"
    assert [(r["step"], r["val_loss"]) for r in records(run, "eval")] == [
        (r["step"], r["val_loss"]) for r in records(reference, "eval")
    ], "evaluations differ"
    a, b = load_checkpoint(Path(run) / "ckpt.pt"), load_checkpoint(Path(reference) / "ckpt.pt")
    assert a["step"] == b["step"] == MAX_ITERS, (a["step"], b["step"])
    for part in ("model", "adamw", "muon"):
        pa, pb = tensors_of(a[part]), tensors_of(b[part])
        assert pa.keys() == pb.keys(), part
        for name in pa:
            assert torch.equal(pa[name], pb[name]), f"{part}: {name}"


def tensors_of(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside nested dicts/lists (a state dict, an optimizer state), by path."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors_of(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensors_of(v, f"{prefix}/{i}"))
    return out


def assert_all_finite(*state_dicts) -> int:
    """Every floating tensor finite; returns how many were checked (so a test can see it checked any)."""
    n = 0
    for sd in state_dicts:
        for name, t in tensors_of(sd).items():
            if t.is_floating_point():
                assert torch.isfinite(t).all(), f"non-finite values in {name}"
                n += 1
    return n


def snapshot(run) -> dict[str, bytes]:
    """The bytes of every file in a run folder (to show a refused command changed nothing)."""
    return {p.name: p.read_bytes() for p in sorted(Path(run).iterdir()) if p.is_file()}


def temp_files(run) -> list[str]:
    return sorted(p.name for p in Path(run).iterdir() if ".tmp." in p.name)


def rewrite_checkpoint(run, change) -> None:
    """``change(state)`` applied to ``run/ckpt.pt``, saved back with ``ckpt.json``'s sha256 to match: a checkpoint
    that verifies (as if saved so), not a corrupted file."""
    run = Path(run)
    state = torch.load(run / "ckpt.pt", weights_only=False)
    change(state)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    (run / "ckpt.pt").write_bytes(data)
    manifest = json.loads((run / "ckpt.json").read_text())
    manifest.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (run / "ckpt.json").write_text(json.dumps(manifest))


# ----------------------------------------------------------------------------- session fixtures
# ``data_dir`` (the prepared classics folder, shared read-only: copy it to modify it) is conftest's.
@pytest.fixture
def data_copy(data_dir, tmp_path) -> Path:
    """A private copy of the prepared folder, free to corrupt."""
    return Path(shutil.copytree(data_dir, tmp_path / "data-copy"))


@pytest.fixture(scope="session")
def reference(data_dir, tmp_path_factory) -> Path:
    """The uninterrupted run every faulted run is compared with."""
    out = tmp_path_factory.mktemp("fault-ref") / "run"
    assert cli_main(run_args(data_dir, out)) == 0
    return out


@pytest.fixture(scope="session")
def stopped_at_4(data_dir, tmp_path_factory) -> Path:
    """The same run stopped after its first checkpoint (step 4): copy it with `stopped_run`."""
    out = tmp_path_factory.mktemp("fault-stopped") / "run"
    assert cli_main(run_args(data_dir, out, "--stop-after", str(CHECKPOINT_EVERY))) == 130
    return out


@pytest.fixture
def stopped_run(stopped_at_4, tmp_path) -> Path:
    """A private copy of the run stopped at step 4 (checkpoint at 4, metrics up to 4)."""
    return Path(shutil.copytree(stopped_at_4, tmp_path / "run"))


# ----------------------------------------------------------------------------- a failing disk
class FailingDisk:
    """``builtins.open`` replacement for files under ``root``: opening for writing fails with
    EROFS (``readonly``), or every write beyond ``free`` bytes writes what fits and fails with
    ENOSPC (a full disk: the kernel's error carries no file name). Reading is unaffected."""

    def __init__(self, root, *, readonly: bool = False, free: int | None = None):
        self.root, self.readonly, self.free = Path(root).resolve(), readonly, free
        self.real_open = open
        self.failures = 0

    def open(self, file, mode="r", *args, **kwargs):
        if (
            isinstance(file, (str, os.PathLike))
            and any(c in mode for c in "wax+")
            and Path(os.path.abspath(file)).is_relative_to(self.root)
        ):
            if self.readonly:
                self.failures += 1
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(file))
            if self.free is not None:
                return _QuotaFile(self, self.real_open(file, mode, *args, **kwargs))
        return self.real_open(file, mode, *args, **kwargs)


class _QuotaFile:
    def __init__(self, disk: FailingDisk, fh):
        self._disk, self._fh = disk, fh

    def write(self, data):
        fits = max(0, min(len(data), self._disk.free))
        if fits < len(data):
            self._fh.write(data[:fits])
            self._fh.flush()
            self._disk.free -= fits
            self._disk.failures += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.free -= len(data)
        return self._fh.write(data)

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


def isfinite_number(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
