"""Launching a test worker script on gloo CPU ranks under torchrun (or as one process), one torch thread per
rank, the repository on ``PYTHONPATH``: the one launcher of the distributed tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker_env() -> dict:
    """The environment of a worker: one torch thread, the repository importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def launch_command(ranks: int, script) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=RANKS SCRIPT``; ``ranks`` 1:
    ``python SCRIPT``."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    return [sys.executable, *torchrun, str(script)]


def run_ranks(ranks: int, script, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``script ARGS`` on ``ranks`` ranks to the end; a non-zero exit fails the test with its stderr's tail."""
    cmd = [*launch_command(ranks, script), *map(str, args)]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def processes_of(marker) -> list[int]:
    """The running processes whose command line names ``marker`` (a job's run folder: torchrun and its ranks;
    each rank runs in a session of its own and outlives torchrun when torchrun gives up on it)."""
    return [
        int(cmdline.parent.name)
        for cmdline in Path("/proc").glob("[0-9]*/cmdline")
        if str(marker).encode() in _read(cmdline) and _running(int(cmdline.parent.name))
    ]


def kill_processes_of(marker) -> None:
    """SIGKILL `processes_of` ``marker``: a hung rank must not outlive its test."""
    for pid in processes_of(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its parent does not)."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    return False


def _read(path: Path) -> bytes:
    with contextlib.suppress(OSError):
        return path.read_bytes()
    return b""
