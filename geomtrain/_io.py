"""The one place for file I/O every part of `geomtrain` shares.

- atomic writes: ``atomic_write_bytes`` / ``atomic_write_text`` / ``atomic_write_json`` /
  ``atomic_torch_save`` write a temporary file in the same folder, fsync it, rename it over the
  target and fsync the folder: a reader sees the old file or the new one, never half of one.
  ``writable_output`` checks where a long job will write before the job starts.
- JSON: ``to_jsonable`` (tensors, numpy scalars and paths to plain values; non-finite floats to
  ``None``), ``read_json`` (``default`` when missing or unreadable).
- JSONL: ``append_jsonl`` (one record a line, flushed) and ``read_jsonl``, which tolerates a torn
  *last* line (a run killed mid-write) and reports any other bad line with its file and number.
- ``sha256_file``; ``environment_record``: versions, machine, threads, git commit, command line.
- ``FileLock``: an exclusive, kernel-held lock on a file (one run per run folder, one claim per
  study run); a dead holder never blocks it.

Private to the package: modules of `geomtrain` import it; users never need to.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_torch_save",
    "writable_output",
    "to_jsonable",
    "read_json",
    "append_jsonl",
    "read_jsonl",
    "truncate_jsonl",
    "sha256_file",
    "git_commit",
    "environment_record",
    "fsync_dir",
    "naming_file",
    "FileLock",
]


# ----------------------------------------------------------------------------- atomic writes
def fsync_dir(path: Path) -> None:
    """fsync a folder so that a rename inside it survives a power cut (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
    """``write(fh)`` into a temporary binary file beside ``path``, fsync, rename over ``path``.

    On any error (a full disk, a read-only folder, an exception in ``write``) the temporary file
    is removed, ``path`` is untouched and the error propagates."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise naming_file(exc, path) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def naming_file(exc: OSError, path: str | os.PathLike) -> OSError:
    """``exc`` with ``path`` as its file name: a full disk's ENOSPC names no file, and a failed
    temporary file should be reported as the file the user knows (``ckpt.pt``, not ``.ckpt.pt.tmp.123``)."""
    if exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror or str(exc), os.fspath(path))  # OSError() picks the subclass from errno


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any, compact: bool = False) -> None:
    """``obj`` (made JSON-ready by `to_jsonable`) as indented JSON, or one line with ``compact``."""
    obj = to_jsonable(obj)
    text = json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj, indent=2)
    atomic_write_text(path, text + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    import torch

    atomic_write(path, lambda fh: torch.save(obj, fh))


def writable_output(path: str | os.PathLike, folder: bool = False) -> Path:
    """Make ``path``'s folder (``path`` itself with ``folder``) and check that it can be written, before a
    long job whose result goes there (a benchmark's JSON written after minutes of timing); raises an
    OSError naming the path instead of losing the job's result at the end."""
    path = Path(path)
    where = path if folder else path.parent
    if not folder and path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a folder, not a file", os.fspath(path))
    try:
        where.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file where a folder of the path should be
        raise NotADirectoryError(
            errno.ENOTDIR, "cannot make this folder: a file is in its path", os.fspath(where)
        ) from None
    if not os.access(where, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "folder not writable", os.fspath(where))
    return path


# ----------------------------------------------------------------------------- JSON and JSONL
def to_jsonable(obj: Any) -> Any:
    """A JSON-ready copy: tensors become numbers or lists, numpy scalars numbers, paths strings,
    non-finite floats ``None`` (JSON has no NaN)."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if callable(getattr(obj, "numel", None)) and obj.numel() == 1:  # a one-element tensor is a number
        return to_jsonable(obj.item())
    if hasattr(obj, "tolist") and callable(obj.tolist):  # torch tensors, numpy arrays and scalars
        return to_jsonable(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON record as a line (flushed; the file is created if missing)."""
    try:
        with open(path, "a") as fh:
            fh.write(json.dumps(to_jsonable(record)) + "\n")
            fh.flush()
    except OSError as exc:
        raise naming_file(exc, path) from exc


def read_jsonl(path: str | os.PathLike, repair: bool = False) -> list[dict]:
    """The records of a JSONL file ([] when it does not exist).

    A torn last line (no trailing newline and not valid JSON: a process killed while writing) is
    dropped with a warning; with ``repair`` it is also cut from the file. A bad line anywhere else
    raises ``ValueError`` naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    out, good_end, offset = [], 0, 0
    for number, raw in enumerate(lines, 1):
        end = offset + len(raw) + 1
        if raw.strip():
            try:
                out.append(json.loads(raw))
            except ValueError:
                if number == len(lines):  # the last line, no newline after it: torn
                    warnings.warn(f"{path}: dropped a torn last line ({len(raw)} bytes)", RuntimeWarning, stacklevel=2)
                    if repair:
                        with open(path, "r+b") as fh:
                            fh.truncate(good_end)
                    break
                raise ValueError(f"{path}: line {number} is not valid JSON") from None
        good_end = min(end, len(data))
        offset = end
    return out


def truncate_jsonl(path: str | os.PathLike, step: int) -> None:
    """Keep only the records with ``step <= step`` (and repair a torn last line): a resumed run
    rewrites the rest identically."""
    path = Path(path)
    if not path.exists():
        return
    keep = [r for r in read_jsonl(path, repair=True) if r.get("step", 0) <= step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- environment
# the folders whose untracked files are code (a new module); elsewhere an untracked file is output or data
CODE_FOLDERS = ("geomtrain", "manifolds")


def git_commit(root: Path | None = None) -> dict:
    """``{"commit", "dirty"}`` of the checkout at ``root`` (default: the one this package runs from;
    ``None`` outside git). Dirty: a tracked file changed, or an untracked file in the package folders
    (the run folders, reports and data a study writes into its checkout leave it clean)."""
    root = root or Path(__file__).resolve().parent.parent
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=5).stdout.strip()  # noqa: E731
        commit = run("rev-parse", "HEAD")
        if not commit:
            return {"commit": None, "dirty": None}
        changed = run("status", "--porcelain", "--untracked-files=no") or run(
            "status", "--porcelain", "--", *CODE_FOLDERS
        )
        return {"commit": commit, "dirty": bool(changed)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def environment_record(device: Any = "cpu", **extra: Any) -> dict:
    """What a result needs to be reproduced: versions, machine, threads, device, float32 matmul
    precision (this process's global setting), git, argv.

    ``extra`` (e.g. ``seed=``; the trainer adds ``tf32``, its model passes' setting) is merged in."""
    import numpy as np
    import torch
    import torch.distributed as dist

    try:
        import geoopt

        geoopt_version = geoopt.__version__
    except ImportError:  # pragma: no cover - a dependency
        geoopt_version = None
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "geoopt": geoopt_version,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "device": str(device),
        "argv": sys.argv,
        "git": git_commit(),
        "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
    }
    try:  # "highest": IEEE float32 matmuls; "high": TF32 allowed (on CUDA)
        info["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch >= 2.9 refuses to answer once its legacy and new TF32 settings disagree
        info["float32_matmul_precision"] = None
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(torch.device(device))
    info.update(extra)
    return info


# ----------------------------------------------------------------------------- locks
class FileLock:
    """An exclusive lock on the file ``path``, held by this process until `release`.

    ``fcntl.flock`` on the open file: taking it is atomic (of processes released at the same
    instant exactly one wins) and the kernel drops it when the holder dies, so a killed holder
    never blocks the next one. The holder writes its PID into the file and deletes the file on
    release; a file that still names a PID when the lock is taken was left by a killed holder,
    reported in ``took_over``. Local file systems only (flock on NFS is not reliable)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.took_over: int | None = None  # the PID of a dead holder whose lock file was taken over
        self._fd: int | None = None

    def __repr__(self) -> str:
        return f"FileLock({str(self.path)!r}, held={self.held})"

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> int | None:
        """Take the lock: ``None`` on success, else the holder's PID (``-1`` if it cannot be read).
        ``OSError`` when the file cannot be created (a missing or read-only folder)."""
        if self._fd is not None:
            return None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return self._holder_pid()
            if self._same_file(fd):
                break
            os.close(fd)  # released (and deleted) between our open and flock: lock the new file
        old = os.read(fd, 32).decode(errors="replace").strip()
        self.took_over = int(old) if old.isdigit() and int(old) != os.getpid() else None
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return None

    def _same_file(self, fd: int) -> bool:
        try:
            on_disk, ours = os.stat(self.path), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (on_disk.st_dev, on_disk.st_ino) == (ours.st_dev, ours.st_ino)

    def _holder_pid(self) -> int:
        for _ in range(20):  # a holder that has just taken the lock writes its PID a moment later
            try:
                text = self.path.read_text().strip()
            except OSError:
                text = ""
            if text.isdigit():
                return int(text)
            time.sleep(0.005)
        return -1

    def live_holder(self) -> int | None:
        """The PID of the process holding the lock now (``-1`` if unreadable), else ``None``."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.getpid() if self._fd is not None else self._holder_pid()
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def release(self) -> None:
        """Delete the lock file and drop the lock (a no-op when not held)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding it: no one can take a file we delete
        finally:
            os.close(self._fd)
            self._fd = None
